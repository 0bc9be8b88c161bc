"""Streaming into and out of a table, engine-independent: exactly-once micro-batch writes, and
micro-batch reads whose offsets are completion times.

Writing. A streaming engine retries a micro-batch after a failure with the same batch id and the
same data, and the tasks of one batch run in different processes. So every batch claims one
instant for all its tasks in a record under `.nbcc/streams/<stream_id>/`:

    <batch_id:020d>.<attempt>.json   {"instant", "stream_id", "batch_id", "attempt", "query_id", ...}

created by whichever task of the batch has rows first: under the table lock it takes the
instant time, publishes `<instant>.requested` and puts the claim (put-if-absent), as
WriteTransaction.begin issues and publishes an instant under one lock hold (a compaction planned
later must see every pending instant, compaction.py). Every other task, and every replay of the
batch, reads the latest attempt and goes by its instant's state:
- completed: the batch is committed already; write nothing, commit nothing (a replay);
- rolled back (an abort, or a heartbeat that expired): claim attempt + 1 with a new instant;
- pending: write into it (the heartbeat and `.inflight` steps are repeatable, any task finishes
  them).
The commit completes that instant with `stream_id` and `batch_id` in its metadata, unless it is
completed already. An instant completes at most once (commit.py), so each batch is committed at
most once, whatever crashes, replays or zombie tasks do. Files of a failed attempt or of a task
attempt that lost are never listed by the commit; the cleaner deletes them as orphans.

Reading. An offset is a completion time `C`; the micro-batch after it reads the incremental range
`(C, E]` with `E` the completion time of a later data commit. A commit that started long ago and
completes late gets a completion time after every offset already handed out (one clock, §6), so
it falls into a later micro-batch and is never missed. The first batch of a stream that starts at
the beginning is the snapshot as of `E` (the same rows as that range, and readable even after a
clean removed older files). A stream of changes reads each range in the cdc format; its first
batch from the beginning is that snapshot's rows as inserts (`as_changes`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from datetime import datetime, timezone
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

import pyarrow as pa

from .clock import BEFORE_ALL, format_time, parse_time_option
from .commit import WriteTransaction
from .errors import CommitError, InvalidOptionError, LockLostError, StorageError
from .heartbeat import beat, remove as remove_heartbeat
from .rollback import rollback_instant, rollback_or_log
from .scan import (
    CDC,
    CHANGE_TYPE_COL,
    COMPLETION_TIME_COL,
    EARLIEST,
    INCREMENTAL,
    LATEST_STATE,
    SNAPSHOT,
    ReadOptions,
    ScanPlan,
    output_schema,
    plan_scan,
)
from .schema import constant_strings, null_array
from .storage import Storage
from .timeline import (
    COMPLETED,
    DATA_ACTIONS,
    INFLIGHT,
    REQUESTED,
    ROLLEDBACK,
    TIMELINE_DIR,
    Timeline,
    create_requested,
    earliest_retained,
    load_history,
    parse_instant_file,
    read_commit_metadata,
)
from .view import earliest_begin, state_lost_at

log = logging.getLogger(__name__)

STREAMS_DIR = ".nbcc/streams"
OWNER_FILE = "owner.json"
QUERIES_DIR = f"{STREAMS_DIR}/_queries"  # the stream id each query writes under
KEEP_CLAIMS = 100  # batches whose claims are kept; an engine replays only its latest batch
_MAX_CLAIM_ROUNDS = 50
_STREAM_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
LATEST = "latest"


# -- writing -----------------------------------------------------------------------------------

def check_stream_id(value: Any) -> str:
    """A stream id names a folder: letters, digits, '.', '_', '-' (at most 128, not starting with
    '.', '_' or '-')."""
    text = str(value).strip()
    if not _STREAM_ID.fullmatch(text):
        raise InvalidOptionError(
            f"stream_id={value!r} is not a valid stream id: use 1 to 128 letters, digits, '.', '_' or "
            "'-', starting with a letter or digit (e.g. orders_ingest.v2)"
        )
    return text


@dataclass(frozen=True)
class Claim:
    """The instant that micro-batch `batch_id` of a stream writes into."""

    stream_id: str
    batch_id: int
    attempt: int
    instant: str
    state: str  # the instant's state: completed, or pending (requested / inflight)

    @property
    def committed(self) -> bool:
        return self.state == COMPLETED


def _claim_dir(stream_id: str) -> str:
    return f"{STREAMS_DIR}/{stream_id}"


def _claim_path(stream_id: str, batch_id: int, attempt: int) -> str:
    return f"{_claim_dir(stream_id)}/{batch_id:020d}.{attempt}.json"


def _parse_claim_name(name: str) -> tuple[int, int] | None:
    parts = name.split(".")
    if len(parts) == 3 and parts[2] == "json" and parts[0].isdigit() and parts[1].isdigit():
        return int(parts[0]), int(parts[1])
    return None


def latest_claim(storage: Storage, stream_id: str, batch_id: int) -> dict[str, Any] | None:
    """The latest attempt's claim record of a batch, or None."""
    names = storage.list_names(_claim_dir(stream_id), prefix=f"{batch_id:020d}.")
    attempts = [p[1] for p in map(_parse_claim_name, names) if p is not None and p[0] == batch_id]
    if not attempts:
        return None
    return json.loads(storage.read_bytes(_claim_path(stream_id, batch_id, max(attempts))))


def instant_state(storage: Storage, instant: str) -> str | None:
    """The state of one instant (None: not on the timeline), from a listing of its own names
    and, unless they show it completed, rolled back or still requested, the history (it may have
    been archived since): the highest state of both, as Timeline.load finds."""
    own = [i for i in map(parse_instant_file, storage.list_names(TIMELINE_DIR, prefix=instant))
           if i is not None and i.instant == instant]
    # No file, or only an `.inflight` that a task stalled through a rollback put back after the
    # rollback's mark was archived (a pending instant keeps its `.requested` until it completes).
    # The history is listed after the timeline: archival writes history first, then deletes.
    if not {i.state for i in own} & {COMPLETED, ROLLEDBACK, REQUESTED}:
        own += [i for i in load_history(storage) if i.instant == instant]
    found = Timeline(own).get(instant)
    return found.state if found else None


def _begin_rest(storage: Storage, instant: str, action: str, info: dict[str, Any]) -> None:
    """The steps of WriteTransaction.begin after `.requested` (heartbeat, inflight); repeatable,
    so any task of the batch may finish them."""
    beat(storage, instant)
    storage.put_if_absent(f"{TIMELINE_DIR}/{instant}.{action}.{INFLIGHT}",
                          json.dumps(info, separators=(",", ":"), sort_keys=True).encode())


def _new_claim(storage: Storage, clock: Any, stream_id: str, batch_id: int, attempt: int, action: str,
               info: dict[str, Any], query_id: str | None) -> str | None:
    """Claim `attempt` of a batch with a new instant, issued and published as requested under the
    lock; None if another task claimed that attempt first."""
    path = _claim_path(stream_id, batch_id, attempt)
    instant = ""
    try:
        with clock.locked() as grant:
            # Every claimant takes the lock, so a claim seen missing here is not being made by
            # anyone else: the common race (all tasks of a new batch at once) leaves no stray instant.
            if storage.exists(path):
                return None
            instant = grant.time
            create_requested(storage, instant, action, info, grant)
            body = {"stream_id": stream_id, "batch_id": batch_id, "attempt": attempt, "instant": instant,
                    "action": action, "query_id": query_id}
            won = False
            claim_failure: StorageError | None = None
            data = json.dumps(body).encode()
            if not grant.overran:
                try:
                    won = grant.put_if_absent(storage, path, data)
                except LockLostError:
                    pass  # too late in the lease to claim: the instant is withdrawn below
                except StorageError as failure:
                    claim_failure = failure
    except StorageError as failure:
        # The requested file may have landed all the same: undo it now, not at the cleaner's.
        if instant:
            rollback_or_log(storage, clock, instant, 0, failure)
        raise
    if claim_failure is not None:
        # The claim may have landed (a lost reply, a request given up at the lease's end), and
        # another task of the batch may be writing into its instant already: look before undoing.
        try:
            won = storage.read_bytes(path) == data
        except FileNotFoundError:
            won = False
        except StorageError:
            raise claim_failure from None  # unknown: leave the instant to the cleaner
        if not won:
            rollback_or_log(storage, clock, instant, 0, claim_failure)
            raise claim_failure
    # As WriteTransaction.begin: an instant published past the lease may have been missed by a
    # compaction scheduled meanwhile. A claim that landed then names a rolled-back instant, and
    # the next attempt claims anew.
    if not won or grant.overran:  # (not won: our lease ran out mid-claim, another claimant went ahead)
        rollback_instant(storage, clock, instant, 0, reason="its claim was not published within the table lock's lease")
        return None
    _begin_rest(storage, instant, action, info)
    return instant


_OWNERS_SEEN: set[tuple[str, str, str]] = set()


def check_owner(storage: Storage, stream_id: str, query_id: str | None) -> None:
    """A stream id belongs to one streaming query (one checkpoint). Another query starts its
    batch ids at 0 again, so its batches would be taken for replays of the first one's and
    skipped: refuse it instead. A default stream id (the query id) is recorded too: another
    query may be given it as its stream_id. And a query belongs to one stream id: restarted
    from its checkpoint under another one, it would commit again the batches it had committed
    but not yet checkpointed (`_check_query_stream`)."""
    if not query_id or (storage.uri, stream_id, query_id) in _OWNERS_SEEN:
        return
    record = _check_query_stream(storage, stream_id, query_id)
    path = f"{_claim_dir(stream_id)}/{OWNER_FILE}"
    if not storage.put_if_absent(path, json.dumps({"query_id": query_id}).encode()):
        owner = _owner_of(storage, stream_id)
        if owner != query_id:
            raise InvalidOptionError(
                f"stream_id={stream_id!r} belongs to another streaming query (query id {owner}); this "
                f"query ({query_id}) has another checkpoint, and its batch ids would be taken for that "
                "query's committed batches and skipped. Give each checkpoint its own stream_id (or "
                "leave stream_id out: it defaults to the query id, kept in the checkpoint)."
            )
    if record is not None:  # only once the stream is this query's: a refused one records nothing
        record()
    _OWNERS_SEEN.add((storage.uri, stream_id, query_id))


def _check_query_stream(storage: Storage, stream_id: str, query_id: str) -> Callable[[], None] | None:
    """Refuse a query that wrote under another stream id: `.nbcc/streams/_queries/<query_id>.json`
    records the one it first wrote under (a stream id never starts with '_'). A query that wrote
    before these records existed is known by its default stream's owner file. Returns what
    records `stream_id` for the query, if nothing has yet, for once the stream is known to be its."""
    if not _STREAM_ID.fullmatch(query_id):
        return None  # not a name a file can have (Spark's query ids are UUIDs)
    path = f"{QUERIES_DIR}/{query_id}.json"
    try:
        recorded = json.loads(storage.read_bytes(path)).get("stream_id")
    except FileNotFoundError:
        recorded = None
        if stream_id != query_id and _owner_of(storage, query_id) == query_id:
            recorded = query_id  # it wrote under its default stream id
    if recorded is None:
        def record() -> None:
            if not storage.put_if_absent(path, json.dumps({"stream_id": stream_id}).encode()):
                _refuse_other_stream(query_id, json.loads(storage.read_bytes(path)).get("stream_id"), stream_id)
        return record
    _refuse_other_stream(query_id, recorded, stream_id)
    return None


def _owner_of(storage: Storage, stream_id: str) -> str | None:
    try:
        return json.loads(storage.read_bytes(f"{_claim_dir(stream_id)}/{OWNER_FILE}")).get("query_id")
    except FileNotFoundError:
        return None


def _refuse_other_stream(query_id: str, recorded: str | None, stream_id: str) -> None:
    if recorded == stream_id:
        return
    raise InvalidOptionError(
        f"this streaming query (query id {query_id}, kept in its checkpoint) wrote to this table as "
        f"stream_id={recorded!r}; restarted as stream_id={stream_id!r} it would commit again the batches "
        f"it committed as {recorded!r} but had not checkpointed yet. Restart it with stream_id={recorded!r}"
        f"{' (or without stream_id: that is its default)' if recorded == query_id else ''}, or give "
        f"stream {stream_id!r} a new checkpoint location."
    )


def claim_batch(storage: Storage, clock: Any, stream_id: str, batch_id: int, action: str,
                info: dict[str, Any] | None = None, query_id: str | None = None) -> Claim:
    """The instant micro-batch `batch_id` writes into: its latest claim if that is still usable,
    else a new claim (see the module doc). Safe to call from every task of the batch at once."""
    check_owner(storage, stream_id, query_id)
    info = {**(info or {}), "stream_id": stream_id, "batch_id": batch_id,
            "host": socket.gethostname(), "pid": os.getpid()}
    for _ in range(_MAX_CLAIM_ROUNDS):
        record = latest_claim(storage, stream_id, batch_id)
        attempt = 0
        if record is not None:
            instant = record["instant"]
            state = instant_state(storage, instant)
            if state == COMPLETED:
                return Claim(stream_id, batch_id, record["attempt"], instant, COMPLETED)
            if state != ROLLEDBACK:
                # Beat before looking again: a cleaner re-reads the heartbeat under the lock
                # before it rolls a write back, so once the second look shows it pending, it stays
                # so while this task writes (and beats).
                beat(storage, instant)
                state = instant_state(storage, instant)
                if state in (REQUESTED, INFLIGHT):
                    if state == REQUESTED:  # its claimant died before finishing the begin
                        _begin_rest(storage, instant, record.get("action", action), info)
                    return Claim(stream_id, batch_id, record["attempt"], instant, state)
                remove_heartbeat(storage, instant)
                if state == COMPLETED:
                    return Claim(stream_id, batch_id, record["attempt"], instant, COMPLETED)
            attempt = record["attempt"] + 1
        instant = _new_claim(storage, clock, stream_id, batch_id, attempt, action, info, query_id)
        if instant is not None:
            return Claim(stream_id, batch_id, attempt, instant, INFLIGHT)
        # Another task claimed this attempt first: go by its claim.
    raise CommitError(f"stream {stream_id}: could not claim an instant for batch {batch_id}")


def commit_batch(template: WriteTransaction, stream_id: str, batch_id: int, instant: str,
                 files: Iterable[dict[str, Any]]) -> str | None:
    """Complete micro-batch `batch_id` in `instant`: its completion time, or None if the batch
    was committed already (a replay, or another run of it won)."""
    extra = {"stream_id": stream_id, "batch_id": batch_id}
    if instant_state(template.storage, instant) == COMPLETED:
        return None
    try:
        completion = replace(template, instant=instant).commit(files, extra=extra)
    except CommitError:
        if instant_state(template.storage, instant) == COMPLETED:
            return None  # a concurrent run of the same batch completed it first
        raise
    prune_claims(template.storage, stream_id, batch_id)
    return completion


def prune_claims(storage: Storage, stream_id: str, batch_id: int, keep: int = KEEP_CLAIMS) -> None:
    """Delete the claims of batches older than the last `keep` (an engine only ever replays its
    latest batch). Best effort: a claim left behind is harmless."""
    try:
        names = storage.list_names(_claim_dir(stream_id))
        storage.delete_many([f"{_claim_dir(stream_id)}/{name}" for name in names
                             if (parsed := _parse_claim_name(name)) is not None and parsed[0] <= batch_id - keep])
    except Exception as exc:  # noqa: BLE001 - the batch is committed; tidying must not fail it
        log.warning("stream %s: pruning old claims failed: %s", stream_id, exc)


# -- reading -----------------------------------------------------------------------------------

_FUTURE_SKEW_MS = 5 * 60 * 1000  # how far ahead of this machine's clock a begin may be


def initial_offset(storage: Storage, begin: str | None) -> str:
    """The offset (a completion time) a new stream starts after: `earliest` (default) is before
    every commit, `latest` is the latest data commit's completion, else the time given (refused
    if it is in the future: after every commit and past this machine's clock)."""
    text = (begin or EARLIEST).strip()
    if text.lower() == EARLIEST:
        return BEFORE_ALL
    if text.lower() == LATEST:
        return latest_data_completion(storage)
    begin = parse_time_option(text, "begin")
    # Later than every completion and than this machine's clock (give or take its skew): most
    # likely a local time given without its zone, and the stream would skip every commit that
    # completes before it.
    latest = Timeline.load(storage).latest_completion() or BEFORE_ALL
    now = format_time(time.time_ns() // 1_000_000 + _FUTURE_SKEW_MS)
    if begin > max(latest, now):
        now_utc = datetime.now(timezone.utc).isoformat(timespec="seconds")
        raise InvalidOptionError(
            f"begin={text!r} ({begin}) is in the future (it is {now_utc} now), and the stream would skip every "
            "commit that completes before then. A time without a zone is UTC: if it is a local time, give its "
            "zone (2026-11-21T10:30:00+01:00); for the commits that complete from now on, give begin=latest")
    return begin



def latest_data_completion(storage: Storage) -> str:
    """The completion time of the latest data commit (BEFORE_ALL if there is none)."""
    latest = Timeline.load(storage).latest_data_commit()
    return latest.completion if latest else BEFORE_ALL


@dataclass(frozen=True)
class Limits:
    """Admission control for one micro-batch; None = no limit. At least one commit is always
    admitted, or a single large commit would stop the stream."""

    max_commits: int | None = None
    max_rows: int | None = None
    max_bytes: int | None = None
    min_rows: int | None = None  # fewer rows than this available: wait for more


def next_offset(storage: Storage, start: str, limits: Limits = Limits(), upto: str | None = None) -> str:
    """The end of the micro-batch after `start`: the completion time of the last data commit
    admitted (`start` itself if there is none). `upto` caps it (a trigger that reads only what
    was there when it began)."""
    timeline = Timeline.load(storage)
    commits = [i for i in timeline.completed()
               if i.action in DATA_ACTIONS and i.completion > start and (upto is None or i.completion <= upto)]
    if not commits:
        return start
    first = 1
    if start == BEFORE_ALL:
        # The first batch of a stream from the beginning is a snapshot; it cannot be taken as of
        # a time before the window a cleaner retained, so it reaches at least that far.
        window = earliest_retained(storage, timeline)
        if window is not None:
            first = max(first, sum(1 for i in commits if i.completion <= window))
    if limits.max_rows is None and limits.max_bytes is None and limits.min_rows is None:
        n = len(commits) if limits.max_commits is None else min(len(commits), limits.max_commits)
        return commits[max(n, first) - 1].completion
    rows = bytes_ = 0
    n = 0
    for inst in commits:
        meta = read_commit_metadata(storage, inst)
        r, b = int(meta.get("rows", 0)), int(meta.get("bytes", 0))
        over = ((limits.max_commits is not None and n + 1 > limits.max_commits)
                or (limits.max_rows is not None and rows + r > limits.max_rows)
                or (limits.max_bytes is not None and bytes_ + b > limits.max_bytes))
        if over and n >= first:
            break
        rows, bytes_, n = rows + r, bytes_ + b, n + 1
    if limits.min_rows is not None and rows < limits.min_rows:
        return start
    return commits[n - 1].completion


def plan_range(storage: Storage, config: Any, start: str, end: str, include_meta_columns: bool = False,
               use_metadata_table: bool | None = None, incremental_format: str = LATEST_STATE) -> ScanPlan:
    """The read plan of the micro-batch `(start, end]`: the rows of every key written by a data
    commit that completed in it, as of `end` (deleted keys absent); with `incremental_format=cdc`,
    its changes. A cdc stream's first micro-batch from the beginning is a snapshot plan with the
    meta columns: `as_changes` makes its rows changes."""
    if start == BEFORE_ALL:
        # Every key written up to `end`, as of `end`: the snapshot, which stays readable after a
        # clean (an incremental range from the beginning would need cleaned files).
        options = ReadOptions(query_type=SNAPSHOT, as_of=end,
                              include_meta_columns=include_meta_columns or incremental_format == CDC,
                              use_metadata_table=use_metadata_table)
    else:
        options = ReadOptions(query_type=INCREMENTAL, begin=start, end=end, incremental_format=incremental_format,
                              include_meta_columns=include_meta_columns, use_metadata_table=use_metadata_table)
    try:
        return plan_scan(storage, config, options)
    except InvalidOptionError:
        timeline = Timeline.load(storage)
        retained = earliest_retained(storage, timeline)
        if retained is None or (end if start == BEFORE_ALL else start) >= retained:
            raise
        # The stream's own offsets, not the as_of or begin the user never gave, and what to do.
        first = earliest_begin(timeline, retained, needs_begin_state=True)  # a begin that serves any range
        if first == BEFORE_ALL:  # nothing completed before the window: it is not why
            raise
        lost = state_lost_at(timeline, retained, start) if start != BEFORE_ALL else None
        if lost:  # no commit of the range is missing: the state at its begin is (cdc, or an overwrite)
            why = (f"needs the table's state at {start} ("
                   f"{'the stream reads changes' if options.is_cdc else 'the range holds an overwrite'}), and "
                   f"{lost} (the window the cleaner retained starts at {retained}). "
                   "Such a stream must not lag behind a compaction older than the window: choose retain_commits "
                   "to cover that lag")
        else:
            why = (f"reaches before the window the cleaner retained, which starts at {retained}: commits it "
                   "holds completed before the window, and their files may have been cleaned. Choose "
                   "retain_commits to cover the longest the stream may lag")
        raise InvalidOptionError(
            f"the stream's micro-batch ({start}, {end}] {why}. To go on, "
            "start the query from a new checkpoint: begin=earliest delivers the table as of a time the "
            "cleaner kept, then every later commit (keys delivered before come again); "
            f"begin={first}, the earliest begin that can still be read, delivers every commit that completed "
            "after it, and skips the keys that only cleaned commits changed") from None


def as_changes(plan: ScanPlan, rows: pa.Table) -> pa.Table:
    """Rows of a cdc stream's first micro-batch (the snapshot as of its end, with meta columns)
    as cdc rows: every key an insert, at the completion of the commit its row came from (the
    winning record's: a later write that lost on ordering does not count, where a batch cdc read
    from `earliest` takes the last commit that wrote the key), as Delta's change feed starts a
    stream with its snapshot's rows as inserts."""
    changes = output_schema(plan.config, plan.schema, ReadOptions(query_type=INCREMENTAL, incremental_format=CDC))
    row_type = changes.field("after").type
    n = rows.num_rows
    after = pa.StructArray.from_arrays([rows.column(f.name).combine_chunks() for f in row_type], fields=list(row_type))
    return pa.table({**{k: rows.column(k) for k in plan.config.record_key},
                     CHANGE_TYPE_COL: constant_strings("insert", n),
                     COMPLETION_TIME_COL: rows.column(COMPLETION_TIME_COL),
                     "before": null_array(n, row_type), "after": after}).cast(changes)
