"""Data file names: they carry everything file slicing needs, so they must round-trip exactly and
sort in RFC-66's log order (instant, then version as an integer, then token as three integers)."""

from __future__ import annotations

import random

import pytest

from nbcc.filenames import (
    BaseFile,
    LogFile,
    base_file_name,
    log_file_name,
    make_token,
    parse_data_file,
)

FG = "00000003-0000-0000-0000-000000000000"
T1 = "20240102030405006"
T2 = "20240102030405007"


def test_log_file_name_is_the_documented_layout_and_round_trips():
    name = log_file_name(FG, T1, 1, "4-2-0")
    # <file_group_id>_<instant>.log.<version>_<token>, written out by hand
    assert name == "00000003-0000-0000-0000-000000000000_20240102030405006.log.1_4-2-0"
    parsed = parse_data_file(name)
    assert isinstance(parsed, LogFile)
    assert (parsed.file_group_id, parsed.instant, parsed.version, parsed.token) == (FG, T1, 1, "4-2-0")
    assert parsed.name == name


def test_base_file_name_is_the_documented_layout_and_round_trips():
    name = base_file_name(FG, "0-17-3", T2)
    # <file_group_id>_<token>_<instant>.parquet
    assert name == "00000003-0000-0000-0000-000000000000_0-17-3_20240102030405007.parquet"
    parsed = parse_data_file(name)
    assert isinstance(parsed, BaseFile)
    assert (parsed.file_group_id, parsed.token, parsed.instant) == (FG, "0-17-3", T2)
    assert parsed.name == name


@pytest.mark.parametrize("version", [1, 9, 10, 123456])
@pytest.mark.parametrize("token", ["0-0-0", "12-345-6789", "1000000-1-2"])
def test_log_names_round_trip_over_versions_and_tokens(version, token):
    name = log_file_name(FG, T1, version, token)
    parsed = parse_data_file(name)
    assert (parsed.file_group_id, parsed.instant, parsed.version, parsed.token) == (FG, T1, version, token)
    assert parsed.name == name


def test_make_token_builds_a_parseable_token_and_refuses_negative_numbers():
    assert make_token(3, 14, 1) == "3-14-1"
    assert parse_data_file(log_file_name(FG, T1, 1, make_token(3, 14, 1))).token == "3-14-1"
    with pytest.raises(ValueError):
        make_token(0, -1, 0)


def _log_order(names):
    return sorted(names, key=lambda n: parse_data_file(n).order_key)


def test_log_order_is_instant_then_version_as_integer_then_token_as_integers():
    # The expected order, written by hand (lexicographic order of the names differs from it).
    expected = [
        log_file_name(FG, T1, 1, "2-0-0"),
        log_file_name(FG, T1, 1, "10-0-0"),   # token 10 after token 2 (as integers)
        log_file_name(FG, T1, 2, "0-0-0"),
        log_file_name(FG, T1, 9, "0-0-0"),
        log_file_name(FG, T1, 9, "0-0-1"),
        log_file_name(FG, T1, 9, "0-2-0"),   # second number compared before the third
        log_file_name(FG, T1, 9, "0-10-0"),
        log_file_name(FG, T1, 10, "0-0-0"),  # version 10 after version 9
        log_file_name(FG, T1, 11, "0-0-0"),
        log_file_name(FG, T2, 1, "0-0-0"),   # a later instant after every version of T1
    ]
    # Plain string sorting gets this wrong, so the test can tell the two apart.
    assert sorted(expected) != expected
    rng = random.Random(7)
    for _ in range(5):
        shuffled = expected[:]
        rng.shuffle(shuffled)
        assert _log_order(shuffled) == expected


@pytest.mark.parametrize(
    "name",
    [
        "",
        "part-00000.parquet",
        "_SUCCESS",
        ".nbcc",
        "00000003-0000-0000-0000-000000000000",
        # log names with a broken part
        f"{FG}_{T1}.log.1",                      # no token
        f"{FG}_{T1}.log._1-2-3",                 # no version
        f"{FG}_{T1}.log.0_1-2-3",                # versions start at 1
        f"{FG}_{T1}.log.x_1-2-3",                # version not a number
        f"{FG}_{T1}.log.1_1-2",                  # token of two numbers
        f"{FG}_{T1}.log.1_1-2-3-4",              # token of four numbers
        f"{FG}_{T1}.log.1_a-b-c",                # token not numbers
        f"{FG}_{T1}.log.1_1--3",                 # empty token part
        f"{FG}_{T1}.log.1_-1-2-3",               # negative token part
        f"{FG}_{T1}.log.1_1-2-3.crc",            # a checksum side file
        f"{FG}_2024010203040500.log.1_1-2-3",    # 16-digit instant
        f"{FG}_202401020304050066.log.1_1-2-3",  # 18-digit instant
        f"{FG}_2024010203040500x.log.1_1-2-3",   # instant not digits
        f"_{T1}.log.1_1-2-3",                    # no file group id
        # base names with a broken part
        f"{FG}_1-2-3_{T1}.parquet.crc",
        f"{FG}_1-2-3_{T1}",
        f"{FG}_1-2_{T1}.parquet",
        f"{FG}_1-2-3_2024.parquet",
        f"{FG}_{T1}.parquet",                    # no token
        f"_1-2-3_{T1}.parquet",
    ],
)
def test_malformed_names_raise_value_error(name):
    with pytest.raises(ValueError):
        parse_data_file(name)


@pytest.mark.parametrize("token", ["", "1-2", "1-2-3-4", "a-1-2", "1-2-", "-1-2-3", "1.0-2-3", " 1-2-3"])
def test_malformed_tokens_raise_value_error(token):
    with pytest.raises(ValueError):
        log_file_name(FG, T1, 1, token)
    with pytest.raises(ValueError):
        base_file_name(FG, token, T1)


@pytest.mark.parametrize(
    "instant, version",
    [("2024", 1), ("2024010203040500x", 1), (T1, 0)],
)
def test_log_file_name_refuses_what_could_not_be_read_back(instant, version):
    # A writer must not be able to create a file whose name the reader then rejects.
    with pytest.raises(ValueError):
        log_file_name(FG, instant, version, "1-2-3")


@pytest.mark.parametrize("instant", ["2024", "202401020304050066"])
def test_base_file_name_refuses_a_bad_instant(instant):
    with pytest.raises(ValueError):
        base_file_name(FG, "1-2-3", instant)
