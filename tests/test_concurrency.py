"""Concurrency: OS processes (Python API) and Spark jobs (threads of the one session) upsert
overlapping keys into one table at the same time, with no conflict and no retry.

Every row carries an ordering value that is unique per key across all writes, so the final
state does not depend on the order in which commits complete: for each key the row with the
greatest ordering value wins. The test computes that reference on its own from the data it hands
to the writers.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

import nbcc

PROCESS_WRITERS = 4
SPARK_WRITERS = 2
COMMITS_PER_WRITER = 5
KEYS = 300
BARRIER_TIMEOUT_S = 120

SCHEMA = pa.schema([
    pa.field("id", pa.int64()),
    pa.field("ts", pa.int64()),
    pa.field("writer", pa.string()),
    pa.field("commit", pa.int64()),
    pa.field("payload", pa.string()),
])

# A process writer: before its commit c it waits at gate c (a file the test creates), then writes
# and reports the instant the write returned. Any exception fails the process (there is no retry).
WRITER_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import pyarrow.parquet as pq
    import nbcc

    uri, work, writer, commits = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    table = nbcc.Table.open(uri)
    batches = [pq.read_table(work / f"w{writer}-c{c}.parquet") for c in range(commits)]
    (work / f"ready-{writer}").write_text("ready")
    for c, data in enumerate(batches):
        deadline = time.monotonic() + 240  # per gate: the whole run may take longer on a slow machine
        while not (work / f"gate-{c}").exists():
            if time.monotonic() > deadline:
                sys.exit(f"gate {c} never opened")
            time.sleep(0.002)
        instant = table.write(data)
        (work / f"step-{writer}-{c}.tmp").write_text(instant)
        (work / f"step-{writer}-{c}.tmp").rename(work / f"step-{writer}-{c}")
""")


def _rows(writer: int, commit: int) -> list[dict[str, Any]]:
    """The rows writer `writer` upserts in its commit `commit`: a random subset of the keys,
    overlapping the other writers'. `ts` = random * 100 + commit * 10 + writer is unique per key
    over all (writer, commit) pairs, so exactly one row per key has the greatest ts."""
    rng = random.Random(f"nbcc-concurrency-{writer}-{commit}")
    keys = rng.sample(range(KEYS), rng.randint(KEYS // 3, KEYS // 2))
    return [
        {"id": k, "ts": rng.randrange(50) * 100 + commit * 10 + writer, "writer": f"w{writer}",
         "commit": commit, "payload": f"w{writer}-c{commit}-k{k}"}
        for k in keys
    ]


def _reference(all_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    best: dict[int, dict[str, Any]] = {}
    for row in all_rows:
        cur = best.get(row["id"])
        assert cur is None or cur["ts"] != row["ts"], "test data must have no ties"
        if cur is None or row["ts"] > cur["ts"]:
            best[row["id"]] = row
    return [best[k] for k in sorted(best)]


def _wait_for(paths: list[Path], procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while not all(p.exists() for p in paths):
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, f"a writer process exited before the barrier: {dead[0].communicate()}"
        assert time.monotonic() < deadline, "writer processes never became ready"
        time.sleep(0.01)


def _open_gates(uri: str, work: Path, procs: list[subprocess.Popen], threads: list[threading.Thread]) -> None:
    """Open gate c (the processes' commit c) once the Spark jobs have started 2c+1 instants and
    every process finished its commit c-1, so that the process commits are spread over the
    Spark jobs' run instead of all landing before Spark's first job is planned. Purely
    event-driven: if the Spark threads end early, the remaining gates open at once."""
    table = nbcc.Table.open(uri)
    for c in range(COMMITS_PER_WRITER):
        deadline = time.monotonic() + BARRIER_TIMEOUT_S * 2  # per gate, as the writers wait
        while True:
            dead = [p for p in procs if p.poll() not in (None, 0)]
            assert not dead, f"a writer process failed: {dead[0].communicate()}"
            assert time.monotonic() < deadline, f"gate {c} could not open"
            previous_done = c == 0 or all((work / f"step-{w}-{c - 1}").exists() for w in range(PROCESS_WRITERS))
            if previous_done:
                mine = {(work / f"step-{w}-{k}").read_text() for w in range(PROCESS_WRITERS) for k in range(c)}
                spark_started = len({i.instant for i in table.timeline()} - mine)
                if spark_started >= 2 * c + 1 or not any(t.is_alive() for t in threads):
                    break
            time.sleep(0.005)
        (work / f"gate-{c}").write_text("open")


def test_processes_and_spark_jobs_write_concurrently_without_conflict(spark, tmp_path):
    uri = str(tmp_path / "table")
    work = tmp_path / "work"
    work.mkdir()
    nbcc.Table.create(uri, SCHEMA, "id", ordering_field="ts", buckets=4)

    writers = list(range(PROCESS_WRITERS + SPARK_WRITERS))
    data = {(w, c): _rows(w, c) for w in writers for c in range(COMMITS_PER_WRITER)}
    for (w, c), rows in data.items():
        if w < PROCESS_WRITERS:
            pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), work / f"w{w}-c{c}.parquet")

    # -- the Python API writers: separate OS processes --------------------------------------
    script = work / "writer.py"
    script.write_text(WRITER_SCRIPT)
    procs = [
        subprocess.Popen([sys.executable, str(script), uri, str(work), str(w), str(COMMITS_PER_WRITER)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for w in range(PROCESS_WRITERS)
    ]
    try:
        # -- the Spark writers: threads of the one session, each a series of append jobs ----
        errors: list[BaseException] = []
        finished: list[int] = []
        go = threading.Event()

        def spark_writer(w: int) -> None:
            try:
                # Built in this thread: createDataFrame also makes the session active for this
                # thread's JVM side, where Spark looks Python data sources up.
                frames = [spark.createDataFrame(pa.Table.from_pylist(data[(w, c)], schema=SCHEMA))
                          for c in range(COMMITS_PER_WRITER)]
                go.wait()
                for df in frames:
                    df.write.format("nbcc").mode("append").save(uri)
                finished.append(w)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=spark_writer, args=(w,), name=f"spark-writer-{w}", daemon=True)
                   for w in range(PROCESS_WRITERS, PROCESS_WRITERS + SPARK_WRITERS)]
        for t in threads:
            t.start()

        _wait_for([work / f"ready-{w}" for w in range(PROCESS_WRITERS)], procs)
        go.set()  # the Spark jobs start; the processes follow them gate by gate
        _open_gates(uri, work, procs, threads)

        for t in threads:
            t.join(timeout=300)
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        go.set()  # never leave a Spark thread waiting at the barrier
        for p in procs:
            if p.poll() is None:
                p.kill()

    # -- every write succeeded, first time --------------------------------------------------
    assert not [t.name for t in threads if t.is_alive()], "a Spark writer thread did not finish"
    assert not errors, "Spark writes failed:\n" + "\n".join(str(e)[:4000] for e in errors)
    assert sorted(finished) == list(range(PROCESS_WRITERS, PROCESS_WRITERS + SPARK_WRITERS))
    for w, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"writer process {w} failed:\n{out}\n{err}"
    process_instants = {w: [(work / f"step-{w}-{c}").read_text() for c in range(COMMITS_PER_WRITER)]
                        for w in range(PROCESS_WRITERS)}
    for w, instants in process_instants.items():
        assert len(instants) == COMMITS_PER_WRITER, (w, instants)

    # -- the timeline -----------------------------------------------------------------------
    table = nbcc.Table.open(uri)
    timeline = table.timeline()
    total_writes = (PROCESS_WRITERS + SPARK_WRITERS) * COMMITS_PER_WRITER
    assert [i for i in timeline if i.state != "completed"] == [], "a write left a pending instant"
    deltacommits = [i for i in timeline if i.action == "deltacommit" and i.state == "completed"]
    assert len(deltacommits) == len(timeline) == total_writes
    for i in deltacommits:
        assert i.completion > i.instant, i
    times = [i.instant for i in deltacommits] + [i.completion for i in deltacommits]
    assert len(set(times)) == len(times), "instant and completion times must all be distinct"
    on_timeline = {i.instant for i in deltacommits}
    returned = [x for instants in process_instants.values() for x in instants]
    assert len(set(returned)) == len(returned) and set(returned) <= on_timeline
    # Each writer's own commits happen one after another: its instants increase.
    for instants in process_instants.values():
        assert instants == sorted(instants)
    # The writes really ran at the same time: one began (took its instant) while another was in
    # flight (between its instant and its completion), and so did a process's and a Spark job's.
    spark_instants = on_timeline - set(returned)
    assert len(spark_instants) == SPARK_WRITERS * COMMITS_PER_WRITER
    overlapping = [(i.instant, j.instant) for i in deltacommits for j in deltacommits
                   if i.instant < j.instant < i.completion]
    assert overlapping, "no two writes overlapped: the test ran them one after another"
    assert any((a in spark_instants) != (b in spark_instants) for a, b in overlapping), \
        "no process write overlapped a Spark write"

    # -- the final snapshot -----------------------------------------------------------------
    expected = _reference([row for rows in data.values() for row in rows])
    assert len(expected) == KEYS  # every key was written at least once
    assert {r["writer"] for r in expected} == {f"w{w}" for w in writers}  # every writer wins some

    got = sorted(table.read().to_pylist(), key=lambda r: r["id"])
    assert got == expected

    spark_rows = sorted((r.asDict() for r in spark.read.format("nbcc").load(uri).collect()),
                        key=lambda r: r["id"])
    assert spark_rows == expected
