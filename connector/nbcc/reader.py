"""Reading data files: open them, align them to the table's schema, and merge them by key.

Which files to read is decided by `scan.py` from the timeline. Every committed file must be
readable: a missing or corrupt one fails the read and names the file, so rows are never silently
dropped.
"""

from __future__ import annotations

from typing import Any, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .config import TableConfig
from .errors import DataFileError
from .merge import merge_records
from .schema import META_FIELDS, file_schema
from .storage import Storage, is_not_found


def _read_parquet(storage: Storage, arrow_fs: Any, partition: str, name: str,
                  columns: Sequence[str] | None = None) -> pa.Table:
    """The file's rows; with `columns`, only those of them the file has (a column added to the
    table later is absent from older files)."""
    rel = f"{partition}/{name}" if partition else name
    try:
        if columns is None:
            return pq.read_table(storage.full_path(rel), filesystem=arrow_fs)
        with arrow_fs.open_input_file(storage.full_path(rel)) as source:
            pf = pq.ParquetFile(source)
            present = set(pf.schema_arrow.names)
            return pf.read(columns=[c for c in columns if c in present])
    except Exception as exc:  # noqa: BLE001 - every failure must name the file
        what = "is missing" if is_not_found(exc) else "cannot be read"
        raise DataFileError(
            f"committed data file {storage.full_path(rel)} {what} ({exc}); the read stopped so that "
            "no rows are silently dropped. Restore the file or roll the table back."
        ) from exc


def _aligned(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` in `schema`: columns added to the table after the file was written read as null."""
    cols = []
    for f in schema:
        idx = table.schema.get_field_index(f.name)
        if idx < 0:
            cols.append(pa.nulls(table.num_rows, f.type))
        else:
            col = table.column(idx)
            cols.append(col if col.type.equals(f.type) else pc.cast(col, f.type))
    return pa.Table.from_arrays(cols, schema=schema)


def read_files(storage: Storage, config: TableConfig, schema: pa.Schema, partition: str,
               files: Sequence[str], include_meta: bool = False, compact: bool = False,
               merged_already: bool = False) -> pa.Table:
    """The merged, live records of `files` (one file group's files, in log order), in `schema`
    plus the meta columns if asked; with `compact`, what a base file keeps (merge.py).
    `merged_already`: the files hold one live row per key (a base file marked live)."""
    fschema = file_schema(schema)
    arrow_fs = storage.arrow_filesystem()
    if merged_already and not include_meta:
        # Nothing to merge and no meta columns asked for: do not even read them.
        fschema = pa.schema([f.with_nullable(True) for f in schema])
    columns = fschema.names if merged_already else None
    parts = [_aligned(_read_parquet(storage, arrow_fs, partition, n, columns), fschema) for n in files]
    rows = pa.concat_tables(parts) if parts else fschema.empty_table()
    if merged_already:
        merged = rows
    else:
        merged = merge_records(rows, config.record_key, config.ordering_field, config.merge_mode, compact)
    if compact:
        return merged
    out_fields = list(schema) + (META_FIELDS if include_meta else [])
    return merged.select([f.name for f in out_fields]).cast(pa.schema(out_fields))


def read_columns(storage: Storage, partition: str, files: Sequence[str], columns: Sequence[str]) -> pa.Table:
    """Some columns of `files`, concatenated (no merge)."""
    arrow_fs = storage.arrow_filesystem()
    parts = [_read_parquet(storage, arrow_fs, partition, n, columns) for n in files]
    return pa.concat_tables(parts) if parts else pa.table({c: pa.array([], pa.string()) for c in columns})
