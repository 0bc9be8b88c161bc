"""The soak test (issue 6): every kind of writer, service and reader on one table for a fixed time.

    python tests/soak.py --seconds 120 --storage local   # or --storage s3 (a moto server on 127.0.0.1)
    make soak                                             # both, see the Makefile (SOAK_ARGS=...)

tests/test_soak.py runs a short version of it in `make test`. On one table (event_time mode,
8 buckets), for `--seconds`, and on until every writer, service and reader below has done its
part at least once (the cleaner deleting a file and archiving an instant last of all on a slow
machine), but not past `--max-seconds`:

- 4 writer processes upsert overlapping keys through the Python API (`Table.write`), one commit
  after another as fast as they can, with no retry (an exception is a failed commit);
- 1 Spark structured streaming query (`writeStream.format("nbcc")`, processing-time trigger)
  writes the small Parquet files a feeder thread drops into its input folder, one micro-batch
  (one commit) per file;
- a compactor process runs `compact()` every second, a cleaner process `clean()` every second and
  `archive()` every 5th time (its window: the last 10 data commits, widened to cover every read
  in progress, as a deployment chooses retain_commits to cover its longest read);
- a savepointer process, every 2 seconds, makes a savepoint of the oldest state the cleaner's
  smallest window holds (so a clean running meanwhile may pass it: the savepoint is then made
  and kept, or refused with nothing kept, format.md §14.6), reads as of every savepoint (soon
  before the window: readable only because cleans keep their files), and deletes all but the
  last one (more would leave a short run on S3 too few files to clean);
- 2 readers read the table over and over: one through the Python API, one through Spark's batch
  source (`spark.read.format("nbcc")`).

Then everything is stopped (each stage bounded in time) and checked. Between stopping the writers
(and draining the stream) and stopping the services, the cleaner runs once more on the quiet table,
cleaning and archiving, so that the final checks read a table that was cleaned and archived.

The data. Commit `seq` of writer `slot` (slots 0-3: the processes, slot 4: the stream's files)
carries the marker `tag` = "<slot>-<seq>" on all its rows and writes
- upserts (and a few deletes) of a random subset of the shared keys 0..keys-1, whose ordering
  value `ts` is unique per key over the whole run (so each key's winner is well defined);
- PRIVATE rows: keys no other commit ever writes (derived from slot and seq), never deleted.

Atomic visibility, checked on every read. A reader lists the timeline, takes T = the latest
completion of a data commit and reads `as_of=T` with the meta columns, so the read is one fixed,
well-defined state: exactly the data commits completed at or before T (call them C). Then
- every private row's tag has all of its commit's private keys (all or none of a commit);
- the instants of the private rows (`_nbcc_commit_time`) are exactly C: no completed commit is
  missing and no row of a commit outside C (in flight, or completed after T) is visible;
- every row's `_nbcc_commit_time` is in C and its `_nbcc_completion_time` is that commit's
  completion; no key appears twice;
- after the run, the read's whole content (a digest of all its rows) equals reference(T): the
  reference fold of every commit in C, computed from what every writer wrote. This covers the
  shared keys, where later winners hide earlier rows.

At the end the snapshot (Python API, and Spark both as of the latest completion and without as_of)
equals reference(latest), every commit a writer returned is on the timeline, every commit on the
timeline was written by someone, nothing is left pending or rolled back, no commit failed, and
the cleaner deleted files and archived instants. The run prints commits/s, rows/s, failed
commits, retries and the longest lock wait; `--out` writes the whole summary as JSON.

The figures: commits/s and rows/s count every data commit over the load phase (from the start
until the writers stopped and the stream's last file was committed). A failed commit is a
`Table.write` that raised, or a failed streaming query. Writers never retry a commit (none is
needed by design), so "retries" are those of the layers below, counted apart from their log
records in every process the soak starts and in this one (not in Spark's Python workers):
storage calls nbcc retried after a transient error (nbcc.storage), requests the S3 client
retried by itself (botocore, s3fs), and, shown beside them, lock CAS races lost and retried
(`TimeGenerator.stats.cas_conflicts` of the writer, compactor and cleaner processes). The longest lock wait is the greatest
`lock_wait_ms` in the commit metadata (the wait for the lock that issues the completion time),
with the greatest wait of any lock acquisition by a writer process (instant times too) beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from bisect import bisect_right
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

import nbcc
from nbcc.clock import format_time
from nbcc.timeline import DATA_ACTIONS, read_commit_metadata

WRITERS = 4  # writer processes: slots 0..3
STREAM_SLOT = WRITERS  # the streaming query's files
SLOTS = 8  # room in the unique commit number seq * SLOTS + slot
PRIVATE_BASE = 10**12  # private keys start here; shared keys are 0..keys-1
PRIVATE_PER_COMMIT = 4
DELETE_FRACTION = 0.05
BUCKETS = 8
COMPACT_EVERY_S = 1.0
CLEAN_EVERY_S = 1.0
SAVEPOINT_EVERY_S = 2.0
SAVEPOINTS_KEPT = 1
READ_PAUSE_S = 0.5  # between two reads of one reader
READ_SLACK_S = 2.0  # the cleaner also keeps the commits of the last 2 s (see _retain_for_reads)
ARCHIVE_EVERY_CLEANS = 5
DEFAULT_RETAIN_COMMITS = 10  # the cleaner's window at least, widened to cover every read in progress
STOP_TIMEOUT_S = 180  # the most each stage of stopping may take (a hang guard)
START_TIMEOUT_S = 180  # processes importing pyarrow on a loaded machine

DELETED = "_nbcc_is_deleted"
SCHEMA = pa.schema([
    pa.field("id", pa.int64()),
    pa.field("ts", pa.int64()),
    pa.field("tag", pa.string()),
    pa.field("payload", pa.string()),
])
WRITE_SCHEMA = SCHEMA.append(pa.field(DELETED, pa.bool_()))
SPARK_WRITE_SCHEMA = "id long, ts long, tag string, payload string, _nbcc_is_deleted boolean"
COLUMNS = SCHEMA.names
COMMIT_TIME, COMPLETION_TIME = "_nbcc_commit_time", "_nbcc_completion_time"

# Storage retries are logged by nbcc.storage at DEBUG level, one record per retried attempt.
RETRY_LOGGER = "nbcc.storage"


# -- the data ------------------------------------------------------------------------------------

def commit_tag(slot: int, seq: int) -> str:
    return f"{slot}-{seq}"


def private_keys(slot: int, seq: int) -> list[int]:
    """The keys only commit (slot, seq) ever writes."""
    first = PRIVATE_BASE + (seq * SLOTS + slot) * PRIVATE_PER_COMMIT
    return list(range(first, first + PRIVATE_PER_COMMIT))


def private_keys_of_tag(tag: str) -> list[int] | None:
    slot, _, seq = tag.partition("-")
    return private_keys(int(slot), int(seq)) if slot.isdigit() and seq.isdigit() else None


def commit_rows(slot: int, seq: int, keys: int) -> list[dict[str, Any]]:
    """The rows of commit `seq` of writer `slot`: shared keys (a few deleted) and private keys.
    `ts` = random * 10^7 + the unique commit number: unique per key over the run."""
    rng = random.Random(f"nbcc-soak-{slot}-{seq}")
    unique = seq * SLOTS + slot
    assert unique < 10**7
    tag = commit_tag(slot, seq)
    shared = rng.sample(range(keys), rng.randint(max(1, keys // 20), max(1, keys // 8)))
    rows = [{"id": k, "ts": rng.randrange(1, 10**6) * 10**7 + unique, "tag": tag, "payload": f"{tag}:{k}",
             DELETED: rng.random() < DELETE_FRACTION} for k in shared]
    rows += [{"id": k, "ts": unique, "tag": tag, "payload": f"{tag}:{k}", DELETED: False}
             for k in private_keys(slot, seq)]
    return rows


def commit_table(slot: int, seq: int, keys: int) -> pa.Table:
    return pa.Table.from_pylist(commit_rows(slot, seq, keys), schema=WRITE_SCHEMA)


# -- the reference ---------------------------------------------------------------------------------

def _row_hash(values: tuple) -> int:
    return int.from_bytes(hashlib.blake2b(repr(values).encode(), digest_size=8).digest(), "little")


def state_digest(rows: Iterable[dict[str, Any]], columns: list[str]) -> tuple[int, int]:
    """An order-independent digest of a multiset of rows: (count, sum of row hashes mod 2^64)."""
    n = total = 0
    for r in rows:
        n += 1
        total += _row_hash(tuple(r[c] for c in columns))
    return n, total % 2**64


class Reference:
    """The table's state after every data commit, in event_time mode with an ordering value that
    is unique per key: per key the row with the greatest ordering value among the commits
    completed by then wins, and the key is absent if that row is a delete (`_nbcc_is_deleted`).

    `commits`: (completion, instant, rows) of every data commit, rows being a list or a callable
    that returns it (so a long run's rows are built one commit at a time). Keeps a digest of
    every state, not the states themselves."""

    BEFORE_ALL = "0" * 17

    def __init__(self, commits: Iterable[tuple[str, str, list[dict[str, Any]] | Callable[[], list[dict[str, Any]]]]],
                 columns: list[str], key: str = "id", ordering: str = "ts"):
        self.columns = list(columns)
        best: dict[Any, dict[str, Any]] = {}
        n = total = 0
        self.times = [self.BEFORE_ALL]
        self.digests = [(0, 0)]
        for completion, _instant, rows in sorted(commits, key=lambda c: (c[0], c[1])):
            for row in rows() if callable(rows) else rows:
                cur = best.get(row[key])
                if cur is not None and cur[ordering] == row[ordering]:
                    raise ValueError(f"test data must have no ties: key {row[key]} ordering {row[ordering]}")
                if cur is None or row[ordering] > cur[ordering]:
                    if cur is not None and not cur.get(DELETED):
                        n -= 1
                        total -= _row_hash(tuple(cur[c] for c in self.columns))
                    if not row.get(DELETED):
                        n += 1
                        total += _row_hash(tuple(row[c] for c in self.columns))
                    best[row[key]] = row
            self.times.append(completion)
            self.digests.append((n, total % 2**64))
        self.final = sorted(({c: r[c] for c in self.columns} for r in best.values() if not r.get(DELETED)),
                            key=lambda r: r[key])
        self.latest = self.times[-1]
        self._by_digest: dict[tuple[int, int], list[str]] = {}
        for t, d in zip(self.times, self.digests):
            self._by_digest.setdefault(d, []).append(t)

    def at(self, time: str) -> tuple[int, int]:
        """The digest of reference(time): the commits completed at or before `time`."""
        return self.digests[bisect_right(self.times, time) - 1]

    def matches(self, rows: list[dict[str, Any]]) -> list[str]:
        """The completion times T with reference(T) == rows."""
        return self._by_digest.get(state_digest(rows, self.columns), [])


# -- small helpers ---------------------------------------------------------------------------------

def json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class RetryCounter(logging.Handler):
    """Counts the retries that the storage layers log, one record per retried attempt:
    "storage": nbcc.storage's "attempt N failed (...), retrying" (transient errors nbcc retries);
    "s3_client": botocore's "Retry needed" and s3fs's "Retryable error" (the S3 client retrying a
    request by itself, e.g. after a 500 from the server, before nbcc sees any error)."""

    LOGGERS = {RETRY_LOGGER: "storage", "botocore.retryhandler": "s3_client",
               "botocore.retries.standard": "s3_client", "s3fs": "s3_client"}

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts = {"storage": 0, "s3_client": 0}
        self.samples: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.name == RETRY_LOGGER:
            retried = "retrying" in message
        elif record.name == "s3fs":
            retried = message.startswith("Retryable error")
        else:
            retried = message.startswith("Retry needed") and "not retrying" not in message
        if retried:
            self.counts[self.LOGGERS[record.name]] += 1
            if len(self.samples) < 5:
                self.samples.append(f"{record.name}: {message[:300]}")


def install_retry_counter() -> RetryCounter:
    """This process's counter of storage retries (one per process, however often called)."""
    for handler in logging.getLogger(RETRY_LOGGER).handlers:
        if isinstance(handler, RetryCounter):
            return handler
    counter = RetryCounter()
    for name in RetryCounter.LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.addHandler(counter)
    return counter


def _wait_for(condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll `condition` until it holds (True) or `timeout_s` passes (False)."""
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(interval_s)
    return True


def _lines(path: Path) -> int:
    """Complete lines of a file another process appends to."""
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _appended_records(path: Path) -> list[dict[str, Any]]:
    """The complete records of a JSON-lines log another process may be appending to."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def _quiet_clean_done(path: Path) -> bool:
    """Whether the cleaner's log has a run on the quiet table."""
    return any(r.get("quiet") for r in _appended_records(path))


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


# -- the processes: writers, compactor, cleaner ----------------------------------------------------

READS_DIR = "reads"  # in the work folder: one file per reader naming the as_of it is reading
QUIET = "quiet"  # in the work folder: written once the writers stopped and the stream drained


def _retain_for_reads(table: nbcc.Table, work: Path, minimum: int) -> int:
    """The retain_commits that keeps every read in progress readable. A deployment chooses
    retain_commits to cover its longest read; here the readers say what they read (a read as of
    T needs the cleaner's window to start at or before T) and the cleaner widens its window to
    the oldest of them, and to READ_SLACK_S of commits more, for a read that chose its as_of
    and has not said so yet (or a cleaner slow between this and its own look at the timeline)."""
    folder = work / READS_DIR
    times = [format_time(time.time_ns() // 1_000_000 - int(READ_SLACK_S * 1000))]
    for f in folder.glob("*.json") if folder.exists() else ():
        try:
            times.append(json.loads(f.read_text())["as_of"])
        except (OSError, ValueError, KeyError):
            continue  # being replaced right now: the next clean sees it
    oldest = min(times)
    newer = sum(1 for i in table.timeline()
                if i.is_completed and i.action in DATA_ACTIONS and i.completion >= oldest)
    return max(minimum, newer + 1)


def _role_main(role: str, config_path: Path, slot: int) -> int:
    cfg = json.loads(config_path.read_text())
    work = Path(cfg["work"])
    deadline = cfg["deadline_epoch"]  # every role stops by itself even if the runner died
    counter = install_retry_counter()
    table = nbcc.Table.open(cfg["uri"], cfg["storage_options"])
    name = f"writer-{slot}" if role == "writer" else role
    log_path = work / f"{name}.jsonl"
    (work / f"ready-{name}").write_text("ready")
    # The runner waits for every process, then for the stream's first micro-batch: twice as long.
    if not _wait_for(lambda: (work / "go").exists() or time.time() > deadline, 2 * START_TIMEOUT_S):
        return 2
    stop = work / ("stop" if role == "writer" else "services-stop")
    quiet = work / QUIET  # the writers stopped and the stream drained: the cleaner's last round
    failures = 0
    n = 0
    while not stop.exists() and time.time() < deadline:
        start = time.monotonic()
        record: dict[str, Any] = {"n": n}
        try:
            if role == "writer":
                data = commit_table(slot, n, cfg["keys"])
                start = time.monotonic()
                record.update(tag=commit_tag(slot, n), instant=table.write(data), rows=data.num_rows)
            elif role == "compactor":
                record["instant"] = table.compact()
            elif role == "savepointer":
                record.update(_savepoint_round(table, cfg["retain_commits"]))
            else:
                record["quiet"] = quiet.exists()  # this run started on the quiet table
                retain = _retain_for_reads(table, work, cfg["retain_commits"])
                result = table.clean(retain_commits=retain)
                record.update(instant=result.get("instant"), retain=retain, deleted=len(result["deleted"]),
                              rolled_back=result["rolled_back"])
                if n % ARCHIVE_EVERY_CLEANS == ARCHIVE_EVERY_CLEANS - 1 or record["quiet"]:
                    record["archived"] = table.archive(retain_commits=retain)["archived"]
            record["ok"] = True
        except Exception as exc:  # noqa: BLE001 - recorded: a failed commit / service run
            failures += 1
            record.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
            traceback.print_exc()
        record["seconds"] = round(time.monotonic() - start, 4)
        _append(log_path, record)
        n += 1
        if role != "writer":
            pause = {"compactor": COMPACT_EVERY_S, "savepointer": SAVEPOINT_EVERY_S}.get(role, CLEAN_EVERY_S)
            _wait_for(lambda: stop.exists() or time.time() > deadline, pause)
    stats = {"lock": asdict(table.clock.stats), "retries": counter.counts,
             "retry_samples": counter.samples, "runs": n, "failures": failures,
             "stopped_by": "signal" if stop.exists() else "deadline"}
    (work / f"{name}.stats.json").write_text(json.dumps(stats))
    return 0


def _savepoint_round(table: nbcc.Table, retain_commits: int) -> dict[str, Any]:
    """One round of the savepointer: keep the oldest state the cleaner's smallest window holds
    (made, found, or refused because a clean passed it meanwhile: all fine), read as of every
    savepoint (digests, checked against the reference at the end), and delete all but the last
    SAVEPOINTS_KEPT. Any other error fails the round."""
    out: dict[str, Any] = {}
    done = sorted(i.completion for i in table.timeline() if i.is_completed and i.action in DATA_ACTIONS)
    if done:
        try:
            out["made"] = table.savepoint(as_of=done[max(0, len(done) - retain_commits)])
        except nbcc.CommitError as exc:  # a clean that planned without it deletes its files
            out["refused"] = str(exc)[:300]
        except nbcc.InvalidOptionError as exc:  # a clean passed it since this round's listing
            if "before the window the cleaner retained" not in str(exc):
                raise
            out["refused"] = str(exc)[:300]
    kept = sorted({s["as_of"] for s in table.savepoints() if s["confirmed"]})
    out["reads"] = []
    for state in kept:
        data = table.read(as_of=state)
        out["reads"].append({"as_of": state, "digest": state_digest(data.select(COLUMNS).to_pylist(), COLUMNS)})
    for state in kept[:-SAVEPOINTS_KEPT]:
        table.delete_savepoint(state)
    return out


# -- the streaming query ---------------------------------------------------------------------------

class StreamWriter:
    """A Spark streaming query writing to the table, fed one small Parquet file at a time (each
    file one micro-batch, so one commit). The feeder keeps at most two files ahead of the query."""

    def __init__(self, spark, uri: str, storage_options: dict[str, Any], work: Path, keys: int):
        self.spark, self.uri, self.keys = spark, uri, keys
        self.storage_options = storage_options
        self.inbox = work / "stream-in"
        self.checkpoint = work / "stream-checkpoint"
        self.inbox.mkdir(parents=True, exist_ok=True)
        self.fed = 0
        self.query = None
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._feed, name="stream-feeder", daemon=True)

    def start(self) -> None:
        writer = (self.spark.readStream.schema(SPARK_WRITE_SCHEMA).option("maxFilesPerTrigger", 1)
                  .parquet(str(self.inbox))
                  .writeStream.format("nbcc").option("checkpointLocation", str(self.checkpoint))
                  .option("record_key", "id").option("ordering_field", "ts"))
        for k, v in self.storage_options.items():
            writer = writer.option(f"storage.{k}", str(v))
        self.query = writer.trigger(processingTime="1 second").start(self.uri)

    def warm_up(self, timeout_s: float) -> bool:
        """Feed the first file and wait for its commit: a query's first micro-batch is slow
        (about 15 s here, starting Spark's Python writers), so it runs before the clock starts."""
        self._feed_one()
        return _wait_for(lambda: self.completed_batches() >= 1 or not self.query.isActive, timeout_s, 0.1)

    def begin_feeding(self) -> None:
        self._thread.start()

    def _feed_one(self) -> None:
        tmp = self.inbox / f".part-{self.fed:06d}.parquet"  # hidden from Spark until renamed
        pq.write_table(commit_table(STREAM_SLOT, self.fed, self.keys), tmp)
        tmp.rename(self.inbox / f"part-{self.fed:06d}.parquet")
        self.fed += 1

    def completed_batches(self) -> int:
        """Micro-batches Spark recorded as done (each one file, so one nbcc commit): the last
        batch id in the commit log, plus one. Not the number of its files: Spark deletes all but
        the last 100 (spark.sql.streaming.minBatchesToRetain)."""
        folder = self.checkpoint / "commits"
        ids = [int(n) for n in os.listdir(folder) if n.isdigit()] if folder.exists() else []
        return max(ids) + 1 if ids else 0

    def _feed(self) -> None:
        try:
            while not self.stopping.is_set():
                if self.query is not None and not self.query.isActive:
                    return
                if self.fed - self.completed_batches() < 2:
                    self._feed_one()
                self.stopping.wait(0.2)
        except BaseException as exc:  # noqa: BLE001 - reported by the runner
            self.error = exc

    def stop_feeding(self) -> None:
        self.stopping.set()
        self._thread.join(timeout=STOP_TIMEOUT_S)

    def drain_and_stop(self, timeout_s: float) -> bool:
        """Wait until every file fed is committed (or the query died), then stop the query."""
        drained = _wait_for(lambda: self.completed_batches() >= self.fed or not self.query.isActive,
                            timeout_s, 0.2)
        drained = drained and self.completed_batches() >= self.fed
        self.query.stop()
        return drained

    def exception(self) -> str | None:
        exc = self.query.exception() if self.query is not None else None
        return None if exc is None else str(exc)[:4000]


# -- the readers -----------------------------------------------------------------------------------

def check_read(data: pa.Table, as_of: str, completed: dict[str, str]) -> list[str]:
    """Atomic-visibility problems of a read as of `as_of`; `completed`: instant -> completion of
    every data commit completed at or before `as_of` (the state the read must show)."""
    problems = []
    ids = data.column("id").to_pylist()
    tags = data.column("tag").to_pylist()
    commit_times = data.column(COMMIT_TIME).to_pylist()
    completion_times = data.column(COMPLETION_TIME).to_pylist()
    if len(set(ids)) != len(ids):
        problems.append(f"as of {as_of}: a key appears twice")
    outside = {c for c in commit_times if c not in completed}
    if outside:
        problems.append(f"as of {as_of}: rows of instants that are no data commit completed by then: {sorted(outside)[:5]}")
    wrong = {(c, t) for c, t in zip(commit_times, completion_times) if c in completed and completed[c] != t}
    if wrong:
        problems.append(f"as of {as_of}: rows whose completion time is not their commit's: {sorted(wrong)[:5]}")
    private: dict[str, set[int]] = {}
    private_instants: dict[str, set[str]] = {}
    for k, tag, c in zip(ids, tags, commit_times):
        if k >= PRIVATE_BASE:
            private.setdefault(tag, set()).add(k)
            private_instants.setdefault(tag, set()).add(c)
    for tag, seen in private.items():
        expected = private_keys_of_tag(tag)
        if expected is None or seen != set(expected):
            problems.append(f"as of {as_of}: commit {tag} is partly visible: {len(seen)} of its "
                            f"{PRIVATE_PER_COMMIT} private rows ({sorted(seen)})")
        if len(private_instants[tag]) != 1:
            problems.append(f"as of {as_of}: commit {tag}'s rows carry several instants {sorted(private_instants[tag])}")
    visible = set().union(*private_instants.values()) if private_instants else set()
    missing = set(completed) - visible
    if missing:
        problems.append(f"as of {as_of}: {len(missing)} data commit(s) completed by then are invisible: "
                        f"{sorted(missing)[:5]}")
    return problems


class Reader:
    """Reads as of the latest data completion over and over, checking each read at once and
    keeping its digest for the check against the reference at the end."""

    def __init__(self, name: str, read: Callable[[str], pa.Table], table: nbcc.Table, work: Path):
        self.name, self._read, self.table = name, read, table
        self._register = work / READS_DIR / f"{name}.json"
        self._register.parent.mkdir(parents=True, exist_ok=True)
        self.reads: list[dict[str, Any]] = []  # {"as_of", "digest", "rows", "seconds"}
        self.violations: list[str] = []
        self.error: str | None = None
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def read_once(self) -> None:
        done = [i for i in self.table.timeline() if i.is_completed and i.action in DATA_ACTIONS]
        if not done:
            return
        as_of = max(i.completion for i in done)
        completed = {i.instant: i.completion for i in done if i.completion <= as_of}
        tmp = self._register.with_suffix(".tmp")
        tmp.write_text(json.dumps({"as_of": as_of}))
        tmp.replace(self._register)  # the cleaner keeps as_of readable while this file names it
        start = time.monotonic()
        data = self._read(as_of)
        seconds = time.monotonic() - start
        self._register.unlink()
        problems = check_read(data, as_of, completed)
        self.violations.extend(f"{self.name}: {p}" for p in problems)
        self.reads.append({"as_of": as_of, "digest": state_digest(data.select(COLUMNS).to_pylist(), COLUMNS),
                           "rows": data.num_rows, "seconds": round(seconds, 3)})

    def _loop(self) -> None:
        try:
            while not self.stopping.is_set():
                self.read_once()
                self.stopping.wait(READ_PAUSE_S)  # leave the writers and the stream some CPU
        except BaseException:  # noqa: BLE001 - reported by the runner
            self.error = traceback.format_exc()[-4000:]

    def stop(self, timeout_s: float) -> bool:
        self.stopping.set()
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()


def _warm_up(spark, uri: str, storage_options: dict[str, Any]) -> None:
    """One Spark read of the empty table before the clock starts (Spark's first job is slow)."""
    import pyspark_nbcc

    pyspark_nbcc.set_active_session(spark)
    _spark_source(spark, storage_options).load(uri).toArrow()


def _spark_source(spark, storage_options: dict[str, Any]):
    reader = spark.read.format("nbcc")
    for k, v in storage_options.items():
        reader = reader.option(f"storage.{k}", str(v))
    return reader


def python_reader(table: nbcc.Table) -> Callable[[str], pa.Table]:
    return lambda as_of: table.read(as_of=as_of, include_meta_columns=True)


def spark_reader(spark, uri: str, storage_options: dict[str, Any]) -> Callable[[str], pa.Table]:
    import pyspark_nbcc

    def read(as_of: str) -> pa.Table:
        pyspark_nbcc.set_active_session(spark)  # the reader runs in its own thread
        return (_spark_source(spark, storage_options).option("as_of", as_of)
                .option("include_meta_columns", "true").load(uri).toArrow())
    return read


# -- the run ---------------------------------------------------------------------------------------

def _spawn(role: str, config_path: Path, slot: int, log_path: Path) -> subprocess.Popen:
    out = open(log_path, "w")
    try:
        return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--role", role,
                                 "--config", str(config_path), "--slot", str(slot)],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "AWS_EC2_METADATA_DISABLED": "true"})
    finally:
        out.close()


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _parts_missing(work: Path, streamer: "StreamWriter | None", readers: list["Reader"]) -> list[str]:
    """What the run has not seen yet of the work every writer, service and reader must do (what
    the end checks ask for), from the processes' logs, which they may be appending to."""
    def records(name: str) -> list[dict[str, Any]]:
        return _appended_records(work / f"{name}.jsonl")

    missing = [f"writer-{w} to commit" for w in range(WRITERS)
               if not any(r["ok"] for r in records(f"writer-{w}"))]
    if streamer is not None and streamer.completed_batches() < 2:  # the warm-up batch and one during the load
        missing.append("the stream to commit")
    if not any(r["ok"] and r["instant"] for r in records("compactor")):
        missing.append("a compaction")
    cleans = [r for r in records("cleaner") if r["ok"]]
    if not any(r["deleted"] for r in cleans):
        missing.append("the cleaner to delete a file")
    if not any(r.get("archived") for r in cleans):
        missing.append("the cleaner to archive an instant")
    if not any("made" in r for r in records("savepointer")):
        missing.append("a savepoint")
    missing.extend(f"{r.name} to read twice" for r in readers if len(r.reads) < 2)
    return missing


def run_soak(spark, uri: str, storage_options: dict[str, Any] | None, work: Path, *, seconds: float,
             max_seconds: float | None = None, keys: int = 2000, stream: bool = True,
             retain_commits: int = DEFAULT_RETAIN_COMMITS, storage_name: str = "",
             echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the soak against a fresh table at `uri`; returns the summary. `summary["problems"]` lists
    every check that failed (empty: the run passed). The load runs `seconds`, and on until every
    writer, service and reader has done its part (a slow machine or S3 makes few commits, and
    the cleaner deletes nothing until a compaction is older than its window), but not past
    `max_seconds` (default: 4 times `seconds`)."""
    max_seconds = max(seconds, 4 * seconds if max_seconds is None else max_seconds)
    storage_options = dict(storage_options or {})
    work.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    table = nbcc.Table.create(uri, SCHEMA, "id", ordering_field="ts", buckets=BUCKETS,
                              storage_options=storage_options)
    config_path = work / "config.json"
    config_path.write_text(json.dumps({
        "uri": uri, "storage_options": storage_options, "work": str(work), "keys": keys,
        "retain_commits": retain_commits,
        "deadline_epoch": time.time() + START_TIMEOUT_S + max_seconds + 2 * STOP_TIMEOUT_S,
    }))
    counter = install_retry_counter()  # this process: the readers
    counted_before = dict(counter.counts)

    roles = [(f"writer-{w}", "writer", w) for w in range(WRITERS)] + [
        ("compactor", "compactor", 0), ("cleaner", "cleaner", 0), ("savepointer", "savepointer", 0)]
    procs = {name: _spawn(role, config_path, slot, work / f"{name}.log") for name, role, slot in roles}
    writers = [procs[f"writer-{w}"] for w in range(WRITERS)]
    services = [procs["compactor"], procs["cleaner"], procs["savepointer"]]
    streamer = StreamWriter(spark, uri, storage_options, work, keys) if stream else None
    readers = [Reader("python-reader", python_reader(nbcc.Table.open(uri, storage_options)),
                      nbcc.Table.open(uri, storage_options), work),
               Reader("spark-reader", spark_reader(spark, uri, storage_options),
                      nbcc.Table.open(uri, storage_options), work)]
    load_s = 0.0

    def dead() -> list[str]:
        return [n for n, p in procs.items() if p.poll() not in (None, 0)]

    try:
        _warm_up(spark, uri, storage_options)
        if not _wait_for(lambda: all((work / f"ready-{n}").exists() for n in procs) or bool(dead()),
                         START_TIMEOUT_S, 0.1):
            problems.append("the processes did not start in time")
        if streamer is not None:
            streamer.start()
            if not streamer.warm_up(START_TIMEOUT_S):
                problems.append(f"the streaming query's first micro-batch did not commit in time: {streamer.exception()}")
        (work / "go").write_text("go")
        began = time.monotonic()
        if streamer is not None:
            streamer.begin_feeding()
        for r in readers:
            r.start()

        # The load phase: `seconds` long, then on until every part has been seen (at most
        # `max_seconds`), with a progress line now and then.
        next_report = began + 10
        missing = ["the load"]
        while not dead():
            time.sleep(0.2)
            elapsed = time.monotonic() - began
            if elapsed >= seconds:
                missing = _parts_missing(work, streamer, readers)
                if not missing or elapsed >= max_seconds:
                    break
            if time.monotonic() >= next_report:
                next_report += 10
                commits = sum(_lines(work / f"writer-{w}.jsonl") for w in range(WRITERS))
                echo(f"  {elapsed:5.0f} s: {commits} writer commits, "
                     f"{streamer.completed_batches() if streamer else 0} stream commits, "
                     f"{sum(len(r.reads) for r in readers)} reads"
                     + (f"; waiting for {', '.join(missing)}" if elapsed >= seconds else ""))
        if missing and not dead():
            echo(f"  after {max_seconds:g} s still waiting for {', '.join(missing)}: stopping")
        if dead():
            problems.append(f"processes died during the run: {dead()}")

        # Stop, each stage bounded: writers, then the stream (drained), then the services.
        (work / "stop").write_text("stop")
        if streamer is not None:
            streamer.stop_feeding()
        if not _wait_for(lambda: all(p.poll() is not None for p in writers), STOP_TIMEOUT_S, 0.1):
            problems.append("the writers did not stop in time")
        if streamer is not None and not streamer.drain_and_stop(STOP_TIMEOUT_S):
            problems.append(f"the streaming query did not commit every file fed in time "
                            f"({streamer.completed_batches()} of {streamer.fed})")
        load_s = time.monotonic() - began
        # One more read each of the quiet table (so that the readers' as_of is the latest), then
        # one more clean and archive of it, then stop the services and the readers.
        marks = [len(r.reads) for r in readers]
        if not _wait_for(lambda: all(len(r.reads) > m + 1 or r.error for r, m in zip(readers, marks)),
                         STOP_TIMEOUT_S, 0.1):
            problems.append("the readers did not read the quiet table in time")
        (work / QUIET).write_text("quiet")
        if not _wait_for(lambda: _quiet_clean_done(work / "cleaner.jsonl") or procs["cleaner"].poll() is not None,
                         STOP_TIMEOUT_S, 0.1):
            problems.append("the cleaner did not clean the quiet table in time")
        (work / "services-stop").write_text("stop")
        if not _wait_for(lambda: all(p.poll() is not None for p in services), STOP_TIMEOUT_S, 0.1):
            problems.append("the compactor, the cleaner or the savepointer did not stop in time")
        for r in readers:
            if not r.stop(STOP_TIMEOUT_S):
                problems.append(f"{r.name} did not stop in time")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for p in procs.values():
            p.wait(timeout=30)
        if streamer is not None:
            streamer.stopping.set()
            if streamer.query is not None and streamer.query.isActive:
                streamer.query.stop()
        for r in readers:
            r.stopping.set()

    for name, p in procs.items():
        if p.returncode != 0:
            problems.append(f"{name} exited {p.returncode}: {_tail(work / f'{name}.log')}")
    for r in readers:
        if r.error:
            problems.append(f"{r.name} failed: {r.error}")
        problems.extend(r.violations[:20])
    if streamer is not None:
        if streamer.error is not None:
            problems.append(f"the stream feeder failed: {streamer.error!r}")
    summary = analyse(table, work, keys=keys, streamer=streamer, readers=readers, spark=spark, uri=uri,
                      storage_options=storage_options, load_s=load_s, problems=problems)
    for layer, n in counter.counts.items():
        summary["retries"][layer] += n - counted_before[layer]
    summary.update(storage=storage_name, seconds=seconds, max_seconds=max_seconds, keys=keys, stream=stream,
                   retain_commits=retain_commits)
    return summary


def analyse(table: nbcc.Table, work: Path, *, keys: int, streamer: StreamWriter | None, readers: list[Reader],
            spark, uri: str, storage_options: dict[str, Any], load_s: float, problems: list[str]) -> dict[str, Any]:
    """The checks at the end and the figures of the summary."""
    timeline = table.timeline()
    left = [f"{i.instant}.{i.action}.{i.state}" for i in timeline if not i.is_completed]
    if left:
        problems.append(f"the timeline ends with pending or rolled back instants: {left[:10]}")
    data = {i.instant: i for i in timeline if i.is_completed and i.action in DATA_ACTIONS}
    with ThreadPoolExecutor(8) as pool:
        metadata = dict(zip(data, pool.map(lambda i: read_commit_metadata(table.storage, i), data.values())))

    # What each writer process wrote and saw.
    writer_records = {w: json_lines(work / f"writer-{w}.jsonl") for w in range(WRITERS)}
    service_records = {n: json_lines(work / f"{n}.jsonl") for n in ("compactor", "cleaner", "savepointer")}
    stats = {n: json.loads((work / f"{n}.stats.json").read_text()) if (work / f"{n}.stats.json").exists() else None
             for n in [f"writer-{w}" for w in range(WRITERS)] + ["compactor", "cleaner", "savepointer"]}
    failed = [f"writer-{w} commit {r['n']}: {r['error']}" for w, rs in writer_records.items() for r in rs if not r["ok"]]
    for name, rs in service_records.items():
        problems.extend(f"{name} run {r['n']} failed: {r['error']}" for r in rs if not r["ok"])
    problems.extend(f"the cleaner rolled back live writes: {r['rolled_back']}"
                    for r in service_records["cleaner"] if r.get("rolled_back"))

    commits: list[tuple[str, str, Callable[[], list[dict[str, Any]]]]] = []
    accounted: set[str] = set()
    for w, rs in writer_records.items():
        for r in (r for r in rs if r["ok"]):
            if r["instant"] not in data:
                problems.append(f"writer-{w}'s commit {r['tag']} (instant {r['instant']}) is not completed on the timeline")
                continue
            accounted.add(r["instant"])
            commits.append((data[r["instant"]].completion, r["instant"],
                            lambda w=w, n=r["n"]: commit_rows(w, n, keys)))

    # The final snapshot, with the instants of the private rows: they map the stream's tags to
    # its commits (Spark chose the instants), and must be exactly the commits on the timeline.
    final = table.read(include_meta_columns=True)
    instant_of_tag: dict[str, str] = {}
    for k, tag, c in zip(final.column("id").to_pylist(), final.column("tag").to_pylist(),
                         final.column(COMMIT_TIME).to_pylist()):
        if k >= PRIVATE_BASE:
            instant_of_tag.setdefault(tag, c)
    stream_commits = sorted(i for i, m in metadata.items() if m.get("stream_id"))
    stream_fed = streamer.fed if streamer is not None else 0
    if streamer is not None:
        if streamer.exception():
            failed.append(f"the streaming query failed: {streamer.exception()}")
        for n in range(stream_fed):
            instant = instant_of_tag.get(commit_tag(STREAM_SLOT, n))
            if instant is None or instant not in stream_commits:
                problems.append(f"stream file {n} is not in the table as one of the stream's commits ({instant})")
                continue
            accounted.add(instant)
            commits.append((data[instant].completion, instant, lambda n=n: commit_rows(STREAM_SLOT, n, keys)))
        if len(stream_commits) != stream_fed:
            problems.append(f"the stream made {len(stream_commits)} commits for {stream_fed} files")
    rows_written = sum(int(metadata[i].get("rows", 0)) for i in accounted)
    unaccounted = sorted(set(data) - accounted)
    if unaccounted:
        problems.append(f"data commits on the timeline that no writer made: {unaccounted[:10]}")
    for w, rs in writer_records.items():
        instants = [r["instant"] for r in rs if r["ok"]]
        if instants != sorted(instants):
            problems.append(f"writer-{w}'s instants are not increasing")

    # Every read was reference(as_of); the final snapshot (both APIs) is reference(latest).
    reference = Reference(commits, COLUMNS)
    bad_reads = [(r.name, read["as_of"]) for r in readers for read in r.reads
                 if tuple(read["digest"]) != reference.at(read["as_of"])]
    if bad_reads:
        problems.append(f"{len(bad_reads)} read(s) differ from the reference state at their as_of: {bad_reads[:5]}")
    # Reads as of savepoints, during the run and now (after the last clean and archival).
    rounds = [r for r in service_records["savepointer"] if r["ok"]]
    savepoint_reads = [read for r in rounds for read in r["reads"]]
    kept_now = sorted({s["as_of"] for s in table.savepoints() if s["confirmed"]})
    savepoint_reads += [{"as_of": s, "digest": state_digest(table.read(as_of=s).select(COLUMNS).to_pylist(), COLUMNS)}
                        for s in kept_now]
    bad_savepoint_reads = [read["as_of"] for read in savepoint_reads if tuple(read["digest"]) != reference.at(read["as_of"])]
    if bad_savepoint_reads:
        problems.append(f"{len(bad_savepoint_reads)} read(s) as of a savepoint differ from the reference state: "
                        f"{bad_savepoint_reads[:5]}")
    window = table.describe()["oldest_as_of"]
    got = sorted(final.select(COLUMNS).to_pylist(), key=lambda r: r["id"])
    if got != reference.final:
        problems.append("the final snapshot differs from the reference: " + _diff(got, reference.final))
    import pyspark_nbcc
    pyspark_nbcc.set_active_session(spark)
    spark_final = sorted(spark_reader(spark, uri, storage_options)(reference.latest).select(COLUMNS).to_pylist(),
                         key=lambda r: r["id"])
    if spark_final != reference.final:
        problems.append("Spark's final read differs from the reference: " + _diff(spark_final, reference.final))
    # Everything has stopped, so the latest snapshot (no as_of) is reference(latest) too.
    spark_latest = sorted(_spark_source(spark, storage_options).load(uri).toArrow().select(COLUMNS).to_pylist(),
                          key=lambda r: r["id"])
    if spark_latest != reference.final:
        problems.append("Spark's final read without as_of differs from the reference: "
                        + _diff(spark_latest, reference.final))

    # The figures.
    lock_waits = [float(m.get("lock_wait_ms", 0.0)) for m in metadata.values()]
    writer_stats = [s for n, s in stats.items() if s and n.startswith("writer")]
    storage_retries = sum(s["retries"]["storage"] for s in stats.values() if s)
    client_retries = sum(s["retries"]["s3_client"] for s in stats.values() if s)
    lock_cas = sum(s["lock"]["cas_conflicts"] for s in stats.values() if s)
    all_reads = [read for r in readers for read in r.reads]
    compactions = [r for r in service_records["compactor"] if r["ok"] and r["instant"]]
    cleans = [r for r in service_records["cleaner"] if r["ok"]]
    n_commits = len(commits)
    summary = {
        "load_seconds": round(load_s, 1),
        "commits": n_commits,
        "writer_commits": n_commits - len(stream_commits),
        "writer_commits_by_slot": {f"writer-{w}": sum(1 for r in rs if r["ok"]) for w, rs in writer_records.items()},
        "stream_commits": len(stream_commits),
        "commits_per_s": round(n_commits / load_s, 2) if load_s else 0.0,
        "rows": rows_written,
        "rows_per_s": round(rows_written / load_s, 1) if load_s else 0.0,
        "failed_commits": len(failed),
        "failures": failed[:20],
        "retries": {"storage": storage_retries, "s3_client": client_retries, "lock_cas": lock_cas, "writer": 0,
                    "samples": [x for s in stats.values() if s for x in s["retry_samples"]][:5]},
        "longest_lock_wait_ms": round(max(lock_waits, default=0.0), 3),
        "longest_lock_wait_any_ms": round(max([s["lock"]["max_wait_ms"] for s in writer_stats] + lock_waits,
                                              default=0.0), 3),
        "longest_lock_hold_ms": round(max((s["lock"]["max_hold_ms"] for s in stats.values() if s), default=0.0), 3),
        "mean_commit_lock_wait_ms": round(sum(lock_waits) / len(lock_waits), 3) if lock_waits else 0.0,
        "reads": {r.name: len(r.reads) for r in readers},
        "longest_read_s": max((read["seconds"] for read in all_reads), default=0.0),
        "atomicity_violations": sum(len(r.violations) for r in readers),
        "reads_off_reference": len(bad_reads),
        "compactions": len(compactions),
        "cleans": len(cleans),
        "files_cleaned": sum(r["deleted"] for r in cleans),
        "instants_archived": sum(r.get("archived", 0) for r in cleans),
        "savepoints_made": len({r["made"] for r in rounds if "made" in r}),
        "savepoints_refused": sum("refused" in r for r in rounds),
        "savepoint_reads": len(savepoint_reads),
        "savepoints_before_window_at_end": sum(1 for s in kept_now if window and s < window),
        "final_rows": final.num_rows,
        "final_matches_reference": got == reference.final and spark_final == reference.final
                                   and spark_latest == reference.final,
    }
    if not any(r.get("quiet") for r in cleans):
        problems.append("the cleaner never cleaned the quiet table")
    if summary["files_cleaned"] == 0:
        problems.append("the cleaner deleted no file in the whole run")
    if summary["instants_archived"] == 0:
        problems.append("the cleaner archived no instant in the whole run")
    if summary["savepoints_made"] == 0:
        problems.append("the savepointer made no savepoint in the whole run")
    if failed:
        problems.insert(0, f"{len(failed)} failed commit(s): {failed[:5]}")
    if not all_reads or any(len(r.reads) < 2 for r in readers):
        problems.append(f"a reader read less than twice: {summary['reads']}")
    summary["problems"] = problems
    return summary


def _diff(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> str:
    g = {r["id"]: r for r in got}
    e = {r["id"]: r for r in expected}
    missing = sorted(set(e) - set(g))
    extra = sorted(set(g) - set(e))
    changed = sorted(k for k in set(g) & set(e) if g[k] != e[k])
    return (f"{len(got)} rows vs {len(expected)}; missing {missing[:5]}, extra {extra[:5]}, "
            f"different {[(g[k], e[k]) for k in changed[:3]]}")


def summary_line(s: dict[str, Any]) -> str:
    r = s["retries"]
    return (f"soak {s['storage']}: {s['load_seconds']} s, {WRITERS} writer processes + "
            f"{'1 streaming query' if s['stream'] else 'no streaming query'}: "
            f"{s['commits']} commits ({s['commits_per_s']}/s; {s['stream_commits']} from the stream), "
            f"{s['rows']} rows ({s['rows_per_s']}/s), failed commits {s['failed_commits']}, "
            f"retries {r['storage'] + r['s3_client'] + r['writer']} (nbcc storage-call retries {r['storage']}, "
            f"S3 client retries {r['s3_client']}, writer retries {r['writer']}; lock CAS races lost and "
            f"retried {r['lock_cas']}), "
            f"longest lock wait {s['longest_lock_wait_ms']} ms (commit; {s['longest_lock_wait_any_ms']} ms any "
            f"acquisition by a writer process; longest hold {s['longest_lock_hold_ms']} ms)\n"
            f"  reads {s['reads']} (longest {s['longest_read_s']} s), atomicity violations "
            f"{s['atomicity_violations']}, reads off the reference {s['reads_off_reference']}, "
            f"compactions {s['compactions']}, cleans {s['cleans']} ({s['files_cleaned']} files deleted, "
            f"{s['instants_archived']} instants archived), savepoints {s['savepoints_made']} made, "
            f"{s['savepoints_refused']} refused ({s['savepoint_reads']} reads as of them, "
            f"{s['savepoints_before_window_at_end']} kept before the window at the end), final snapshot {s['final_rows']} rows "
            f"{'== reference' if s['final_matches_reference'] else '!= REFERENCE'}"
            + ("" if not s["problems"] else "\n  PROBLEMS:\n" + "\n".join(f"  - {p}" for p in s["problems"])))


# -- the command line ------------------------------------------------------------------------------

def make_spark(work: Path):
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    session = (SparkSession.builder.master("local[2]").appName("nbcc-soak")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "4")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.driver.memory", "2g")
               .config("spark.sql.warehouse.dir", str(work / "spark-warehouse"))
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    return session


def start_moto() -> tuple[Any, dict[str, Any], str]:
    """A moto S3 server on 127.0.0.1 (a free port) with one bucket: (server, options, bucket)."""
    from moto_s3 import start_server

    server, options = start_server("nbcc-soak")
    return server, options, "nbcc-soak"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0, help="how long the load runs at least (default 120)")
    parser.add_argument("--max-seconds", type=float,
                        help="how long the load may go on until every writer, service and reader has done its "
                             "part (default: 4 times --seconds)")
    parser.add_argument("--storage", choices=("local", "s3"), default="local",
                        help="local disk, or a moto S3 server this run starts on 127.0.0.1")
    parser.add_argument("--keys", type=int, default=2000, help="shared record keys (default 2000)")
    parser.add_argument("--retain-commits", type=int, default=DEFAULT_RETAIN_COMMITS)
    parser.add_argument("--no-stream", action="store_true", help="leave the streaming query out")
    parser.add_argument("--out", type=Path, help="write the summary here as JSON")
    parser.add_argument("--work", type=Path, help="work folder (default: a temporary one, removed after)")
    parser.add_argument("--role", choices=("writer", "compactor", "cleaner", "savepointer"), help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--slot", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        return _role_main(args.role, args.config, args.slot)

    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    work = args.work or Path(tempfile.mkdtemp(prefix="nbcc-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    server = None
    spark = make_spark(work)
    try:
        if args.storage == "s3":
            server, options, bucket = start_moto()
            uri = f"s3://{bucket}/soak-{uuid.uuid4().hex[:8]}"
        else:
            options, uri = {}, str(work / "table")
        print(f"soak {args.storage}: {args.seconds:g} s on {uri} (work folder {work})", flush=True)
        summary = run_soak(spark, uri, options, work / "run", seconds=args.seconds,
                           max_seconds=args.max_seconds, keys=args.keys,
                           stream=not args.no_stream, retain_commits=args.retain_commits,
                           storage_name=args.storage, echo=lambda m: print(m, flush=True))
    finally:
        spark.stop()
        if server is not None:
            server.stop()
    print(summary_line(summary), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    if args.work is None and not summary["problems"]:
        shutil.rmtree(work, ignore_errors=True)
    elif summary["problems"]:
        print(f"work folder kept for inspection: {work}", flush=True)
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
