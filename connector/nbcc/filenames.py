"""Names of data files, which carry everything file slicing needs.

    log file:  <file_group_id>_<instant>.log.<version>_<token>      (Parquet, written by writers)
    base file: <file_group_id>_<token>_<instant>.parquet           (written by compaction)

`token` is `a-b-c`, three non-negative integers that no other writer of the same instant uses
(a Spark task's partition id, stage id and task attempt id). Log order, which decides ties in
merging (RFC-66): instant, then version as an integer, then token as three integers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Union

from .clock import TIME_LEN

LOG_MARK = ".log."
BASE_SUFFIX = ".parquet"


@functools.lru_cache(maxsize=1 << 12)  # few distinct tokens, each parsed for every log's order
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


# File slicing parses every data file name of a table at every plan (a clean, at every time of
# its window): a name always stands for the same file, so parses are remembered.
@functools.lru_cache(maxsize=1 << 17)
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


def _check_common(file_group_id: str, instant: str, token: str) -> None:
    _parse_token(token)
    if not _is_instant(instant):
        raise ValueError(f"instant {instant!r} is not a 17-digit time")
    if not file_group_id or "_" in file_group_id:
        raise ValueError(f"file group id {file_group_id!r} must be non-empty and contain no '_'")


def log_file_name(file_group_id: str, instant: str, version: int, token: str) -> str:
    """The name of a log file; refuses anything `parse_data_file` could not read back."""
    _check_common(file_group_id, instant, token)
    if int(version) < 1:
        raise ValueError(f"log file versions start at 1, got {version}")
    return LogFile(file_group_id, instant, int(version), token).name


def base_file_name(file_group_id: str, token: str, instant: str) -> str:
    _check_common(file_group_id, instant, token)
    return BaseFile(file_group_id, token, instant).name


def data_file_path(partition: str, name: str) -> str:
    """A data file's path relative to the table root (an unpartitioned table's files live in it)."""
    return f"{partition}/{name}" if partition else name
