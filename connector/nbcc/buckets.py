"""Hudi-compatible bucket-index hashing, vectorized over Arrow arrays.

A bucket-indexed nbcc table has a fixed number of buckets and stores each
bucket in one fixed file group, so upserts find a key's file group without any
lookup. To stay interoperable with Apache Hudi's simple bucket index, a
record's bucket must be computed exactly as Hudi does:
``(List<String>.hashCode() & Integer.MAX_VALUE) % numBuckets`` over the string
forms of the record-key fields. Java hashes strings over UTF-16 code units with
wrapping int32 arithmetic, so this module reproduces that bit for bit with NumPy
uint32 arithmetic (which wraps mod 2**32 like Java's int) instead of per-row
Python loops.
"""

from __future__ import annotations

import re
from numbers import Integral
from typing import Any, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = [
    "java_list_hash",
    "bucket_ids",
    "bucket_ids_for_columns",
    "file_group_id",
    "bucket_of_file_group",
]

ArrayLike = Union[pa.Array, pa.ChunkedArray, Sequence[Any]]

_SUPPORTED = "string (string, large_string, string_view), integer (signed or unsigned), date (date32, date64)"

_FILE_GROUP_SUFFIX = "-0000-0000-0000-000000000000"
_FILE_GROUP_RE = re.compile(r"([0-9]{8})" + re.escape(_FILE_GROUP_SUFFIX))

# Code units hashed per block; small enough for temporaries to stay in cache.
_BLOCK_UNITS = 1 << 18

# Powers of 31 mod 2**32, grown on demand; index e holds 31**e.
_POW31 = np.ones(1, dtype=np.uint32)


def _pow31(n: int) -> np.ndarray:
    """Return 31**0 .. 31**(n-1) as uint32 (wrapping), cached across calls."""
    global _POW31
    table = _POW31
    if len(table) < n:
        size = max(n, 2 * len(table))
        table = np.empty(size, dtype=np.uint32)
        table[0] = 1
        # cumprod in uint32 wraps mod 2**32, which is exactly Java's int overflow.
        np.cumprod(np.full(size - 1, 31, dtype=np.uint32), dtype=np.uint32, out=table[1:])
        _POW31 = table
    # Slice the local table: another thread may swap in a different one meanwhile.
    return table[:n]


def _to_arrow(values: ArrayLike) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        return values.combine_chunks()
    if isinstance(values, pa.Array):
        return values
    return pa.array(values)


def _as_string_array(values: ArrayLike) -> pa.Array:
    """Convert one key column to a string/large_string array of Java's String.valueOf forms."""
    arr = _to_arrow(values)
    if pa.types.is_dictionary(arr.type):
        # Dictionary-encoded keys (common from Parquet) hash like their decoded values.
        arr = arr.dictionary_decode()
    if arr.null_count > 0:
        raise ValueError(
            f"record key contains null values ({arr.null_count} of {len(arr)}); "
            "Hudi bucket ids are undefined for null keys"
        )
    t = arr.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return arr
    if pa.types.is_string_view(t):
        return arr.cast(pa.large_string())
    if pa.types.is_integer(t) or pa.types.is_date(t):
        # Arrow's cast yields decimal text for integers and ISO YYYY-MM-DD for
        # dates, matching Java's Long.toString / LocalDate.toString.
        return pc.cast(arr, pa.string())
    raise TypeError(f"unsupported record key type {t}; supported types: {_SUPPORTED}")


def _utf8_to_utf16(data: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decode concatenated UTF-8 bytes into UTF-16 code units.

    ``offsets`` are byte offsets (starting at 0) of each string; returns the code
    units as uint32 and the matching code-unit offsets. Input is assumed to be
    valid UTF-8, which Arrow guarantees for string arrays.
    """
    lead_pos = np.flatnonzero((data & 0xC0) != 0x80)
    # Pad so that p+1..p+3 stay in range for lead bytes near the end.
    padded = np.concatenate([data, np.zeros(3, dtype=np.uint8)]).astype(np.uint32)
    b0 = padded[lead_pos]
    b1 = padded[lead_pos + 1] & 0x3F
    b2 = padded[lead_pos + 2] & 0x3F
    b3 = padded[lead_pos + 3] & 0x3F
    cp = np.where(
        b0 < 0x80,
        b0,
        np.where(
            b0 < 0xE0,
            ((b0 & 0x1F) << 6) | b1,
            np.where(
                b0 < 0xF0,
                ((b0 & 0x0F) << 12) | (b1 << 6) | b2,
                ((b0 & 0x07) << 18) | (b1 << 12) | (b2 << 6) | b3,
            ),
        ),
    )
    supplementary = cp >= 0x10000
    # Java stores code points beyond the BMP as two surrogate code units;
    # unit_cum[c] is the number of code units before code point c.
    unit_cum = np.zeros(len(cp) + 1, dtype=np.int64)
    np.cumsum(1 + supplementary, out=unit_cum[1:])
    unit_start = unit_cum[:-1]
    units = np.empty(int(unit_cum[-1]), dtype=np.uint32)
    units[unit_start] = cp
    sup_start = unit_start[supplementary]
    sup_cp = cp[supplementary] - 0x10000
    units[sup_start] = 0xD800 + (sup_cp >> 10)
    units[sup_start + 1] = 0xDC00 + (sup_cp & 0x3FF)
    # String boundaries fall on lead bytes (or the end), so each byte offset is
    # found exactly among the lead positions, giving its code point index.
    unit_offsets = unit_cum[np.searchsorted(lead_pos, offsets)]
    return units, unit_offsets


def _java_string_hashes(values: ArrayLike) -> np.ndarray:
    """Java String.hashCode() of each value's string form, as uint32 bit patterns."""
    arr = _as_string_array(values)
    count = len(arr)
    if count == 0:
        return np.zeros(0, dtype=np.uint32)
    _, offsets_buf, data_buf = arr.buffers()[:3]
    off_dtype = np.int64 if pa.types.is_large_string(arr.type) else np.int32
    # Slices share their parent's buffers; arr.offset selects our window.
    offsets = np.frombuffer(offsets_buf, dtype=off_dtype)[arr.offset : arr.offset + count + 1].astype(np.int64)
    start = int(offsets[0])
    end = int(offsets[-1])
    offsets = offsets - start
    if data_buf is None or end == start:
        return np.zeros(count, dtype=np.uint32)
    data = np.frombuffer(data_buf, dtype=np.uint8)[start:end]

    if int(data.max()) < 0x80:
        # ASCII: one byte is one UTF-16 code unit (widened per block later).
        units = data
        unit_offsets = offsets
    else:
        units, unit_offsets = _utf8_to_utf16(data, offsets)

    # Work in blocks of roughly _BLOCK_UNITS code units: the temporaries then stay
    # cache-sized and memory stays bounded, which is faster than one huge pass.
    hashes = np.empty(count, dtype=np.uint32)
    boundaries = np.searchsorted(unit_offsets, np.arange(0, len(units), _BLOCK_UNITS))
    rows = np.unique(np.concatenate([boundaries, [count]]))
    for r0, r1 in zip(rows[:-1].tolist(), rows[1:].tolist()):
        u0, u1 = int(unit_offsets[r0]), int(unit_offsets[r1])
        hashes[r0:r1] = _polynomial_hash(units[u0:u1], unit_offsets[r0 : r1 + 1] - u0)
    return hashes


def _polynomial_hash(units: np.ndarray, unit_offsets: np.ndarray) -> np.ndarray:
    """sum_j units[j] * 31**(len - 1 - j) per string, mod 2**32 (Java's String.hashCode loop)."""
    count = len(unit_offsets) - 1
    lengths = np.diff(unit_offsets)
    max_len = int(lengths.max())
    if max_len == 0:
        return np.zeros(count, dtype=np.uint32)
    if int(lengths.min()) == max_len:
        # Equal-length keys (common for formatted ids): a 2-D weighted row sum.
        matrix = units.reshape(count, max_len).astype(np.uint32)
        return (matrix * _pow31(max_len)[::-1]).sum(axis=1, dtype=np.uint32)
    total = len(units)
    # Unit j of string i gets weight 31**(len_i - 1 - j); with block index k
    # that exponent is (end_i - 1) - k.
    exponent = np.repeat((unit_offsets[1:] - 1).astype(np.int64), lengths)
    exponent -= np.arange(total, dtype=np.int64)
    weighted = units.astype(np.uint32) * _pow31(max_len)[exponent]
    # Wrapping prefix sums: cs[end] - cs[start] is the per-string sum mod 2**32,
    # and is 0 for empty strings (no reduceat edge cases).
    cs = np.zeros(total + 1, dtype=np.uint32)
    np.cumsum(weighted, dtype=np.uint32, out=cs[1:])
    return cs[unit_offsets[1:]] - cs[unit_offsets[:-1]]


def java_list_hash(columns: Sequence[ArrayLike]) -> np.ndarray:
    """Per row, Java's ``List<String>.hashCode()`` of ``[str(col[i]) for col in columns]``.

    Columns may be Arrow arrays, chunked arrays or Python sequences of string,
    integer or date values, all of the same length. Returns an int32 array.
    """
    columns = list(columns)
    if not columns:
        raise ValueError("java_list_hash needs at least one key column")
    hashes = [_java_string_hashes(col) for col in columns]
    n = len(hashes[0])
    if any(len(h) != n for h in hashes):
        raise ValueError(f"key columns have different lengths: {[len(h) for h in hashes]}")
    # List.hashCode: h = 1; h = 31*h + e.hashCode() for each element.
    acc = np.ones(n, dtype=np.uint32)
    for h in hashes:
        acc = acc * np.uint32(31) + h
    return acc.view(np.int32)


def _check_buckets(buckets: int) -> int:
    if isinstance(buckets, bool) or not isinstance(buckets, Integral) or buckets < 1:
        raise ValueError(f"buckets must be an integer >= 1, got {buckets!r}")
    return int(buckets)


def _to_bucket(hashes: np.ndarray, buckets: int) -> np.ndarray:
    # Same as Hudi: (hash & Integer.MAX_VALUE) % numBuckets, non-negative.
    positive = hashes.astype(np.int64) & 0x7FFFFFFF
    return (positive % buckets).astype(np.int32)


def bucket_ids(keys: ArrayLike, buckets: int) -> np.ndarray:
    """Hudi bucket id (int32) of each single-field record key.

    ``keys`` is a pyarrow Array/ChunkedArray or a Python list of string,
    integer or date values; null keys raise ValueError.
    """
    buckets = _check_buckets(buckets)
    return _to_bucket(java_list_hash([keys]), buckets)


def bucket_ids_for_columns(columns: Sequence[ArrayLike], buckets: int) -> np.ndarray:
    """Hudi bucket id (int32) per row for a multi-field record key (one column per field)."""
    buckets = _check_buckets(buckets)
    return _to_bucket(java_list_hash(columns), buckets)


def file_group_id(bucket: int) -> str:
    """File group id owning ``bucket``: Hudi's bucket-index prefix form, e.g. ``00000005-0000-...``."""
    if isinstance(bucket, bool) or not isinstance(bucket, Integral) or not 0 <= bucket < 10**8:
        raise ValueError(f"bucket must be an integer in [0, 99999999], got {bucket!r}")
    return f"{int(bucket):08d}{_FILE_GROUP_SUFFIX}"


def bucket_of_file_group(fg_id: str) -> int:
    """Inverse of :func:`file_group_id`; ValueError if ``fg_id`` is not in that form."""
    match = _FILE_GROUP_RE.fullmatch(fg_id) if isinstance(fg_id, str) else None
    if match is None:
        raise ValueError(f"malformed bucket file group id {fg_id!r}; expected e.g. {file_group_id(5)!r}")
    return int(match.group(1))
