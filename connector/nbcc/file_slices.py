"""File slicing by completion time (RFC-66, "Pseudocode for File Slicing").

Per file group, the barriers are the instants of its base files, newest first. A committed log file
joins the slice of the greatest barrier below its *completion* time, so a log that started before
a compaction but completed after it lands in the new slice and is never lost. A group (or the part
of it older than every base file) with no base file takes the instant of its earliest-completed log
as its barrier. Files whose instant has no completion time (pending or failed writes) belong to no
slice and never decide a barrier, so they cannot hide committed files (Hudi #19774).

A compaction's plan lists the logs of the slice its base file replaces. A log that completed
before the compaction's instant but is not listed was published late (its commit's put outlasted
the table lock's lease, and the scheduler's listing missed it): it joins the compaction's slice,
as if it had completed after it, so its rows are not hidden behind a base file that lacks them.
Only the two newest barriers are checked: older slices are superseded and never read.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Mapping

from .filenames import BaseFile, LogFile, parse_data_file


@dataclass(frozen=True)
class FileSlice:
    file_group_id: str
    base_instant: str
    base_file: str | None
    log_files: list[str] = field(default_factory=list)  # in log order
    partition: str = ""

    def file_names(self) -> list[str]:
        return ([self.base_file] if self.base_file else []) + list(self.log_files)


def build_file_slices(
    file_names: Iterable[str],
    completion_times: Mapping[str, str | None],
    partition: str = "",
    pending_compactions: Mapping[str, str] | None = None,
    planned_logs: Callable[[str, str], Collection[str] | None] | None = None,
) -> dict[str, list[FileSlice]]:
    """`{file_group_id: [FileSlice, ...]}` newest slice first, for the files of one partition.

    `completion_times` maps instant -> completion time, or None for a pending or failed instant;
    files of instants it does not know are treated as not committed. `pending_compactions` maps
    a file group to the instant Tc of a compaction planned but not completed: Tc is a barrier with
    no base file yet, so logs completing after Tc start a new slice (readers merge that slice with
    the one before it until the compaction completes). `planned_logs(file_group, Tc)`: the log
    names that the plan of compaction `Tc` lists for the group (None: not known), for the rule
    above on late logs.
    """
    bases: dict[str, list[BaseFile]] = defaultdict(list)
    logs: dict[str, list[tuple[str, str, LogFile]]] = defaultdict(list)  # (completion, name, log)
    for name in file_names:
        f = parse_data_file(name)
        completion = completion_times.get(f.instant)
        if completion is None:
            continue
        if isinstance(f, BaseFile):
            bases[f.file_group_id].append(f)
        else:
            logs[f.file_group_id].append((completion, name, f))

    pending = dict(pending_compactions or {})
    result: dict[str, list[FileSlice]] = {}
    for fg in sorted(set(bases) | set(logs)):
        base_of: dict[str, str | None] = {b.instant: b.name for b in bases[fg]}
        if fg in pending and pending[fg] not in base_of:
            base_of[pending[fg]] = None
        barriers = sorted(base_of)  # ascending, for bisect
        members: dict[str, list[tuple[str, LogFile]]] = defaultdict(list)
        older: list[tuple[str, str, LogFile]] = []  # completed before every base file
        # The logs that the plans of the two newest barriers list (None: plan not known).
        listed: dict[int, Collection[str] | None] = {}
        if planned_logs and logs[fg]:
            listed = {j: planned_logs(fg, barriers[j]) for j in range(max(0, len(barriers) - 2), len(barriers))}
        for completion, name, log in logs[fg]:
            i = bisect.bisect_left(barriers, completion) - 1  # greatest barrier < completion
            while listed.get(i + 1) is not None and name not in listed[i + 1]:
                i += 1  # published after the next barrier's plan was made: after that barrier
            if i >= 0:
                members[barriers[i]].append((name, log))
            else:
                older.append((completion, name, log))
        slices = [
            FileSlice(fg, b, base_of[b], _in_log_order(members[b]), partition) for b in barriers
        ]
        if older:
            first = min(older, key=lambda cl: cl[0])[2]
            slices.append(FileSlice(fg, first.instant, None, _in_log_order([(n, l) for _, n, l in older]), partition))
        slices.sort(key=lambda s: s.base_instant, reverse=True)
        result[fg] = slices
    return result


def _in_log_order(logs: list[tuple[str, LogFile]]) -> list[str]:
    return [name for name, _ in sorted(logs, key=lambda nl: nl[1].order_key)]
