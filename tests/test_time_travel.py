"""Reads across time (issue 3) through the Python API: time travel (`as_of`), incremental
(`latest_state` and `cdc`), read-optimized reads and meta columns.

The main test runs random workloads from several concurrent writers, with compactions
interleaved, in every merge mode, and compares every read with a reference that this module
computes on its own, in plain Python, from what each writer wrote:

- the state as of T is made of the data commits whose COMPLETION time is <= T;
- their records are applied in LOG ORDER: by the commit's INSTANT (not its completion), then
  row order inside the commit (RFC-66; issue 2: "Log order: by instant, then version, then token");
- per record key (issue 2 and connector/nbcc/merge.py's docstring):
  * a delete with no ordering value (every delete in `commit_time` mode or without an
    ordering field, a key-only `operation="delete"`, a `_nbcc_is_deleted` row whose ordering
    value is null) wins over everything earlier in log order and loses to everything later;
  * otherwise records rank by (ordering value, log position) (`commit_time`: log position only);
  * `event_time` / `commit_time`: the top-ranked record wins; if it is a delete the key is gone;
  * `partial_update`: records up to the last-ranked delete are dropped; each column takes the
    value of the last-ranked record where it is not null; if the top record is a delete the key
    is gone.

Nothing here asks the code under test what an answer should be: commits, instants and
completion times come from the writers and the timeline; the expected rows come from the fold.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

import pyarrow as pa
import pytest

import nbcc
import nbcc.writer
from nbcc.scan import iter_plan
from nbcc.view import table_schema
from nbcc.schema import schema_to_json
from nbcc.timeline import Instant

DELETED = "_nbcc_is_deleted"
BEFORE_ALL = "0" * 17
META = ["_nbcc_commit_time", "_nbcc_completion_time", "_nbcc_record_key", "_nbcc_partition",
        "_nbcc_file_group"]


# -- times -------------------------------------------------------------------------------------

def _dt(t: str) -> datetime:
    return datetime.strptime(t[:14], "%Y%m%d%H%M%S").replace(tzinfo=timezone.utc) + timedelta(
        milliseconds=int(t[14:]))


def _t(d: datetime) -> str:
    return d.strftime("%Y%m%d%H%M%S") + f"{d.microsecond // 1000:03d}"


def shift(t: str, ms: int) -> str:
    return _t(_dt(t) + timedelta(milliseconds=ms))


def iso_z(t: str) -> str:
    return _dt(t).strftime("%Y-%m-%dT%H:%M:%S.") + t[14:] + "Z"


def iso_offset(t: str) -> str:
    """The same moment written in +02:00."""
    d = _dt(t).astimezone(timezone(timedelta(hours=2)))
    return d.strftime("%Y-%m-%d %H:%M:%S.") + t[14:] + "+02:00"


def parse_any(text: str) -> str:
    """A 17-digit time or one of the ISO forms above, as a 17-digit UTC time (test-side)."""
    if len(text) == 17 and text.isdigit():
        return text
    d = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return _t(d.replace(tzinfo=timezone.utc) if d.tzinfo is None else d.astimezone(timezone.utc))


def iso_naive(t: str) -> str:
    return _dt(t).strftime("%Y-%m-%dT%H:%M:%S.") + t[14:]


def file_group(bucket: int) -> str:
    return f"{bucket:08d}-0000-0000-0000-000000000000"


# -- the reference -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Rec:
    key: int
    row: dict[str, Any]  # the written values of every table column (None where not written)
    is_delete: bool
    ordering: Any  # the ordering value (None when the table has no ordering field or it is null)


class Model:
    """The expected table at any time, from the commits' records, instants and completions."""

    def __init__(self, merge_mode: str, has_ordering: bool, columns: list[str], key: str = "id"):
        self.mode = merge_mode
        self.ordered = has_ordering and merge_mode != "commit_time"
        self.columns = columns
        self.key = key
        self.commits: dict[str, tuple[str, list[Rec]]] = {}  # instant -> (completion, records)
        self.compactions: list[tuple[str, str]] = []  # (instant, completion), for failure messages only

    def add(self, instant: str, completion: str, records: list[Rec]) -> None:
        self.commits[instant] = (completion, records)

    def _natural(self, r: Rec) -> bool:
        return r.is_delete and (not self.ordered or r.ordering is None)

    def resolve(self, recs: list[Rec]) -> dict[str, Any] | None:
        """One key's records in log order -> its row, or None if it does not exist."""
        cut = max((p for p, r in enumerate(recs) if self._natural(r)), default=None)
        if cut is not None:
            recs = recs[cut:]  # everything before the last unordered delete is gone

        def rank(p: int) -> tuple:
            r = recs[p]
            if not self.ordered:
                return (p,)
            if self._natural(r):
                return (0, 0, p)  # only ever the first record here: below all later records
            return (1, r.ordering, p)

        seq = [recs[p] for p in sorted(range(len(recs)), key=rank)]
        top = seq[-1]
        if top.is_delete:
            return None
        if self.mode != "partial_update":
            return dict(top.row)
        last_delete = max((i for i, r in enumerate(seq) if r.is_delete), default=-1)
        after = seq[last_delete + 1:]
        out = {}
        for c in self.columns:
            values = [r.row.get(c) for r in after if r.row.get(c) is not None]
            out[c] = values[-1] if values else None
        return out

    def state(self, when: str) -> dict[int, dict[str, Any]]:
        per_key: dict[int, list[Rec]] = defaultdict(list)
        for instant in sorted(i for i, (c, _) in self.commits.items() if c <= when):  # LOG ORDER
            for r in self.commits[instant][1]:
                per_key[r.key].append(r)
        out = {}
        for k, recs in per_key.items():
            row = self.resolve(recs)
            if row is not None:
                out[k] = row
        return out

    def winner_instant(self, when: str) -> dict[int, str]:
        """event_time: per live key, the instant of the commit whose record won."""
        assert self.mode == "event_time"
        tagged: dict[int, list[tuple[Rec, str]]] = defaultdict(list)
        for instant in sorted(i for i, (c, _) in self.commits.items() if c <= when):
            for r in self.commits[instant][1]:
                tagged[r.key].append((r, instant))
        out = {}
        for k, pairs in tagged.items():
            best = None
            for r, instant in pairs:  # unique ordering values in the tests that use this
                if r.is_delete and r.ordering is None:
                    best = None
                elif best is None or r.ordering >= best[0].ordering:
                    best = (r, instant)
            if best is not None and not best[0].is_delete:
                out[k] = best[1]
        return out

    def changed(self, begin: str, end: str) -> dict[int, str]:
        """key -> greatest completion among the data commits in (begin, end] that wrote it."""
        out: dict[int, str] = {}
        for _, (completion, recs) in self.commits.items():
            if begin < completion <= end:
                for r in recs:
                    out[r.key] = max(out.get(r.key, completion), completion)
        return out


# -- comparing reads with the reference ----------------------------------------------------------

def rows_by_key(table: pa.Table, key: str = "id") -> dict[Any, dict[str, Any]]:
    rows = table.to_pylist()
    out = {r[key]: r for r in rows}
    assert len(out) == len(rows), f"duplicate keys in a read: {sorted(r[key] for r in rows)}"
    return out


def explain(model: Model, keys: set[int], when: str) -> str:
    """The records (in log order) behind the expected values of some keys, for failure messages."""
    lines = [f"compactions (instant, completion): {model.compactions}"]
    for k in sorted(keys)[:4]:
        lines.append(f"key {k}:")
        for instant in sorted(model.commits):
            completion, recs = model.commits[instant]
            for r in recs:
                if r.key == k:
                    seen = "visible" if completion <= when else "not yet"
                    lines.append(f"  instant {instant} completion {completion} ({seen}) delete={r.is_delete} "
                                 f"ordering={r.ordering} row={r.row}")
    return "\n".join(lines)


def assert_same(got: dict, expected: dict, model: Model, when: str, what: str) -> None:
    if got == expected:
        return
    bad = {k for k in set(got) | set(expected) if got.get(k) != expected.get(k)}
    detail = "\n".join(f"  key {k}: got {got.get(k)} expected {expected.get(k)}" for k in sorted(bad)[:6])
    raise AssertionError(f"{what}: {len(bad)} key(s) differ\n{detail}\n{explain(model, bad, when)}")


# -- small tables for the targeted tests ------------------------------------------------------------

ET_SCHEMA = pa.schema([("id", pa.int64()), ("ts", pa.int64()), ("v", pa.string())])


def _et_rows(*rows: tuple[int, int, str]) -> pa.Table:
    return pa.Table.from_pylist([{"id": i, "ts": ts, "v": v} for i, ts, v in rows], schema=ET_SCHEMA)


def _values(table: pa.Table) -> dict[int, str]:
    return {r["id"]: r["v"] for r in table.to_pylist()}


# -- the random concurrent workload -------------------------------------------------------------

@dataclass(frozen=True)
class Mode:
    name: str
    merge_mode: str
    ordering: bool
    growing: bool = False  # ordering values grow with each writer's commits (the usual stream)


MODES = [
    Mode("event_time", "event_time", True),
    Mode("event_time-growing", "event_time", True, growing=True),
    Mode("commit_time", "commit_time", False),
    Mode("partial_update-ordering", "partial_update", True),
    Mode("partial_update-no-ordering", "partial_update", False),
]

SCHEMA = pa.schema([("id", pa.int64()), ("region", pa.string()), ("ts", pa.int64()), ("a", pa.string()),
                    ("b", pa.int64()), ("c", pa.string())])
COLUMNS = SCHEMA.names
KEY_SCHEMA = pa.schema([("id", pa.int64()), ("region", pa.string())])
WRITERS = 3
COMMITS_PER_WRITER = 7
KEY_POOL = 16
WAIT_S = 30


def region(k: int) -> str:
    return f"p{k % 2}"  # the partition is a function of the key


def _thread_stacks() -> str:
    """Every thread's stack, so that a timeout on CI shows what was stuck."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
                     for ident, frame in sys._current_frames().items())


class Progress:
    """Counts finished commits and compaction schedulings, for event-driven interleaving."""

    def __init__(self):
        self.cond = threading.Condition()
        self.commits = 0
        self.scheduled = 0
        self.pending_scheduled = 0  # the compaction that is scheduled now and run later
        self.held_open = 0  # writer 0 has begun the write that it holds open
        self.errors: list[BaseException] = []

    def bump(self, attr: str) -> None:
        with self.cond:
            setattr(self, attr, getattr(self, attr) + 1)
            self.cond.notify_all()

    def wait(self, pred: Callable[[], bool], what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: pred() or bool(self.errors), timeout=WAIT_S):
                raise AssertionError(f"timed out waiting for {what} (commits={self.commits}, "
                                     f"scheduled={self.scheduled}, held_open={self.held_open}); "
                                     f"where the threads are:\n{_thread_stacks()}")
        if self.errors:
            raise RuntimeError("another thread failed") from self.errors[0]


def _upsert_rows(rng: random.Random, mode: Mode, tag: str, with_flag: bool, seq: int) -> list[dict[str, Any]]:
    rows = []
    for r in range(rng.randint(3, 9)):
        k = rng.randrange(KEY_POOL)
        # A small range: many ties. Growing: a writer's n-th commit has ts n or n + 1, so ranges
        # of later commits often outrank every older record (and concurrent writers sometimes not).
        ts = seq + rng.randint(0, 1) if mode.growing else rng.randint(0, 4)
        row = {"id": k, "region": region(k), "ts": ts,
               "a": f"a-{tag}-{r}", "b": rng.randint(0, 10**6), "c": f"c-{tag}-{r}"}
        nulls = 0.5 if mode.merge_mode == "partial_update" else 0.15
        for col in ("a", "b", "c"):
            if rng.random() < nulls:
                row[col] = None
        if not mode.ordering and rng.random() < 0.2:
            row["ts"] = None  # without an ordering field ts is plain data
        if with_flag:
            row[DELETED] = rng.random() < 0.3
            if row[DELETED] and mode.ordering and rng.random() < 0.4:
                row["ts"] = None  # a delete with no ordering value
        rows.append(row)
    return rows


def _records(rows: list[dict[str, Any]], mode: Mode, key_only_delete: bool) -> list[Rec]:
    out = []
    for row in rows:
        full = {c: row.get(c) for c in COLUMNS}
        is_delete = key_only_delete or bool(row.get(DELETED))
        out.append(Rec(row["id"], full, is_delete, row.get("ts") if mode.ordering else None))
    return out


def _writer(uri: str, mode: Mode, w: int, progress: Progress, log: dict[str, list[Rec]],
            log_lock: threading.Lock, start: threading.Barrier) -> None:
    table = nbcc.Table.open(uri)  # each writer its own handle (its own lock holder id)
    rng = random.Random(f"nbcc-tt-{mode.name}-{w}")
    start.wait(WAIT_S)
    for n in range(COMMITS_PER_WRITER):
        if w != 0 and n == 0:
            # Writer 0 must begin first: its hold waits for three later commits, which writers 1
            # and 2 could not supply if a slow start (the lock is not fair) let them finish first.
            progress.wait(lambda: progress.held_open > 0, "writer 0 to begin the write it holds open")
        if w != 0 and n >= COMMITS_PER_WRITER - 2:
            # The last commits of writers 1 and 2 wait for the compaction that is scheduled and run
            # later, so that commits surely complete while it is pending.
            progress.wait(lambda: progress.pending_scheduled > 0, "the compaction scheduled to run later")
        tag = f"w{w}c{n}"
        kind = rng.choices(["upsert", "flag", "delete"], [5, 3, 2])[0]
        if n == 0:
            kind = "upsert"
        if kind == "delete":
            keys = rng.sample(range(KEY_POOL), rng.randint(1, 4))
            rows = [{"id": k, "region": region(k)} for k in keys]
            data, operation = pa.Table.from_pylist(rows, schema=KEY_SCHEMA), "delete"
        else:
            rows = _upsert_rows(rng, mode, tag, kind == "flag", n)
            schema = pa.schema(list(SCHEMA) + ([pa.field(DELETED, pa.bool_())] if kind == "flag" else []))
            data, operation = pa.Table.from_pylist(rows, schema=schema), "upsert"
        # Writer 0's first commit stays open until commits that started after it completed and a
        # compaction was scheduled after it started: a commit with an old instant completing late,
        # across a compaction barrier (RFC-66's case). Other commits use either API, some held
        # open a while.
        hold = w == 0 and n == 0
        if hold or rng.random() < 0.5:
            txn = table.begin_write(data.schema, operation)
            seen_commits, seen_scheduled = progress.commits, progress.scheduled
            if hold:
                progress.bump("held_open")
            lw = table.log_writer(txn, "0-0-0")
            lw.write(nbcc.writer.prepare(data, table.config, txn.schema, operation))
            if hold:
                # Writers 1 and 2 began no commit before this one: every completion from now on
                # is of a commit that started after it.
                progress.wait(lambda: progress.commits >= seen_commits + 3 and progress.scheduled > seen_scheduled,
                              "a commit and a compaction while writer 0 holds its write open")
            else:
                time.sleep(rng.uniform(0, 0.02))
            txn.commit(lw.close())
            instant = txn.instant
        else:
            instant = table.write(data, operation)
        with log_lock:
            log[instant] = _records(rows, mode, operation == "delete")
        progress.bump("commits")


def _compactor(uri: str, progress: Progress, out: dict[str, Any]) -> None:
    table = nbcc.Table.open(uri)
    total = WRITERS * COMMITS_PER_WRITER

    def at(n: int) -> None:
        progress.wait(lambda: progress.commits >= min(n, total), f"{n} commits")

    def schedule() -> str | None:
        tc = table.schedule_compaction()
        if tc is not None:
            progress.bump("scheduled")
        return tc

    at(3)
    tc = schedule()
    if tc is not None:
        table.run_compaction(tc)
        out["compacted"].append(tc)
    # Scheduled while writes continue, executed later: commits complete in between.
    at(8)
    tc = schedule()
    assert tc is not None, "nothing to compact after 8 commits"
    scheduled_at = progress.commits
    progress.bump("pending_scheduled")
    at(scheduled_at + 3)
    assert table.run_compaction(tc) is not None
    out["scheduled_then_run"] = tc
    out["compacted"].append(tc)
    for n in (14, 18):
        at(n)
        tc = schedule()
        if tc is not None:
            table.run_compaction(tc)
            out["compacted"].append(tc)


def _run_workload(uri: str, mode: Mode) -> tuple[dict[str, list[Rec]], dict[str, Any]]:
    progress = Progress()
    log: dict[str, list[Rec]] = {}
    log_lock = threading.Lock()
    compactions: dict[str, Any] = {"compacted": []}
    start = threading.Barrier(WRITERS)

    def guarded(fn, *args):
        def run():
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the test
                with progress.cond:
                    progress.errors.append(exc)
                    progress.cond.notify_all()
        return threading.Thread(target=run, daemon=True)

    threads = [guarded(_writer, uri, mode, w, progress, log, log_lock, start) for w in range(WRITERS)]
    threads.append(guarded(_compactor, uri, progress, compactions))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT_S * 4)
        assert not t.is_alive(), "a writer or the compactor thread hangs"
    if progress.errors:
        raise progress.errors[0]
    return log, compactions


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
def test_time_travel_and_incremental_match_reference_with_concurrent_writers_and_compaction(mode, local_table):
    uri, _ = local_table
    table = nbcc.Table.create(uri, SCHEMA, "id", ordering_field="ts" if mode.ordering else None,
                              partition_by="region", buckets=2, merge_mode=mode.merge_mode)
    log, compactions = _run_workload(uri, mode)

    # -- the timeline: every write completed once; what else is on it are compactions -----------
    timeline = table.timeline()
    assert all(i.is_completed for i in timeline), [i for i in timeline if not i.is_completed]
    data = {i.instant: i for i in timeline if i.action == "deltacommit"}
    assert set(data) == set(log), "the completed data commits are not exactly the writes that returned"
    others = [i for i in timeline if i.action != "deltacommit"]
    assert {i.action for i in others} <= {"commit"}
    assert {i.instant for i in others} == set(compactions["compacted"])
    for i in timeline:
        assert i.completion > i.instant
    model = Model(mode.merge_mode, mode.ordering, COLUMNS)
    for instant, inst in data.items():
        model.add(instant, inst.completion, log[instant])
    model.compactions = [(i.instant, i.completion) for i in others]

    # The workload did what it is for: late commits (instant order != completion order), a commit
    # straddling a compaction (instant < Tc < completion), deletes of both kinds.
    by_instant = sorted(data.values(), key=lambda i: i.instant)
    assert any(a.completion > b.completion for a, b in zip(by_instant, by_instant[1:])), "no late commit"
    assert any(d.instant < c.instant < d.completion for d in data.values() for c in others), \
        "no commit completed across a compaction barrier"
    tc_run_later = next(i for i in others if i.instant == compactions["scheduled_then_run"])
    assert any(tc_run_later.instant < d.completion < tc_run_later.completion for d in data.values()), \
        "no commit completed while the scheduled compaction was pending"
    recs = [r for rs in log.values() for r in rs]
    assert any(r.is_delete and r.ordering is None for r in recs)
    if mode.ordering:
        assert any(r.is_delete and r.ordering is not None for r in recs)

    # -- time travel: at every instant and completion time, and between them --------------------
    oldest = min(i.completion for i in timeline)
    marks = sorted({t for i in timeline for t in (i.instant, i.completion)})
    times = set(marks)
    times |= {shift(i.completion, -1) for i in timeline}  # just before each commit shows
    times |= {_t(_dt(a) + (_dt(b) - _dt(a)) / 2) for a, b in zip(marks, marks[1:])}  # between marks
    times |= {shift(marks[0], -1), shift(marks[-1], 1)}
    times = sorted(times)
    readable = [t for t in times if t >= oldest]
    assert len(readable) > 2 * len(timeline)
    for t in times:
        if t < oldest:
            with pytest.raises(nbcc.InvalidOptionError, match=oldest):
                table.read(as_of=t)
            continue
        got = table.read(as_of=t)
        assert got.column_names == COLUMNS
        assert_same(rows_by_key(got), model.state(t), model, t, f"read(as_of={t})")
    # The same moments written as ISO-8601 (UTC 'Z', an offset, no zone = UTC).
    for t in random.Random(1).sample(readable, 2):
        expected = model.state(t)
        for form in (iso_z(t), iso_offset(t), iso_naive(t)):
            assert_same(rows_by_key(table.read(as_of=form)), expected, model, t, f"read(as_of={form!r})")
    # No as_of: the latest state; a fresh handle agrees.
    latest = max(i.completion for i in timeline)
    assert_same(rows_by_key(table.read()), model.state(latest), model, latest, "read()")
    assert_same(rows_by_key(nbcc.Table.open(uri).read()), model.state(latest), model, latest, "re-opened read()")

    # -- incremental: latest_state and cdc over random ranges of completion times ----------------
    completions = sorted(i.completion for i in timeline)
    rng = random.Random(f"ranges-{mode.name}")
    ranges: list[tuple[Any, Any]] = [("earliest", None), ("earliest", completions[len(completions) // 2]),
                                     (completions[0], None), (completions[-1], None),
                                     (completions[3], completions[3])]
    for _ in range(14):
        b, e = sorted(rng.sample(completions, 2))
        ranges.append((b, e))
    for i in range(1, len(completions) - 3, 4):  # short ranges: a few commits each
        ranges.append((completions[i], completions[i + 3]))
    ranges.append((shift(completions[2], 1), shift(completions[-3], -1)))  # between completions
    ranges.append((iso_z(completions[1]), iso_offset(completions[-2])))
    kinds = set()
    range_only = 0  # file groups read from the range's files alone (format.md §12.7)
    for begin, end in ranges:
        b = BEFORE_ALL if begin == "earliest" else parse_any(begin)
        e = parse_any(end) if end is not None else latest
        kwargs = {"query_type": "incremental", "begin": begin}
        if end is not None:
            kwargs["end"] = end
        changed = model.changed(b, e)
        after = model.state(e)
        before = model.state(b) if b != BEFORE_ALL else {}
        what = f"incremental ({begin}, {end}]"

        got = table.read(**kwargs)
        assert got.column_names == COLUMNS, what
        range_only += sum(t.range_only for t in table.plan(**kwargs).tasks)
        expected = {k: after[k] for k in changed if k in after}
        assert_same(rows_by_key(got), expected, model, e, f"{what} latest_state")

        cdc = table.read(**kwargs, incremental_format="cdc")
        assert cdc.column_names == ["id", "_change_type", "_nbcc_completion_time", "before", "after"], what
        expected_cdc = {}
        for k, last in changed.items():
            old, new = before.get(k), after.get(k)
            if old == new:
                continue
            kind = "insert" if old is None else "delete" if new is None else "update"
            expected_cdc[k] = {"id": k, "_change_type": kind, "_nbcc_completion_time": last,
                               "before": old, "after": new}
            kinds.add(kind)
        assert_same(rows_by_key(cdc), expected_cdc, model, e, f"{what} cdc")
    # The ranges had changes of every kind, so the comparisons above were not vacuous.
    assert kinds == {"insert", "update", "delete"}, kinds
    if mode.growing or mode.merge_mode == "commit_time":
        assert range_only > 0, "no incremental read took the range-only path: it went untested"
    if mode.merge_mode == "partial_update":
        assert range_only == 0
    explicit = table.read(query_type="incremental", begin=completions[1], incremental_format="latest_state")
    assert rows_by_key(explicit) == rows_by_key(table.read(query_type="incremental", begin=completions[1]))


# -- compaction never changes an answer ------------------------------------------------------------
#
# Deterministic cases of what the random workload above runs into: a table service must not change
# what any read returns. Each case runs three times on fresh tables (no compaction; a compaction
# scheduled at one point and run at the end; a compaction run at that point) and every run must
# give the state the records imply.

KV_SCHEMA = pa.schema([("id", pa.int64()), ("v", pa.string())])
FLAG = pa.field(DELETED, pa.bool_())


def _hold_open(table: nbcc.Table, data: pa.Table, operation: str = "upsert"):
    txn = table.begin_write(data.schema, operation)
    w = table.log_writer(txn, "0-0-0")
    w.write(nbcc.writer.prepare(data, table.config, txn.schema, operation))
    return lambda: txn.commit(w.close())


def _late_commit_older_instant(table: nbcc.Table, step: Callable[[], None]) -> None:
    """commit_time: A starts, B starts and commits, then A commits. Log order is A then B
    (by instant), so B's value wins whenever A completes."""
    table.write(pa.table({"id": [1, 2], "v": ["base", "base"]}, schema=KV_SCHEMA))
    commit_a = _hold_open(table, pa.table({"id": [1], "v": ["A-older-instant"]}, schema=KV_SCHEMA))
    table.write(pa.table({"id": [1], "v": ["B-newer-instant"]}, schema=KV_SCHEMA))
    step()
    commit_a()


def _late_key_delete_older_instant(table: nbcc.Table, step: Callable[[], None]) -> None:
    """event_time: a key-only delete (no ordering value) starts, an upsert of the key starts and
    commits, then the delete commits. By log order the upsert comes after the delete: it wins."""
    table.write(_et_rows((1, 1, "v0"), (2, 1, "v0")))
    commit_delete = _hold_open(table, pa.table({"id": [1]}), "delete")
    table.write(_et_rows((1, 1, "newer-instant")))
    step()
    commit_delete()


def _ordered_delete_then_lower_upsert(table: nbcc.Table, step: Callable[[], None]) -> None:
    """A delete with ordering value 9, then an upsert with ordering value 3: the delete wins."""
    table.write(_et_rows((1, 5, "v5"), (2, 5, "v5")))
    table.write(pa.Table.from_pylist([{"id": 1, "ts": 9, "v": "gone", DELETED: True}],
                                     schema=pa.schema(list(ET_SCHEMA) + [FLAG])))
    step()
    table.write(_et_rows((1, 3, "lower")))


COMPACTION_CASES = {
    "late-commit-older-instant-commit_time": (
        dict(schema=KV_SCHEMA, merge_mode="commit_time"), _late_commit_older_instant,
        {1: "B-newer-instant", 2: "base"}),
    "late-key-delete-older-instant-event_time": (
        dict(schema=ET_SCHEMA, merge_mode="event_time", ordering_field="ts"), _late_key_delete_older_instant,
        {1: "newer-instant", 2: "v0"}),
    "ordered-delete-then-lower-upsert-event_time": (
        dict(schema=ET_SCHEMA, merge_mode="event_time", ordering_field="ts"), _ordered_delete_then_lower_upsert,
        {2: "v5"}),
    "ordered-delete-then-lower-upsert-partial_update": (
        dict(schema=ET_SCHEMA, merge_mode="partial_update", ordering_field="ts"),
        _ordered_delete_then_lower_upsert, {2: "v5"}),
}


@pytest.mark.parametrize("case", sorted(COMPACTION_CASES))
def test_compaction_does_not_change_what_reads_return(case, tmp_path):
    options, scenario, expected = COMPACTION_CASES[case]
    results = {}
    for variant in ("no-compaction", "compaction-pending", "compaction-completed"):
        table = nbcc.Table.create(str(tmp_path / variant), options["schema"], "id", buckets=1,
                                  merge_mode=options["merge_mode"], ordering_field=options.get("ordering_field"))
        scheduled = []

        def step() -> None:
            if variant == "compaction-pending":
                scheduled.append(table.schedule_compaction())
            elif variant == "compaction-completed":
                assert table.compact() is not None

        scenario(table, step)
        results[variant] = _values(table.read())
        latest = max(i.completion for i in table.timeline() if i.is_completed)
        results[variant + " as_of latest"] = _values(table.read(as_of=latest))
        if scheduled:
            assert scheduled[0] is not None and table.run_compaction(scheduled[0]) is not None
            results[variant + " then run"] = _values(table.read())
    assert results == {k: expected for k in results}


# -- a writer in flight ----------------------------------------------------------------------------

def test_an_incremental_window_after_the_latest_completion_is_empty_and_the_next_reads_on(local_table):
    # A consumer polling wall-clock windows: nothing completed in (begin, end], so the result is
    # empty, and the plan's end is begin (a commit may still complete inside the window).
    uri, _ = local_table
    table = nbcc.Table.create(uri, ET_SCHEMA, "id", ordering_field="ts", buckets=2)
    table.write(_et_rows((1, 1, "c1")))
    latest = table.timeline()[-1].completion
    begin, end = shift(latest, 1), shift(latest, 3_600_000)
    plan = table.plan(query_type="incremental", begin=begin, end=end)
    assert (plan.tasks, plan.end) == ([], begin)
    for fmt in ("latest_state", "cdc"):
        assert table.read(query_type="incremental", begin=begin, end=end, incremental_format=fmt).num_rows == 0
    assert table.read(query_type="incremental", begin=end, end=end).num_rows == 0
    with pytest.raises(nbcc.InvalidOptionError, match="is after end"):
        table.read(query_type="incremental", begin=end, end=begin)
    with pytest.raises(nbcc.InvalidOptionError, match="is after end"):  # no end: the range ends at the latest
        table.read(query_type="incremental", begin=begin)
    time.sleep(0.01)  # the next commit completes after `begin` on this machine's clock
    table.write(_et_rows((2, 1, "c2")))
    assert _values(table.read(query_type="incremental", begin=plan.end)) == {2: "c2"}


def test_writer_in_flight_is_invisible_then_appears_in_the_next_incremental_range(local_table):
    uri, _ = local_table
    table = nbcc.Table.create(uri, ET_SCHEMA, "id", ordering_field="ts", buckets=2)
    table.write(_et_rows((1, 1, "c1"), (2, 1, "c1"), (3, 1, "c1"), (4, 1, "c1")))

    # The late writer: its instant is taken now, its files are written, it commits much later.
    txn = table.begin_write(ET_SCHEMA)
    w = table.log_writer(txn, "0-0-0")
    w.write(nbcc.writer.prepare(_et_rows((3, 9, "late"), (5, 9, "late"), (6, 9, "late"), (1, 0, "late-loses")),
                                table.config, txn.schema, "upsert"))

    other = nbcc.Table.open(uri)
    other.write(_et_rows((2, 5, "c2"), (7, 1, "c2")))
    assert table.compact() is not None  # a compaction barrier while the writer is still open
    other.write(_et_rows((4, 5, "c3")))
    before_late = {1: "c1", 2: "c2", 3: "c1", 4: "c3", 7: "c2"}

    done = [i for i in table.timeline() if i.is_completed]
    latest = max(i.completion for i in done)
    pending = [i for i in table.timeline() if not i.is_completed]
    assert [i.instant for i in pending] == [txn.instant]
    first = min(i.instant for i in done if i.action == "deltacommit")
    assert all(txn.instant < i.instant for i in done if i.instant != first)

    # Invisible: snapshot, as_of, incremental with the default end and with end = latest.
    assert _values(table.read()) == before_late
    assert _values(table.read(as_of=latest)) == before_late
    assert _values(table.read(as_of=shift(latest, 60_000))) == before_late
    for kw in ({}, {"end": latest}):
        got = table.read(query_type="incremental", begin="earliest", **kw)
        assert _values(got) == before_late
        cdc = table.read(query_type="incremental", begin="earliest", incremental_format="cdc", **kw)
        assert sorted(r["id"] for r in cdc.to_pylist()) == sorted(before_late)
        assert {r["_change_type"] for r in cdc.to_pylist()} == {"insert"}

    completion = txn.commit(w.close())
    assert txn.instant < latest < completion  # older instant than begin, completes after it

    after = {1: "c1", 2: "c2", 3: "late", 4: "c3", 5: "late", 6: "late", 7: "c2"}
    assert _values(table.read()) == after
    assert _values(table.read(as_of=latest)) == before_late  # completed after `latest`
    assert _values(table.read(as_of=completion)) == after
    # The next incremental range (begin = the last completion the consumer saw) has its keys,
    # each with its state as of end (key 1 was written by it, but its record lost on ts).
    got = table.read(query_type="incremental", begin=latest)
    assert _values(got) == {1: "c1", 3: "late", 5: "late", 6: "late"}
    assert _values(table.read(query_type="incremental", begin=latest, end=completion)) == _values(got)
    assert table.read(query_type="incremental", begin=latest, end=latest).num_rows == 0
    cdc = {r["id"]: r for r in table.read(query_type="incremental", begin=latest, incremental_format="cdc").to_pylist()}
    assert cdc == {
        3: {"id": 3, "_change_type": "update", "_nbcc_completion_time": completion,
            "before": {"id": 3, "ts": 1, "v": "c1"}, "after": {"id": 3, "ts": 9, "v": "late"}},
        5: {"id": 5, "_change_type": "insert", "_nbcc_completion_time": completion,
            "before": None, "after": {"id": 5, "ts": 9, "v": "late"}},
        6: {"id": 6, "_change_type": "insert", "_nbcc_completion_time": completion,
            "before": None, "after": {"id": 6, "ts": 9, "v": "late"}},
    }  # key 1 is unchanged (its late record lost), so it has no cdc row


# -- read-optimized ----------------------------------------------------------------------------------

def _keys_in_buckets(buckets: int, wanted: set[int], n: int) -> list[int]:
    ids = list(range(1000))
    b = nbcc.bucket_ids(ids, buckets)
    out = [i for i, bucket in zip(ids, b) if int(bucket) in wanted][:n]
    assert len(out) == n
    return out


def test_read_optimized_reads_base_files_only(local_table):
    uri, _ = local_table
    table = nbcc.Table.create(uri, ET_SCHEMA, "id", ordering_field="ts", buckets=4)
    a_keys = _keys_in_buckets(4, {0, 1}, 6)
    b_keys = _keys_in_buckets(4, {2, 3}, 4)

    table.write(_et_rows(*[(k, 1, "v1") for k in a_keys]))
    table.write(_et_rows(*[(k, 2, "v2") for k in a_keys[:3]]))
    table.write(pa.table({"id": [a_keys[5]]}), operation="delete")
    state = {k: "v2" if k in a_keys[:3] else "v1" for k in a_keys[:5]}
    # No base file anywhere yet: a read-optimized read has nothing to read.
    assert table.read(query_type="read_optimized").num_rows == 0
    assert table.read(query_type="read_optimized").column_names == ET_SCHEMA.names
    assert _values(table.read()) == state

    assert table.compact() is not None
    compacted = dict(state)
    assert _values(table.read(query_type="read_optimized")) == compacted
    assert _values(table.read()) == compacted

    # More writes: updates, a delete, and keys in file groups that have no base file.
    table.write(_et_rows(*[(k, 3, "v3") for k in a_keys[1:4]] + [(k, 1, "new") for k in b_keys]))
    table.write(pa.table({"id": [a_keys[0]]}), operation="delete")
    state.update({k: "v3" for k in a_keys[1:4]})
    state.update({k: "new" for k in b_keys})
    del state[a_keys[0]]
    assert _values(table.read()) == state
    assert _values(table.read(query_type="read_optimized")) == compacted  # stale
    assert _values(table.read(query_type="snapshot")) == state

    # A compaction that is only scheduled changes nothing for read-optimized readers; once run it
    # holds what completed before it was scheduled, not what completed after.
    tc = table.schedule_compaction()
    assert tc is not None
    table.write(_et_rows((a_keys[4], 9, "after-tc")))
    assert _values(table.read(query_type="read_optimized")) == compacted
    at_tc = dict(state)
    state[a_keys[4]] = "after-tc"
    assert table.run_compaction(tc) is not None
    assert _values(table.read(query_type="read_optimized")) == at_tc
    assert _values(table.read()) == state


# -- meta columns ----------------------------------------------------------------------------------

META_SCHEMA = pa.schema([("id", pa.int64()), ("region", pa.string()), ("ts", pa.int64()), ("v", pa.string())])


def test_meta_columns_name_the_winning_commit_its_key_partition_and_file_group(local_table):
    uri, _ = local_table
    buckets = 4
    table = nbcc.Table.create(uri, META_SCHEMA, "id", ordering_field="ts", partition_by="region",
                              buckets=buckets)
    reg = {k: "eu" if k % 2 else "us" for k in range(1, 13)}
    model = Model("event_time", True, META_SCHEMA.names)

    def write(rows: list[tuple[int, int, str]], operation: str = "upsert") -> None:
        if operation == "delete":
            data = pa.Table.from_pylist([{"id": k, "region": reg[k]} for k, _, _ in rows],
                                        schema=pa.schema([("id", pa.int64()), ("region", pa.string())]))
        else:
            data = pa.Table.from_pylist([{"id": k, "region": reg[k], "ts": ts, "v": v} for k, ts, v in rows],
                                        schema=META_SCHEMA)
        instant = table.write(data, operation)
        completion = next(i.completion for i in table.timeline() if i.instant == instant)
        model.add(instant, completion, [
            Rec(k, {"id": k, "region": reg[k], "ts": None if operation == "delete" else ts,
                    "v": None if operation == "delete" else v}, operation == "delete",
                None if operation == "delete" else ts) for k, ts, v in rows])

    write([(k, 10, f"c1-{k}") for k in range(1, 13)])
    write([(k, 20, f"c2-{k}") for k in (2, 4, 6, 9)])
    write([(3, 5, "c3-loses"), (8, 30, "c3-8")])
    write([(5, 0, "")], "delete")

    def check(got: pa.Table, when: str, what: str) -> None:
        assert got.column_names == META_SCHEMA.names + META, what
        rows = rows_by_key(got)
        state = model.state(when)
        winners = model.winner_instant(when)
        completion = {i: c for i, (c, _) in model.commits.items()}
        assert set(rows) == set(state), what
        for k, r in rows.items():
            assert {c: r[c] for c in META_SCHEMA.names} == state[k], what
            bucket = int(nbcc.bucket_ids([k], buckets)[0])
            assert r["_nbcc_commit_time"] == winners[k], (what, k)
            assert r["_nbcc_completion_time"] == completion[winners[k]], (what, k)
            assert r["_nbcc_record_key"] == str(k), (what, k)
            assert r["_nbcc_partition"] == f"region={reg[k]}", (what, k)
            assert r["_nbcc_file_group"] == file_group(bucket), (what, k)

    latest = max(c for c, _ in model.commits.values())
    check(table.read(include_meta_columns=True), latest, "snapshot")
    check(table.read(include_meta_columns="true"), latest, "snapshot, option given as text")
    second = sorted(c for c, _ in model.commits.values())[1]
    check(table.read(include_meta_columns=True, as_of=second), second, "as_of the second commit")
    # Compaction keeps each record's own commit and completion time.
    assert table.compact() is not None
    check(table.read(include_meta_columns=True), latest, "snapshot after compaction")
    check(table.read(include_meta_columns=True, query_type="read_optimized"), latest, "read_optimized")
    write([(9, 40, "c5-9"), (11, 40, "c5-11")])
    latest = max(c for c, _ in model.commits.values())
    check(table.read(include_meta_columns=True), latest, "snapshot after a write on top of the base")
    got = table.read(include_meta_columns=True, query_type="incremental", begin=second)
    changed = model.changed(second, latest)
    assert set(rows_by_key(got)) == {k for k in changed if k in model.state(latest)}
    # Every row of an incremental read is checked like a snapshot row, restricted to its keys.
    full = rows_by_key(table.read(include_meta_columns=True))
    assert all(full[k] == r for k, r in rows_by_key(got).items())
    assert table.read().column_names == META_SCHEMA.names  # off by default
    # Some columns only, meta columns among them, in the order asked for; incremental reads too.
    picked = ["_nbcc_commit_time", "v", "id"]
    for options in ({}, {"query_type": "incremental", "begin": second}, {"as_of": second}):
        got = table.read(include_meta_columns=True, columns=picked, **options)
        full = table.read(include_meta_columns=True, **options)
        assert got.column_names == picked
        assert sorted(got.to_pylist(), key=lambda r: r["id"]) == sorted(
            full.select(picked).to_pylist(), key=lambda r: r["id"]), options
    # The same reads as streams of batches, cdc too.
    for options in ({}, {"query_type": "incremental", "begin": second}, {"as_of": second},
                    {"query_type": "incremental", "begin": second, "incremental_format": "cdc"},
                    {"filter": [("region", "=", "eu"), ("ts", ">", 10)], "columns": ["id", "v"]}):
        whole = table.read(**options)
        streamed = table.read_batches(**options)
        assert streamed.schema == whole.schema
        assert sorted(streamed.read_all().to_pylist(), key=lambda r: r["id"]) == sorted(
            whole.to_pylist(), key=lambda r: r["id"]), options


def test_read_batches_reads_ahead_hands_errors_over_and_stops_with_its_caller(tmp_path, monkeypatch):
    schema = pa.schema([("id", pa.int64()), ("v", pa.string())])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id", buckets=8)
    table.write(pa.table({"id": range(4000), "v": [f"v{i}" for i in range(4000)]}, schema=schema))

    def reading_ahead() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "nbcc-read-ahead"]

    def gone() -> bool:
        deadline = time.monotonic() + 10
        while reading_ahead() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not reading_ahead()

    # Every row, in the plan's order (the order a read without reading ahead gives).
    plan = table.plan()
    in_order = pa.Table.from_batches(list(iter_plan(table.storage, plan)), plan.output_schema)
    assert table.read_batches().read_all().equals(in_order) and in_order.num_rows == 4000
    assert gone()
    # A caller that drops the reader after one batch stops the thread. Meanwhile the thread has
    # merged one file group ahead of the one taken, and no more.
    merged = []
    real = nbcc.scan.iter_task

    def counted(*args):
        for rows in real(*args):
            merged.append(rows.num_rows)
            yield rows

    monkeypatch.setattr(nbcc.scan, "iter_task", counted)
    reader = table.read_batches()
    assert reader.read_next_batch().num_rows
    assert reading_ahead()
    deadline = time.monotonic() + 10
    while len(merged) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert len(merged) == 2, merged
    del reader
    assert gone()
    monkeypatch.undo()
    # An error while reading ahead reaches the caller as a read's error does.
    reader = table.read_batches()
    victim = table.file_slices()[5]
    table.storage.delete(f"{victim.partition}/{victim.log_files[0]}".lstrip("/"))
    with pytest.raises(Exception) as streamed:
        reader.read_all()
    with pytest.raises(Exception) as whole:
        table.read()
    assert type(streamed.value) is type(whole.value) and str(streamed.value) == str(whole.value)
    assert victim.log_files[0] in str(streamed.value)
    assert gone()


def test_a_process_that_ends_while_read_batches_reads_ahead_exits_cleanly(tmp_path):
    # The thread was a daemon left inside Arrow's C++ code as the interpreter ended: the process
    # aborted ("terminate called without an active exception") in 3 to 5 runs of 10.
    schema = pa.schema([("id", pa.int64()), ("v", pa.string())])
    uri = str(tmp_path / "t")
    table = nbcc.Table.create(uri, schema, "id", buckets=16)
    for k in range(3):  # each file group's read merges three log files
        ids = range(k, 300_000, 3)
        table.write(pa.table({"id": ids, "v": [f"value-{i}" * 4 for i in ids]}, schema=schema))
    script = ("import sys, nbcc; r = nbcc.Table.open(sys.argv[1]).read_batches(); "
              "print(r.read_next_batch().num_rows)")
    for _ in range(5):
        done = subprocess.run([sys.executable, "-c", script, uri], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and int(done.stdout) > 0, (done.returncode, done.stderr[-500:])


def test_columns_errors_say_what_is_wrong(local_table):
    uri, _ = local_table
    table = nbcc.Table.create(uri, META_SCHEMA, "id", ordering_field="ts", partition_by="region")
    table.write(pa.Table.from_pylist([{"id": 1, "region": "eu", "ts": 1, "v": "a"}], schema=META_SCHEMA))
    for columns, message in (
            ("v", r"columns must be a non-empty list of column names, e.g. \['id', 'amount'\]; got 'v'"),
            ([], "columns must be a non-empty list"),
            (["v", 3], "columns must be a non-empty list"),
            (["v", "nosuch"], r"columns \['nosuch'\] are not in the table \(as of the time read\); its columns are "
                              r"\['id', 'region', 'ts', 'v'\]"),
            (["v", "id", "v"], r"columns lists \['v'\] more than once"),
            (["_nbcc_commit_time"], r"meta columns: read them with include_meta_columns=True")):
        with pytest.raises(nbcc.InvalidOptionError, match=message):
            table.read(columns=columns)
    with pytest.raises(nbcc.InvalidOptionError, match="columns does not apply to cdc output"):
        table.read(query_type="incremental", incremental_format="cdc", columns=["id"])
    # A column added after the time read: said so.
    first = table.timeline()[-1].completion
    table.write(pa.Table.from_pylist([{"id": 2, "region": "eu", "ts": 1, "v": "b", "note": "n"}]))
    with pytest.raises(nbcc.InvalidOptionError, match=rf"columns \['note'\] were added to the table after the time "
                                                      rf"this read reads \({first}\); leave them out"):
        table.read(as_of=first, columns=["id", "note"])
    assert table.read(as_of=first, columns=["id", "v"]).to_pylist() == [{"id": 1, "v": "a"}]


# -- errors ------------------------------------------------------------------------------------------

def test_time_option_errors(local_table):
    uri, _ = local_table
    table = nbcc.Table.create(uri, ET_SCHEMA, "id", ordering_field="ts")
    first = table.write(_et_rows((1, 1, "a")))
    table.write(_et_rows((2, 1, "b")))
    c1, c2 = sorted(i.completion for i in table.timeline())

    for bad in ("yesterday", "2024-13-45", "2024010112", "20241399000000000", "2024-01-01T25:00", ""):
        with pytest.raises(nbcc.InvalidOptionError) as err:
            table.read(as_of=bad)
        message = str(err.value)
        assert "17-digit" in message and "ISO-8601" in message, message
    for name in ("begin", "end"):
        with pytest.raises(nbcc.InvalidOptionError, match="ISO-8601"):
            table.read(query_type="incremental", **{name: "not-a-time"})

    # Before the oldest readable state: the error names it (the first commit's completion).
    for early in (first, shift(c1, -1), "2000-01-01", "19991231235959999"):
        with pytest.raises(nbcc.InvalidOptionError) as err:
            table.read(as_of=early)
        assert c1 in str(err.value), str(err.value)
    assert _values(table.read(as_of=c1)) == {1: "a"}
    assert _values(table.read(as_of=iso_z(c1))) == {1: "a"}
    # Any fraction of a second (within c1's millisecond), an offset of hours only: read the same on
    # Python 3.10, whose datetime.fromisoformat takes 3 or 6 digits and no Z.
    assert _values(table.read(as_of=iso_z(c1)[:-1] + "999999+00")) == {1: "a"}
    assert _values(table.read(as_of=iso_z(c1).lower())) == {1: "a"}  # RFC 3339 allows a lowercase t and z
    with pytest.raises(nbcc.InvalidOptionError, match="ISO-8601"):
        table.read(as_of=iso_z(c1).replace("-", "").replace(":", ""))  # the basic form: not taken

    with pytest.raises(nbcc.InvalidOptionError, match="after"):
        table.read(query_type="incremental", begin=c2, end=c1)
    with pytest.raises(nbcc.InvalidOptionError, match="after"):
        table.read(query_type="incremental", begin=iso_z(c2), end=iso_z(c1), incremental_format="cdc")
    assert table.read(query_type="incremental", begin=c1, end=c1).num_rows == 0

    for query_type in (None, "snapshot", "read_optimized"):
        for kw in ({"begin": c1}, {"end": c2}, {"begin": "earliest"}, {"incremental_format": "cdc"}):
            with pytest.raises(nbcc.InvalidOptionError, match="incremental"):
                table.read(query_type=query_type, **kw)
    with pytest.raises(nbcc.InvalidOptionError, match="meta"):
        table.read(query_type="incremental", begin="earliest", incremental_format="cdc", include_meta_columns=True)
    with pytest.raises(nbcc.InvalidOptionError):
        table.read(query_type="incremental", as_of=c2)


def test_digit_strings_that_are_not_17_digits_are_malformed(local_table):
    """A digit string of the wrong length is a mistyped instant time, not some other moment
    (Python's lenient `datetime.fromisoformat` reads e.g. '202401011200000' as 2024-01-01 20:00)."""
    uri, _ = local_table
    table = nbcc.Table.create(uri, ET_SCHEMA, "id", ordering_field="ts")
    table.write(_et_rows((1, 1, "a")))
    # 20990101120000000 (17 digits: 2099-01-01 12:00:00.000) with digits missing or extra.
    for bad in ("209901011200000", "2099010112000000", "209901011200000000", "2099010112000000000"):
        with pytest.raises(nbcc.InvalidOptionError) as err:
            table.read(as_of=bad)
        assert "17-digit" in str(err.value), (bad, str(err.value))
        with pytest.raises(nbcc.InvalidOptionError):
            table.read(query_type="incremental", begin="earliest", end=bad)


# -- schema evolution across time ---------------------------------------------------------------------

def test_added_column_is_absent_before_it_and_null_for_older_rows_after(local_table):
    uri, _ = local_table
    table = nbcc.Table.create(uri, ET_SCHEMA, "id", ordering_field="ts", buckets=2)
    table.write(_et_rows((1, 1, "a1"), (2, 1, "a2"), (3, 1, "a3")))
    wide = pa.schema(list(ET_SCHEMA) + [pa.field("extra", pa.string())])
    txn = table.begin_write(wide)
    w = table.log_writer(txn, "0-0-0")
    w.write(nbcc.writer.prepare(pa.Table.from_pylist([{"id": 2, "ts": 2, "v": "b2", "extra": "x2"},
                                                      {"id": 4, "ts": 2, "v": "b4", "extra": "x4"}], schema=wide),
                                table.config, txn.schema, "upsert"))
    # In flight: the column does not exist yet for anyone.
    assert table.read().column_names == ET_SCHEMA.names
    assert table.schema().names == ET_SCHEMA.names
    c2 = txn.commit(w.close())
    table.write(_et_rows((1, 3, "c1")))  # a later write without the column
    c1, _, c3 = sorted(i.completion for i in table.timeline())

    old = table.read(as_of=c1)
    assert old.column_names == ET_SCHEMA.names
    assert table.schema(as_of=c1).names == ET_SCHEMA.names
    assert sorted(old.to_pylist(), key=lambda r: r["id"]) == [
        {"id": 1, "ts": 1, "v": "a1"}, {"id": 2, "ts": 1, "v": "a2"}, {"id": 3, "ts": 1, "v": "a3"}]
    expected = {1: {"id": 1, "ts": 1, "v": "a1", "extra": None}, 2: {"id": 2, "ts": 2, "v": "b2", "extra": "x2"},
                3: {"id": 3, "ts": 1, "v": "a3", "extra": None}, 4: {"id": 4, "ts": 2, "v": "b4", "extra": "x4"}}
    mid = table.read(as_of=c2)
    assert mid.column_names == wide.names
    assert rows_by_key(mid) == expected
    expected[1] = {"id": 1, "ts": 3, "v": "c1", "extra": None}
    assert rows_by_key(table.read(as_of=c3)) == expected
    assert table.schema().names == wide.names
    # Incremental over the change: the new column in latest_state and in cdc's before/after.
    assert rows_by_key(table.read(query_type="incremental", begin=c1, end=c2)) == {k: expected[k] for k in (2, 4)}
    cdc = rows_by_key(table.read(query_type="incremental", begin=c1, end=c2, incremental_format="cdc"))
    assert cdc == {
        2: {"id": 2, "_change_type": "update", "_nbcc_completion_time": c2,
            "before": {"id": 2, "ts": 1, "v": "a2", "extra": None}, "after": expected[2]},
        4: {"id": 4, "_change_type": "insert", "_nbcc_completion_time": c2, "before": None, "after": expected[4]},
    }
    # Compaction keeps it so.
    assert table.compact() is not None
    assert rows_by_key(table.read()) == expected
    assert table.read(as_of=c1).column_names == ET_SCHEMA.names


def test_a_column_another_process_adds_is_in_this_process_schema_and_reads(local_table):
    # This process has looked at the schema (and remembers what it folded); a writer in another
    # process then adds a column.
    uri, _ = local_table
    table = nbcc.Table.create(uri, ET_SCHEMA, "id", ordering_field="ts", buckets=2)
    table.write(_et_rows((1, 1, "a1")))
    assert table.schema().names == ET_SCHEMA.names
    code = ("import sys, pyarrow as pa, nbcc; t = nbcc.Table.open(sys.argv[1]); "
            "t.write(pa.table({'id': [2], 'ts': [2], 'v': ['b2'], 'extra': ['x2']}))")
    subprocess.run([sys.executable, "-c", code, uri], check=True, capture_output=True, timeout=120)
    assert table.schema().names == ET_SCHEMA.names + ["extra"]
    table.write(_et_rows((3, 3, "c3")))  # a write from here that leaves the column out
    assert rows_by_key(table.read()) == {1: {"id": 1, "ts": 1, "v": "a1", "extra": None},
                                         2: {"id": 2, "ts": 2, "v": "b2", "extra": "x2"},
                                         3: {"id": 3, "ts": 3, "v": "c3", "extra": None}}


def test_a_table_made_again_at_the_same_path_has_only_its_own_columns(local_table):
    uri, _ = local_table
    first = nbcc.Table.create(uri, ET_SCHEMA, "id", ordering_field="ts", buckets=2)
    first.write(pa.table({"id": [1], "ts": [1], "v": ["a"], "extra": ["x"]}))
    assert first.schema().names == ET_SCHEMA.names + ["extra"]
    shutil.rmtree(uri)
    again = nbcc.Table.create(uri, ET_SCHEMA, "id", ordering_field="ts", buckets=2)
    assert again.schema().names == ET_SCHEMA.names
    again.write(_et_rows((1, 2, "b")))
    assert again.schema().names == ET_SCHEMA.names
    assert again.read().to_pylist() == [{"id": 1, "ts": 2, "v": "b"}]


def test_a_fresh_process_takes_the_schema_of_a_long_timeline_from_the_metadata_table(local_table):
    # Enough commits that a process folding them all reads their schemas from the metadata table
    # instead of every commit file; the column is added in the middle.
    uri, _ = local_table
    table = nbcc.Table.create(uri, ET_SCHEMA, "id", ordering_field="ts", buckets=2)
    for i in range(12):
        table.write(_et_rows((i, i, f"v{i}")))
    table.write(pa.table({"id": [100], "ts": [100], "v": ["w"], "extra": ["x"]}))
    for i in range(12, 24):
        table.write(_et_rows((i, i, f"v{i}")))
    table.build_index("files")
    # The fresh process counts the table's commit files it reads (one request each on S3; the
    # metadata table is a table of its own, with its own timeline).
    code = ("import sys, re, nbcc\n"
            "table = nbcc.Table.open(sys.argv[1])\n"
            "reads = []\n"
            "plain = nbcc.storage.Storage.read_bytes\n"
            "def counted(self, rel, **kw):\n"
            "    if self.uri == table.storage.uri and re.search(r'timeline/\\d{17}_\\d{17}\\.', rel):\n"
            "        reads.append(rel)\n"
            "    return plain(self, rel, **kw)\n"
            "nbcc.storage.Storage.read_bytes = counted\n"
            "print(','.join(table.schema().names)); print(len(reads))\n")
    out = subprocess.run([sys.executable, "-c", code, uri], check=True, capture_output=True, text=True, timeout=120)
    names, commit_files_read = out.stdout.split()
    assert names.split(",") == ET_SCHEMA.names + ["extra"]
    assert int(commit_files_read) == 0


def test_a_commit_listed_after_a_later_one_still_adds_its_column(tmp_path):
    # A listing can miss a commit that completed before one it shows (an S3 listing racing the
    # commit, or a commit whose lock lease ran out before it was published). The schema seen
    # next, with both listed, must hold both commits' columns.
    table = nbcc.Table.create(str(tmp_path / "t"), ET_SCHEMA, "id", ordering_field="ts", buckets=2)
    early = Instant("20260101000000001", "deltacommit", "completed", "20260101000000002")
    late = Instant("20260101000000003", "deltacommit", "completed", "20260101000000004")
    metas = {early.instant: {"schema": schema_to_json(pa.schema(list(ET_SCHEMA) + [("x", pa.string())]))},
             late.instant: {"schema": schema_to_json(pa.schema(list(ET_SCHEMA) + [("y", pa.string())]))}}

    def schema(completed):
        return table_schema(table.storage, table.config, completed, lambda new: metas).names

    assert schema([late]) == ET_SCHEMA.names + ["y"]
    assert schema([early, late]) == ET_SCHEMA.names + ["x", "y"]
    assert schema([early]) == ET_SCHEMA.names + ["x"]  # as of early's completion
    assert schema([early, late]) == ET_SCHEMA.names + ["x", "y"]


def test_incremental_read_with_a_pyarrow_filter_on_a_meta_column(tmp_path):
    # Ordering values and instants grow, so the range's files alone are read (range_only); they
    # must still carry the meta columns a pyarrow filter may name.
    import pyarrow.compute as pc

    table = nbcc.Table.create(str(tmp_path / "t"), KV_SCHEMA.append(pa.field("ts", pa.int64())), "id",
                              ordering_field="ts", buckets=2)
    first = table.write(pa.table({"id": [1, 2], "v": ["a", "b"], "ts": [1, 1]}))
    second = table.write(pa.table({"id": [3], "v": ["c"], "ts": [2]}))
    third = table.write(pa.table({"id": [2, 4], "v": ["B", "d"], "ts": [3, 3]}))
    begin = next(i.completion for i in table.timeline() if i.instant == first)
    assert all(t.range_only for t in table.plan(query_type="incremental", begin=begin).tasks)
    got = table.read(query_type="incremental", begin=begin, filter=pc.field("_nbcc_commit_time") == third)
    assert _values(got) == {2: "B", 4: "d"}
    got = table.read(query_type="incremental", begin=begin, filter=pc.field("_nbcc_commit_time") == second)
    assert _values(got) == {3: "c"}


@pytest.mark.parametrize("pre_merge_key_set", [100_000, 0])
def test_incremental_read_filters_by_touched_keys_before_or_after_the_merge(tmp_path, monkeypatch,
                                                                            pre_merge_key_set):
    # An update that loses to an older record (smaller ts) makes the range not outrank the older
    # files, so the whole file group is merged and cut down to the keys the range touched:
    # before the merge for a small set of keys, after it for a huge one. Same rows either way.
    import nbcc.scan

    monkeypatch.setattr(nbcc.scan, "_PRE_MERGE_KEY_SET", pre_merge_key_set)
    table = nbcc.Table.create(str(tmp_path / "t"), KV_SCHEMA.append(pa.field("ts", pa.int64())), "id",
                              ordering_field="ts", buckets=1)
    first = table.write(pa.table({"id": [1, 2, 3, 4], "v": ["a", "b", "c", "d"], "ts": [5, 5, 5, 5]}))
    table.write(pa.table({"id": [1, 5], "v": ["stale", "e"], "ts": [1, 1]}))
    begin = next(i.completion for i in table.timeline() if i.instant == first)
    assert not any(t.range_only for t in table.plan(query_type="incremental", begin=begin).tasks)
    assert _values(table.read(query_type="incremental", begin=begin)) == {1: "a", 5: "e"}
    assert _values(table.read(query_type="incremental", begin=begin, filter=[("id", "=", 5)])) == {5: "e"}


_CDC_KEYS = {  # a key kind: (schema of the key columns, record_key, the key of row i)
    "int": ([pa.field("id", pa.int64())], ["id"], lambda i: {"id": i}),
    "string": ([pa.field("id", pa.string())], ["id"], lambda i: {"id": f"k{i:03d}"}),
    "date": ([pa.field("id", pa.date32())], ["id"],
             lambda i: {"id": datetime(2026, 1, 1).date() + timedelta(days=i)}),
    "composite": ([pa.field("id", pa.int64()), pa.field("sub", pa.string())], ["id", "sub"],
                  lambda i: {"id": i // 2, "sub": "ab"[i % 2]}),
}


@pytest.mark.parametrize("case", ["range-outranks", "stale-update", "overwrite"])
@pytest.mark.parametrize("pre_merge_key_set", [100_000, 0], ids=["filter-files", "filter-merged"])
@pytest.mark.parametrize("kind", list(_CDC_KEYS))
def test_cdc_of_a_few_changes_to_a_compacted_file_group_matches_the_states_at_begin_and_end(
        tmp_path, monkeypatch, kind, pre_merge_key_set, case):
    # A cdc read merges only the changed keys' records: the range's files alone when they
    # outrank the older ones, else every file cut down to the changed keys (before or after the
    # merge); after an overwrite, every key of the earlier state. Whichever way, each row must be
    # what the snapshots as of begin and end say, stamped with the last commit that touched it.
    import nbcc.scan

    monkeypatch.setattr(nbcc.scan, "_PRE_MERGE_KEY_SET", pre_merge_key_set)
    fields, record_key, key_of = _CDC_KEYS[kind]
    key_names = [f.name for f in fields]
    schema = pa.schema(fields + [pa.field("v", pa.string()), pa.field("ts", pa.int64())])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, record_key, ordering_field="ts", buckets=8)
    writes: list[tuple[str, list[int]]] = []  # the range's commits: (completion, ids written)

    def key(i: int) -> tuple:
        return tuple(key_of(i)[n] for n in key_names)

    def write(ids, v, ts, **kwargs) -> str:
        rows = pa.Table.from_pylist([{**key_of(i), "v": f"{v}{i}", "ts": ts} for i in ids], schema=schema)
        instant = table.write(rows, **kwargs)
        done = next(i.completion for i in table.timeline() if i.instant == instant)
        writes.append((done, list(ids)))
        return done

    write(range(40), "a", 5)
    assert table.compact() is not None
    begin = write([3, 4], "b", 6)
    writes.clear()
    # The range: upserts (updates, inserts), a delete, and per case a stale update or an overwrite.
    write([1, 7, 40, 41], "c", 7)
    overwrite = None
    if case == "stale-update":
        write([9], "old", 1)  # an older ts: it loses to the base's record of key 9
    if case == "overwrite":  # hides every earlier file; file groups with no new row are touched too
        overwrite = write([3, 50], "o", 8, mode="overwrite")
    write([7, 12, 50], "", 8, operation="delete")
    write([41], "d", 9)

    kwargs = {"query_type": "incremental", "begin": begin, "incremental_format": "cdc"}
    tasks = table.plan(**kwargs).tasks
    assert tasks and all(t.range_only for t in tasks) == (case == "range-outranks")
    assert all(t.reset_completion for t in tasks) == (case == "overwrite")
    if case == "overwrite":  # 7 keys written in the range, 8 buckets: a file group only the overwrite touched
        assert any(not t.range_files for t in tasks)

    def by_key(t: pa.Table) -> dict[tuple, dict]:
        return {tuple(r[k] for k in key_names): r for r in t.to_pylist()}

    before, after = by_key(table.read(as_of=begin)), by_key(table.read())
    last_write: dict[tuple, str] = {}
    for done, ids in writes:
        for i in ids:
            last_write[key(i)] = max(last_write.get(key(i), done), done)
    touched = dict(last_write)
    if overwrite is not None:  # it touched every earlier key; a key written before it changed last at it
        touched = {k: max(overwrite, last_write.get(k, overwrite)) for k in set(before) | set(last_write)}
    expected = {}
    for k, last in touched.items():
        old, new = before.get(k), after.get(k)
        if old != new:
            change = "insert" if old is None else "delete" if new is None else "update"
            expected[k] = (change, last, old, new)
    got = {tuple(r[k] for k in key_names): (r["_change_type"], r["_nbcc_completion_time"], r["before"], r["after"])
           for r in table.read(**kwargs).to_pylist()}
    assert got == expected
    # The changes, as the snapshots show them: not a vacuous comparison.
    kinds = sorted(v[0] for v in expected.values())
    if case == "overwrite":  # 39 of the 40 keys hidden, key 3 replaced, key 41 new
        assert kinds == ["delete"] * 39 + ["insert", "update"]
    else:
        assert kinds == ["delete", "delete", "insert", "insert", "update"]
    latest = by_key(table.read(query_type="incremental", begin=begin))
    assert latest == {k: after[k] for k in touched if k in after}


def test_a_cdc_read_takes_nan_for_unchanged_inside_nested_values_too(memory_uri):
    # §12.7: NaN equals NaN, and nested values compare element for element by the same rule.
    nan = float("nan")
    schema = pa.schema([("id", pa.int64()), ("x", pa.float64()), ("xs", pa.list_(pa.float64())),
                        ("s", pa.struct([("f", pa.float64())])), ("m", pa.map_(pa.string(), pa.float64()))])

    def rows(changed_f: float) -> pa.Table:
        return pa.Table.from_pylist([
            {"id": 1, "x": nan, "xs": [1.0, nan], "s": {"f": nan}, "m": [("k", nan)]},
            {"id": 2, "x": nan, "xs": [nan], "s": {"f": changed_f}, "m": [("k", nan)]},
        ], schema=schema)
    table = nbcc.Table.create(memory_uri, schema, "id")
    table.write(rows(nan))
    first = table.timeline()[-1].completion
    table.write(rows(1.0))  # key 1 written again unchanged; key 2's s.f from NaN to 1.0
    cdc = table.read(query_type="incremental", begin=first, incremental_format="cdc").to_pylist()
    assert [(r["id"], r["_change_type"], r["after"]["s"]["f"]) for r in cdc] == [(2, "update", 1.0)]


def test_a_time_past_year_9999_in_utc_is_an_option_error(memory_uri):
    table = nbcc.Table.create(memory_uri, pa.schema([("id", pa.int64())]), "id")
    table.write(pa.table({"id": [1]}))
    for kw in ({"as_of": "9999-12-31T23:00:00-05:00"},
               {"query_type": "incremental", "begin": "earliest", "end": "9999-12-31T20:00:00-04:00"}):
        with pytest.raises(nbcc.InvalidOptionError, match="after 9999-12-31T23:59:59.999Z"):
            table.read(**kw)
    assert table.read(as_of="9999-12-31T23:59:59.999Z").num_rows == 1  # the last time there is
