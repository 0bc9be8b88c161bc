"""Savepoints: table states that stay readable whatever the cleaner's window (Hudi's savepoints,
Iceberg's tags), for month-end audits and for `restore` to a known good state.

A savepoint names a state by its time S: the completion time of the last instant completed at
or before the time given. `.nbcc/savepoints/<S>_<created>.json` records it (format.md §14.6).
A read as of any time whose state is S is allowed before the cleaner's window
(`view.check_readable`), and a clean keeps every file such a read opens until the savepoint is
deleted.

A savepoint and a clean race without a lock. A clean records in its plan the savepoints it
planned with, and every run that deletes its files lists the savepoints again just before and
keeps the files of any its plan lacks (`clean.kept_by_new_savepoints`). A savepoint is made in
two steps: a pending file (`<S>_<created>.pending.json`, whose state cleans keep too), then,
once it has checked that no clean which planned without it deletes a file of S, the savepoint
itself. Each side writes before it looks at the other, so one always sees the other; and a
savepoint that fails (a clean found deleting, a storage error, a crash) leaves no savepoint that
reads trust, only at worst a pending file that makes cleans keep more.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from .clean import files_of_state
from .clock import TimeGenerator, parse_time_option
from .config import SAVEPOINT_VERSION, TableConfig, raise_format_version
from .errors import CommitError, InvalidOptionError, StorageError
from .storage import Storage
from .timeline import DATA_ACTIONS, SAVEPOINT_DIR, Timeline, committed_by, read_cleans, savepoint_files
from .view import oldest_readable, state_at

_LAST_TIME = "99991231235959999"
log = logging.getLogger(__name__)


def list_savepoints(storage: Storage, files: list[tuple[str, str, bool]] | None = None) -> list[dict[str, Any]]:
    """Each savepoint's record, oldest state first: `as_of` (its state's time S), `created`
    (when it was made), `host`/`user`, `user_metadata` if given, and `confirmed`: False for one
    being made, or left pending by a creation that crashed (delete it to let cleans go on).
    `files`: those of `savepoint_files` to read (default: all)."""
    out = []
    for state, created, confirmed in savepoint_files(storage) if files is None else files:
        try:
            record = json.loads(storage.read_bytes(_path(state, created, confirmed)))
        except FileNotFoundError:  # deleted since the listing (a pending one: confirmed meanwhile)
            continue
        out.append({**record, "confirmed": confirmed})
    return sorted(out, key=lambda r: (r["as_of"], r["created"], r["confirmed"]))


def _path(state: str, created: str, confirmed: bool) -> str:
    return f"{SAVEPOINT_DIR}/{state}_{created}{'' if confirmed else '.pending'}.json"


def create_savepoint(storage: Storage, config: TableConfig, clock: TimeGenerator, as_of: Any = None,
                     user_metadata: str | None = None) -> str:
    """Keep the state as of `as_of` (None: the latest) readable until `delete_savepoint`;
    returns its time S (a savepoint of that state made before is returned as it is, its note
    replaced if `user_metadata` differs). Refused
    if that state is before the cleaner's window (its files may be gone already), or if a clean
    that started meanwhile is deleting its files (then nothing is kept)."""
    if user_metadata is not None and not isinstance(user_metadata, str):
        raise InvalidOptionError(f"user_metadata must be text (why the state is kept); got {user_metadata!r}")
    timeline = Timeline.load(storage)
    data = [i.completion for i in timeline.completed() if i.action in DATA_ACTIONS]
    if not data:
        raise InvalidOptionError("the table has no commits yet: there is no state to keep")
    given = parse_time_option(as_of, "as_of") if as_of is not None else _LAST_TIME
    state = state_at(timeline, given)
    if state is None or state < min(data):
        raise InvalidOptionError(f"as_of={as_of}: no commit had completed by then (the first completed at "
                                 f"{min(data)})")
    of_state = [f for f in savepoint_files(storage) if f[0] == state]
    existing = list_savepoints(storage, [f for f in of_state if f[2]])  # made ones
    if existing and (user_metadata is None or any(r.get("user_metadata") == user_metadata for r in existing)):
        return state
    # Else (another note) it is made again, which its kept files let happen whatever the window,
    # and then the old records go.
    oldest = oldest_readable(storage, timeline)
    # A state that a pending savepoint file has kept may be made again (the check below finds
    # any clean that deleted its files before the file landed).
    if oldest is not None and state < oldest and not of_state:
        raise InvalidOptionError(
            f"{'the latest state' if as_of is None else f'as_of={as_of}: the state then'} ({state}) is before "
            f"the window the cleaner retained, which starts at {oldest}: its files may be deleted already. Only "
            "a state within the window can be kept (nbcc describe: oldest as_of)")
    with clock.locked() as grant:  # older nbcc, whose cleans would delete its files, must refuse the table
        raise_format_version(storage, grant, SAVEPOINT_VERSION)
        created = grant.time
    record = json.dumps({"as_of": state, "created": created, **committed_by(),
                         **({"user_metadata": user_metadata} if user_metadata is not None else {})},
                        sort_keys=True).encode()
    pending = _path(state, created, confirmed=False)
    storage.put_if_absent(pending, record)  # from here on, cleans that list it keep the state
    try:
        # A made savepoint of the state listed now has kept it without a break since before
        # this pending file: no clean can have deleted its files since (format.md §14.6).
        kept = any(s == state and made for s, _, made in savepoint_files(storage))
        conflict = None if kept else _clean_deleting(storage, config, state)
    except BaseException:
        _remove_quietly(storage, pending)  # no savepoint file was put: none can appear later
        raise
    if conflict is not None:
        _remove_quietly(storage, pending)
        raise CommitError(f"clean {conflict} planned to delete files of the state as of {state} without this "
                          "savepoint, so the state cannot be kept; nothing was kept. Keep a state within the "
                          "cleaner's window instead (the latest, or nbcc describe: oldest as_of)")
    try:
        storage.put_if_absent(_path(state, created, confirmed=True), record)
    except Exception as exc:
        # It may land later all the same (a request in flight): the pending file stays, so
        # cleans keep the state whatever happened.
        raise StorageError(f"the savepoint of the state as of {state} may or may not have been made ({exc}); its "
                           "pending file stays, so cleans keep the state. Make it again (it is found if it was "
                           "made), or delete it with its pending files") from exc
    _remove_quietly(storage, pending)
    for old in existing:  # another note: the state stays kept by the record just made
        storage.delete(_path(state, old["created"], confirmed=True))
    return state


def _remove_quietly(storage: Storage, path: str) -> None:
    """Delete a pending savepoint file; left behind, it only makes cleans keep its state."""
    try:
        storage.delete(path)
    except Exception as exc:  # noqa: BLE001 - the caller's outcome stands either way
        log.warning("could not delete the pending savepoint file %s (%s); cleans keep its state's files "
                    "until it is deleted (nbcc delete-savepoint)", path, exc)


def _clean_deleting(storage: Storage, config: TableConfig, state: str) -> str | None:
    """The first clean, pending or completed, that planned without the savepoint at `state` and
    plans to delete a file that reads as of it open; None if there is none."""
    timeline = Timeline.load(storage)
    needed: set[tuple[str, str]] | None = None
    for inst, record in read_cleans(storage, timeline):
        window = record.get("earliest_retained")
        if window is None or window <= state or state in record.get("savepoints", ()):
            continue  # it kept every state from its window on, or this one
        # Its plan: a completed clean's run kept the files of savepoints it found, but another
        # run finishing it may not have (format.md §14.3), so what it deleted is not enough.
        planned = record["delete"] if not inst.is_completed else record.get("deleted", []) + record.get("kept", [])
        if needed is None:
            needed = files_of_state(storage, config, timeline, state)
        if any(tuple(d) in needed for d in planned):
            return inst.instant
    return None


def delete_savepoint(storage: Storage, when: Any, pending: bool = False) -> bool:
    """Stop keeping the savepoint's state (the next clean may delete its files, and reads
    before the cleaner's window are refused again); False if no savepoint has that time. Its
    pending files are deleted only with `pending`: the one of a maker still running is what
    keeps the state until its savepoint is made (format.md §14.6)."""
    state = parse_time_option(when, "savepoint")
    found = [(s, c, made) for s, c, made in savepoint_files(storage) if s == state and (made or pending)]
    for s, created, made in found:
        storage.delete(_path(s, created, made))
    return bool(found)
