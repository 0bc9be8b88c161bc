"""What `Table.write` takes, as Arrow record batches: pyarrow tables, batches, readers and
datasets, iterables of batches, and other libraries' frames (anything exporting an Arrow
stream: Polars, DuckDB; pandas with its index handled as pandas users mean it). Anything else
is refused with what to give instead."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.dataset as ds

from .errors import InvalidOptionError

Data = pa.Table | pa.RecordBatch | pa.RecordBatchReader | ds.Dataset | Iterable[pa.RecordBatch]

_KINDS = ("a pyarrow Table, RecordBatch, RecordBatchReader, Dataset or iterable of RecordBatch, or a data frame "
          "that exports an Arrow stream (__arrow_c_stream__: Polars, pandas 2.2+, a DuckDB result)")


def as_arrow(data: Any) -> pa.Table | pa.RecordBatch | pa.RecordBatchReader | Any:
    """`data` as pyarrow data where it is another library's: a pandas frame through
    `_from_pandas`, a dataset or scanner as a reader, any other Arrow stream exporter (the
    PyCapsule interface) as a reader, without a copy where the exporter allows."""
    if isinstance(data, (pa.Table, pa.RecordBatch, pa.RecordBatchReader)):
        return data
    if isinstance(data, ds.Dataset):
        return data.scanner().to_reader()
    if isinstance(data, ds.Scanner):
        return data.to_reader()
    _refuse_known_mistakes(data)
    if _is_pandas(data, "DataFrame"):
        return _from_pandas(data)
    if hasattr(data, "__arrow_c_stream__"):
        try:
            return pa.RecordBatchReader.from_stream(data)
        except pa.ArrowInvalid as exc:
            if "non-struct" in str(exc):  # a pandas Series, an Arrow array: one column, no names
                raise _one_column(data, "pa.table({'id': column, ...}), series.to_frame()") from None
            raise
    return data


def as_batches(data: Any) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """The schema of `data` (as `as_arrow` gives it) and its record batches. The batches of an
    iterable must all have the first one's schema (a reader's have by construction)."""
    if isinstance(data, pa.Table):
        return data.schema, iter(data.to_batches())
    if isinstance(data, pa.RecordBatch):
        return data.schema, iter([data])
    if isinstance(data, pa.RecordBatchReader):
        return data.schema, iter(data)
    if isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
        raise InvalidOptionError(f"data must be {_KINDS}; got {type(data).__name__}")
    pieces = iter(data)
    try:
        first = _batches_of(next(pieces), 0)
    except StopIteration:
        raise InvalidOptionError("no data to write: the iterable of record batches is empty") from None
    schema = first[0].schema

    def chain() -> Iterator[pa.RecordBatch]:
        yield from first
        for i, piece in enumerate(pieces, 1):
            for batch in _batches_of(piece, i):
                if not batch.schema.equals(schema):
                    raise InvalidOptionError(_schema_drift(i, schema, batch.schema))
                yield batch
    return schema, chain()


def _batches_of(piece: Any, i: int) -> list[pa.RecordBatch]:
    if isinstance(piece, pa.RecordBatch):
        return [piece]
    if isinstance(piece, pa.Table):
        return piece.to_batches() or [pa.RecordBatch.from_pylist([], schema=piece.schema)]
    if isinstance(piece, dict) and i == 0:
        raise InvalidOptionError("data must be a table, not rows as dicts: give pa.Table.from_pylist(rows)")
    raise InvalidOptionError(f"data must be {_KINDS}; item {i} of the iterable is a {type(piece).__name__}, "
                             "not a RecordBatch")


def _schema_drift(i: int, first: pa.Schema, other: pa.Schema) -> str:
    """What differs between the first batch's schema and item `i`'s."""
    a, b = {f.name: f.type for f in first}, {f.name: f.type for f in other}
    differences = [f"{n!r} is missing" for n in a if n not in b] + [f"{n!r} is added" for n in b if n not in a]
    differences += [f"{n!r} is {b[n]}, not {a[n]}" for n in a if n in b and not a[n].equals(b[n])]
    if not differences:
        differences = ["the columns are in another order" if list(a) != list(b) else "the columns' nullability "
                       "differs"]
    return (f"item {i} of the data has another schema than the first ({'; '.join(differences)}): every "
            "batch of a write must have the same columns, in the same order, of the same types; cast them "
            "to one schema first (batch.select(names).cast(schema)). Nothing of this write is committed")


def _refuse_known_mistakes(data: Any) -> None:
    """Clear words for inputs that are near misses of data."""
    kind = type(data)
    if isinstance(data, dict):
        raise InvalidOptionError("data must be a table, not a dict of columns: give pa.table(data)")
    if kind.__name__ == "LazyFrame":
        raise InvalidOptionError("a Polars LazyFrame is a query, not data: give frame.collect() (or "
                                 "frame.collect_batches() for a stream of batches)")
    if isinstance(data, (pa.Array, pa.ChunkedArray)):
        raise _one_column(data, "pa.table({'id': array, ...})", of_its_kind=True)
    if _is_pandas(data, "Series"):
        raise _one_column(data, "series.to_frame() or a DataFrame")


def _one_column(data: Any, instead: str, of_its_kind: bool = False) -> InvalidOptionError:
    """The error for data that is one unnamed column, naming what to give `instead`."""
    what = f"a single {type(data).__name__}" if of_its_kind else f"a single column ({type(data).__name__})"
    return InvalidOptionError(f"data must be a table of named columns; got {what}: give {instead}")


def _is_pandas(data: Any, kind: str) -> bool:
    return type(data).__module__.split(".")[0] == "pandas" and type(data).__name__ == kind


def _from_pandas(frame: Any) -> pa.Table:
    """A pandas frame's columns as Arrow. Its unnamed index levels are not data, as in Spark's
    createDataFrame; its named ones (`set_index("id")`) become columns. pandas's own export wrote
    an unnamed index as a column `__index_level_0__` (added to the table for good), and a named
    one of evenly spaced numbers as schema metadata only (its column missing). A named level
    that is also a column must hold the column's values: else which one is meant is unclear."""
    import pandas as pd  # there: the frame is one

    columns = set(map(str, frame.columns))
    named = [n for n in frame.index.names if n is not None]
    for name in (n for n in named if str(n) in columns):
        if not frame.index.get_level_values(name).equals(pd.Index(frame[name])):
            raise InvalidOptionError(
                f"the pandas frame's index level {name!r} has the name of a column but other values: "
                "rename one, or drop the index (frame.reset_index(drop=True))")
    kept = [n for n in named if str(n) not in columns]
    if kept:
        frame = frame.reset_index(level=kept)
    return pa.Table.from_pandas(frame, preserve_index=False).replace_schema_metadata(None)
