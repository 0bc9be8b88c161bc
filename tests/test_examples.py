"""The README's runnable examples run (make demo runs examples/quickstart.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_time_travel_example_runs(tmp_path):
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    done = subprocess.run([sys.executable, str(ROOT / "examples/time_travel.py"), "--path", str(tmp_path / "t")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "point lookup id = 3 reads 1 of 4 file groups" in out
    assert "_change_type" in out and "delete" in out and "insert" in out
