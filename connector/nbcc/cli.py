"""The `nbcc` command: inspect an nbcc table and run its table services from a shell.

Usage:
    nbcc [--storage-option KEY=VALUE ...] COMMAND URI [options]

    nbcc describe URI [--json]              settings, columns, instants counted, how far back reads
                                            may go, what a snapshot read opens, metadata table
    nbcc timeline URI [--json]              every instant: instant, action, operation, state,
                                            completion time, and why a rolled-back one was
    nbcc history URI [--limit N] [--json]   what each completed instant did, latest first:
                                            operation, rows, files, bytes, partitions, parameters
    nbcc slices URI [--as-of T] [--json]    the file slices: per partition and file group, base
                                            instant, base file and log files (in log order)
    nbcc compact URI [--quiet] [--json]     finish the compactions scheduled earlier (by writes,
                                            or a crashed run), then schedule and run a new one
    nbcc compact URI --instant T            run (or finish) the scheduled compaction T
    nbcc compact URI --schedule-only        only schedule a compaction; prints its instant
    nbcc clean URI [--retain-commits N] [--retain-hours H] [--heartbeat-timeout-s S] [--dry-run] [--quiet]
                   [--json]
                                            roll back failed writes, delete the files no read of
                                            the last N data commits (or as of the last H hours)
                                            needs
    nbcc archive URI [--retain-commits N] [--json]
                                            move old instants into .nbcc/history/
    nbcc rollback URI INSTANT               roll back a write that did not complete
    nbcc restore URI --as-of T              make the table's rows those it had at T (one overwrite)
    nbcc delete URI --where "COL OP VALUE" [--where ...] [--dry-run]
                                            delete the records that match (one delete commit)
    nbcc delete-partitions URI --where "COL OP VALUE" [--where ...] [--dry-run]
                                            delete every row of the matching partitions (one
                                            commit, no files written)
    nbcc index URI                          the metadata table: each partition's state
    nbcc index URI --partitions files,column_stats,key_filters [--timeout S] [--quiet]
                                            build metadata table partitions while writers keep
                                            writing (resumes an indexing left pending)
    nbcc index URI --drop column_stats      stop using a partition and delete it
    nbcc --version

Times (T, INSTANT) are 17-digit instant times (yyyyMMddHHmmssSSS, UTC); `--as-of` also takes an
ISO-8601 timestamp. `--storage-option KEY=VALUE` (repeatable, before or after the command) passes
S3 options (those of s3fs.S3FileSystem), e.g.:

    nbcc timeline s3://bucket/table --storage-option endpoint_url=http://127.0.0.1:9000 \\
        --storage-option key=ACCESS_KEY --storage-option secret=SECRET_KEY

Progress bars go to stderr, only when it is a terminal (and not with --quiet). Errors print
`nbcc: error: <message>` to stderr and exit 1; bad usage exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Callable, Sequence

from . import __version__
from .clean import DEFAULT_RETAIN_COMMITS, check_retention
from .clock import parse_time, parse_time_option
from .compaction import compaction_to_run, executing_compactions, left_to_its_executor, run_compactions
from .conditions import parse_assignment, parse_conditions, typed_condition, typed_value, with_column_as_spelled
from .errors import InvalidOptionError, NbccError
from .indexing import DEFAULT_TIMEOUT_S
from .metadata_table import DROPPING, KINDS, check_kinds
from .rollback import failed_writes
from .scan import read_task
from .update import check_updates
from .storage_options import check_storage_options
from .table import Table
from .timeline import (
    COMPACTION,
    DATA_ACTIONS,
    HISTORY_DIR,
    ROLLEDBACK,
    Timeline,
    read_commit_metadata,
    read_commit_metadatas,
    read_rollback_marks,
)

PROG = "nbcc"


# -- output helpers ------------------------------------------------------------------------------

def _print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Aligned columns, two spaces apart; the last column is not padded."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    for row in [list(headers)] + [list(r) for r in rows]:
        cells = [c.ljust(w) for c, w in zip(row[:-1], widths[:-1])] + [row[-1]]
        print("  ".join(cells).rstrip())


def _print_json(obj: Any) -> int:
    print(json.dumps(obj, indent=2))
    return 0


class _Progress:
    """A `progress(done, total)` callback drawing a tqdm bar on stderr (created on first call)."""

    def __init__(self, desc: str, unit: str, enabled: bool):
        self.desc, self.unit, self.enabled = desc, unit, enabled
        self.bar: Any = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.desc, unit=self.unit, file=sys.stderr, leave=False,
                            dynamic_ncols=True)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _progress(args: argparse.Namespace, desc: str, unit: str) -> _Progress:
    enabled = not getattr(args, "quiet", False) and sys.stderr.isatty()
    return _Progress(desc, unit, enabled)


def _note(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr)


# -- commands ------------------------------------------------------------------------------------

def _open(args: argparse.Namespace) -> Table:
    return Table.open(args.uri, args.storage_options)


def _n(count: float, noun: str) -> str:
    number = f"{count:g}" if isinstance(count, float) else str(count)  # 168.0 hours: 168; 10**6 rows: all digits
    return f"{number} {noun}{'' if count == 1 else 's'}"


def _size(n: float) -> str:
    if n < 1024:
        return _n(int(n), "byte")
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def _earliest_begin(limits: dict[str, str] | None) -> str:
    if limits is None:
        return "earliest (no clean deleted a commit's changes)"
    if limits["cdc"] == limits["latest_state"]:
        return limits["cdc"]
    return f"{limits['latest_state']} (cdc, or a range with an overwrite: {limits['cdc']})"


def cmd_describe(args: argparse.Namespace) -> int:
    d = _open(args).describe()
    if args.json:
        _print_json(d)
        return 0

    def counts(by_state: dict[str, int]) -> str:
        return ", ".join(f"{n} {state}" for state, n in sorted(by_state.items()))

    latest = d["latest_commit"]
    fs = d["snapshot_read"]
    rows = [
        ["table", d["uri"]],
        ["format version", str(d["format_version"])],
        ["record key", ", ".join(d["record_key"])],
        ["ordering field", d["ordering_field"] or "-"],
        ["merge mode", d["merge_mode"]],
        ["partition by", ", ".join(d["partition_by"]) or "-"],
        ["buckets", f"{d['buckets']} per partition"],
        ["lock lease", f"{d['lock_lease_ms']} ms"],
        ["heartbeat timeout", f"{d['heartbeat_timeout_s']} s"],
    ]
    rows += [["columns" if n == 0 else "", f"{c['name']}  {c['type']}{'' if c['nullable'] else ' not null'}"]
             for n, c in enumerate(d["columns"])]
    rows += [["instants" if n == 0 else "", f"{action}: {counts(by_state)}"]
             for n, (action, by_state) in enumerate(sorted(d["instants"].items()))] or [["instants", "none"]]
    rows += [
        ["archived instants", str(d["archived_instants"])],
        ["latest data commit", f"{latest['instant']} {latest['action']}, completed {latest['completion']}" if latest else "-"],
    ]
    executing = {e["instant"]: e["idle_s"] for e in d["compactions_executing"]}
    rows += [["pending compactions" if n == 0 else "",
              tc + (f", being executed (last heartbeat {executing[tc]:g} s ago)" if tc in executing else "")]
             for n, tc in enumerate(d["pending_compactions"])] or [["pending compactions", "-"]]
    timeout = d["heartbeat_timeout_s"]
    rows += [["writes in flight" if n == 0 else "",
              f"{w['instant']} {w['action']}, last heartbeat {w['idle_s']:g} s ago"
              + (f" (past the {timeout} s timeout: the next clean rolls it back)" if w["idle_s"] > timeout else "")]
             for n, w in enumerate(d["writes_in_flight"])] or [["writes in flight", "-"]]
    rows += [
        ["oldest as_of", d["oldest_as_of"] or "- (no commit yet)"],
        ["savepoints", ", ".join(d["savepoints"]) or "-"],
        ["earliest begin", _earliest_begin(d["earliest_begin"])],
        ["snapshot read", f"{_n(fs['file_groups'], 'file group')}"
                          f"{' in ' + _n(fs['partitions'], 'partition') if d['partition_by'] else ''}: "
                          f"{_n(fs['base_files'], 'base file')}, {_n(fs['log_files'], 'log file')}, "
                          f"{_size(fs['bytes'])}"],
        ["metadata table", ", ".join(f"{k} {v}" for k, v in sorted(d["metadata_table"].items())) or "-"],
    ]
    _print_table(["PROPERTY", "VALUE"], rows)
    return 0


def cmd_timeline(args: argparse.Namespace) -> int:
    table = _open(args)
    timeline = Timeline.load(table.storage)
    # What each completed instant did (an overwrite and a partition deletion are both
    # replacepartitions): from its commit metadata, cached, 10 at a time on S3; the archived
    # ones' from the history already read. Pending instants have none.
    metas = read_commit_metadatas(table.storage, timeline.completed())
    # A clean's and an index build's metadata name no operation: the action says it (as in history).
    operation = {i.instant: metas[i.instant].get("operation") or i.action for i in timeline.completed()}
    instants = timeline.instants
    marks = read_rollback_marks(table.storage, instants)  # when and why each rolled-back write was
    if args.json:
        _print_json([{"instant": i.instant, "action": i.action, "operation": operation.get(i.instant),
                      "state": i.state, "completion": i.completion, "archived": i.archived,
                      "rolled_back_at": marks.get(i.instant, {}).get("rolled_back_at"),
                      "reason": marks.get(i.instant, {}).get("reason") or None} for i in instants])
        return 0
    _print_table(["INSTANT", "ACTION", "OPERATION", "STATE", "COMPLETION", "NOTE"],
                 [[i.instant, i.action, operation.get(i.instant) or "-", i.state, i.completion or "-",
                   _rollback_note(marks[i.instant]) if i.instant in marks else "-"] for i in instants])
    return 0


def _rollback_note(mark: dict[str, Any]) -> str:
    """What `nbcc timeline` says of a rolled-back write: when, and why."""
    when, why = mark.get("rolled_back_at"), mark.get("reason")
    return "rolled back" + (f" at {when}" if when else "") + (f": {why}" if why else "")


def cmd_history(args: argparse.Namespace) -> int:
    table = _open(args)
    commits = table.history(args.limit)
    if args.json:
        _print_json([c.to_dict() for c in commits])
        return 0

    def value(v: Any) -> str:  # on one line, and never mistaken for the separator
        text = v if isinstance(v, str) else json.dumps(v)
        return json.dumps(text) if "; " in text or not text.isprintable() else text

    def parameters(c: Any) -> str:  # the partitions replaced are in PARTITIONS already
        return "; ".join(f"{k}={value(v)}"
                         for k, v in c.parameters.items() if k != "replaced_partitions" and v != []) or "-"

    def number(n: int | None) -> str:
        return "-" if n is None else str(n)

    def partitions(c: Any) -> str:  # "-": the table has none; "all": every one was replaced
        return "-" if not table.config.partition_by else "all" if c.replaces_table else str(len(c.partitions))

    def by(c: Any) -> str:
        return "@".join(p for p in (c.user, c.host) if p) or "-"

    _print_table(["COMPLETION", "INSTANT", "ACTION", "OPERATION", "ROWS", "FILES", "BYTES", "PARTITIONS", "BY",
                  "PARAMETERS"],
                 [[c.completion, c.instant, c.action, c.operation, number(c.rows), str(c.files), number(c.bytes),
                   partitions(c), by(c), parameters(c)] for c in commits])
    return 0


def cmd_slices(args: argparse.Namespace) -> int:
    table = _open(args)
    slices = table._file_slices(args.as_of, "--as-of")
    if args.json:
        _print_json([{"partition": s.partition, "file_group": s.file_group_id, "base_instant": s.base_instant,
                      "base_file": s.base_file, "log_files": list(s.log_files)} for s in slices])
        return 0
    rows = []
    for s in slices:
        logs = list(s.log_files) or ["-"]
        rows.append([s.partition or "-", s.file_group_id, s.base_instant, s.base_file or "-", logs[0]])
        rows.extend(["", "", "", "", name] for name in logs[1:])
    _print_table(["PARTITION", "FILE GROUP", "BASE INSTANT", "BASE FILE", "LOG FILES"], rows)
    return 0


def _run_compaction(table: Table, args: argparse.Namespace, tc: str) -> str | None:
    with _progress(args, f"compaction {tc}", "file group") as progress:
        return table.run_compaction(tc, progress, parallelism=args.parallelism)


def cmd_compact(args: argparse.Namespace) -> int:
    table = _open(args)
    # --json: what ran, for schedulers (each compaction: its instant, its completion time or None
    # if another run completed it meanwhile, and whether an earlier run had left it pending).
    ran: list[dict[str, Any]] = []
    say = _quiet_if(args.json)
    if args.schedule_only:
        if args.parallelism is not None:
            raise InvalidOptionError("--parallelism is for running compactions; --schedule-only runs none")
        tc = table.schedule_compaction()
        pending = [p for p in table.pending_compactions() if p != tc]  # left by earlier runs, or running
        if args.json:
            _print_json({"scheduled": tc, "pending": pending})
        elif tc is not None:
            print(tc)
        elif not pending:
            print("nothing to compact")
        else:  # nothing new to plan because the file groups with log files are planned already
            same = " (with the same --storage-option flags)" if args.storage_options else ""
            if len(pending) == 1:
                print(f"nothing new to compact: compaction {pending[0]} is pending; run it with "
                      f"`nbcc compact {table.uri} --instant {pending[0]}`{same}")
            else:
                print(f"nothing new to compact: compactions {', '.join(pending)} are pending; run them with "
                      f"`nbcc compact {table.uri}`{same}")
        return 0
    timeout = table.config.heartbeat_timeout_s
    if args.instant is not None:
        inst = compaction_to_run(table.storage, args.instant, "--instant")
        tc = inst.instant
        if inst.is_completed:
            say(f"compaction {tc} is already completed (at {inst.completion})")
            ran.append({"instant": tc, "completion": inst.completion, "ran": False, "was_pending": False})
        else:  # scheduled earlier (--schedule-only, or a run that stopped): pending until this run
            busy = executing_compactions(table.storage, [tc], timeout)
            if tc in busy:  # run as asked (its process may be gone): the first to complete wins
                _note(f"warning: compaction {tc} has an execution whose last heartbeat is {busy[tc]:.0f} s old; "
                      "running it here too, as --instant asks (if that process is alive, the same work is done twice)")
            ran.append(_run_and_tell(table, args, tc, say, was_pending=True, told="compaction"))
        return _print_json({"compactions": ran}) if args.json else 0

    def run(tc: str, earlier: bool) -> dict[str, Any]:
        if earlier:
            _note(f"compaction {tc} is pending (scheduled by a write's compaction_delta_commits or --schedule-only, "
                  "or left by a run that failed or crashed); finishing it")
        return _run_and_tell(table, args, tc, say, was_pending=earlier,
                             told="pending compaction" if earlier else "compaction")

    elsewhere: list[dict[str, Any]] = []

    def leave(tc: str, idle_s: float) -> None:
        elsewhere.append({"instant": tc, "idle_s": round(idle_s, 1)})
        say(left_to_its_executor(table.uri, tc, idle_s, timeout,
                                 "(with the same --storage-option flags)" if args.storage_options else ""))

    ran = run_compactions(table.storage, table.config, table.clock, run, leave)
    if not ran and not elsewhere:
        say("nothing to compact")
    return _print_json({"compactions": ran, "executing_elsewhere": elsewhere}) if args.json else 0


def _run_and_tell(table: Table, args: argparse.Namespace, tc: str, say: Callable[[str], None], *,
                  was_pending: bool, told: str) -> dict[str, Any]:
    """Run compaction `tc`, say how it ended, and return what --json reports of it."""
    done = _run_compaction(table, args, tc)
    if done is None:
        say(f"{told} {tc} was completed meanwhile by another run")
    elif told.startswith("pending"):  # one an earlier run left
        say(f"finished {told} {tc}, completed at {done}")
    else:
        say(f"{told} {tc} completed at {done}")
    return {"instant": tc, "completion": done, "ran": done is not None, "was_pending": was_pending}


def _quiet_if(json_wanted: bool) -> Callable[[str], None]:
    """`print`, or nothing where --json prints one document at the end instead."""
    return (lambda text: None) if json_wanted else print


def cmd_clean(args: argparse.Namespace) -> int:
    table = _open(args)
    timeout = args.heartbeat_timeout_s
    if timeout is not None and timeout < table.config.heartbeat_timeout_s:
        # Allowed: an operator may know the writers are dead; but a live write is rolled back too.
        _note(f"warning: --heartbeat-timeout-s {timeout:g} is below the table's heartbeat_timeout_s "
              f"({table.config.heartbeat_timeout_s} s): writes still running whose heartbeat is older than "
              f"{timeout:g} s are rolled back, and will fail to commit")
    commits = check_retention(args.retain_commits, args.retain_hours)
    with _progress(args, "deleting", "file") as progress:
        result = table.clean(commits, timeout, progress, retain_hours=args.retain_hours, dry_run=args.dry_run)
    if args.json:  # what Table.clean returns
        return _print_json(result)
    rolled_back = result.get("rolled_back") or []
    print(f"{'would roll back' if args.dry_run else 'rolled back'} failed writes: "
          f"{', '.join(rolled_back) if rolled_back else 'none'}")
    if args.dry_run and result.get("rolled_back_files"):
        _print_files(f"{_n(len(result['rolled_back_files']), 'file')} of theirs would be deleted:",
                     result["rolled_back_files"])
    elif rolled_back:
        print(f"deleted {_n(len(result['rolled_back_files']), 'file')} of theirs")
    for finished in result.get("finished_cleans", []):  # a clean that a crash cut short, finished first
        what = f"clean {finished['instant']}, which an earlier run began and did not finish"
        if args.dry_run:
            _print_files(f"would finish {what}: {_n(len(finished['deleted']), 'file')} of its plan would be "
                         f"deleted{':' if finished['deleted'] else ''}", finished["deleted"])
        else:
            print(f"finished {what}: {_n(len(finished['deleted']), 'file')} of its plan deleted (by it or this run)")
    hours = None if args.retain_hours is None else _n(args.retain_hours, "hour")
    policy = " or ".join(([f"the last {commits} data commits"] if commits else [])
                         + ([f"the last {hours}"] if hours else []))
    # Why this clean's policy retains every commit: one of its policies does (given both, the
    # window keeps what either needs).
    few = commits and result["data_commits"] <= commits
    everything = (f"the table has {commits} or fewer data commits" if few or not hours
                  else f"no data commit completed more than {hours} ago")
    start = result.get("retain_commits_start")
    starts = "would start" if args.dry_run else "starts"
    if result.get("earliest_retained") is None:
        # Orphans (files no commit lists) are deleted all the same.
        print(f"no retained window yet: {everything}")
    elif result["earliest_retained"] == start:
        print(f"retained window {starts} at {result['earliest_retained']} ({policy})")
    else:  # a clean never moves the window back: what reads before it needed is gone
        if not start:
            why = everything
        elif args.retain_hours is None:
            why = f"the last {commits} data commits start at {start}"
        else:
            why = f"reads of {policy} need the commits from {start} on"
        print(f"retained window {starts} at {result['earliest_retained']}, where an earlier clean put it "
              f"({why}, but files that reads before the window needed were deleted)")
    before = [s for s in result.get("savepoints", []) if result["earliest_retained"] and s < result["earliest_retained"]]
    if before:  # their states stay readable: the clean keeps their files
        print(f"{'would keep' if args.dry_run else 'kept'} the files of the states of savepoint(s) {', '.join(before)}")
    deleted = result.get("deleted") or []
    if not args.dry_run:
        print(f"deleted {_n(len(deleted), 'more file' if rolled_back else 'file')}")
        return 0
    _print_files(f"{_n(len(deleted), 'file')} would be deleted{':' if deleted else ''}", deleted)
    return 0


def _print_files(heading: str, files: list[list[str]]) -> None:
    """`heading`, then each (partition, name) of `files` as a path, indented."""
    print(heading)
    for partition, name in files:
        print(f"  {partition}/{name}" if partition else f"  {name}")


def cmd_archive(args: argparse.Namespace) -> int:
    table = _open(args)
    result = table.archive(args.retain_commits)
    if args.json:  # what Table.archive returns
        return _print_json(result)
    n = result.get("archived", 0)
    if result.get("finished"):
        print(f"finished an earlier archival that did not finish: removed {_n(result['finished'], 'instant')} "
              "already in the history from the active timeline")
    if not n:
        print(f"nothing {'else ' if result.get('finished') else ''}to archive: no completed instant is older "
              "than the retained window")
        return 0
    print(f"archived {_n(n, 'instant')} into {table.uri}/{HISTORY_DIR}/{result['file']}")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    table = _open(args)
    instant = args.instant
    timeline = Timeline.load(table.storage)
    inst = timeline.get(instant)
    if inst is None:
        raise InvalidOptionError(f"no instant {instant} on the timeline of {table.uri}; `nbcc timeline` lists them")
    if inst.is_completed:
        raise InvalidOptionError(
            f"instant {instant} ({inst.action}) completed at {inst.completion}; only a write that did not "
            "complete can be rolled back")
    if inst.action not in DATA_ACTIONS:
        hint = (f"; finish it with `nbcc compact {table.uri} --instant {instant}`" if inst.action == COMPACTION
                else "")
        raise InvalidOptionError(f"instant {instant} is a {inst.state} {inst.action}, not a write{hint}")
    was = inst.state
    if was != ROLLEDBACK:
        expired = {f.instant for f in failed_writes(table.storage, table.config.heartbeat_timeout_s, timeline)}
        if instant not in expired:
            _note(f"warning: write {instant} started or had a heartbeat within the last "
                  f"{table.config.heartbeat_timeout_s} s; if its writer is still running, its commit will now fail")
    if not table.rollback(instant):
        raise NbccError(f"instant {instant} completed while rolling back; it was not rolled back")
    print(f"write {instant} was already rolled back; its leftover files are removed" if was == ROLLEDBACK
          else f"rolled back {inst.action} {instant} (was {was})")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    table = _open(args)
    instant = table.restore(args.as_of)
    done, meta = _completed(table, instant)
    rows = sum(int(f.get("rows", 0)) for f in meta["files"])
    print(f"restored {table.uri} as of {args.as_of}: {_n(rows, 'row')}, written by overwrite {instant} "
          f"(completed at {done.completion}). The commits in between stay readable with as_of until a "
          "clean passes them")
    return 0


def cmd_savepoint(args: argparse.Namespace) -> int:
    table = _open(args)
    state = table.savepoint(args.as_of, user_metadata=args.user_metadata)
    if args.json:
        made = [k for k in table.savepoints() if k["as_of"] == state and k["confirmed"]]  # not a cut-short one
        return _print_json(made[-1] if made else {"as_of": state, "confirmed": True})
    # The time alone on stdout, for a script to pass on (SP=$(nbcc savepoint ...)).
    _note(f"the state as of {state} stays readable (as_of, restore) whatever the cleaner's window, "
          f"until `{PROG} delete-savepoint {table.uri} {state}`")
    print(state)
    return 0


def cmd_savepoints(args: argparse.Namespace) -> int:
    kept = _open(args).savepoints()
    if args.json:
        _print_json(kept)
        return 0
    _print_table(["SAVEPOINT", "CREATED", "STATE", "BY", "USER_METADATA"],
                 [[k["as_of"], k["created"], "kept" if k["confirmed"] else "pending",
                   "@".join(filter(None, (k.get("user"), k.get("host")))) or "-", k.get("user_metadata") or "-"]
                  for k in kept])
    return 0


def cmd_delete_savepoint(args: argparse.Namespace) -> int:
    table = _open(args)
    if not table.delete_savepoint(args.savepoint, pending=args.pending):
        print(f"{PROG}: error: {table.uri} has no savepoint {args.savepoint} (`{PROG} savepoints` lists them)",
              file=sys.stderr)
        return 1
    print(f"deleted savepoint {args.savepoint}: a later clean may delete the files only it kept")
    return 0


_CONDITION_HELP = ("'COL OP VALUE' (OP: = == != <> < <= > >=), 'COL in V1,V2', 'COL not in V1,V2' or 'COL is "
                   "[not] null' (COL in any letter case, in backticks if it holds spaces: `order day`); values in the column's type (dates 2026-11-20, timestamps 2026-11-20T10:00:00Z, "
                   "UTC without a zone; true/false), quoted if they hold commas or quotes; as in SQL, a null "
                   "matches only 'is null'")


def _add_conditions(parser: argparse.ArgumentParser, what: str, dry_run: str) -> None:
    """The options of the commands that delete what matches: --where (repeatable), --dry-run."""
    parser.add_argument("--where", metavar="CONDITION", type=_where, action="append", required=True,
                        help=f"{what}: {_CONDITION_HELP}; join conditions with AND, or repeat --where, to require all")
    parser.add_argument("--dry-run", action="store_true", help=dry_run)


def _where(text: str) -> list[tuple[Any, ...]]:
    try:
        return parse_conditions(text)
    except InvalidOptionError as exc:  # bad usage: exits 2 with the usage line
        raise argparse.ArgumentTypeError(str(exc)) from None


def _assignment(text: str) -> tuple[str, str | None]:
    try:
        return parse_assignment(text)
    except InvalidOptionError as exc:  # bad usage: exits 2 with the usage line
        raise argparse.ArgumentTypeError(str(exc)) from None


def _conditions(table: Table, args: argparse.Namespace) -> list[Any]:
    """The `--where` conditions as a filter, their values in their columns' types."""
    schema = table.schema()
    return [typed_condition(with_column_as_spelled(item, schema), schema) for given in args.where for item in given]


def _completed(table: Table, instant: str) -> tuple[Any, dict[str, Any]]:
    """The instant a command just wrote, and its commit metadata."""
    done = Timeline.load(table.storage).get(instant)
    return done, read_commit_metadata(table.storage, done)


def _count_matching(table: Table, where: list[Any]) -> int:
    """How many records match `where` (what a --dry-run prints)."""
    plan = table.plan(filter=where)
    return sum(read_task(table.storage, plan, task).num_rows for task in plan.tasks)


def _report_records(table: Table, instant: str | None, done: str) -> int:
    """Print what a delete or an update (`done`: its past tense) wrote, or that it wrote nothing."""
    if instant is None:
        print(f"no record of {table.uri} matches; nothing was written")
        return 0
    completed, meta = _completed(table, instant)
    print(f"{done} {_n(meta['rows'], 'record')} of {table.uri} with commit {instant} (completed at "
          f"{completed.completion})")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    table = _open(args)
    where = _conditions(table, args)
    if args.dry_run:
        print(f"would delete {_n(_count_matching(table, where), 'record')}")
        return 0
    return _report_records(table, table.delete(where), "deleted")


def cmd_update(args: argparse.Namespace) -> int:
    table = _open(args)
    where = _conditions(table, args)
    schema = table.schema()
    updates = dict(typed_value(column, text, schema) for column, text in args.set)
    if len(updates) < len(args.set):
        raise InvalidOptionError("--set names a column more than once; give each column one value")
    if args.dry_run:
        check_updates(updates, schema, table.config)
        print(f"would update {_n(_count_matching(table, where), 'record')}")
        return 0
    return _report_records(table, table.update(updates, where), "updated")


def cmd_delete_partitions(args: argparse.Namespace) -> int:
    table = _open(args)
    where = _conditions(table, args)
    if args.dry_run:
        matched = table.partitions(where)
        print(f"would delete {_n(len(matched), 'partition')}" + "".join(f"\n  {p}" for p in matched))
        return 0
    instant = table.delete_partitions(where)
    if instant is None:
        print(f"no partition of {table.uri} matches; nothing was written")
        return 0
    done, meta = _completed(table, instant)
    deleted = meta["replaced_partitions"]
    print(f"deleted {_n(len(deleted), 'partition')} of {table.uri} with commit {instant} (completed at "
          f"{done.completion}); their files stay readable with as_of until a clean deletes them"
          + "".join(f"\n  {p}" for p in deleted))
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    table = _open(args)
    if args.drop is not None:
        result = table.drop_index(check_kinds(args.drop))
        dropped = result["dropped"]
        print(f"dropped: {', '.join(dropped)}" if dropped else "nothing to drop: none of them was in use")
        if result["cancelled"]:
            print(f"cancelled pending indexing: {', '.join(result['cancelled'])}")
    elif args.partitions is not None:
        kinds = check_kinds(args.partitions)
        timeout = DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout
        with _progress(args, "indexing", "chunk") as progress:
            result = table.build_index(kinds, timeout, progress)
        built = ", ".join(result["instants"]) or "none needed"
        print(f"indexing instants run: {built}")
    state = table.index_state()
    parts = state["partitions"]
    _print_table(["PARTITION", "STATE"], [[k, parts.get(k, "-")] for k in KINDS])
    for p in state["pending"]:
        print(f"pending indexing {p['instant']}: {', '.join(p['partitions'])} (re-run `nbcc index` with "
              "--partitions to resume it)")
    dropping = [k for k in KINDS if parts.get(k) == DROPPING]
    if dropping:
        same = " with the same --storage-option flags" if args.storage_options else ""
        print(f"dropping: {', '.join(dropping)} (a drop that is running, or stopped part-way: finish it with "
              f"`nbcc index {table.uri} --drop {','.join(dropping)}`{same}, then build again if wanted)")
    return 0


# -- the parser ----------------------------------------------------------------------------------

def _storage_option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _instant(text: str) -> str:
    """INSTANT and --instant: an instant time exactly as `nbcc timeline` prints it. (An ISO-8601
    time is not taken: it names a millisecond that no instant of the table need have.)"""
    try:
        parse_time(text.strip())
    except (InvalidOptionError, ValueError):
        raise argparse.ArgumentTypeError(f"expected an instant time, the 17 digits yyyyMMddHHmmssSSS that "
                                         f"`nbcc timeline` prints; got {text!r}") from None
    return text.strip()


def _time(text: str) -> str:
    """--as-of: an instant time, or an ISO-8601 time (UTC if it has no zone)."""
    try:
        return parse_time_option(text, "T")
    except InvalidOptionError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("T=")) from None


def _duration(unit: str, examples: str) -> Callable[[str], float]:
    """An argument type for a finite number of `unit`s, 0 or more. float() takes nan and inf too,
    with which no heartbeat ever counts as expired and no commit as old enough (nan compares
    false with everything): `clean` then silently did nothing."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise argparse.ArgumentTypeError(f"expected a number of {unit}, 0 or more (e.g. {examples}), got {text!r}")
        return value
    return parse


_seconds = _duration("seconds", "30 or 2.5")
_hours = _duration("hours", "168 or 0.5")


_STORAGE_HELP = ("an S3 storage option (one of s3fs.S3FileSystem's), e.g. endpoint_url=http://host:9000, "
                 "key=..., secret=... for S3 (repeatable)")


def _check_index_usage(args: argparse.Namespace) -> str | None:
    """What is wrong with `nbcc index`'s options that argparse cannot tell, if anything."""
    if args.partitions is None:
        given = [name for name, value in (("--timeout", args.timeout), ("-q/--quiet", args.quiet or None))
                 if value is not None]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            return f"{' and '.join(given)} {verb} only with --partitions (building partitions)"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Inspect an nbcc table and run its table services (compaction, cleaning, "
                               "archival, rollback of failed writes).",
        epilog="Times are 17-digit instant times (yyyyMMddHHmmssSSS, UTC); --as-of also takes an ISO-8601 "
               "timestamp (UTC if it has no zone). Run `nbcc COMMAND -h` for a command's options.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--storage-option", dest="storage_options_global", action="append", default=[],
                        type=_storage_option, metavar="KEY=VALUE", help=_STORAGE_HELP)

    # The same option after the command (argparse keeps a subcommand's values apart).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--storage-option", dest="storage_options_sub", action="append", default=[],
                        type=_storage_option, metavar="KEY=VALUE", help=_STORAGE_HELP)
    common.add_argument("uri", metavar="URI", help="the table's location: a local path, file://, s3://")

    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("describe", parents=[common], help="the table's settings, columns and state at a glance",
                       description="Show the table's settings (record key, ordering field, merge mode, partition "
                                   "columns, buckets, lock lease, heartbeat timeout), its columns now, its instants "
                                   "counted by action and state, its latest commit and pending compactions, the "
                                   "writes in flight (with how long since each one's last heartbeat), the "
                                   "oldest as_of and earliest incremental begin that reads may use, the "
                                   "savepoints, what a "
                                   "snapshot read opens (file groups, base and log files, bytes) and the metadata "
                                   "table's partitions.")
    p.add_argument("--json", action="store_true", help="print a JSON object instead")
    p.set_defaults(func=cmd_describe)

    p = sub.add_parser("timeline", parents=[common], help="list the instants, oldest first",
                       description="List every instant (archived ones too), oldest first: instant, action, "
                                   "operation (upsert, delete, overwrite, delete_partition, compact, clean, ...; "
                                   "'-' if not completed), state, completion time ('-' if not completed) and a note: "
                                   "when and why a write was rolled back.")
    p.add_argument("--json", action="store_true", help="print a JSON list instead")
    p.set_defaults(func=cmd_timeline)

    p = sub.add_parser("history", parents=[common], help="what each completed instant did, latest first",
                       description="List the completed instants (archived ones too), latest completion first "
                                   "(Delta's DESCRIBE HISTORY): completion time, instant, action, operation, rows "
                                   "written (a delete: the keys it names), data files written (a clean: files "
                                   "deleted), bytes, how many partitions it wrote to or replaced ('all' for a "
                                   "replacecommit), the user@host that completed it, and how it was asked for "
                                   "(user_metadata, replace_where, condition, restored_as_of, stream_id and "
                                   "batch_id, ...). --json gives the partitions by name.")
    p.add_argument("--limit", type=_positive_int, metavar="N", help="only the latest N")
    p.add_argument("--json", action="store_true", help="print a JSON list instead")
    p.set_defaults(func=cmd_history)

    p = sub.add_parser("slices", parents=[common], help="list the file groups and their latest slices",
                       description="List the latest file slice of every file group: partition, file group, "
                                   "base instant, base file ('-' if none) and log files in log order.")
    p.add_argument("--as-of", metavar="T", type=_time, help="the slices as of time T (instant time or ISO-8601)")
    p.add_argument("--json", action="store_true", help="print a JSON list instead")
    p.set_defaults(func=cmd_slices)

    p = sub.add_parser("compact", parents=[common], help="schedule and run a compaction",
                       description="Schedule a compaction of every file group with log files and run it "
                                   "in this process; writers keep writing. Compactions scheduled earlier "
                                   "(by writes' compaction_delta_commits, by --schedule-only, or left "
                                   "unfinished by a run that crashed) are finished first; one that another "
                                   "process is executing (a fresh heartbeat) is left to it.")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--instant", metavar="T", type=_instant,
                       help="run (or finish) the scheduled compaction T only, even if another process "
                            "seems to execute it (after a kill, say)")
    which.add_argument("--schedule-only", action="store_true",
                       help="only schedule; print the compaction's instant (run it later with --instant)")
    p.add_argument("--parallelism", metavar="N", type=_positive_int,
                   help="file groups merged at once (default: one per CPU, at most 4); each holds its own merge's "
                        "memory, so a lower N lowers the peak")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true",
                   help="print a JSON object instead: compactions (each: instant, completion, ran, was_pending: "
                        "scheduled before this run), executing_elsewhere (each: instant, idle_s: seconds since "
                        "its last heartbeat); with --schedule-only: scheduled, pending (the others)")
    p.set_defaults(func=cmd_compact)

    p = sub.add_parser("clean", parents=[common], help="roll back failed writes and delete unneeded files",
                       description="Roll back writes whose heartbeat expired, then delete the files that no "
                                   "read of the last N data commits needs, or no read as of a time in the last "
                                   "H hours (given both: what either needs is kept). Time travel to before "
                                   "that window fails afterwards.")
    p.add_argument("--retain-commits", type=_positive_int, default=None, metavar="N",
                   help=f"data commits whose reads stay possible (default {DEFAULT_RETAIN_COMMITS}, "
                        "unless --retain-hours is given)")
    p.add_argument("--retain-hours", type=_hours, default=None, metavar="H",
                   help="keep reads as of any time in the last H hours possible (by this machine's clock), "
                        "e.g. 168 for a week")
    p.add_argument("--heartbeat-timeout-s", type=_seconds, default=None, metavar="S",
                   help="roll back writes without a heartbeat for S seconds (default: the table's "
                        "heartbeat_timeout_s; a shorter one also rolls back writes still running)")
    p.add_argument("--dry-run", action="store_true",
                   help="change nothing: list the writes it would roll back and the files it would delete")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true",
                   help="print what Table.clean returns as a JSON object instead: rolled_back, deleted "
                        "([partition, file] pairs), earliest_retained, finished_cleans, ...")
    p.set_defaults(func=cmd_clean)

    p = sub.add_parser("archive", parents=[common], help="move old instants into .nbcc/history/",
                       description="Move completed instants older than the retained window (the cleaner's, "
                                   "or else the last N data commits) into .nbcc/history/. Reads are "
                                   "unchanged; `nbcc timeline` still lists them.")
    p.add_argument("--retain-commits", type=_positive_int, default=DEFAULT_RETAIN_COMMITS, metavar="N",
                   help=f"data commits kept on the active timeline if the table was never cleaned "
                        f"(default {DEFAULT_RETAIN_COMMITS})")
    p.add_argument("--json", action="store_true",
                   help="print a JSON object instead: archived (how many instants), file (the history file or "
                        "null), finished (how many instants of an earlier archival it finished)")
    p.set_defaults(func=cmd_archive)

    p = sub.add_parser("rollback", parents=[common], help="roll back a write that did not complete",
                       description="Roll back a write that did not complete: its files are deleted and "
                                   "its instant is marked rolled back.")
    p.add_argument("instant", metavar="INSTANT", type=_instant, help="the write's instant time")
    p.set_defaults(func=cmd_rollback)

    p = sub.add_parser("restore", parents=[common], help="make the table's rows those it had at a time",
                       description="Make the table's rows those a read as of time T gives, with one "
                                   "overwrite commit (undoes bad writes). Nothing is deleted: the commits "
                                   "after T stay on the timeline, readable with as_of until a clean passes "
                                   "them, and writes that complete after the restore merge with its rows.")
    p.add_argument("--as-of", metavar="T", type=_time, required=True,
                   help="the time to restore (instant time or ISO-8601)")
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser("savepoint", parents=[common], help="keep a state readable whatever the cleaner's window",
                       description="Keep the table's state as of a time (default: now) readable with as_of and "
                                   "restore until the savepoint is deleted, whatever the cleaner's window "
                                   "(Hudi's savepoints, Iceberg's tags): cleans keep its files. A state before "
                                   "the cleaner's window is refused. Prints the savepoint's time (what to give "
                                   "as_of and delete-savepoint).")
    p.add_argument("--as-of", metavar="T", type=_time, help="the state to keep (instant time or ISO-8601); "
                                                             "default: the latest")
    p.add_argument("--user-metadata", metavar="TEXT", help="why it is kept (shown by savepoints)")
    p.add_argument("--json", action="store_true", help="print the savepoint as `savepoints --json` lists it")
    p.set_defaults(func=cmd_savepoint)

    p = sub.add_parser("savepoints", parents=[common], help="list the savepoints",
                       description="List the savepoints, oldest first: the savepoint's time (read it with as_of), "
                                   "when it was made, its state (kept; pending while it is being made, or if its "
                                   "making was cut short: cleans keep its files until it is deleted), by whom, "
                                   "and its user metadata.")
    p.add_argument("--json", action="store_true", help="print a JSON list instead")
    p.set_defaults(func=cmd_savepoints)

    p = sub.add_parser("delete-savepoint", parents=[common], help="stop keeping a savepoint's state",
                       description="Delete a savepoint: the next clean may delete the files only it kept, and "
                                   "reads as of its time before the cleaner's window are refused again.")
    p.add_argument("savepoint", metavar="SAVEPOINT", type=_time, help="the savepoint's time (nbcc savepoints)")
    p.add_argument("--pending", action="store_true",
                   help="also delete its pending files (left by a making cut short); only when no process is "
                        "making it: a running maker's pending file keeps the state until its savepoint is made")
    p.set_defaults(func=cmd_delete_savepoint)

    p = sub.add_parser("delete", parents=[common], help="delete the records that match (SQL's DELETE ... WHERE)",
                       description="Delete the records whose values match every --where (any columns), with one "
                                   "delete commit of their keys. Records that a concurrent write makes match "
                                   "while it runs are kept. The deleted versions stay readable with as_of until "
                                   "a compaction and a clean pass them.")
    _add_conditions(p, "a condition", "only print how many records would be deleted")
    p.set_defaults(func=cmd_delete)

    p = sub.add_parser("update", parents=[common], help="set columns of the records that match (SQL's UPDATE)",
                       description="Set columns of the records whose values match every --where (any columns) "
                                   "to new values, with one upsert commit of those records. A concurrent write to "
                                   "them is ordered against it as any two writes are (README: merge modes). "
                                   "Record-key and partition columns are not set, nor the ordering field of an "
                                   "event_time or partial_update table; in a partial_update table NULL cannot be "
                                   "set (a null means 'unchanged' there).")
    p.add_argument("--set", metavar="COLUMN=VALUE", type=_assignment, action="append", required=True,
                   help="a new value, as text in the column's type (quote it as in --where; NULL for null); "
                        "repeat for more columns")
    _add_conditions(p, "a condition", "only print how many records would be updated")
    p.set_defaults(func=cmd_update)

    p = sub.add_parser("delete-partitions", parents=[common], help="delete every row of the matching partitions",
                       description="Delete every row of the partitions whose values match every --where, with "
                                   "one commit that writes no files (a table's first raises its format version "
                                   "to 3). Writes to those partitions that complete later are kept. The old "
                                   "files stay readable with as_of until a clean deletes them.")
    _add_conditions(p, "a condition on a partition column ('COL is null': the null partition)",
                    "only print the partitions that would be deleted")
    p.set_defaults(func=cmd_delete_partitions)

    p = sub.add_parser("index", parents=[common], help="build, drop or show the metadata table's partitions",
                       description="The metadata table (.nbcc/metadata) indexes the data files: `files` "
                                   "(planning without reading commit files), `column_stats` (skipping by "
                                   "min/max/nulls), `key_filters` (point lookups open only files that may "
                                   "hold the key). Building runs while writers keep writing. Without "
                                   "options: show each partition's state.")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--partitions", metavar="P[,P...]",
                       help=f"build these partitions ({', '.join(KINDS)}), comma-separated")
    which.add_argument("--drop", metavar="P[,P...]", help="stop using these partitions and delete them")
    p.add_argument("--timeout", type=_seconds, default=None, metavar="S",
                   help=f"with --partitions: seconds to wait for writes in flight to finish before giving up "
                        f"(default {DEFAULT_TIMEOUT_S:g}; a re-run resumes). Not a limit on the whole run, "
                        "which also indexes the table's files and compacts the metadata table")
    p.add_argument("-q", "--quiet", action="store_true", help="with --partitions: no progress bar")
    p.set_defaults(func=cmd_index, check_usage=_check_index_usage, parser=p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit code (0 ok, 1 error, 2 bad usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        problem = args.check_usage(args) if hasattr(args, "check_usage") else None
        if problem:
            args.parser.error(problem)  # usage and message on stderr, exits 2
        args.storage_options = dict(args.storage_options_global + args.storage_options_sub)
        try:
            if args.storage_options:  # (checking imports s3fs: not for a local table without options)
                check_storage_options(args.storage_options)
        except InvalidOptionError as exc:  # a name or value no table would take: bad usage
            parser.error(f"--storage-option: {exc}")
    except SystemExit as exc:  # usage errors, -h, --version
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        return args.func(args)
    except BrokenPipeError:  # `nbcc timeline URI | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (NbccError, FileNotFoundError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # storage unreachable, access denied, ...
        print(f"{PROG}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
