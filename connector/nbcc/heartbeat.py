"""Heartbeats of writes in flight: how the cleaner tells a slow writer from a dead one.

While a write is in flight, whoever writes its files refreshes `.nbcc/heartbeats/<instant>.json`
(`{"ms": <epoch ms>}`): a thread of the Python API writer, and every Spark task that writes (on
each batch, at most once per interval), so a long write stays alive however long it takes. An
inflight instant whose heartbeat is older than `heartbeat_timeout_s` (or that has none and was
requested that long ago) is failed and may be rolled back by another process (`rollback.py`).
"""

from __future__ import annotations

import json
import logging
import threading
import time

from .clock import parse_time
from .storage import Storage

log = logging.getLogger(__name__)

HEARTBEAT_DIR = ".nbcc/heartbeats"


def interval_s(timeout_s: float) -> float:
    """How often to beat: several times per timeout, so one slow storage call never expires it."""
    return max(0.2, timeout_s / 6)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def heartbeat_file(instant: str) -> str:
    return f"{HEARTBEAT_DIR}/{instant}.json"


def beat(storage: Storage, instant: str, failed: bool = False) -> None:
    """`failed`: the last beat of a compaction's execution that failed (format.md §14.1)."""
    # Not fsynced: after a power failure every writer of this machine is gone, and a lost or
    # empty heartbeat reads as expired, which is then the truth.
    body = {"ms": _now_ms(), **({"failed": True} if failed else {})}
    storage.replace(heartbeat_file(instant), json.dumps(body).encode(), durable=False)


def read_beat(storage: Storage, instant: str) -> tuple[int, bool] | None:
    """The last beat of `instant`: its epoch ms, and whether it marks an execution that failed;
    None if there is none."""
    try:
        body = json.loads(storage.read_bytes(heartbeat_file(instant)))
        return int(body["ms"]), body.get("failed") is True
    except (FileNotFoundError, ValueError, KeyError, TypeError):  # unreadable counts as none (format.md 14.1)
        return None


def last_beat_ms(storage: Storage, instant: str) -> int | None:
    last = read_beat(storage, instant)
    return None if last is None else last[0]


def idle_ms(storage: Storage, instant: str, now_ms: int | None = None) -> int:
    """Milliseconds since `instant` last showed a sign of life: its heartbeat, or with none its
    instant time (a writer that died before its first beat). What "failed" (format.md §14.1) and
    "abandoned" are measured by."""
    last = max(last_beat_ms(storage, instant) or 0, parse_time(instant))
    return (_now_ms() if now_ms is None else now_ms) - last


def remove(storage: Storage, instant: str) -> None:
    storage.delete(heartbeat_file(instant))


class Heartbeat:
    """A background thread that refreshes an instant's heartbeat until stopped. One of several
    writers of an instant (a Spark task) keeps the heartbeat when it stops (`keep=True`): the
    others may still be writing, and the commit deletes it. A compaction's execution keeps it
    only when it fails (`keep_if_failed=True`), with a last beat that says so: inline writers
    then wait for it to expire before they try the failing compaction again
    (compaction.abandoned_compactions), while a compaction job need not
    (compaction.executing_compactions). `beat_first=False`: the caller beat just now (a write's
    begin_write), so the first beat waits an interval."""

    def __init__(self, storage: Storage, instant: str, interval_s: float, keep: bool = False,
                 keep_if_failed: bool = False, beat_first: bool = True):
        self.storage, self.instant, self.interval_s, self.keep = storage, instant, interval_s, keep
        self.keep_if_failed, self.beat_first = keep_if_failed, beat_first
        self.removed = False  # set by whoever deleted the file after stop(): exiting need not
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nbcc-heartbeat-{instant}", daemon=True)

    def __enter__(self) -> "Heartbeat":
        if self.beat_first:
            beat(self.storage, self.instant)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                beat(self.storage, self.instant)
            except Exception:  # noqa: BLE001 - a missed beat is retried; expiry is generous
                pass

    def stop(self) -> None:
        """Stop beating for good: no late beat can put the file back once it is deleted (a
        commit's tidying deletes it with the pending files, in one request on S3)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop()
        if self.keep or self.removed:
            return
        if self.keep_if_failed and exc_type is not None:
            try:
                beat(self.storage, self.instant, failed=True)
            except Exception as err:  # noqa: BLE001 - as below; a job then waits for it to expire
                log.warning("could not mark the heartbeat of %s failed: %s", self.instant, err)
            return
        # Completed or failed, the beat is over either way. Best effort: a storage error here
        # must neither fail a write that completed nor hide the error of one that failed; a
        # leftover heartbeat only delays a rollback, and the cleaner deletes stale ones.
        try:
            remove(self.storage, self.instant)
        except Exception as err:  # noqa: BLE001
            log.warning("could not delete the heartbeat of %s: %s", self.instant, err)
