"""Reading: plan a snapshot from the timeline, then read and merge file slices.

Planning lists the timeline once and reads the metadata of completed commits (cached: completed
files never change). The files a reader may see come only from that metadata, never from listing
data folders, so files of failed or unfinished writes are never read. An overwrite (a completed
replacecommit) hides every file whose commit completed before it.
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .config import TableConfig
from .errors import DataFileError
from .file_slices import FileSlice, build_file_slices
from .merge import merge_records
from .schema import META_FIELDS, file_schema, merge_added_columns, schema_from_json
from .storage import Storage, is_not_found
from .timeline import REPLACE_COMMIT, Timeline, read_commit_metadata


@dataclass(frozen=True)
class Snapshot:
    """What one read sees: the table schema and the latest file slice of every file group."""

    timeline: Timeline
    schema: pa.Schema
    slices: list[FileSlice]


def plan_snapshot(storage: Storage, config: TableConfig, timeline: Timeline | None = None) -> Snapshot:
    timeline = timeline or Timeline.load(storage)
    completed = timeline.completed()
    metas = [read_commit_metadata(storage, i) for i in completed]
    schema = merge_added_columns(config.schema, (schema_from_json(m["schema"]) for m in metas))

    cutoff = max((i.completion for i in completed if i.action == REPLACE_COMMIT), default=None)
    by_partition: dict[str, list[str]] = defaultdict(list)
    for inst, meta in zip(completed, metas):
        if cutoff is not None and inst.completion < cutoff:
            continue
        for f in meta["files"]:
            by_partition[f["partition"]].append(f["name"])

    completion = timeline.completion_times()
    slices = []
    for partition in sorted(by_partition):
        groups = build_file_slices(by_partition[partition], completion, partition)
        slices.extend(groups[fg][0] for fg in sorted(groups))
    return Snapshot(timeline, schema, slices)


def _read_file(storage: Storage, arrow_fs: Any, partition: str, name: str, schema: pa.Schema) -> pa.Table:
    rel = f"{partition}/{name}" if partition else name
    try:
        table = pq.read_table(storage.full_path(rel), filesystem=arrow_fs)
    except Exception as exc:  # noqa: BLE001 - every failure must name the file
        what = "is missing" if is_not_found(exc) else "cannot be read"
        raise DataFileError(
            f"committed data file {storage.full_path(rel)} {what} ({exc}); the read stopped so that "
            "no rows are silently dropped. Restore the file or roll the table back."
        ) from exc
    cols = []
    for f in schema:
        idx = table.schema.get_field_index(f.name)
        if idx < 0:
            cols.append(pa.nulls(table.num_rows, f.type))  # column added after this file
        else:
            col = table.column(idx)
            cols.append(col if col.type.equals(f.type) else pc.cast(col, f.type))
    return pa.Table.from_arrays(cols, schema=schema)


def read_slice(storage: Storage, config: TableConfig, schema: pa.Schema, file_slice: FileSlice,
               include_meta: bool = False) -> pa.Table:
    """The merged, live records of one file slice, in `schema` (plus meta columns if asked)."""
    fschema = file_schema(schema)
    arrow_fs = storage.arrow_filesystem()
    parts = [_read_file(storage, arrow_fs, file_slice.partition, n, fschema) for n in file_slice.file_names()]
    rows = pa.concat_tables(parts) if parts else fschema.empty_table()
    merged = merge_records(rows, config.record_key, config.ordering_field, config.merge_mode)
    out_fields = list(schema) + (META_FIELDS if include_meta else [])
    return merged.select([f.name for f in out_fields]).cast(pa.schema(out_fields))


def read_slices(storage: Storage, config: TableConfig, snapshot: Snapshot, threads: int = 4
                ) -> Iterator[pa.Table]:
    """Merged slices in plan order, read a few at a time (pyarrow releases the GIL)."""
    if not snapshot.slices:
        return
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(snapshot.slices)))) as pool:
        yield from pool.map(lambda s: read_slice(storage, config, snapshot.schema, s), snapshot.slices)
