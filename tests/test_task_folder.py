"""A task copied into an empty folder runs with ``ravq demo --task mytask`` and with its path (issue #40): the
demo, run by the ``ravq`` command (whose sys.path holds no current folder), finds the file where the user
stands, and its node processes are handed the same file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RAVQ = Path(sys.executable).parent / "ravq"


@pytest.mark.multiprocess
@pytest.mark.skipif(not RAVQ.exists(), reason="the ravq command is not installed beside this interpreter")
@pytest.mark.parametrize(("spec", "stages"), [("mytask", 2), ("tasks/mytask.py", 1)])
def test_copied_task_runs_from_an_empty_folder(tmp_path: Path, spec: str, stages: int) -> None:
    folder = tmp_path / "work"
    (folder / "tasks").mkdir(parents=True)
    shutil.copy(ROOT / "ravq" / "tasks" / "charlm.py", folder / Path(spec).with_suffix(".py"))
    env = dict(os.environ)  # the user's folder is on no path: the demo must find it itself
    run = tmp_path / "run"
    proc = subprocess.run([str(RAVQ), "demo", "--task", spec, "--clusters", "1", "--stages", str(stages),
                           "--steps", "4", "--micro-batch", "4", "--eval-every", "0", "--quiet", "--no-curve",
                           "--run-dir", str(run), "--report", str(run / "report.json"), "--timeout", "200"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert json.loads((run / "report.json").read_text())["completed"]
    topology = (run / "topology.yaml").read_text()
    assert f"task: {folder / Path(spec).with_suffix('.py')}" in topology  # the nodes got the file's path
