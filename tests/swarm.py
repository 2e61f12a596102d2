"""Start a broker and node processes from a topology dict, as separate OS processes (for tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from ravq.cli.demo import free_ports
from ravq.config import parse_topology, portable_task_spec
from ravq.net.listen import Listeners, ports_of

ROOT = Path(__file__).resolve().parent.parent


def local_topology(task: str, clusters: list[int], training: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """``clusters[c]`` stages in cluster c, every node on 127.0.0.1 with free ports.  Uncompressed unless
    ``training`` says otherwise: tests compare weights and bytes with the exact float32 path."""
    training = {"compress": {"pipeline": "none", "ring": "none"}, **training}
    n = sum(clusters)
    ports = iter(free_ports(2 * n + 2))
    nodes = [{"name": f"c{c}s{s}", "pipeline_port": next(ports), "ring_port": next(ports), "cluster": c,
              "stage": s} for c, size in enumerate(clusters) for s in range(size)]
    return {"task": portable_task_spec(task), "training": training, "broker": {"pub_port": next(ports), "router_port": next(ports)},
            "nodes": nodes, **extra}


class Swarm:
    def __init__(self, tmp: Path, topology: dict[str, Any], env: dict[str, dict[str, str]] | None = None,
                 plan: dict[str, Any] | None = None, broker_args: list[str] | None = None,
                 faults: dict[str, str] | None = None) -> None:
        self.tmp, self.topology = tmp, topology
        self.path = tmp / "topology.yaml"
        self.path.write_text(yaml.safe_dump(topology))
        self.broker_argv = ["broker", "--topology", str(self.path), *(broker_args or [])]
        if plan is not None:
            (tmp / "plan.yaml").write_text(yaml.safe_dump(plan))
            self.broker_argv += ["--plan", str(tmp / "plan.yaml")]
        self.env = env or {}
        self.faults = dict(faults or {})
        """Node -> the fault its process starts with (``tests.faulty_node``), until taken out of here."""
        self.base = {**os.environ, "PYTHONPATH": str(ROOT)}
        self._listeners = Listeners()
        """Every port of the topology, bound here before the first process starts: each process inherits
        its own listening sockets (``ravq.net.listen``), so no other process can take one in the minute a
        node needs to start."""
        self._served = parse_topology(topology, resolve_task=False)
        try:
            backup = ["broker-backup"] if self._served.broker.backup is not None else []
            for name in ["broker", *backup, *(node["name"] for node in topology["nodes"])]:
                self._listeners.hold(ports_of(self._served, name))
            self.broker = self._spawn(self.broker_argv, "broker", self.base)
            self.backup = self._spawn([*self.broker_argv, "--backup"], "broker-backup", self.base) \
                if backup else None
            """The backup broker's process (``broker.backup`` in the topology)."""
            self.nodes: dict[str, subprocess.Popen[bytes]] = {}
            for node in topology["nodes"]:
                self.start(node["name"])
        finally:
            self._listeners.close()

    def start(self, name: str) -> None:
        """Start (or restart, as systemd would) one node; its log is appended to."""
        fault = self.faults.get(name)
        self.nodes[name] = self._spawn(["node", "--topology", str(self.path), "--name", name, "--threads", "1",
                                        "--summary", str(self.tmp / f"summary-{name}.json")], name,
                                       {**self.base, **self.env.get(name, {})},
                                       ["tests.faulty_node", fault] if fault else ["ravq"])

    def restart_broker(self) -> None:
        self.broker = self._spawn(self.broker_argv, "broker", self.base)

    def restart_backup(self) -> None:
        self.backup = self._spawn([*self.broker_argv, "--backup"], "broker-backup", self.base)

    def status(self) -> dict[str, Any] | None:
        from ravq.cli.status import status_once
        from ravq.config import load_topology
        return status_once(load_topology(self.path), None, timeout_s=1.0)

    def _spawn(self, argv: list[str], name: str, env: dict[str, str],
               module: list[str] | None = None) -> subprocess.Popen[bytes]:
        """Start one process with its listening sockets: held since the swarm started, or bound now (a
        restart: its ports were freed when the process it replaces died).  ``module``: what ``python -m``
        runs, with its own arguments before ``argv`` (``ravq``; a faulty node's ``tests.faulty_node``)."""
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 (the child holds it)
        return self._listeners.spawn([sys.executable, "-m", *(module or ["ravq"]), *argv],
                                     ports_of(self._served, name), env,
                                     cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait(self, names: list[str] | None = None, timeout_s: float = 240) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        codes = {}
        for name in names or list(self.nodes):
            try:
                codes[name] = self.nodes[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} did not finish:\n{self.log(name)}") from None
        return codes

    def summary(self, name: str) -> dict[str, Any]:
        return json.loads((self.tmp / f"summary-{name}.json").read_text())

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-3000:]

    def close(self) -> None:
        for proc in [*self.nodes.values(), self.broker, *([self.backup] if self.backup else [])]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def train(tmp: Path, topology: dict[str, Any], timeout_s: float = 280) -> Swarm:
    """Run a swarm to its end; every process must exit 0 (the failing nodes' logs are the message).  The
    finished swarm's summaries and logs stay readable.  Nobody is declared lost before 30 s of silence
    (unless the topology says otherwise): these runs check results, not churn, and a loaded machine can
    starve a node's heartbeats for longer than the default 6 s."""
    topology = {**topology, "timeouts": {"lost_s": 30.0, **topology.get("timeouts", {})}}
    swarm = Swarm(tmp, topology)
    try:
        codes = swarm.wait(timeout_s=timeout_s)
        assert all(c == 0 for c in codes.values()), {n: swarm.log(n) for n, c in codes.items() if c}
    finally:
        swarm.close()
    return swarm


def export(ckpt: Path, cluster: int, out: Path) -> dict[str, torch.Tensor]:
    """What ``ravq export --cluster N`` writes from these checkpoints (in this process: no interpreter start)."""
    from safetensors.torch import load_file

    from ravq.persist.export import export_cluster

    export_cluster(ckpt, out, cluster)
    return load_file(str(out))


def assert_clusters_equal(ckpt: Path, clusters: int, want: dict[str, torch.Tensor], out_dir: Path,
                          atol: float = 1e-5, same_names: bool = True) -> None:
    """Each cluster's exported model equals ``want`` (the one-process reference) within ``atol``."""
    for cluster in range(clusters):
        got = export(ckpt, cluster, out_dir / f"c{cluster}.safetensors")
        if same_names:
            assert set(got) == set(want), set(got) ^ set(want)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=atol, msg=f"cluster {cluster} {name}")


def tied_copies_identical(ckpt: Path, cluster: int, stages: tuple[int, ...] = (0, 1)) -> None:
    """Each of ``stages``' checkpoints holds its copy under the names it reads; all copies of a tie are one
    value, bit for bit."""
    from ravq.persist import checkpoint

    loaded = [checkpoint.load_stage(ckpt, cluster, s) for s in stages]
    for s, ck in zip(stages, loaded, strict=True):
        assert ck.meta["tied"], f"cluster {cluster} stage {s} holds no tied copy"
    first = loaded[0].model[loaded[0].meta["tied"][0]["names"][0]]
    for s, ck in zip(stages, loaded, strict=True):
        for group in ck.meta["tied"]:
            for name in group["names"]:
                assert torch.equal(ck.model[name], first), f"cluster {cluster} stage {s} {name}"
