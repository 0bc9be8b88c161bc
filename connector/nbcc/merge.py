"""Merging the records of one file slice by record key, vectorized over whole Arrow tables.

Log order is RFC-66's: a record's commit instant first, then its position (base file first, then
log files by instant, version and token, rows in file order). Ordering by the record's own instant
(`_nbcc_commit_time`, which base files keep per row) makes a merge give the same answer whether or
not a compaction folded some of the records into a base file, even when a commit with an older
instant completes after the compaction. Per record key:

1. A delete with no ordering value (every delete in `commit_time` mode, and `operation=delete`
   without the ordering column) is ordered by log order alone: rows at or before the last such
   delete are dropped, and the delete itself stays as a candidate.
2. The remaining rows are ordered by (ordering value, log order); `commit_time` ignores the
   ordering value.
3. `event_time` / `commit_time`: the last row wins; if it is a delete, the key is gone.
   `partial_update`: rows up to the last delete are dropped; each column then takes its last
   non-null value, so writers that own different columns build one joined row.

`compact=True` returns instead the records that merge to the same result together with any
records that complete later (what compaction writes): per key the last natural delete and the
winner (`partial_update`: the last delete and, per column, the record holding its last non-null
value), less the natural deletes older than `late_after` (no commit still to come can be
older than them, so they decide nothing more). A commit that completes after the compaction can
have an older instant than records it
folded, so one of its natural deletes can cut the log between them: with A (instant 1, ts 4) and
B (instant 3, ts 2), A wins, but a late natural delete at instant 2 removes A and B must win. So
from `late_after` on (the earliest instant still pending when the compaction was planned) it
also keeps every record that outranks all records after it in log order (the winner of some
suffix; in `partial_update` also per column and among deletes). With ordering values that grow
with log order those are the winners anyway.

One sort by (key, ordering, log order) and NumPy segment reductions implement all of it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .config import COMMIT_TIME, PARTIAL_UPDATE
from .schema import COMMIT_TIME_COL, IS_DELETED_COL, META_PREFIX

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


def one_row_per_key(merged: pa.Table, record_key: Sequence[str]) -> bool:
    """Whether `merged` (a merge's output: sorted by key, so a key's rows are adjacent) holds
    no key twice. Neighbours are compared, with no hash table of the keys."""
    n = merged.num_rows
    return n < 2 or bool(_group_starts([merged.column(k) for k in record_key], n).all())


def _log_order(rows: pa.Table) -> np.ndarray:
    """Each row's rank in log order: (its commit instant, its position)."""
    n = rows.num_rows
    pos = np.arange(n, dtype=np.int64)
    if COMMIT_TIME_COL not in rows.column_names:
        return pos
    instants = rows.column(COMMIT_TIME_COL)
    if pa.types.is_dictionary(instants.type):  # as the reader read it from Parquet (reader.py)
        codes = instants.unify_dictionaries().combine_chunks()
    else:
        codes = instants.combine_chunks().dictionary_encode()
    if len(codes.dictionary) <= 1:
        return pos
    rank_of_code = np.argsort(np.argsort(codes.dictionary.to_numpy(zero_copy_only=False), kind="stable"))
    return rank_of_code[codes.indices.to_numpy(zero_copy_only=False)].astype(np.int64) * n + pos


def _sorted_groups(keyed: pa.Table, record_key: Sequence[str], ordering_field: str | None,
                   pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The permutation that sorts `keyed` by (key, ordering, log order), nulls first, and the
    mask of the rows (in sorted order) that start a key."""
    order = _numpy_order(keyed, record_key, ordering_field, pos)
    if order is not None:
        return order, _group_starts([keyed.column(record_key[0]).take(order)], len(order))
    sort_keys = [(k, "ascending", "at_start") for k in record_key]
    if ordering_field is not None:
        sort_keys.append((ordering_field, "ascending", "at_start"))
    sort_keys.append((_POS, "ascending", "at_start"))
    order = pc.sort_indices(keyed, sort_keys=sort_keys).to_numpy()
    return order, _group_starts([keyed.column(k).take(order) for k in record_key], len(order))


def _numpy_order(keyed: pa.Table, record_key: Sequence[str], ordering_field: str | None,
                 pos: np.ndarray) -> np.ndarray | None:
    """The sort as one NumPy lexsort, for the common table whose key is one integer column
    (never null) and whose ordering field, if used, is an integer (nulls first, as Arrow sorts
    them "at_start"); about twice as fast as Arrow's multi-key sort. None for other tables."""
    if len(record_key) != 1 or not pa.types.is_integer(keyed.schema.field(record_key[0]).type):
        return None
    key_col = keyed.column(record_key[0])
    if key_col.null_count:
        return None
    columns = [pos]
    if ordering_field is not None:
        ordering = keyed.column(ordering_field)
        if not pa.types.is_integer(ordering.type):
            return None
        if ordering.null_count:
            valid = ordering.is_valid().to_numpy(zero_copy_only=False)
            columns += [ordering.fill_null(0).to_numpy(), valid]
        else:
            columns.append(ordering.to_numpy())
    columns.append(key_col.to_numpy())
    return np.lexsort(columns)  # the last column is the primary key


def merge_records(rows: pa.Table, record_key: Sequence[str], ordering_field: str | None,
                  merge_mode: str, compact: bool = False, late_after: str | None = None) -> pa.Table:
    """The merged, live records of `rows` (one per key, deletes removed), sorted by key; or, with
    `compact`, the records a base file must keep (see the module docstring). `late_after`: the
    earliest instant that may still complete with an instant older than these records' (None:
    any); a late natural delete cuts the log at or after it, so earlier records need no more than
    the winner."""
    n = rows.num_rows
    if n == 0:
        return rows
    use_ordering = ordering_field is not None and merge_mode != COMMIT_TIME
    pos = _log_order(rows)
    keyed = rows.select(list(record_key) + ([ordering_field] if use_ordering else [])).append_column(
        _POS, pa.array(pos))
    order, boundary = _sorted_groups(keyed, record_key, ordering_field if use_ordering else None, pos)
    starts = np.flatnonzero(boundary)
    deleted = rows.column(IS_DELETED_COL).fill_null(False).to_numpy(zero_copy_only=False)[order]
    natural = deleted
    if use_ordering:
        natural = deleted & keyed.column(ordering_field).is_null().to_numpy(zero_copy_only=False)[order]
    has_natural = bool(natural.any())
    if merge_mode != PARTIAL_UPDATE and not compact and not has_natural:
        # The usual read: every row is a candidate, so each key's last row (in sorted order)
        # wins; no per-row group numbers or segment reductions are needed (12% of a
        # merge-on-read task's time).
        winner = np.append(starts[1:], n) - 1
        return rows.take(order[winner[~deleted[winner]]])

    group = np.cumsum(boundary) - 1
    at = np.arange(n, dtype=np.int64)  # position in sorted order
    keep = np.ones(n, dtype=bool)
    natural_at = np.full(len(starts), -1, dtype=np.int64)  # the last natural delete, in sorted order
    if has_natural:
        log_pos = pos[order]
        last_natural = np.maximum.reduceat(np.where(natural, log_pos, -1), starts)
        keep = log_pos >= last_natural[group]
        natural_at = np.maximum.reduceat(np.where(natural & (log_pos == last_natural[group]), at, -1), starts)

    winner = np.maximum.reduceat(np.where(keep, at, -1), starts)
    if merge_mode != PARTIAL_UPDATE:
        if compact:
            late = _late_cut_winners(rows, order, pos, group, keep, deleted, record_key, merge_mode, late_after)
            kept = _union(natural_at, winner, late)
            return rows.take(order[_without_settled_deletes(kept, rows, order, natural, late_after)])
        live = winner[~deleted[winner]]
        return rows.take(order[live])

    last_delete = np.maximum.reduceat(np.where(keep & deleted, at, -1), starts)
    after_delete = keep & (at > last_delete[group])
    data_columns = [c for c in rows.column_names if c not in record_key and not c.startswith(META_PREFIX)]
    lasts = {}
    for name in data_columns:
        valid = after_delete & rows.column(name).is_valid().to_numpy(zero_copy_only=False)[order]
        lasts[name] = np.maximum.reduceat(np.where(valid, at, -1), starts)
    if compact:
        late = _late_cut_winners(rows, order, pos, group, keep, deleted, record_key, merge_mode, late_after)
        kept = _union(natural_at, last_delete, winner, *lasts.values(), late)
        return rows.take(order[_without_settled_deletes(kept, rows, order, natural, late_after)])
    alive = winner != last_delete
    result = rows.take(order[winner[alive]])
    for name in data_columns:  # keys are equal within a group; meta columns come from the winner
        last = lasts[name][alive]
        col = rows.column(name).take(order)
        result = result.set_column(result.schema.get_field_index(name), name,
                                   col.take(pa.array(last, mask=last < 0)))
    return result


def _late_cut_winners(rows: pa.Table, order: np.ndarray, pos: np.ndarray, group: np.ndarray, keep: np.ndarray,
                      deleted: np.ndarray, record_key: Sequence[str], merge_mode: str,
                      late_after: str | None) -> np.ndarray:
    """Positions (in rank order) of the records that win once a late natural delete cuts the log
    somewhere at or after `late_after`: every record from there on that outranks all records
    after it in log order (per column and among deletes too in `partial_update`)."""
    n = len(order)
    eligible = keep
    if late_after is not None:
        eligible = keep & pc.greater_equal(rows.column(COMMIT_TIME_COL), late_after).to_numpy(
            zero_copy_only=False)[order]
    if not eligible.any():
        return np.empty(0, dtype=np.int64)
    # Each group's records in log order; a record's rank is its position in rank order.
    by_log = np.lexsort((pos[order], group))
    # Shifting each group's ranks below the previous group's makes one reverse running maximum
    # over the whole array act per group.
    shifted = (np.arange(n, dtype=np.int64) - group.astype(np.int64) * n)[by_log]
    floor = np.iinfo(np.int64).min

    def suffix_winners(mask: np.ndarray) -> np.ndarray:
        values = np.where(mask[by_log], shifted, floor)
        best_from_here = np.maximum.accumulate(values[::-1])[::-1]
        return by_log[mask[by_log] & (values == best_from_here)]

    kept = [suffix_winners(eligible)]
    if merge_mode == PARTIAL_UPDATE:
        kept.append(suffix_winners(eligible & deleted))
        for name in rows.column_names:
            if name not in record_key and not name.startswith(META_PREFIX):
                kept.append(suffix_winners(eligible & rows.column(name).is_valid().to_numpy(zero_copy_only=False)[order]))
    return np.concatenate(kept)


def _without_settled_deletes(kept: np.ndarray, rows: pa.Table, order: np.ndarray, natural: np.ndarray,
                             late_after: str | None) -> np.ndarray:
    """`kept` (positions in rank order) less the natural deletes older than `late_after`. Every
    commit still to come has a newer instant, so it outranks such a delete whatever it holds: the
    delete decides nothing any more, and keeping it would carry it from base file to base file
    (and keep the file from being `live`). Deletes with an ordering value stay: a later row with
    a smaller one must still lose to them."""
    if late_after is None or not natural.any():
        return kept
    older = pc.less(rows.column(COMMIT_TIME_COL), late_after).to_numpy(zero_copy_only=False)[order]
    return kept[~(natural[kept] & older[kept])]


def _union(*positions: np.ndarray) -> np.ndarray:
    """The distinct valid (>= 0) positions, ascending (so records stay in merge order)."""
    allpos = np.concatenate(positions)
    return np.unique(allpos[allpos >= 0])
