"""Scenario 7: four writer processes upserting overlapping keys at the same time.

nbcc: each writer makes COMMITS commits of 2.5% of the rows into one table; we count failed
commits and retries (nbcc writers never retry) and compare the aggregate rows/s with one writer
doing one writer's share alone. deltalake: four processes run the same merges concurrently on a
Delta table; we count the merges that fail with a commit conflict. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import make_rows, upsert_batch  # noqa: E402

COMMITS = 4
FRACTION = 0.025


def nbcc_writer(uri: str, rows: int, writer: int, start, results) -> None:
    import nbcc

    table = nbcc.Table.open(uri)
    batches = [upsert_batch(rows, FRACTION, seed=100 + writer * 10 + c, ts=100 + c) for c in range(COMMITS)]
    start.wait()
    failed = 0
    for b in batches:
        try:
            table.write(b)
        except Exception:  # noqa: BLE001 - counted
            failed += 1
    results.put((failed, sum(b.num_rows for b in batches), time.perf_counter()))


def delta_writer(uri: str, rows: int, writer: int, start, results) -> None:
    import deltalake

    batches = [upsert_batch(rows, FRACTION, seed=100 + writer * 10 + c, ts=100 + c) for c in range(COMMITS)]
    start.wait()
    failed = 0
    for b in batches:
        try:
            (deltalake.DeltaTable(uri).merge(b, predicate="t.id = s.id", source_alias="s", target_alias="t")
             .when_matched_update_all().when_not_matched_insert_all().execute())
        except Exception:  # noqa: BLE001 - a commit conflict: the merge failed
            failed += 1
    results.put((failed, sum(b.num_rows for b in batches), time.perf_counter()))


def run(target, uri: str, rows: int, writers: int) -> dict:
    ctx = mp.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(uri, rows, w, start, results)) for w in range(writers)]
    for p in procs:
        p.start()
    time.sleep(2)  # let every writer import and prepare its batches
    t0 = time.perf_counter()
    start.set()
    outs = [results.get() for _ in procs]
    for p in procs:
        p.join()
    wall = max(o[2] for o in outs) - t0
    return {"failed": sum(o[0] for o in outs), "rows": sum(o[1] for o in outs), "wall_s": wall,
            "rows_per_s": sum(o[1] for o in outs) / wall}


def main() -> None:
    import deltalake

    p = argparse.ArgumentParser()
    p.add_argument("--table", required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--work", required=True)
    a = p.parse_args()
    single_uri = a.table + "-single"
    shutil.copytree(a.table, single_uri)
    one = run(nbcc_writer, single_uri, a.rows, 1)
    four = run(nbcc_writer, a.table, a.rows, 4)
    delta_uri = str(Path(a.work) / "s7-delta")
    shutil.rmtree(delta_uri, ignore_errors=True)
    deltalake.write_deltalake(delta_uri, make_rows(a.rows))
    delta = run(delta_writer, delta_uri, a.rows, 4)
    print(json.dumps({
        "nbcc_commits": 4 * COMMITS, "nbcc_failed": four["failed"], "nbcc_retries": 0,
        "nbcc_rows_per_s_1_writer": round(one["rows_per_s"]), "nbcc_rows_per_s_4_writers": round(four["rows_per_s"]),
        "speedup_4_vs_1": round(four["rows_per_s"] / one["rows_per_s"], 2),
        "deltalake_merges": 4 * COMMITS, "deltalake_failed": delta["failed"],
    }))


if __name__ == "__main__":
    main()
