"""Oracle test: random upserts and deletes, commit after commit, in every merge mode.

After every commit the merged snapshot (`nbcc.Table.read()`) must equal a reference that this
module computes on its own, in plain Python: one dict per record key, folded record by record in
log order (commit order, then row order inside a commit). Nothing here asks the code under test
what the answer should be.

Semantics the reference implements (issue 2 and connector/nbcc/merge.py's docstring):
- event_time: the greatest ordering value wins; ties go to the later record in log order.
- commit_time: the later record in log order wins (ordering values are ignored).
- partial_update: the non-null columns of a later record (by ordering value, then log order)
  overwrite earlier ones.
- A delete with an ordering value (an upsert row with `_nbcc_is_deleted` = true) obeys the same
  ordering rule; a delete with no ordering value (`operation="delete"` with keys only, or any
  delete when there is no ordering) wins over everything earlier in log order and loses to
  everything later.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pytest

import nbcc

DELETED = "_nbcc_is_deleted"
DATA_COLS = ("a", "b", "c")  # the non-key payload columns (ts is separate)


@dataclass(frozen=True)
class Case:
    name: str
    merge_mode: str
    ordering: bool  # the table has ordering_field="ts"
    partitioned: bool = False
    composite: bool = False
    buckets: int = 3
    max_log_file_bytes: int | None = None
    storage: str = "memory"
    rows_per_commit: tuple[int, int] = (12, 30)
    key_pool: int = 30
    commits: int = 8


CASES = [
    Case("event_time", "event_time", True),
    Case("event_time-partitioned-local", "event_time", True, partitioned=True, storage="local"),
    Case("event_time-composite-key", "event_time", True, composite=True, buckets=4),
    Case("event_time-tiny-log-files", "event_time", True, buckets=2, max_log_file_bytes=1500,
         rows_per_commit=(60, 90), key_pool=40, storage="local"),
    Case("commit_time", "commit_time", False),
    Case("commit_time-with-ordering-column", "commit_time", True, partitioned=True),
    Case("partial_update-ordering", "partial_update", True),
    Case("partial_update-ordering-partitioned-composite", "partial_update", True, partitioned=True,
         composite=True, storage="local"),
    Case("partial_update-no-ordering", "partial_update", False, buckets=2),
    Case("partial_update-tiny-log-files", "partial_update", True, buckets=1, max_log_file_bytes=1500,
         rows_per_commit=(60, 90), key_pool=25),
]


# -- the reference -----------------------------------------------------------------------------

class Reference:
    """Folds records in log order into the expected snapshot, one dict per record key."""

    def __init__(self, merge_mode: str, uses_ordering: bool, columns: list[str]):
        self.mode = merge_mode
        self.uses_ordering = uses_ordering and merge_mode != "commit_time"
        self.columns = columns
        self.seq = 0  # global log position
        # event_time / commit_time: key -> (ordering, row or None for an ordered delete)
        # partial_update: key -> {"top": (ord, seq, is_delete), "barrier": (ord, seq) | None,
        #                         "cols": {name: (ord, seq, value)}}
        self.state: dict[tuple, Any] = {}

    def apply(self, key: tuple, row: dict[str, Any], is_delete: bool, ordering: Any) -> None:
        self.seq += 1
        if is_delete and (ordering is None or not self.uses_ordering):
            # A delete with no ordering value: everything earlier is gone, anything later wins.
            self.state.pop(key, None)
            return
        if self.mode == "commit_time":
            self.state[key] = (None, None if is_delete else dict(row))
        elif self.mode == "event_time":
            cur = self.state.get(key)
            if cur is None or ordering >= cur[0]:  # ties: the later record wins
                self.state[key] = (ordering, None if is_delete else dict(row))
        else:
            rank = (ordering if self.uses_ordering else 0, self.seq)
            s = self.state.setdefault(key, {"top": None, "barrier": None, "cols": {}})
            if is_delete:
                if s["barrier"] is None or rank > s["barrier"]:
                    s["barrier"] = rank
            else:
                for name, value in row.items():
                    if value is not None:
                        old = s["cols"].get(name)
                        if old is None or rank > old[0]:
                            s["cols"][name] = (rank, value)
            if s["top"] is None or rank > s["top"][0]:
                s["top"] = (rank, is_delete)

    def snapshot(self) -> list[dict[str, Any]]:
        out = []
        for key in sorted(self.state):
            s = self.state[key]
            if self.mode != "partial_update":
                if s[1] is not None:
                    out.append({c: s[1].get(c) for c in self.columns})
                continue
            if s["top"] is None or s["top"][1]:
                continue  # the latest record (by ordering, then log order) is a delete
            barrier = s["barrier"]
            row = {}
            for c in self.columns:
                got = s["cols"].get(c)
                row[c] = got[1] if got is not None and (barrier is None or got[0] > barrier) else None
            out.append(row)
        return out


# -- data generation ---------------------------------------------------------------------------

def _key_cols(case: Case) -> list[str]:
    return ["id", "sub"] if case.composite else ["id"]


def _schema(case: Case) -> pa.Schema:
    fields = [pa.field("id", pa.int64())]
    if case.composite:
        fields.append(pa.field("sub", pa.string()))
    if case.partitioned:
        fields.append(pa.field("region", pa.string()))
    fields += [pa.field("ts", pa.int64()), pa.field("a", pa.string()), pa.field("b", pa.int64()),
               pa.field("c", pa.string())]
    return pa.schema(fields)


def _key_values(case: Case, rng: random.Random) -> dict[str, Any]:
    k = rng.randrange(case.key_pool)
    vals: dict[str, Any] = {"id": k * 7 - 50}  # negative ids too
    if case.composite:
        vals["sub"] = rng.choice(["x", "y", "zé"])
    if case.partitioned:
        # The partition is a function of the key: keys are unique within a partition.
        vals["region"] = f"r/{(k * 7 - 50) % 3}" if (k % 2) else f"r {(k * 7 - 50) % 3}"
    return vals


def _key_tuple(case: Case, row: dict[str, Any]) -> tuple:
    return tuple(row[c] for c in _key_cols(case))


def _upsert_rows(case: Case, rng: random.Random, commit: int, with_flag: bool) -> list[dict[str, Any]]:
    n = rng.randint(*case.rows_per_commit)
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        if rows and rng.random() < 0.15:
            # The same key again inside this commit, sometimes with the very same ordering value.
            prev = rows[rng.randrange(len(rows))]
            row = {c: prev[c] for c in _key_cols(case) + (["region"] if case.partitioned else [])}
            ts = prev["ts"] if prev["ts"] is None or rng.random() < 0.6 else prev["ts"] + rng.randint(-3, 3)
        else:
            row = _key_values(case, rng)
            # Later commits usually carry greater values, but often not; ties happen.
            ts = commit * 5 + rng.randint(-12, 6)
        row["ts"] = ts
        tag = f"c{commit}r{len(rows)}"
        row["a"], row["b"], row["c"] = f"a-{tag}", commit * 1000 + len(rows), f"c-{tag}"
        if rng.random() < 0.4:  # a partial row: some payload columns left null
            for col in rng.sample(DATA_COLS, rng.randint(1, len(DATA_COLS))):
                row[col] = None
        if not case.ordering and rng.random() < 0.2:
            row["ts"] = None  # without an ordering field ts is plain data
        if with_flag:
            row[DELETED] = rng.random() < 0.2
        rows.append(row)
    return rows


def _table_of(rows: list[dict[str, Any]], schema: pa.Schema, extra: list[pa.Field] = ()) -> pa.Table:
    target = pa.schema(list(schema) + list(extra))
    return pa.Table.from_pylist(rows, schema=target)


def _open_table(case: Case, tmp_path, memory_uri: str) -> nbcc.Table:
    uri = memory_uri if case.storage == "memory" else str(tmp_path / "table")
    return nbcc.Table.create(
        uri, _schema(case), _key_cols(case),
        ordering_field="ts" if case.ordering else None,
        partition_by=["region"] if case.partitioned else (),
        buckets=case.buckets, merge_mode=case.merge_mode,
    )


def _sorted_read(table: nbcc.Table, case: Case) -> list[dict[str, Any]]:
    got = table.read()
    assert got.column_names == _schema(case).names
    return sorted(got.to_pylist(), key=lambda r: _key_tuple(case, r))


# -- the test ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_snapshot_matches_reference_after_every_commit(case: Case, tmp_path, memory_uri):
    rng = random.Random(f"nbcc-oracle-{case.name}")
    table = _open_table(case, tmp_path, memory_uri)
    schema = _schema(case)
    ref = Reference(case.merge_mode, case.ordering, schema.names)
    instants: list[str] = []
    saw = {"flag_delete": 0, "key_delete": 0, "upsert": 0}
    key_names = _key_cols(case) + (["region"] if case.partitioned else [])
    known: dict[tuple, dict[str, Any]] = {}  # key -> its key (and partition) column values

    def check(step: str) -> None:
        expected = ref.snapshot()
        # Re-open too: a fresh reader sees exactly what the writer's handle sees.
        for t in (table, nbcc.Table.open(table.uri)):
            got = _sorted_read(t, case)
            assert got == expected, f"snapshot differs from the reference after {step}"
        # Filters on a key column select whole keys and are applied before the merge; a filter
        # on another column only after it (an older version may match where the winner does not).
        ids = sorted({r["id"] for r in expected})
        pick = random.Random(step)  # its own generator: the written data stays as it was
        wanted = set(pick.sample(ids, min(3, len(ids)))) | {10**6}  # and a key that never exists
        cut = ids[len(ids) // 2] if ids else 0
        for flt, keep in [([("id", "in", sorted(wanted))], lambda r: r["id"] in wanted),
                          ([("id", "<", cut)], lambda r: r["id"] < cut),
                          ([("id", ">=", cut), ("b", ">", 2000)], lambda r: r["id"] >= cut and (r["b"] or 0) > 2000)]:
            got = sorted(table.read(filter=flt).to_pylist(), key=lambda r: _key_tuple(case, r))
            assert got == [r for r in expected if keep(r)], f"read with filter {flt} after {step}"
        # A read of some columns reads only those from the files (and what the merge needs),
        # with a filter on a column it does not return.
        columns = ["b"] + _key_cols(case)
        for flt, keep in [(None, lambda r: True), ([("a", ">=", "a-c3")], lambda r: r["a"] is not None and r["a"] >= "a-c3")]:
            got = table.read(columns=columns, filter=flt)
            assert got.column_names == columns
            assert sorted(got.to_pylist(), key=lambda r: _key_tuple(case, r)) == [
                {c: r[c] for c in columns} for r in expected if keep(r)], f"read of {columns} ({flt}) after {step}"

    for commit in range(case.commits):
        with_flag = commit % 2 == 1 or commit == case.commits - 1
        rows = _upsert_rows(case, rng, commit, with_flag)
        data = _table_of(rows, schema, [pa.field(DELETED, pa.bool_())] if with_flag else [])
        if case.max_log_file_bytes:
            # A stream of small batches (as Spark hands them over), which rolls over to several
            # versions of one file group, so that a repeated key can span versions.
            data = pa.RecordBatchReader.from_batches(data.schema, data.to_batches(max_chunksize=8))
        instants.append(table.write(data, max_log_file_bytes=case.max_log_file_bytes))
        for row in rows:
            is_delete = bool(row.get(DELETED))
            saw["flag_delete" if is_delete else "upsert"] += 1
            payload = {c: row.get(c) for c in schema.names}
            ref.apply(_key_tuple(case, row), payload, is_delete, row["ts"] if case.ordering else None)
            known[_key_tuple(case, row)] = {c: row[c] for c in key_names}
        check(f"upsert commit {commit}")

        if commit % 3 == 2:
            # Keys only (plus the partition column): no ordering value. Some keys may not exist.
            keys = [_key_values(case, rng) for _ in range(rng.randint(2, 5))]
            live = [k for k in sorted(ref.state) if k in known]
            keys += [dict(known[k]) for k in rng.sample(live, min(4, len(live)))]
            rng.shuffle(keys)
            key_schema = pa.schema([f for f in schema if f.name in key_names])
            instants.append(table.write(_table_of(keys, key_schema), operation="delete",
                                        max_log_file_bytes=case.max_log_file_bytes))
            for k in keys:
                saw["key_delete"] += 1
                ref.apply(_key_tuple(case, k), dict(k), True, None)
            check(f"delete commit after upsert commit {commit}")

    # The data exercised what it should: deletes of both kinds, and something still alive.
    assert saw["flag_delete"] > 0 and saw["key_delete"] > 0 and saw["upsert"] > 0
    assert ref.snapshot(), "the reference ended empty: the data would not catch much"

    # One completed deltacommit per write, in write order, completion after instant.
    timeline = table.timeline()
    assert [i.instant for i in timeline] == instants
    assert len(set(instants)) == len(instants)
    for i in timeline:
        assert (i.action, i.state) == ("deltacommit", "completed")
        assert i.completion is not None and i.completion > i.instant
    # Sequential writes: each commit completed before the next one started.
    for prev, nxt in zip(timeline, timeline[1:]):
        assert prev.completion < nxt.instant

    if case.max_log_file_bytes:
        # Tiny log files: at least one file group rolled over to a second version in one commit.
        names = [n for s in table.file_slices() for n in s.log_files]
        versions = [int(re.search(r"\.log\.(\d+)_", n).group(1)) for n in names]
        assert max(versions) >= 2, names
    if case.partitioned:
        parts = {s.partition for s in table.file_slices()}
        assert len(parts) > 1 and all(p.startswith("region=") for p in parts), parts


def test_one_big_table_write_rolls_over_to_several_log_file_versions(tmp_path):
    """`max_log_file_bytes` bounds log files however the rows arrive: one pyarrow Table written
    through the Python API rolls over like Spark's stream of batches does."""
    limit = 20_000
    table = nbcc.Table.create(str(tmp_path / "t"), pa.schema([("id", pa.int64()), ("ts", pa.int64()),
                                                              ("a", pa.string())]),
                              "id", ordering_field="ts", buckets=1)
    n = 20_000
    rng = random.Random(7)
    data = pa.table({"id": list(range(n)), "ts": [rng.randrange(10**9) for _ in range(n)],
                     "a": [f"{rng.getrandbits(64):016x}" for _ in range(n)]})
    table.write(data, max_log_file_bytes=limit)

    files = sorted((tmp_path / "t").glob("*.log.*"))
    sizes = {f.name: f.stat().st_size for f in files}
    assert sum(sizes.values()) > 4 * limit  # the data really is several limits' worth
    versions = sorted(int(re.search(r"\.log\.(\d+)_", name).group(1)) for name in sizes)
    assert versions == list(range(1, len(versions) + 1))
    assert len(versions) >= 3, sizes
    assert all(size <= 2 * limit for size in sizes.values()), sizes
    got = table.read().sort_by("id")
    assert got.column("id").to_pylist() == list(range(n))
    assert got.column("a").to_pylist() == data.column("a").to_pylist()
