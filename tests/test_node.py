"""Multi-process tests: a broker and real node processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import models_for_tests as skipnet
from tests.pipeline_harness import train_one_process

pytestmark = pytest.mark.multiprocess
ROOT = Path(__file__).resolve().parent.parent


def ravq(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ravq", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)


def run_demo(tmp_path: Path, *args: str, timeout: float = 240) -> dict:
    report = tmp_path / "report.json"
    proc = ravq("demo", "--quiet", "--run-dir", str(tmp_path / "run"), "--report", str(report), *args,
                timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(report.read_text())


def test_three_processes_sync_equal_one_process(tmp_path: Path) -> None:
    """The correctness anchor across real processes and sockets: max_inflight 1 == unsplit training."""
    ckpt = tmp_path / "ckpt"
    report = run_demo(tmp_path, "--task", "tests.models_for_tests", "--clusters", "1", "--stages", "3",
                      "--steps", "20", "--max-inflight", "1", "--micro-batch", "4", "--checkpoint-dir", str(ckpt))
    assert report["steps"] == 20
    out = tmp_path / "model.safetensors"
    proc = ravq("export", "--checkpoint-dir", str(ckpt), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    got = load_file(str(out))
    want = train_one_process(skipnet, steps=20, micro_batch=4)
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)
    model = skipnet.build_model()
    model.load_state_dict(got)  # the export is loadable into the unsplit model


def test_demo_learns_and_reports(tmp_path: Path) -> None:
    report = run_demo(tmp_path, "--clusters", "1", "--stages", "3", "--steps", "120")
    for key in ("samples_per_second", "initial_loss", "final_loss", "steps", "nodes"):
        assert key in report
    assert report["steps"] == 120
    assert report["final_loss"] < report["initial_loss"] - 0.5, report
    assert len(report["nodes"]) == 3
    for node in report["nodes"]:
        assert {"name", "cluster", "stage", "busy_fraction", "staleness_mean", "bytes_sent",
                "bytes_received"} <= set(node)
        assert 0 < node["busy_fraction"] <= 1
        assert node["bytes_sent"] > 0 and node["bytes_received"] > 0
    assert report["nodes"][0]["staleness_mean"] > 0  # asynchronous: stage 0 runs ahead
    curve = report["eval_loss"]  # six evaluations on held-out data by default (docs/training.md)
    assert [step for step, _ in curve] == [20, 40, 60, 80, 100, 120]
    assert curve[-1][1] < curve[0][1] - 0.1, curve  # validation loss falls


def _write_topology(tmp_path: Path, steps: int, ckpt: Path, drain_s: float = 10.0) -> Path:
    from ravq.cli.demo import free_ports
    p = iter(free_ports(9))
    nodes = [{"name": f"n{s}", "pipeline_port": next(p), "ring_port": next(p), "cluster": 0, "stage": s}
             for s in range(2)]
    topo = {"task": "ravq.tasks.charlm", "training": {"steps": steps, "micro_batch": 8,
                                                      "checkpoint_dir": str(ckpt)},
            "timeouts": {"drain_s": drain_s},
            "broker": {"pub_port": next(p), "router_port": next(p)}, "nodes": nodes}
    import yaml
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(topo))
    return path


def test_sigterm_drains_and_writes_final_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    topo = _write_topology(tmp_path, steps=100000, ckpt=ckpt)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    from ravq.config import load_topology
    from ravq.net.listen import Listeners, ports_of
    served = load_topology(topo, resolve_task=False)
    with Listeners() as listeners:  # each process inherits its ports' listening sockets: none can be taken
        broker = listeners.spawn([sys.executable, "-m", "ravq", "broker", "--topology", str(topo)],
                                 ports_of(served, "broker"), env)
        nodes = [listeners.spawn([sys.executable, "-m", "ravq", "node", "--topology", str(topo), "--name", f"n{s}",
                                  "--threads", "1"], ports_of(served, f"n{s}"), env, stderr=subprocess.PIPE, text=True)
                 for s in range(2)]
    try:
        deadline = time.monotonic() + 120
        from ravq.cli.status import status_once
        from ravq.config import load_topology
        topology = load_topology(topo)
        while time.monotonic() < deadline:
            status = status_once(topology, None)
            versions = [m.get("stats", {}).get("version", 0) for m in (status or {}).get("members", {}).values()]
            if len(versions) == 2 and min(versions) >= 5:
                break
            time.sleep(0.5)
        else:
            pytest.fail("training never started")
        for n in nodes:
            n.send_signal(signal.SIGTERM)
        drained_by = time.monotonic() + 25  # a deadline for the drain, not a measurement of it
        codes = [n.wait(timeout=max(0.1, drained_by - time.monotonic())) for n in nodes]
        assert codes == [0, 0], [n.stderr.read() for n in nodes]
    finally:
        for proc in [*nodes, broker]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    for s in range(2):
        meta = json.loads((ckpt / "cluster0" / f"stage{s}.json").read_text())
        assert meta["version"] >= 5
    assert json.loads((ckpt / "cluster0" / "stage0.json").read_text())["data_position"] >= 5


def test_bad_topology_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: ravq.tasks.charlm\nbroker: {pub_port: 5000, router_port: 5001}\n"
                   "nodes:\n  - {name: a, pipeline_port: 70000, ring_port: 6001}\n")
    proc = ravq("node", "--topology", str(bad), "--name", "a")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nodes[0].pipeline_port" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_export_of_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    proc = ravq("export", "--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "m.safetensors"))
    assert proc.returncode == 2 and "no stage checkpoints" in proc.stderr


def test_resume_continues_exactly(tmp_path: Path) -> None:
    """Train 12 steps, stop everything, start again (the same run: the broker's state directory) to 25:
    every stage resumes by default, and the weights equal 25 steps in one go."""
    from tests.swarm import Swarm, local_topology
    ckpt = tmp_path / "ckpt"
    training = {"steps": 12, "micro_batch": 4, "max_inflight": 1, "checkpoint_dir": str(ckpt)}
    topo = local_topology("tests.models_for_tests", [3], training)
    topo["broker"]["state_dir"] = str(tmp_path / "broker")  # the run survives the broker's restart
    for steps, sub in ((12, "a"), (25, "b")):
        (tmp_path / sub).mkdir()
        topo["training"] = {**topo["training"], "steps": steps}
        swarm = Swarm(tmp_path / sub, topo)
        try:
            codes = swarm.wait()
            assert all(c == 0 for c in codes.values()), {n: swarm.log(n) for n in codes}
        finally:
            swarm.close()
    assert json.loads((ckpt / "cluster0" / "stage0.json").read_text())["data_position"] == 25
    out = tmp_path / "m.safetensors"
    assert ravq("export", "--checkpoint-dir", str(ckpt), "--out", str(out)).returncode == 0
    got = load_file(str(out))
    want = train_one_process(skipnet, steps=25, micro_batch=4)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)


def test_plan_then_demo_runs_the_plan(tmp_path: Path) -> None:
    """`ravq plan` (numbers typed into the topology stand in for profiles) then `ravq demo --plan`."""
    import yaml

    from tests.swarm import local_topology
    topo = local_topology("tests.models_for_tests", [1, 1, 1], {"steps": 30, "micro_batch": 4})
    for i, node in enumerate(topo["nodes"]):
        del node["cluster"], node["stage"]
        node.update({"memory_bytes": 8 << 30, "flops": 1e9 * (1 + i), "bandwidth_bytes_per_s": 1e8})
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(topo))
    plan = tmp_path / "plan.yaml"
    (tmp_path / "profiles").mkdir()
    proc = ravq("plan", "--topology", str(path), "--profiles", str(tmp_path / "profiles"), "--out", str(plan))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "samples/s" in proc.stdout  # the explanation table with the prediction
    report = run_demo(tmp_path, "--topology", str(path), "--plan", str(plan))
    from ravq.config import load_plan
    planned = {n for c in load_plan(plan).clusters for n in c.nodes}
    assert {n["name"] for n in report["nodes"]} == planned
    assert report["steps"] == 30 * report["clusters"]


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_demo_children_die_with_a_killed_demo(tmp_path: Path) -> None:
    """SIGKILL gives the demo no chance to clean up; its broker and nodes must still go."""
    demo = subprocess.Popen([sys.executable, "-m", "ravq", "demo", "--quiet", "--run-dir", str(tmp_path / "run"),
                             "--clusters", "1", "--stages", "2", "--steps", "100000"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(kids := _children(demo.pid)) < 3:  # broker + 2 nodes
            assert demo.poll() is None, "demo exited early"
            assert time.monotonic() < deadline, f"demo started only {kids}"
            time.sleep(0.2)
    finally:
        demo.kill()
        demo.wait()
    deadline = time.monotonic() + 10
    while any(_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [k for k in kids if _alive(k)]
    for k in survivors:
        os.kill(k, signal.SIGKILL)
    assert not survivors, f"children {survivors} outlived the killed demo"
