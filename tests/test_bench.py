"""The benchmark harness (bench/run.py, `make bench`) runs every scenario end to end at a small
size and writes its report, so it keeps working as the code changes. No timing is asserted:
timings belong to the benchmark. What is asserted is what the harness reports about outcomes
(every scenario measured, no failed commit or retry among concurrent writers) and what it checks
itself (scenario 10 refuses to time nbcc and deltalake reads that return different rows)."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_pushdown import pushdown

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench_module(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import run

    # The JVM's Arrow hand-over is warmed with 16M rows before timed writes; a smoke run needs none.
    monkeypatch.setattr(run, "ARROW_WARMUP_ROWS", 0)
    return run


def test_every_benchmark_scenario_runs_and_reports(spark, bench_module, tmp_path):
    run = bench_module
    args = run.parse_args(["--rows", "20000", "--repeats", "1", "--commits", "30", "--slice-rows", "50000",
                           "--scale-rows", "40000", "--writer-rounds", "1", "--out", str(tmp_path)])
    bench = run.Bench(args)
    bench._spark = spark
    run.floor.register(spark)
    try:
        with pushdown(spark, True):  # as the bench's own session (and spark_conf/) sets it
            bench.run(list(run.SCENARIOS))
    finally:
        shutil.rmtree(bench.work, ignore_errors=True)

    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(results["scenarios"], key=int) == list(run.SCENARIOS)
    for key, scenario in results["scenarios"].items():
        assert scenario["figures"], f"scenario {key} reported no figures"
    writers = results["scenarios"]["7"]["figures"]
    assert writers["nbcc_commits"] == 4 * 16 and writers["nbcc_failed"] == 0 and writers["nbcc_retries"] == 0
    report, analysis = (tmp_path / "results.md").read_text().split("## What limits each figure")  # analysis.md appended
    rows = [line for line in report.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert [line.split("|")[1].strip() for line in rows] == list(run.SCENARIOS)
    assert analysis.strip()


def test_the_s3_request_count_runs_and_finds_no_request_for_a_data_files_size():
    # bench/s3_requests.py, at a tiny size: its six measurements, and none of them asks S3 for
    # a file's size (format.md files[].bytes: data files are opened at their recorded size).
    out = subprocess.run([sys.executable, str(BENCH / "s3_requests.py"), "--commits", "2", "--buckets", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "snapshot read (2 commits x 2 file groups)", "point lookup", "compaction", "snapshot read after compaction",
        "upsert of 2,000 rows", "clean of the log files compaction replaced"]
    assert all("head_object" not in line for line in lines), lines
    assert all("'get_object'" in line for line in lines[:4]), lines
    clean = ast.literal_eval(lines[5][lines[5].index("{"):])
    assert clean["delete_objects"] == 1 and clean.get("delete_object", 0) <= 1, lines  # not one per file
