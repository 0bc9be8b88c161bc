"""Savepoints: table states that stay readable whatever the cleaner's window (Hudi's savepoints,
Iceberg's tags), for month-end audits and for `restore` to a known good state.

A savepoint names a state by its time S: the completion time of the last instant completed at
or before the time given. `.nbcc/savepoints/<S>.json` records it (format.md §14.6). A read as of
any time whose state is S is allowed before the cleaner's window (`view.check_readable`), and a
clean keeps every file such a read opens until the savepoint is deleted.

A savepoint and a clean race without a lock: a clean records in its plan the savepoints it
planned with, and every run that deletes its files lists the savepoints again just before and
keeps the files of any its plan lacks (`clean.kept_by_new_savepoints`); a new savepoint, once
written, looks at the cleans whose window starts after S that lacked it, and removes itself and
fails if one plans to delete a file of S. Each writes before it looks, so one sees the other.
"""

from __future__ import annotations

import json
from typing import Any

from .clean import files_of_state
from .clock import TimeGenerator, parse_time_option
from .config import SAVEPOINT_VERSION, TableConfig, raise_format_version
from .errors import CommitError, InvalidOptionError
from .storage import Storage
from .timeline import (
    CLEAN,
    REQUESTED,
    SAVEPOINT_DIR,
    TIMELINE_DIR,
    Timeline,
    committed_by,
    read_commit_metadata,
    savepoint_times,
)
from .view import check_readable, state_at

_LAST_TIME = "99991231235959999"


def list_savepoints(storage: Storage) -> list[dict[str, Any]]:
    """Each savepoint's record, oldest state first: `as_of` (its state's time S), `created`
    (when it was made), `host`/`user`, and `user_metadata` if given."""
    out = []
    for when in savepoint_times(storage):
        try:
            out.append(json.loads(storage.read_bytes(f"{SAVEPOINT_DIR}/{when}.json")))
        except FileNotFoundError:  # deleted since the listing
            continue
    return out


def create_savepoint(storage: Storage, config: TableConfig, clock: TimeGenerator, as_of: Any = None,
                     user_metadata: str | None = None) -> str:
    """Keep the state as of `as_of` (None: the latest) readable until `delete_savepoint`;
    returns its time S (making one that exists again returns it too). Refused if that state is
    before the cleaner's window (its files may be gone already), or if a clean that started
    meanwhile is deleting its files (then nothing is kept; try again)."""
    if user_metadata is not None and not isinstance(user_metadata, str):
        raise InvalidOptionError(f"user_metadata must be text (why the state is kept); got {user_metadata!r}")
    timeline = Timeline.load(storage)
    if state_at(timeline, _LAST_TIME) is None:
        raise InvalidOptionError("the table has no completed commits yet: there is no state to keep")
    state = state_at(timeline, parse_time_option(as_of, "as_of") if as_of is not None else _LAST_TIME)
    if state is None:
        first = min(i.completion for i in timeline.completed())
        raise InvalidOptionError(f"as_of={as_of}: no commit had completed by then (the first completed at {first})")
    check_readable(storage, timeline, state, "as_of")  # before the window, and not kept already: gone
    with clock.locked() as grant:  # older nbcc, whose cleans would delete its files, must refuse the table
        raise_format_version(storage, grant, SAVEPOINT_VERSION)
        made = grant.time
    record = {"as_of": state, "created": made, **committed_by(),
              **({"user_metadata": user_metadata} if user_metadata is not None else {})}
    path = f"{SAVEPOINT_DIR}/{state}.json"
    created = storage.put_if_absent(path, json.dumps(record, sort_keys=True).encode())
    conflict = _clean_deleting(storage, config, state)
    if conflict is not None:
        if created:
            storage.delete(path)
        raise CommitError(f"clean {conflict} started meanwhile and deletes files of the state as of {state}, so "
                          "it cannot be kept; nothing was kept. Make the savepoint again once the clean is done "
                          "if that state is still readable, else keep a later one")
    return state


def _clean_deleting(storage: Storage, config: TableConfig, state: str, _attempts: int = 3) -> str | None:
    """The first clean, pending or completed, that planned without the savepoint at `state` and
    plans to delete a file that reads as of it open; None if there is none."""
    timeline = Timeline.load(storage)
    needed: set[tuple[str, str]] | None = None
    for inst in timeline.instants:
        if inst.action != CLEAN:
            continue
        try:
            body = (read_commit_metadata(storage, inst) if inst.is_completed else
                    json.loads(storage.read_bytes(f"{TIMELINE_DIR}/{inst.instant}.{CLEAN}.{REQUESTED}")))
        except FileNotFoundError:  # completed since the listing: look again
            if _attempts > 0:
                return _clean_deleting(storage, config, state, _attempts - 1)
            raise
        window = body.get("earliest_retained")
        if window is None or window <= state or state in body.get("savepoints", ()):
            continue  # it kept every state from its window on, or this one
        # Its plan: a completed clean's run kept the files of savepoints it found, but another
        # run finishing it may not have (format.md §14.3), so what it deleted is not enough.
        planned = body["delete"] if not inst.is_completed else body.get("deleted", []) + body.get("kept", [])
        if needed is None:
            needed = files_of_state(storage, config, timeline, state)
        if any(tuple(d) in needed for d in planned):
            return inst.instant
    return None


def delete_savepoint(storage: Storage, when: Any) -> bool:
    """Stop keeping the savepoint's state (the next clean may delete its files, and reads
    before the cleaner's window are refused again); False if no savepoint has that time."""
    state = parse_time_option(when, "savepoint")
    path = f"{SAVEPOINT_DIR}/{state}.json"
    if not storage.exists(path):
        return False
    storage.delete(path)
    return True
