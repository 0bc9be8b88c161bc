"""Bloom filters of record keys: the `key_filters` of the metadata table (metadata_table.py).

A point lookup opens only the files whose filter may hold the key. The filter of a file is a bit
set over the UTF-8 bytes of its `_nbcc_record_key` values, built and probed with NumPy (no Python
loop per key). The hashes are fixed by the format (docs/format.md §18.3), so that any writer and
any reader agree:

    p1, p2 = polynomial hashes of the key's bytes, bases B1 and B2, mod 2**32 (Horner's rule)
    h1 = fmix32(p1);  h2 = fmix32(p2 xor SEED2) | 1            (MurmurHash3's finalizer)
    probe i (0 <= i < k) sets bit (x_i * m) >> 32, x_i = (h1 + i * h2) mod 2**32

with m = 8 x the filter's length in bytes, bit b at byte b // 8, value 1 << (b % 8). Ten bits
per key and k = 7 probes give about 1% false positives.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import pyarrow as pa

BITS_PER_KEY = 10
PROBES = 7
B1 = 0x01000193  # FNV-1's prime
B2 = 0x5BD1E995  # MurmurHash2's multiplier
SEED2 = 0x9E3779B9  # makes h2 differ from h1 for one-byte keys
_ROWS_PER_BLOCK = 1 << 20  # keys hashed per block: temporaries stay bounded


def _fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _horner(padded: np.ndarray, ends: np.ndarray, lengths: np.ndarray, width: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """(p1, p2) of strings of at most `width` bytes, column by column over every string at once:
    each string is read right-aligned, and its leading columns count as zero bytes, which leave
    a polynomial hash unchanged. `padded` is the data with `width` zero bytes in front."""
    n = len(ends)
    p1 = np.zeros(n, dtype=np.uint32)
    p2 = np.zeros(n, dtype=np.uint32)
    byte = np.empty(n, dtype=np.uint32)
    skip = width - lengths
    pos = ends.copy()  # index in `padded` of column 0: ends - width, shifted by the padding
    for col in range(width):
        byte[:] = padded[pos]
        byte[skip > col] = 0
        p1 *= np.uint32(B1)
        p1 += byte
        p2 *= np.uint32(B2)
        p2 += byte
        pos += 1
    return p1, p2


def _polynomials(data: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(p1, p2): sum_j data[j] * B**(len - 1 - j) per string mod 2**32, for B1 and B2."""
    lengths = np.diff(offsets)
    p1 = np.zeros(len(lengths), dtype=np.uint32)
    p2 = np.zeros(len(lengths), dtype=np.uint32)
    if not len(lengths) or int(lengths.max()) == 0:
        return p1, p2
    widest = int(lengths.max())
    padded = np.concatenate([np.zeros(widest, dtype=np.uint8), data])
    if widest * len(lengths) <= 2 * int(lengths.sum()) + len(lengths):  # lengths alike
        return _horner(padded, offsets[1:], lengths, widest)
    # Strings grouped by length class (up to 2**c bytes), so a few long keys cost only their
    # own bytes: the work is at most twice the bytes hashed.
    cls = np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    for c in np.unique(cls).tolist():
        rows = np.flatnonzero(cls == c)
        width = min(1 << c, widest)
        q1, q2 = _horner(padded, offsets[1:][rows] + (widest - width), lengths[rows], width)
        p1[rows] = q1
        p2[rows] = q2
    return p1, p2


def key_hashes(keys: pa.Array | pa.ChunkedArray | Iterable[str]) -> tuple[np.ndarray, np.ndarray]:
    """(h1, h2) of each key (uint32), the two hashes the probes are made of."""
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    elif not isinstance(keys, pa.Array):
        keys = pa.array(list(keys), pa.string())
    if pa.types.is_large_string(keys.type):
        keys = keys.cast(pa.large_string())
        off_dtype = np.int64
    else:
        keys = keys.cast(pa.string())
        off_dtype = np.int32
    if keys.null_count:
        raise ValueError("record keys are never null")
    n = len(keys)
    h1 = np.empty(n, dtype=np.uint32)
    h2 = np.empty(n, dtype=np.uint32)
    if n == 0:
        return h1, h2
    _, offsets_buf, data_buf = keys.buffers()[:3]
    offsets = np.frombuffer(offsets_buf, dtype=off_dtype)[keys.offset:keys.offset + n + 1].astype(np.int64)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    for r0 in range(0, n, _ROWS_PER_BLOCK):
        r1 = min(n, r0 + _ROWS_PER_BLOCK)
        block = offsets[r0:r1 + 1]
        p1, p2 = _polynomials(data, block)
        h1[r0:r1] = _fmix32(p1)
        h2[r0:r1] = _fmix32(p2 ^ np.uint32(SEED2)) | np.uint32(1)
    return h1, h2


def _probes(h1: np.ndarray, h2: np.ndarray, bits: int, probes: int) -> Iterable[np.ndarray]:
    """Bit indices of probe 0, 1, ...: x_i = (h1 + i*h2) mod 2**32 mapped to [0, bits) as
    (x_i * bits) >> 32 (a multiply, cheaper than a modulo)."""
    x = h1.copy()
    for _ in range(probes):
        yield ((x.astype(np.uint64) * np.uint64(bits)) >> np.uint64(32)).astype(np.int64)
        x += h2


def filter_bytes(keys: int) -> int:
    """Length in bytes of the filter of `keys` keys (a multiple of 8, at least 8)."""
    return max(8, math.ceil(keys * BITS_PER_KEY / 64) * 8)


def build(keys: pa.Array | pa.ChunkedArray | Iterable[str], probes: int = PROBES) -> bytes:
    """The filter of `keys` (duplicates count once in effect, but size the filter)."""
    h1, h2 = key_hashes(keys)
    bits = filter_bytes(len(h1)) * 8
    mask = np.zeros(bits, dtype=bool)
    for pos in _probes(h1, h2, bits, probes):
        mask[pos] = True
    return np.packbits(mask, bitorder="little").tobytes()


def may_contain(bitset: bytes, h1: np.ndarray, h2: np.ndarray, probes: int = PROBES) -> np.ndarray:
    """Per key (given by its hashes): False if the filter surely does not hold it."""
    if len(h1) == 0:
        return np.zeros(0, dtype=bool)
    packed = np.frombuffer(bitset, dtype=np.uint8)
    out = np.ones(len(h1), dtype=bool)
    for pos in _probes(h1, h2, len(packed) * 8, probes):
        out &= ((packed[pos >> 3] >> (pos & 7).astype(np.uint8)) & 1).astype(bool)
    return out
