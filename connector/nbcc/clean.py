"""Cleaning: delete the files no read of the retained window needs.

The retained window starts at E, the completion time of the oldest of the last
`retain_commits` data commits, or of the last data commit that completed before the last
`retain_hours` hours (window_start). A file is kept if any read as of a time T >= E needs it:
since the table only changes when a commit completes, those are the snapshot and read-optimized
reads as of E and as of every completion time after it (and incremental reads, whose ranges then
hold only retained commits and read those files, format.md §12.7). Every input of a pending compaction plan is kept too
(Hudi #19290). Everything else that a commit listed is deleted, and so are orphans: files in the
partition folders whose instant is completed but which its commit does not list (a failed task
attempt, a compaction run that lost) or whose instant was rolled back.

A clean is an instant: `<Tcl>.clean.requested` holds the plan (E and the files), so readers stop
reading before E before anything is deleted; then the files are deleted; `<Tcl>_<c>.clean`
records what was deleted. Time travel before E, and incremental ranges that reach before it, are
then clear errors. A crashed clean is finished by the next one (deletes are idempotent).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from .clock import TimeGenerator, format_time
from .errors import CommitError
from .config import TableConfig, check_count, check_duration
from .filenames import data_file_path, parse_data_file
from .metadata_table import open_metadata_table, prune, upkeep
from .rollback import failed_writes, files_of_instants, partition_folders, rollback_failed_writes
from .scan import files_to_merge
from .storage import Storage
from .timeline import (
    CLEAN,
    DATA_ACTIONS,
    REQUESTED,
    TIMELINE_DIR,
    Instant,
    Timeline,
    committed_by,
    create_completed,
    earliest_retained,
    is_completed,
    read_cleans,
    read_compaction_plan,
    savepoint_times,
)
from .view import slices_by_group, table_view

DEFAULT_RETAIN_COMMITS = 10
log = logging.getLogger(__name__)


@dataclass
class CleanPlan:
    earliest_retained: str | None
    delete: list[tuple[str, str]] = field(default_factory=list)  # (partition, file name)
    savepoints: list[str] = field(default_factory=list)  # the states of the savepoint files (made or pending) it planned with
    data_commits: int = 0  # completed, which the commits policy counts


def files_of_state(storage: Storage, config: TableConfig, timeline: Timeline, when: str) -> set[tuple[str, str]]:
    """Every (partition, file) a snapshot or read-optimized read as of `when` opens."""
    view = table_view(storage, config, timeline, when)
    needed: set[tuple[str, str]] = set()
    for (partition, _), slices in slices_by_group(storage, view).items():
        for read_optimized in (False, True):
            needed.update((partition, name) for name in files_to_merge(slices, read_optimized,
                                                                         view.pending_compactions) or ())
    return needed


def needed_files(storage: Storage, config: TableConfig, timeline: Timeline, since: str,
                 savepoints: Iterable[str] = ()) -> set[tuple[str, str]]:
    """Every (partition, file) a read as of any time >= `since`, or as of a savepoint's state
    (`savepoints`), may open."""
    points = [since] + [i.completion for i in timeline.completed() if i.completion > since]
    needed: set[tuple[str, str]] = set()
    for point in points + [s for s in savepoints if s < since]:
        needed |= files_of_state(storage, config, timeline, point)
    for inst in timeline.pending():  # inputs of pending compactions (Hudi #19290)
        if inst.action == "compaction":
            for op in read_compaction_plan(storage, inst.instant)["operations"]:
                for name in ([op["base_file"]] if op["base_file"] else []) + op["log_files"]:
                    needed.add((op["partition"], name))
    return needed


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def check_retention(retain_commits: int | None, retain_hours: float | None) -> int | None:
    """`retain_commits` as the clean uses it: the default when no retention is given, else as
    given (None: the hours alone count). InvalidOptionError for a retention that is not one."""
    if retain_commits is None and retain_hours is None:
        return DEFAULT_RETAIN_COMMITS
    if retain_hours is not None:
        check_duration("retain_hours", retain_hours, "hours")
    return None if retain_commits is None else check_count("retain_commits", retain_commits, "data commits")


def window_start(data_commits: list[Instant], retain_commits: int | None, retain_hours: float | None,
                 now_ms: int) -> str | None:
    """Where the retained window starts for these policies: the completion time of the oldest
    data commit whose state a retained read needs; None if every commit is retained. The last
    `retain_commits` data commits, and reads as of any time in the last `retain_hours` (by this
    machine's clock; such a read needs the last commit that completed before the time). Given
    both, the window keeps what either needs."""
    starts = []
    if retain_commits is not None:
        if len(data_commits) <= retain_commits:
            return None
        starts.append(data_commits[-retain_commits].completion)
    if retain_hours is not None:
        cutoff = format_time(max(0, now_ms - round(retain_hours * 3_600_000)))
        before = [i.completion for i in data_commits if i.completion <= cutoff]
        if not before:
            return None
        starts.append(before[-1])
    return min(starts)


def plan_clean(storage: Storage, config: TableConfig, retain_commits: int | None = DEFAULT_RETAIN_COMMITS,
               timeline: Timeline | None = None, retain_hours: float | None = None,
               now_ms: int | None = None) -> CleanPlan:
    # A savepoint made after this listing is found by the run that deletes (kept_by_new_savepoints),
    # or finds this clean's plan itself (format.md §14.6).
    savepoints = savepoint_times(storage, pending=True)
    timeline = timeline or Timeline.load(storage)
    data_commits = [i for i in timeline.completed() if i.action in DATA_ACTIONS]
    view = table_view(storage, config, timeline, None)
    listed = {(f["partition"], f["name"]) for m in view.metas.values() for f in m.get("files", [])}
    # Files that earlier cleans deleted are gone already: do not delete or record them again.
    gone = {tuple(d) for i in timeline.completed() if i.action == CLEAN
            for d in view.metas[i.instant].get("deleted", [])}
    listed -= gone
    since = window_start(data_commits, retain_commits, retain_hours, _now_ms() if now_ms is None else now_ms)
    doomed: set[tuple[str, str]] = set()
    if since is not None:
        doomed = listed - needed_files(storage, config, timeline, since, savepoints)
    # Orphans (whatever the window): files on storage that no commit lists, of instants that
    # completed or were rolled back (failed task attempts, compaction runs that lost or crashed).
    states = {i.instant: i for i in timeline.instants}
    for part in partition_folders(storage, len(config.partition_by)):
        for name in storage.list_names(part):
            try:
                instant = parse_data_file(name).instant
            except ValueError:
                continue
            inst = states.get(instant)
            if inst is not None and inst.state in ("completed", "rolledback") and (part, name) not in listed:
                doomed.add((part, name))
    return CleanPlan(since, sorted(doomed), savepoints=savepoints, data_commits=len(data_commits))


def kept_by_new_savepoints(storage: Storage, config: TableConfig, planned_with: Iterable[str],
                           window: str | None) -> set[tuple[str, str]]:
    """The files a clean that planned with the savepoints `planned_with` must not delete after
    all: those of savepoints made since, of states before its `window`. Every run that deletes a
    clean's files asks just before it deletes (format.md §14.6)."""
    known = set(planned_with)
    new = [s for s in savepoint_times(storage, pending=True) if s not in known and window is not None and s < window]
    if not new:
        return set()
    timeline = Timeline.load(storage)
    return set().union(*(files_of_state(storage, config, timeline, s) for s in new))


def clean(storage: Storage, config: TableConfig, clock: TimeGenerator,
          retain_commits: int | None = None, heartbeat_timeout_s: float | None = None,
          progress: Callable[[int, int], None] | None = None, retain_hours: float | None = None,
          dry_run: bool = False) -> dict[str, Any]:
    """Roll back expired writes, then delete what the retained window does not need: that of
    the last `retain_commits` data commits (default 10), of reads as of the last `retain_hours`
    hours, or, given both, of either (window_start). Returns the clean's metadata (what was
    deleted; `earliest_retained`: where the window starts now, which an earlier clean may have
    put later than this one's policy would), `retain_commits_start`, where the window of this
    one's policy starts (None: it retains every commit), `data_commits`, how many it
    counted, and `rolled_back_files`, the (partition, file) pairs of the writes it rolled back
    that it deleted. `progress(done, total)` is called while deleting. `dry_run`: change nothing; the same result says what would be
    rolled back and deleted, and where the window would start (Delta's VACUUM DRY RUN)."""
    retain_commits = check_retention(retain_commits, retain_hours)
    timeout = config.heartbeat_timeout_s if heartbeat_timeout_s is None else heartbeat_timeout_s
    extra: dict[str, Any] = {}  # for the caller, not the clean's metadata: what else the run did, its plan
    # One load for the failed writes and the unfinished cleans: rolling writes back changes no
    # clean. Planning loads it again, to see the rollbacks.
    before = Timeline.load(storage)
    if dry_run:
        rolled_back = [failed.instant for failed in failed_writes(storage, timeout, before)]
        extra["rolled_back_files"] = sorted(map(list, files_of_instants(storage, len(config.partition_by),
                                                                        set(rolled_back))))
        unfinished = _pending_cleans(storage, before)
        extra["finished_cleans"] = _files_left(storage, config, unfinished)
    else:
        rolled_back_files = rollback_failed_writes(storage, clock, len(config.partition_by), timeout, before)
        rolled_back = list(rolled_back_files)
        extra["rolled_back_files"] = sorted(list(f) for files in rolled_back_files.values() for f in files)
        extra["finished_cleans"] = _finish_pending_cleans(storage, config, clock, before)
        unfinished = []
    timeline = Timeline.load(storage)
    plan = plan_clean(storage, config, retain_commits, timeline, retain_hours)
    # A dry run plans without what the unfinished cleans delete (once finished, their records say
    # it is gone): else it lists their files, those they deleted already among them.
    finishing = {tuple(d) for _, unfinished_plan in unfinished for d in unfinished_plan["delete"]}
    plan.delete = [d for d in plan.delete if d not in finishing]
    extra.update(retain_commits_start=plan.earliest_retained, data_commits=plan.data_commits)
    # The window never moves back: an earlier clean with fewer retained commits deleted what
    # reads before its window needed. (Readers take the greatest window of all cleans anyway.)
    current = earliest_retained(storage, timeline)
    window = max((w for w in (plan.earliest_retained, current) if w is not None), default=None)
    result: dict[str, Any] = {"action": CLEAN, "earliest_retained": window, **committed_by(),
                              "deleted": [], "rolled_back": rolled_back, "files": [], "savepoints": plan.savepoints}
    if dry_run:
        return {**result, "deleted": [list(d) for d in plan.delete], "dry_run": True, **extra}
    if not plan.delete and window == current:
        _index_in_step(storage)
        return {**result, **extra}  # nothing new: no clean instant
    instant = clock.new_instant()
    body = {"instant": instant, "earliest_retained": window, "delete": [list(d) for d in plan.delete],
            "savepoints": plan.savepoints}
    storage.put_if_absent(f"{TIMELINE_DIR}/{instant}.{CLEAN}.{REQUESTED}", json.dumps(body).encode())
    result.update(instant=instant, **_delete_planned(storage, config, body, progress))
    _complete_clean(storage, clock, instant, result)
    _remove_stale_heartbeats(storage)
    _index_in_step(storage)
    return {**result, **extra}


def _delete_planned(storage: Storage, config: TableConfig, plan: dict[str, Any],
                    progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Delete the files of a published clean plan (`<Tcl>.clean.requested`'s content), but for
    those of savepoints made since it was planned (format.md §14.3 step 4); the completed
    clean's `deleted` and, if any, `kept`."""
    kept = kept_by_new_savepoints(storage, config, plan.get("savepoints", []), plan["earliest_retained"])
    delete = [d for d in plan["delete"] if tuple(d) not in kept]
    storage.delete_many([data_file_path(part, name) for part, name in delete], progress)
    spared = [d for d in plan["delete"] if tuple(d) in kept]
    return {"deleted": delete, **({"kept": spared} if spared else {})}


def _index_in_step(storage: Storage) -> None:
    """Keep the metadata table in step (format.md §18.5, §18.7): forget every file a clean
    deleted and every rolled-back instant (this clean's deletes among them), index the
    instants it lacks, and tidy the metadata table itself up. Never fails the clean."""
    from .indexing import fill_gaps

    try:
        prune(storage)
    except Exception as exc:  # noqa: BLE001 - rows of deleted files are only dead weight
        log.warning("clean of %s: forgetting deleted files in the metadata table failed: %s", storage.uri, exc)
    try:
        fill_gaps(storage)
    except Exception as exc:  # noqa: BLE001 - the clean is done; readers are right without it
        log.warning("clean of %s: indexing instants the metadata table lacks failed: %s", storage.uri, exc)
    mdt = open_metadata_table(storage)
    if mdt is not None:
        upkeep(mdt, force=True)


def _complete_clean(storage: Storage, clock: TimeGenerator, instant: str, result: dict[str, Any]) -> None:
    """Record a clean whose deletes are done; another cleaner may have recorded it already."""
    try:
        with clock.locked() as grant:
            create_completed(storage, instant, grant, CLEAN, result)
    except CommitError:
        if not is_completed(storage, instant):
            raise
    storage.delete(f"{TIMELINE_DIR}/{instant}.{CLEAN}.{REQUESTED}")


def _remove_stale_heartbeats(storage: Storage) -> None:
    from .heartbeat import HEARTBEAT_DIR

    # Heartbeats first: a write puts its heartbeat only once its requested file is on the
    # timeline, so a later listing of the timeline has every write a listed heartbeat beats for.
    # The other order took a write that began between the two listings for gone, and deleted
    # the heartbeat it had just put.
    names = storage.list_names(HEARTBEAT_DIR)
    pending = {i.instant for i in Timeline.load(storage).pending()}
    storage.delete_many([f"{HEARTBEAT_DIR}/{name}" for name in names
                         if name.endswith(".json") and name[:-5] not in pending])


def _pending_cleans(storage: Storage, timeline: Timeline) -> list[tuple[Instant, dict[str, Any]]]:
    """The cleans that a crash left requested, with their plans."""
    return [(inst, plan) for inst, plan in read_cleans(storage, timeline) if not inst.is_completed]


def _finish_pending_cleans(storage: Storage, config: TableConfig, clock: TimeGenerator,
                           timeline: Timeline) -> list[dict[str, Any]]:
    """Complete cleans that a crash left requested (their deletes are idempotent), keeping the
    files of savepoints their plans did not know; each one's instant and the files it deleted
    (those a crashed run deleted already among them)."""
    finished = []
    for inst, plan in _pending_cleans(storage, timeline):
        result = {"action": CLEAN, "instant": inst.instant, "earliest_retained": plan["earliest_retained"],
                  **committed_by(), "rolled_back": [], "files": [], "savepoints": plan.get("savepoints", []),
                  **_delete_planned(storage, config, plan)}
        _complete_clean(storage, clock, inst.instant, result)
        _index_in_step(storage)
        finished.append({"instant": inst.instant, "deleted": result["deleted"]})
    return finished


def _files_left(storage: Storage, config: TableConfig, unfinished: list[tuple[Instant, dict[str, Any]]]
                ) -> list[dict[str, Any]]:
    """What `_finish_pending_cleans` would do with the `unfinished` cleans: each one's instant
    and the files of its plan still on storage that it would delete."""
    out = []
    for inst, plan in unfinished:
        kept = kept_by_new_savepoints(storage, config, plan.get("savepoints", []), plan["earliest_retained"])
        planned = [d for d in plan["delete"] if tuple(d) not in kept]
        present = {(part, name) for part in {d[0] for d in planned} for name in storage.list_names(part)}
        out.append({"instant": inst.instant, "deleted": [d for d in planned if tuple(d) in present]})
    return out
