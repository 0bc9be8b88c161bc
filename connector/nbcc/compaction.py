"""Compaction: merge a file group's slice into a base file while writers keep writing (RFC-66).

Scheduling takes the lock, which issues the compaction instant Tc, and records the plan in
`<Tc>.compaction.requested`: per file group, the current base file and the log files committed
before Tc. Every commit that completes later gets a completion time > Tc and so lands in the new
slice (Tc is its barrier), whatever its instant; nothing is lost and no writer waits.

Executing merges each planned file group into `<file_group_id>_<token>_<Tc>.parquet` and
completes the instant as `<Tc>_<completion>.commit`, listing the base files. Each execution uses
its own token, so a re-run after a crash, or two processes running one plan at once, never write
the same file; only the files of the execution that completed the instant are ever read.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Callable, TypeVar

import pyarrow.compute as pc

from .clock import TimeGenerator, parse_time, parse_time_option
from .config import TableConfig
from .errors import CommitError, DataFileError, InvalidOptionError
from .filenames import base_file_name, data_file_path, make_token
from . import heartbeat
from .heartbeat import Heartbeat, interval_s
from .merge import one_row_per_key
from .metadata_table import index_commit
from .reader import iter_files
from .expr import supported_type
from .schema import IS_DELETED_COL, file_schema, schema_from_json, schema_to_json
from .storage import Storage
from .timeline import (
    COMPACTION,
    DATA_ACTIONS,
    COMPACTION_COMMIT,
    REQUESTED,
    ROLLEDBACK,
    TIMELINE_DIR,
    Instant,
    Timeline,
    committed_by,
    create_completed,
    is_completed,
    read_compaction_plan,
)
from .view import known_sizes, slices_by_group, table_view
from .writer import column_encodings, parquet_writer, update_stats

log = logging.getLogger(__name__)
T = TypeVar("T")

# A base file is sorted by key (each merged piece: reader.py), so a read filtered by key decodes
# only the row groups whose statistics may match (reader._row_groups_to_read). Measured on one
# 2M-row file group: a point lookup took 8.5 ms with 256k-row groups, 3.2 ms with 64k and
# 2.5 ms with 32k; a full read, file size and compaction time did not change.
BASE_ROW_GROUP_ROWS = 64 * 1024


def schedule_compaction(storage: Storage, config: TableConfig, clock: TimeGenerator) -> str | None:
    """Plan a compaction of every file group with log files; returns Tc, or None if there is
    nothing to compact."""
    # Read the commit metadata before taking the lock (it is cached), so that under the lock
    # only one listing and the few commits completed meanwhile are read.
    table_view(storage, config, Timeline.load(storage), None)
    with clock.locked() as grant:
        tc = grant.time
        timeline = Timeline.load(storage)  # under the lock: every completion < Tc is on it
        view = table_view(storage, config, timeline, None)
        operations = []
        info = view.file_info()
        for (partition, fg), slices in sorted(slices_by_group(storage, view).items()):
            latest = slices[0]
            if latest.base_file is None and latest.base_instant in view.pending_compactions:
                continue  # already being compacted
            if not latest.log_files:
                continue
            files = ([latest.base_file] if latest.base_file else []) + list(latest.log_files)
            operations.append({"partition": partition, "file_group": fg, "base_file": latest.base_file,
                               "log_files": list(latest.log_files), "bytes": known_sizes(info, partition, files)})
        if not operations:
            return None
        # Writers make their instant visible under the lock (commit.py), so this is every data
        # instant older than Tc that may still complete: only records from the earliest of them
        # on can be cut apart by a late natural delete (merge.py).
        pending = [i.instant for i in timeline.pending() if i.action in DATA_ACTIONS and i.instant < tc]
        plan = {"instant": tc, "operations": operations, "schema": schema_to_json(view.schema),
                "earliest_pending": min(pending, default=tc)}
        if not grant.put_if_absent(storage, f"{TIMELINE_DIR}/{tc}.{COMPACTION}.{REQUESTED}",
                                   json.dumps(plan, sort_keys=True).encode()):
            raise CommitError(f"compaction {tc} is already scheduled")
    return tc


class MergeStopped(Exception):
    """A merge stopped because another file group of its execution failed (or was interrupted)."""


def compact_file_group(storage: Storage, config: TableConfig, tc: str, operation: dict[str, Any],
                       token: str, stop: threading.Event | None = None) -> dict[str, Any]:
    """Merge one planned file group into a base file; returns the file's descriptor. `stop`:
    once set, the merge raises MergeStopped at its next piece (its file is left unfinished, an
    orphan the cleaner deletes)."""
    plan = read_compaction_plan(storage, tc)
    schema = schema_from_json(plan["schema"])
    files = ([operation["base_file"]] if operation["base_file"] else []) + operation["log_files"]
    # The records that merge like the whole slice with any later record (deletes included: a
    # late commit with an older instant must still lose to them). Written even when empty: the
    # base file is the barrier that retires the old slice.
    fschema = file_schema(schema)
    name = base_file_name(operation["file_group"], token, tc)
    rel = data_file_path(operation["partition"], name)
    stats: dict[str, Any] = {}
    stat_columns = [f.name for f in schema if supported_type(f.type)]
    rows, live = 0, True
    with storage.open_write(rel) as sink:
        out = None  # opened on the first piece, whose rows choose the columns' encodings
        try:
            # Pieces have disjoint keys (reader.py), so "one live row per key" holds for the file
            # when it holds for every piece.
            for piece in iter_files(storage, config, schema, operation["partition"], files, compact=True,
                                    late_after=plan.get("earliest_pending"), sizes=operation.get("bytes")):
                if stop is not None and stop.is_set():
                    raise MergeStopped(f"the merge of file group {operation['file_group']} stopped")
                piece = piece.cast(fschema)
                if out is None:
                    out = parquet_writer(sink, fschema, column_encodings(fschema, piece))
                out.write_table(piece, row_group_size=BASE_ROW_GROUP_ROWS)
                update_stats(stats, piece, stat_columns)
                rows += piece.num_rows
                live = (live and not pc.any(piece.column(IS_DELETED_COL)).as_py()
                        and one_row_per_key(piece, config.record_key))
                del piece  # not kept while the next piece is merged
            if out is None:  # no records: still a base file, the barrier
                out = parquet_writer(sink, fschema)
        finally:
            if out is not None:
                out.close()
        size = sink.tell()
    storage.make_durable([rel])
    return {"partition": operation["partition"], "file_group": operation["file_group"], "name": name,
            "rows": rows, "bytes": size, "stats": stats, "live": bool(live)}


def complete_compaction(storage: Storage, clock: TimeGenerator, tc: str, files: list[dict[str, Any]]) -> str | None:
    """Complete compaction `tc` with `files`; its completion time, or None if another execution
    completed it first (then these files are never read; the cleaner removes them)."""
    plan = read_compaction_plan(storage, tc)
    metadata = {"instant": tc, "action": COMPACTION_COMMIT, "operation": "compact", "schema": plan["schema"], **committed_by(),
                "files": sorted(files, key=lambda f: (f["partition"], f["name"])),
                "rows": sum(f["rows"] for f in files), "bytes": sum(f["bytes"] for f in files)}
    try:
        with clock.locked() as grant:
            completion = create_completed(storage, tc, grant, COMPACTION_COMMIT, metadata)
    except CommitError:
        if is_completed(storage, tc):
            return None
        raise
    # Indexed after completing: several executions may run one plan, and only the one that
    # completed it knows its base files are the instant's (format.md §18.4).
    index_commit(storage, metadata)
    return completion


def execution_token() -> str:
    """Numbers no other execution of the same plan picks (a pid and a random number)."""
    return make_token(os.getpid() % 2**31, random.randrange(2**31), 0)


def compaction_to_run(storage: Storage, instant: Any, name: str = "instant") -> Instant:
    """The compaction a user named by `instant` (option `name`), to run or finish it: a
    scheduled compaction, or a completed one (`is_completed`: nothing left to run).
    InvalidOptionError for anything else, saying what the instant is."""
    tc = parse_time_option(instant, name)
    inst = Timeline.load(storage).get(tc)
    if inst is None:
        raise InvalidOptionError(f"no instant {tc} on the timeline of {storage.uri}; `nbcc timeline "
                                 f"{storage.uri}` lists the instants")
    if inst.action == COMPACTION_COMMIT and inst.is_completed:
        return inst
    if inst.action != COMPACTION or inst.state == ROLLEDBACK:
        raise InvalidOptionError(f"instant {tc} is a {inst.state} {inst.action}, not a scheduled compaction; "
                                 f"`nbcc timeline {storage.uri}` lists the instants")
    return inst


def run_compaction(storage: Storage, config: TableConfig, clock: TimeGenerator, tc: str,
                   progress: Callable[[int, int], None] | None = None,
                   parallelism: int | None = None) -> str | None:
    """Execute compaction `tc` in this process; returns its completion time (None if another
    execution completed it first). `progress(done, total)` is called per file group, from the
    calling thread. `parallelism`: file groups merged at once (default: check_parallelism)."""
    workers = check_parallelism(parallelism)
    inst = Timeline.load(storage).get(tc)
    if inst is None or inst.action not in (COMPACTION, COMPACTION_COMMIT):
        raise InvalidOptionError(f"no compaction {tc} on the timeline" + (f" ({tc} is a {inst.action})" if inst else ""))
    if inst.is_completed:
        return None
    token = execution_token()
    operations = read_compaction_plan(storage, tc)["operations"]
    with compaction_heartbeat(storage, config, tc):
        try:
            files = _merge_file_groups(storage, config, tc, operations, token, workers, progress)
        except (DataFileError, FileNotFoundError):
            if is_completed(storage, tc):
                return None  # and a clean deleted the inputs it no longer needed: nothing was lost
            raise
        return complete_compaction(storage, clock, tc, files)


# The default number of file groups one process merges at once, at most: each merge holds its
# own memory, and the CPUs a process may use are not those of its container's quota.
DEFAULT_MAX_PARALLELISM = 4


def check_parallelism(parallelism: Any) -> int:
    """The number of file groups to merge at once: `parallelism`, or if None one per CPU this
    process may run on, at most DEFAULT_MAX_PARALLELISM."""
    if parallelism is None:
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return max(1, min(usable or 1, DEFAULT_MAX_PARALLELISM))
    if isinstance(parallelism, bool) or not isinstance(parallelism, int) or parallelism < 1:
        raise InvalidOptionError(f"parallelism must be a positive integer (file groups merged at once); "
                                 f"got {parallelism!r}")
    return parallelism


def _merge_file_groups(storage: Storage, config: TableConfig, tc: str, operations: list[dict[str, Any]],
                       token: str, workers: int, progress: Callable[[int, int], None] | None) -> list[dict[str, Any]]:
    """compact_file_group for each operation, `workers` at a time. Threads suffice: reading,
    merging and writing Parquet run in Arrow, which releases the GIL (bench/compaction_parallelism.py:
    8 file groups, 2M rows, on 2 cores, 2.29 s with 2 threads against 3.72 s with one). Each
    merge holds its own bounded memory, so the peak grows with `workers`."""
    files: list[dict[str, Any]] = []
    if workers == 1 or len(operations) <= 1:
        for op in operations:
            files.append(compact_file_group(storage, config, tc, op, token))
            if progress is not None:
                progress(len(files), len(operations))
        return files
    stop = threading.Event()
    with ThreadPoolExecutor(min(workers, len(operations)), thread_name_prefix=f"nbcc-compaction-{tc}") as pool:
        futures = [pool.submit(compact_file_group, storage, config, tc, op, token, stop=stop) for op in operations]
        try:
            for done in as_completed(futures):
                files.append(done.result())
                if progress is not None:
                    progress(len(files), len(operations))
        except BaseException:
            # The first failure (or Ctrl-C) fails the execution: no other merge starts, and those
            # running stop at their next piece, so it is raised without waiting for them to end.
            stop.set()
            for f in futures:
                f.cancel()
            raise
    return files


def compaction_heartbeat(storage: Storage, config: TableConfig, tc: str) -> Heartbeat:
    """The heartbeat of an execution of compaction `tc`: it tells one in progress from one that
    died (`abandoned_compactions`, `executing_compactions`). Kept when the execution fails, its
    last beat marked failed, so that an inline writer tries a failing compaction again once per
    heartbeat_timeout_s, not after every commit; the cleaner deletes it once the compaction
    completed."""
    return Heartbeat(storage, tc, interval_s(config.heartbeat_timeout_s), keep_if_failed=True)


# From scheduling a compaction to the first heartbeat of its execution, for whoever executes the
# compactions it schedules: one storage call, as the heartbeat starts with a beat.
UNSTARTED_GRACE_S = 10.0


def abandoned_compactions(storage: Storage, pending: list[str], timeout_s: float,
                          unstarted_s: float = UNSTARTED_GRACE_S) -> list[str]:
    """The compactions among `pending` that nothing executes: an execution's heartbeat older
    than `timeout_s` (it died, or it failed and kept its heartbeat, so that a failing
    compaction is tried again once per timeout), or no execution started within `unstarted_s`
    (at most `timeout_s`) of its scheduling: one scheduled by `--schedule-only` or by a writer
    that only schedules, which is anyone's to execute."""
    now = heartbeat._now_ms()

    def abandoned(tc: str) -> bool:
        beat = heartbeat.last_beat_ms(storage, tc)
        if beat is None:
            return now - parse_time(tc) > min(timeout_s, unstarted_s) * 1000
        return now - beat > timeout_s * 1000

    return [tc for tc in pending if abandoned(tc)]


def executing_compactions(storage: Storage, pending: list[str], timeout_s: float) -> dict[str, float]:
    """The compactions among `pending` that another process is executing, each with the seconds
    since its execution's last beat: a heartbeat at most `timeout_s` old whose last beat does not
    mark a failed execution. A process killed mid-execution (kill -9, a lost machine) leaves its
    heartbeat fresh until it expires: such a compaction counts as executing until then."""
    now = heartbeat._now_ms()
    beats = {tc: heartbeat.read_beat(storage, tc) for tc in pending}
    return {tc: (now - b[0]) / 1000 for tc, b in beats.items()
            if b is not None and not b[1] and now - b[0] <= timeout_s * 1000}


def left_to_its_executor(uri: str, tc: str, idle_s: float, timeout_s: float, other_ways: str = "") -> str:
    """What a compaction job says of a compaction `tc` it left to the process executing it."""
    return (f"compaction {tc} is being executed by another process (last heartbeat {idle_s:.0f} s ago); left to "
            f"it. If that process is gone (killed), the compaction counts as abandoned once its heartbeat is "
            f"{timeout_s} s old (heartbeat_timeout_s); `nbcc compact {uri} --instant {tc}`"
            f"{' ' + other_ways if other_ways else ''} runs it now")


def run_compactions(storage: Storage, config: TableConfig, clock: TimeGenerator,
                    run: Callable[[str, bool], T],
                    leave: Callable[[str, float], None] | None = None) -> list[T]:
    """A compaction job (`Table.compact`, `pyspark_nbcc.compact`, `nbcc compact`): `run(instant,
    scheduled_earlier)` for the compactions scheduled earlier, oldest first, then for one it
    schedules for what is left; or, when another process scheduled that meanwhile (a writer's
    compaction_delta_commits), for the compactions it scheduled. Their results, in order.

    One that another process is executing (`executing_compactions`) is left to it, and
    `leave(instant, seconds_since_its_last_beat)` is called (by default, a warning): running
    it again would only do the same work twice. One that fails does not stop the others (a
    damaged input file must not keep every other file group from being compacted): the first
    failure is raised once the rest have run."""
    results: list[T] = []
    failure: Exception | None = None

    def warn(tc: str, idle_s: float) -> None:  # it explains why the job did not run what it was asked to
        log.warning("%s", left_to_its_executor(storage.uri, tc, idle_s, config.heartbeat_timeout_s,
                                               "(or Table.run_compaction, or pyspark_nbcc.compact with instant=)"))

    def attempt(tc: str, earlier: bool) -> None:
        nonlocal failure
        # Read just before running it: the ones before may have taken long.
        busy = executing_compactions(storage, [tc], config.heartbeat_timeout_s) if earlier else {}
        if tc in busy:
            (leave or warn)(tc, busy[tc])
            return
        try:
            results.append(run(tc, earlier))
        except Exception as exc:  # noqa: BLE001 - raised below, after the others
            log.warning("compaction %s failed: %s; going on with the others", tc, exc)
            failure = failure or exc

    earlier = Timeline.load(storage).pending_compactions()
    for tc in earlier:
        attempt(tc, True)
    tc = schedule_compaction(storage, config, clock)  # after those: their groups' newer logs too
    if tc is not None:
        attempt(tc, False)
    else:
        for tc in Timeline.load(storage).pending_compactions():
            if tc not in earlier:
                attempt(tc, True)
    if failure is not None:
        raise failure
    return results


def delta_commits_since_compaction(timeline: Timeline) -> int:
    """Data commits completed after the latest compaction was scheduled (all, if none was)."""
    last = max((i.instant for i in timeline.instants if i.action in (COMPACTION, COMPACTION_COMMIT)), default="")
    return sum(1 for i in timeline.completed() if i.action in DATA_ACTIONS and i.completion > last)


def maybe_compact(storage: Storage, config: TableConfig, clock: TimeGenerator, every: int | None,
                  inline: bool, committed: str, logger: logging.Logger | None = None) -> str | None:
    """The inline trigger, run after a commit (`committed` names it in the log): schedule a
    compaction once `every` delta commits have completed since the last one, and execute it here
    if `inline`. Never raises: the write is committed, and failing it now would report it as
    failed (and make Spark abort a completed instant). A failure is logged as a warning on
    `logger`; `nbcc compact` finishes a compaction it left pending."""
    if not every:
        return None
    try:
        return _compact_inline(storage, config, clock, every, inline, logger or log)
    except Exception as exc:  # noqa: BLE001 - see above
        (logger or log).warning("%s completed, but the compaction after it failed: %s. `nbcc compact` "
                                "finishes a compaction left pending", committed, exc)
        return None


def _compact_inline(storage: Storage, config: TableConfig, clock: TimeGenerator, every: int,
                    inline: bool, logger: logging.Logger) -> str | None:
    timeline = Timeline.load(storage)
    since = delta_commits_since_compaction(timeline)
    if since < every:
        return None
    pending = timeline.pending_compactions()
    if pending:
        # Executing it is the job's, or the inline run's that scheduled it. One that nothing
        # executes (a killed process) an inline writer finishes, as `nbcc compact` would: a plan
        # may be executed again (format.md §15.3). A scheduling-only writer says so, once per
        # `every` commits, and only after heartbeat_timeout_s: a compaction job (cron) runs
        # the compactions writers schedule later as a rule.
        if not inline:
            if since % every == 0 and \
                    (stale := abandoned_compactions(storage, pending, config.heartbeat_timeout_s, float("inf"))):
                logger.warning("compaction %s is pending and nothing has executed it for %d delta commits; "
                               "`nbcc compact %s` finishes it (so do table.compact() and pyspark_nbcc.compact)",
                               stale[0], since, storage.uri)
            return None
        abandoned = abandoned_compactions(storage, pending, config.heartbeat_timeout_s)
        if len(abandoned) < len(pending):  # one is being executed: this writer leaves compaction to it
            return None
        for tc in abandoned:
            logger.warning("compaction %s was left pending (nothing executes it: its execution stopped or never started); "
                           "finishing it", tc)
            run_compaction(storage, config, clock, tc, parallelism=INLINE_PARALLELISM)
    tc = schedule_compaction(storage, config, clock)
    if tc is not None and inline:
        run_compaction(storage, config, clock, tc, parallelism=INLINE_PARALLELISM)
    return tc


# A writer's inline compaction merges one file group at a time: it runs inside a writer's
# process (a Spark driver, a stream), whose memory and CPUs are the writer's.
INLINE_PARALLELISM = 1
