"""Structured streaming: the nbcc sink (one commit per micro-batch, exactly once across replays,
crashes and concurrent queries) and the nbcc source (offsets are completion times)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.errors import StreamingQueryException

import nbcc
from nbcc.errors import InvalidOptionError, SchemaError
from nbcc.filenames import make_token
from nbcc.stream import KEEP_CLAIMS, check_owner, check_stream_id, claim_batch, commit_batch, prune_claims
from nbcc.timeline import create_requested
from nbcc.writer import prepare

ROOT = Path(__file__).resolve().parents[1]
IN_SCHEMA = "id long, v string, ts long"
ARROW_SCHEMA = pa.schema([("id", pa.int64()), ("v", pa.string()), ("ts", pa.int64())])
TIMEOUT_S = 300


# -- helpers -----------------------------------------------------------------------------------

def _rows(ids, v, ts=1):
    ids = list(ids)
    return pa.table({"id": ids, "v": [f"{v}{i}" for i in ids], "ts": [ts] * len(ids)}, schema=ARROW_SCHEMA)


def _inputs(folder: Path, tables: list[pa.Table]) -> Path:
    """One Parquet file per table, with increasing modification times: Spark's file source takes
    them in that order, one per micro-batch with maxFilesPerTrigger=1."""
    folder.mkdir(parents=True, exist_ok=True)
    start = time.time() - 1000
    for n, t in enumerate(tables):
        path = folder / f"part-{n:03d}.parquet"
        pq.write_table(t, path)
        os.utime(path, (start + n, start + n))
    return folder


def _file_stream(spark, folder: Path):
    return spark.readStream.schema(IN_SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(folder))


def _sink(df, uri: str, checkpoint: Path, fmt: str = "nbcc", **options):
    w = df.writeStream.format(fmt).option("checkpointLocation", str(checkpoint))
    for k, v in {"record_key": "id", "ordering_field": "ts", "buckets": "4", **options}.items():
        w = w.option(k, v)
    return w.trigger(availableNow=True).start(uri)


def _run(query) -> None:
    query.awaitTermination(TIMEOUT_S)
    assert not query.isActive, "the streaming query did not finish in time"
    if query.exception() is not None:
        raise query.exception()


def _process_all_available(query, timeout_s: float = TIMEOUT_S) -> None:
    """query.processAllAvailable(), which has no timeout of its own, bounded: a query that never
    catches up is stopped and fails the test instead of hanging the run."""
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            query.processAllAvailable()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            failure.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(timeout_s)
    if waiter.is_alive():
        query.stop()
        raise AssertionError(f"the streaming query did not process all available data in {timeout_s} s")
    if failure:
        raise failure[0]


def _data_commits(uri: str) -> list[dict]:
    """The completed data commits' metadata, read from the timeline files, in completion order."""
    folder = Path(uri) / ".nbcc" / "timeline"
    out = []
    for name in os.listdir(folder):
        times, _, action = name.partition(".")
        if action in ("deltacommit", "replacecommit") and "_" in times:
            meta = json.loads((folder / name).read_text())
            out.append({**meta, "completion": times.split("_")[1]})
    return sorted(out, key=lambda m: m["completion"])


def _spark_commits(checkpoint: Path) -> list[int]:
    """The batch ids Spark recorded as committed in its checkpoint."""
    return sorted(int(n) for n in os.listdir(checkpoint / "commits") if n.isdigit())


def _offset(checkpoint: Path, batch_id: int) -> dict:
    """The source offset Spark recorded for the end of a micro-batch."""
    return json.loads((checkpoint / "offsets" / str(batch_id)).read_text().splitlines()[-1])


def _ids(table: pa.Table) -> list[int]:
    return sorted(table.column("id").to_pylist())


def _collecting_stream(spark, uri: str, checkpoint: Path, *, available_now: bool = True, summary=None, **options):
    """A stream from the nbcc source whose micro-batches are collected as (batch id, sorted ids),
    or as summary(rows of the micro-batch)."""
    batches: list = []
    reader = spark.readStream.format("nbcc")
    for k, v in options.items():
        reader = reader.option(k, v)

    def collect(df, batch_id):
        if summary is not None:
            batches.append(summary(df.collect()))
        else:
            batches.append((batch_id, sorted(r.id for r in df.select("id").collect())))

    w = reader.load(uri).writeStream.foreachBatch(collect).option("checkpointLocation", str(checkpoint))
    # Without availableNow: poll twice a second (the default polls in a tight loop).
    w = w.trigger(availableNow=True) if available_now else w.trigger(processingTime="0.5 seconds")
    return w.start(), batches


# -- sink ----------------------------------------------------------------------------------------

def test_each_micro_batch_is_one_commit_with_its_stream_and_batch_id(spark, tmp_path):
    uri = str(tmp_path / "t")
    inputs = _inputs(tmp_path / "in", [
        _rows(range(0, 10), "a"),
        _rows(range(10, 20), "a"),
        _rows(range(0, 0), "a"),  # an empty micro-batch: no commit
        _rows(range(5, 15), "b", ts=2),  # updates 5..14
    ])
    # Several tasks per micro-batch: they share one instant.
    query = _sink(_file_stream(spark, inputs).repartition(3), uri, tmp_path / "ckpt", userMetadata="orders feed")
    _run(query)

    commits = _data_commits(uri)
    assert [(c["action"], c["stream_id"], c["batch_id"], c["rows"]) for c in commits] == [
        ("deltacommit", query.id, 0, 10), ("deltacommit", query.id, 1, 10), ("deltacommit", query.id, 3, 10)]
    assert [(c.operation, c.parameters) for c in nbcc.Table.open(uri).history()] == [
        ("upsert", {"user_metadata": "orders feed", "stream_id": query.id, "batch_id": b}) for b in (3, 1, 0)]
    assert len({f["name"].rsplit("_", 1)[1].split("-")[0] for f in commits[0]["files"]}) > 1, \
        "expected the files of several tasks in one commit"
    assert _spark_commits(tmp_path / "ckpt") == [0, 1, 2, 3]
    got = nbcc.Table.open(uri).read().sort_by("id").to_pylist()
    expected = [{"id": i, "v": f"{'b' if 5 <= i < 15 else 'a'}{i}", "ts": 2 if 5 <= i < 15 else 1}
                for i in range(20)]
    assert got == expected


def test_a_replayed_batch_that_was_committed_is_skipped(spark, tmp_path):
    uri, ckpt = str(tmp_path / "t"), tmp_path / "ckpt"
    inputs = _inputs(tmp_path / "in", [_rows(range(0, 5), "a"), _rows(range(5, 10), "a")])
    _run(_sink(_file_stream(spark, inputs), uri, ckpt))
    before = _data_commits(uri)
    assert [c["batch_id"] for c in before] == [0, 1]

    # Spark forgets that it committed batch 1 and replays it (same batch id, same data).
    (ckpt / "commits" / "1").unlink()
    (ckpt / "commits" / ".1.crc").unlink(missing_ok=True)  # Hadoop's checksum of it
    _run(_sink(_file_stream(spark, inputs), uri, ckpt))

    assert (ckpt / "commits" / "1").exists(), "Spark did not replay batch 1"
    assert _data_commits(uri) == before
    assert _ids(nbcc.Table.open(uri).read()) == list(range(10))


KILLABLE = '''
"""An nbcc sink that freezes in the commit of one micro-batch (before or after the nbcc commit),
after writing a marker file, so that a test can SIGKILL the whole application right there."""
import os
import time

from pyspark_nbcc import DefaultSource
from pyspark_nbcc.streaming import NbccStreamWriter

KILL_AT, KILL_BATCH, MARKER = os.environ["KILL_AT"], int(os.environ["KILL_BATCH"]), os.environ["MARKER"]


class FreezingWriter(NbccStreamWriter):
    def commit(self, messages, batchId):
        if batchId == KILL_BATCH and KILL_AT == "before_commit":
            self._freeze(messages)
        super().commit(messages, batchId)
        if batchId == KILL_BATCH and KILL_AT == "after_commit":
            self._freeze(messages)

    def _freeze(self, messages):
        with open(MARKER + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(MARKER + ".tmp", MARKER)
        deadline = time.monotonic() + 120  # never outlive the test by much, even if orphaned
        while time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(1)


class FreezingSource(DefaultSource):
    @classmethod
    def name(cls):
        return "nbcc_freezing"

    def streamWriter(self, schema, overwrite):
        w = super().streamWriter(schema, overwrite)
        return FreezingWriter(w.config, w.template, w.stream_id, w.max_log_file_bytes, w.compaction_trigger)
'''

CHILD = '''
import sys
from pyspark.sql import SparkSession
from freezing_sink import FreezingSource

inputs, checkpoint, uri = sys.argv[1:4]
spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "2").getOrCreate())
spark.dataSource.register(FreezingSource)
df = spark.readStream.schema("id long, v string, ts long").option("maxFilesPerTrigger", 1).parquet(inputs)
(df.repartition(2).writeStream.format("nbcc_freezing").option("checkpointLocation", checkpoint)
   .option("record_key", "id").option("ordering_field", "ts").option("buckets", "4")
   .trigger(availableNow=True).start(uri).awaitTermination())
'''


def _run_child_until_frozen(tmp_path: Path, inputs: Path, ckpt: Path, uri: str, kill_at: str, batch: int) -> None:
    """Run a streaming query in a child process until its sink freezes in the commit of `batch`,
    then SIGKILL the child and everything it started (its JVM and Python workers)."""
    (tmp_path / "freezing_sink.py").write_text(KILLABLE)
    (tmp_path / "child.py").write_text(CHILD)
    marker = tmp_path / "frozen"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "KILL_AT": kill_at, "KILL_BATCH": str(batch), "MARKER": str(marker)}
    with open(tmp_path / "child.log", "wb") as logfile:
        child = subprocess.Popen([sys.executable, str(tmp_path / "child.py"), str(inputs), str(ckpt), uri],
                                 env=env, stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not marker.exists():
            assert child.poll() is None, (
                f"the child exited before freezing:\n{(tmp_path / 'child.log').read_text()[-3000:]}")
            assert time.monotonic() < deadline, "the child did not reach the freezing point in time"
            time.sleep(0.2)
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the child's own session: its JVM and workers
        child.wait(timeout=60)
        if marker.exists():  # the committing worker runs in Spark's daemon's process group
            try:
                os.kill(int(marker.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_killed_between_the_sink_commit_and_sparks_checkpoint_each_row_lands_once(spark, tmp_path):
    uri, ckpt = str(tmp_path / "t"), tmp_path / "ckpt"
    inputs = _inputs(tmp_path / "in", [_rows(range(0, 10), "a"), _rows(range(10, 20), "a"),
                                       _rows(range(20, 30), "a")])
    _run_child_until_frozen(tmp_path, inputs, ckpt, uri, "after_commit", batch=1)

    # Killed right after nbcc committed batch 1 and before Spark recorded it.
    assert [c["batch_id"] for c in _data_commits(uri)] == [0, 1]
    assert not (ckpt / "commits" / "1").exists()
    stream_id = _data_commits(uri)[0]["stream_id"]

    _run(_sink(_file_stream(spark, inputs).repartition(2), uri, ckpt))  # restart: Spark replays batch 1

    commits = _data_commits(uri)
    assert [(c["stream_id"], c["batch_id"], c["rows"]) for c in commits] == [
        (stream_id, 0, 10), (stream_id, 1, 10), (stream_id, 2, 10)]
    assert (ckpt / "commits" / "1").exists() and (ckpt / "commits" / "2").exists()
    got = nbcc.Table.open(uri).read(include_meta_columns=True)
    assert _ids(got) == list(range(30))
    assert sorted(set(got.column("_nbcc_commit_time").to_pylist())) == sorted(c["instant"] for c in commits)


def _killed_before_batch_1_commit(tmp_path):
    """Three batches of 10 rows; the application killed after batch 1's tasks wrote their files,
    before its commit. Returns the table's uri, the checkpoint, the inputs and the pending instant."""
    uri, ckpt = str(tmp_path / "t"), tmp_path / "ckpt"
    inputs = _inputs(tmp_path / "in", [_rows(range(0, 10), "a"), _rows(range(10, 20), "a"),
                                       _rows(range(20, 30), "a")])
    _run_child_until_frozen(tmp_path, inputs, ckpt, uri, "before_commit", batch=1)
    pending = [i.instant for i in nbcc.Table.open(uri).timeline() if i.state in ("requested", "inflight")]
    assert len(pending) == 1
    return uri, ckpt, inputs, pending


def test_a_batch_killed_before_its_commit_is_committed_once_when_replayed(spark, tmp_path):
    uri, ckpt, inputs, pending = _killed_before_batch_1_commit(tmp_path)

    # Batch 1's tasks wrote their files into a pending instant; nothing of it is visible.
    table = nbcc.Table.open(uri)
    written_before = {n for n in os.listdir(uri) if pending[0] in n}
    assert written_before
    assert _ids(table.read()) == list(range(10))

    _run(_sink(_file_stream(spark, inputs).repartition(2), uri, ckpt))  # replays batch 1

    commits = _data_commits(uri)
    assert [(c["batch_id"], c["rows"]) for c in commits] == [(0, 10), (1, 10), (2, 10)]
    assert commits[1]["instant"] == pending[0], "the replay re-commits the batch's pending instant"
    assert _ids(nbcc.Table.open(uri).read()) == list(range(30))
    # The killed run's files are not part of the commit; the cleaner deletes them as orphans.
    committed = {f["name"] for f in commits[1]["files"]}
    assert not committed & written_before
    nbcc.Table.open(uri).clean()
    assert {n for n in os.listdir(uri) if pending[0] in n} == committed
    assert _ids(nbcc.Table.open(uri).read()) == list(range(30))


def test_a_batch_killed_before_its_commit_and_rolled_back_is_written_again_once(spark, tmp_path):
    uri, ckpt, inputs, pending = _killed_before_batch_1_commit(tmp_path)

    table = nbcc.Table.open(uri)
    assert any(pending[0] in n for n in os.listdir(uri))
    # The application is dead: a cleaner finds the batch's heartbeat expired and rolls it back.
    table.clean(heartbeat_timeout_s=0)
    assert {i.instant: i.state for i in table.timeline()}[pending[0]] == "rolledback"
    assert not [n for n in os.listdir(uri) if pending[0] in n]

    _run(_sink(_file_stream(spark, inputs).repartition(2), uri, ckpt))  # replays batch 1

    commits = _data_commits(uri)
    assert [(c["batch_id"], c["rows"]) for c in commits] == [(0, 10), (1, 10), (2, 10)]
    again = commits[1]["instant"]
    assert again > pending[0], "the replay writes batch 1 in a new instant, after the rolled-back one"
    states = {i.instant: i.state for i in table.timeline()}
    assert states[pending[0]] == "rolledback" and states[again] == "completed"
    got = nbcc.Table.open(uri).read(include_meta_columns=True).sort_by("id")
    assert _ids(got) == list(range(30))
    assert {r["_nbcc_commit_time"] for r in got.to_pylist() if 10 <= r["id"] < 20} == {again}


def _overlap_rows(ids, v, even_ts, odd_ts):
    ids = list(ids)
    return pa.table({"id": ids, "v": [f"{v}{i}" for i in ids],
                     "ts": [even_ts if i % 2 == 0 else odd_ts for i in ids]}, schema=ARROW_SCHEMA)


def _gated_source(uri: str, gates: dict):
    """A data source named nbcc_gated whose sink, before committing batch `b` of stream `s`,
    waits until the timeline holds the completed commit `gates[(s, b)]` (another stream's batch):
    commits of two queries then complete in an order known in advance, without timing."""
    from pyspark_nbcc import DefaultSource
    from pyspark_nbcc.streaming import NbccStreamWriter

    # Defined in here, so that Spark pickles them by value into the Python worker that runs the
    # sink's commit (another process, which cannot import this test module).
    def committed(stream_id, batch_id):
        from nbcc.timeline import read_commit_metadata
        table = nbcc.Table.open(uri)
        metas = (read_commit_metadata(table.storage, i) for i in table.timeline() if i.state == "completed")
        return any((m.get("stream_id"), m.get("batch_id")) == (stream_id, batch_id) for m in metas)

    class GatedWriter(NbccStreamWriter):
        def commit(self, messages, batchId):
            wait_for = gates.get((self.stream_id, batchId))
            deadline = time.monotonic() + TIMEOUT_S  # never hangs the test, whatever goes wrong
            while wait_for is not None and not committed(*wait_for):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gave up waiting for commit {wait_for}")
                time.sleep(0.1)
            super().commit(messages, batchId)

    class GatedSource(DefaultSource):
        @classmethod
        def name(cls):
            return "nbcc_gated"

        def streamWriter(self, schema, overwrite):
            w = super().streamWriter(schema, overwrite)
            return GatedWriter(w.config, w.template, w.stream_id, w.max_log_file_bytes, w.compaction_trigger)

    return GatedSource


def test_two_streaming_queries_write_one_table_at_once(spark, tmp_path):
    uri = str(tmp_path / "t")
    nbcc.Table.create(uri, ARROW_SCHEMA, "id", ordering_field="ts", buckets=4)
    # Both queries upsert keys 15..29. There the greater ts wins whatever the commit order: a's
    # rows for even keys, b's for odd keys.
    a = _inputs(tmp_path / "a", [_overlap_rows(range(i * 10, i * 10 + 10), "a", 2, 1) for i in range(3)])
    b = _inputs(tmp_path / "b", [_overlap_rows(range(15 + i * 10, 25 + i * 10), "b", 1, 2) for i in range(3)])
    # a's batch 0 commits after b's batch 0, and b's batch 1 after a's batch 0: interleaved.
    spark.dataSource.register(_gated_source(uri, {("a", 0): ("b", 0), ("b", 1): ("a", 0)}))
    qa = _sink(_file_stream(spark, a), uri, tmp_path / "ckpt-a", fmt="nbcc_gated", stream_id="a")
    qb = _sink(_file_stream(spark, b), uri, tmp_path / "ckpt-b", fmt="nbcc_gated", stream_id="b")
    _run(qa)
    _run(qb)

    commits = [(c["stream_id"], c["batch_id"]) for c in _data_commits(uri)]
    assert sorted(commits) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)]
    assert commits.index(("b", 0)) < commits.index(("a", 0)) < commits.index(("b", 1))
    assert {i.state for i in nbcc.Table.open(uri).timeline()} == {"completed"}  # nothing failed
    assert _spark_commits(tmp_path / "ckpt-a") == _spark_commits(tmp_path / "ckpt-b") == [0, 1, 2]

    def winner(k):
        if k < 15 or (k < 30 and k % 2 == 0):
            return {"id": k, "v": f"a{k}", "ts": 2 if k % 2 == 0 else 1}
        return {"id": k, "v": f"b{k}", "ts": 2 if k % 2 else 1}
    assert nbcc.Table.open(uri).read().sort_by("id").to_pylist() == [winner(k) for k in range(45)]


def test_a_failing_compaction_after_a_batch_commit_is_logged_and_the_query_goes_on(spark, tmp_path):
    from pyspark_nbcc import DefaultSource
    from pyspark_nbcc.streaming import NbccStreamWriter

    uri, log_path = str(tmp_path / "t"), str(tmp_path / "sink.log")

    # Defined in here, so that Spark pickles them by value into the Python worker that runs the
    # sink's commit: the compaction is made to fail in that process, and its log kept.
    class FailingCompactionWriter(NbccStreamWriter):
        def commit(self, messages, batchId):
            import logging
            import nbcc.compaction

            def fail(*args, **kwargs):
                raise OSError("the storage refused the compacted base file")

            handler = logging.FileHandler(log_path)
            logger = logging.getLogger("pyspark_nbcc.streaming")
            real, nbcc.compaction.run_compaction = nbcc.compaction.run_compaction, fail
            logger.addHandler(handler)
            try:
                super().commit(messages, batchId)
            finally:
                nbcc.compaction.run_compaction = real
                logger.removeHandler(handler)
                handler.close()

    class FailingCompactionSource(DefaultSource):
        @classmethod
        def name(cls):
            return "nbcc_failing_compaction"

        def streamWriter(self, schema, overwrite):
            w = super().streamWriter(schema, overwrite)
            return FailingCompactionWriter(w.config, w.template, w.stream_id, w.max_log_file_bytes,
                                           w.compaction_trigger)

    spark.dataSource.register(FailingCompactionSource)
    inputs = _inputs(tmp_path / "in", [_rows(range(0, 10), "a"), _rows(range(5, 15), "b", ts=2),
                                       _rows(range(15, 20), "a")])
    ckpt = tmp_path / "ckpt"
    _run(_sink(_file_stream(spark, inputs), uri, ckpt, fmt="nbcc_failing_compaction",
               compaction_delta_commits="1", compaction_inline="true"))

    assert [c["batch_id"] for c in _data_commits(uri)] == [0, 1, 2]
    assert _spark_commits(ckpt) == [0, 1, 2]
    logged = Path(log_path).read_text()
    assert "streaming batch 0 of stream" in logged and "the compaction after it failed" in logged
    assert "the storage refused the compacted base file" in logged
    # The compaction scheduled after batch 0 is left pending (later batches leave it alone); it
    # can be finished afterwards, and the rows are the same either way.
    table = nbcc.Table.open(uri)
    expected = [{"id": i, "v": f"{'b' if 5 <= i < 15 else 'a'}{i}", "ts": 2 if 5 <= i < 15 else 1}
                for i in range(20)]
    assert table.read().sort_by("id").to_pylist() == expected
    [pending] = table.pending_compactions()
    assert table.run_compaction(pending) is not None
    assert table.read().sort_by("id").to_pylist() == expected


def test_complete_output_mode_replaces_the_table_each_micro_batch(spark, tmp_path):
    from pyspark.sql import functions as F

    uri = str(tmp_path / "t")
    inputs = _inputs(tmp_path / "in", [_rows(range(0, 4), "a"), _rows(range(4, 6), "b"), _rows(range(6, 9), "a")])
    totals = (_file_stream(spark, inputs).groupBy(F.substring("v", 1, 1).alias("letter"))
              .agg(F.count("*").alias("n")))
    query = (totals.writeStream.outputMode("complete").format("nbcc").option("record_key", "letter")
             .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start(uri))
    _run(query)
    assert [(c["action"], c["batch_id"]) for c in _data_commits(uri)] == [
        ("replacecommit", 0), ("replacecommit", 1), ("replacecommit", 2)]
    assert sorted((r["letter"], r["n"]) for r in nbcc.Table.open(uri).read().to_pylist()) == [("a", 7), ("b", 2)]


def test_complete_output_mode_with_an_empty_result_empties_the_table(spark, tmp_path):
    from pyspark.sql import functions as F

    uri = str(tmp_path / "t")
    # Letters seen fewer than 3 times: batch 0 has a twice, batch 1 makes it 4 (none left), batch
    # 2 brings b once.
    inputs = _inputs(tmp_path / "in", [_rows(range(0, 2), "a"), _rows(range(2, 4), "a"), _rows(range(4, 5), "b")])
    rare = (_file_stream(spark, inputs).groupBy(F.substring("v", 1, 1).alias("letter"))
            .agg(F.count("*").alias("n")).where("n < 3"))
    query = (rare.writeStream.outputMode("complete").format("nbcc").option("record_key", "letter")
             .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start(uri))
    _run(query)
    assert [(c["action"], c["batch_id"], c["rows"]) for c in _data_commits(uri)] == [
        ("replacecommit", 0, 1), ("replacecommit", 1, 0), ("replacecommit", 2, 1)]
    assert [(r["letter"], r["n"]) for r in nbcc.Table.open(uri).read().to_pylist()] == [("b", 1)]
    one = nbcc.Table.open(uri)
    second = [i.completion for i in one.timeline() if i.action == "replacecommit"][1]
    assert one.read(as_of=second).num_rows == 0  # batch 1's result: no letter is rare


def test_stream_id_option_names_the_stream_and_belongs_to_one_query(spark, tmp_path):
    uri = str(tmp_path / "t")
    inputs = _inputs(tmp_path / "in", [_rows(range(0, 5), "a")])
    _run(_sink(_file_stream(spark, inputs), uri, tmp_path / "ckpt", stream_id="orders_ingest.v2"))
    assert [(c["stream_id"], c["batch_id"]) for c in _data_commits(uri)] == [("orders_ingest.v2", 0)]

    # A new checkpoint starts at batch 0 again: with the same stream_id its batches would be
    # taken for replays and skipped. It fails instead, and writes nothing.
    more = _inputs(tmp_path / "in2", [_rows(range(5, 10), "a")])
    with pytest.raises(StreamingQueryException, match="belongs to another streaming query"):
        _run(_sink(_file_stream(spark, more), uri, tmp_path / "ckpt2", stream_id="orders_ingest.v2"))
    assert len(_data_commits(uri)) == 1
    assert _ids(nbcc.Table.open(uri).read()) == list(range(5))



def test_a_query_restarted_from_its_checkpoint_under_another_stream_id_is_refused(spark, tmp_path):
    # Batch 1 committed in nbcc but not in Spark's checkpoint (the process died in between):
    # the restart replays it. Under another stream_id the replay would not be recognised and
    # batch 1 would be committed twice, over any newer write of its keys.
    uri, ckpt = str(tmp_path / "t"), tmp_path / "ckpt"
    inputs = _inputs(tmp_path / "in", [_rows(range(0, 3), "a"), _rows(range(3, 6), "b")])
    _run(_sink(_file_stream(spark, inputs), uri, ckpt))
    for name in ("1", ".1.crc"):
        (ckpt / "commits" / name).unlink(missing_ok=True)
    with pytest.raises(StreamingQueryException, match=r"wrote to this table as stream_id='[0-9a-f-]{36}'; "
                                                      r"restarted as stream_id='orders_v2'.*without stream_id"):
        _run(_sink(_file_stream(spark, inputs), uri, ckpt, stream_id="orders_v2"))
    assert [c["batch_id"] for c in _data_commits(uri)] == [0, 1]
    _run(_sink(_file_stream(spark, inputs), uri, ckpt))  # as before: the replay commits nothing
    assert [c["batch_id"] for c in _data_commits(uri)] == [0, 1]
    assert _ids(nbcc.Table.open(uri).read()) == list(range(6))

def test_a_named_query_writes_and_resumes_from_the_sessions_checkpoint_root(spark, tmp_path):
    # writeStream.queryName(...) reaches the sink as an option: it was refused as unknown, which
    # also ruled out spark.sql.streaming.checkpointLocation (one checkpoint per query name).
    inputs = _inputs(tmp_path / "in", [_rows(range(0, 5), "a"), _rows(range(5, 10), "b")])
    uri = str(tmp_path / "t")
    root = tmp_path / "checkpoints"

    def start():
        w = _file_stream(spark, inputs).writeStream.format("nbcc").queryName("orders_sink")
        for k, v in {"record_key": "id", "ordering_field": "ts", "buckets": "4"}.items():
            w = w.option(k, v)
        return w.trigger(availableNow=True).start(uri)

    spark.conf.set("spark.sql.streaming.checkpointLocation", str(root))
    try:
        _run(start())
        assert _ids(nbcc.Table.open(uri).read()) == list(range(10))
        assert (root / "orders_sink").is_dir()
        pq.write_table(_rows(range(10, 15), "c"), inputs / "part-002.parquet")
        _run(start())  # resumes from the same checkpoint: only the new file
    finally:
        spark.conf.unset("spark.sql.streaming.checkpointLocation")
    assert _ids(nbcc.Table.open(uri).read()) == list(range(15))
    assert [c["batch_id"] for c in _data_commits(uri)] == [0, 1, 2]


def test_bad_streaming_write_options_fail_clearly_and_write_nothing(spark, tmp_path):
    inputs = _inputs(tmp_path / "in", [_rows(range(0, 5), "a")])
    uri = tmp_path / "t"
    with pytest.raises(StreamingQueryException, match=r"unknown streaming write option\(s\): recordkey.*stream_id.*"
                                                      r"recordkey: did you mean record_key\?"):
        _run(_sink(_file_stream(spark, inputs), str(uri), tmp_path / "c1", recordkey="id"))
    with pytest.raises(StreamingQueryException, match=r"stream_id='my/stream' is not a valid stream id"):
        _run(_sink(_file_stream(spark, inputs), str(uri), tmp_path / "c2", stream_id="my/stream"))
    # A batch write's option: a stream's micro-batches append.
    with pytest.raises(StreamingQueryException, match="partitionOverwriteMode is an option of batch overwrites"):
        _run(_sink(_file_stream(spark, inputs), str(uri), tmp_path / "c3", partitionOverwriteMode="dynamic"))
    with pytest.raises(StreamingQueryException, match="replaceWhere is an option of batch overwrites"):
        _run(_sink(_file_stream(spark, inputs), str(uri), tmp_path / "c5", replaceWhere="id = 1"))
    with pytest.raises(StreamingQueryException, match="operation=delete_partition is for batch writes"):
        _run(_sink(_file_stream(spark, inputs), str(uri), tmp_path / "c4", operation="delete_partition"))
    assert not uri.exists()


# -- sink core: claims (no Spark) --------------------------------------------------------------

def _template(table):
    return table.prepare_write(ARROW_SCHEMA, "upsert", overwrite=False)


def _write_into(table, template, instant, rows):
    writer = table.log_writer(dataclasses.replace(template, instant=instant), make_token(0, 0, 0))
    writer.write(prepare(rows, table.config, template.schema, "upsert"))
    return writer.close()


def test_claims_all_tasks_of_a_batch_share_one_instant_and_a_commit_happens_once(tmp_path):
    table = nbcc.Table.create(str(tmp_path / "t"), ARROW_SCHEMA, "id", ordering_field="ts")
    claims = []
    threads = [threading.Thread(target=lambda: claims.append(
        claim_batch(table.storage, table.clock, "s1", 7, "deltacommit"))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert len(claims) == 6 and len({c.instant for c in claims}) == 1
    instant = claims[0].instant
    assert [(i.instant, i.state) for i in table.timeline()] == [(instant, "inflight")]

    template = _template(table)
    files = _write_into(table, template, instant, _rows(range(3), "a"))
    assert commit_batch(template, "s1", 7, instant, files) is not None
    assert commit_batch(template, "s1", 7, instant, files) is None  # a replayed commit
    again = claim_batch(table.storage, table.clock, "s1", 7, "deltacommit")
    assert again.committed and again.instant == instant  # a replayed batch writes nothing
    meta = _data_commits(table.uri)
    assert [(m["instant"], m["stream_id"], m["batch_id"]) for m in meta] == [(instant, "s1", 7)]


def test_claims_an_instant_published_after_the_lease_is_rolled_back_and_claimed_anew(tmp_path):
    # The claimant's .requested put outlasted the lock's lease while another writer took the lock
    # over: a compaction scheduled then would not have seen the instant pending (format.md §17.1).
    from faults import Faults, Stall, faulty_table
    table = nbcc.Table.create(str(tmp_path / "t"), ARROW_SCHEMA, "id", ordering_field="ts", lock_lease_ms=1000)
    stall = Stall()
    slow = faulty_table(table, Faults().plan("put", stall, where=r"\.deltacommit\.requested$"))
    claims = []
    claimant = threading.Thread(target=lambda: claims.append(
        claim_batch(slow.storage, slow.clock, "s1", 0, "deltacommit")), daemon=True)
    claimant.start()
    assert stall.entered.wait(TIMEOUT_S)
    other = table.write(_rows(range(2), "w"))  # takes the lock over meanwhile
    stall.release()
    claimant.join(TIMEOUT_S)
    [claim] = claims
    states = {i.instant: i.state for i in table.timeline()}
    [stalled] = [i for i, state in states.items() if state == "rolledback"]
    # The claim itself was never put (the lease was over), so attempt 0 is claimed again.
    assert stalled < other < claim.instant and claim.attempt == 0
    assert states == {stalled: "rolledback", other: "completed", claim.instant: "inflight"}
    template = _template(table)
    commit_batch(template, "s1", 0, claim.instant, _write_into(table, template, claim.instant, _rows(range(2, 4), "b")))
    assert sorted(table.read().column("v").to_pylist()) == ["b2", "b3", "w0", "w1"]



def test_claims_a_claim_whose_reply_was_lost_past_the_lease_is_withdrawn_and_claimed_anew(s3_table, monkeypatch):
    # On S3 the claim's put is given up at the lease's end; it landed all the same (its reply
    # was lost). Its instant is rolled back at once and the next attempt claims a new one.
    from test_faults import S3_LEASE_MS, StalledS3Put
    uri, opts = s3_table
    table = nbcc.Table.create(uri, ARROW_SCHEMA, "id", ordering_field="ts", storage_options=opts,
                              lock_lease_ms=S3_LEASE_MS)
    stall = StalledS3Put(table.storage.fs, r"/streams/s1/0{20}\.0\.json$", monkeypatch, lands_first=True)
    claim = claim_batch(table.storage, table.clock, "s1", 0, "deltacommit")
    stall.finish()
    monkeypatch.undo()
    states = {i.instant: i.state for i in table.timeline()}
    [withdrawn] = [i for i, state in states.items() if state == "rolledback"]
    assert claim.attempt == 1 and states == {withdrawn: "rolledback", claim.instant: "inflight"}
    template = _template(table)
    commit_batch(template, "s1", 0, claim.instant, _write_into(table, template, claim.instant, _rows(range(2), "b")))
    assert sorted(table.read().column("v").to_pylist()) == ["b0", "b1"]


def test_claims_a_claim_whose_put_never_landed_fails_the_task_with_the_storage_error(s3_table, monkeypatch):
    # The claim's put is given up at the lease's end and never landed: its instant is rolled
    # back and the task fails with the storage's error (not 50 more claims, then another error).
    from test_faults import S3_LEASE_MS, StalledS3Put
    uri, opts = s3_table
    table = nbcc.Table.create(uri, ARROW_SCHEMA, "id", ordering_field="ts", storage_options=opts,
                              lock_lease_ms=S3_LEASE_MS)
    stall = StalledS3Put(table.storage.fs, r"/streams/s1/0{20}\.0\.json$", monkeypatch)
    with pytest.raises(nbcc.StorageError, match="lease ran out"):
        claim_batch(table.storage, table.clock, "s1", 0, "deltacommit")
    stall.finish()
    monkeypatch.undo()
    assert [i.state for i in table.timeline()] == ["rolledback"]
    claim = claim_batch(table.storage, table.clock, "s1", 0, "deltacommit")  # the task's retry
    assert claim.attempt == 0 and claim.state == "inflight"

def test_claims_a_stream_template_is_checked_like_a_write_and_begins_no_instant(tmp_path):
    table = nbcc.Table.create(str(tmp_path / "t"), ARROW_SCHEMA, "id", ordering_field="ts")
    with pytest.raises(nbcc.SchemaError, match="lacks the ordering_field column 'ts'"):
        table.prepare_write(pa.schema([("id", pa.int64()), ("v", pa.string())]), "upsert")
    wider = ARROW_SCHEMA.append(pa.field("extra", pa.float64()))
    template = table.prepare_write(wider, "upsert")
    assert template.schema.names == ["id", "v", "ts", "extra"] and template.added_columns == ["extra"]
    assert table.timeline() == [] and template.instant == ""  # each micro-batch begins its own

    claim = claim_batch(table.storage, table.clock, "s1", 0, "deltacommit")
    rows = _rows(range(2), "a").append_column("extra", pa.array([0.5, 1.5]))
    commit_batch(template, "s1", 0, claim.instant, _write_into(table, template, claim.instant, rows))
    assert table.schema().names == ["id", "v", "ts", "extra"]
    assert sorted(table.read().column("extra").to_pylist()) == [0.5, 1.5]


def test_claims_a_rolled_back_batch_gets_a_new_instant(tmp_path):
    table = nbcc.Table.create(str(tmp_path / "t"), ARROW_SCHEMA, "id", ordering_field="ts")
    first = claim_batch(table.storage, table.clock, "s1", 0, "deltacommit")
    template = _template(table)
    _write_into(table, template, first.instant, _rows(range(3), "a"))
    # The run died; a cleaner finds its heartbeat expired and rolls it back.
    assert table.rollback_failed_writes(heartbeat_timeout_s=0) == [first.instant]

    second = claim_batch(table.storage, table.clock, "s1", 0, "deltacommit")
    assert (second.attempt, second.committed) == (1, False) and second.instant > first.instant
    files = _write_into(table, template, second.instant, _rows(range(3), "b"))
    with pytest.raises(nbcc.CommitError, match="rolled back"):
        commit_batch(template, "s1", 0, first.instant, [])  # a zombie of the first attempt
    commit_batch(template, "s1", 0, second.instant, files)
    states = {i.instant: i.state for i in table.timeline()}
    assert states == {first.instant: "rolledback", second.instant: "completed"}
    assert sorted(table.read().column("v").to_pylist()) == ["b0", "b1", "b2"]


def test_claims_a_batch_rolled_back_and_archived_gets_a_new_instant_though_a_stalled_task_put_its_inflight_back(
        tmp_path):
    table = nbcc.Table.create(str(tmp_path / "t"), ARROW_SCHEMA, "id", ordering_field="ts", buckets=2)
    first = claim_batch(table.storage, table.clock, "s1", 0, "deltacommit")
    assert table.rollback(first.instant)
    for k in range(5):
        table.write(_rows([k], "a"))
    table.clean(retain_commits=2)
    assert table.archive(retain_commits=2)["archived"] >= 1  # the rolled-back instant among them
    # A task of the first attempt that stalled through all that puts its inflight file back.
    table.storage.put_if_absent(f".nbcc/timeline/{first.instant}.deltacommit.inflight", b"{}")
    assert [i.state for i in table.timeline() if i.instant == first.instant] == ["rolledback"]

    replay = claim_batch(table.storage, table.clock, "s1", 0, "deltacommit")
    assert (replay.attempt, replay.committed) == (1, False) and replay.instant != first.instant
    template = _template(table)
    commit_batch(template, "s1", 0, replay.instant, _write_into(table, template, replay.instant, _rows([9], "b")))
    assert sorted(table.read().column("id").to_pylist()) == [0, 1, 2, 3, 4, 9]


def test_claims_a_claimant_that_died_mid_begin_is_finished_by_the_next_task(tmp_path):
    # A claimant publishes `.requested` and the claim under the lock, then dies before the
    # heartbeat and `.inflight`: the next task of the batch writes into that instant.
    table = nbcc.Table.create(str(tmp_path / "t"), ARROW_SCHEMA, "id", ordering_field="ts")
    with table.clock.locked() as grant:
        instant = grant.time
        create_requested(table.storage, instant, "deltacommit", {})
        claim = {"stream_id": "s1", "batch_id": 3, "attempt": 0, "instant": instant, "action": "deltacommit"}
        table.storage.put_if_absent(".nbcc/streams/s1/00000000000000000003.0.json", json.dumps(claim).encode())

    got = claim_batch(table.storage, table.clock, "s1", 3, "deltacommit")
    assert (got.instant, got.attempt, got.committed) == (instant, 0, False)
    assert [(i.instant, i.state) for i in table.timeline()] == [(instant, "inflight")]


def test_claims_a_claimed_instant_is_pending_for_a_compaction_planned_after_it(tmp_path):
    # The claim issues and publishes its instant under one lock hold, like any write: a
    # compaction planned later names it as the earliest write that may still complete.
    table = nbcc.Table.create(str(tmp_path / "t"), ARROW_SCHEMA, "id", ordering_field="ts")
    table.write(_rows(range(3), "a"))
    claim = claim_batch(table.storage, table.clock, "s1", 0, "deltacommit")
    tc = table.schedule_compaction()
    plan = json.loads(table.storage.read_bytes(f".nbcc/timeline/{tc}.compaction.requested"))
    assert plan["earliest_pending"] == claim.instant


def test_claims_stream_ids_and_owners_are_checked_and_old_claims_pruned(tmp_path):
    for bad in ["", "a/b", "../x", ".hidden", "x" * 129, "sp ace"]:
        with pytest.raises(InvalidOptionError, match="not a valid stream id"):
            check_stream_id(bad)
    assert check_stream_id(" orders-1.v2_x ") == "orders-1.v2_x"

    table = nbcc.Table.create(str(tmp_path / "t"), ARROW_SCHEMA, "id")
    check_owner(table.storage, "named", "query-1")
    check_owner(table.storage, "named", "query-1")
    with pytest.raises(InvalidOptionError, match="belongs to another streaming query"):
        check_owner(table.storage, "named", "query-2")
    # A query's default stream id is its query id; another query given that id is refused too.
    check_owner(table.storage, "query-3", "query-3")
    with pytest.raises(InvalidOptionError, match="stream_id='query-3' belongs to another streaming query"):
        check_owner(table.storage, "query-3", "query-4")
    # And a query writes under one stream id: its checkpoint's replays are recognised only there.
    with pytest.raises(InvalidOptionError, match="query-1.*as stream_id='named'; restarted as stream_id='other'"):
        check_owner(table.storage, "other", "query-1")
    with pytest.raises(InvalidOptionError, match="as stream_id='query-3'.*without stream_id"):
        check_owner(table.storage, "named-3", "query-3")
    # A query that wrote under its default before queries were recorded is known by its owner file.
    table.storage.put_if_absent(".nbcc/streams/query-5/owner.json", b'{"query_id": "query-5"}')
    with pytest.raises(InvalidOptionError, match="as stream_id='query-5'"):
        check_owner(table.storage, "named-5", "query-5")
    check_owner(table.storage, "query-5", "query-5")
    assert not (Path(table.uri) / ".nbcc/streams/named-5").exists()
    # A query refused another query's stream_id has written nothing: it may take its own.
    with pytest.raises(InvalidOptionError, match="belongs to another streaming query"):
        check_owner(table.storage, "named", "query-6")
    check_owner(table.storage, "named-6", "query-6")

    for b in range(KEEP_CLAIMS + 5):
        table.storage.put_if_absent(f".nbcc/streams/s1/{b:020d}.0.json", b"{}")
    prune_claims(table.storage, "s1", KEEP_CLAIMS + 4)
    left = sorted(int(n.split(".")[0]) for n in os.listdir(Path(table.uri) / ".nbcc/streams/s1"))
    assert left == list(range(5, KEEP_CLAIMS + 5))


# -- source --------------------------------------------------------------------------------------

def _table_with_commits(uri: str, *id_ranges) -> tuple[nbcc.Table, list[str]]:
    """A table with one commit per id range; the completion times of those commits."""
    table = nbcc.Table.create(uri, ARROW_SCHEMA, "id", ordering_field="ts", buckets=4)
    for r in id_ranges:
        table.write(_rows(r, "a"))
    return table, [i.completion for i in table.timeline()]


def test_source_offsets_are_completion_times_so_a_late_commit_is_not_missed(spark, tmp_path):
    uri = str(tmp_path / "t")
    table, _ = _table_with_commits(uri, range(0, 5))
    late = table.begin_write(ARROW_SCHEMA)  # takes its instant now ...
    writer = table.log_writer(late, make_token(0, 0, 0))
    writer.write(prepare(_rows(range(100, 105), "late"), table.config, late.schema, "upsert"))
    table.write(_rows(range(5, 10), "a"))  # ... a later instant completes first

    query, batches = _collecting_stream(spark, uri, tmp_path / "ckpt")
    _run(query)
    assert batches == [(0, list(range(10)))]

    late.commit(writer.close())  # ... and the older instant completes last
    query, batches = _collecting_stream(spark, uri, tmp_path / "ckpt")
    _run(query)
    assert batches == [(1, list(range(100, 105)))]
    assert _offset(tmp_path / "ckpt", 1) == {
        "completion": [i.completion for i in table.timeline() if i.instant == late.instant][0]}


def test_source_begin_earliest_a_time_or_latest(spark, tmp_path):
    uri = str(tmp_path / "t")
    table, completions = _table_with_commits(uri, range(0, 5), range(5, 10), range(10, 15))

    query, batches = _collecting_stream(spark, uri, tmp_path / "c-earliest")
    _run(query)
    assert [ids for _, ids in batches] == [list(range(15))]

    query, batches = _collecting_stream(spark, uri, tmp_path / "c-time", begin=completions[0])
    _run(query)
    assert [ids for _, ids in batches] == [list(range(5, 15))]  # begin is exclusive

    query, batches = _collecting_stream(spark, uri, tmp_path / "c-latest", available_now=False, begin="latest")
    try:
        _process_all_available(query)
        assert [ids for _, ids in batches if ids] == []
        # Spark records where the stream starts (an empty first batch), so a restart keeps it.
        assert _offset(tmp_path / "c-latest", 0) == {"completion": completions[-1]}
        table.write(_rows(range(15, 20), "a"))
        _process_all_available(query)
        assert [ids for _, ids in batches if ids] == [list(range(15, 20))]
    finally:
        query.stop()


def test_source_begin_in_the_future_is_refused_as_a_local_time_given_without_its_zone(tmp_path, monkeypatch):
    # A local time of a zone east of UTC, given without its zone, reads as a UTC time hours ahead:
    # the stream would skip every commit until then.
    from pyspark_nbcc.source import _spark_schema
    from pyspark_nbcc.streaming import stream_reader

    uri = str(tmp_path / "t")
    _table_with_commits(uri, range(0, 5))
    ahead = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2)).replace(tzinfo=None).isoformat()
    with pytest.raises(nbcc.InvalidOptionError, match=r"begin='.*' \(\d{17}\) is in the future \(it is \d{4}-\d\d-\d\dT\S+ "
                                                      r"now\).*if it is a local time, give its zone"):
        stream_reader({"path": uri, "begin": ahead}, _spark_schema(ARROW_SCHEMA)).initialOffset()
    # A minute ahead is a clock's skew, not a mistake.
    soon = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=1)
    offset = stream_reader({"path": uri, "begin": soon.isoformat()}, _spark_schema(ARROW_SCHEMA)).initialOffset()
    assert offset == {"completion": soon.strftime("%Y%m%d%H%M%S") + f"{soon.microsecond // 1000:03d}"}
    # So is a time before a commit that a writer whose clock runs ahead completed.
    from nbcc import clock

    real = clock._now_ms
    monkeypatch.setattr(clock, "_now_ms", lambda: real() + 3 * 3600 * 1000)
    nbcc.Table.open(uri).write(_rows(range(5, 6), "a"))
    monkeypatch.undo()
    assert stream_reader({"path": uri, "begin": ahead}, _spark_schema(ARROW_SCHEMA)).initialOffset()["completion"] > \
        soon.strftime("%Y%m%d%H%M%S")


def test_source_admission_control_and_restart_without_gaps_or_repeats(spark, tmp_path):
    uri = str(tmp_path / "t")
    table, _ = _table_with_commits(uri, range(0, 5), range(5, 10), range(10, 15), range(15, 20), range(20, 40))

    query, batches = _collecting_stream(spark, uri, tmp_path / "c-commits", max_commits_per_trigger=2)
    _run(query)
    assert batches == [(0, list(range(10))), (1, list(range(10, 20))), (2, list(range(20, 40)))]

    # At most 15 rows per batch; the 20-row commit exceeds it alone and is still read.
    query, batches = _collecting_stream(spark, uri, tmp_path / "c-rows", max_rows_per_trigger=15)
    _run(query)
    assert batches == [(0, list(range(15))), (1, list(range(15, 20))), (2, list(range(20, 40)))]

    # A restart from the checkpoint goes on after the last batch: nothing twice, nothing left out.
    table.write(_rows(range(40, 45), "a"))
    table.write(_rows(range(0, 3), "b", ts=2))  # an update of keys read before
    query, batches = _collecting_stream(spark, uri, tmp_path / "c-commits", max_commits_per_trigger=2)
    _run(query)
    assert batches == [(3, [0, 1, 2] + list(range(40, 45)))]


def test_source_from_earliest_after_a_clean_and_an_offset_behind_the_cleaner(spark, tmp_path):
    uri = str(tmp_path / "t")
    table, _ = _table_with_commits(uri, range(0, 5))
    query, batches = _collecting_stream(spark, uri, tmp_path / "behind")
    _run(query)
    assert batches == [(0, list(range(5)))]

    table.write(_rows(range(0, 5), "b", ts=2))
    table.compact()
    table.write(_rows(range(5, 10), "a"))
    assert table.clean(retain_commits=1)["deleted"]  # the first two commits' files

    # A new stream from the beginning starts with the table as it is.
    got = []
    query = (spark.readStream.format("nbcc").load(uri).writeStream
             .foreachBatch(lambda df, _: got.extend((r.id, r.v) for r in df.collect()))
             .option("checkpointLocation", str(tmp_path / "fresh")).trigger(availableNow=True).start())
    _run(query)
    assert sorted(got) == [(i, f"b{i}") for i in range(5)] + [(i, f"a{i}") for i in range(5, 10)]

    # The first stream's offset is before the window the cleaner kept: it fails, and says why.
    query, batches = _collecting_stream(spark, uri, tmp_path / "behind")
    first = [i.completion for i in table.timeline() if i.action == "commit"][-1]  # then the last write
    with pytest.raises(StreamingQueryException,
                       match=r"the stream's micro-batch \(\d{17}, \d{17}\] reaches before the window the "
                             r"cleaner retained, which starts at \d{17}.*retain_commits.*new checkpoint: "
                             rf"begin=earliest .*; begin={first}, the earliest begin that can still be read"):
        _run(query)


def test_source_lagging_by_as_many_commits_as_the_cleaner_retains_goes_on(spark, tmp_path):
    # The window starts at the oldest retained commit's completion; a stream whose offset is the
    # commit just before it needs nothing the clean deleted, and reads that commit too.
    uri = str(tmp_path / "t")
    table, _ = _table_with_commits(uri, range(0, 5))
    table.write(_rows(range(0, 5), "b", ts=2))
    table.compact()  # the first two commits' files are superseded
    query, batches = _collecting_stream(spark, uri, tmp_path / "ckpt")
    _run(query)
    assert batches == [(0, list(range(5)))]
    for n in range(3):
        table.write(_rows([10 + n], "c"))
    assert table.clean(retain_commits=3)["deleted"]
    query, batches = _collecting_stream(spark, uri, tmp_path / "ckpt")
    _run(query)
    assert batches == [(1, [10, 11, 12])]


def test_source_batches_from_before_a_column_was_added_read_it_as_null(spark, tmp_path):
    # The stream takes the table's schema when it starts; a micro-batch that ends before the
    # column was added has rows without it (the query used to fail on every restart).
    uri = str(tmp_path / "t")
    table, _ = _table_with_commits(uri, range(0, 2), range(2, 4))
    wider = ARROW_SCHEMA.append(pa.field("extra", pa.string()))
    table.write(pa.table({"id": [4], "v": ["a4"], "ts": [1], "extra": ["x"]}, schema=wider))
    got: list[tuple[int, list]] = []
    query = (spark.readStream.format("nbcc").option("max_commits_per_trigger", 1).load(uri).writeStream
             .foreachBatch(lambda df, b: got.append((b, sorted((r.id, r.extra) for r in df.collect()))))
             .option("checkpointLocation", str(tmp_path / "c")).trigger(availableNow=True).start())
    _run(query)
    assert got == [(0, [(0, None), (1, None)]), (1, [(2, None), (3, None)]), (2, [(4, "x")])]


def test_source_a_column_added_while_the_query_runs_stops_it_and_a_restart_delivers_it(spark, tmp_path):
    # Delivered without the column, its values would be lost downstream: a restarted query
    # would not send those rows again. The query fails instead, as Delta's does, and the restart
    # replays the micro-batch with the new column.
    uri, ckpt = str(tmp_path / "t"), tmp_path / "c"
    table, _ = _table_with_commits(uri, range(0, 2))
    got: list[tuple[int, list]] = []

    def start(df=None, **kw):
        df = spark.readStream.format("nbcc").load(uri) if df is None else df
        return (df.writeStream.foreachBatch(lambda d, b: got.append((b, sorted(map(tuple, d.collect())))))
                .option("checkpointLocation", str(ckpt)).trigger(**kw).start(), df)

    query, first_df = start(processingTime="0.5 seconds")
    _process_all_available(query)
    wider = ARROW_SCHEMA.append(pa.field("extra", pa.string()))
    table.write(pa.table({"id": [2], "v": ["a2"], "ts": [1], "extra": ["x"]}, schema=wider))
    stopped = r"the table gained column\(s\) extra since this streaming query's DataFrame was loaded.*loaded anew"
    with pytest.raises(StreamingQueryException, match=stopped):
        query.awaitTermination(TIMEOUT_S)
    # The same DataFrame keeps its columns: restarted from it, the query stops again.
    query, _ = start(first_df, availableNow=True)
    with pytest.raises(StreamingQueryException, match=stopped):
        _run(query)
    query, df = start(availableNow=True)
    _run(query)
    assert df.columns == ["id", "v", "ts", "extra"]
    assert got == [(0, [(0, "a0", 1), (1, "a1", 1)]), (1, [(2, "a2", 1, "x")])]  # batch 1 replayed, whole

    # A query that names its columns with .schema(...) reads them, whatever is added later, even
    # when they are all the table's columns.
    queries, fixed = [], {"some": [], "all": []}
    for name, schema in (("some", "id long, v string"), ("all", df.schema)):
        queries.append(spark.readStream.format("nbcc").schema(schema).load(uri).writeStream
                       .foreachBatch(lambda d, b, name=name: fixed[name].extend(map(tuple, d.collect())))
                       .option("checkpointLocation", str(tmp_path / name)).trigger(processingTime="0.5 seconds")
                       .start())
    for query in queries:
        _process_all_available(query)
    table.write(pa.table({"id": [3], "v": ["a3"], "ts": [1], "extra": ["y"], "more": [1]},
                         schema=wider.append(pa.field("more", pa.int64()))))
    for query in queries:
        _process_all_available(query)
        query.stop()
    assert sorted(fixed["some"]) == [(0, "a0"), (1, "a1"), (2, "a2"), (3, "a3")]
    assert sorted(fixed["all"]) == [(0, "a0", 1, None), (1, "a1", 1, None), (2, "a2", 1, "x"), (3, "a3", 1, "y")]


def test_source_a_column_widened_while_the_query_runs_stops_it_and_a_restart_reads_it(spark, tmp_path):
    # Cast down to the type the query began with, a widened column's values would overflow or
    # lose digits: the query stops as for an added column, and the restart replays the batch.
    uri, ckpt = str(tmp_path / "t"), tmp_path / "c"
    table = nbcc.Table.create(uri, pa.schema([("id", pa.int64()), ("x", pa.float32())]), "id", buckets=2)
    table.write(pa.table({"id": [1], "x": pa.array([1.5], pa.float32())}))
    got: list[tuple[int, list]] = []

    def start(**kw):
        df = spark.readStream.format("nbcc").load(uri)
        return (df.writeStream.foreachBatch(lambda d, b: got.append((b, sorted(map(tuple, d.collect())))))
                .option("checkpointLocation", str(ckpt)).trigger(**kw).start(), df)

    query, _ = start(processingTime="0.5 seconds")
    _process_all_available(query)
    table.write(pa.table({"id": [2], "x": [0.1]}), type_widening=True)  # a double: x widens
    with pytest.raises(StreamingQueryException, match=r"the table widened column\(s\) x \(float -> double\) "
                                                      r"since this streaming query's DataFrame was loaded"):
        query.awaitTermination(TIMEOUT_S)
    query, df = start(availableNow=True)
    _run(query)
    assert df.schema.simpleString() == "struct<id:bigint,x:double>"
    assert got == [(0, [(1, 1.5)]), (1, [(2, 0.1)])]
    # A query loaded after the widening reads the commits before it, one micro-batch each, at
    # the wider type.
    late: list[tuple[int, list]] = []
    query = (spark.readStream.format("nbcc").option("max_commits_per_trigger", 1).load(uri).writeStream
             .foreachBatch(lambda d, b: late.append((b, sorted(map(tuple, d.collect())))))
             .option("checkpointLocation", str(tmp_path / "late")).trigger(availableNow=True).start())
    _run(query)
    assert late == [(0, [(1, 1.5)]), (1, [(2, 0.1)])]


def test_sink_type_widening_widens_the_column_and_raises_the_format_version_before_its_first_batch(spark, tmp_path):
    # A stream's micro-batches claim their instants without WriteTransaction.begin, which raises
    # the version for a batch write: the sink raises it when it starts.
    uri = str(tmp_path / "t")
    table = nbcc.Table.create(uri, pa.schema([("id", pa.int64()), ("x", pa.float32())]), "id", buckets=2)
    table.write(pa.table({"id": [-1], "x": pa.array([1.5], pa.float32())}))
    source = spark.readStream.format("rate").option("rowsPerSecond", 10).load() \
        .selectExpr("value AS id", "CAST(value AS DOUBLE) / 10 AS x")

    def start(**options):
        writer = source.writeStream.format("nbcc").option("checkpointLocation", str(tmp_path / "c"))
        for k, v in options.items():
            writer = writer.option(k, v)
        return writer.trigger(processingTime="0.5 seconds").start(uri)

    with pytest.raises(StreamingQueryException, match=r"column 'x' has type double in the data but float in the "
                                                      r"table.*type_widening=true"):
        start().awaitTermination(TIMEOUT_S)
    assert json.loads(Path(uri, ".nbcc", "table.json").read_text())["format_version"] == 1
    query = start(type_widening="true")
    deadline = time.monotonic() + TIMEOUT_S
    while nbcc.Table.open(uri).read().num_rows < 5 and time.monotonic() < deadline:
        time.sleep(0.5)
    query.stop()
    t = nbcc.Table.open(uri)
    assert t.schema().field("x").type == pa.float64()
    assert {r["id"]: r["x"] for r in t.read().to_pylist() if r["id"] in (-1, 3)} == {-1: 1.5, 3: 0.3}
    assert json.loads(Path(uri, ".nbcc", "table.json").read_text())["format_version"] == 4


def test_source_a_schema_given_is_checked_as_a_batch_reads_is(spark, tmp_path):
    # A misspelt column read as null in every row, the record key too.
    uri = str(tmp_path / "t")
    _table_with_commits(uri, range(0, 2))
    for schema, message in (("ID bigint, v string", "names column 'ID', which the table spells 'id'"),
                            ("id bigint, nosuch string", "names column 'nosuch', which this read does not have")):
        with pytest.raises(Exception, match=message):
            query = (spark.readStream.format("nbcc").schema(schema).load(uri).writeStream
                     .foreachBatch(lambda d, b: None).option("checkpointLocation", str(tmp_path / "c"))
                     .trigger(availableNow=True).start())
            _run(query)


def test_source_change_feed_options_say_what_a_stream_delivers(spark, tmp_path):
    uri = str(tmp_path / "t")
    _table_with_commits(uri, range(0, 2))
    with pytest.raises(Exception, match=r"unknown streaming read option\(s\): query_type.*"
                                        r"\(query_type is a batch read option: a stream delivers.*"
                                        r"with incremental_format=cdc one row per change, deletes") as refused:
        query = (spark.readStream.format("nbcc").option("query_type", "incremental")
                 .option("incremental_format", "cdc").load(uri).writeStream.foreachBatch(lambda d, b: None)
                 .option("checkpointLocation", str(tmp_path / "c")).trigger(availableNow=True).start())
        _run(query)
    # PySpark's runner buried an error raised while setting up the reader under its own.
    assert "UnboundLocalError" not in str(refused.value)
    for name, value, message in (
            ("incremental_format", "changes", "incremental_format must be one of latest_state, cdc; got 'changes'"),
            ("include_meta_columns", "true", "include_meta_columns does not apply to cdc")):
        reader = spark.readStream.format("nbcc").option("incremental_format", "cdc")
        with pytest.raises(Exception, match=message) as failed:
            reader.option(name, value).load(uri)
        assert "only for query_type" not in str(failed.value)  # the batch read's complaint is not for a stream
    # A column of the table is not a column of a cdc read (it is a field of before and after).
    from pyspark_nbcc.streaming import stream_reader
    from pyspark.sql.types import StructType, StructField, LongType, StringType
    given = StructType([StructField("id", LongType()), StructField("v", StringType())])
    with pytest.raises(SchemaError, match="names column 'v', which this read does not have"):
        stream_reader({"path": uri, "incremental_format": "cdc"}, given)


def _change_stream(spark, uri: str, checkpoint: Path):
    """A cdc stream run to the end of what is there: its micro-batches as
    {key: (change type, before v, after v, completion time)} each."""
    query, batches = _collecting_stream(
        spark, uri, checkpoint, incremental_format="cdc",
        summary=lambda rows: {r.id: (r._change_type, r.before and r.before.v, r.after and r.after.v,
                                     r._nbcc_completion_time) for r in rows})
    _run(query)
    return batches


def test_source_cdc_delivers_every_change_deletes_and_overwrites_included_so_a_copy_mirrors_the_table(spark, tmp_path):
    uri = str(tmp_path / "t")
    table, _ = _table_with_commits(uri, range(0, 4), range(4, 6))
    done = {i.instant: i.completion for i in table.timeline()}
    first, second = [i.instant for i in table.timeline()]
    mirror: dict[int, str] = {}

    def apply(batch: dict) -> None:
        for key, (change, _, after, _) in batch.items():
            if change == "delete":
                del mirror[key]
            else:
                mirror[key] = after

    # From the beginning: the table as of the first micro-batch's end, every key an insert at the
    # completion of the commit its row came from.
    [batch] = _change_stream(spark, uri, tmp_path / "c")
    assert batch == {**{k: ("insert", None, f"a{k}", done[first]) for k in range(4)},
                     **{k: ("insert", None, f"a{k}", done[second]) for k in (4, 5)}}
    apply(batch)

    # Updates, an update that loses to a newer ordering value (no change), inserts and deletes.
    updated = table.write(pa.concat_tables([_rows([0, 1], "b", ts=2), _rows([2], "old", ts=0), _rows([6], "a")]))
    deleted = table.write(pa.table({"id": [1, 3]}), operation="delete")
    begin = table.timeline()[-3].completion
    [batch] = _change_stream(spark, uri, tmp_path / "c")
    when = {i.instant: i.completion for i in table.timeline()}
    assert batch == {0: ("update", "a0", "b0", when[updated]), 1: ("delete", "a1", None, when[deleted]),
                     3: ("delete", "a3", None, when[deleted]), 6: ("insert", None, "a6", when[updated])}
    # the same as a batch read of the range
    cdc = table.read(query_type="incremental", begin=begin, incremental_format="cdc").to_pylist()
    assert {r["id"]: (r["_change_type"], r["before"] and r["before"]["v"], r["after"] and r["after"]["v"],
                      r["_nbcc_completion_time"]) for r in cdc} == batch
    apply(batch)

    # An overwrite: the keys it drops are deletes, the ones it keeps updates or no change.
    table.write(pa.concat_tables([_rows([0], "b", ts=2), _rows([4], "c", ts=3)]), mode="overwrite")
    [batch] = _change_stream(spark, uri, tmp_path / "c")
    assert {k: v[:3] for k, v in batch.items()} == {2: ("delete", "a2", None), 4: ("update", "a4", "c4"),
                                                    5: ("delete", "a5", None), 6: ("delete", "a6", None)}
    apply(batch)
    assert mirror == {r["id"]: r["v"] for r in table.read().to_pylist()} == {0: "b0", 4: "c4"}


def test_source_cdc_first_micro_batch_is_a_batch_cdc_read_from_earliest(tmp_path):
    # Nested fields marked not null, a composite key, a partition column, a key deleted again.
    from nbcc.scan import iter_task
    from nbcc.stream import BEFORE_ALL, as_changes, plan_range

    inner = pa.struct([pa.field("a", pa.int32(), nullable=False), pa.field("b", pa.string())])
    schema = pa.schema([pa.field("k1", pa.string(), nullable=False), pa.field("k2", pa.int64(), nullable=False),
                        pa.field("day", pa.string()), pa.field("s", inner), pa.field("tags", pa.list_(pa.string()))])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, ["k1", "k2"], partition_by="day", buckets=2)

    def rows(keys, n):
        return pa.table({"k1": [k for k, _ in keys], "k2": [k for _, k in keys], "day": [f"d{k % 2}" for _, k in keys],
                         "s": [None if k == 3 else {"a": k * n, "b": f"b{n}"} for _, k in keys],
                         "tags": [[f"t{n}"] * (k % 3) for _, k in keys]}, schema=schema)

    table.write(rows([("x", k) for k in range(6)], 1))
    table.write(rows([("x", 1), ("y", 1)], 2))
    table.write(pa.table({"k1": ["x"], "k2": [4], "day": ["d0"]}), operation="delete")
    end = table.timeline()[-1].completion
    plan = plan_range(table.storage, table.config, BEFORE_ALL, end, incremental_format="cdc")
    got = pa.concat_tables([as_changes(plan, rows) for task in plan.tasks for rows in iter_task(table.storage, plan, task)])
    expected = table.read(query_type="incremental", begin="earliest", incremental_format="cdc")
    assert got.schema == expected.schema
    assert sorted(got.to_pylist(), key=repr) == sorted(expected.to_pylist(), key=repr)
    assert len(got) == 6 and set(got.column("_change_type").to_pylist()) == {"insert"}


def test_source_cdc_micro_batches_from_before_a_column_was_added_read_it_as_null(spark, tmp_path):
    uri = str(tmp_path / "t")
    table, _ = _table_with_commits(uri, range(0, 2))
    table.write(_rows([0], "b", ts=2))
    wider = ARROW_SCHEMA.append(pa.field("note", pa.string()))
    table.write(pa.table({"id": [1], "v": ["c1"], "ts": [3], "note": ["n"]}, schema=wider))
    query, batches = _collecting_stream(
        spark, uri, tmp_path / "c", incremental_format="cdc", max_commits_per_trigger=1,
        summary=lambda rows: sorted((r.id, r._change_type, r.before and r.before.asDict(), r.after.asDict())
                                    for r in rows))
    _run(query)
    assert batches == [
        [(0, "insert", None, {"id": 0, "v": "a0", "ts": 1, "note": None}),
         (1, "insert", None, {"id": 1, "v": "a1", "ts": 1, "note": None})],
        [(0, "update", {"id": 0, "v": "a0", "ts": 1, "note": None}, {"id": 0, "v": "b0", "ts": 2, "note": None})],
        [(1, "update", {"id": 1, "v": "a1", "ts": 1, "note": None}, {"id": 1, "v": "c1", "ts": 3, "note": "n"})]]


def test_source_cdc_from_the_beginning_after_a_clean_starts_from_a_kept_state(spark, tmp_path):
    uri = str(tmp_path / "t")
    table, _ = _table_with_commits(uri, range(0, 3), range(3, 6), range(6, 9))
    table.write(pa.table({"id": [0]}), operation="delete")
    table.clean(retain_commits=1)  # the earlier commits' changes can no longer be read as changes
    [batch] = _change_stream(spark, uri, tmp_path / "c")
    assert {k: v[:3] for k, v in batch.items()} == {k: ("insert", None, f"a{k}") for k in range(1, 9)}


def test_source_begin_latest_is_fixed_when_first_asked(tmp_path):
    # Spark asks for the initial offset when it plans the first micro-batch and again when it
    # runs it: a commit that completes in between must be read, not skipped.
    from pyspark_nbcc.streaming import stream_reader

    uri = str(tmp_path / "t")
    table, completions = _table_with_commits(uri, range(0, 5))
    from pyspark_nbcc.source import _spark_schema

    reader = stream_reader({"path": uri, "begin": "latest"}, _spark_schema(ARROW_SCHEMA))
    first = reader.initialOffset()
    assert first == {"completion": completions[-1]}
    table.write(_rows(range(5, 8), "a"))
    assert reader.initialOffset() == first
    end = reader.latestOffset(first, reader.getDefaultReadLimit())
    parts = reader.partitions(reader.initialOffset(), end)
    ids = sorted(i for p in parts for b in reader.read(p) for i in b.column("id").to_pylist())
    assert ids == [5, 6, 7]


def test_source_use_metadata_table_option(spark, tmp_path):
    from pyspark_nbcc.streaming import stream_reader

    uri = str(tmp_path / "t")
    table, _ = _table_with_commits(uri, range(0, 5), range(5, 10))
    table.build_index("files")
    for flag in ("true", "false"):
        query, batches = _collecting_stream(spark, uri, tmp_path / f"c-{flag}", max_commits_per_trigger=1,
                                            use_metadata_table=flag)
        _run(query)
        assert batches == [(0, list(range(5))), (1, list(range(5, 10)))]
        # The same rows either way; the plan shows whether the metadata table was used.
        reader = stream_reader({"path": uri, "use_metadata_table": flag}, None)
        parts = reader.partitions(reader.initialOffset(), {"completion": _data_commits(uri)[-1]["completion"]})
        assert parts and {p.plan.metadata_used for p in parts} == {("files",) if flag == "true" else ()}

    with pytest.raises(Exception, match=r"unknown streaming read option\(s\): use_metadata_tabel"):
        spark.readStream.format("nbcc").option("use_metadata_tabel", "false").load(uri)
    with pytest.raises(Exception, match="'use_metadata_table' must be true or false"):
        spark.readStream.format("nbcc").option("use_metadata_table", "maybe").load(uri)


def test_source_options_are_checked(spark, tmp_path):
    uri = str(tmp_path / "t")
    _table_with_commits(uri, range(0, 5))
    # A typo tells neither read: both complaints, the stream's listing the right name.
    with pytest.raises(Exception, match=r"unknown read option\(s\): max_comits_per_trigger.*as spark.readStream: "
                                        r"unknown streaming read option\(s\): max_comits_per_trigger.*max_commits_per_trigger"):
        spark.readStream.format("nbcc").option("max_comits_per_trigger", 1).load(uri)
    # Options only a stream takes (begin without query_type, too): the stream's complaint alone,
    # not first a batch read's that does not apply.
    for option, value, message in (("begin", "yesterday", "begin='yesterday' is not a time"),
                                   ("max_rows_per_trigger", "0", "'max_rows_per_trigger' must be a positive integer"),
                                   ("max_commits_per_trigger", "0",
                                    "'max_commits_per_trigger' must be a positive integer, got '0'")):
        with pytest.raises(Exception, match=message) as err:
            spark.readStream.format("nbcc").option(option, value).load(uri)
        text = str(err.value)
        assert "as spark.readStream" not in text and "unknown read option" not in text, text
        assert "only for query_type" not in text, text


def test_micro_batches_under_random_storage_faults_commit_exactly_once(tmp_path):
    # Two streams write 6 micro-batches each, every batch by 3 tasks at once, through a storage
    # where 10% of calls fail (half of the failing changes after taking effect). A batch that
    # fails anywhere is replayed whole with the same batch id, as Spark does, until it commits;
    # so is one in three committed batches (the engine died before its own checkpoint).
    from faults import Faults, FaultyStorage

    uri = str(tmp_path / "t")
    nbcc.Table.create(uri, ARROW_SCHEMA, "id", ordering_field="ts", buckets=2)
    faults = Faults(seed=7, rate=0.10, rates={"sink": 0.04})
    table = nbcc.Table(FaultyStorage(uri, {}, faults), nbcc.Table.open(uri).config)
    faults.enabled = False
    template = _template(table)
    faults.enabled = True
    batches, tasks = 6, 3
    replays = {"s1": 0, "s2": 0}
    errors = []
    lost_checkpoint = random.Random(11)

    def rows(stream: str, batch: int, task: int) -> pa.Table:
        base = {"s1": 0, "s2": 10_000}[stream] + batch * 100 + task * 10
        return _rows(range(base, base + 10), f"{stream}-{batch}-")

    def run_batch(stream: str, batch: int, run: int) -> None:
        results: list = [None] * tasks

        def task(t: int) -> None:
            try:
                claim = claim_batch(table.storage, table.clock, stream, batch, "deltacommit")
                files = []
                if not claim.committed:  # a task's files are named by (task, run), as Spark's are
                    writer = table.log_writer(dataclasses.replace(template, instant=claim.instant),
                                              make_token(t, run, 0))
                    writer.write(prepare(rows(stream, batch, t), table.config, template.schema, "upsert"))
                    files = writer.close()
                results[t] = (claim, files)
            except BaseException as exc:  # noqa: BLE001 - seen by run_batch below
                results[t] = exc

        threads = [threading.Thread(target=task, args=(t,), daemon=True) for t in range(tasks)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(TIMEOUT_S)
        assert not any(th.is_alive() for th in threads), f"a task of {stream} batch {batch} hangs"
        for r in results:  # only nbcc's own errors are a failed attempt to replay; a raw OSError
            if isinstance(r, BaseException) and not isinstance(r, nbcc.NbccError):  # fails the test
                raise r
        if any(not isinstance(r, tuple) for r in results):
            raise nbcc.CommitError(f"a task failed: {results}")
        claims = {r[0].instant for r in results}
        assert len(claims) == 1, f"the tasks of one batch claimed different instants: {claims}"
        if not results[0][0].committed:  # the driver's commit of the tasks' files
            commit_batch(template, stream, batch, results[0][0].instant, [f for r in results for f in r[1]])
            if lost_checkpoint.random() < 0.3:  # died before Spark's checkpoint: replayed
                raise nbcc.CommitError("the engine lost its checkpoint of this batch")

    def stream_job(stream: str) -> None:
        try:
            for batch in range(batches):
                for run in range(30):
                    try:
                        run_batch(stream, batch, run)
                        break
                    except nbcc.NbccError:
                        replays[stream] += 1
                else:
                    raise AssertionError(f"{stream} batch {batch} never committed")
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            errors.append(exc)

    jobs = [threading.Thread(target=stream_job, args=(s,), daemon=True) for s in ("s1", "s2")]
    for j in jobs:
        j.start()
    for j in jobs:
        j.join(TIMEOUT_S)
    faults.enabled = False
    assert not any(j.is_alive() for j in jobs), "a stream job did not finish"
    assert not errors, errors
    assert faults.total() > 10 and sum(replays.values()) > 0, (faults.injected, replays)

    # Exactly one completed commit per (stream, batch); every row of every batch once.
    commits = _data_commits(uri)
    assert sorted((c["stream_id"], c["batch_id"]) for c in commits) == sorted(
        (s, b) for s in ("s1", "s2") for b in range(batches))
    final = nbcc.Table.open(uri)
    final.clean(heartbeat_timeout_s=0)  # what failed attempts left: rolled back, never shown
    expected = pa.concat_tables([rows(s, b, t) for s in ("s1", "s2") for b in range(batches) for t in range(tasks)])
    assert final.read().sort_by("id").to_pydict() == expected.sort_by("id").to_pydict()


def test_a_batch_whose_only_task_with_rows_failed_is_rolled_back_at_once(spark, tmp_path):
    # A failed task sends Spark no message, so the sink's abort learns the batch's instant from
    # its claim: it is rolled back now, not left pending until the cleaner's heartbeat timeout.
    uri, ckpt = str(tmp_path / "t"), tmp_path / "ckpt"
    bad = pa.table({"id": [1, 2], "v": ["a", "b"], "ts": [1, None]}, schema=ARROW_SCHEMA)
    inputs = _inputs(tmp_path / "in", [bad])
    with pytest.raises(StreamingQueryException, match="ordering_field 'ts' has 1 null"):
        _run(_sink(_file_stream(spark, inputs), uri, ckpt, stream_id="orders"))
    timeline = nbcc.Table.open(uri).timeline()
    assert [i.state for i in timeline] == ["rolledback"]
    assert not [n for n in os.listdir(uri) if timeline[0].instant in n]
