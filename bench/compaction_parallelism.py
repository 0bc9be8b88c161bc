"""Seconds of one compaction in one process (`Table.run_compaction`) by how many file groups it
merges at once, on local disk: the same plan executed again at each parallelism, alternated.

    python bench/compaction_parallelism.py                 # 2M rows, 8 file groups, 3 upserts of 10%
    python bench/compaction_parallelism.py --rows 10000000 --parallelism 1 2 4

It times the merge step of `run_compaction` (`_merge_file_groups`), not the whole call, which
completes the instant and would then have nothing left to run: each execution writes its own
base files (a plan may be executed again, format.md §15.3), so the runs compare like for like.
The table is deleted at the end.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa

import nbcc
from nbcc.compaction import _merge_file_groups, check_parallelism, execution_token, read_compaction_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--buckets", type=int, default=8)
    parser.add_argument("--parallelism", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    folder = tempfile.mkdtemp(prefix="nbcc-bench-")
    try:
        table = nbcc.Table.create(f"{folder}/t", pa.schema([("id", pa.int64()), ("s", pa.string()), ("ts", pa.int64()),
                                                            ("x", pa.float64())]),
                                  "id", ordering_field="ts", buckets=args.buckets)

        def rows(ids: np.ndarray, ts: int) -> pa.Table:
            return pa.table({"id": ids, "s": pa.array(np.char.add("v", ids.astype(str))),
                             "ts": np.full(len(ids), ts), "x": rng.random(len(ids))})

        table.write(rows(np.arange(args.rows), 0))
        for i in range(3):
            table.write(rows(rng.choice(args.rows * 11 // 10, args.rows // 10, replace=False), i + 1))
        tc = table.schedule_compaction()
        operations = read_compaction_plan(table.storage, tc)["operations"]
        times: dict[int, list[float]] = {p: [] for p in args.parallelism}
        for _ in range(args.repeats):
            for p in args.parallelism:
                start = time.perf_counter()
                _merge_file_groups(table.storage, table.config, tc, operations, execution_token(),
                                   check_parallelism(p), None)
                times[p].append(time.perf_counter() - start)
        for p, t in times.items():
            print(f"parallelism {p}: median {statistics.median(t):.2f} s of {', '.join(f'{x:.2f}' for x in t)}")
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
