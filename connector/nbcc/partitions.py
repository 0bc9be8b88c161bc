"""Partitions: Hive-style folders (`col=value/...`) and the split of incoming rows into
(partition, bucket) groups, each of which goes to one file group's log file.

Values are percent-encoded (every byte but letters, digits and `-_.~`, as `urllib.parse.quote`), and a null value is the
folder `__HIVE_DEFAULT_PARTITION__`, as in Hive and Spark. An unpartitioned table's partition
path is "" (files live in the table root).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence
from urllib.parse import quote, unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .buckets import bucket_ids_for_columns
from .errors import SchemaError
from .schema import RECORD_KEY_COL

NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"


def _value_text(value: pa.Scalar) -> str:
    if not value.is_valid:
        return NULL_PARTITION
    text = pc.cast(value, pa.string()).as_py() if not pa.types.is_string(value.type) else value.as_py()
    return quote(text, safe="")


# Longest folder name: NAME_MAX of Linux, macOS and Windows file systems. Kept on object stores
# too, so that a table copied to a disk still fits.
MAX_FOLDER_NAME_BYTES = 255


def check_partition_values(data: pa.Table, partition_by: Sequence[str]) -> None:
    """Refuse partition values that cannot have a folder of their own (`data` is in the table's
    types):
    - a string equal to NULL_PARTITION: it would share the folder of null values, and its
      records would be read as null and merged with theirs (one replacing the other);
    - a value whose folder name `<col>=<text>` passes MAX_FOLDER_NAME_BYTES: opening the first
      file there would fail (File name too long) after the instant began and folders were made.
      Percent-encoding takes at most 3 bytes per byte of text, so only values whose text is that
      long are encoded exactly (a few, if any)."""
    for name in partition_by:
        col = data.column(name)
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            same = pc.sum(pc.equal(col, NULL_PARTITION)).as_py()
            if same:
                raise SchemaError(
                    f"partition column {name!r} has {same} value(s) equal to {NULL_PARTITION!r}, the folder "
                    "name of null values: those rows would be read back as null and merged with the null "
                    "partition's records. Change those values, or write null"
                )
        else:
            col = pc.cast(pc.unique(col), pa.string())  # short texts; the few distinct values only
        room = (MAX_FOLDER_NAME_BYTES - len(f"{name}=".encode())) // 3
        lengths = pc.binary_length(col)
        if col.null_count == 0 and (pc.max(lengths).as_py() or 0) <= room:
            continue
        long_ones = pc.unique(pc.filter(col, pc.or_kleene(pc.greater(lengths, room), pc.is_null(lengths))))
        for value in long_ones:
            folder = partition_path([name], [value])
            size = len(folder.encode())
            if size > MAX_FOLDER_NAME_BYTES:
                raise SchemaError(
                    f"partition column {name!r} has a value whose folder name ({folder[:60]}...) is {size} "
                    f"bytes; a folder name may have at most {MAX_FOLDER_NAME_BYTES} bytes (the column "
                    "name, '=' and the percent-encoded value): shorten the value or partition by "
                    "another column")


def partition_path(columns: Sequence[str], values: Sequence[pa.Scalar]) -> str:
    return "/".join(f"{c}={_value_text(v)}" for c, v in zip(columns, values))


def parse_partition_path(path: str) -> dict[str, str | None]:
    """`{column: value text}` of a partition path (None for the null partition)."""
    out: dict[str, str | None] = {}
    for part in filter(None, path.split("/")):
        col, _, text = part.partition("=")
        out[col] = None if text == NULL_PARTITION else unquote(text)
    return out


def split_rows(table: pa.Table, partition_by: Sequence[str], record_key: Sequence[str],
               buckets: int) -> Iterator[tuple[str, int, pa.Table]]:
    """Yield (partition path, bucket, rows) for every non-empty group; rows keep their order."""
    n = table.num_rows
    if n == 0:
        return
    key_columns = [table.column(k) for k in record_key]
    if len(record_key) == 1 and RECORD_KEY_COL in table.column_names:
        # A single key's `_nbcc_record_key` is already the key's text, which is what is hashed.
        key_columns = [table.column(RECORD_KEY_COL)]
    bucket = bucket_ids_for_columns(key_columns, buckets).astype(np.int64)
    part_index = np.zeros(n, dtype=np.int64)
    part_values: list[pa.Array] = []
    stride = 1
    for col in reversed(partition_by):
        enc = table.column(col).combine_chunks().dictionary_encode(null_encoding="encode")
        codes = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        part_index += codes * stride
        stride *= max(len(enc.dictionary), 1)
        part_values.insert(0, enc.dictionary)
    group = part_index * buckets + bucket
    # NumPy's stable sort is a radix sort for 16-bit values: about 6x faster here than on int64.
    order = np.argsort(group.astype(np.int16) if group.max() < 2**15 else group, kind="stable")
    sorted_group = group[order]
    starts = np.flatnonzero(np.r_[True, sorted_group[1:] != sorted_group[:-1]])
    ends = np.r_[starts[1:], n]
    ordered = table.take(order)
    for s, e in zip(starts, ends):
        g = int(sorted_group[s])
        pidx, b = divmod(g, buckets)
        values = []
        for dictionary in reversed(part_values):
            size = max(len(dictionary), 1)
            pidx, code = divmod(pidx, size)
            values.insert(0, dictionary[code])
        yield partition_path(partition_by, values), b, ordered.slice(s, e - s)


def distinct_partitions(rows: pa.Table, partition_by: Sequence[str]) -> set[str]:
    """The partition paths of `rows` (in the table's types)."""
    distinct = rows.select(list(partition_by)).group_by(list(partition_by)).aggregate([])
    columns = [distinct.column(c) for c in partition_by]
    return {partition_path(partition_by, [col[i] for col in columns]) for i in range(distinct.num_rows)}


def partition_values(paths: Sequence[str], partition_by: Sequence[str], schema: pa.Schema) -> pa.Table:
    """One row per partition path: its values in the table's types (the folders' texts, which
    `_value_text` made, cast back), for matching partitions by a filter."""
    texts = [parse_partition_path(p) for p in paths]
    columns = {}
    for name in partition_by:
        field = schema.field(name)
        try:
            columns[name] = pc.cast(pa.array([t.get(name) for t in texts], pa.string()), field.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise SchemaError(f"a folder of partition column {name!r} does not hold a {field.type} "
                              f"value: {exc}") from None
    return pa.table(columns, schema=pa.schema([schema.field(n) for n in partition_by]))


def matching(paths: Sequence[str], condition: pc.Expression | None, partition_by: Sequence[str],
             schema: pa.Schema) -> list[str]:
    """Those of the partition `paths` whose values (in `schema`'s types) match `condition`
    (None: all)."""
    if condition is None or not paths:
        return list(paths)
    values = partition_values(paths, partition_by, schema)
    return values.append_column("_path", pa.array(paths, pa.string())).filter(condition).column("_path").to_pylist()


@dataclass(frozen=True)
class PartitionMatch:
    """The partitions that a condition on partition columns (a replaceWhere's, a partition
    deletion's filter) matched in a listing of the table, and what its commit needs to complete
    the list under the table lock (format.md §8): a partition that a commit completing after
    the listing created matches too, though the listing could not see it."""

    listed: tuple[str, ...]
    condition: pc.Expression | None
    partition_by: tuple[str, ...]
    # The instants of the commits the listing saw completed. Not a completion time: a commit's
    # completed file may land after a listing that saw a later completion (clock.py's lease).
    seen: frozenset[str]

    def unseen(self, completed: Sequence[Any]) -> list[Any]:
        """The instants of `completed` that the listing did not see."""
        return [i for i in completed if i.instant not in self.seen]

    def of(self, paths: Sequence[str], schema: pa.Schema) -> list[str]:
        """Those of `paths` that match the condition."""
        return matching(paths, self.condition, self.partition_by, schema)
