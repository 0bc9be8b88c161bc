"""Merging the records of one file slice (nbcc.merge.merge_records).

Input rows are hand-built Arrow tables in log order, as the reader builds them: one table per file
(base file first, then logs in log order) concatenated, with the meta columns of schema.py. The
expected rows are written out by hand, and a randomized test compares against a plain-Python
reference of the merge rules written from the spec.
"""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from nbcc.merge import merge_records
from nbcc.schema import COMMIT_TIME_COL, IS_DELETED_COL, RECORD_KEY_COL

DATA = pa.schema([("id", pa.int64()), ("ts", pa.int64()), ("a", pa.string()), ("b", pa.int64())])
INSTANTS = ["20240101000000001", "20240101000000002", "20240101000000003", "20240101000000004"]


def files(*file_rows, schema: pa.Schema = DATA, key=("id",)) -> pa.Table:
    """One Arrow table per file, concatenated in log order. Each row is a dict of data columns
    plus an optional "deleted" flag."""
    tables = []
    for i, rows in enumerate(file_rows):
        cols = {f.name: pa.array([r.get(f.name) for r in rows], f.type) for f in schema}
        cols[COMMIT_TIME_COL] = pa.array([INSTANTS[i % len(INSTANTS)]] * len(rows), pa.string())
        cols[RECORD_KEY_COL] = pa.array([",".join(str(r.get(k)) for k in key) for r in rows], pa.string())
        cols[IS_DELETED_COL] = pa.array([bool(r.get("deleted", False)) for r in rows], pa.bool_())
        tables.append(pa.table(cols))
    return pa.concat_tables(tables)  # several chunks, as the reader produces


def merged(rows: pa.Table, mode: str, key=("id",), ordering="ts", cols=None) -> list[dict]:
    out = merge_records(rows, list(key), ordering, mode)
    cols = cols or [c for c in out.column_names if not c.startswith("_nbcc_")]
    got = out.select(cols).to_pylist()
    return sorted(got, key=lambda r: tuple(r[k] for k in key))


def up(id, ts, a=None, b=None, **kw):
    return {"id": id, "ts": ts, "a": a, "b": b, **kw}


def delete(id, ts=None):
    return {"id": id, "ts": ts, "deleted": True}


# -- event_time ---------------------------------------------------------------------------------

def test_event_time_greatest_ordering_value_wins_across_files():
    rows = files(
        [up(1, 10, "v1-f1"), up(2, 5, "v2-f1"), up(3, 7, "v3-f1")],
        [up(1, 9, "v1-f2"), up(2, 6, "v2-f2")],          # 1: older event arrives later: loses
        [up(3, 3, "v3-f3"), up(4, 1, "v4-f3")],
    )
    assert merged(rows, "event_time") == [
        up(1, 10, "v1-f1"), up(2, 6, "v2-f2"), up(3, 7, "v3-f1"), up(4, 1, "v4-f3"),
    ]


def test_event_time_ties_go_to_the_later_record_in_log_order_and_within_a_file():
    rows = files(
        [up(1, 5, "first"), up(2, 5, "x-row1"), up(2, 5, "x-row2")],
        [up(1, 5, "second")],
        [up(1, 4, "older")],
    )
    assert merged(rows, "event_time") == [up(1, 5, "second"), up(2, 5, "x-row2")]


def test_event_time_keeps_the_winners_meta_columns():
    rows = files([up(1, 9, "a")], [up(1, 2, "b")], [up(1, 9, "c")])
    out = merge_records(rows, ["id"], "ts", "event_time")
    assert out.column(COMMIT_TIME_COL).to_pylist() == [INSTANTS[2]]
    assert out.column(IS_DELETED_COL).to_pylist() == [False]


# -- commit_time --------------------------------------------------------------------------------

def test_commit_time_last_row_wins_regardless_of_ordering():
    rows = files(
        [up(1, 100, "f1"), up(2, 1, "x")],
        [up(1, 1, "f2")],
        [up(2, 0, "y-row1"), up(2, -5, "y-row2")],
    )
    assert merged(rows, "commit_time") == [up(1, 1, "f2"), up(2, -5, "y-row2")]
    # Without an ordering field at all.
    assert merged(rows, "commit_time", ordering=None) == [up(1, 1, "f2"), up(2, -5, "y-row2")]


def test_commit_time_deletes_win_over_earlier_rows_and_lose_to_later_ones():
    rows = files(
        [up(1, 5, "a"), up(2, 5, "b"), up(3, 5, "c")],
        [delete(1, 1), delete(2, 9)],      # an ordering value does not matter in commit_time
        [up(2, 1, "b-again")],
    )
    assert merged(rows, "commit_time") == [up(2, 1, "b-again"), up(3, 5, "c")]


# -- deletes under event_time -------------------------------------------------------------------

def test_a_delete_with_an_ordering_value_obeys_the_ordering_rule():
    rows = files(
        [up(1, 10, "keep"), up(2, 10, "gone"), up(3, 10, "tie-gone"), up(4, 10, "v")],
        [delete(1, 9), delete(2, 11), delete(3, 10)],  # older, newer, tie (later wins)
        [up(4, 12, "w")],
        [delete(4, 11)],                               # older than the upsert before it
    )
    assert merged(rows, "event_time") == [up(1, 10, "keep"), up(4, 12, "w")]


def test_natural_deletes_win_over_earlier_rows_and_lose_to_later_ones():
    rows = files(
        [up(1, 100, "a"), up(2, 100, "b"), up(3, 100, "c")],
        [delete(1), delete(2)],               # null ordering value: a natural delete
        [up(2, 1, "b-after")],                # later in log order, even with a small ordering value
    )
    assert merged(rows, "event_time") == [up(2, 1, "b-after"), up(3, 100, "c")]


def test_a_key_deleted_then_reinserted_is_live_with_the_new_values():
    for mode in ("event_time", "commit_time", "partial_update"):
        rows = files(
            [up(1, 1, "old", 10)],
            [delete(1, 2)],
            [up(1, 3, "new", 30)],
        )
        assert merged(rows, mode) == [up(1, 3, "new", 30)], mode


def test_a_key_that_is_only_deleted_is_absent():
    for mode in ("event_time", "commit_time", "partial_update"):
        assert merged(files([delete(7)], [delete(7, 3)]), mode) == [], mode


def test_is_deleted_null_means_not_deleted():
    rows = files([up(1, 1, "x")])
    rows = rows.set_column(rows.schema.get_field_index(IS_DELETED_COL), IS_DELETED_COL,
                           pa.array([None], pa.bool_()))
    assert merged(rows, "event_time") == [up(1, 1, "x")]


# -- partial_update -----------------------------------------------------------------------------

def test_partial_update_two_writers_owning_columns_build_one_joined_row():
    rows = files(
        [up(1, 5, a="from-A"), up(2, 5, a="A2")],   # writer A owns column a
        [up(1, 3, b=42), up(2, 6, b=7)],            # writer B owns column b
    )
    assert merged(rows, "partial_update") == [up(1, 5, "from-A", 42), up(2, 6, "A2", 7)]


def test_partial_update_later_non_null_values_by_ordering_then_log_order_overwrite():
    rows = files(
        [up(1, 1, "a1", 1)],
        [up(1, 9, "a9", None)],     # newest by ordering: a wins, b stays
        [up(1, 5, "a5", 5)],        # arrives last but older than ts=9: only fills nothing newer
        [up(1, 9, None, 99)],       # ties with ts=9, later in log order: b overwrites
    )
    assert merged(rows, "partial_update") == [up(1, 9, "a9", 99)]


def test_partial_update_without_ordering_field_uses_log_order():
    rows = files([up(1, 9, "a1", 1)], [up(1, 1, None, 2)], [up(1, None, "a3", None)])
    assert merged(rows, "partial_update", ordering=None) == [up(1, 1, "a3", 2)]


def test_partial_update_a_delete_drops_the_values_before_it():
    rows = files(
        [up(1, 1, "old-a", 11), up(2, 1, "keep-a", 22)],
        [delete(1, 2), delete(2, 0)],            # 2: older-ordered delete loses
        [up(1, 3, b=33)],                        # a re-insert carrying only b
    )
    assert merged(rows, "partial_update") == [up(1, 3, None, 33), up(2, 1, "keep-a", 22)]


def test_partial_update_natural_delete_then_later_update():
    rows = files([up(1, 50, "a", 1)], [delete(1)], [up(1, 2, b=3)])
    assert merged(rows, "partial_update") == [up(1, 2, None, 3)]


# -- keys ---------------------------------------------------------------------------------------

def test_multi_column_record_keys():
    schema = pa.schema([("k1", pa.string()), ("k2", pa.int32()), ("ts", pa.int64()), ("v", pa.string())])
    key = ("k1", "k2")
    rows = files(
        [{"k1": "x", "k2": 1, "ts": 1, "v": "x1"}, {"k1": "x", "k2": 2, "ts": 1, "v": "x2"},
         {"k1": "y", "k2": 1, "ts": 1, "v": "y1"}],
        [{"k1": "x", "k2": 2, "ts": 2, "v": "x2-new"}, {"k1": "y", "k2": 1, "ts": 0, "v": "y1-old"},
         {"k1": "y", "k2": 2, "ts": 0, "v": "y2"}],
        [{"k1": "x", "k2": 1, "deleted": True}],
        schema=schema, key=key,
    )
    assert merged(rows, "event_time", key=key) == [
        {"k1": "x", "k2": 2, "ts": 2, "v": "x2-new"},
        {"k1": "y", "k2": 1, "ts": 1, "v": "y1"},
        {"k1": "y", "k2": 2, "ts": 0, "v": "y2"},
    ]


def test_string_keys_including_non_ascii_and_prefixes():
    schema = pa.schema([("id", pa.string()), ("ts", pa.int64()), ("a", pa.string()), ("b", pa.int64())])
    rows = files(
        [up("a", 1, "1"), up("ab", 1, "2"), up("é", 1, "3"), up("", 1, "4")],
        [up("a", 2, "1b"), up("é", 0, "3b"), up("𝄞", 1, "5")],
        schema=schema,
    )
    assert merged(rows, "event_time") == [
        up("", 1, "4"), up("a", 2, "1b"), up("ab", 1, "2"), up("é", 1, "3"), up("𝄞", 1, "5"),
    ]


def test_the_result_has_one_row_per_live_key_in_key_order():
    rows = files([up(3, 1, "c"), up(1, 1, "a")], [up(2, 1, "b"), up(3, 2, "c2")])
    out = merge_records(rows, ["id"], "ts", "event_time")
    assert out.column("id").to_pylist() == [1, 2, 3]
    assert out.schema == rows.schema


def test_empty_input():
    empty = files([])
    for mode in ("event_time", "commit_time", "partial_update"):
        out = merge_records(empty, ["id"], "ts", mode)
        assert out.num_rows == 0
        assert out.schema == empty.schema


# -- randomized, against a plain-Python reference ----------------------------------------------

def reference(file_rows: list[list[dict]], mode: str, ordering: str | None) -> list[dict]:
    """The merge rules of the spec, one key at a time, in plain Python."""
    by_key: dict = {}
    pos = 0
    for rows in file_rows:
        for r in rows:
            by_key.setdefault(r["id"], []).append((pos, r))
            pos += 1
    out = []
    for key, recs in by_key.items():
        use_ordering = ordering is not None and mode != "commit_time"
        # A delete without an ordering value replaces everything before it in log order.
        natural = [p for p, r in recs if r.get("deleted") and (not use_ordering or r[ordering] is None)]
        if natural:
            recs = [(p, r) for p, r in recs if p >= natural[-1]]
        if use_ordering:
            # Natural deletes sort as the oldest value: every later record beats them.
            recs = sorted(recs, key=lambda pr: (pr[1][ordering] is not None, pr[1][ordering] or 0, pr[0]))
        last = recs[-1][1]
        if last.get("deleted"):
            continue
        if mode != "partial_update":
            out.append({k: last.get(k) for k in ("id", "ts", "a", "b")})
            continue
        after = recs
        deletes = [i for i, (_, r) in enumerate(recs) if r.get("deleted")]
        if deletes:
            after = recs[deletes[-1] + 1:]
        row = {"id": key}
        for col in ("ts", "a", "b"):
            vals = [r[col] for _, r in after if r.get(col) is not None]
            row[col] = vals[-1] if vals else None
        out.append(row)
    return sorted(out, key=lambda r: r["id"])


@pytest.mark.parametrize("mode", ["event_time", "commit_time", "partial_update"])
def test_random_slices_match_a_plain_python_reference(mode):
    rng = random.Random(20240501)
    for _ in range(60):
        file_rows = []
        for _ in range(rng.randint(1, 4)):
            rows = []
            for _ in range(rng.randint(0, 12)):
                k = rng.randint(0, 6)
                kind = rng.random()
                if kind < 0.15:
                    rows.append(delete(k))
                elif kind < 0.3:
                    rows.append(delete(k, rng.randint(-3, 5)))
                else:  # negative values too: a null ordering value sorts below every one of them
                    rows.append(up(k, rng.randint(-3, 5),
                                   rng.choice([None, f"a{rng.randint(0, 99)}"]),
                                   rng.choice([None, rng.randint(0, 99)])))
            file_rows.append(rows)
        rows = files(*file_rows)
        assert merged(rows, mode) == reference(file_rows, mode, "ts"), file_rows


# -- compaction: what a base file keeps must merge like everything it replaced ------------------

def _with_instants(file_rows: list[list[dict]], instants: list[str]) -> pa.Table:
    tables = []
    for rows, instant in zip(file_rows, instants):
        t = files(rows)
        tables.append(t.set_column(t.schema.get_field_index(COMMIT_TIME_COL), COMMIT_TIME_COL,
                                   pa.array([instant] * len(rows), pa.string())))
    return pa.concat_tables(tables) if tables else files([])


@pytest.mark.parametrize("mode", ["event_time", "partial_update"])
def test_a_late_natural_delete_between_the_winner_and_a_lower_ranked_later_record(mode):
    # The compaction sees A (instant 1, ts 4) and B (instant 3, ts 2): A wins. A commit with
    # instant 2 that completes after the compaction deletes the key: in log order that removes A
    # and leaves B, which must then win; a base file holding only A would lose the key.
    early = _with_instants([[up(1, 4, "A")], [up(1, 2, "B")]], ["20240101000000001", "20240101000000003"])
    late = _with_instants([[delete(1)]], ["20240101000000002"])
    base = merge_records(early, ["id"], "ts", mode, compact=True)
    assert merged(pa.concat_tables([base, late]), mode) == [up(1, 2, "B")]


@pytest.mark.parametrize("mode", ["event_time", "commit_time", "partial_update"])
def test_compacted_records_merge_like_the_records_they_replace_with_any_late_commits(mode):
    """Commits with any instants complete after the compaction (late), as RFC-66 allows: the
    base file plus the late commits must merge like all the original records."""
    rng = random.Random(f"compact-late-{mode}")
    for _ in range(400):
        n_files = rng.randint(2, 6)
        instants = sorted(f"202401010000000{i:02d}" for i in rng.sample(range(100), n_files))
        file_rows = []
        for _ in range(n_files):
            rows = []
            for k in rng.sample(range(5), rng.randint(1, 5)):
                kind = rng.random()
                if kind < 0.2:
                    rows.append(delete(k))
                elif kind < 0.3:
                    rows.append(delete(k, rng.randint(0, 9)))
                else:
                    rows.append(up(k, rng.randint(0, 9), rng.choice([None, f"a{rng.randint(0, 99)}"]),
                                   rng.choice([None, rng.randint(0, 99)])))
            file_rows.append(rows)
        late = sorted(rng.sample(range(n_files), rng.randint(1, n_files - 1)))
        early = [i for i in range(n_files) if i not in late]
        everything = _with_instants(file_rows, instants)
        assert merged(everything, mode) == reference(file_rows, mode, "ts")
        # Not knowing which instants may complete late (None), and knowing it: the late commits
        # were the pending ones, so the earliest of them bounds what the base must keep.
        for late_after in (None, instants[late[0]]):
            base = merge_records(_with_instants([file_rows[i] for i in early], [instants[i] for i in early]),
                                 ["id"], "ts", mode, compact=True, late_after=late_after)
            after = pa.concat_tables([base, _with_instants([file_rows[i] for i in late],
                                                           [instants[i] for i in late])])
            assert merged(after, mode) == merged(everything, mode), (file_rows, instants, late, late_after)


@pytest.mark.parametrize("mode", ["event_time", "partial_update"])
def test_with_nothing_pending_a_stale_record_is_not_kept(mode):
    # A stale update (smaller ts, later instant) loses to the winner. If no write was pending when
    # the compaction was planned, no late delete can separate them, so the base keeps the winner.
    early = _with_instants([[up(1, 4, "A")], [up(1, 2, "B")]], ["20240101000000001", "20240101000000003"])
    everything_kept = merge_records(early, ["id"], "ts", mode, compact=True)
    bounded = merge_records(early, ["id"], "ts", mode, compact=True, late_after="20240101000000009")
    assert sorted(everything_kept.column("a").to_pylist()) == ["A", "B"]
    assert bounded.column("a").to_pylist() == ["A"]
