"""Timeline archival: move instants older than the retained window out of `.nbcc/timeline/`.

Every completed (or rolled back) instant whose time is before the window the cleaner retained is
written, with its metadata, into one Parquet file `.nbcc/history/<first>_<last>_<8 hex>.parquet`
(columns instant, action, state, completion, metadata, plan), and only then removed from the
active timeline. The timeline reads history files too (once per process), so completion times
and file lists of archived instants are always found (Hudi #14365 lost data when an archived
instant's completion time read back as null). A crash between the two steps leaves an instant in both places, which
readers treat as one.
"""

from __future__ import annotations

import io
import json
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .clean import DEFAULT_RETAIN_COMMITS
from .config import check_count
from .errors import StorageError
from .storage import Storage
from .timeline import (
    COMPACTION,
    COMPACTION_COMMIT,
    COMPLETED,
    DATA_ACTIONS,
    HISTORY_DIR,
    INFLIGHT,
    REQUESTED,
    ROLLEDBACK,
    TIMELINE_DIR,
    Timeline,
    earliest_retained,
    load_history,
    read_commit_metadata,
    read_compaction_plan,
    read_timeline_file,
)


def archive(storage: Storage, retain_commits: int = DEFAULT_RETAIN_COMMITS) -> dict[str, Any]:
    """Archive the instants before the retained window (the cleaner's, or else the last
    `retain_commits` data commits). Returns {"archived": n, "file": name or None, "finished": m}:
    m instants that an earlier archival left on the active timeline too, removed from it."""
    retain_commits = check_count("retain_commits", retain_commits, "data commits")
    rows = _rows_to_archive(storage, Timeline.load(storage), retain_commits)
    name = _write_history(storage, rows) if rows else None
    # Also the instants of an archival that crashed after writing its history file.
    finished = _finish(storage) - {r["instant"] for r in rows}
    _archive_metadata_table(storage)
    return {"archived": len(rows), "file": name, "finished": len(finished)}


def _rows_to_archive(storage: Storage, timeline: Timeline, retain_commits: int) -> list[dict[str, Any]]:
    """The history rows of the completed and rolled-back instants before the retained window."""
    boundary = earliest_retained(storage, timeline)
    if boundary is None:
        data = [i for i in timeline.completed() if i.action in DATA_ACTIONS]
        if len(data) <= retain_commits:
            return []
        boundary = data[-retain_commits].completion
    # Only writes and compactions in flight hold archival back (a pending clean is finished by
    # the next clean and never needs older instants).
    pending = [i.instant for i in timeline.pending() if i.action in DATA_ACTIONS + (COMPACTION,)]
    oldest_pending = min(pending, default=None)
    rows = []
    for inst in timeline.instants:
        if inst.archived or inst.state not in (COMPLETED, ROLLEDBACK):
            continue
        when = inst.completion if inst.is_completed else inst.instant
        if when >= boundary or (oldest_pending is not None and inst.instant >= oldest_pending):
            continue
        if inst.is_completed:
            meta = read_commit_metadata(storage, inst)  # falls back to the history
        else:
            try:
                meta = read_timeline_file(storage, inst.file_name, f"the rollback mark of {inst.instant}")
            except FileNotFoundError:
                continue  # another archiver moved it into the history since the listing
        plan = None
        if inst.action == COMPACTION_COMMIT:  # kept: time travel may slice as of its pending time
            plan = json.dumps(read_compaction_plan(storage, inst.instant), sort_keys=True)
        rows.append({"instant": inst.instant, "action": inst.action, "state": inst.state,
                     "completion": inst.completion, "metadata": json.dumps(meta, sort_keys=True), "plan": plan})
    return rows


def _write_history(storage: Storage, rows: list[dict[str, Any]]) -> str:
    """A new history file of `rows`; its name."""
    table = pa.Table.from_pylist(rows, schema=pa.schema([
        ("instant", pa.string()), ("action", pa.string()), ("state", pa.string()),
        ("completion", pa.string()), ("metadata", pa.string()), ("plan", pa.string())]))
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    # A unique name: two archivers never overwrite or shadow each other's history.
    name = f"{rows[0]['instant']}_{rows[-1]['instant']}_{uuid.uuid4().hex[:8]}.parquet"
    if not storage.put_if_absent(f"{HISTORY_DIR}/{name}", sink.getvalue()):
        raise StorageError(f"history file {name} exists already")
    return name


def _archive_metadata_table(storage: Storage) -> None:
    """Archive the metadata table's timeline with the table's (it needs none of the data
    timeline's archived instants: their completion times stay in the history)."""
    from .metadata_table import open_metadata_table, upkeep

    mdt = open_metadata_table(storage)
    if mdt is not None:
        upkeep(mdt, force=True)


def _finish(storage: Storage) -> set[str]:
    """Remove the active files of every instant the history holds (also finishing an archival
    that crashed after writing its history file): pending files first, then the completed file
    or rollback mark, so an instant never looks less than it is while its files go. Returns
    the instants whose files it removed."""
    archived = {i.instant for i in load_history(storage)}
    names = [n for n in storage.list_names(TIMELINE_DIR) if n[:17] in archived]
    pending = {n for n in names if n.rsplit(".", 1)[-1] in (REQUESTED, INFLIGHT)}
    for step in (sorted(pending), [n for n in names if n not in pending]):  # two calls keep the order
        storage.delete_many([f"{TIMELINE_DIR}/{name}" for name in step])
    return {n[:17] for n in names}
