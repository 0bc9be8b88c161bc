"""The life of one write instant: begin, write files (elsewhere), commit or roll back.

    begin:    instant = new time; create <instant>.<action>.requested, then .inflight
    commit:   under the table lock: completion = time issued with the lock, create
              <instant>_<completion>.<action> (put-if-absent) holding the commit metadata;
              release the lock, then remove the requested/inflight files
    rollback: delete the instant's data files, then its requested/inflight files

The lock is held to issue the completion time and create one small file (RFC-66 needs the two to
be atomic), and, for a write that adds columns or replaces the partitions matching a condition,
to list the timeline and read the commits that completed meanwhile. No conflict check runs:
writers of different instants never conflict.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Iterable

import pyarrow as pa

from .clock import TimeGenerator
from .config import FORMAT_VERSION, TYPE_WIDENING_VERSION, raise_format_version
from .errors import CommitError, LockLostError, SchemaError, StorageError
from .filenames import LogFile, parse_data_file
from .schema import schema_to_json, type_from_json, widened_type, widest_of_kind
from .storage import Storage
from . import heartbeat
from .metadata_table import index_commit, maintain
from .partitions import PartitionMatch
from .rollback import rollback_instant, rollback_or_log
from .timeline import (
    REPLACE_PARTITIONS,
    Instant,
    Timeline,
    committed_by,
    create_completed,
    create_inflight,
    create_requested,
    pending_files,
    read_commit_metadatas,
)

log = logging.getLogger(__name__)


@dataclass
class WriteTransaction:
    storage: Storage
    clock: TimeGenerator
    action: str
    operation: str
    schema: pa.Schema  # the table schema this write produces (possibly with added columns)
    added_columns: list[str] = field(default_factory=list)
    partition_depth: int = 0  # number of partition columns (a rollback lists that deep)
    format_version: int = FORMAT_VERSION  # the table's format version this write needs (§3)
    instant: str = ""
    user_metadata: str | None = None  # recorded with the commit (the userMetadata option)
    type_widening: bool = False  # it may widen column types (format.md §4.2)
    widened: list[str] = field(default_factory=list)  # those it widens, "x: float -> double" (recorded)

    def require_format_version(self) -> None:
        """Raise the table's format version to the one this write needs (§3), under the lock.
        `begin` does so in the hold that requests its instant; a stream, whose micro-batches
        claim their instants elsewhere (stream.py), calls this once before its first."""
        if self.format_version > FORMAT_VERSION:
            with self.clock.locked() as grant:
                raise_format_version(self.storage, grant, self.format_version)

    def begin(self) -> str:
        info = {"operation": self.operation, "host": socket.gethostname(), "pid": os.getpid()}
        try:
            with self.clock.locked() as grant:
                # Issued and made visible under one lock hold: a compaction scheduled later sees
                # every older instant that may still complete, which bounds what it must keep (§15).
                self.instant = grant.time
                if self.format_version > FORMAT_VERSION:  # older nbcc must refuse the table from now (§3, §8)
                    raise_format_version(self.storage, grant, self.format_version)
                create_requested(self.storage, self.instant, self.action, info, grant)
        except StorageError as failure:
            # The put may have landed all the same (a lost reply, a request given up at the
            # lease's end): undo it now rather than leave a pending instant for the cleaner.
            if self.instant:
                self.rollback_or_log(failure)
            raise
        if grant.overran:
            # A compaction scheduled meanwhile may not have seen this instant pending, and then
            # keeps too little for it (§15.2 earliest_pending): never write it.
            self.rollback(reason="its requested file was published after the table lock's lease")
            raise LockLostError(
                f"publishing instant {self.instant} took longer than the table lock's "
                f"{grant.lease_ms} ms lease (storage is slow); nothing was written. Retry the write, "
                "or raise lock_lease_ms."
            )
        heartbeat.beat(self.storage, self.instant)
        create_inflight(self.storage, self.instant, self.action, info)
        return self.instant

    def commit(self, files: Iterable[dict[str, Any]], extra: dict[str, Any] | None = None,
               partitions: Iterable[str] = (), match: PartitionMatch | None = None,
               beating: heartbeat.Heartbeat | None = None) -> str:
        """Complete the instant; returns its completion time. A `replacepartitions` replaces the
        partitions of its files, `partitions` (those a partition deletion's rows name), and
        those `match` matched (a replaceWhere's, a deletion's filter), with, found under the
        lock, those that commits completed since its listing created and that match too.
        `beating`: the heartbeat thread of this process's write, stopped once the commit
        completed, so that the tidying's delete of the heartbeat is its last."""
        files = sorted(files, key=lambda f: (f["partition"], f["name"]))
        for f in files:
            parsed = parse_data_file(f["name"])
            if not isinstance(parsed, LogFile) or parsed.instant != self.instant:
                raise CommitError(f"file {f['name']} does not belong to instant {self.instant}")
        metadata = {
            "instant": self.instant,
            "action": self.action,
            "operation": self.operation,
            "schema": schema_to_json(self.schema),
            "files": files,
            "rows": sum(int(f["rows"]) for f in files),
            "bytes": sum(int(f["bytes"]) for f in files),
            **committed_by(),
            **({"user_metadata": self.user_metadata} if self.user_metadata is not None else {}),
            **({"widened": self.widened} if self.widened else {}),
            **(extra or {}),
        }
        if self.action == REPLACE_PARTITIONS:  # its scope (format.md §8)
            metadata["replaced_partitions"] = sorted({f["partition"] for f in files}.union(
                partitions, match.listed if match else ()))
        # The metadata table's entries go in before the commit completes, so a reader that sees
        # the commit finds them; a commit that then fails leaves entries of an instant that never
        # completes, which readers ignore. Several runs may complete one micro-batch's instant
        # (a stream's replays, §17): only the run that completes it knows its files are the
        # instant's, so such a commit adds its entries after completing (format.md §18.4).
        # Its upkeep (compacting, cleaning the metadata table) waits until the commit completed:
        # it is not needed to read the commit, and must neither delay nor fail it.
        if match is not None:  # their commit files, read (and cached) now: under the lock, only newer ones
            read_commit_metadatas(self.storage, match.unseen(Timeline.load(self.storage).completed()))
        shared_instant = bool(extra and "batch_id" in extra)
        indexed = False
        if not shared_instant:
            indexed = index_commit(self.storage, metadata, maintain=False)
        with self.clock.locked() as grant:
            # Under the lock: no commit can slip in between.
            completed = Timeline.load(self.storage).completed() if self.added_columns or match else []
            if self.added_columns and self._check_added_columns(completed):
                raise_format_version(self.storage, grant, TYPE_WIDENING_VERSION)
            if match is not None:
                created = self._created_since(match, completed)
                if created:
                    metadata["replaced_partitions"] = sorted(set(metadata["replaced_partitions"]).union(created))
            metadata["lock_wait_ms"] = round(grant.wait_ms, 3)
            completion = create_completed(self.storage, self.instant, grant, self.action, metadata)
        if shared_instant:
            indexed = index_commit(self.storage, metadata, maintain=False)
        # The commit is published: what follows is tidying, and must never fail the write
        # (a failure here would make Spark call abort on a committed instant).
        if beating is not None:
            beating.stop()
        try:
            self.storage.delete_many([*pending_files(self.instant, self.action),
                                      heartbeat.heartbeat_file(self.instant)])  # one request on S3
            if beating is not None:
                beating.removed = True
        except Exception as exc:  # noqa: BLE001
            log.warning("commit %s completed; removing its pending files failed: %s", self.instant, exc)
        if indexed:
            maintain(self.storage)  # never raises
        return completion

    def _created_since(self, match: PartitionMatch, completed: list[Instant]) -> list[str]:
        """The partitions that `match` did not list, that commits its listing did not see wrote
        files to, and that match its condition. Without them, a partition created while a
        replaceWhere or a partition deletion ran would keep rows that completed before it, while
        a partition it listed would lose them (format.md §8). Folder values are read as the
        widest type of their kind: a commit meanwhile may have widened the column."""
        written = {f["partition"] for meta in read_commit_metadatas(self.storage, match.unseen(completed)).values()
                   for f in meta.get("files", ())}
        schema = pa.schema([f.with_type(widest_of_kind(f.type)) for f in self.schema])
        return match.of(sorted(written - set(match.listed)), schema)

    def _check_added_columns(self, completed: list[Instant]) -> bool:
        """Another writer may have added one of this write's new columns meanwhile. The later
        commit is refused where the two cannot be combined: a spelling that differs only in
        letter case (Spark could read neither of `Foo` and `foo`), or a type of another kind.
        Types of one kind (format.md §4.2) combine as narrower and wider data do: narrower is
        read as the wider type, and wider widens the column, with `type_widening` only.
        Returns whether this commit widens one (the caller raises the format version)."""
        mine = {n.lower(): n for n in self.added_columns}
        metas = read_commit_metadatas(self.storage, completed)
        found: dict[str, tuple[str, pa.DataType]] = {}  # name -> (the commit that added it, its type now)
        for inst in completed:  # completion order: the type folds as a reader's schema does
            for f in metas[inst.instant].get("schema", []):
                name = mine.get(f["name"].lower())
                if name is None:
                    continue
                if f["name"] != name:
                    raise SchemaError(
                        f"column {name!r} was added as {f['name']!r} by commit {inst.instant} while "
                        f"this write added it as {name!r}; Spark does not tell the two apart, so the "
                        f"table would hold two columns it cannot read: write it as {f['name']!r}"
                    )
                t = type_from_json(f["type"])
                if name not in found:
                    found[name] = (inst.instant, t)
                elif widened_type(found[name][1], t) is not None:
                    found[name] = (found[name][0], t)
        widens = False
        for name, (added_by, theirs) in found.items():
            ours = self.schema.field(name).type
            if ours.equals(theirs) or widened_type(ours, theirs) is not None:
                continue
            wider = widened_type(theirs, ours) is not None
            if wider and self.type_widening:
                widens = True
                continue
            raise SchemaError(
                f"column {name!r} was added as {theirs} by commit {added_by} while this write added it as "
                f"{ours}; cast it to {theirs}" + (" (or give the write option type_widening=true)" if wider else "")
                + " and write again")
        return widens

    def rollback(self, files: Iterable[dict[str, Any]] = (), reason: str = "the write failed") -> bool:
        """Undo this write at once (a failed Spark job's abort); never a completed one."""
        return rollback_instant(self.storage, self.clock, self.instant, self.partition_depth, files, reason)

    def rollback_or_log(self, failure: BaseException) -> None:
        """`rollback` of a write that failed with `failure`, which the caller raises; a failure
        of the rollback itself is only logged."""
        rollback_or_log(self.storage, self.clock, self.instant, self.partition_depth, failure)
