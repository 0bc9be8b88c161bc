"""Tests for nbcc.buckets: Hudi-compatible bucket-index hashing."""

from __future__ import annotations

import datetime
import json
import pathlib
import random
import sys

import numpy as np
import pyarrow as pa
import pytest

_CONNECTOR = str(pathlib.Path(__file__).resolve().parents[1] / "connector")
if _CONNECTOR not in sys.path:
    sys.path.insert(0, _CONNECTOR)

from nbcc.buckets import (  # noqa: E402
    bucket_ids,
    bucket_ids_for_columns,
    bucket_of_file_group,
    file_group_id,
    java_list_hash,
)

VECTORS_PATH = pathlib.Path(__file__).resolve().parents[2] / "shared" / "testdata" / "bucket_hash_vectors.json"


# --- independent pure-Python reference of the Java semantics ---------------------------


def _to_int32(x: int) -> int:
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= (1 << 31) else x


def ref_string_hash(s: str) -> int:
    """Java String.hashCode(): h = 31*h + c over UTF-16 code units, int32 wrap."""
    raw = s.encode("utf-16-le")
    h = 0
    for i in range(0, len(raw), 2):
        unit = raw[i] | (raw[i + 1] << 8)
        h = _to_int32(31 * h + unit)
    return h


def ref_list_hash(elements: list[str]) -> int:
    """Java List<String>.hashCode(): h = 1; h = 31*h + e.hashCode()."""
    h = 1
    for e in elements:
        h = _to_int32(31 * h + ref_string_hash(e))
    return h


def ref_bucket(elements: list[str], buckets: int) -> int:
    return (ref_list_hash(elements) & 0x7FFFFFFF) % buckets


# --- shared test vectors ---------------------------------------------------------------


@pytest.fixture(scope="module")
def vectors() -> list[dict]:
    if not VECTORS_PATH.is_file():
        pytest.fail(
            f"bucket hash test vectors not found at {VECTORS_PATH}; "
            "the shared/ directory must sit beside the repository checkout"
        )
    data = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))
    assert data, "bucket hash vector file is empty"
    return data


def test_reference_matches_known_java_values() -> None:
    # Sanity check of the reference itself against well-known Java results.
    assert ref_string_hash("") == 0
    assert ref_string_hash("a") == 97
    assert ref_string_hash("hello") == 99162322
    assert ref_list_hash([]) == 1
    assert ref_list_hash(["a"]) == 128


def test_vectors_include_non_ascii_and_non_bmp(vectors: list[dict]) -> None:
    keys = [v["key"] for v in vectors]
    assert any(any(0x80 <= ord(c) <= 0xFFFF for c in k) for k in keys)
    assert any(any(ord(c) > 0xFFFF for c in k) for k in keys)


def test_java_list_hash_vectors(vectors: list[dict]) -> None:
    keys = pa.array([v["key"] for v in vectors])
    got = java_list_hash([keys])  # one vectorized call for all keys
    assert got.dtype == np.int32
    expected = np.array([v["java_list_hash"] for v in vectors], dtype=np.int32)
    mismatches = [(v["key"], int(g), int(e)) for v, g, e in zip(vectors, got, expected) if g != e]
    assert not mismatches


def test_reference_agrees_with_vectors(vectors: list[dict]) -> None:
    for v in vectors:
        assert ref_list_hash([v["key"]]) == v["java_list_hash"], v["key"]


def test_bucket_ids_vectors(vectors: list[dict]) -> None:
    keys = pa.array([v["key"] for v in vectors])
    counts = sorted({int(n) for v in vectors for n in v["bucket"]})
    assert counts
    for n in counts:
        rows = [i for i, v in enumerate(vectors) if str(n) in v["bucket"]]
        got = bucket_ids(keys, n)
        assert got.dtype == np.int32
        assert len(got) == len(vectors)
        expected = [vectors[i]["bucket"][str(n)] for i in rows]
        assert got[rows].tolist() == expected, f"buckets={n}"


def test_bucket_ids_accepts_python_list(vectors: list[dict]) -> None:
    keys = [v["key"] for v in vectors]
    assert bucket_ids(keys, 16).tolist() == bucket_ids(pa.array(keys), 16).tolist()


# --- slicing, chunking, string flavours -------------------------------------------------


def _mixed_keys() -> list[str]:
    return ["", "a", "éclair", "日本語キー", "emoji😀key", "k1", "𝄞", "x" * 40, "key-0001", "ü", "", "z😀", "42", "end"]


@pytest.mark.parametrize("typ", [pa.string(), pa.large_string(), pa.string_view()])
def test_string_types(typ: pa.DataType) -> None:
    keys = _mixed_keys()
    got = java_list_hash([pa.array(keys, type=typ)])
    assert got.tolist() == [ref_list_hash([k]) for k in keys]


def test_sliced_array_matches_unsliced() -> None:
    keys = _mixed_keys()
    arr = pa.array(keys)
    sliced = arr.slice(3, 10)
    assert java_list_hash([sliced]).tolist() == java_list_hash([pa.array(keys[3:13])]).tolist()
    assert java_list_hash([sliced]).tolist() == java_list_hash([arr]).tolist()[3:13]
    assert bucket_ids(sliced, 7).tolist() == bucket_ids(arr, 7).tolist()[3:13]


def test_sliced_ascii_and_integer_arrays() -> None:
    ascii_arr = pa.array([f"key-{i:07d}" for i in range(20)])
    assert bucket_ids(ascii_arr.slice(3, 10), 13).tolist() == bucket_ids(ascii_arr, 13).tolist()[3:13]
    ints = pa.array(range(-10, 10), type=pa.int64())
    assert bucket_ids(ints.slice(3, 10), 13).tolist() == bucket_ids(ints, 13).tolist()[3:13]


def test_chunked_array_matches_contiguous() -> None:
    keys = _mixed_keys()
    arr = pa.array(keys)
    chunked = pa.chunked_array([pa.array(keys[:4]), pa.array(keys[4:5]), pa.array([], pa.string()), pa.array(keys[5:])])
    assert java_list_hash([chunked]).tolist() == java_list_hash([arr]).tolist()
    assert bucket_ids(chunked, 256).tolist() == bucket_ids(arr, 256).tolist()
    # Chunks that are themselves slices of a larger buffer.
    chunked2 = pa.chunked_array([arr.slice(0, 5), arr.slice(5)])
    assert bucket_ids(chunked2, 256).tolist() == bucket_ids(arr, 256).tolist()


def test_empty_input() -> None:
    assert bucket_ids(pa.array([], pa.string()), 4).tolist() == []
    assert bucket_ids(pa.chunked_array([], pa.string()), 4).tolist() == []


def test_all_empty_strings() -> None:
    got = java_list_hash([pa.array(["", "", ""])])
    assert got.tolist() == [31, 31, 31]


# --- non-string key types --------------------------------------------------------------


def test_integer_keys_match_their_decimal_text() -> None:
    assert bucket_ids(pa.array([42, -7]), 16).tolist() == bucket_ids(pa.array(["42", "-7"]), 16).tolist()
    assert bucket_ids([42, -7], 1000).tolist() == bucket_ids(["42", "-7"], 1000).tolist()


@pytest.mark.parametrize("typ", [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint32(), pa.uint64()])
def test_integer_types(typ: pa.DataType) -> None:
    values = [0, 1, 7, 100, 127]
    if pa.types.is_signed_integer(typ):
        values += [-1, -128]
    got = java_list_hash([pa.array(values, type=typ)])
    assert got.tolist() == [ref_list_hash([str(v)]) for v in values]


def test_int64_extremes() -> None:
    values = [-(2**63), 2**63 - 1, 12345678901234567890 - 2**64]
    got = java_list_hash([pa.array(values, type=pa.int64())])
    assert got.tolist() == [ref_list_hash([str(v)]) for v in values]


@pytest.mark.parametrize("typ", [pa.date32(), pa.date64()])
def test_date_keys_use_iso_format(typ: pa.DataType) -> None:
    dates = [datetime.date(2026, 11, 21), datetime.date(1970, 1, 1), datetime.date(1999, 2, 3)]
    got = bucket_ids(pa.array(dates, type=typ), 97)
    assert got.tolist() == [ref_bucket([d.isoformat()], 97) for d in dates]


def test_dictionary_encoded_strings() -> None:
    keys = ["a", "b", "a", "日本"]
    dict_arr = pa.array(keys).dictionary_encode()
    assert bucket_ids(dict_arr, 7).tolist() == bucket_ids(pa.array(keys), 7).tolist()


# --- multi-field keys ------------------------------------------------------------------


def test_multi_field_matches_java_list_of() -> None:
    got = java_list_hash([pa.array(["a"]), pa.array(["b"])])
    # Java: List.of("a", "b").hashCode() == 31 * (31 * 1 + 97) + 98 == 4066
    assert got.tolist() == [ref_list_hash(["a", "b"])] == [4066]


def test_multi_field_mixed_types() -> None:
    a = pa.array(["x", "éé", "😀", ""])
    b = pa.array([1, -2, 3, 40], type=pa.int32())
    c = pa.array([datetime.date(2024, 1, 31)] * 4, type=pa.date32())
    expected = [ref_list_hash([s, str(i), "2024-01-31"]) for s, i in zip(a.to_pylist(), b.to_pylist())]
    assert java_list_hash([a, b, c]).tolist() == expected
    assert bucket_ids_for_columns([a, b, c], 64).tolist() == [(h & 0x7FFFFFFF) % 64 for h in expected]


def test_multi_field_length_mismatch() -> None:
    with pytest.raises(ValueError):
        java_list_hash([pa.array(["a", "b"]), pa.array(["c"])])
    with pytest.raises(ValueError):
        java_list_hash([])


# --- randomized comparison with the reference ------------------------------------------


def _random_string(rng: random.Random) -> str:
    n = rng.choice([0, 1, 2, 3, 5, 8, 13, 30, 70])
    pools = [
        (0x20, 0x7E),  # ASCII
        (0xA0, 0x7FF),  # 2-byte UTF-8
        (0x800, 0xD7FF),  # 3-byte UTF-8
        (0xE000, 0xFFFD),  # 3-byte UTF-8 above the surrogate range
        (0x10000, 0x10FFFF),  # non-BMP: 4-byte UTF-8, surrogate pair in UTF-16
    ]
    out = []
    for _ in range(n):
        lo, hi = pools[rng.randrange(len(pools))]
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def test_randomized_against_reference() -> None:
    rng = random.Random(20261121)
    keys = [_random_string(rng) for _ in range(3000)]
    assert any(any(ord(c) > 0xFFFF for c in k) for k in keys)
    arr = pa.array(keys)
    assert java_list_hash([arr]).tolist() == [ref_list_hash([k]) for k in keys]
    assert bucket_ids(arr, 1000).tolist() == [ref_bucket([k], 1000) for k in keys]
    # Two-field keys with the same random strings, paired with a shifted copy.
    other = keys[1:] + keys[:1]
    assert java_list_hash([arr, pa.array(other)]).tolist() == [ref_list_hash([x, y]) for x, y in zip(keys, other)]


def test_randomized_ascii_against_reference() -> None:
    rng = random.Random(7)
    keys = ["".join(chr(rng.randint(0x20, 0x7E)) for _ in range(rng.randint(0, 40))) for _ in range(2000)]
    assert java_list_hash([pa.array(keys)]).tolist() == [ref_list_hash([k]) for k in keys]


# --- errors ----------------------------------------------------------------------------


def test_null_keys_rejected() -> None:
    with pytest.raises(ValueError, match="null"):
        bucket_ids(pa.array(["a", None]), 4)
    with pytest.raises(ValueError, match="null"):
        bucket_ids(["a", None], 4)
    with pytest.raises(ValueError, match="null"):
        bucket_ids_for_columns([pa.array(["a"]), pa.array([None], pa.int64())], 4)


def test_float_keys_rejected() -> None:
    with pytest.raises(TypeError, match="double"):
        bucket_ids(pa.array([1.5, 2.0]), 4)
    with pytest.raises(TypeError, match="string"):
        bucket_ids(pa.array([1.5]), 4)


@pytest.mark.parametrize("buckets", [0, -1, 2.0, True, "4"])
def test_bad_bucket_count_rejected(buckets: object) -> None:
    with pytest.raises(ValueError):
        bucket_ids(pa.array(["a"]), buckets)  # type: ignore[arg-type]


def test_numpy_integer_bucket_count_accepted() -> None:
    assert bucket_ids(pa.array(["a"]), np.int64(7)).tolist() == [2]


# --- file group ids --------------------------------------------------------------------


def test_file_group_id_roundtrip() -> None:
    assert file_group_id(5) == "00000005-0000-0000-0000-000000000000"
    assert bucket_of_file_group("00000005-0000-0000-0000-000000000000") == 5
    for b in [0, 1, 255, 99999999]:
        assert bucket_of_file_group(file_group_id(b)) == b


@pytest.mark.parametrize(
    "fg_id",
    [
        "",
        "5",
        "0000005-0000-0000-0000-000000000000",
        "00000005-0000-0000-0000-00000000000",
        "0000000x-0000-0000-0000-000000000000",
        "00000005-0000-0000-0000-000000000000-0",
        "00000005-1234-0000-0000-000000000000",
        "٠٠٠٠٠٠٠5-0000-0000-0000-000000000000",
    ],
)
def test_bucket_of_file_group_rejects_malformed(fg_id: str) -> None:
    with pytest.raises(ValueError):
        bucket_of_file_group(fg_id)


def test_file_group_id_rejects_bad_bucket() -> None:
    for bad in [-1, 10**8]:
        with pytest.raises(ValueError):
            file_group_id(bad)


# --- internal code paths ---------------------------------------------------------------


def test_equal_length_keys() -> None:
    # All keys the same number of UTF-16 units takes the 2-D fast path.
    ascii_keys = [f"key-{i:07d}" for i in range(500)]
    assert java_list_hash([pa.array(ascii_keys)]).tolist() == [ref_list_hash([k]) for k in ascii_keys]
    # "é😀" and "abc" are both 3 UTF-16 code units.
    mixed = ["é😀", "abc", "日本語", "😀x"]
    assert java_list_hash([pa.array(mixed)]).tolist() == [ref_list_hash([k]) for k in mixed]


@pytest.mark.parametrize("block", [1, 5, 64])
def test_small_blocks(monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    # Force many block boundaries (including blocks of only empty strings).
    import nbcc.buckets as buckets_mod

    monkeypatch.setattr(buckets_mod, "_BLOCK_UNITS", block)
    rng = random.Random(block)
    keys = [_random_string(rng) for _ in range(300)] + [""] * 5 + ["abc"] * 20 + [""] * 3
    assert java_list_hash([pa.array(keys)]).tolist() == [ref_list_hash([k]) for k in keys]
    ascii_keys = [f"k{i}" for i in range(100)] + [""] * 4
    assert java_list_hash([pa.array(ascii_keys)]).tolist() == [ref_list_hash([k]) for k in ascii_keys]
