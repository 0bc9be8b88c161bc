"""Names of data files, which carry everything file slicing needs.

    log file:  <file_group_id>_<instant>.log.<version>_<token>      (Parquet, written by writers)
    base file: <file_group_id>_<token>_<instant>.parquet           (written by compaction)

`token` is `a-b-c`, three non-negative integers that no other writer of the same instant uses
(a Spark task's partition id, stage id and attempt number). Log order, which decides ties in
merging (RFC-66): instant, then version as an integer, then token as three integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .clock import TIME_LEN

LOG_MARK = ".log."
BASE_SUFFIX = ".parquet"


def _parse_token(token: str) -> tuple[int, int, int]:
    parts = token.split("-")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"write token {token!r} is not three non-negative integers a-b-c")
    return int(parts[0]), int(parts[1]), int(parts[2])


def make_token(a: int, b: int, c: int) -> str:
    if min(a, b, c) < 0:
        raise ValueError("write token numbers must be non-negative")
    return f"{a}-{b}-{c}"


def _is_instant(text: str) -> bool:
    return len(text) == TIME_LEN and text.isdigit()


@dataclass(frozen=True)
class LogFile:
    file_group_id: str
    instant: str
    version: int
    token: str

    @property
    def name(self) -> str:
        return f"{self.file_group_id}_{self.instant}{LOG_MARK}{self.version}_{self.token}"

    @property
    def order_key(self) -> tuple:
        return (self.instant, self.version, _parse_token(self.token))


@dataclass(frozen=True)
class BaseFile:
    file_group_id: str
    token: str
    instant: str

    @property
    def name(self) -> str:
        return f"{self.file_group_id}_{self.token}_{self.instant}{BASE_SUFFIX}"


DataFile = Union[LogFile, BaseFile]


def parse_data_file(name: str) -> DataFile:
    """Parse a data file name; ValueError for anything that is not one."""
    fg, sep, rest = name.partition("_")
    if not sep or not fg:
        raise ValueError(f"{name!r} is not an nbcc data file name")
    if LOG_MARK in rest:
        instant, _, tail = rest.partition(LOG_MARK)
        version, sep, token = tail.partition("_")
        if sep and _is_instant(instant) and version.isdigit() and int(version) >= 1:
            _parse_token(token)
            return LogFile(fg, instant, int(version), token)
    elif rest.endswith(BASE_SUFFIX):
        token, sep, instant = rest[: -len(BASE_SUFFIX)].partition("_")
        if sep and _is_instant(instant):
            _parse_token(token)
            return BaseFile(fg, token, instant)
    raise ValueError(f"{name!r} is not an nbcc data file name")


def log_file_name(file_group_id: str, instant: str, version: int, token: str) -> str:
    _parse_token(token)
    return LogFile(file_group_id, instant, version, token).name


def base_file_name(file_group_id: str, token: str, instant: str) -> str:
    _parse_token(token)
    return BaseFile(file_group_id, token, instant).name
