"""Reading data files: open them, align them to the table's schema, and merge them by key.

Which files to read is decided by `scan.py` from the timeline. Every committed file must be
readable: a missing or corrupt one fails the read and names the file, so rows are never silently
dropped.

Memory stays bounded by `merge_rows`, not by the size of a file slice: a slice with more rows
than that is split into pieces of about `merge_rows` rows, spilled to local temporary Arrow IPC
files, and each piece is merged on its own (every record of a key lands in one piece, in log
order, so each piece merges exactly as the whole slice would). Results come out piece by piece.
Reads split by a hash of the key. Compaction splits by ranges of the first record key column,
cut at quantiles of a sample of it and handed back in key order, so that its base file is in
key order as a whole (a lookup then decodes one of its row groups); where that column cannot be
cut evenly (one value holds too many rows), or a range turns out larger than the sample said,
the hash splits them instead.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .buckets import java_list_hash
from .config import TableConfig
from .errors import DataFileError, StorageError
from .expr import Predicate, conjunction, stat_value
from .filenames import data_file_path
from .merge import merge_records
from .schema import COMMIT_TIME_COL, IS_DELETED_COL, META_FIELDS, file_schema, null_array
from .storage import Storage, is_not_found

# A merge holds about 300 bytes per row of a 5-column table (rows, sort keys, permutation); 2M
# rows keep one merging task well under 1 GB. Slices above it are merged in spilled pieces.
DEFAULT_MERGE_ROWS = 2_000_000
_SPILL_BATCH_ROWS = 128 * 1024
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: spreads hashes that share low bits
# Range pieces: sampled keys per piece (its quantiles put about 1% error on a piece's
# size), and the most a piece may hold, as a multiple of its share, before hashing is used.
_SAMPLE_PER_PIECE = 8192
_MAX_PIECE_SHARE = 1.25


def _fail(storage: Storage, rel: str, exc: Exception) -> DataFileError:
    if isinstance(exc, StorageError):  # transient errors that outlasted the retries
        return DataFileError(
            f"committed data file {storage.full_path(rel)} could not be read ({exc}); the read "
            "stopped so that no rows are silently dropped. The storage kept failing: run the read again."
        )
    what = "is missing" if is_not_found(exc) else "cannot be read"
    return DataFileError(
        f"committed data file {storage.full_path(rel)} {what} ({exc}); the read stopped so that "
        "no rows are silently dropped. Restore the file or roll the table back."
    )


def _read_parquet(storage: Storage, partition: str, name: str, columns: Sequence[str],
                  size: int | None = None) -> pa.Table:
    """Those of `columns` the file has (a column added to the table later is absent from older
    files). `size`: its size in bytes if known (Storage.open_parquet)."""
    rel = data_file_path(partition, name)
    try:
        with storage.open_parquet(rel, size) as pf:
            present = set(pf.schema_arrow.names)
            return pf.read(columns=[c for c in columns if c in present])
    except Exception as exc:  # noqa: BLE001 - every failure must name the file
        raise _fail(storage, rel, exc) from exc


class _DataFile:
    """One open data file: its row count from the footer, then its rows whole or in batches.
    With `prune_by`, only the row groups whose Parquet statistics let them hold a matching row
    are read (and counted in `rows`). `size`: its size in bytes if known (Storage.open_parquet)."""

    def __init__(self, storage: Storage, partition: str, name: str, stack: contextlib.ExitStack,
                 read_dictionary: Sequence[str] | None = None, prune_by: Sequence[Predicate] = (),
                 size: int | None = None):
        self.storage, self.rel = storage, data_file_path(partition, name)
        try:
            self.pf = stack.enter_context(storage.open_parquet(self.rel, size, read_dictionary=read_dictionary))
            self.row_groups = _row_groups_to_read(self.pf.metadata, prune_by)
        except Exception as exc:  # noqa: BLE001
            raise _fail(storage, self.rel, exc) from exc
        md = self.pf.metadata
        self.rows = md.num_rows if self.row_groups is None else sum(md.row_group(i).num_rows for i in self.row_groups)

    def _columns(self, columns: Sequence[str] | None) -> list[str] | None:
        if columns is None:
            return None
        present = set(self.pf.schema_arrow.names)
        return [c for c in columns if c in present]

    def read(self, columns: Sequence[str] | None = None) -> pa.Table:
        try:
            if self.row_groups is None:
                return self.pf.read(columns=self._columns(columns))
            return self.pf.read_row_groups(self.row_groups, columns=self._columns(columns))
        except Exception as exc:  # noqa: BLE001
            raise _fail(self.storage, self.rel, exc) from exc

    def batches(self, columns: Sequence[str] | None = None, rows: int = _SPILL_BATCH_ROWS) -> Iterator[pa.Table]:
        try:
            for batch in self.pf.iter_batches(batch_size=rows, row_groups=self.row_groups,
                                              columns=self._columns(columns)):
                yield pa.Table.from_batches([batch])
        except Exception as exc:  # noqa: BLE001
            raise _fail(self.storage, self.rel, exc) from exc


# Files of one file group opened at once on an object store, where opening a small log file is
# one request of tens of ms (its footer read, which fetches all of a small file).
_OPEN_THREADS = 8


def _open_files(storage: Storage, partition: str, files: Sequence[str], stack: contextlib.ExitStack,
                key_predicates: Sequence[Predicate], sizes: Mapping[str, int]) -> list[_DataFile]:
    """`_DataFile`s of `files`, in their order, closed with `stack`. Local files one after the
    other (an open is a system call); others up to _OPEN_THREADS at a time. If one fails, those
    opened are closed and the first failure in file order is raised."""
    def open_one(name: str, into: contextlib.ExitStack) -> _DataFile:
        return _DataFile(storage, partition, name, into, [COMMIT_TIME_COL], key_predicates, sizes.get(name))

    if storage.is_local or len(files) < 2:
        return [open_one(n, stack) for n in files]
    from concurrent.futures import ThreadPoolExecutor

    def opened_alone(name: str) -> tuple[_DataFile | None, contextlib.ExitStack, BaseException | None]:
        own = contextlib.ExitStack()
        try:
            return open_one(name, own), own, None
        except BaseException as exc:  # noqa: BLE001 - raised below, in file order
            own.close()
            return None, own, exc

    with ThreadPoolExecutor(max_workers=min(_OPEN_THREADS, len(files)), thread_name_prefix="nbcc-open") as pool:
        results = list(pool.map(opened_alone, files))
    for _, own, _ in results:
        stack.enter_context(own)  # each file closes with the stack, opened or not
    failure = next((exc for _, _, exc in results if exc is not None), None)
    if failure is not None:
        raise failure
    return [f for f, _, _ in results if f is not None]


def _row_groups_to_read(metadata: pq.FileMetaData, predicates: Sequence[Predicate]) -> list[int] | None:
    """The row groups that may hold a row matching every predicate, judged from their Parquet
    statistics (min, max, null count) as `Predicate.may_match` judges a file from nbcc's own;
    None for all of them. A compacted base file is sorted by key in row groups of
    `compaction.BASE_ROW_GROUP_ROWS`, so a lookup by key decodes one row group, not the file."""
    if not predicates or metadata.num_row_groups < 2:
        return None
    # Top-level columns only: a column named "a.b" and the leaf b of a struct a share the path.
    columns = [metadata.schema.column(j) for j in range(metadata.num_columns)]
    index = {c.name: j for j, c in enumerate(columns) if c.path == c.name}
    keep = []
    for i in range(metadata.num_row_groups):
        group = metadata.row_group(i)
        if all(p.may_match(_parquet_stats(group, index.get(p.column)), group.num_rows) for p in predicates):
            keep.append(i)
    return keep


def _parquet_stats(group: pq.RowGroupMetaData, column: int | None) -> dict[str, Any] | None:
    """A row group's statistics of one column in the form of nbcc's file statistics
    (`writer.update_stats`, `expr.stat_value`: dates as ISO text); None when the file has none."""
    if column is None:
        return None
    st = group.column(column).statistics
    if st is None:
        return None
    out: dict[str, Any] = {"nulls": st.null_count if st.has_null_count else None}
    if st.has_min_max:
        lo, hi = stat_value(st.min), stat_value(st.max)
        if isinstance(lo, (int, str, bool)):  # types whose order predicates compare by
            out["min"], out["max"] = lo, hi
    return out


def _aligned(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` in `schema`: columns added to the table after the file was written read as null."""
    cols = []
    for f in schema:
        idx = table.schema.get_field_index(f.name)
        if idx < 0:
            cols.append(null_array(table.num_rows, f.type))
        else:
            col = table.column(idx)
            cols.append(col if col.type.equals(f.type) else pc.cast(col, f.type))
    return pa.Table.from_arrays(cols, schema=schema)


# Read as Parquet stored it (dictionary-encoded: one value per log file, a few per base file), so
# that the merge ranks instants without decoding and hashing a 17-byte string per row (0.1 s of
# a 3M-row merge). Only in-memory merges whose output drops the column keep it so; every other
# read gets strings back from _aligned (the file is opened before its row count decides).
_INSTANTS_AS_DICTIONARY = pa.field(COMMIT_TIME_COL, pa.dictionary(pa.int32(), pa.string()), nullable=False)


def iter_files(storage: Storage, config: TableConfig, schema: pa.Schema, partition: str,
               files: Sequence[str], include_meta: bool = False, compact: bool = False,
               merged_already: bool = False, merge_rows: int | None = None,
               late_after: str | None = None, key_predicates: Sequence[Predicate] = (),
               key_filter: pc.Expression | None = None, sizes: Mapping[str, int] | None = None) -> Iterator[pa.Table]:
    """The merged, live records of `files` (one file group's files, in log order), in `schema`
    plus the meta columns if asked; with `compact`, what a base file keeps (merge.py). Yields
    pieces whose keys are disjoint, each sorted by key; memory follows `merge_rows`.
    `merged_already`: the files hold one live row per key (a base file marked live).
    `late_after` (with `compact`): the earliest instant that may still complete (merge.py).
    `key_predicates` (on record key columns) and `key_filter` (an expression on them or on
    `_nbcc_record_key`): every file's rows are filtered by both before they merge, and the
    predicates skip the row groups whose statistics rule them out. A merge is per key and a
    key's records all pass or all fail, so this gives the merge of the whole slice restricted to
    those keys; a point lookup then merges the few rows of its key, not the file group.
    `sizes`: the files' sizes in bytes where known (from their commits), by name."""
    sizes = sizes or {}
    merge_rows = merge_rows or DEFAULT_MERGE_ROWS
    fschema = file_schema(schema)
    if not include_meta and not compact:
        # Meta columns nobody asked for are not read: none if there is nothing to merge, else
        # only what the merge needs (it keys on the record key's own columns, so the string
        # `_nbcc_record_key` is skipped).
        needed = [] if merged_already else [COMMIT_TIME_COL, IS_DELETED_COL]
        fschema = pa.schema([f.with_nullable(True) for f in schema] + [fschema.field(n) for n in needed])
    out_fields = list(schema) + (META_FIELDS if include_meta else [])
    out_schema = pa.schema(out_fields)

    def finish(rows: pa.Table) -> pa.Table:
        return rows if compact else rows.select(out_schema.names).cast(out_schema)

    def merge(rows: pa.Table) -> pa.Table:
        return merge_records(rows, config.record_key, config.ordering_field, config.merge_mode, compact,
                             late_after)

    wanted = conjunction(key_predicates, key_filter)

    def wanted_keys(rows: pa.Table) -> pa.Table:
        return rows if wanted is None or not rows.num_rows else rows.filter(wanted)

    with contextlib.ExitStack() as stack:
        opened = _open_files(storage, partition, files, stack, key_predicates, sizes)
        opened = [f for f in opened if f.rows] or opened[:1]  # files whose row groups all miss
        total = sum(f.rows for f in opened)
        if merged_already:
            if not opened:
                yield finish(fschema.empty_table())
            for f in opened:
                reads = [f.read(fschema.names)] if f.rows <= merge_rows else f.batches(fschema.names, merge_rows)
                for part in reads:
                    yield finish(wanted_keys(_aligned(part, fschema)))
            return
        if total <= merge_rows:
            in_memory = fschema
            if not include_meta and not compact and COMMIT_TIME_COL in fschema.names:
                in_memory = fschema.set(fschema.get_field_index(COMMIT_TIME_COL), _INSTANTS_AS_DICTIONARY)
            parts = [wanted_keys(_aligned(f.read(in_memory.names), in_memory)) for f in opened]
            yield finish(merge(pa.concat_tables(parts) if parts else in_memory.empty_table()))
            return
        for piece in _spilled_pieces(opened, fschema, config.record_key, math.ceil(total / merge_rows), wanted_keys,
                                     in_key_order=compact):
            merged = finish(merge(piece))
            del piece  # not kept while the caller works on the merged rows
            yield merged


def _hash_piece_ids(rows: pa.Table, record_key: Sequence[str], pieces: int) -> np.ndarray:
    # Every row of a file group shares its bucket (hash % buckets), so the hash's low bits are
    # alike: take the piece from the high bits of the hash times the golden ratio instead.
    h = java_list_hash([rows.column(k) for k in record_key]).view(np.uint32).astype(np.uint64)
    return ((h * _GOLDEN) >> np.uint64(32)) % np.uint64(pieces)


def _range_piece_ids(column: pa.ChunkedArray | pa.Array, bounds: pa.Array) -> np.ndarray:
    """The piece of each value: the number of bounds at or below it (nulls sort first: 0)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if column.null_count == 0 and (pa.types.is_integer(column.type) or pa.types.is_date(column.type)):
        if pa.types.is_date(column.type):  # days or milliseconds: the integers' order
            as_int = pa.int32() if pa.types.is_date32(column.type) else pa.int64()
            column, bounds = column.view(as_int), bounds.view(as_int)
        return np.searchsorted(bounds.to_numpy(), column.to_numpy(), side="right")
    if len(bounds) < 32:  # one vectorised comparison per bound (128k strings, 15 bounds: 8 ms)
        ids = np.zeros(len(column), dtype=np.int64)
        for bound in bounds:
            ids += pc.fill_null(pc.greater_equal(column, bound), False).to_numpy(zero_copy_only=False)
        return ids
    # Many bounds: a binary search, a comparison per step with each value's middle bound (its
    # gather costs more than a few comparisons; 49 bounds: 28 ms instead of 40).
    lo, hi = np.zeros(len(column), dtype=np.int64), np.full(len(column), len(bounds), dtype=np.int64)
    for _ in range(max(1, len(bounds)).bit_length()):
        mid = np.minimum((lo + hi) // 2, len(bounds) - 1)
        at_or_above = pc.fill_null(pc.greater_equal(column, bounds.take(pa.array(mid))), False)
        above = at_or_above.to_numpy(zero_copy_only=False) & (lo < hi)
        lo, hi = np.where(above, mid + 1, lo), np.where(above | (lo >= hi), hi, mid)
    return lo


def _range_bounds(opened: list[_DataFile], total: int, key: str, key_type: pa.DataType,
                  pieces: int) -> pa.Array | None:
    """`pieces - 1` values of column `key` that split the files' `total` rows into ranges of about
    equal size, read from a sample of one row at a random place in every stride of rows (not the
    stride's first: rows that alternate between sources would fool that); None if no such split
    exists (a value holds too many rows). Every record key type (config.py) has an order."""
    stride = max(1, total // (pieces * _SAMPLE_PER_PIECE))
    picks = np.arange(0, total, stride) + np.random.default_rng(0).integers(0, stride, -(-total // stride))
    picks = picks[picks < total]
    samples, offset = [], 0  # `offset`: the global position of the batch's first row
    for f in opened:
        for batch in f.batches([key]):
            lo, hi = np.searchsorted(picks, [offset, offset + batch.num_rows])
            if hi > lo:
                column = batch.column(0).take(pa.array(picks[lo:hi] - offset)).combine_chunks()
                samples.append(column if column.type.equals(key_type) else pc.cast(column, key_type))
            offset += batch.num_rows
    sample = pa.concat_arrays(samples) if samples else pa.array([], key_type)
    if len(sample) < pieces:
        return None
    sample = sample.take(pc.array_sort_indices(sample, null_placement="at_start"))
    bounds = sample.take(pa.array([len(sample) * i // pieces for i in range(1, pieces)]))
    if bounds.null_count:
        return None  # nulls (never in a valid key) fill a whole piece's share
    sizes = np.bincount(_range_piece_ids(sample, bounds), minlength=pieces)
    return bounds if sizes.max() <= _MAX_PIECE_SHARE * len(sample) / pieces else None


def _spilled_pieces(opened: list[_DataFile], fschema: pa.Schema, record_key: Sequence[str],
                    pieces: int, wanted_keys: Callable[[pa.Table], pa.Table],
                    in_key_order: bool = False) -> Iterator[pa.Table]:
    """Split the files' rows by key into `pieces` temporary Arrow IPC files, keeping log order
    within each, then hand them back one at a time. With `in_key_order` (compaction: the base
    file is then sorted as a whole) the pieces are key ranges, handed back in key order."""
    first, total = record_key[0], sum(f.rows for f in opened)
    bounds = _range_bounds(opened, total, first, fschema.field(first).type, pieces) if in_key_order else None
    share = total / pieces

    def by_hash(n: int) -> Callable[[pa.Table], np.ndarray]:
        return lambda rows: _hash_piece_ids(rows, record_key, n)

    def by_range(rows: pa.Table) -> np.ndarray:
        return _range_piece_ids(rows.column(first), bounds)

    with tempfile.TemporaryDirectory(prefix="nbcc-merge-") as tmp:
        batches = (wanted_keys(_aligned(b, fschema)) for f in opened for b in f.batches(fschema.names))
        spilled = _spill(batches, by_hash(pieces) if bounds is None else by_range, pieces, fschema, tmp, "p")
        for p, (path, rows) in enumerate(spilled):
            if bounds is not None and rows > _MAX_PIECE_SHARE * share:
                # The sample misjudged this range (it cannot be sure): hash it into pieces of
                # the budget, which keeps memory bounded and only this range out of key order.
                n = math.ceil(rows / share)
                with contextlib.closing(_spilled_batches(path)) as batches_of_piece:  # its map, even on errors
                    again = _spill(batches_of_piece, by_hash(n), n, fschema, tmp, f"p{p}-")
                yield from (_read_spilled(sub) for sub, _ in again)
            else:
                yield _read_spilled(path)


def _spill(batches: Iterator[pa.Table], piece_ids: Callable[[pa.Table], np.ndarray], pieces: int,
           fschema: pa.Schema, tmp: str, prefix: str) -> list[tuple[str, int]]:
    """Write each batch's rows to the temporary file of their piece, keeping their order;
    (file, rows) of every piece."""
    paths = [os.path.join(tmp, f"{prefix}{p}.arrow") for p in range(pieces)]
    counts = np.zeros(pieces, dtype=np.int64)
    with contextlib.ExitStack() as writers:
        # The writer does not close a file it was given by name: open each one here, so that an
        # error leaves none open.
        sinks = [writers.enter_context(pa.ipc.new_file(writers.enter_context(pa.OSFile(path, "wb")), fschema))
                 for path in paths]
        for batch in batches:
            if not batch.num_rows:
                continue
            ids = piece_ids(batch)
            # stable: rows keep their file order (and a radix sort on 16-bit ids)
            order = np.argsort(ids.astype(np.int16 if pieces < 2**15 else np.int64), kind="stable")
            grouped = batch.take(order)
            sizes = np.bincount(ids.astype(np.int64), minlength=pieces)
            counts += sizes
            start = 0
            for p, end in enumerate(np.cumsum(sizes)):
                if end > start:
                    sinks[p].write_table(grouped.slice(start, end - start))
                start = int(end)
    return list(zip(paths, counts.tolist()))


def _spilled_batches(path: str) -> Iterator[pa.Table]:
    """A spilled piece's rows batch by batch (never all at once), then the file is gone."""
    with pa.memory_map(path) as source:
        reader = pa.ipc.open_file(source)
        for i in range(reader.num_record_batches):
            yield pa.Table.from_batches([reader.get_batch(i)])
    os.remove(path)


def _read_spilled(path: str) -> pa.Table:
    piece = pa.ipc.open_file(pa.memory_map(path)).read_all()  # the map lives as long as the piece
    os.remove(path)  # its pages go with the last reference to the piece
    return piece


def read_files(storage: Storage, config: TableConfig, schema: pa.Schema, partition: str,
               files: Sequence[str], include_meta: bool = False, compact: bool = False,
               merged_already: bool = False, merge_rows: int | None = None,
               key_filter: pc.Expression | None = None, sizes: Mapping[str, int] | None = None) -> pa.Table:
    """`iter_files` as one table (for callers that need the whole file group at once)."""
    parts = list(iter_files(storage, config, schema, partition, files, include_meta, compact,
                            merged_already, merge_rows, key_filter=key_filter, sizes=sizes))
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts)


def read_columns(storage: Storage, partition: str, files: Sequence[str], columns: Sequence[str],
                 types: pa.Schema | None = None, sizes: Mapping[str, int] | None = None) -> pa.Table:
    """Some columns of `files`, concatenated (no merge). With `types` (fields named by
    `columns`), each file's columns are cast to them, as a merge casts them (another writer may
    store a narrower type, §4.2), and no file gives an empty table of those types; else an
    empty table of strings. `sizes`: as `iter_files`."""
    sizes = sizes or {}
    parts = [_read_parquet(storage, partition, n, columns, sizes.get(n)) for n in files]
    if types is not None:
        target = pa.schema([types.field(c) for c in columns])
        parts = [_aligned(p, target) for p in parts] or [target.empty_table()]
    return pa.concat_tables(parts) if parts else pa.table({c: pa.array([], pa.string()) for c in columns})
