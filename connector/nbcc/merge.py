"""Merging the records of one file slice by record key, vectorized over whole Arrow tables.

Input rows come in log order (base file first, then log files in log order, rows in file order);
that position is the tie-breaker everywhere. Per record key:

1. A delete with no ordering value (every delete in `commit_time` mode, and `operation=delete`
   without the ordering column) is ordered by log position alone: rows at or before the last such
   delete are dropped, and the delete itself stays as a candidate.
2. The remaining rows are ordered by (ordering value, log position); `commit_time` ignores the
   ordering value.
3. `event_time` / `commit_time`: the last row wins; if it is a delete, the key is gone.
   `partial_update`: rows up to the last delete are dropped; each column then takes its last
   non-null value, so writers that own different columns build one joined row.

One sort by (key, ordering, position) and NumPy segment reductions implement all of it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .config import COMMIT_TIME, PARTIAL_UPDATE
from .schema import IS_DELETED_COL, META_PREFIX

_POS = "__nbcc_pos"


def _group_starts(sorted_keys: Sequence[pa.ChunkedArray | pa.Array], n: int) -> np.ndarray:
    boundary = np.zeros(n, dtype=bool)
    boundary[0] = True
    for col in sorted_keys:
        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks()
        if pa.types.is_integer(col.type) or pa.types.is_date(col.type):
            values = col.to_numpy(zero_copy_only=False)
            boundary[1:] |= values[1:] != values[:-1]
        else:
            boundary[1:] |= pc.not_equal(col.slice(1), col.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    return boundary


def merge_records(rows: pa.Table, record_key: Sequence[str], ordering_field: str | None,
                  merge_mode: str) -> pa.Table:
    """The merged, live records of `rows` (one per key, deletes removed), sorted by key."""
    n = rows.num_rows
    if n == 0:
        return rows
    use_ordering = ordering_field is not None and merge_mode != COMMIT_TIME
    pos = np.arange(n, dtype=np.int64)
    keyed = rows.select(list(record_key) + ([ordering_field] if use_ordering else [])).append_column(
        _POS, pa.array(pos))
    sort_keys = [(k, "ascending", "at_start") for k in record_key]
    if use_ordering:
        sort_keys.append((ordering_field, "ascending", "at_start"))
    sort_keys.append((_POS, "ascending", "at_start"))
    order = pc.sort_indices(keyed, sort_keys=sort_keys).to_numpy()

    boundary = _group_starts([keyed.column(k).take(order) for k in record_key], n)
    starts = np.flatnonzero(boundary)
    group = np.cumsum(boundary) - 1
    at = np.arange(n, dtype=np.int64)  # position in sorted order

    deleted = rows.column(IS_DELETED_COL).fill_null(False).to_numpy(zero_copy_only=False)[order]
    natural = deleted
    if use_ordering:
        natural = deleted & keyed.column(ordering_field).is_null().to_numpy(zero_copy_only=False)[order]
    keep = np.ones(n, dtype=bool)
    if natural.any():
        log_pos = pos[order]
        last_natural = np.maximum.reduceat(np.where(natural, log_pos, -1), starts)
        keep = log_pos >= last_natural[group]

    winner = np.maximum.reduceat(np.where(keep, at, -1), starts)
    if merge_mode != PARTIAL_UPDATE:
        live = winner[~deleted[winner]]
        return rows.take(order[live])

    last_delete = np.maximum.reduceat(np.where(keep & deleted, at, -1), starts)
    alive = winner != last_delete
    after_delete = keep & (at > last_delete[group])
    result = rows.take(order[winner[alive]])
    for name in rows.column_names:
        if name in record_key or name.startswith(META_PREFIX):
            continue  # keys are equal within a group; meta columns come from the winner
        col = rows.column(name).take(order)
        valid = after_delete & col.is_valid().to_numpy(zero_copy_only=False)
        last = np.maximum.reduceat(np.where(valid, at, -1), starts)[alive]
        indices = pa.array(last, mask=last < 0)
        result = result.set_column(result.schema.get_field_index(name), name, col.take(indices))
    return result
