"""Building metadata table partitions while writers keep writing (RFC-45's asynchronous indexing,
adapted to nbcc; format.md §18.6).

1. Schedule, under the table lock, which issues the indexing instant Ti: the base instant B is the
   latest completed instant with no pending data write or compaction before it; table.json marks
   the partitions "building", and `<Ti>.indexing.requested` holds {partitions, base_instant}.
   From then on every writer adds its own entries (commit.py, compaction.py).
2. Build: index every completed data commit and compaction up to B, in chunks of one delta
   commit of the metadata table each. Instants already indexed are skipped, so a re-run resumes.
3. Catch up: index every instant completed after B that has no entries, and wait (up to a
   timeout) for the data writes that were pending when Ti was scheduled: they may have read
   table.json before step 1, and so write no entries of their own. On timeout Ti stays pending
   and a re-run resumes it.
4. Complete, under the lock: table.json marks the partitions "ready", `<Ti>_<c>.indexing` is
   created.
Dropping a partition marks it "dropping" in table.json (no one uses it, no build is scheduled for
it), cancels (marks rolled back) the pending indexing instants that build it, deletes its rows,
and only then removes it from table.json.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterable, Sequence

from .clock import TimeGenerator
from .config import check_duration
from .errors import CommitError, NbccError
from .index_view import indexed_instants, read_rows
from .metadata_table import (
    BUILDING,
    DROPPING,
    INDEXED_ACTIONS,
    READY,
    check_kinds,
    cleaned_files,
    completed_cleans,
    delete_rows,
    entries,
    forget,
    metadata_storage,
    open_metadata_table,
    read_states,
    upkeep,
    write_rows,
    write_states,
)
from .storage import Storage
from .timeline import (
    COMPACTION,
    COMPLETED,
    DATA_ACTIONS,
    INDEXING,
    INFLIGHT,
    REQUESTED,
    ROLLEDBACK,
    TIMELINE_DIR,
    Timeline,
    committed_by,
    create_completed,
    read_commit_metadata,
    read_timeline_file,
    remove_pending_files,
)

DEFAULT_TIMEOUT_S = 300.0
CHUNK_INSTANTS = 100  # instants per delta commit of the metadata table while building


class IndexingTimeoutError(NbccError):
    """Catch-up waited too long for writes in flight; the indexing stays pending (re-run it)."""


def plan_of(storage: Storage, ti: str) -> dict[str, Any]:
    """The plan of indexing `ti`: {instant, partitions, base_instant}."""
    return read_timeline_file(storage, f"{ti}.{INDEXING}.{REQUESTED}", f"the plan of indexing {ti}")


def pending_indexing(storage: Storage, timeline: Timeline | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(Ti, plan) of every indexing scheduled and neither completed nor cancelled."""
    timeline = timeline or Timeline.load(storage)
    out = []
    for inst in timeline.pending():
        if inst.action == INDEXING:
            try:
                out.append((inst.instant, plan_of(storage, inst.instant)))
            except FileNotFoundError:  # completed or cancelled meanwhile
                continue
    return out


def base_instant(timeline: Timeline) -> str | None:
    """The latest completed instant with no pending data write or compaction before it."""
    base = None
    for inst in timeline.instants:  # by instant time
        if inst.state in (REQUESTED, INFLIGHT) and inst.action in DATA_ACTIONS + (COMPACTION,):
            break
        if inst.state == COMPLETED:
            base = inst.instant
    return base


def schedule(storage: Storage, clock: TimeGenerator, kinds: Sequence[str]) -> str | None:
    """Schedule the indexing of the partitions among `kinds` that are neither ready nor being
    built by a pending indexing; its instant, or None if there is none left to schedule."""
    open_metadata_table(storage, create=True)  # before "building": writers then have a table to write to
    with clock.locked() as grant:
        ti = grant.time
        timeline = Timeline.load(storage)  # under the lock: every instant older than Ti is on it
        planned = {k for _, plan in pending_indexing(storage, timeline) for k in plan["partitions"]}
        states = read_states(storage, dropping=True)
        # Not while a drop deletes its rows: the build would skip instants whose old markers it
        # read, and then be marked ready with the gaps the deletion leaves.
        todo = [k for k in kinds if states.get(k) not in (READY, DROPPING) and k not in planned]
        if not todo:
            return None
        plan = {"instant": ti, "partitions": todo, "base_instant": base_instant(timeline)}
        # Marked building before any later time is issued: a write that begins after this, or
        # completes after it, adds its own entries (it reads table.json when it commits).
        write_states(storage, grant, {**states, **{k: BUILDING for k in todo}})
        if not grant.put_if_absent(storage, f"{TIMELINE_DIR}/{ti}.{INDEXING}.{REQUESTED}",
                                   json.dumps(plan, sort_keys=True).encode()):
            raise CommitError(f"indexing {ti} is already scheduled")
    return ti


def index_instants(storage: Storage, kinds: Sequence[str], instants: Iterable[str],
                   indexed: dict[str, set[str]] | None = None) -> int:
    """Index completed instants (by instant time) into `kinds`, skipping what `indexed` (kind ->
    instants) already has, in one delta commit of the metadata table; the instants indexed.
    Runs anywhere (a Spark task too): it reads only the timeline, commit files and data files."""
    timeline = Timeline.load(storage)
    gone = cleaned_files(storage, timeline)
    cleans = completed_cleans(timeline)
    rows: list[dict[str, Any]] = []
    done = 0
    for ti in instants:
        inst = timeline.get(ti)
        missing = [k for k in kinds if indexed is None or ti not in indexed.get(k, set())]
        if inst is None or not inst.is_completed or inst.action not in INDEXED_ACTIONS or not missing:
            continue
        meta = read_commit_metadata(storage, inst)
        meta = {**meta, "files": [f for f in meta.get("files", []) if (f["partition"], f["name"]) not in gone]}
        rows += entries(storage, meta, missing)
        done += 1
    write_rows(storage, rows, maintain=False)
    # A clean that completed since the listing above may have forgotten its files before these
    # rows landed: forget them again. One completing after the listing below forgets after
    # these rows (it runs prune() once completed), so no entry of a deleted file stays.
    late = (cleaned_files(storage, Timeline.load(storage), skip=cleans) - gone) & {
        (r["partition"], r["name"]) for r in rows if r.get("name") is not None}
    if late:
        forget(storage, sorted(late), kinds)
    return done


def base_work(storage: Storage, plan: dict[str, Any]) -> tuple[list[list[str]], dict[str, set[str]]]:
    """The instants step 2 still has to index, in chunks (one delta commit each), and what the
    metadata table has already (kind -> instants)."""
    mdt = open_metadata_table(storage, create=True)
    timeline = Timeline.load(storage)
    base, kinds = plan.get("base_instant"), plan["partitions"]
    indexed = indexed_instants(mdt, kinds)
    todo = [i.instant for i in timeline.completed()
            if base is not None and i.instant <= base and i.action in INDEXED_ACTIONS
            and any(i.instant not in indexed[k] for k in kinds)]
    todo.sort()
    return [todo[n:n + CHUNK_INSTANTS] for n in range(0, len(todo), CHUNK_INSTANTS)], indexed


def _completed(ti: str, names: Sequence[str]) -> bool:
    """Whether the timeline names that start with `ti` show it completed (by any run)."""
    return any(n.startswith(f"{ti}_") for n in names)


def _cancelled(ti: str, names: Sequence[str]) -> bool:
    """Whether they show indexing `ti` cancelled (a drop of one of its partitions): its mark, or,
    once archival moved the mark into the history, its requested file gone."""
    return f"{ti}.{INDEXING}.{ROLLEDBACK}" in names or f"{ti}.{INDEXING}.{REQUESTED}" not in names


def _check_cancelled(storage: Storage, ti: str) -> None:
    """Fail if indexing `ti` was cancelled; one that another run completed goes on (it finds
    out at completion)."""
    names = storage.list_names(TIMELINE_DIR, prefix=ti)
    if not _completed(ti, names) and _cancelled(ti, names):
        _stop_cancelled(storage, ti)


def _stop_cancelled(storage: Storage, ti: str) -> None:
    remove_pending_files(storage, ti, INDEXING)  # a run may have put its inflight file back
    raise CommitError(f"indexing {ti} was cancelled (its partitions were dropped meanwhile)")


def catch_up(storage: Storage, ti: str, plan: dict[str, Any], timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """Step 3: index what completed after the base instant and has no entries, until no data
    write that was pending when Ti was scheduled is still pending. The instants indexed."""
    mdt = open_metadata_table(storage, create=True)
    base, kinds = plan.get("base_instant"), plan["partitions"]
    deadline = time.monotonic() + timeout_s
    pause, done = 0.02, 0
    while True:
        # Each round, not only before writing: a run with nothing to index would otherwise
        # wait out its timeout for writes although a drop cancelled it.
        _check_cancelled(storage, ti)
        timeline = Timeline.load(storage)  # before the markers: an instant indexed before it
        indexed = indexed_instants(mdt, kinds)  # completed is then among them
        missing = [i.instant for i in timeline.completed()
                   if (base is None or i.instant > base) and i.action in INDEXED_ACTIONS
                   and any(i.instant not in indexed[k] for k in kinds)]
        for n in range(0, len(missing), CHUNK_INSTANTS):
            if n:  # the round began with a check; stop writing rows that a drop is deleting
                _check_cancelled(storage, ti)
            done += index_instants(storage, kinds, missing[n:n + CHUNK_INSTANTS], indexed)
        waiting = [i.instant for i in timeline.pending()
                   if i.action in DATA_ACTIONS and i.instant < ti and (base is None or i.instant > base)]
        if not waiting:
            return done
        left = deadline - time.monotonic()
        if left <= 0:
            raise IndexingTimeoutError(
                f"indexing {ti}: {'writes' if len(waiting) > 1 else 'write'} {', '.join(waiting)} "
                f"{'were' if len(waiting) > 1 else 'was'} still in flight after {timeout_s:g} s; "
                "the indexing stays pending and resumes where it stopped when run again (a write that "
                "failed is rolled back by `nbcc clean` once its heartbeat expires)")
        time.sleep(min(pause, left))
        pause = min(pause * 2, 1.0)


def complete(storage: Storage, clock: TimeGenerator, ti: str, plan: dict[str, Any]) -> list[str]:
    """Step 4: mark the partitions still being built ready and complete Ti; the partitions
    marked (none if another run completed it first)."""
    with clock.locked() as grant:
        names = storage.list_names(TIMELINE_DIR, prefix=ti)
        if _completed(ti, names):
            return []  # another run completed it
        cancelled = _cancelled(ti, names)
        if not cancelled:
            states = read_states(storage, dropping=True)  # kept whole: a drop may be under way
            ready = [k for k in plan["partitions"] if states.get(k) == BUILDING]  # not dropped since
            write_states(storage, grant, {**states, **{k: READY for k in ready}})
            meta = {"instant": ti, "action": INDEXING, "partitions": plan["partitions"],
                    "base_instant": plan.get("base_instant"), "ready": ready, "files": [], **committed_by()}
            create_completed(storage, ti, grant, INDEXING, meta)
    if cancelled:
        _stop_cancelled(storage, ti)
    remove_pending_files(storage, ti, INDEXING)
    return ready


# (partitions, chunks, indexed: kind -> instants covered already): index the chunks
Execute = Callable[[Sequence[str], list[list[str]], dict[str, set[str]]], None]


def run(storage: Storage, clock: TimeGenerator, ti: str, timeout_s: float = DEFAULT_TIMEOUT_S,
        progress: Callable[[int, int], None] | None = None, execute: Execute | None = None) -> list[str]:
    """Steps 2 to 4 of indexing Ti (also to resume it); the partitions made ready. `execute`
    runs step 2's chunks elsewhere (a Spark job: one task each); by default, here. Fails with a
    CommitError once Ti is found cancelled: a drop is deleting the rows it would write."""
    try:
        plan = plan_of(storage, ti)
    except FileNotFoundError:
        _check_cancelled(storage, ti)
        raise
    storage.put_if_absent(f"{TIMELINE_DIR}/{ti}.{INDEXING}.{INFLIGHT}", json.dumps(plan, sort_keys=True).encode())
    _check_cancelled(storage, ti)  # after the put: removes the inflight file if the drop came first
    chunks, indexed = base_work(storage, plan)
    if execute is not None and chunks:
        execute(plan["partitions"], chunks, indexed)
    else:
        for n, chunk in enumerate(chunks, 1):
            _check_cancelled(storage, ti)
            index_instants(storage, plan["partitions"], chunk, indexed)
            if progress is not None:
                progress(n, len(chunks))
    catch_up(storage, ti, plan, timeout_s)
    ready = complete(storage, clock, ti, plan)
    mdt = open_metadata_table(storage)
    if mdt is not None:
        upkeep(mdt, force=True)  # the build wrote many delta commits: compact them
    return ready


def build_index(storage: Storage, clock: TimeGenerator, partitions: Iterable[str] | str,
                timeout_s: float = DEFAULT_TIMEOUT_S, progress: Callable[[int, int], None] | None = None,
                execute: Execute | None = None) -> dict[str, Any]:
    """Build the metadata table `partitions` (resuming pending indexing that builds any of them);
    returns {"instants": the indexing instants run, "ready": every ready partition}."""
    kinds = check_kinds(partitions)
    check_duration("timeout_s", timeout_s, "seconds")
    dropping = [k for k, v in read_states(storage, dropping=True).items() if v == DROPPING and k in kinds]
    if dropping:
        one = len(dropping) == 1
        raise CommitError(f"metadata table partition{'' if one else 's'} {', '.join(sorted(dropping))} "
                          f"{'is' if one else 'are'} being dropped: build {'it' if one else 'them'} once the "
                          "drop finished (run the drop again if it stopped part-way)")
    open_metadata_table(storage, create=True)
    ran = []
    for ti, plan in pending_indexing(storage):
        if set(plan["partitions"]) & set(kinds):
            run(storage, clock, ti, timeout_s, progress, execute)
            ran.append(ti)
    ti = schedule(storage, clock, kinds)
    if ti is not None:
        run(storage, clock, ti, timeout_s, progress, execute)
        ran.append(ti)
    fill_gaps(storage)
    return {"instants": ran, "ready": sorted(k for k, v in read_states(storage).items() if v == READY)}


def fill_gaps(storage: Storage) -> int:
    """Index the completed instants that a ready partition lacks (a writer or a compaction that
    stopped between its commit and its entries); the instants indexed. Readers are right without
    it (they read such an instant's commit file); this keeps them from having to."""
    kinds = sorted(k for k, v in read_states(storage).items() if v == READY)
    mdt = open_metadata_table(storage)
    if not kinds or mdt is None:
        return 0
    timeline = Timeline.load(storage)
    indexed = indexed_instants(mdt, kinds)
    missing = [i.instant for i in timeline.completed()
               if i.action in INDEXED_ACTIONS and any(i.instant not in indexed[k] for k in kinds)]
    return sum(index_instants(storage, kinds, missing[n:n + CHUNK_INSTANTS], indexed)
               for n in range(0, len(missing), CHUNK_INSTANTS))


def drop_index(storage: Storage, clock: TimeGenerator, partitions: Iterable[str] | str) -> dict[str, Any]:
    """Stop using and maintaining the metadata table `partitions` and delete their rows; returns
    {"dropped": partitions that were in use, "cancelled": pending indexing instants cancelled}.
    Run again, it finishes a drop that stopped part-way."""
    kinds = check_kinds(partitions)
    with clock.locked() as grant:
        states = read_states(storage, dropping=True)
        cancelled = [ti for ti, plan in pending_indexing(storage) if set(plan["partitions"]) & set(kinds)]
        for ti in cancelled:  # its run then fails to complete; other partitions it built stay building
            mark = {"instant": ti, "rolled_back_at": grant.time, "reason": f"dropped {', '.join(kinds)}"}
            grant.put_if_absent(storage, f"{TIMELINE_DIR}/{ti}.{INDEXING}.{ROLLEDBACK}", json.dumps(mark).encode())
        dropped = [k for k in kinds if k in states]
        # "dropping" until every row is deleted: removed now, a build scheduled before the
        # deletion would read the old markers, skip the instants they cover and become ready
        # with the gaps the deletion then leaves. Writers and readers leave it alone meanwhile.
        write_states(storage, grant, {**states, **{k: DROPPING for k in dropped}})
    for ti in cancelled:
        remove_pending_files(storage, ti, INDEXING)
    mdt = open_metadata_table(storage)
    if mdt is not None:
        for kind in kinds:  # one delete commit per partition: all its rows go at once
            delete_rows(mdt, kind, read_rows(mdt, kind, ("key",)).column("key"))
    if dropped:
        with clock.locked() as grant:
            states = read_states(storage, dropping=True)
            write_states(storage, grant, {k: v for k, v in states.items() if not (k in kinds and v == DROPPING)})
    return {"dropped": dropped, "cancelled": cancelled}


def index_state(storage: Storage) -> dict[str, Any]:
    """What `nbcc index URI` prints: each partition's state, the pending indexing instants."""
    return {"partitions": read_states(storage, dropping=True),
            "pending": [{"instant": ti, **plan} for ti, plan in pending_indexing(storage)],
            "metadata_table": metadata_storage(storage).uri}
