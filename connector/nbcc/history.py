"""A table's history: what each completed instant did, newest first (Delta's DESCRIBE HISTORY,
Hudi's show_commits). It is read from the commit metadata (format.md §7.3) of the active
timeline and of the archived one, so it reaches back to the table's first commit."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .config import check_count
from .storage import Storage
from .timeline import CLEAN, INDEXING, REPLACE_COMMIT, Timeline, read_commit_metadatas

# Commit-metadata fields that say how a commit was asked for (Delta's operationParameters).
_PARAMETERS = ("user_metadata", "replace_where", "condition", "updates", "widened", "replaced_partitions",
               "restored_as_of", "stream_id", "batch_id", "earliest_retained", "rolled_back")


@dataclass(frozen=True)
class CommitInfo:
    """One completed instant. `rows`: rows written (a delete: the keys it names, whether or not
    they existed; a compaction: the rows of its base files); None for a clean or an indexing,
    which write none. `files`: data files written (a clean: files deleted). `partitions`: those
    it wrote to (a clean: those it deleted files in) or, `replacepartitions`, replaced;
    `replaces_table`: it replaced every partition (a `replacecommit`: an overwrite or a
    restore). `user`, `host`: who completed it (None before nbcc recorded them).
    `parameters`: how it was asked for, as recorded (`user_metadata`, `replace_where`,
    `condition`, `updates`, `widened`, `replaced_partitions`, `restored_as_of`, `stream_id` and `batch_id`; a clean's
    `earliest_retained`, `rolled_back`, `savepoints` and `kept_for_new_savepoints`; an
    indexing's `built`)."""

    instant: str
    completion: str
    action: str
    operation: str
    rows: int | None
    files: int
    bytes: int | None
    partitions: tuple[str, ...]
    replaces_table: bool = False
    user: str | None = None
    host: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict, hash=False)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["partitions"] = list(self.partitions)
        return out


def commit_history(storage: Storage, limit: int | None = None) -> list[CommitInfo]:
    """The completed instants, latest completion first; with `limit`, the latest `limit` of
    them (only their commit files are read)."""
    if limit is not None:
        check_count("limit", limit, "commits")
    completed = Timeline.load(storage).completed()[::-1]  # completed(): in completion order
    completed = completed[:limit] if limit is not None else completed
    metas = read_commit_metadatas(storage, completed)
    return [_commit_info(i.instant, i.completion, i.action, metas[i.instant]) for i in completed]


def _commit_info(instant: str, completion: str, action: str, meta: dict[str, Any]) -> CommitInfo:
    parameters = {k: meta[k] for k in _PARAMETERS if k in meta}
    who = {"user": meta.get("user"), "host": meta.get("host")}
    if action == CLEAN:
        deleted = meta.get("deleted", [])
        # The savepoints whose files it kept: those it planned with, and how many files it kept
        # for savepoints made while it ran (format.md §14.6).
        parameters.update({"savepoints": meta["savepoints"]} if meta.get("savepoints") else {})
        parameters.update({"kept_for_new_savepoints": len(meta["kept"])} if meta.get("kept") else {})
        return CommitInfo(instant, completion, action, CLEAN, None, len(deleted), None,
                          tuple(sorted({partition for partition, _ in deleted} - {""})), **who, parameters=parameters)
    if action == INDEXING:
        return CommitInfo(instant, completion, action, INDEXING, None, 0, None, (), **who,
                          parameters={"built": list(meta.get("ready", []))})
    files = meta.get("files", [])
    partitions = {f["partition"] for f in files}.union(meta.get("replaced_partitions", [])) - {""}  # "": none
    return CommitInfo(instant, completion, action, meta.get("operation") or action, int(meta.get("rows", 0)),
                      len(files), int(meta.get("bytes", 0)), tuple(sorted(partitions)),
                      replaces_table=action == REPLACE_COMMIT, **who, parameters=parameters)
