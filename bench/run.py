"""nbcc benchmarks: measured side by side with Spark's Parquet source, delta-rs and the hardware.

    python bench/run.py [--rows 2000000] [--repeats 5] [--only 1,2,...] [--commits 2000]
                        [--slice-rows 10000000] [--scale-rows 10000000] [--writer-rounds 5] [--out bench]

Writes results.json and results.md (in bench/ unless --out says otherwise). Each figure is the median of `--repeats` runs after
a warm-up; each comparison is a ratio measured in the same run, its two sides run in turns
(this machine's speed drifts, so absolute times from different runs do not compare). Scenarios (see README / issue 5):
 1 bulk write through Spark            vs df.write.parquet
 2 upsert 10% (half updates, half new) : Spark, Python API, deltalake merge
 3 snapshot read after compaction      vs spark.read.parquet of the same rows
 4 snapshot read, 5 uncompacted 10% upserts (merge on read) vs parquet of the final rows
 5 incremental read of the last commit vs a full snapshot read; also at --scale-rows rows
 6 point lookup with pushdown          vs a full scan; with and without the metadata table; the
   lookup and scan also at --scale-rows rows
 7 4 concurrent writers                : nbcc commits/retries vs deltalake concurrent merges
 8 planning a read of a table with N commits (before/after archival, with and without the
   metadata table), in a fresh process
 9 peak memory of one process merging one large file slice
10 time travel and incremental reads (latest state, CDC) through the Python API vs deltalake's
   versions and change data feed, on the same table history as 4 and 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import nbcc
from nbcc.filenames import data_file_path

import floor  # bench/floor.py: run.py's folder is on the path

HERE = Path(__file__).resolve().parent
ARROW_WARMUP_ROWS = 16_000_000  # rows through the JVM's Arrow hand-over before writes are timed
# Runs of each side at --scale-rows: a full read there takes seconds, so its median is steady
# with fewer runs, and the default bench stays near 10 minutes.
SCALE_REPEATS = 3
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


# -- helpers ---------------------------------------------------------------------------------

def median_time(fn: Callable[[], Any], repeats: int, setup: Callable[[], Any] | None = None) -> float:
    """Median wall time of `fn` over `repeats` runs after one warm-up (setup is not timed)."""
    return paired_times({"fn": fn}, repeats, setup)["fn"]


def paired_times(fns: dict[str, Callable[[], Any]], repeats: int,
                 setup: Callable[[], Any] | None = None) -> dict[str, float]:
    """Median wall time of each of `fns`, run in turns (a, b, a, b, ...) after one warm-up each,
    so that this machine's drift during the run hits every side of a ratio alike (timed one
    after the other, the same pair differed by up to 40% between the halves of a run)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeats + 1):
        for name, fn in fns.items():
            if setup is not None:
                setup()
            start = time.perf_counter()
            fn()
            if i:  # the first round warms caches and the JVM
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def spark_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by this machine's JVMs and Spark Python workers,
    from /proc (Linux; empty elsewhere): where a Spark job's time goes, which wall times on 2
    busy cores do not show."""
    if not os.path.isdir("/proc"):
        return {}
    hz = os.sysconf("SC_CLK_TCK")
    out = {"jvm": 0.0, "python": 0.0}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        used = (int(fields[11]) + int(fields[12])) / hz  # utime + stime
        if any(b"pyspark.daemon" in a for a in argv):
            out["python"] += used
        elif argv[0].endswith(b"java"):
            out["jvm"] += used
    return out


def cpu_jiffies() -> tuple[int, int] | None:
    """(stolen, total) CPU time of this machine so far, in clock ticks, from /proc/stat (Linux):
    time the hypervisor gave other guests while this one wanted to run. It changes every
    timing here, and a parallel speedup most of all, so each scenario reports its share."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def metered(fn: Callable[[], Any], into: list[dict[str, float]]) -> Callable[[], None]:
    """`fn`, appending the Spark CPU seconds of each call to `into`."""
    def run() -> None:
        before = spark_cpu_seconds()
        fn()
        after = spark_cpu_seconds()
        into.append({k: after[k] - before[k] for k in after})
    return run


def median_cpu(samples: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Median CPU seconds per kind, without the warm-up call (the first)."""
    kept = samples[1:] or samples
    return {f"{prefix}_{kind}_cpu_s": round(statistics.median(s[kind] for s in kept), 2)
            for kind in (kept[0] if kept else {})}


def status_text(scenario: dict[str, Any], met: str = "met", missed: str = "**missed**") -> str:
    """A recorded scenario's verdict: at the default size, and at --scale-rows where measured."""
    def word(ok: bool | None) -> str:
        return "n/a" if ok is None else (met if ok else missed)
    text = word(scenario["met"])
    if scenario.get("scaled_met") is not None:
        text += f"; at {scenario['figures']['scale_rows']:,} rows: {word(scenario['scaled_met'])}"
    return text


def make_rows(n: int, start: int = 0, seed: int = 0, ts: int = 1) -> pa.Table:
    """The benchmark's rows: long key, string, long ordering field, double, timestamp."""
    rng = np.random.default_rng(seed)
    ids = np.arange(start, start + n, dtype=np.int64)
    return pa.table({
        "id": ids,
        "name": pa.array(np.char.add("name-", (ids % 100_000).astype(str))),
        "ts": np.full(n, ts, dtype=np.int64),
        "amount": rng.random(n) * 1000,
        "created": pa.array((1_700_000_000_000_000 + ids * 1000).astype("datetime64[us]")).cast(pa.timestamp("us", tz="UTC")),
    })


def upsert_batch(n: int, frac: float, seed: int, ts: int) -> pa.Table:
    """`frac * n` rows: half updates of random existing keys, half new keys."""
    rng = np.random.default_rng(seed)
    k = int(n * frac)
    updates = rng.choice(n, size=k // 2, replace=False)
    inserts = np.arange(n + seed * k, n + seed * k + (k - k // 2))
    ids = np.concatenate([updates, inserts]).astype(np.int64)
    t = make_rows(len(ids), seed=seed, ts=ts)
    return t.set_column(0, "id", pa.array(ids)).set_column(1, "name", pa.array(np.char.add("upd-", ids.astype(str))))


def mor_upserts(n: int) -> Iterator[pa.Table]:
    """The 5 upserts of 10% that follow the base in (4), (5) and (10), one at a time."""
    for i in range(5):
        yield upsert_batch(n, 0.10, seed=10 + i, ts=10 + i)


def delta_upsert(uri: str, batch: pa.Table) -> None:
    """An upsert into a Delta table: deltalake's merge, update-all and insert-all by `id`."""
    import deltalake

    (deltalake.DeltaTable(uri).merge(batch, predicate="t.id = s.id", source_alias="s", target_alias="t")
     .when_matched_update_all().when_not_matched_insert_all().execute())


def connector_conf() -> dict[str, str]:
    """The Spark properties the project recommends for nbcc jobs (spark_conf/nbcc-defaults.conf)."""
    conf = {}
    for line in (HERE.parent / "spark_conf" / "nbcc-defaults.conf").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, value = line.split(None, 1)
            conf[key] = value
    return conf


def spark_session():
    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    for key, value in connector_conf().items():  # as a job run with --properties-file would
        builder = builder.config(key, value)
    spark = (builder.master("local[2]").appName("nbcc-bench")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.session.timeZone", "UTC").config("spark.driver.memory", "6g")
             .config("spark.sql.python.filterPushdown.enabled", "true")
             .config("spark.sql.shuffle.partitions", "4").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    floor.register(spark)
    return spark


def consume(df) -> None:
    """Read every row of `df` without collecting it to the driver."""
    df.write.format("noop").mode("overwrite").save()


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server in a process of its own on a free loopback port: its endpoint URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the moto server did not start on port {port}") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.n = args.rows
        self.repeats = args.repeats
        self.work = Path(tempfile.mkdtemp(prefix="nbcc-bench-"))
        self.results: dict[str, Any] = {"rows": self.n, "repeats": self.repeats, "scenarios": {}}
        self._spark = None
        self._arrow_path_warm = False
        self.ticks_at_start = cpu_jiffies()  # reset by settle() before each scenario

    @property
    def spark(self):
        if self._spark is None:
            self._spark = spark_session()
        return self._spark

    def settle(self) -> None:
        """Start a scenario from a settled machine: the earlier scenarios' dirty pages written back
        (on ext4 an fsync can wait for other files' data, which slowed the concurrent writers'
        commits after the bulk writes) and the JVM's garbage collected."""
        if self._spark is not None:
            self._spark.catalog.clearCache()
            self._spark.sparkContext._jvm.System.gc()
        if hasattr(os, "sync"):
            os.sync()
        self.ticks_at_start = cpu_jiffies()

    def bulk_input(self) -> Path:
        """The benchmark's rows as one Parquet file (Spark's input for bulk writes)."""
        path = self.work / "input.parquet"
        if not path.exists():
            pq.write_table(make_rows(self.n), path)
        return path

    def warm_arrow_path(self, df=None) -> list[float]:
        """Write the benchmark's rows through the do-nothing Python writer until the JVM has
        compiled its hand-over of rows to Python (once per session; returns each write's time). Measured here, that
        path takes 4-7 writes of 2M rows to reach steady state (1.2-1.4 s a write, then 0.65 s,
        with the JIT compiler threads busy meanwhile), while Spark's Parquet write is steady after
        one: a single warm-up round made every Spark-to-Python write look up to 2x slower.
        `df`: the cached benchmark rows, when the caller has them (else cached here for it)."""
        if self._arrow_path_warm:
            return []
        rows = df if df is not None else self.spark.read.parquet(str(self.bulk_input())).cache()
        times = []
        for _ in range(max(3, -(-ARROW_WARMUP_ROWS // max(rows.count(), 1)))):
            start = time.perf_counter()
            rows.write.format(floor.NAME).mode("append").save()
            times.append(round(time.perf_counter() - start, 3))
        if df is None:
            rows.unpersist()
        self._arrow_path_warm = True
        return times

    def record(self, key: str, title: str, figures: dict[str, Any], target: str, met: bool | None, note: str = "",
               scaled_met: bool | None = None):
        """`met`: the target at the default size; `scaled_met`: the same target at --scale-rows rows
        (scenarios 5 and 6 measure both)."""
        now = cpu_jiffies()
        if now is not None and self.ticks_at_start is not None and now[1] > self.ticks_at_start[1]:
            stolen, total = now[0] - self.ticks_at_start[0], now[1] - self.ticks_at_start[1]
            figures = {**figures, "cpu_steal_pct": round(100 * stolen / total, 1)}
        scenario = self.results["scenarios"][key] = {"title": title, "figures": figures, "target": target,
                                                     "met": met, "scaled_met": scaled_met, "note": note}
        print(f"[{key}] {title}: {json.dumps(figures)} target {target}: {status_text(scenario, 'MET', 'MISSED')}",
              flush=True)

    def base_table(self, n: int | None = None) -> str:
        """A compacted nbcc table of `n` base rows (default `--rows`; built once), and for the
        default size its Parquet twin. Larger tables are written in commits of `--rows` rows,
        so that building one takes no more memory than the default table."""
        n = n or self.n
        path = self.work / ("base" if n == self.n else f"base-{n}")
        if not path.exists():
            t = nbcc.Table.create(str(path), make_rows(1).schema, "id", ordering_field="ts", buckets=16)
            for start in range(0, n, self.n):
                rows = make_rows(min(self.n, n - start), start=start)
                t.write(rows)
                if n == self.n:  # one commit: `rows` is the whole table
                    pq.write_table(rows, self.work / "base.parquet")
            t.compact()
        return str(path)

    def fresh_copy(self, name: str) -> str:
        dst = self.work / name
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(self.base_table(), dst)
        return str(dst)

    # -- scenarios -----------------------------------------------------------------------------

    def s1_bulk_write(self):
        spark = self.spark
        df = spark.read.parquet(str(self.bulk_input())).cache()
        df.count()
        warmup = self.warm_arrow_path(df)
        out = self.work / "s1"

        def clear():
            shutil.rmtree(out, ignore_errors=True)
            (out / "pyarrow").mkdir(parents=True)

        cpu: dict[str, list[dict[str, float]]] = {"nbcc": [], "parquet": [], "floor": [], "pyarrow_floor": []}
        t = paired_times({
            "nbcc": metered(lambda: df.write.format("nbcc").mode("append").option("record_key", "id")
                                      .option("ordering_field", "ts").save(str(out / "nbcc")), cpu["nbcc"]),
            "parquet": metered(lambda: df.write.mode("overwrite").parquet(str(out / "pq")), cpu["parquet"]),
            "floor": metered(lambda: df.write.format(floor.NAME).mode("append").save(), cpu["floor"]),
            "pyarrow_floor": metered(lambda: df.write.format(floor.NAME).mode("append")
                                             .option("path", str(out / "pyarrow")).save(), cpu["pyarrow_floor"])},
            self.repeats, clear)
        nbcc_s, pq_s, floor_s, pa_floor_s = t["nbcc"], t["parquet"], t["floor"], t["pyarrow_floor"]
        df.unpersist()
        ratio = nbcc_s / pq_s
        figures = {"nbcc_s": round(nbcc_s, 3), "parquet_s": round(pq_s, 3), "ratio": round(ratio, 2),
                   "python_writer_floor_s": round(floor_s, 3), "floor_vs_parquet": round(floor_s / pq_s, 2),
                   "pyarrow_parquet_floor_s": round(pa_floor_s, 3),
                   "pyarrow_floor_vs_parquet": round(pa_floor_s / pq_s, 2),
                   "nbcc_vs_pyarrow_floor": round(nbcc_s / pa_floor_s, 2)}
        if warmup:
            figures["arrow_warmup_writes_s"] = warmup
        for name, samples in cpu.items():
            figures.update(median_cpu(samples, name))
        self.record("1", "bulk write through Spark", figures, "<= 1.3x", ratio <= 1.3,
                    "python_writer_floor: a Python data source writer that only counts the Arrow batches Spark "
                    "hands it (bench/floor.py); pyarrow_parquet_floor: one that only writes them to one Parquet "
                    "file per task with pyarrow, encoded as nbcc encodes data columns (snappy, dictionary where "
                    "a sample of the rows repeats, delta for integers with small steps): the least any Python "
                    "source writing Parquet costs; arrow_warmup_writes_s: the do-nothing writer's writes before "
                    "timing, until the JVM has compiled its hand-over of rows to Python "
                    f"({ARROW_WARMUP_ROWS // 1_000_000}M rows); *_cpu_s: CPU seconds of the JVM and of Spark's "
                    "Python workers per write (2 cores: wall time is about their sum / 2 when both are busy)")

    def s2_upsert(self):
        import deltalake

        spark = self.spark
        batch = upsert_batch(self.n, 0.10, seed=1, ts=2)
        batch_path = self.work / "upsert.parquet"
        pq.write_table(batch, batch_path)
        self.warm_arrow_path()  # steady state, as after scenario 1 (when run alone)
        sdf = spark.read.parquet(str(batch_path)).cache()
        sdf.count()
        state: dict[str, Any] = {}

        def prep_nbcc():
            state["uri"] = self.fresh_copy("s2")

        spark_s = median_time(lambda: sdf.write.format("nbcc").mode("append").save(state["uri"]), self.repeats, prep_nbcc)
        py_s = median_time(lambda: nbcc.Table.open(state["uri"]).write(batch), self.repeats, prep_nbcc)
        delta_base = self.work / "delta-base"
        if not delta_base.exists():
            deltalake.write_deltalake(str(delta_base), make_rows(self.n))

        def prep_delta():
            dst = self.work / "s2-delta"
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(delta_base, dst)
            state["delta"] = str(dst)

        delta_s = median_time(lambda: delta_upsert(state["delta"], batch), self.repeats, prep_delta)
        sdf.unpersist()
        met = py_s < delta_s and spark_s <= 2 * delta_s
        self.record("2", "upsert 10% of keys (half updates, half inserts)",
                    {"nbcc_spark_s": round(spark_s, 3), "nbcc_python_s": round(py_s, 3), "deltalake_merge_s": round(delta_s, 3),
                     "python_vs_delta": round(py_s / delta_s, 2), "spark_vs_delta": round(spark_s / delta_s, 2)},
                    "Python API < deltalake; Spark <= 2x deltalake", met)

    def s3_read_compacted(self):
        spark = self.spark
        uri = self.base_table()
        nbcc_df = spark.read.format("nbcc").load(uri)
        floor_df, partitions = self.floor_reader(nbcc_df, uri)
        t = paired_times({"nbcc": lambda: consume(nbcc_df),
                          "parquet": lambda: consume(spark.read.parquet(str(self.work / "base.parquet"))),
                          "floor": lambda: consume(floor_df)},
                         self.repeats)
        nb, pqs, floor_s = t["nbcc"], t["parquet"], t["floor"]
        ratio = nb / pqs
        self.record("3", "snapshot read after compaction", {"nbcc_s": round(nb, 3), "parquet_s": round(pqs, 3),
                                                            "ratio": round(ratio, 2),
                                                            "python_reader_floor_s": round(floor_s, 3),
                                                            "floor_vs_parquet": round(floor_s / pqs, 2)},
                    "<= 1.2x", ratio <= 1.2,
                    "python_reader_floor: a Python data source that only reads the same base files with "
                    f"pyarrow, in the same {partitions} input partitions, and yields their "
                    "Arrow batches (bench/floor.py)")

    def floor_reader(self, nbcc_df, uri: str, **plan_options: Any) -> tuple[Any, int]:
        """A DataFrame of the floor reader (bench/floor.py) over the very files nbcc reads for
        `nbcc_df` (planned with `plan_options`), in as many input partitions; and that count."""
        partitions = nbcc_df.rdd.getNumPartitions()  # plans the read once
        table = nbcc.Table.open(uri)
        paths = [table.storage.full_path(data_file_path(task.partition, name))
                 for task in table.plan(**plan_options).tasks for name in task.files]
        return (self.spark.read.format(floor.NAME).schema(nbcc_df.schema).option("paths", json.dumps(paths))
                .option("partitions", partitions).load()), partitions

    def mor_table(self, n: int | None = None) -> str:
        """The base table of `n` rows plus 5 uncompacted upserts of 10% (built once), and for the
        default size the final rows as Parquet."""
        n = n or self.n
        path = self.work / ("mor" if n == self.n else f"mor-{n}")
        if not path.exists():
            shutil.copytree(self.base_table(n), path)
            t = nbcc.Table.open(str(path))
            for batch in mor_upserts(n):
                t.write(batch)
            if n == self.n:
                pq.write_table(t.read(), self.work / "mor-final.parquet")
        return str(path)

    def s4_read_mor(self):
        spark = self.spark
        uri = self.mor_table()
        t = paired_times({"nbcc": lambda: consume(spark.read.format("nbcc").load(uri)),
                          "parquet": lambda: consume(spark.read.parquet(str(self.work / "mor-final.parquet")))},
                         self.repeats)
        nb, pqs = t["nbcc"], t["parquet"]
        ratio = nb / pqs
        self.record("4", "snapshot read with 5 uncompacted 10% upserts (merge on read)",
                    {"nbcc_s": round(nb, 3), "parquet_final_rows_s": round(pqs, 3), "ratio": round(ratio, 2)},
                    "<= 2x", ratio <= 2)

    def one_row_queries(self, lookup: bool = False) -> dict[str, Callable[[], Any]]:
        """The fixed cost of any query in this session: a collect of a one-row Parquet file
        through Spark's own source, and through a Python data source that only reads that file
        in one input partition (bench/floor.py). No Python source's query can cost less than the
        second, so it bounds the ratios of small reads to full ones, (5) and (6)."""
        spark = self.spark
        key = self.n // 3
        one_row = self.work / "one-row.parquet"
        if not one_row.exists():
            pq.write_table(make_rows(1, start=key), one_row)
        schema = spark.read.format("nbcc").load(self.base_table()).schema
        python_source = (spark.read.format(floor.NAME).schema(schema).option("paths", json.dumps([str(one_row)]))
                         .option("partitions", 1))
        queries = {"parquet_one_row": lambda: spark.read.parquet(str(one_row)).collect(),
                   "python_source_one_row": lambda: python_source.load().collect()}
        if lookup:  # the same collect with a filter on the key: Spark then pushes it to the source
            queries["python_source_one_row_lookup"] = lambda: python_source.load().where(f"id = {key}").collect()
        return queries

    def last_commit_read(self, uri: str) -> tuple[Any, str]:
        """A DataFrame of an incremental read of the table's last commit, and its `begin`."""
        done = [i for i in nbcc.Table.open(uri).timeline() if i.state == "completed"]
        begin = done[-2].completion
        return self.spark.read.format("nbcc").option("query_type", "incremental").option("begin", begin).load(uri), begin

    def s5_incremental(self):
        spark = self.spark
        uri = self.mor_table()
        incremental, begin = self.last_commit_read(uri)
        range_floor, _ = self.floor_reader(incremental, uri, query_type="incremental", begin=begin)
        t = paired_times({"incremental": lambda: consume(incremental),
                          "snapshot": lambda: consume(spark.read.format("nbcc").load(uri)),
                          "range_floor": lambda: consume(range_floor),
                          **self.one_row_queries()}, self.repeats)
        inc, full, fixed = t["incremental"], t["snapshot"], t["python_source_one_row"]
        ratio = inc / full
        figures = {"incremental_s": round(inc, 3), "snapshot_s": round(full, 3), "ratio": round(ratio, 2),
                   "python_source_one_row_s": round(fixed, 3), "floor_ratio": round(fixed / full, 2),
                   "python_reader_range_files_s": round(t["range_floor"], 3),
                   "range_floor_ratio": round(t["range_floor"] / full, 2),
                   "parquet_one_row_file_s": round(t["parquet_one_row"], 3)}
        scaled_met = None
        if self.args.scale_rows:  # the same table and commits, --scale-rows rows
            big_uri = self.mor_table(self.args.scale_rows)
            big_incremental, _ = self.last_commit_read(big_uri)
            big = paired_times({"incremental": lambda: consume(big_incremental),
                                "snapshot": lambda: consume(spark.read.format("nbcc").load(big_uri))}, SCALE_REPEATS)
            big_ratio = big["incremental"] / big["snapshot"]
            figures |= {"scale_rows": self.args.scale_rows, "incremental_s_at_scale": round(big["incremental"], 3),
                        "snapshot_s_at_scale": round(big["snapshot"], 3), "ratio_at_scale": round(big_ratio, 3)}
            scaled_met = big_ratio <= 0.2
            shutil.rmtree(big_uri, ignore_errors=True)  # about 1 GB; (6) uses the base table it was copied from
        self.record("5", "incremental read of the last 10% commit vs full snapshot", figures,
                    "<= 0.2", ratio <= 0.2, scaled_met=scaled_met, note=
                    "the range's records outrank every older one here (newer instants and ordering values), so "
                    "each touched file group reads only the range's files (format.md section 12.7); "
                    "python_source_one_row: a Python data source's collect of a one-row file, the least any "
                    "query through the API costs here, and floor_ratio that over the snapshot: the smallest "
                    "ratio any Python source could show; python_reader_range_files: the floor reader (as in "
                    "(3)) of the files the incremental read reads (the commit's own log files), and "
                    "range_floor_ratio that over the snapshot; *_at_scale: the same two reads of a table built "
                    "the same way (a compacted base and 5 upserts of 10%) with scale_rows rows, where a query's "
                    "fixed cost is a small part of a snapshot")

    def s6_point_lookup(self):
        spark = self.spark
        uri = self.base_table()
        key = self.n // 3
        base_pq = str(self.work / "base.parquet")
        t = paired_times({"lookup": lambda: spark.read.format("nbcc").load(uri).where(f"id = {key}").collect(),
                          "scan": lambda: consume(spark.read.format("nbcc").load(uri)),
                          "parquet_lookup": lambda: spark.read.parquet(base_pq).where(f"id = {key}").collect(),
                          "parquet_scan": lambda: consume(spark.read.parquet(base_pq)),
                          **self.one_row_queries(lookup=True)}, self.repeats)
        look, scan = t["lookup"], t["scan"]
        buckets = nbcc.Table.open(uri).config.buckets
        ratio = look / scan
        # With the metadata table: a copy of the merge-on-read table (base files and 5 upserts in
        # every file group) with every partition built; a key the upserts did not touch is only in
        # its base file, so its key filter leaves the 5 log files out.
        mor = self.work / "s6-index"
        shutil.rmtree(mor, ignore_errors=True)
        shutil.copytree(self.mor_table(), mor)
        indexed = nbcc.Table.open(str(mor))
        start = time.perf_counter()
        indexed.build_index()
        index_s = time.perf_counter() - start
        hit = next(k for k in range(key, self.n) if indexed.read(filter=[("id", "=", k)], use_metadata_table=False)
                   .column("name")[0].as_py().startswith("name-"))  # not rewritten by an upsert

        # The same rows compacted into one file group (one bucket): a lookup through the Python
        # API decodes the row group of its base file that may hold the key, not the whole file.
        one_group = nbcc.Table.create(str(self.work / "s6-one-group"), make_rows(1).schema, "id",
                                      ordering_field="ts", buckets=1)
        one_group.write(make_rows(self.n))
        one_group.compact()
        one_t = paired_times({"lookup": lambda: one_group.read(filter=[("id", "=", key)]),
                              "read": lambda: one_group.read()}, self.repeats)

        def lookup(use: str) -> float:
            return median_time(lambda: spark.read.format("nbcc").option("use_metadata_table", use).load(str(mor))
                               .where(f"id = {hit}").collect(), self.repeats)

        def files(use: bool) -> int:
            return sum(len(t.files) for t in indexed.plan(filter=[("id", "=", hit)], use_metadata_table=use).tasks)

        def python_lookup(use: bool) -> float:
            return median_time(lambda: indexed.read(filter=[("id", "=", hit)], use_metadata_table=use), self.repeats)

        at_scale, scaled_met = {}, None
        if self.args.scale_rows:  # the same lookup and scan of a table of --scale-rows rows
            big_uri = self.base_table(self.args.scale_rows)
            big = paired_times({"lookup": lambda: spark.read.format("nbcc").load(big_uri).where(f"id = {key}").collect(),
                                "scan": lambda: consume(spark.read.format("nbcc").load(big_uri))}, SCALE_REPEATS)
            big_ratio = big["lookup"] / big["scan"]
            at_scale = {"scale_rows": self.args.scale_rows, "lookup_s_at_scale": round(big["lookup"], 3),
                        "scan_s_at_scale": round(big["scan"], 3), "ratio_at_scale": round(big_ratio, 3)}
            scaled_met = big_ratio <= 1 / (buckets // 2)
            shutil.rmtree(big_uri, ignore_errors=True)  # 0.7 GB, not needed again

        self.record("6", "point lookup by key with pushdown vs full scan",
                    {"lookup_s": round(look, 3), "scan_s": round(scan, 3), "ratio": round(ratio, 3),
                     "parquet_lookup_s": round(t["parquet_lookup"], 3), "parquet_scan_s": round(t["parquet_scan"], 3),
                     "parquet_ratio": round(t["parquet_lookup"] / t["parquet_scan"], 3),
                     "parquet_one_row_file_s": round(t["parquet_one_row"], 3),
                     "python_source_one_row_s": round(t["python_source_one_row"], 3),
                     "python_source_one_row_lookup_s": round(t["python_source_one_row_lookup"], 3),
                     "floor_ratio": round(t["python_source_one_row_lookup"] / scan, 3),
                     "mor_lookup_s": round(lookup("false"), 3), "mor_lookup_with_metadata_table_s": round(lookup("true"), 3),
                     "mor_python_lookup_s": round(python_lookup(False), 3),
                     "mor_python_lookup_with_metadata_table_s": round(python_lookup(True), 3),
                     "mor_files_opened": files(False), "mor_files_opened_with_metadata_table": files(True),
                     "build_index_s": round(index_s, 3),
                     "one_group_python_lookup_s": round(one_t["lookup"], 4),
                     "one_group_python_read_s": round(one_t["read"], 4), **at_scale},
                    f"<= 1/{buckets // 2}", ratio <= 1 / (buckets // 2), scaled_met=scaled_met, note=
                    "parquet_*: Spark's own Parquet source, the same lookup and scan of the same rows (one file), "
                    "and a collect of a one-row file (what any query costs here); python_source_one_row: the "
                    "same collect through a Python data source that only reads the file, and with the "
                    "lookup's filter (python_source_one_row_lookup: Spark then asks the source which filters "
                    "it takes), and floor_ratio that over nbcc's scan (the smallest ratio any Python source "
                    "could show for a lookup); "
                    "with the metadata table: the merge-on-read table (base + 5 upserts) with every partition "
                    "built; the key is one no upsert touched; one_group_*: the rows compacted into one file "
                    "group, a lookup and a full read through the Python API (a lookup decodes the one "
                    "64k-row group of the base file whose key range holds the key); *_at_scale: the same "
                    "lookup and scan of a compacted table of scale_rows rows (16 buckets)")

    def s7_concurrent_writers(self):
        script = HERE / "concurrent_writers.py"
        base = self.fresh_copy("s7-base")
        out = subprocess.run([sys.executable, str(script), "--table", base, "--rows", str(self.n),
                              "--work", str(self.work), "--rounds", str(self.args.writer_rounds)],
                             capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-3000:])
        figures = json.loads(out.stdout.strip().splitlines()[-1])
        met = figures["nbcc_failed"] == 0 and figures["nbcc_retries"] == 0 and figures["speedup_4_vs_1"] >= 1.5
        self.record("7", "4 writers upserting overlapping keys at once", figures,
                    "0 failed, 0 retries, >= 1.5x one writer's rows/s", met,
                    "machine_2_process_speedup: two processes spinning the same CPU-bound loop against one "
                    "alone, measured after each round's writers (median): a rough and noisy gauge of the machine's "
                    "parallel speed during the scenario; nbcc_rows_per_s_4_separate_tables: four writers doing the "
                    "same work at once, each on its own copy of the table (no lock or table shared): what "
                    "this machine allows four writer processes on its cores, against which the shared "
                    "table's figure shows what sharing costs")

    def s8_planning(self):
        path = self.work / "commits"
        shutil.rmtree(path, ignore_errors=True)
        t = nbcc.Table.create(str(path), pa.schema([("id", pa.int64()), ("v", pa.int64())]), "id", buckets=16)
        writes = []
        for i in range(self.args.commits):
            start = time.perf_counter()
            t.write(pa.table({"id": [i % 997, (i * 7) % 997], "v": [i, i]}))
            writes.append(time.perf_counter() - start)
            if i % 200 == 199:
                t.compact()
        start = time.perf_counter()
        t.build_index()  # the metadata table, built once the commits exist (the writers then add theirs)
        index_s = time.perf_counter() - start
        code = ("import nbcc,time,sys; t=nbcc.Table.open(sys.argv[1]); s=time.perf_counter(); "
                "p=t.plan(use_metadata_table=sys.argv[2]=='true'); print(time.perf_counter()-s, flush=True)")

        def cold_plan(use: bool) -> float:
            return statistics.median(self._timed_child([code, str(path), str(use).lower()]) for _ in range(3))

        before, before_mdt = cold_plan(False), cold_plan(True)
        on_s3 = self._plan_on_s3(path)
        t.clean(retain_commits=10)
        t.archive(retain_commits=10)
        after, after_mdt = cold_plan(False), cold_plan(True)
        self.record("8", f"planning a read of a table with {self.args.commits} commits (fresh process)",
                    {"before_archival_s": round(before, 3), "before_archival_with_metadata_table_s": round(before_mdt, 3),
                     **on_s3,
                     "after_archival_s": round(after, 3), "after_archival_with_metadata_table_s": round(after_mdt, 3),
                     "build_index_s": round(index_s, 3),
                     "write_ms_first_100": round(1000 * statistics.median(writes[:100]), 1),
                     "write_ms_last_100": round(1000 * statistics.median(writes[-100:]), 1)},
                    "< 1 s", max(after, after_mdt) < 1,
                    "with the metadata table the plan reads no commit file: it lists the timeline and reads "
                    "the metadata table's few files; s3_* figures: the same table's .nbcc/ on S3 (moto on "
                    "loopback), before archival; write_ms_*: a 2-row commit through the Python API "
                    "(median), among the table's first and last 100 commits: what a commit costs as "
                    "the active timeline grows")

    @staticmethod
    def _timed_child(args: list[str]) -> float:
        """The time a fresh `python -c args...` process prints."""
        out = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"a plan process failed ({out.returncode}): {out.stderr[-2000:]}")
        return float(out.stdout)

    def _plan_on_s3(self, path: Path) -> dict[str, float]:
        """Cold planning of the table at `path` from S3 (moto on loopback, a few ms per request):
        what the metadata table saves is requests. Planning reads only `.nbcc/`, so only that is
        uploaded. Empty if moto is not installed (the `test` extra)."""
        try:
            import s3fs
            import moto.server  # noqa: F401
        except ImportError:
            return {}
        with moto_server() as endpoint:
            opts = {"key": "bench", "secret": "bench", "endpoint_url": endpoint}
            fs = s3fs.S3FileSystem(key="bench", secret="bench", client_kwargs={"endpoint_url": endpoint})
            fs.mkdir("bench")
            # About 2,300 objects at some 10 ms of the server's time each: the server is a process
            # of its own and takes 64 at once, so uploading takes 15 s rather than 28 s.
            fs.put(str(path / ".nbcc"), "bench/t/.nbcc", recursive=True, batch_size=64)
            code = ("import nbcc,time,sys,json; t=nbcc.Table.open(sys.argv[1], json.loads(sys.argv[3])); "
                    "s=time.perf_counter(); t.plan(use_metadata_table=sys.argv[2]=='true'); print(time.perf_counter()-s, flush=True)")

            def cold(use: bool) -> float:
                return self._timed_child([code, "s3://bench/t", str(use).lower(), json.dumps(opts)])

            return {"s3_before_archival_s": round(cold(False), 3),
                    "s3_before_archival_with_metadata_table_s": round(cold(True), 3)}

    def s9_memory(self):
        script = HERE / "merge_memory.py"
        out = subprocess.run([sys.executable, str(script), "--rows", str(self.args.slice_rows), "--work", str(self.work)],
                             capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-3000:])
        figures = json.loads(out.stdout.strip().splitlines()[-1])
        self.record("9", f"peak memory merging one {self.args.slice_rows:,}-row file slice (a read, then a compaction)",
                    figures, "< 1.5 GB, both",
                    figures["peak_rss_gb"] < 1.5 and figures["compaction_peak_rss_gb"] < 1.5)

    def s10_time_travel_vs_delta(self):
        """The table history of (4) and (5), a base of --rows rows and 5 upserts of 10%, in nbcc
        and in Delta (deltalake, change data feed on: a write, then the same 5 merges), read as of
        the first and the next-to-last version, and the last commit's changes."""
        import deltalake

        uri = self.mor_table()
        delta_uri = str(self.work / "s10-delta")
        if not Path(delta_uri).exists():
            deltalake.write_deltalake(delta_uri, make_rows(self.n), configuration={"delta.enableChangeDataFeed": "true"})
            for batch in mor_upserts(self.n):
                delta_upsert(delta_uri, batch)
        done = [i.completion for i in nbcc.Table.open(uri).timeline()
                if i.state == "completed" and i.action == "deltacommit"]
        first, before_last = done[0], done[-2]  # Delta's versions 0 and 4

        def delta_cdf(version: int) -> pa.Table:
            reader = deltalake.DeltaTable(delta_uri).load_cdf(starting_version=version, ending_version=version)
            return pa.RecordBatchReader.from_stream(reader).read_all()

        reads: dict[str, Callable[[], Any]] = {
            "nbcc_as_of": lambda: nbcc.Table.open(uri).read(as_of=before_last),
            "delta_version": lambda: deltalake.DeltaTable(delta_uri, version=4).to_pyarrow_table(),
            "nbcc_as_of_first": lambda: nbcc.Table.open(uri).read(as_of=first),
            "delta_version_0": lambda: deltalake.DeltaTable(delta_uri, version=0).to_pyarrow_table(),
            "nbcc_incremental": lambda: nbcc.Table.open(uri).read(query_type="incremental", begin=before_last),
            "nbcc_cdc": lambda: nbcc.Table.open(uri).read(query_type="incremental", begin=before_last,
                                                          incremental_format="cdc"),
            "delta_cdf": lambda: delta_cdf(5),
        }
        # Like for like, checked once before timing: the same rows as of each version, and the
        # same changes (Delta gives an update as a pre- and a post-image row).
        def digest(t: pa.Table) -> tuple:
            return t.num_rows, pc.sum(t.column("id")).as_py(), pc.sum(t.column("ts")).as_py()

        def ids(t: pa.Table, kind: str) -> list[int]:
            kinds = t.column("_change_type").cast(pa.string())  # Delta's is a string_view
            return sorted(pc.filter(t.column("id"), pc.equal(kinds, kind)).to_pylist())

        as_of, nbcc_cdc, cdf = reads["nbcc_as_of"](), reads["nbcc_cdc"](), reads["delta_cdf"]()
        updated = ids(nbcc_cdc, "update")
        if (digest(as_of) != digest(reads["delta_version"]())
                or digest(reads["nbcc_as_of_first"]()) != digest(reads["delta_version_0"]())
                or ids(nbcc_cdc, "insert") != ids(cdf, "insert") or not updated
                or not updated == ids(cdf, "update_postimage") == ids(cdf, "update_preimage")
                or ids(nbcc_cdc, "delete") or ids(cdf, "delete")):
            raise RuntimeError("nbcc and deltalake read different rows or changes")
        spark = self.spark
        spark_as_of = spark.read.format("nbcc").option("as_of", before_last).load(uri)
        spark_cdc = (spark.read.format("nbcc").option("query_type", "incremental").option("begin", before_last)
                     .option("incremental_format", "cdc").load(uri))
        t = paired_times({**reads, "nbcc_spark_as_of": lambda: consume(spark_as_of),
                          "nbcc_spark_cdc": lambda: consume(spark_cdc)}, self.repeats)
        figures = {f"{name}_s": round(v, 3) for name, v in t.items()}
        figures.update({
            "as_of_vs_delta": round(t["nbcc_as_of"] / t["delta_version"], 2),
            "as_of_first_vs_delta": round(t["nbcc_as_of_first"] / t["delta_version_0"], 2),
            # latest_state: one row per changed key; Delta's feed: two per update
            "incremental_vs_delta_cdf": round(t["nbcc_incremental"] / t["delta_cdf"], 2),
            "cdc_vs_delta_cdf": round(t["nbcc_cdc"] / t["delta_cdf"], 2),
            "rows_as_of": as_of.num_rows, "rows_cdc": nbcc_cdc.num_rows, "rows_delta_cdf": cdf.num_rows})
        self.record("10", "time travel and incremental reads (Python API) vs deltalake", figures,
                    "none set (a peer comparison)", None,
                    "the history of (4) and (5) in both formats: a base of the benchmark's rows, then 5 upserts "
                    "of 10% (Delta: a write and 5 merges, change data feed on); as_of: the state before the "
                    "last upsert (Delta's version 4), as_of_first: the base (version 0); incremental and cdc: "
                    "the last upsert's changes, as each key's latest state and as nbcc's cdc rows (before and "
                    "after in one row), against Delta's change data feed of version 5 (an update is two rows, "
                    "its pre- and post-image); nbcc_spark_*: the same as_of and cdc reads through Spark. "
                    "nbcc merges a state on read, Delta merged it on write (the merges rewrote the files the "
                    "upserts touched) and wrote each merge's changes to change data files as it went")

    def run(self, keys: list[str]) -> None:
        """Run the scenarios `keys` in turn, writing the results after each."""
        for key in keys:
            key = key.strip()
            start = time.perf_counter()
            self.settle()
            getattr(self, SCENARIOS[key])()
            # what the scenario took, its tables' building included: what to cut when `make bench`
            # outgrows its 10 minutes
            self.results["scenarios"][key]["wall_s"] = round(time.perf_counter() - start, 1)
            self.write_results()

    def write_results(self) -> None:
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(self.results, indent=2) + "\n")
        lines = [
            "# nbcc benchmark results",
            "",
            f"`python bench/run.py --rows {self.n} --repeats {self.repeats}` (`make bench`), 2-core machine. "
            "Figures are medians after a warm-up; the two sides of each ratio run in turns in one run. "
            "cpu_steal_pct: the share of this machine's CPU time its hypervisor gave to other guests "
            "during the scenario (from /proc/stat); where it is high, every figure of that row is slower "
            "and noisier, parallel speedups most.",
        ]
        scenarios = sorted(self.results["scenarios"].items(), key=lambda kv: int(kv[0]))
        walls = [(key, s["wall_s"]) for key, s in scenarios if "wall_s" in s]
        if walls:
            lines += ["", f"This run took {sum(w for _, w in walls) / 60:.1f} min: "
                      + ", ".join(f"({key}) {w:.0f} s" for key, w in walls) + "."]
        lines += ["", "| # | scenario | figures | target | result |", "|---|---|---|---|---|"]
        for key, s in scenarios:
            figs = ", ".join(f"{k} {v}" for k, v in s["figures"].items())
            lines.append(f"| {key} | {s['title']} | {figs} | {s['target']} | {status_text(s)} |")
        notes = [f"- ({k}) {s['note']}" for k, s in scenarios if s.get("note")]
        if notes:
            lines += ["", "Notes:", *notes]
        analysis = HERE / "analysis.md"
        if analysis.exists():
            lines += ["", analysis.read_text().rstrip()]
        (out / "results.md").write_text("\n".join(lines) + "\n")


SCENARIOS = {
    "1": "s1_bulk_write", "2": "s2_upsert", "3": "s3_read_compacted", "4": "s4_read_mor",
    "5": "s5_incremental", "6": "s6_point_lookup", "7": "s7_concurrent_writers", "8": "s8_planning", "9": "s9_memory",
    "10": "s10_time_travel_vs_delta",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="nbcc benchmarks")
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--commits", type=int, default=2000)
    parser.add_argument("--slice-rows", type=int, default=10_000_000)
    # 10M: a snapshot there takes seconds against a query's fixed 0.2-0.3 s, which shows how
    # the work scales; 20M (sessions 12-21) showed the same at 40 s more of the run.
    parser.add_argument("--scale-rows", type=int, default=10_000_000,
                        help="also measure (5) and (6) on tables of this many rows (0: not)")
    parser.add_argument("--writer-rounds", type=int, default=5,
                        help="(7): rounds of one and four writers, alternating (the figures are medians)")
    parser.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenario numbers")
    parser.add_argument("--out", default=str(HERE), help="folder for results.json and results.md")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    bench = Bench(args)
    try:
        bench.run(args.only.split(","))
    finally:
        shutil.rmtree(bench.work, ignore_errors=True)


if __name__ == "__main__":
    main()
