"""Scenario 7: four writer processes upserting overlapping keys at the same time.

nbcc: each writer makes COMMITS commits of 2.5% of the rows into one table, after warming up
on a scratch table of its own (a fresh process's first commit costs twice a later one: lazy
imports, first calls into Arrow's kernels, thread start-up); we count failed commits and
retries and compare the aggregate rows/s with one writer doing one writer's share alone. Four
writers also do the same work each on a copy of the table of its own: what four writer
processes make on this machine with nothing shared, a reference for what sharing costs. Each
figure is the median of ROUNDS rounds; a round runs one writer, four on one table, four on
separate tables and the machine's own two-process speedup in turn, so drift hits all alike.
Every timed span starts once each process has prepared its work, at one barrier.

nbcc writers never retry a commit; "retries" counts what the layers below retried: storage
calls nbcc.storage retried after a transient error. Lock CAS races lost (a writer re-reading the
lock and trying again, which is waiting, not a failed commit) are reported apart. deltalake: four
processes run the same merges concurrently on a Delta table; we count the merges that fail with a
commit conflict. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import delta_upsert, make_rows, upsert_batch  # noqa: E402

COMMITS = 16
FRACTION = 0.025
WARM_UP_COMMITS = 2
ROUNDS = 5


class _RetryCount(logging.Handler):
    """Counts nbcc.storage's "attempt N failed (...), retrying" records."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "retrying" in record.getMessage():
            self.count += 1


def released(start) -> float:
    """Wait at the `start` barrier (every process prepared); the time the timed work began."""
    start.wait()
    return time.perf_counter()


def writer_batches(rows: int, writer: int) -> list:
    """The upserts of one writer: seeds of its own, so no two writers send the same batch."""
    return [upsert_batch(rows, FRACTION, seed=100 + writer * 100 + c, ts=100 + c) for c in range(COMMITS)]


def nbcc_writer(uri: str, rows: int, writer: int, start, results) -> None:
    import nbcc

    retries = _RetryCount()
    logger = logging.getLogger("nbcc.storage")  # its retries log one record each
    logger.addHandler(retries)
    logger.setLevel(logging.DEBUG)
    table = nbcc.Table.open(uri)
    batches = writer_batches(rows, writer)
    warm_up(table, f"{uri}-warm-up-{writer}", batches[:WARM_UP_COMMITS])
    began = released(start)
    failed = 0
    for b in batches:
        try:
            table.write(b)
        except Exception:  # noqa: BLE001 - counted
            failed += 1
    lock = table.clock.stats
    results.put({"failed": failed, "rows": sum(b.num_rows for b in batches), "began": began,
                 "end": time.perf_counter(), "retries": retries.count, "cas_conflicts": lock.cas_conflicts,
                 "lock_wait_ms": lock.total_wait_ms, "lock_hold_ms": lock.total_hold_ms})


def warm_up(table, uri: str, batches: list) -> None:
    """Write `batches` to a scratch table at `uri` made like `table`, then remove it."""
    import nbcc

    c = table.config
    shutil.rmtree(uri, ignore_errors=True)
    scratch = nbcc.Table.create(uri, c.schema, c.record_key, ordering_field=c.ordering_field,
                                partition_by=c.partition_by, buckets=c.buckets, merge_mode=c.merge_mode)
    for b in batches:
        scratch.write(b)
    shutil.rmtree(uri, ignore_errors=True)


def delta_writer(uri: str, rows: int, writer: int, start, results) -> None:
    import deltalake  # noqa: F401 - imported before the start, so not timed

    batches = writer_batches(rows, writer)
    began = released(start)
    failed = 0
    for b in batches:
        try:
            delta_upsert(uri, b)
        except Exception:  # noqa: BLE001 - a commit conflict: the merge failed
            failed += 1
    results.put({"failed": failed, "rows": sum(b.num_rows for b in batches), "began": began,
                 "end": time.perf_counter(), "retries": 0, "cas_conflicts": 0,
                 "lock_wait_ms": 0.0, "lock_hold_ms": 0.0})


def _spin(n: int, start, results) -> None:
    began = released(start)
    x = 0
    for i in range(n):
        x += i
    results.put({"began": began, "end": time.perf_counter()})


def started_together(target, args: list[tuple]) -> tuple[float, float, list[dict]]:
    """Run `target(*a, start, results)` for each `a` in its own process, all released together
    once every process has prepared its work (imports, batches, warm-up) and waits at the
    `start` barrier (`released`); (first begin, last end, what each put on `results`). Each
    process reports when it began and ended (perf_counter is one system-wide monotonic clock on
    Linux), so no process's preparation falls inside the span: four processes preparing on 2
    cores took seconds longer than one, which a fixed pause before the start used to count as
    writing time."""
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(len(args) + 1), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, start, results)) for a in args]
    for p in procs:
        p.start()

    def failed(what: str) -> RuntimeError:
        codes = [p.exitcode for p in procs]
        for p in procs:
            p.kill()
        return RuntimeError(f"a writer process did not {what}; exit codes {codes}")

    # A process that dies before the start or before reporting (an import error, out of memory)
    # must not hang the run: wait for all to be ready while watching that none has exited.
    deadline = time.monotonic() + 600
    while start.n_waiting < len(procs):
        if any(p.exitcode is not None for p in procs) or time.monotonic() > deadline:
            start.abort()  # whoever already waits is released with an error
            raise failed("get ready")
        time.sleep(0.05)
    try:
        start.wait(timeout=60)
    except threading.BrokenBarrierError:
        raise failed("start") from None
    try:
        outs = [results.get(timeout=600) for _ in procs]
    except queue.Empty:
        raise failed("report") from None
    for p in procs:
        p.join()
    return min(o["began"] for o in outs), max(o["end"] for o in outs), outs


def machine_speedup(procs: int = 2, n: int = 10_000_000) -> float:
    """A rough gauge of the parallel speedup this machine allows just now: the throughput of
    `procs` processes each spinning the same CPU-bound loop, over one process alone. On a 2-core
    VM whose cores are hyperthreads or are shared with other guests it is below 2 and changes
    from minute to minute, so it is measured in every round, next to the writers. It is noisy
    (one short loop a side; it has read above 2 with 2 processes), so it is no ceiling: four
    writers on separate tables are (7)'s reference."""
    walls = {}
    for k in (1, procs):
        t0, end, _ = started_together(_spin, [(n,)] * k)
        walls[k] = end - t0
    return procs * walls[1] / walls[procs]


def run(target, uris: list[str], rows: int) -> dict:
    """One process per entry of `uris` (writer w writes uris[w]) running `target` at once."""
    writers = len(uris)
    t0, end, outs = started_together(target, [(u, rows, w) for w, u in enumerate(uris)])
    wall = end - t0

    def total(key: str) -> float:
        return sum(o[key] for o in outs)
    return {"failed": total("failed"), "rows": total("rows"), "wall_s": wall,
            "rows_per_s": total("rows") / wall, "retries": total("retries"),
            "cas_conflicts": total("cas_conflicts"),
            # the share of the writers' time spent waiting for, and holding, the table lock
            "lock_wait_share": total("lock_wait_ms") / 1000 / (writers * wall),
            "lock_hold_share": total("lock_hold_ms") / 1000 / (writers * wall)}


def main() -> None:
    import deltalake

    p = argparse.ArgumentParser()
    p.add_argument("--table", required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--rounds", type=int, default=ROUNDS)
    a = p.parse_args()
    ones, fours, separate, machine = [], [], [], []
    for r in range(a.rounds):  # every round on fresh copies of the same table
        for runs, writers, apart in ((ones, 1, False), (fours, 4, False), (separate, 4, True)):
            uri = f"{a.table}-{writers}-{'apart' if apart else 'shared'}-{r}"
            uris = [f"{uri}-{w}" for w in range(writers)] if apart else [uri] * writers
            tables = sorted(set(uris))
            try:
                for t in tables:
                    shutil.copytree(a.table, t)
                # Written back before the writers start, so that no run's fsyncs wait for it
                # (the separate tables copy four times the bytes).
                os.sync()
                runs.append(run(nbcc_writer, uris, a.rows))
            finally:
                for t in tables:
                    shutil.rmtree(t, ignore_errors=True)
        machine.append(machine_speedup())
    one_rps = statistics.median(o["rows_per_s"] for o in ones)
    four_rps = statistics.median(o["rows_per_s"] for o in fours)
    separate_rps = statistics.median(o["rows_per_s"] for o in separate)
    if any(o["failed"] for o in separate):  # a reference that failed to write measures nothing
        raise RuntimeError(f"writers on separate tables failed {sum(o['failed'] for o in separate)} commits")
    delta_uri = str(Path(a.work) / "s7-delta")
    shutil.rmtree(delta_uri, ignore_errors=True)
    deltalake.write_deltalake(delta_uri, make_rows(a.rows))
    delta = run(delta_writer, [delta_uri] * 4, a.rows)
    print(json.dumps({
        "nbcc_commits": a.rounds * 4 * COMMITS, "nbcc_failed": sum(o["failed"] for o in fours),
        "nbcc_retries": sum(o["retries"] for o in fours),
        "nbcc_lock_cas_races": sum(o["cas_conflicts"] for o in fours),
        "nbcc_rows_per_s_1_writer": round(one_rps), "nbcc_rows_per_s_4_writers": round(four_rps),
        "speedup_4_vs_1": round(four_rps / one_rps, 2),
        "nbcc_lock_wait_pct_4_writers": round(100 * statistics.median(o["lock_wait_share"] for o in fours), 1),
        "nbcc_lock_hold_pct_4_writers": round(100 * statistics.median(o["lock_hold_share"] for o in fours), 1),
        "machine_2_process_speedup": round(statistics.median(machine), 2),
        "nbcc_rows_per_s_4_separate_tables": round(separate_rps),
        "separate_tables_4_vs_1": round(separate_rps / one_rps, 2),
        "deltalake_merges": 4 * COMMITS, "deltalake_failed": delta["failed"],
    }))


if __name__ == "__main__":
    main()
