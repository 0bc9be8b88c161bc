"""The table as of a time: which commits exist, their files, the schema they make, and the file
slices those files form (Hudi's file-system view; format.md §12.1); and how far back a read, or
an incremental range, may reach once a clean deleted files (§12.5, §12.7).

Time travel (`as_of=T`, RFC-66): only commits whose completion time is <= T exist; a commit that
started before T but completed after it is treated as pending, so the latest file slice of each
file group is exactly its state at T. An overwrite (`replacecommit`) hides every file of the
commits that completed before it; a dynamic partition overwrite (`replacepartitions`) does so
only in the partitions it wrote files to. Where the metadata table's `files` partition is ready
(index_view.py), the files and schemas of the instants it covers come from it instead of their
commit files (format.md §18.5).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import pyarrow as pa

from .clock import BEFORE_ALL
from .config import TableConfig
from .errors import InvalidOptionError
from .file_slices import FileSlice, build_file_slices
from .index_view import MetadataIndex
from .metadata_table import FILES
from .schema import merge_commit_schemas, schema_from_json
from .storage import Storage
from .timeline import (
    CLEAN,
    COMPACTION,
    COMPACTION_COMMIT,
    DATA_ACTIONS,
    INDEXING,
    OVERWRITES,
    REPLACE_COMMIT,
    REPLACE_PARTITIONS,
    Instant,
    Timeline,
    earliest_retained,
    read_commit_metadatas,
    read_compaction_plan,
    savepoint_times,
)


@dataclass(frozen=True)
class Cutoffs:
    """Where overwrites hide older files (format.md §12.1 step 5): per partition, the completion
    time before which its commits are hidden; `whole` for partitions no dynamic overwrite
    replaced (that of the latest overwrite of the whole table, or None)."""

    whole: str | None = None
    by_partition: Mapping[str, str] = field(default_factory=dict)  # each at least `whole`

    def of(self, partition: str) -> str | None:
        return self.by_partition.get(partition, self.whole)


def overwrite_cutoffs(completed: Iterable[Instant], replaced: Mapping[str, frozenset[str]]) -> Cutoffs:
    """The cutoffs the overwrites among `completed` (completion order) make; `replaced`: the
    partitions of each dynamic one (`replaced_partitions`)."""
    completed = list(completed)
    whole = max((i.completion for i in completed if i.action == REPLACE_COMMIT), default=None)
    by_partition = {p: max(whole or "", inst.completion)
                    for inst in completed for p in replaced.get(inst.instant, ())}  # the latest wins
    return Cutoffs(whole, by_partition)


@dataclass
class TableView:
    """The timeline restricted to what had completed at `as_of` (None: everything)."""

    completed: list[Instant]  # completion order
    metas: dict[str, dict[str, Any]]  # instant -> commit metadata
    completion: dict[str, str | None]  # instant -> completion time, None if not completed by as_of
    pending_compactions: list[str]  # compaction instants scheduled by as_of, not completed by it
    schema: pa.Schema
    cutoffs: Cutoffs
    replaced: dict[str, frozenset[str]] = field(default_factory=dict)  # dynamic overwrite -> its partitions

    def file_info(self) -> dict[tuple[str, str], dict[str, Any]]:
        """(partition, file name) -> its descriptor in the commit metadata. One commit writes
        files of the same name in every partition it touches, so the name alone is ambiguous."""
        return {(f["partition"], f["name"]): f for meta in self.metas.values() for f in meta["files"]}


def known_sizes(info: Mapping[tuple[str, str], Mapping[str, Any]], partition: str,
                names: Iterable[str]) -> dict[str, int]:
    """name -> bytes of those of `names` (files of `partition`) whose descriptor (`file_info`)
    gives a size: such a file opens on an object store without a request for it."""
    sizes = {n: int(info.get((partition, n), {}).get("bytes", 0)) for n in names}
    return {n: b for n, b in sizes.items() if b > 0}


def table_view(storage: Storage, config: TableConfig, timeline: Timeline, as_of: str | None,
               index: MetadataIndex | None = None) -> TableView:
    """The table as of `as_of`. With an `index` whose `files` partition is ready, the schema and
    files of the instants it covers come from it instead of their commit files."""
    completed = [i for i in timeline.completed() if as_of is None or i.completion <= as_of]
    metas = _metadata(storage, completed, index)
    schema = table_schema(storage, config, completed, lambda new: metas)
    done = {i.instant: i.completion for i in completed}
    completion = {i.instant: done.get(i.instant) for i in timeline.instants}
    pending = [i.instant for i in timeline.instants
               if i.action in (COMPACTION, COMPACTION_COMMIT) and (as_of is None or i.instant <= as_of)
               and i.instant not in done and i.state != "rolledback"]
    replaced = replaced_partitions(storage, completed, metas, index)
    return TableView(completed, metas, completion, pending, schema, overwrite_cutoffs(completed, replaced), replaced)


def replaced_partitions(storage: Storage, completed: Iterable[Instant], metas: Mapping[str, Mapping[str, Any]],
                        index: MetadataIndex | None) -> dict[str, frozenset[str]]:
    """The partitions each `replacepartitions` among `completed` (a dynamic overwrite, a
    replaceWhere, a partition deletion) replaced: those its commit names, and those it wrote
    files to. From its completed file even where the metadata table gave `metas`: the metadata
    table drops the entries of cleaned files, and an overwrite whose files were compacted and
    then cleaned still replaced its partitions (format.md §18.5)."""
    dynamic = [i for i in completed if i.action == REPLACE_PARTITIONS]
    if not dynamic:
        return {}
    if index is not None and index.has(FILES):
        metas = read_commit_metadatas(storage, dynamic)  # cached: a commit file never changes
    # Version 3 names them (a deletion writes no file); a version-2 commit, by its files.
    return {i.instant: frozenset(f["partition"] for f in metas[i.instant]["files"])
            .union(metas[i.instant].get("replaced_partitions", ())) for i in dynamic}


@dataclass(frozen=True)
class _SchemaFold:
    """The schema that a run of completed commits (in completion order) makes."""

    base: pa.Schema  # the table's created schema
    instants: list[tuple[str, str]]  # (instant, completion) of the commits folded, in completion order
    shapes: frozenset[tuple]  # the (name, type) sets their schemas had
    schema: pa.Schema


# Storage uri -> the longest fold a call here made. Completion times are issued in increasing
# order, so a later listing's completed commits usually extend that run, and only the new ones
# are folded: a writer's schema look-up (every commit begins with one) does not re-read every
# commit of a long timeline. When they do not (a listing that missed a commit, a commit whose
# lock lease ran out before it was published, a table made again at the same path), the run is
# not a prefix of the new one and the fold starts over. The tables used last are kept.
_SCHEMA_FOLDS: "OrderedDict[str, _SchemaFold]" = OrderedDict()
_SCHEMA_FOLDS_LOCK = threading.Lock()
_SCHEMA_FOLDS_KEPT = 64  # tables; a fold holds the ids of its table's completed commits


def table_schema(storage: Storage, config: TableConfig, completed: list[Instant],
                 metas_of: Callable[[list[Instant]], Mapping[str, Mapping[str, Any]]]) -> pa.Schema:
    """The table's schema after the `completed` commits (completion order): the created schema
    plus the columns they added and the types they widened. `metas_of(instants)`: their
    metadata by instant, asked only for the commits this process has not folded yet."""
    keys = [(i.instant, i.completion) for i in completed]
    with _SCHEMA_FOLDS_LOCK:
        fold = _SCHEMA_FOLDS.get(storage.uri)
    if fold is None or keys[:len(fold.instants)] != fold.instants or not fold.base.equals(config.schema):
        fold = _SchemaFold(config.schema, [], frozenset(), config.schema)  # not a prefix: fold anew
    new = completed[len(fold.instants):]
    if not new:
        return fold.schema
    metas = metas_of(new)
    seen = set(fold.shapes)
    schema = merge_commit_schemas(fold.schema, _new_schemas((metas[i.instant] for i in new), seen))
    done = _SchemaFold(config.schema, keys, frozenset(seen), schema)
    with _SCHEMA_FOLDS_LOCK:
        current = _SCHEMA_FOLDS.get(storage.uri)
        if current is None or len(keys) >= len(current.instants):  # a time travel's shorter fold is not kept
            _SCHEMA_FOLDS[storage.uri] = done
            _SCHEMA_FOLDS.move_to_end(storage.uri)
            if len(_SCHEMA_FOLDS) > _SCHEMA_FOLDS_KEPT:
                _SCHEMA_FOLDS.popitem(last=False)
    return schema


# Fewer commits than this left to fold are read from their completed files (on S3 one request
# each, 10 at a time): fewer requests than reading the metadata table's files.
_FOLD_FROM_INDEX = 16


def schema_as_of(storage: Storage, config: TableConfig, timeline: Timeline, as_of: str | None,
                 index: MetadataIndex | None = None,
                 index_of: Callable[[], MetadataIndex | None] = lambda: None) -> pa.Schema:
    """The table's schema as of `as_of` (None: now), without the rest of its view. The commits
    this process has not folded yet are read from `index`, a metadata table already read; without
    one, `index_of()` reads it only when many commits are left to fold. (A commit's schema is the
    same in both places and no clean removes it, so unlike a file list it may be read after the
    listing, §18.5.)"""
    completed = [i for i in timeline.completed() if as_of is None or i.completion <= as_of]

    def metas_of(new: list[Instant]) -> dict[str, dict[str, Any]]:
        source = index
        if source is None and len(new) >= _FOLD_FROM_INDEX:
            source = index_of()
        return _metadata(storage, new, source, files=False)

    return table_schema(storage, config, completed, metas_of)


def _new_schemas(metas: Iterable[Mapping[str, Any]], seen: set[tuple]) -> Iterator[pa.Schema]:
    """The commit schemas that can change the table's, in order: a schema whose columns, names
    and types, were all `seen` before changes nothing (columns are added by name and widened by
    type), so each such set is parsed once."""
    for meta in metas:
        fields = meta.get("schema")
        if fields is None:
            continue
        shape = tuple((f["name"], f["type"] if isinstance(f["type"], str) else json.dumps(f["type"], sort_keys=True))
                      for f in fields)
        if shape not in seen:
            seen.add(shape)
            yield schema_from_json(fields)


def _metadata(storage: Storage, completed: list[Instant], index: MetadataIndex | None,
              files: bool = True) -> dict[str, dict[str, Any]]:
    """The commit metadata of `completed`, from `index` where it covers them; `files=False`:
    only their schemas are needed (what the index gives then has no `files`)."""
    if index is None or not index.has(FILES):
        return read_commit_metadatas(storage, completed)
    metas = index.file_metas(completed, files)
    for i in completed:
        if i.instant not in metas and i.action in (CLEAN, INDEXING):  # they add no files and no columns
            metas[i.instant] = {"files": []}
    # Not (yet) indexed: commits that completed after writing no entries.
    metas.update(read_commit_metadatas(storage, [i for i in completed if i.instant not in metas]))
    return {i.instant: metas[i.instant] for i in completed}


def _visible(inst: Instant, cutoff: str | None) -> bool:
    """Whether an overwrite whose completion is `cutoff` leaves the instant's files visible."""
    if cutoff is None:
        return True
    if inst.action == COMPACTION_COMMIT:
        return inst.instant >= cutoff  # a compaction planned before an overwrite holds older data
    return inst.completion >= cutoff


def slices_by_group(storage: Storage, view: TableView) -> dict[tuple[str, str], list[FileSlice]]:
    """(partition, file group) -> its file slices as of the view, newest first."""
    files: dict[str, list[str]] = defaultdict(list)
    for inst in view.completed:
        for f in view.metas[inst.instant]["files"]:
            if _visible(inst, view.cutoffs.of(f["partition"])):
                files[f["partition"]].append(f["name"])
    pending: dict[str, dict[str, str]] = defaultdict(dict)
    for tc in view.pending_compactions:
        for op in read_compaction_plan(storage, tc)["operations"]:
            pending[op["partition"]][op["file_group"]] = tc
    planned = _PlannedLogs(storage)
    out: dict[tuple[str, str], list[FileSlice]] = {}
    for partition in sorted(files):
        groups = build_file_slices(files[partition], view.completion, partition, pending.get(partition),
                                   functools.partial(planned, partition))
        for fg, slices in groups.items():
            out[(partition, fg)] = slices
    return out


class _PlannedLogs:
    """`(partition, file group, Tc)` -> the logs compaction `Tc`'s plan lists for the group, for
    file slicing's check of logs published late; None if the plan cannot be read (a table that
    another writer compacted). Plans are read (once each) only when slicing asks."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.by_plan: dict[str, dict[tuple[str, str], frozenset[str]] | None] = {}

    def __call__(self, partition: str, file_group: str, tc: str) -> frozenset[str] | None:
        if tc not in self.by_plan:
            try:
                ops = read_compaction_plan(self.storage, tc)["operations"]
                self.by_plan[tc] = {(op["partition"], op["file_group"]): frozenset(op["log_files"]) for op in ops}
            except FileNotFoundError:
                self.by_plan[tc] = None
        groups = self.by_plan[tc]
        return None if groups is None else groups.get((partition, file_group), frozenset())



def oldest_readable(storage: Storage, timeline: Timeline) -> str | None:
    """The oldest time a read can be as of: the first commit's completion, or the start of the
    window the cleaner retained."""
    done = [i for i in timeline.completed() if i.action in DATA_ACTIONS]
    if not done:
        return None
    return max(done[0].completion, earliest_retained(storage, timeline) or "")


def state_at(timeline: Timeline, when: str) -> str | None:
    """The state a read as of `when` sees, named by the completion time of the last instant
    completed at or before it (None: none had)."""
    return max((i.completion for i in timeline.completed() if i.completion <= when), default=None)


def check_readable(storage: Storage, timeline: Timeline, when: str, name: str) -> bool:
    """Refuse a read as of `when` before the oldest readable state, unless a savepoint keeps
    the state it would see (format.md §14.6); True for such a savepoint's read. It is planned
    from the commit files, not the metadata table (§18.5): the metadata table forgets the files
    cleans delete, so a file missing would drop rows instead of failing the read."""
    oldest = oldest_readable(storage, timeline)
    if oldest is None:
        raise InvalidOptionError(f"{name}={when}: the table has no completed commits yet")
    if when < oldest:
        state, kept = state_at(timeline, when), savepoint_times(storage)
        if state is not None and state in kept:
            return True
        why = ("the start of the window the cleaner retained; older files may have been deleted"
               if oldest == earliest_retained(storage, timeline) else "the first commit's completion")
        raise InvalidOptionError(
            f"{name}={when} is before the oldest state that can be read, {oldest} ({why}); "
            f"use a time at or after it{', or a savepoint (nbcc savepoints)' if kept else ''}"
        )
    return False


def earliest_begin(timeline: Timeline, window: str, needs_begin_state: bool) -> str:
    """The earliest begin of a range that a clean whose window starts at `window` left readable
    (format.md §12.7). The range holds every data commit after begin, so none may have completed
    before `window` (the clean may have deleted its files). A read that needs the state at begin
    (cdc, or an overwrite in the range) also needs that state to be the one at `window` without
    its commit: no compaction may have completed in between, and the commit at `window` must
    not be an overwrite (it hid the older files). The range then holds the oldest retained
    commit, which no range beginning at `window` can. BEFORE_ALL (any begin, `earliest` too)
    when nothing completed before `window`, as when a window by hours starts at the first
    commit: the state before it is empty, and every commit is retained."""
    done = timeline.completed()
    blocking = [i for i in done if i.completion < window
                and (i.action not in (CLEAN, INDEXING) if needs_begin_state else i.action in DATA_ACTIONS)]
    if not blocking:
        return BEFORE_ALL
    if needs_begin_state and any(i.completion == window and i.action in OVERWRITES for i in done):
        return window
    return max(i.completion for i in blocking)


def state_lost_at(timeline: Timeline, window: str, begin: str) -> str | None:
    """Where a range from `begin` would be refused only for the state at begin it needs (cdc, an
    overwrite in it): no data commit of it completed before `window`, but a compaction (or the
    overwrite at `window`) replaced the files of that state. What did, named; None otherwise
    (a range refused there lacks cleaned commits)."""
    first = earliest_begin(timeline, window, True)
    if not first > begin >= earliest_begin(timeline, window, False):
        return None
    done = [i for i in timeline.completed() if i.completion == first]
    what = {COMPACTION_COMMIT: "compaction", REPLACE_COMMIT: "overwrite",
            REPLACE_PARTITIONS: "partition overwrite"}.get(done[0].action, done[0].action) \
        if done else "instant"
    return (f"the {what} that completed at {first} replaced the files that state was read from, and the "
            "cleaner may have deleted them")
