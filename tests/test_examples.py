"""The README's runnable examples run (make demo runs examples/quickstart.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_time_travel_example_runs(tmp_path):
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    done = subprocess.run([sys.executable, str(ROOT / "examples/time_travel.py"), "--path", str(tmp_path / "t")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "point lookup id = 3 reads 1 of 4 file groups" in out
    assert "_change_type" in out and "delete" in out and "insert" in out


def _compact_job():
    spec = importlib.util.spec_from_file_location("compact_job", ROOT / "examples/compact.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compact_job_ignores_the_shared_write_options_and_refuses_typos():
    """examples/compact.py runs with spark_conf/nbcc-defaults.conf, whose table options (and
    examples/ingest.py's settings) users uncomment: those are skipped, a misspelt name is not.
    (The job as a whole runs with spark-submit in tests/test_spark_compaction.py.)"""
    job = _compact_job()
    shared = {"record_key": "id", "ordering_field": "ts", "partition_by": "day", "buckets": "16",
              "merge_mode": "event_time", "operation": "upsert", "max_log_file_bytes": "536870912",
              "lock_lease_ms": "30000", "heartbeat_timeout_s": "300", "compaction_delta_commits": "10",
              "compaction_inline": "false", "input": "/data/in", "input_format": "parquet", "mode": "append",
              "repartition_by_bucket": "true"}
    assert job.job_settings({"path": "/t", "storage.key": "K", **shared}) == ("/t", None, False, {"storage.key": "K"})
    assert job.job_settings({"path": "/t", "instant": "20260101000000000"})[1] == "20260101000000000"
    assert job.job_settings({"path": "/t", "schedule_only": "TRUE"})[2] is True

    with pytest.raises(SystemExit) as exc:
        job.job_settings({"path": "/t", "record_kye": "id", "schedule_onyl": "true", **shared})
    assert str(exc.value).startswith("unknown setting(s) spark.nbcc.record_kye, spark.nbcc.schedule_onyl: "
                                     "no nbcc option has this name")
    for bad, message in [({}, "missing --conf spark.nbcc.path"),
                         ({"path": "/t", "schedule_only": "yes"}, "spark.nbcc.schedule_only='yes': use true or false"),
                         ({"path": "/t", "schedule_only": "true", "instant": "20260101000000000"}, "not both")]:
        with pytest.raises(SystemExit, match=re.escape(message)):
            job.job_settings(bad)


# The defaults the documentation gives, written down from it (not taken from nbcc.config):
# format.md §3 (buckets: creation default 16; lock_lease_ms 30000; heartbeat_timeout_s 300),
# §9.2 (max_log_file_bytes 512 MiB) and the README's option tables (operation upsert;
# compaction_inline is `true` to also execute the compaction, so false by default;
# partitionOverwriteMode static).
DOCUMENTED_DEFAULTS = {"buckets": "16", "lock_lease_ms": "30000", "heartbeat_timeout_s": "300",
                       "max_log_file_bytes": str(512 * 1024 * 1024), "operation": "upsert",
                       "compaction_inline": "false", "partitionoverwritemode": "static"}


def test_every_write_option_is_documented_for_spark_submit_jobs():
    """The shared properties file lists every write option, commented out with its default,
    and examples/ingest.py's docstring names every one (it passes them on)."""
    from nbcc.config import WRITE_OPTIONS

    conf = (ROOT / "spark_conf/nbcc-defaults.conf").read_text()
    # Option names match in any letter case (partitionOverwriteMode is Spark's spelling).
    listed = {k.lower(): v for k, v in re.findall(r"^# spark\.nbcc\.(\w+)\s+(\S+)$", conf, re.M)}
    assert set(WRITE_OPTIONS) <= set(listed), set(WRITE_OPTIONS) - set(listed)
    assert {k: listed.get(k) for k in DOCUMENTED_DEFAULTS} == DOCUMENTED_DEFAULTS

    docstring = (ROOT / "examples/ingest.py").read_text().split('"""')[1]
    assert [name for name in WRITE_OPTIONS if not re.search(rf"\b{name}\b", docstring, re.I)] == []


def test_a_table_created_without_settings_gets_the_documented_defaults(tmp_path):
    """format.md §3: buckets (creation default 16), lock_lease_ms 30000, heartbeat_timeout_s 300,
    merge_mode event_time with an ordering field and commit_time without; as table.json says."""
    import pyarrow as pa

    import nbcc

    schema = pa.schema([("id", pa.int64()), ("ts", pa.int64())])
    for name, ordering, mode in [("with", "ts", "event_time"), ("without", None, "commit_time")]:
        uri = tmp_path / name
        nbcc.Table.create(str(uri), schema, "id", ordering_field=ordering)
        doc = json.loads((uri / ".nbcc" / "table.json").read_text())
        assert {k: doc.get(k) for k in ("format_version", "buckets", "lock_lease_ms", "heartbeat_timeout_s",
                                         "merge_mode", "ordering_field")} == {
            "format_version": 1, "buckets": 16, "lock_lease_ms": 30000, "heartbeat_timeout_s": 300,
            "merge_mode": mode, "ordering_field": ordering}
        assert nbcc.Table.open(str(uri)).config.buckets == 16


def _conf_file_properties() -> dict[str, str]:
    """spark_conf/nbcc-defaults.conf's properties, read as spark-submit reads the file's lines."""
    lines = (ROOT / "spark_conf/nbcc-defaults.conf").read_text().splitlines()
    return dict(line.split(None, 1) for line in lines if line.strip() and not line.startswith("#"))


def test_configure_gives_a_session_started_from_python_the_properties_file(tmp_path):
    # A job of an installed nbcc has no spark_conf/ folder: pyspark_nbcc.configure(builder) sets
    # the same properties, the JVM's Java options among them (they apply as the JVM starts).
    script = """
import json, sys
import pyarrow as pa
from pyspark.sql import SparkSession
import nbcc, pyspark_nbcc
spark = pyspark_nbcc.configure(SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")).getOrCreate()
nbcc.Table.create(sys.argv[1], pa.schema([("id", pa.int64())]), "id", buckets=2)
spark.range(5).write.format("nbcc").mode("append").save(sys.argv[1])
props = json.loads(sys.argv[2])
print(json.dumps({"conf": {k: spark.conf.get(k) for k in props if not k.endswith("extraJavaOptions")},
                  "java_options": spark.sparkContext.getConf().get("spark.driver.extraJavaOptions"),
                  "unsafe": spark._jvm.System.getProperty("arrow.enable_unsafe_memory_access"),
                  "rows": spark.read.format("nbcc").load(sys.argv[1]).count()}))
"""
    props = _conf_file_properties()
    assert "spark.sql.execution.arrow.maxRecordsPerBatch" in props and "spark.driver.extraJavaOptions" in props
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "t"), json.dumps(props)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["conf"] == {k: v for k, v in props.items() if not k.endswith("extraJavaOptions")}
    # Spark puts its own module options before them.
    assert got["java_options"].endswith(props["spark.driver.extraJavaOptions"]) and got["unsafe"] == "true"
    assert got["rows"] == 5


def test_the_properties_file_ships_in_the_wheel(tmp_path):
    # spark_conf/ is not a package: the wheel carries the file in pyspark_nbcc (a link there).
    import shutil
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("connector", "spark_conf"):
        shutil.copytree(ROOT / folder, src / folder, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
                           str(src)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read("pyspark_nbcc/nbcc-defaults.conf") == (ROOT / "spark_conf/nbcc-defaults.conf").read_bytes()
