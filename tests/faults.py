"""A storage that fails: the one sanctioned fake of the test suite (not a test module).

`FaultyStorage` is a real `nbcc.storage.Storage` (local disk, memory:// or S3) whose
single-attempt primitives (`_put_once`, `_read_once`, `_list_once`, ...) fail a fraction of the
time, so every retry, every error path and every decision above them is nbcc's own code. A
fault is a transient error (a dropped connection, a timeout, S3's 503) raised either *before* the
operation takes effect or, for the operations that change storage, *after* it did: the write
happened but its caller sees an error (the classic S3 timeout).

`Faults` decides, from a seeded RNG shared by every storage of a test (thread-safe), or from a
script of planned outcomes per operation (`Faults.plan`), which calls fail, and counts them.
"""

from __future__ import annotations

import errno
import random
import re
import threading
from collections import Counter, deque
from typing import Any, Callable

import nbcc
from nbcc.storage import Storage

BEFORE, AFTER = "before", "after"

# Operations, as `Faults` names them. Reads of data files go through pyarrow: "open_read" opens
# one, "read_data" is one read call in it. "sink" is a data file being written: it fails on its
# first write (before) or on its close, once its content is out (after).
# "delete_many" is one S3 DeleteObjects request.
OPS = ("put", "replace", "read", "list", "exists", "delete", "delete_many", "open_write", "sink", "open_read",
       "read_data")
_CHANGES = {"put", "replace", "delete", "delete_many", "sink"}  # can fail after taking effect
# A planned outcome of "delete_many": S3 answers, deleting every file but the first, which its
# answer lists among its errors (an InternalError or AccessDenied for one key).
PARTLY = "partly"


def transient_error(op: str, path: str, when: str, rng: random.Random) -> OSError:
    """One of the transient errors a real store gives (all OSErrors, as s3fs raises them)."""
    text = f"injected fault: {op} {path} ({when} it took effect)"
    kind = rng.randrange(3)
    if kind == 0:
        return ConnectionResetError(errno.ECONNRESET, text)
    if kind == 1:
        return TimeoutError(errno.ETIMEDOUT, text)
    return OSError(errno.EBUSY, f"SlowDown (503): {text}")


class Stall:
    """A planned outcome that is not an error: the call waits, inside the storage call (after
    nbcc's own checks), until `release()`, then takes effect: a put that is slow to land."""

    def __init__(self, timeout_s: float = 60):
        self.entered = threading.Event()
        self._go = threading.Event()
        self.timeout_s = timeout_s

    def release(self) -> None:
        self._go.set()

    def hold(self) -> None:
        self.entered.set()
        if not self._go.wait(self.timeout_s):
            raise AssertionError("a stalled storage call was never released")


class Faults:
    """Which storage calls fail. `rate` (or `rates[op]`) is the chance that a call of an
    operation fails; `after_share` the chance that a failing change fails after taking effect."""

    def __init__(self, seed: int = 0, rate: float = 0.0, *, rates: dict[str, float] | None = None,
                 after_share: float = 0.5):
        unknown = set(rates or ()) - set(OPS)
        assert not unknown, f"unknown operations {unknown}"
        self.rng = random.Random(seed)
        self.rate, self.rates, self.after_share = rate, dict(rates or {}), after_share
        self.enabled = True
        self.calls: Counter[str] = Counter()
        self.injected: Counter[tuple[str, str]] = Counter()
        self.injected_paths: list[str] = []
        self._plans: dict[str, list[tuple[str | None, deque]]] = {}
        self._lock = threading.Lock()

    def plan(self, op: str, *outcomes: Any, where: str | None = None) -> "Faults":
        """The next calls of `op` (only those whose path matches the regular expression `where`,
        if given) go as planned: None (no fault), BEFORE, AFTER, a `Stall`, or an exception to
        raise instead of the operation. Random draws resume when the plan is used up."""
        assert op in OPS, op
        with self._lock:
            for plan_where, queue in self._plans.setdefault(op, []):
                if plan_where == where:
                    queue.extend(outcomes)
                    break
            else:
                self._plans[op].append((where, deque(outcomes)))
        return self

    def draw(self, op: str, path: str = "") -> Any:
        with self._lock:
            self.calls[op] += 1
            queue = next((q for w, q in self._plans.get(op, ()) if q and (w is None or re.search(w, path))), None)
            if queue:
                outcome = queue.popleft()
            elif not self.enabled or self.rng.random() >= self.rates.get(op, self.rate):
                outcome = None
            else:
                outcome = AFTER if op in _CHANGES and self.rng.random() < self.after_share else BEFORE
            if outcome is not None:
                self.injected[(op, outcome if isinstance(outcome, str) else type(outcome).__name__)] += 1
                self.injected_paths.append(path)
            return outcome

    def error(self, op: str, path: str, outcome: Any) -> BaseException:
        if isinstance(outcome, BaseException):
            return outcome
        with self._lock:
            return transient_error(op, path, outcome, self.rng)

    def run(self, op: str, path: str, call: Callable[[], Any]) -> Any:
        """`call()` (the real operation), failing as drawn."""
        return self.apply(self.draw(op, path), op, path, call)

    def apply(self, outcome: Any, op: str, path: str, call: Callable[[], Any]) -> Any:
        """`call()`, failing as `outcome` (drawn) says."""
        if isinstance(outcome, Stall):
            outcome.hold()
            outcome = None
        if outcome is not None and outcome != AFTER:
            raise self.error(op, path, outcome)
        result = call()
        if outcome == AFTER:
            raise self.error(op, path, outcome)
        return result

    def total(self) -> int:
        return sum(self.injected.values())


class FaultyStorage(Storage):
    """A real Storage whose primitive calls fail as `faults` decides. Retries are quick (and
    fewer, so that some operations do run out of attempts) to keep the tests fast."""

    RETRY_ATTEMPTS = 3
    RETRY_WAIT_S = 0.002
    RETRY_MAX_WAIT_S = 0.02

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None, faults: Faults | None = None):
        super().__init__(uri, storage_options)
        self.faults = faults or Faults()

    def __reduce__(self):
        return (FaultyStorage, (self.uri, self.storage_options, self.faults))

    def child(self, rel: str) -> "FaultyStorage":  # the metadata table meets the same faults
        return FaultyStorage(f"{self.uri}/{rel}", self.storage_options, self.faults)

    def identity(self) -> tuple:
        return (*super().identity(), id(self.faults))

    def _put_once(self, path: str, data: bytes, durable: bool = True, give_up_at: float | None = None) -> bool:
        return self.faults.run("put", path, lambda: Storage._put_once(self, path, data, durable, give_up_at))

    def _replace_once(self, path: str, data: bytes, durable: bool = True, give_up_at: float | None = None) -> None:
        return self.faults.run("replace", path,
                               lambda: Storage._replace_once(self, path, data, durable, give_up_at))

    def _read_once(self, path: str) -> bytes:
        return self.faults.run("read", path, lambda: Storage._read_once(self, path))

    def _list_once(self, path: str, prefix: str) -> list[str]:
        return self.faults.run("list", path, lambda: Storage._list_once(self, path, prefix))

    def _exists_once(self, path: str) -> bool:
        return self.faults.run("exists", path, lambda: Storage._exists_once(self, path))

    def _delete_once(self, path: str) -> None:
        return self.faults.run("delete", path, lambda: Storage._delete_once(self, path))

    def _delete_batch_once(self, paths: list[str]) -> list[str]:
        outcome = self.faults.draw("delete_many", paths[0])
        if outcome == PARTLY:
            return [paths[0], *(Storage._delete_batch_once(self, paths[1:]) if paths[1:] else [])]
        return self.faults.apply(outcome, "delete_many", paths[0], lambda: Storage._delete_batch_once(self, paths))

    def _open_write_once(self, path: str) -> Any:
        raw = self.faults.run("open_write", path, lambda: Storage._open_write_once(self, path))
        return _FaultySink(raw, path, self.faults, self.faults.draw("sink", path))

    def _open_read_once(self, path: str, size: int | None = None) -> Any:
        raw = self.faults.run("open_read", path, lambda: Storage._open_read_once(self, path, size))
        return _FaultyReader(raw, path, self.faults)

    def arrow_filesystem(self):
        # The retrying pyarrow filesystem on local disk too (nbcc uses pyarrow's native one
        # there), so that data reads meet the faults.
        return self._retrying_arrow_filesystem()


class _FaultySink:
    """A data file being written that fails on its first write (BEFORE) or on close (AFTER)."""

    def __init__(self, raw: Any, path: str, faults: Faults, outcome: Any):
        self._raw, self._path, self._faults, self._outcome = raw, path, faults, outcome

    def write(self, data: Any) -> int:
        if self._outcome is not None and self._outcome != AFTER:
            raise self._faults.error("sink", self._path, self._outcome)
        return self._raw.write(data)

    def close(self) -> None:
        self._raw.close()
        if self._outcome == AFTER:
            self._outcome = None  # a second close succeeds
            raise self._faults.error("sink", self._path, AFTER)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, closed
        return getattr(self._raw, name)


class _FaultyReader:
    """A file open for reading whose reads fail as drawn, half-way through."""

    def __init__(self, raw: Any, path: str, faults: Faults):
        self._raw, self._path, self._faults = raw, path, faults

    def read(self, size: int = -1) -> bytes:
        outcome = self._faults.draw("read_data", self._path)
        if outcome is not None:
            self._raw.read(max(size, 0) // 2)  # it fails half-way: the position has moved
            raise self._faults.error("read_data", self._path, outcome)
        return self._raw.read(size)

    def __getattr__(self, name: str) -> Any:  # seek, tell, close, closed
        return getattr(self._raw, name)


def faulty_table(table: nbcc.Table, faults: Faults) -> nbcc.Table:
    """The same table, seen through a storage that fails as `faults` says."""
    return nbcc.Table(FaultyStorage(table.uri, table.storage.storage_options, faults), table.config)


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `call()` on a thread (started); the dict gets its "value" or its "error"."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            out["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out
