"""A file slice larger than the merge budget is merged in pieces spilled to local disk (issue 5,
scenario 9: memory must follow the budget, not the slice), with exactly the rows of a merge of
the whole slice.

The budget (`nbcc.reader.DEFAULT_MERGE_ROWS`) is set to a few dozen rows here so that small
tables take the spilled path; the expected rows come from test_merge's plain-Python reference of
the merge rules, fed with what each commit wrote, in commit order (the commits are sequential,
so log order is write order).
"""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

import nbcc
import nbcc.reader
from test_merge import reference

SCHEMA = pa.schema([("id", pa.int64()), ("ts", pa.int64()), ("a", pa.string()), ("b", pa.int64())])
BUDGET = 40
KEYS = 90


def _commit(rng: random.Random, mode: str) -> list[dict]:
    rows = []
    for k in rng.sample(range(KEYS), 45):  # unique keys within a commit
        kind = rng.random()
        if kind < 0.1:
            rows.append({"id": k, "ts": None, "deleted": True})  # natural delete
        elif kind < 0.2:
            rows.append({"id": k, "ts": rng.randint(0, 50), "deleted": True})
        else:
            partial = mode == "partial_update"
            rows.append({"id": k, "ts": rng.randint(0, 50),
                         "a": rng.choice([None, f"a{rng.randint(0, 999)}"]) if partial else f"a{rng.randint(0, 999)}",
                         "b": rng.choice([None, rng.randint(0, 999)]) if partial else rng.randint(0, 999)})
    return rows


def _arrow(rows: list[dict]) -> pa.Table:
    cols = {f.name: pa.array([r.get(f.name) for r in rows], f.type) for f in SCHEMA}
    cols["_nbcc_is_deleted"] = pa.array([bool(r.get("deleted")) for r in rows], pa.bool_())
    return pa.table(cols)


def _rows(table: nbcc.Table) -> list[dict]:
    return sorted(table.read().select(SCHEMA.names).to_pylist(), key=lambda r: r["id"])


@pytest.fixture
def pieces(monkeypatch) -> list[int]:
    """The row count of every spilled piece handed to the merge."""
    monkeypatch.setattr(nbcc.reader, "DEFAULT_MERGE_ROWS", BUDGET)
    seen: list[int] = []
    original = nbcc.reader._spilled_pieces

    def spy(*args, **kwargs):
        for piece in original(*args, **kwargs):
            seen.append(piece.num_rows)
            yield piece
    monkeypatch.setattr(nbcc.reader, "_spilled_pieces", spy)
    return seen


@pytest.mark.parametrize("mode", ["event_time", "commit_time", "partial_update"])
def test_a_slice_over_the_budget_merges_in_pieces_to_the_reference_rows(tmp_path, pieces, mode):
    rng = random.Random(f"bounded-{mode}")
    table = nbcc.Table.create(str(tmp_path / "t"), SCHEMA, "id", ordering_field="ts", buckets=1, merge_mode=mode)
    written: list[list[dict]] = []
    for _ in range(5):
        written.append(_commit(rng, mode))
        table.write(_arrow(written[-1]))
    slice_rows = sum(len(c) for c in written)

    assert _rows(table) == reference(written, mode, "ts")
    assert len(pieces) >= slice_rows // BUDGET - 1, "the read did not take the spilled path"
    assert max(pieces) < slice_rows // 2, f"a piece held most of the slice: {pieces} of {slice_rows}"
    # A key filter drops other keys' rows before they are spilled and merged.
    pieces.clear()
    low = table.read(filter=[("id", "<", KEYS // 3)]).select(SCHEMA.names).to_pylist()
    assert sorted(low, key=lambda r: r["id"]) == [r for r in reference(written, mode, "ts") if r["id"] < KEYS // 3]
    assert pieces and sum(pieces) < slice_rows // 2, f"rows of other keys were spilled: {pieces} of {slice_rows}"

    # Compaction merges in pieces too; later commits (some with older ordering values) still
    # merge with the compacted records exactly as with the records they replaced.
    pieces.clear()
    assert table.compact() is not None
    assert pieces, "compaction did not take the spilled path"
    for _ in range(2):
        written.append(_commit(rng, mode))
        table.write(_arrow(written[-1]))
    assert _rows(table) == reference(written, mode, "ts")


def test_a_live_base_file_over_the_budget_is_read_in_pieces_with_every_row(tmp_path, pieces):
    table = nbcc.Table.create(str(tmp_path / "t"), SCHEMA, "id", ordering_field="ts", buckets=1)
    ids = list(range(500))
    table.write(pa.table({"id": ids, "ts": [1] * 500, "a": [f"a{i}" for i in ids], "b": ids}, schema=SCHEMA))
    table.compact()
    plan = table.plan()
    assert [t.merged_already for t in plan.tasks] == [True]
    parts = list(nbcc.scan.iter_task(table.storage, plan, plan.tasks[0]))
    assert len(parts) > 1 and max(p.num_rows for p in parts) <= BUDGET
    assert sorted(pa.concat_tables(parts).column("id").to_pylist()) == ids
