"""Table services under load (issue 4, "Tests that must exist", second bullet).

Writers upsert overlapping keys into one local table without pause, while a compactor schedules
and executes compactions over and over (sometimes scheduling, letting writers commit more, and
only then running), a cleaner runs `clean(retain_commits=5)` every few commits (its window
widened to cover the reads in progress, as a deployment chooses its window to cover its longest
read: each reader says when its read began), and two reader threads read the snapshot all along:

- writers: 3 OS processes using the Python API (`Table.write`) and 1 Spark job series (a thread
  of the shared session);
- the compactor and the cleaner: one OS process each;
- readers: 2 threads of this process calling `Table.read()`.

The table is in event_time mode and every row carries an ordering value `ts` that is unique per
key over all writes (deletes too: upsert rows with `_nbcc_is_deleted` = true and a `ts`), so the
state after any set of commits does not depend on their order: per key the row with the greatest
`ts` among the commits completed by then wins, and the key is absent if that row is a delete.
From its own record of what each writer wrote (keyed by the instant the write produced) and the
completion times on the final timeline, the test computes reference(T) for every completion time
T, and checks:

- no writer fails or retries: every write returns, every process exits 0, no thread raises;
- every read equals reference(T) for some T, with no key twice; that T is at least the latest
  data commit completed before the read began, and a reader's successive reads never go back;
- nothing is lost or duplicated: the final `Table.read()` and Spark's read equal reference(latest);
- at least 2 compactions completed between writers' commits, one of them after writers committed
  more while it was scheduled; cleans deleted files while writers wrote; the timeline ends with
  every instant completed (nothing pending, nothing rolled back).

Pacing is event-driven, never timed: a process writer's commit c waits until c // 2 compactions
have been scheduled, so compactions are interleaved with the writes whatever the machine's speed.
"""

from __future__ import annotations

import json
import os
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
import pyspark_nbcc
from nbcc.clock import format_time
from soak import Reference, json_lines  # the reference fold, shared with the soak test

PROCESS_WRITERS = 3
SPARK_WRITER = PROCESS_WRITERS  # the writer number of the Spark job series
WRITERS = PROCESS_WRITERS + 1
COMMITS_PER_WRITER = 10
KEYS = 300
DELETE_FRACTION = 0.08
RETAIN_COMMITS = 5
CLEAN_EVERY_COMMITS = 3
READS = "reads"  # in the work folder: one file per reader naming when its read in progress began
READ_SLACK_S = 0.5  # for a read that began but has not said so yet when the cleaner looks
DEADLINE_S = 240  # a hang guard for one stage only: nothing asserts how long anything takes
# The hang guard of the whole run (the children's own deadline, the wait for the writers): the
# run took 70 s on 2 busy cores and 130 s with one more busy loop, too close to DEADLINE_S.
RUN_GUARD_S = 1200

DELETED = "_nbcc_is_deleted"
SCHEMA = pa.schema([
    pa.field("id", pa.int64()),
    pa.field("ts", pa.int64()),
    pa.field("writer", pa.string()),
    pa.field("commit", pa.int64()),
    pa.field("payload", pa.string()),
])
WRITE_SCHEMA = SCHEMA.append(pa.field(DELETED, pa.bool_()))
COLUMNS = SCHEMA.names

# A process writer: waits for "go", then for each commit c waits until c // 2 compactions are on
# the timeline, writes once (no retry: any exception fails the process) and records the instant
# the write returned.
WRITER_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import pyarrow.parquet as pq
    import nbcc

    uri, work, w, commits = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    table = nbcc.Table.open(uri)
    batches = [pq.read_table(work / f"w{w}-c{c}.parquet") for c in range(commits)]
    (work / f"ready-w{w}").write_text("ready")
    deadline = time.monotonic() + float(sys.argv[5])

    def wait(what, done):
        while not done():
            if time.monotonic() > deadline:
                sys.exit(f"writer {w}: gave up waiting for {what}")
            time.sleep(0.005)

    wait("go", (work / "go").exists)
    for c, data in enumerate(batches):
        wait(f"{c // 2} compactions", lambda: sum(
            1 for i in table.timeline() if i.action in ("compaction", "commit")) >= c // 2)
        instant = table.write(data)
        (work / f"step-w{w}-c{c}.tmp").write_text(instant)
        (work / f"step-w{w}-c{c}.tmp").rename(work / f"step-w{w}-c{c}")
""")

# The compactor: until the writers are done, compacts whenever there is something to compact,
# alternating two ways: compact at once (schedule + run), or schedule, wait until a data commit
# completes after the plan (writers keep writing), then run. Records each compaction as a JSON line.
COMPACTOR_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import nbcc

    uri, work = sys.argv[1], Path(sys.argv[2])
    table = nbcc.Table.open(uri)
    deadline = time.monotonic() + float(sys.argv[3])
    log = open(work / "compactions.jsonl", "a")
    done = lambda: (work / "writers-done").exists()
    n = 0
    while time.monotonic() < deadline:
        finishing = done()
        deferred = n % 2 == 1
        tc = table.schedule_compaction()
        if tc is not None:
            if deferred:
                while not done() and time.monotonic() < deadline and not any(
                        i.action == "deltacommit" and i.is_completed and i.completion > tc
                        for i in table.timeline()):
                    time.sleep(0.005)
            completion = table.run_compaction(tc)
            log.write(json.dumps({"instant": tc, "completion": completion,
                                  "mode": "deferred" if deferred else "direct"}) + "\\n")
            log.flush()
            n += 1
        if finishing:
            break
        if tc is None:
            time.sleep(0.01)
    else:
        sys.exit("compactor: deadline passed")
    log.close()
""")

# The cleaner: runs clean(retain_commits) every few data commits, after each new compaction and
# once more when the writers are done. Records each result as a JSON line.
CLEANER_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import nbcc
    from nbcc.clock import format_time

    uri, work = sys.argv[1], Path(sys.argv[2])
    retain, every = int(sys.argv[3]), int(sys.argv[4])
    reads, slack_s = work / sys.argv[6], float(sys.argv[7])

    def window(table, least):
        # The reads in progress need the state as of when they began: keep every commit since.
        times = [format_time(time.time_ns() // 1_000_000 - int(slack_s * 1000))]
        for f in reads.glob("*.json"):
            try:
                times.append(json.loads(f.read_text())["began"])
            except (OSError, ValueError, KeyError):
                continue  # gone: that read is over
        newer = sum(1 for i in table.timeline() if i.is_completed and i.action == "deltacommit"
                    and i.completion >= min(times))
        return max(least, newer + 1)

    table = nbcc.Table.open(uri)
    deadline = time.monotonic() + float(sys.argv[5])
    log = open(work / "cleans.jsonl", "a")
    last_data = last_compactions = 0
    while time.monotonic() < deadline:
        finishing = (work / "writers-done").exists()
        done = [i for i in table.timeline() if i.is_completed]
        data = sum(1 for i in done if i.action == "deltacommit")
        compactions = sum(1 for i in done if i.action == "commit")
        if finishing or data - last_data >= every or compactions > last_compactions:
            result = table.clean(retain_commits=window(table, retain))
            log.write(json.dumps({"instant": result.get("instant"), "data_commits_seen": data,
                                  "earliest_retained": result["earliest_retained"],
                                  "deleted": len(result["deleted"]),
                                  "rolled_back": result["rolled_back"]}) + "\\n")
            log.flush()
            last_data, last_compactions = data, compactions
        if finishing:
            break
        time.sleep(0.01)
    else:
        sys.exit("cleaner: deadline passed")
    log.close()
""")


# -- the data and the reference ------------------------------------------------------------------

def _rows(writer: int, commit: int) -> list[dict[str, Any]]:
    """Writer `writer`'s commit `commit`: upserts of a random subset of the keys (overlapping the
    other writers') and a few deletes. `ts` = random * 1000 + commit * 10 + writer is unique per
    key over all (writer, commit) pairs, deletes included."""
    rng = random.Random(f"nbcc-services-{writer}-{commit}")
    keys = rng.sample(range(KEYS), rng.randint(KEYS // 5, KEYS // 3))
    return [
        {"id": k, "ts": rng.randrange(1000) * 1000 + commit * 10 + writer, "writer": f"w{writer}",
         "commit": commit, "payload": f"w{writer}-c{commit}-k{k}", DELETED: rng.random() < DELETE_FRACTION}
        for k in keys
    ]


# -- the run -------------------------------------------------------------------------------------

def _spawn(script: Path, *args: Any) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(condition, what: str, procs: list[subprocess.Popen], guard_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + guard_s
    while not condition():
        failed = [p for p in procs if p.poll() not in (None, 0)]
        assert not failed, f"a process failed while waiting for {what}: {failed[0].communicate()}"
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def test_writers_compaction_cleaning_and_readers_run_together(spark, tmp_path):
    uri = str(tmp_path / "table")
    work = tmp_path / "work"
    (work / READS).mkdir(parents=True)
    nbcc.Table.create(uri, SCHEMA, "id", ordering_field="ts", buckets=4)
    table = nbcc.Table.open(uri)

    data = {(w, c): _rows(w, c) for w in range(WRITERS) for c in range(COMMITS_PER_WRITER)}
    for w in range(PROCESS_WRITERS):
        for c in range(COMMITS_PER_WRITER):
            pq.write_table(pa.Table.from_pylist(data[(w, c)], schema=WRITE_SCHEMA), work / f"w{w}-c{c}.parquet")
    scripts = {}
    for name, text in (("writer", WRITER_SCRIPT), ("compactor", COMPACTOR_SCRIPT), ("cleaner", CLEANER_SCRIPT)):
        scripts[name] = work / f"{name}.py"
        scripts[name].write_text(text)

    errors: list[tuple[str, BaseException]] = []
    go = threading.Event()
    stop_reading = threading.Event()
    spark_done: list[int] = []
    reads: dict[int, list[tuple[str | None, list[dict[str, Any]]]]] = {0: [], 1: []}

    def spark_writer() -> None:
        try:
            pyspark_nbcc.set_active_session(spark)  # this thread's JVM side must find "nbcc"
            frames = [spark.createDataFrame(pa.Table.from_pylist(data[(SPARK_WRITER, c)], schema=WRITE_SCHEMA))
                      for c in range(COMMITS_PER_WRITER)]
            go.wait()
            for c, df in enumerate(frames):
                df.write.format("nbcc").mode("append").save(uri)  # one job, one commit, no retry
                spark_done.append(c)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(("spark-writer", exc))

    def reader(r: int) -> None:
        try:
            mine = nbcc.Table.open(uri)
            said = work / READS / f"reader-{r}.json"
            while not stop_reading.is_set():
                began = format_time(time.time_ns() // 1_000_000)
                (work / READS / f"reader-{r}.tmp").write_text(json.dumps({"began": began}))
                os.replace(work / READS / f"reader-{r}.tmp", said)  # whole, for the cleaner
                # Every data commit completed before the read starts must be in what it returns.
                done = [i.completion for i in mine.timeline() if i.is_completed and i.action == "deltacommit"]
                floor = max(done, default=None)
                reads[r].append((floor, mine.read().to_pylist()))
                said.unlink()
                stop_reading.wait(0.01)  # leave the writers some CPU
        except BaseException as exc:  # noqa: BLE001
            errors.append((f"reader-{r}", exc))

    writers = [_spawn(scripts["writer"], uri, work, w, COMMITS_PER_WRITER, RUN_GUARD_S)
               for w in range(PROCESS_WRITERS)]
    compactor = _spawn(scripts["compactor"], uri, work, RUN_GUARD_S)
    cleaner = _spawn(scripts["cleaner"], uri, work, RETAIN_COMMITS, CLEAN_EVERY_COMMITS, RUN_GUARD_S, READS,
                     READ_SLACK_S)
    procs = writers + [compactor, cleaner]
    threads = [threading.Thread(target=spark_writer, name="spark-writer", daemon=True)]
    threads += [threading.Thread(target=reader, args=(r,), name=f"reader-{r}", daemon=True) for r in reads]
    try:
        for t in threads:
            t.start()
        _wait(lambda: all((work / f"ready-w{w}").exists() for w in range(PROCESS_WRITERS)), "writers ready", procs)
        (work / "go").write_text("go")
        go.set()

        _wait(lambda: all(p.poll() is not None for p in writers) and not threads[0].is_alive(),
              "the writers to finish", procs, RUN_GUARD_S)
        (work / "writers-done").write_text("done")
        _wait(lambda: compactor.poll() is not None and cleaner.poll() is not None,
              "the compactor and the cleaner to finish", procs)
        # A few more reads of the quiet table, then stop the readers.
        settled = {r: len(reads[r]) for r in reads}
        _wait(lambda: all(len(reads[r]) >= settled[r] + 2 for r in reads) or bool(errors), "final reads", procs)
        stop_reading.set()
        for t in threads:
            t.join(timeout=DEADLINE_S)
        outputs = {name: p.communicate(timeout=DEADLINE_S) for name, p in
                   [(f"writer-{w}", writers[w]) for w in range(PROCESS_WRITERS)]
                   + [("compactor", compactor), ("cleaner", cleaner)]}
    finally:
        go.set()
        stop_reading.set()
        (work / "go").write_text("go")
        (work / "writers-done").write_text("done")
        for p in procs:
            if p.poll() is None:
                p.kill()

    # -- every writer, service and reader finished without an error, first time ------------------
    assert not [t.name for t in threads if t.is_alive()], "a thread did not finish"
    assert not errors, "threads raised:\n" + "\n".join(f"{n}: {e!r}"[:4000] for n, e in errors)
    for name, p in zip(outputs, procs):
        out, err = outputs[name]
        assert p.returncode == 0, f"{name} exited {p.returncode}:\n{out}\n{err[-4000:]}"
    assert spark_done == list(range(COMMITS_PER_WRITER))

    timeline = table.timeline()
    assert [i for i in timeline if i.state != "completed"] == [], "the timeline ends with pending or rolled back instants"
    deltas = [i for i in timeline if i.action == "deltacommit"]
    assert len(deltas) == WRITERS * COMMITS_PER_WRITER, "a write made more (or fewer) than one commit"
    completion_of = {i.instant: i.completion for i in timeline}

    # -- each writer's record of what it wrote, keyed by instant ---------------------------------
    written: dict[str, list[dict[str, Any]]] = {}
    for w in range(PROCESS_WRITERS):
        instants = [(work / f"step-w{w}-c{c}").read_text() for c in range(COMMITS_PER_WRITER)]
        assert instants == sorted(instants), f"writer {w}'s commits ran one after another"
        for c, instant in enumerate(instants):
            assert instant not in written
            written[instant] = data[(w, c)]
    # The Spark jobs ran one after another, so their instants (the data commits no process
    # returned) are in commit order.
    spark_instants = sorted(i.instant for i in deltas if i.instant not in written)
    assert len(spark_instants) == COMMITS_PER_WRITER
    for c, instant in enumerate(spark_instants):
        written[instant] = data[(SPARK_WRITER, c)]
    reference = Reference([(completion_of[i], i, rows) for i, rows in written.items()], COLUMNS)

    # The data exercises what it should: every writer wins some keys, deletes win some keys.
    final_writers = {r["writer"] for r in reference.final}
    assert final_writers == {f"w{w}" for w in range(WRITERS)}
    assert 0 < KEYS - len(reference.final) < KEYS // 4

    # -- every read is the table at some consistent point ----------------------------------------
    total_reads = 0
    for r, observed in reads.items():
        assert len(observed) >= 3, f"reader {r} read only {len(observed)} times"
        previous: list[str] = [Reference.BEFORE_ALL]
        for n, (floor, rows) in enumerate(observed):
            ids = [row["id"] for row in rows]
            assert len(ids) == len(set(ids)), f"reader {r} read {n}: a key appears twice"
            at = reference.matches(rows)
            assert at, f"reader {r} read {n} ({len(rows)} rows) is no consistent state of the table"
            if floor is not None:
                assert max(at) >= floor, (
                    f"reader {r} read {n} misses a commit that completed (at {floor}) before the read began; "
                    f"it matches the states at {at}")
            assert max(at) >= min(previous), f"reader {r} read {n} went back in time ({at} after {previous})"
            previous = at
        total_reads += len(observed)
        # The last reads saw the quiet table: everything.
        assert reference.latest in previous

    # -- compactions ran between the writers' commits --------------------------------------------
    compactions = json_lines(work / "compactions.jsonl")
    completed_compactions = {i.instant: i.completion for i in timeline if i.action == "commit"}
    assert {c["instant"]: c["completion"] for c in compactions} == completed_compactions
    data_completions = sorted(completion_of[i] for i in written)
    between = [c for c in compactions
               if data_completions[0] < c["completion"] < data_completions[-1]]
    assert len(between) >= 2, f"only {len(between)} compactions completed while writers wrote: {compactions}"
    # Scheduled, then writers committed more, then run.
    deferred = [c for c in compactions if c["mode"] == "deferred"
                and any(c["instant"] < t < c["completion"] for t in data_completions)]
    assert deferred, f"no compaction saw commits complete between its plan and its completion: {compactions}"

    # -- cleans ran throughout and deleted files while writers wrote -----------------------------
    cleans = json_lines(work / "cleans.jsonl")
    assert all(c["rolled_back"] == [] for c in cleans), "a live write was rolled back"
    clean_instants = {i.instant: i.completion for i in timeline if i.action == "clean"}
    assert {c["instant"] for c in cleans if c["instant"]} == set(clean_instants)
    deleting = [c for c in cleans if c["deleted"] and clean_instants[c["instant"]] < data_completions[-1]]
    assert deleting, f"no clean deleted files while writers wrote: {cleans}"

    # -- nothing lost or duplicated --------------------------------------------------------------
    got = sorted(table.read().to_pylist(), key=lambda row: row["id"])
    assert len({row["id"] for row in got}) == len(got)
    assert got == reference.final
    spark_rows = sorted((row.asDict() for row in spark.read.format("nbcc").load(uri).collect()),
                        key=lambda row: row["id"])
    assert spark_rows == reference.final

    print(f"\n{total_reads} reads, {len(compactions)} compactions ({len(between)} between commits, "
          f"{len(deferred)} deferred with commits in between), {len(cleans)} cleans "
          f"({sum(c['deleted'] for c in cleans)} files deleted), "
          f"{sum(1 for i, c in completion_of.items() if any(i < tc < c for tc in completed_compactions) and i in written)} "
          "data commits straddling a compaction plan")
