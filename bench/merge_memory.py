"""Scenario 9: peak resident memory of one process merging one large file slice.

Builds a table with one bucket (so one file group) of ROWS rows in five commits (the last four
update 10% each), then, in a fresh process, merges the slice as a read task does and reports the
process's peak RSS; then, in another, compacts it (the other task that merges a whole slice) and
reports that process's peak RSS, the compaction's time and a key lookup's time in the compacted
file group (the median of LOOKUPS, through the Python API). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build(uri: str, rows: int) -> None:
    import nbcc
    from run import make_rows, upsert_batch

    base = make_rows(rows)
    table = nbcc.Table.create(uri, base.schema, "id", ordering_field="ts", buckets=1)
    step = 2_000_000
    for start in range(0, rows, step):  # the first state, written in pieces as a job would
        table.write(base.slice(start, step))
    for i in range(4):
        table.write(upsert_batch(rows, 0.10, seed=20 + i, ts=20 + i))


def peak_rss_kb() -> int:
    """This process's peak resident set. Not getrusage's ru_maxrss: Linux carries that across
    fork and exec, so a child started by the large build process would report the parent's peak
    (measured: 1.96 GB that way, 1.09 GB by VmHWM, for the same merge)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def peak_rss_gb() -> float:
    return round(peak_rss_kb() / 1024 / 1024, 2)


def merge(uri: str) -> None:
    import nbcc
    from nbcc.scan import iter_task

    table = nbcc.Table.open(uri)
    plan = table.plan()
    out = sum(piece.num_rows for task in plan.tasks for piece in iter_task(table.storage, plan, task))
    print(json.dumps({"rows_out": out, "files": sum(len(t.files) for t in plan.tasks),
                      "peak_rss_gb": peak_rss_gb()}))


LOOKUPS = 15


def compact(uri: str, rows: int) -> None:
    import nbcc
    from run import median_time

    table = nbcc.Table.open(uri)
    t0 = time.perf_counter()
    table.compact()
    took = time.perf_counter() - t0
    peak = peak_rss_gb()  # before the lookups, which only read
    keys = iter(random.Random(9).sample(range(rows), LOOKUPS + 1))

    def lookup() -> None:
        k = next(keys)  # a different key each time: no cache answers it
        found = table.read(filter=[("id", "=", k)]).num_rows
        assert found == 1, f"key {k}: {found} rows"
    print(json.dumps({"compaction_s": round(took, 2), "compaction_peak_rss_gb": peak,
                      "compacted_lookup_s": round(median_time(lookup, LOOKUPS), 4)}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--merge-only", default=None)
    p.add_argument("--compact-only", default=None)
    a = p.parse_args()
    if a.merge_only:
        merge(a.merge_only)
        return
    if a.compact_only:
        compact(a.compact_only, a.rows)
        return
    uri = str(Path(a.work) / "s9")
    build(uri, a.rows)
    figures = {}
    for step in ("--merge-only", "--compact-only"):  # each in a fresh process: its own peak
        out = subprocess.run([sys.executable, __file__, "--rows", str(a.rows), "--work", a.work, step, uri],
                             capture_output=True, text=True, check=True)
        figures.update(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
