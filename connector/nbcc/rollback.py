"""Rolling back failed writes: at once by the writer that failed (a Spark job's abort), or lazily
by the cleaner for writes whose heartbeat expired (a killed process, a lost driver).

An instant is never rolled back without re-reading the timeline under the table lock: one that
just completed is not failed (Hudi HUDI-5675). Under that lock the instant is marked
`<instant>.<action>.rolledback`; a commit checks for the mark under the same lock, so a slow
writer whose instant was rolled back can never complete it. Then its data files are deleted (the
ones it reported, and any file of the instant found in the partition folders), then its heartbeat
and requested/inflight files, then its rows in the metadata table. Every step can be repeated
after a crash.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable

from .clock import TimeGenerator
from .config import check_duration
from .errors import InvalidOptionError
from .filenames import data_file_path, parse_data_file
from .heartbeat import idle_ms, remove
from .storage import Storage
from .timeline import DATA_ACTIONS, ROLLEDBACK, TIMELINE_DIR, Timeline, is_completed, remove_pending_files

log = logging.getLogger(__name__)


def partition_folders(storage: Storage, depth: int) -> list[str]:
    """Every partition folder, found by listing (a rollback does this; a read never does)."""
    level = [""]
    for _ in range(depth):
        level = [f"{parent}/{name}" if parent else name
                 for parent in level for name in storage.list_names(parent)
                 if "=" in name and not name.startswith(".")]
    return level


def files_of_instants(storage: Storage, partition_depth: int, instants: set[str]) -> set[tuple[str, str]]:
    """The (partition, name) of every data file on storage that one of `instants` wrote."""
    found = set()
    for part in partition_folders(storage, partition_depth):
        for name in storage.list_names(part):
            try:
                if parse_data_file(name).instant in instants:
                    found.add((part, name))
            except ValueError:
                continue
    return found


def rollback_instant(storage: Storage, clock: TimeGenerator, instant: str, partition_depth: int,
                     files: Iterable[dict[str, Any]] = (), reason: str = "",
                     idle_for_s: float | None = None) -> bool:
    """Roll back write `instant` unless it completed (or, with `idle_for_s`, unless its heartbeat
    is fresher than that when re-read under the lock). True if it is (now) rolled back."""
    return _roll_back(storage, clock, instant, partition_depth, files, reason, idle_for_s) is not None


def _roll_back(storage: Storage, clock: TimeGenerator, instant: str, partition_depth: int,
               files: Iterable[dict[str, Any]], reason: str, idle_for_s: float | None) -> set[tuple[str, str]] | None:
    """`rollback_instant`; the (partition, file) pairs it deleted, None if it did not roll back."""
    with clock.locked() as grant:
        if idle_for_s is not None and idle_ms(storage, instant) <= idle_for_s * 1000:
            return None  # it beat again since it was found idle: alive
        inst = Timeline.load(storage).get(instant)
        if inst is not None and inst.action not in DATA_ACTIONS:
            raise InvalidOptionError(
                f"instant {instant} is a {inst.action}, not a write: only writes are rolled back "
                "(a pending compaction is finished by running it again)"
            )
        if inst is None or inst.is_completed:
            if inst is not None:
                log.warning("not rolling back %s: it completed", instant)
            return None
        mark_path = f"{TIMELINE_DIR}/{instant}.{inst.action}.{ROLLEDBACK}"
        if inst.state != ROLLEDBACK:
            mark = {"instant": instant, "rolled_back_at": grant.time, "reason": reason}
            grant.put_if_absent(storage, mark_path, json.dumps(mark).encode())
    if grant.overran and not _still_failed(storage, clock, instant, mark_path):
        return None
    doomed = {(f["partition"], f["name"]) for f in files} | files_of_instants(storage, partition_depth, {instant})
    storage.delete_many([data_file_path(part, name) for part, name in sorted(doomed)])
    remove(storage, instant)
    remove_pending_files(storage, instant, inst.action)
    from .metadata_table import forget_rolled_back  # it imports the write path, which imports this

    forget_rolled_back(storage, instant)  # its metadata table rows, written before it failed
    return doomed


def rollback_or_log(storage: Storage, clock: TimeGenerator, instant: str, partition_depth: int,
                    failure: BaseException, reason: str = "the write failed") -> None:
    """`rollback_instant` of a write that failed with `failure`, the error its caller goes on to
    raise: a rollback that fails too is logged, and the cleaner rolls the write back once its
    heartbeat expires."""
    try:
        rollback_instant(storage, clock, instant, partition_depth, reason=reason)
    except Exception as exc:  # noqa: BLE001 - the write's own error is the one to raise
        log.warning("write %s failed (%s) and rolling it back failed too (the cleaner rolls it back "
                    "once its heartbeat expires): %s", instant, failure, exc)


def _still_failed(storage: Storage, clock: TimeGenerator, instant: str, mark_path: str) -> bool:
    """The mark was put after the lease ran out: the writer may have taken the lock over and
    completed the instant before the mark landed. Look again under the lock (a holder puts
    before it releases); if it completed, its files are committed data: withdraw the mark."""
    with clock.locked():
        if is_completed(storage, instant):
            log.error("rollback of %s: its mark was published after the table lock's lease, and the "
                      "write completed meanwhile; the mark is withdrawn and nothing is deleted", instant)
            storage.delete(mark_path)
            return False
    return True


@dataclass(frozen=True)
class FailedWrite:
    instant: str
    action: str
    idle_s: float


def failed_writes(storage: Storage, timeout_s: float, timeline: Timeline | None = None) -> list[FailedWrite]:
    """Pending writes whose heartbeat (or, if none, their start) is older than `timeout_s`."""
    check_duration("heartbeat_timeout_s", timeout_s, "seconds")  # below 0: as 0, every write in flight
    timeline = timeline or Timeline.load(storage)
    now = time.time_ns() // 1_000_000
    out = []
    for inst in timeline.pending():
        if inst.action not in DATA_ACTIONS:
            continue
        idle = idle_ms(storage, inst.instant, now)
        if idle > timeout_s * 1000:
            out.append(FailedWrite(inst.instant, inst.action, idle / 1000))
    return out


def rollback_failed_writes(storage: Storage, clock: TimeGenerator, partition_depth: int,
                           timeout_s: float, timeline: Timeline | None = None) -> dict[str, set[tuple[str, str]]]:
    """Lazily roll back every write whose heartbeat expired (of `timeline`, loaded if None); the
    instants rolled back, each with the (partition, file) pairs of its that were deleted."""
    done = {}
    for failed in failed_writes(storage, timeout_s, timeline):
        reason = f"heartbeat expired ({failed.idle_s:.0f} s without one, timeout {timeout_s:.0f} s)"
        deleted = _roll_back(storage, clock, failed.instant, partition_depth, (), reason, timeout_s)
        if deleted is not None:
            done[failed.instant] = deleted
    return done
