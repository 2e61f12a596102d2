"""A node stopped while it starts (importing torch, waiting for the broker, building its stage) exits
through its own handler: status 0, one line saying so, no traceback, and without waiting for the
stage's build (issue #27).  Real ``ravq node`` processes, stopped as systemd does (SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ravq.cli.demo import free_ports

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]


def _topology(tmp: Path, task: str) -> Path:
    ports = free_ports(4)
    path = tmp / "topology.yaml"
    path.write_text(yaml.safe_dump({
        "task": task, "broker": {"pub_port": ports[0], "router_port": ports[1]},
        "timeouts": {"connect_s": 300, "request_s": 1.0},
        "nodes": [{"name": "n0", "pipeline_port": ports[2], "ring_port": ports[3], "cluster": 0}]}))
    return path


def _node(tmp: Path, topology: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp / "n0.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ravq", "node", "--topology", str(topology), "--name", "n0"],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    return proc, log


def _until(what: str, check, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert proc.poll() is None, f"exited before {what}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"never {what}:\n{log.read_text()}"
        time.sleep(0.02)


def _stopped_cleanly(proc: subprocess.Popen[bytes], log: Path) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"still running a minute after SIGTERM:\n{log.read_text()}")
    text = log.read_text()
    assert code == 0, text
    assert "Traceback" not in text, text
    assert "SIGTERM while starting" in text, text
    return text


def _maps(proc: subprocess.Popen[bytes]) -> str:
    try:
        return Path(f"/proc/{proc.pid}/maps").read_text()
    except OSError:
        return ""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see torch being loaded")
def test_a_node_stopped_while_importing_torch_exits_0_with_a_line(tmp_path: Path) -> None:
    proc, log = _node(tmp_path, _topology(tmp_path, "tests.tasks_for_tests"))
    try:
        _until("loading torch", lambda: "libtorch" in _maps(proc), proc, log)
        text = _stopped_cleanly(proc, log)
        assert "(importing)" in text or "torch uses" in text, text  # stopped in the import, or just after it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_node_stopped_while_waiting_for_the_broker_exits_0_with_a_line(tmp_path: Path) -> None:
    proc, log = _node(tmp_path, _topology(tmp_path, "tests.tasks_for_tests"))  # no broker at all
    try:
        _until("asking the broker", lambda: "broker not answering yet" in log.read_text(), proc, log)
        text = _stopped_cleanly(proc, log)
        assert "stopping before training" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_node_stopped_while_building_its_stage_does_not_wait_for_the_build(tmp_path: Path) -> None:
    """The task's build_model blocks for ten minutes: exiting at all proves the build is not waited for."""
    topology = _topology(tmp_path, "tests.slow_build_task")
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump({"plan": {"clusters": [{"nodes": ["n0"], "cuts": []}]}}))
    with open(tmp_path / "broker.log", "wb") as out:
        broker = subprocess.Popen([sys.executable, "-m", "ravq", "broker", "--topology", str(topology), "--plan",
                                   str(tmp_path / "plan.yaml")], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
    marker = tmp_path / "building"
    proc, log = _node(tmp_path, topology, {"RAVQ_TEST_BUILD_MARKER": str(marker)})
    try:
        _until("building the stage", marker.exists, proc, log)
        _stopped_cleanly(proc, log)
    finally:
        for p in (proc, broker):
            if p.poll() is None:
                p.kill()
                p.wait()
