"""The table lock and the time generator: one monotonic clock for every writer of a table.

The lock is a compare-and-swap register built on put-if-absent alone, so it works the same on
local disk and S3 with no lock server. Its state is a sequence of small JSON files
`.nbcc/lock/<seq>.json`; the file with the greatest `seq` is the current state, and a change is the
put-if-absent of `seq + 1` (one winner). The state carries

- `holder` and `lease_until_ms`: who holds the lock and until when. A crashed holder's lease runs
  out and the next process takes the lock over; no lock is ever held forever. Whether a lease ran
  out is judged on the waiting process's own monotonic clock (it has seen the same held state
  for a whole lease), never by comparing another machine's wall clock with its own: a holder
  whose clock ran fast would block the table, one whose clock ran slow would be taken over
  while it still writes.
- `last_time_ms`: the last time issued. Every new time is `max(now, last + 1 ms)`, so times are
  strictly increasing across processes and machines without Hudi's sleep of the clock skew.

A process remembers the free state it installed last (a release, an instant time): its next swap
starts from it without reading the register, and reads only when another process swapped since
(the put finds the slot taken). A writer alone on a table so sends a put and a list per swap.

Instant times are issued by one CAS while the lock is free. A completion time is issued by the
CAS that takes the lock, and the completed instant file is created before the lock is released:
RFC-66 needs those two steps to be atomic with respect to compaction scheduling.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from fractions import Fraction
from typing import Iterator

from .errors import InvalidOptionError, LockLostError, LockTimeoutError
from .storage import Storage

log = logging.getLogger(__name__)

LOCK_DIR = ".nbcc/lock"
_KEEP_STATES = 8  # older state files are garbage; keep a few for debugging
_MAX_RETRIED_STATES = 1000  # old states whose delete failed, kept to try again (one request on S3)
_MAX_BACKOFF_S = 0.05

TIME_LEN = 17  # yyyyMMddHHmmssSSS
BEFORE_ALL = "0" * TIME_LEN  # a time before every instant and completion time


def format_time(ms: int) -> str:
    dt = datetime.fromtimestamp(ms / 1000.0, tz=timezone.utc)
    return dt.strftime("%Y%m%d%H%M%S") + f"{ms % 1000:03d}"


def parse_time(text: str) -> int:
    """Milliseconds since the epoch of a 17-digit `yyyyMMddHHmmssSSS` UTC time."""
    if len(text) != TIME_LEN or not text.isdigit():
        raise InvalidOptionError(f"{text!r} is not a 17-digit instant time (yyyyMMddHHmmssSSS, UTC)")
    dt = datetime.strptime(text[:14], "%Y%m%d%H%M%S").replace(tzinfo=timezone.utc)
    return int(dt.timestamp()) * 1000 + int(text[14:])


# ISO-8601 in its extended form, as Arrow reads it: a date, then maybe a time (to any fraction of
# a second: `datetime.fromisoformat` cuts it at microseconds, and on Python 3.10 takes 3 or 6
# digits and no Z) and a zone.
_ISO = re.compile(r"(\d{4})-(\d\d)-(\d\d)(?:[Tt ](\d\d):(\d\d)(?::(\d\d)(?:[.,](\d+))?)?)?"
                  r"\s*(?:([zZ])|([+-])(\d\d)(?::?(\d\d))?)?")


def parse_iso_time(text: str) -> tuple[datetime, Fraction] | None:
    """ISO text as (a datetime, the seconds below its microsecond), or None if it is not one."""
    m = _ISO.fullmatch(text.strip())
    if m is None:
        return None
    year, month, day, hour, minute, second, digits, z, sign, off_h, off_m = m.groups()
    digits = digits or ""
    if int(off_m or 0) >= 60:
        return None
    try:
        zone = None
        if z or sign:
            offset = timedelta(hours=int(off_h or 0), minutes=int(off_m or 0))
            zone = timezone(-offset if sign == "-" else offset)
        when = datetime(int(year), int(month), int(day), int(hour or 0), int(minute or 0), int(second or 0),
                        int(digits[:6].ljust(6, "0")), zone)
    except ValueError:  # a month 13, an offset of a day or more, ...
        return None
    return when, Fraction(int(digits[6:] or 0), 10**len(digits)) if len(digits) > 6 else Fraction(0)


TIME_FORMS = ("a 17-digit instant time yyyyMMddHHmmssSSS (UTC), e.g. 20261121103000123, or an "
              "ISO-8601 timestamp, e.g. 2026-11-21T10:30:00Z, 2026-11-21 10:30:00.123+01:00 or "
              "2026-11-21 (UTC when it has no zone)")


def parse_time_option(value: object, name: str) -> str:
    """A user-given time (`as_of`, `begin`, `end`) as a 17-digit UTC time, rounded down to the
    millisecond (times on the timeline are whole milliseconds, so `<=` is unchanged)."""
    text = str(value).strip()
    if len(text) == TIME_LEN and text.isdigit():
        try:
            parse_time(text)
            return text
        except ValueError:
            pass
    elif not text.isdigit():  # digits of another length are a mistyped instant, not ISO
        moment = (parse_iso_time(text) or (None,))[0]
        if moment is not None:
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=timezone.utc)
            micros = (moment - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(microseconds=1)
            try:
                return format_time(micros // 1000)
            except (ValueError, OverflowError):  # past 9999-12-31 in UTC: no 17-digit time
                raise InvalidOptionError(f"{name}={value!r} is after 9999-12-31T23:59:59.999Z, the last "
                                         "time the timeline can hold") from None
    raise InvalidOptionError(f"{name}={value!r} is not a time; use {TIME_FORMS}")


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _state_file(seq: int) -> str:
    return f"{LOCK_DIR}/{seq:020d}.json"


@dataclass(frozen=True)
class LockState:
    seq: int
    holder: str | None
    lease_until_ms: int
    last_time_ms: int
    lease_ms: int = 0  # the holder's lease (0: not recorded, or free)

    def is_free(self, watched_ms: float, lease_ms: int) -> bool:
        """Free, or held by a holder whose lease ran out: this process has seen this very state
        as the current one for `watched_ms`, at least a lease (the holder's, if longer than this
        process's `lease_ms`). The holder counts its lease from before its swap, so it stops
        writing (`LockGrant.check`) well before."""
        return self.holder is None or watched_ms >= max(lease_ms, self.lease_ms)


@dataclass
class LockStats:
    """What the lock cost this process: it must stay small (it is on every commit's path)."""

    acquisitions: int = 0
    total_wait_ms: float = 0.0
    max_wait_ms: float = 0.0
    total_hold_ms: float = 0.0
    max_hold_ms: float = 0.0
    cas_conflicts: int = 0


@dataclass
class LockGrant:
    """The lock, held. `time` is the time issued when the lock was taken."""

    time: str
    state: LockState
    wait_ms: float
    lease_ms: int
    _acquired_mono: float = field(default_factory=time.monotonic)
    # A write under this grant returned more than a whole lease after the lock was taken: it may
    # have landed after another process took the lock over and issued later times.
    overran: bool = False

    @property
    def held_ms(self) -> float:
        return (time.monotonic() - self._acquired_mono) * 1000

    @property
    def deadline(self) -> float:
        """The `time.monotonic()` after which no write made under this grant may start (nor be
        retried): half the lease, as `check` allows."""
        return self._acquired_mono + self.lease_ms / 2000

    @property
    def lease_end(self) -> float:
        """The `time.monotonic()` at which this grant's lease runs out: a write still running
        then is given up (on S3, where one call can otherwise retry for minutes)."""
        return self._acquired_mono + self.lease_ms / 1000

    def check(self) -> None:
        """Raise unless well inside the lease. Called right before the critical write, so a
        holder that stalled (GC pause, suspended VM) never writes after another took over: the
        write has the other half of the lease to land."""
        held_ms = self.held_ms
        if held_ms > self.lease_ms / 2:
            raise LockLostError(
                f"held the table lock for {held_ms:.0f} ms, more than half its {self.lease_ms} ms "
                "lease; stopped before committing. Retry the commit, or raise lock_lease_ms."
            )

    def put_if_absent(self, storage: Storage, rel: str, data: bytes, give_up: bool = True) -> bool:
        """`storage.put_if_absent` of a write that must land while this grant holds the lock: it
        starts, and may be retried, only inside half the lease (`check`, `deadline`), and is
        given up at the lease's end (`lease_end`) unless `give_up` is False: a request given up
        in flight may still land, which a data commit's completed file must not do after the
        failed write was rolled back (at once, by the writer or Spark's abort)."""
        self.check()
        try:
            return storage.put_if_absent(rel, data, deadline=self.deadline,
                                         give_up_at=self.lease_end if give_up else None)
        finally:
            self._returned()

    def replace(self, storage: Storage, rel: str, data: bytes) -> None:
        """`storage.replace` under this grant, as `put_if_absent`."""
        self.check()
        try:
            storage.replace(rel, data, deadline=self.deadline, give_up_at=self.lease_end)
        finally:
            self._returned()

    def _returned(self) -> None:
        if self.held_ms > self.lease_ms:
            self.overran = True

    def published(self, what: str) -> None:
        """Called once a commit's completed file is put. One that returned after the lease may
        have landed after another process took the lock over and issued later times. Readers
        still place its files right (file_slices.py: a compaction planned meanwhile does not list
        them), but an incremental reader that read past its completion time before it landed
        never sees it: say so loudly."""
        if self.overran:
            log.error("%s was published %.0f ms after the table lock was taken, past its %d ms lease: "
                      "another process may have taken the lock over first, so an incremental or "
                      "streaming read that had already read past its completion time misses it. "
                      "Raise lock_lease_ms if storage calls can take this long.",
                      what, self.held_ms, self.lease_ms)


SLOW_LOCK_MS = 5000  # a wait for the table lock this long is logged, once, naming its holder


class TimeGenerator:
    """Issues instant and completion times for one table, guarded by the storage-based lock."""

    def __init__(self, storage: Storage, lease_ms: int = 30_000, timeout_ms: int | None = None):
        self.storage = storage
        self.lease_ms = int(lease_ms)
        # Waiting longer than a lease lets a crashed holder's lease run out first.
        self.timeout_ms = int(timeout_ms if timeout_ms is not None else 2 * self.lease_ms + 30_000)
        self._timeout_arg = timeout_ms  # None: the default, which outlasts a longer recorded lease
        self.holder_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.stats = LockStats()
        self._stats_lock = threading.Lock()
        self._known: LockState | None = None  # a free state this process installed, maybe still current
        self._strays: list[int] = []  # old states a listing found that collection missed

    # Pickled into Spark's commit worker: locks and counters are per process.
    def __getstate__(self) -> dict:
        return {"storage": self.storage, "lease_ms": self.lease_ms, "timeout_ms": self._timeout_arg}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["storage"], state["lease_ms"], state["timeout_ms"])

    # -- the register ----------------------------------------------------------------------

    def _listed_seqs(self) -> list[int]:
        """The numbers of the state files a fresh listing of the lock shows."""
        stems = (name[:-5] for name in self.storage.list_names(LOCK_DIR) if name.endswith(".json"))
        return [int(stem) for stem in stems if stem.isdigit()]

    def _read_state(self) -> LockState:
        while True:
            seqs = self._listed_seqs()
            if not seqs:
                return LockState(0, None, 0, 0)
            top = max(seqs)
            # Older than every range `_collect` would still delete: its collector failed, or a
            # process put a state into a slot collected before (and lost the swap).
            strays = {s for s in seqs if s < top - 3 * _KEEP_STATES}
            if strays:
                self._strays = sorted(strays.union(self._strays))[-_MAX_RETRIED_STATES:]
            try:
                raw = json.loads(self.storage.read_bytes(_state_file(top)))
            except FileNotFoundError:
                continue  # collected between list and read: list again
            return LockState(int(raw["seq"]), raw.get("holder"), int(raw["lease_until_ms"]),
                             int(raw["last_time_ms"]), int(raw.get("lease_ms") or 0))

    def _swap(self, new: LockState, durable: bool = True, release: bool = False) -> bool:
        """Install `new` if the state is still `new.seq - 1`."""
        # The nonce makes the content unique to this one put: two processes can compute the
        # same new state, and put-if-absent tells its own write from another's by content.
        data = json.dumps({**asdict(new), "nonce": uuid.uuid4().hex}).encode()
        if not self.storage.put_if_absent(_state_file(new.seq), data, durable):
            return False
        if release:
            # A later state is the next holder's, built on this one (a waiter may swap before
            # the listing below would run). A release put in a slot collected long ago changes
            # nothing either: the lock moved on without it.
            return True
        # A stalled process can land a put in a slot that was already collected; it lost.
        return max(self._listed_seqs(), default=0) <= new.seq

    def _collect(self, swapped: tuple[int, ...]) -> None:
        """Delete old states, without listing them: the process that installed state `m`, a
        multiple of `_KEEP_STATES`, deletes the `_KEEP_STATES` states from `m - 2 * _KEEP_STATES`
        (one request on S3). Every state is installed by exactly one process, so each range has
        one collector; the strays a listing found (`_read_state`) go too. Best effort: called
        after the lock is released; states it failed to delete are tried again at its next
        collection (a process alone on the table never lists them)."""
        doomed = [s for m in swapped if m % _KEEP_STATES == 0
                  for s in range(max(m - 2 * _KEEP_STATES, 1), m - _KEEP_STATES)]
        doomed += self._strays
        self._strays = []
        if not doomed:
            return
        try:
            self.storage.delete_many([_state_file(s) for s in sorted(set(doomed))])
        except Exception as exc:  # noqa: BLE001
            self._strays = sorted(set(doomed))[-_MAX_RETRIED_STATES:]
            log.warning("deleting old states of the table lock of %s failed (tried again at the next "
                        "collection): %s", self.storage.uri, exc)

    def _next(self, state: LockState, take: bool, now: int) -> LockState:
        """The state that follows free `state` and issues a new time (holding the lock if `take`)."""
        return LockState(
            seq=state.seq + 1,
            holder=self.holder_id if take else None,
            lease_until_ms=now + self.lease_ms if take else 0,
            last_time_ms=max(now, state.last_time_ms + 1),
            lease_ms=self.lease_ms if take else 0,
        )

    def _acquire(self, take: bool) -> tuple[LockState, float, float]:
        """CAS from a free state to one that issued a new time (and holds the lock if `take`)."""
        start = time.monotonic()
        attempt = 0
        watched: tuple[int, float] = (-1, start)  # the state seen current, and since when
        told = False
        lost = 0  # swaps from a free state that another process made first
        known, self._known = self._known, None
        if known is not None:  # still current unless another process swapped since: no read
            lease_start = time.monotonic()
            new = self._next(known, take, _now_ms())
            if self._swap(new):
                return new, (time.monotonic() - start) * 1000, lease_start
        while True:
            state = self._read_state()
            lease_start = time.monotonic()  # the lease counts from here, not from the swap's end
            if state.seq != watched[0]:
                watched = (state.seq, lease_start)  # seen no earlier than it was put
            now = _now_ms()
            if state.is_free((lease_start - watched[1]) * 1000, self.lease_ms):
                new = self._next(state, take, now)
                if self._swap(new):
                    return new, (time.monotonic() - start) * 1000, lease_start
                with self._stats_lock:
                    self.stats.cas_conflicts += 1
                lost += 1
            waited_ms = (time.monotonic() - start) * 1000
            times = f"{lost} time{'' if lost == 1 else 's'}"  # the lock was free, and others swapped first
            if waited_ms > SLOW_LOCK_MS and not told:  # else a crashed holder's lease is a silent stall
                told = True
                if state.holder:
                    log.warning("waiting for the table lock of %s, held by %s (pid %s) with a lease until %s; a "
                                "holder that crashed is taken over once its lease has run out", self.storage.uri,
                                *(state.holder + ":?").split(":")[:2], format_time(state.lease_until_ms))
                else:  # free when read, and another process swapped first: contention, no one stuck
                    log.warning("waiting for the table lock of %s for %.0f s: it is free between holds, and other "
                                "processes (writers committing, table services) took it first %s; each holds it "
                                "briefly, so many at once queue for it: fewer, larger commits wait less",
                                self.storage.uri, waited_ms / 1000, times)
            # The default wait outlasts the holder's lease too, when it is longer than ours.
            limit = self.timeout_ms if self._timeout_arg is not None else max(self.timeout_ms, 2 * state.lease_ms + 30_000)
            if waited_ms > limit:
                raise LockTimeoutError(
                    f"waited {waited_ms:.0f} ms for the table lock of {self.storage.uri} "
                    + (f"(held by {state.holder}, lease until {format_time(state.lease_until_ms)}); another writer "
                       "may be stuck: it is taken over once its lease runs out" if state.holder else
                       f"(free when last read; other processes took it first {times}): too many processes commit "
                       "at once for this wait; fewer, larger commits (or fewer writers at once) wait less")
                )
            attempt += 1
            time.sleep(min(_MAX_BACKOFF_S, 0.001 * 2 ** min(attempt, 6)) * random.uniform(0.5, 1.5))

    # -- public ----------------------------------------------------------------------------

    def new_instant(self) -> str:
        """A new instant time, greater than every time issued before for this table."""
        state, _, _ = self._acquire(take=False)
        self._known = state
        self._collect((state.seq,))
        return format_time(state.last_time_ms)

    @contextmanager
    def locked(self) -> Iterator[LockGrant]:
        """Hold the table lock; the grant carries a new time issued under it."""
        state, wait_ms, lease_start = self._acquire(take=True)
        grant = LockGrant(format_time(state.last_time_ms), state, wait_ms, self.lease_ms, lease_start)
        try:
            yield grant
        finally:
            hold_ms = (time.monotonic() - grant._acquired_mono) * 1000
            released = LockState(state.seq + 1, None, 0, state.last_time_ms)
            # Failing to release means our lease ran out and someone took over: nothing to undo.
            # A storage error here must not fail a commit that is already published: the lease
            # runs out and the next writer takes over.
            try:
                # Not fsynced: a release lost to a power failure leaves a lock whose holder
                # is gone, taken over once its lease runs out. A state that issued a time is
                # fsynced, so that no time is issued twice.
                freed = self._swap(released, durable=False, release=True)
                if not freed:
                    log.warning("the table lock of %s was taken over after %.0f ms, past its %d ms lease",
                                self.storage.uri, hold_ms, self.lease_ms)
            except Exception as exc:  # noqa: BLE001
                freed = False
                log.warning("releasing the table lock failed (it expires with its lease): %s", exc)
            if freed:
                self._known = released
                self._collect((state.seq, released.seq))
            with self._stats_lock:
                s = self.stats
                s.acquisitions += 1
                s.total_wait_ms += wait_ms
                s.max_wait_ms = max(s.max_wait_ms, wait_ms)
                s.total_hold_ms += hold_ms
                s.max_hold_ms = max(s.max_hold_ms, hold_ms)
