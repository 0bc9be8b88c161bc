"""Scenario 7: four writer processes upserting overlapping keys at the same time.

nbcc: each writer makes COMMITS commits of 2.5% of the rows into one table, after warming up
on a scratch table of its own (a fresh process's first commit costs twice a later one: lazy
imports, first calls into Arrow's kernels, thread start-up); we count failed commits and
retries and compare the aggregate rows/s with one writer doing one writer's share alone. Four
writers also do the same work each on a copy of the table of its own: what four writer
processes make on this machine with nothing shared, a reference for what sharing costs. Each
figure is the median of ROUNDS rounds; a round runs one writer, four on one table, four on
separate tables and the machine's own two-process speedup in turn, so drift hits all alike.
Every timed span starts once each process has prepared its work, at one barrier. The four
writer processes are started and warmed up once, and serve every run of the scenario.

nbcc writers never retry a commit; "retries" counts what the layers below retried: storage
calls nbcc.storage retried after a transient error. Lock CAS races lost (a writer re-reading the
lock and trying again, which is waiting, not a failed commit) are reported apart. deltalake: four
processes run the first DELTA_MERGES of the same upserts as merges concurrently on a Delta table;
we count the merges that fail with a commit conflict. Prints one JSON line.
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import delta_upsert, make_rows, upsert_batch  # noqa: E402

COMMITS = 16
FRACTION = 0.025
WARM_UP_COMMITS = 2
ROUNDS = 5
WORKERS = 4  # writer processes
# A deltalake merge rewrites the files of the whole 2M-row table (3-4 s each, four at once on 2
# cores): 8 a writer show the share that fail as well as 16 did, in half the time.
DELTA_MERGES = 8


class _RetryCount(logging.Handler):
    """Counts nbcc.storage's "attempt N failed (...), retrying" records."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "retrying" in record.getMessage():
            self.count += 1


def released(start) -> float:
    """Wait at the `start` barrier (every process prepared); the time the timed work began.
    Bounded, so that a worker whose main process died does not wait forever (the main process
    waits up to 11 min for every worker to be ready)."""
    start.wait(timeout=900)
    return time.perf_counter()


def writer_batches(rows: int, writer: int) -> list:
    """The upserts of one writer: seeds of its own, so no two writers send the same batch."""
    return [upsert_batch(rows, FRACTION, seed=100 + writer * 100 + c, ts=100 + c) for c in range(COMMITS)]


def nbcc_writer(uri: str, batches: list, start, retries: _RetryCount) -> dict:
    import nbcc

    table = nbcc.Table.open(uri)  # a table of its own: its lock statistics are this run's
    retried_before = retries.count
    began = released(start)
    failed = 0
    for b in batches:
        try:
            table.write(b)
        except Exception:  # noqa: BLE001 - counted
            failed += 1
    lock = table.clock.stats
    return {"failed": failed, "rows": sum(b.num_rows for b in batches), "began": began,
            "end": time.perf_counter(), "retries": retries.count - retried_before,
            "cas_conflicts": lock.cas_conflicts, "lock_wait_ms": lock.total_wait_ms,
            "lock_hold_ms": lock.total_hold_ms}


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


def delta_writer(uri: str, batches: list, start, retries: _RetryCount) -> dict:
    merges = batches[:DELTA_MERGES]
    began = released(start)
    failed = 0
    for b in merges:
        try:
            delta_upsert(uri, b)
        except Exception:  # noqa: BLE001 - a commit conflict: the merge failed
            failed += 1
    return {"failed": failed, "rows": sum(b.num_rows for b in merges), "began": began,
            "end": time.perf_counter(), "retries": 0, "cas_conflicts": 0,
            "lock_wait_ms": 0.0, "lock_hold_ms": 0.0}


def spin(n: int, batches: list, start, retries: _RetryCount) -> dict:
    began = released(start)
    x = 0
    for i in range(n):
        x += i
    return {"began": began, "end": time.perf_counter()}


TASKS = {"nbcc": nbcc_writer, "delta": delta_writer, "spin": spin}


def serve(writer: int, rows: int, like: str, inbox, results, barriers: dict) -> None:
    """A worker process: prepares once (imports, its batches, a warm-up on a scratch table made
    like the table at `like`), then runs the tasks sent to its `inbox` until it gets None."""
    import deltalake  # noqa: F401 - imported before any start, so never timed
    import nbcc

    retries = _RetryCount()
    logger = logging.getLogger("nbcc.storage")  # its retries log one record each
    logger.addHandler(retries)
    logger.setLevel(logging.DEBUG)
    batches = writer_batches(rows, writer)
    warm_up(nbcc.Table.open(like), f"{like}-warm-up-{writer}", batches[:WARM_UP_COMMITS])
    while (task := next_task(inbox)) is not None:
        name, arg, parties = task
        start = barriers[parties]
        try:
            results.put(TASKS[name](arg, batches, start, retries))
        except BaseException as exc:  # noqa: BLE001 - reported to the main process, which stops
            start.abort()  # whoever waits at the start is released with an error
            results.put({"error": f"worker {writer}, task {name}: {exc!r}"})
            return


def next_task(inbox) -> Any:
    """The next task sent, or None once the main process is gone (killed by run.py's timeout,
    say): a worker must not wait for it forever."""
    while True:
        try:
            return inbox.get(timeout=5)
        except queue.Empty:
            if not mp.parent_process().is_alive():
                return None


class Workers:
    """WORKERS processes, spawned and prepared once for the whole scenario; each run hands
    some of them a task. Started afresh for every run (12 a round), preparing took 3-5 s a run
    on 2 cores, more than the timed writing itself (1-3 s)."""

    def __init__(self, rows: int, like: str):
        ctx = mp.get_context("spawn")
        # One barrier per number of parties (the main process is one): a run of k workers
        # releases them together once each has prepared its task and waits.
        self.barriers = {k: ctx.Barrier(k + 1) for k in range(1, WORKERS + 1)}
        self.inboxes = [ctx.Queue() for _ in range(WORKERS)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=serve, args=(w, rows, like, self.inboxes[w], self.results, self.barriers),
                                  daemon=True) for w in range(WORKERS)]
        for p in self.procs:
            p.start()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc: Any) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.exitcode is None:
                p.kill()

    def _failed(self, what: str) -> RuntimeError:
        codes = [p.exitcode for p in self.procs]
        try:
            reason = self.results.get(timeout=5).get("error", "")
        except queue.Empty:
            reason = ""
        return RuntimeError(f"a worker process did not {what}; exit codes {codes} {reason}".rstrip())

    def run(self, task: str, args: list[Any]) -> tuple[float, float, list[dict]]:
        """Run `task` with `args[w]` on worker w, all released together at one barrier once each
        has prepared its work; (first begin, last end, what each returned). Each worker reports
        when it began and ended (perf_counter is one system-wide monotonic clock on Linux), so no
        preparation falls inside the span."""
        start = self.barriers[len(args)]
        for w, arg in enumerate(args):
            self.inboxes[w].put((task, arg, len(args)))
        # A worker that dies or fails before the start (an import error, out of memory) must not
        # hang the run: wait for all to be ready while watching that none has exited or failed.
        deadline = time.monotonic() + 600
        while start.n_waiting < len(args):
            if start.broken or any(p.exitcode is not None for p in self.procs) or time.monotonic() > deadline:
                start.abort()
                raise self._failed("get ready")
            time.sleep(0.01)
        try:
            start.wait(timeout=60)
        except threading.BrokenBarrierError:
            raise self._failed("start") from None
        try:
            outs = [self.results.get(timeout=600) for _ in args]
        except queue.Empty:
            raise self._failed("report") from None
        errors = [o["error"] for o in outs if "error" in o]
        if errors:
            raise RuntimeError("; ".join(errors))
        return min(o["began"] for o in outs), max(o["end"] for o in outs), outs


def machine_speedup(workers: Workers, procs: int = 2, n: int = 10_000_000) -> float:
    """A rough gauge of the parallel speedup this machine allows just now: the throughput of
    `procs` processes each spinning the same CPU-bound loop, over one process alone. On a 2-core
    VM whose cores are hyperthreads or are shared with other guests it is below 2 and changes
    from minute to minute, so it is measured in every round, next to the writers. It is noisy
    (one short loop a side; it has read above 2 with 2 processes), so it is no ceiling: four
    writers on separate tables are (7)'s reference."""
    walls = {}
    for k in (1, procs):
        t0, end, _ = workers.run("spin", [n] * k)
        walls[k] = end - t0
    return procs * walls[1] / walls[procs]


def run(workers: Workers, task: str, uris: list[str]) -> dict:
    """Worker w writes uris[w], all at once."""
    t0, end, outs = workers.run(task, uris)
    wall = end - t0

    def total(key: str) -> float:
        return sum(o[key] for o in outs)
    return {"failed": total("failed"), "rows": total("rows"), "wall_s": wall,
            "rows_per_s": total("rows") / wall, "retries": total("retries"),
            "cas_conflicts": total("cas_conflicts"),
            # the share of the writers' time spent waiting for, and holding, the table lock
            "lock_wait_share": total("lock_wait_ms") / 1000 / (len(uris) * wall),
            "lock_hold_share": total("lock_hold_ms") / 1000 / (len(uris) * wall)}


def main() -> None:
    import deltalake

    p = argparse.ArgumentParser()
    p.add_argument("--table", required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--rounds", type=int, default=ROUNDS)
    a = p.parse_args()
    ones, fours, separate, machine = [], [], [], []
    delta_uri = str(Path(a.work) / "s7-delta")
    shutil.rmtree(delta_uri, ignore_errors=True)
    with Workers(a.rows, a.table) as workers:
        for r in range(a.rounds):  # every round on fresh copies of the same table
            for runs, writers, apart in ((ones, 1, False), (fours, WORKERS, False), (separate, WORKERS, True)):
                uri = f"{a.table}-{writers}-{'apart' if apart else 'shared'}-{r}"
                uris = [f"{uri}-{w}" for w in range(writers)] if apart else [uri] * writers
                tables = sorted(set(uris))
                try:
                    for t in tables:
                        # Linked, not copied: nbcc never writes into a file that exists (metadata
                        # goes through a new file linked or renamed into place; a data file's name
                        # holds an instant issued after the base table's last one, or a random
                        # token), so a copy's writes cannot reach the base table, and there are
                        # no copied bytes to write back (the four separate tables' copies took
                        # 4 s of os.sync a round).
                        shutil.copytree(a.table, t, copy_function=os.link)
                    # The earlier runs' files written back before the writers start, so that no
                    # run's fsyncs wait for them.
                    os.sync()
                    runs.append(run(workers, "nbcc", uris))
                finally:
                    for t in tables:
                        shutil.rmtree(t, ignore_errors=True)
            machine.append(machine_speedup(workers))
        one_rps = statistics.median(o["rows_per_s"] for o in ones)
        four_rps = statistics.median(o["rows_per_s"] for o in fours)
        separate_rps = statistics.median(o["rows_per_s"] for o in separate)
        if any(o["failed"] for o in separate):  # a reference that failed to write measures nothing
            raise RuntimeError(f"writers on separate tables failed {sum(o['failed'] for o in separate)} commits")
        deltalake.write_deltalake(delta_uri, make_rows(a.rows))
        delta = run(workers, "delta", [delta_uri] * WORKERS)
    print(json.dumps({
        "nbcc_commits": a.rounds * WORKERS * COMMITS, "nbcc_failed": sum(o["failed"] for o in fours),
        "nbcc_retries": sum(o["retries"] for o in fours),
        "nbcc_lock_cas_races": sum(o["cas_conflicts"] for o in fours),
        "nbcc_rows_per_s_1_writer": round(one_rps), "nbcc_rows_per_s_4_writers": round(four_rps),
        "speedup_4_vs_1": round(four_rps / one_rps, 2),
        "nbcc_lock_wait_pct_4_writers": round(100 * statistics.median(o["lock_wait_share"] for o in fours), 1),
        "nbcc_lock_hold_pct_4_writers": round(100 * statistics.median(o["lock_hold_share"] for o in fours), 1),
        "machine_2_process_speedup": round(statistics.median(machine), 2),
        "nbcc_rows_per_s_4_separate_tables": round(separate_rps),
        "separate_tables_4_vs_1": round(separate_rps / one_rps, 2),
        "deltalake_merges": WORKERS * DELTA_MERGES, "deltalake_failed": delta["failed"],
    }))


if __name__ == "__main__":
    main()
