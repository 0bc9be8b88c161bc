"""Child processes of one test: real processes for crash and concurrency tests.

Each child runs a script with `python -c` and reports to the parent by writing JSON files
atomically; the parent waits for a file, kills a child at a chosen step, or waits for it to
finish. Any child still running when the test ends is killed (the `children` fixture in
conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

WAIT_S = 120  # a hang guard for anything a child must do: nothing asserts how long it takes


class Children:
    def __init__(self, work: Path):
        self.work = work
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, script: str, *args: str) -> subprocess.Popen:
        log = self.work / f"child-{len(self.procs)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args],
                                    stdout=out, stderr=subprocess.STDOUT)
        self.procs.append((proc, log))
        return proc

    def output(self, proc: subprocess.Popen) -> str:
        return next(log.read_text(errors="replace") for p, log in self.procs if p is proc)[-4000:]

    def wait_for(self, path: Path, proc: subprocess.Popen) -> Any:
        """Wait until the child wrote `path` (JSON, written atomically); its content."""
        deadline = time.monotonic() + WAIT_S
        while not path.exists():
            if proc.poll() is not None:
                raise AssertionError(f"child exited ({proc.returncode}) before writing {path.name}:\n"
                                     f"{self.output(proc)}")
            assert time.monotonic() < deadline, f"child never wrote {path.name}:\n{self.output(proc)}"
            time.sleep(0.01)
        return json.loads(path.read_text())

    def kill(self, proc: subprocess.Popen) -> None:
        assert proc.poll() is None, f"child exited on its own ({proc.returncode}):\n{self.output(proc)}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=WAIT_S)

    def finish(self, proc: subprocess.Popen) -> None:
        try:
            proc.wait(timeout=WAIT_S * 2)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"child did not finish:\n{self.output(proc)}") from None
        assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{self.output(proc)}"

    def close(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
