"""`ravq demo`: a broker and a local swarm of node processes training a built-in task.

Binds free local ports and listens on them, writes a topology into a run directory, starts one process
per node (each dies with the demo: PR_SET_PDEATHSIG) that inherits its ports' listening sockets
(``ravq.net.listen``: no other process can take a port in between), shows live progress from the
broker's status, and prints a summary.  ``--report FILE`` writes the summary as JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ravq.config import (
    EXTRAPOLATE_GRADIENTS,
    INFLIGHT_WARMUP_STEPS,
    PREDICT_WEIGHTS,
    ConfigError,
    parse_topology,
    portable_task_spec,
)
from ravq.net.listen import Listeners, ports_of

DEFAULT_TASK = "ravq.tasks.charlm"
SYNC_EVERY = 2
"""The demo's averaging period.  On loopback a round is cheap, and on the demo task (2x2, max_inflight 2,
predict_weights 2, averaging_lead 1) every 2 steps needed fewer samples than every 3 or 5 to reach the
one-process loss (seeds 0-2), and every step only a few fewer again at ~9% fewer samples/s:
benchmarks/bench_convergence.py.  (Before averaging_lead bounded how far a cluster runs ahead, every 5
beat 2 and 10.)  Deployments keep training.sync_every's default, which also weighs ring bandwidth."""


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clusters", type=int, default=2, help="clusters (data-parallel copies)")
    p.add_argument("--stages", type=int, default=2, help="stages (nodes) per cluster")
    p.add_argument("--steps", type=int, default=300, help="micro-batches each cluster trains on")
    p.add_argument("--task", default=DEFAULT_TASK,
                   help="the task: a module (mytask finds mytask.py in the current folder), "
                        "module:attribute, or a file path/to/mytask.py[:attribute]")
    p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a task option (the topology's task_options; a YAML value), e.g. data=path/to/data")
    p.add_argument("--max-inflight", type=int, default=None,
                   help="micro-batches in flight per cluster; default: one per stage, at most the "
                        "micro-batches an update sums, and 2 with an update per micro-batch")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument(
        "--sync-every", type=int, default=SYNC_EVERY, help="optimizer steps between averaging rounds"
    )
    p.add_argument("--batch", type=int, default=None,
                   help="samples per optimizer step over all clusters (training.batch; default: one "
                        "micro-batch per cluster, times --update-every)")
    p.add_argument("--update-every", type=int, default=1,
                   help="micro-batches per optimizer step (without --batch)")
    p.add_argument("--outer-lr", type=float, default=1.0, help="step size of each average (1: plain average)")
    p.add_argument("--predict-weights", type=float, default=PREDICT_WEIGHTS,
                   help="weight prediction horizon, in multiples of a stage's staleness (0: off)")
    p.add_argument("--extrapolate-gradients", type=float, default=EXTRAPOLATE_GRADIENTS,
                   help="delay compensation of stale updates, in multiples of their staleness (0: off)")
    p.add_argument("--stale-correction", choices=["auto", "none", "pipenag"], default="auto",
                   help="pipenag: stale updates take Nesterov's look-ahead step (ravq.stage.pipenag); auto "
                        "(default): pipenag with an update per micro-batch")
    p.add_argument("--schedule", choices=["async", "sync", "zero_bubble"], default="async",
                   help="sync: 1F1B with a flush at every update (exactly synchronous; training.schedule); "
                        "zero_bubble: and each backward split, its weight pass deferred")
    p.add_argument(
        "--inflight-warmup-steps",
        type=int,
        default=INFLIGHT_WARMUP_STEPS,
        help="optimizer steps trained with one micro-batch in flight before the pipeline opens (0: none)",
    )
    p.add_argument(
        "--average-optimizer-state", action="store_true", help="average optimizer state (Adam moments) too"
    )
    p.add_argument(
        "--compress-pipeline",
        choices=["none", "bf16", "fp16", "int8"],
        default="none",
        help="activations and gradients on pipeline links (default none: on loopback bytes are free "
        "and compressing only costs CPU; a topology's default is int8)",
    )
    p.add_argument("--compress-ring", choices=["none", "bf16", "int8"], default="none",
                   help="all-reduce pieces on ring links, with error feedback (default none, as above)")
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="optimizer steps between evaluations on held-out data (default: 6 rounds per run when "
        "the task has eval_batches; 0: none)",
    )
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="autocast precision")
    p.add_argument("--clip-grad-norm", type=float, default=None, help="clip each step to this global norm")
    p.add_argument("--lr-schedule", choices=["constant", "warmup", "cosine", "linear"], default="constant")
    p.add_argument("--warmup-steps", type=int, default=0, help="optimizer steps of LR warmup")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None, help="write a JSON report here")
    p.add_argument(
        "--run-dir", default=None, help="where logs, topology and summaries go (default: a temp dir)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per node process")
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="give up when no node makes progress for this many seconds (0: never); a long run that "
        "keeps training is never stopped",
    )
    p.add_argument("--no-curve", action="store_true", help="plaintext sockets (default: fresh CURVE keys)")
    p.add_argument("--quiet", action="store_true", help="no live display")
    p.add_argument("--topology", default=None,
                   help="run this local topology (127.0.0.1 hosts) instead of making one; training options "
                        "then come from the file")
    p.add_argument(
        "--plan", default=None, help="with --topology: a plan from `ravq plan` (only its nodes start)"
    )


def free_ports(count: int) -> list[int]:
    """Distinct free TCP ports on 127.0.0.1 (held open together so none repeats), closed again: another
    process may take one before it is bound (a process launcher binds first: ``ravq.net.listen``)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _eval_every(args: argparse.Namespace) -> int:
    """--eval-every, or six rounds over the run when the task has held-out data."""
    if args.eval_every is not None:
        return int(args.eval_every)
    from ravq.config import resolve_task_module

    has_eval = callable(getattr(resolve_task_module(args.task, task_options(args)), "eval_batches", None))
    return max(1, args.steps // _update_every(args) // 6) if has_eval else 0


def _batch(args: argparse.Namespace) -> int:
    """--batch, or what --update-every says: the demo's topology always states its batch."""
    if args.batch is not None and args.update_every != 1:
        raise ConfigError("--batch and --update-every: set one (ravq derives update_every from the batch)")
    return args.batch if args.batch is not None else args.micro_batch * args.clusters * args.update_every


def _update_every(args: argparse.Namespace) -> int:
    return max(1, _batch(args) // (args.micro_batch * args.clusters))


def task_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--task-option KEY=VALUE`` as the topology's task_options (each value read as a YAML scalar)."""
    import yaml

    options = {}
    for item in args.task_option:
        key, eq, value = item.partition("=")
        if not key or not eq:
            raise ConfigError(f"--task-option: {item!r} is not KEY=VALUE")
        options[key] = yaml.safe_load(value)
    return options


def demo_topology(args: argparse.Namespace, listeners: Listeners) -> dict[str, Any]:
    """The demo's topology, on ports ``listeners`` binds and listens on from now on."""
    if args.clusters < 1 or args.stages < 1:
        raise ConfigError("--clusters and --stages must be at least 1")
    n = args.clusters * args.stages
    ports = iter(listeners.ports(3 + 3 * n))
    nodes = []
    for c in range(args.clusters):
        for s in range(args.stages):
            nodes.append({"name": f"c{c}s{s}", "host": "127.0.0.1", "pipeline_port": next(ports),
                          "ring_port": next(ports), "metrics_port": next(ports), "cluster": c, "stage": s})
    training: dict[str, Any] = {
        "micro_batch": args.micro_batch, "steps": args.steps, "max_inflight": args.max_inflight,
        "batch": _batch(args), "sync_every": args.sync_every, "outer_lr": args.outer_lr,
        "predict_weights": args.predict_weights, "extrapolate_gradients": args.extrapolate_gradients,
        "inflight_warmup_steps": args.inflight_warmup_steps, "stale_correction": args.stale_correction,
        "schedule": args.schedule, "average_optimizer_state": args.average_optimizer_state,
        "checkpoint_every": args.checkpoint_every, "checkpoint_dir": args.checkpoint_dir,
    }
    training["compress"] = {"pipeline": args.compress_pipeline, "ring": args.compress_ring}
    training.update(
        precision=args.precision,
        clip_grad_norm=args.clip_grad_norm,
        eval_every=_eval_every(args),
        lr_schedule={"kind": args.lr_schedule, "warmup_steps": args.warmup_steps},
    )
    # the nodes find the task this process found, from any folder: a file as its absolute path
    return {"task": portable_task_spec(args.task), "task_options": task_options(args), "seed": args.seed,
            "training": training,
            "timeouts": {"connect_s": 120.0, "ring_step_s": 30.0, "drain_s": 15.0},
            "broker": {"host": "127.0.0.1", "pub_port": next(ports), "router_port": next(ports),
                       "metrics_port": next(ports)},
            "nodes": nodes}


def _parent_death_signal() -> Callable[[], None] | None:
    """A function for the child, between fork and exec: get SIGTERM when the demo dies, however it dies.

    libc is loaded here, in the parent, so the child only makes one system call (no dlopen, no locks).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


_DIE_WITH_PARENT = _parent_death_signal()


class Swarm:
    """The demo's child processes; stop() ends them all, politely first.  Each starts with its ports'
    listening sockets (bound by ``listeners`` already, or now: a port another process holds is an error
    here, before any child starts)."""

    def __init__(self, run_dir: Path, topo_path: Path, topology: dict[str, Any], threads: int,
                 key_dir: Path | None, plan_path: str | None = None,
                 listeners: Listeners | None = None) -> None:
        self.run_dir, self.topo_path, self.topology = run_dir, topo_path, topology
        self._listeners = listeners or Listeners()
        self._served = parse_topology(topology, resolve_task=False)
        keys = ["--key-dir", str(key_dir)] if key_dir else []
        plan = ["--plan", plan_path] if plan_path else []
        for node in topology["nodes"]:  # all ports before the first child: a taken one fails the demo at once
            self._listeners.hold(ports_of(self._served, node["name"]))
        # every demo is a new run: checkpoints an earlier demo left in --checkpoint-dir are set aside,
        # not loaded
        self.broker = self._start(
            "broker", ["broker", "--topology", str(topo_path), "--new-run", *plan, *keys]
        )
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}
        for node in topology["nodes"]:
            name = node["name"]
            summary = str(run_dir / f"summary-{name}.json")
            self.nodes[name] = self._start(name, ["node", "--topology", str(topo_path), "--name", name,
                                                  "--threads", str(threads), "--summary", summary, *keys])

    def _start(self, process: str, argv: list[str]) -> subprocess.Popen[bytes]:
        """Start ``process``, which inherits its ports' listening sockets."""
        with open(self.run_dir / f"{process}.log", "wb") as log:  # the child keeps its own copy of it
            ports = ports_of(self._served, process)
            return self._listeners.spawn([sys.executable, "-m", "ravq", *argv], ports, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=_DIE_WITH_PARENT)  # one prctl call, see above

    def running(self) -> list[str]:
        return [n for n, p in self.nodes.items() if p.poll() is None]

    def failed(self) -> list[str]:
        """Nodes that exited with an error, and "broker" once the broker has exited at all: it serves until
        stop(), so an exit is an error (e.g. a plan the model cannot take), and nodes would wait for it."""
        failed = [n for n, p in self.nodes.items() if p.poll() not in (None, 0)]
        return failed + ["broker"] if self.broker.poll() is not None else failed

    def error_line(self, name: str) -> str:
        """The last line a process printed: its error, when it failed."""
        lines = [line for line in self.log_tail(name, 40).splitlines() if line.strip()]
        return lines[-1] if lines else "(no output)"

    def stop(self, grace_s: float = 20.0) -> None:
        procs = [*self.nodes.values(), self.broker]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def log_tail(self, name: str, lines: int = 15) -> str:
        text = (self.run_dir / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


def run_demo(args: argparse.Namespace) -> int:
    from ravq.cli.demo_view import LiveView, summarize

    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="ravq-demo-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    listeners = Listeners()  # the ports a made topology names, held from the moment they are chosen
    if args.topology:
        if args.compress_pipeline != "none" or args.compress_ring != "none":
            raise ConfigError(
                "--compress-pipeline/--compress-ring: with --topology, set training.compress in the file"
            )
        data, topo_path, key_dir = _user_topology(args)
        shape = f"topology {args.topology}" + (f", plan {args.plan}" if args.plan else "")
    else:
        if args.plan:
            raise ConfigError("--plan: needs --topology (a plan names the topology's nodes)")
        data = demo_topology(args, listeners)
        key_dir = None if args.no_curve else _make_keys(data, run_dir)
        parse_topology(data, "demo topology")  # same validation a user's file gets
        topo_path = run_dir / "topology.yaml"
        topo_path.write_text(yaml.safe_dump(data, sort_keys=False))
        shape = f"{args.clusters} cluster(s) x {args.stages} stage(s), task {args.task}"
    topology = parse_topology(data)
    from ravq.preflight import check_at_start

    check_at_start(topology)  # before any process starts: each would fail on it (ravq check runs the rest)
    view = LiveView(topology, quiet=args.quiet, key_dir=key_dir)
    print(
        f"ravq demo: {shape}, {topology.training.steps} micro-batches per cluster; logs in {run_dir}",
        flush=True,
    )
    t0 = time.monotonic()
    try:
        swarm = Swarm(run_dir, topo_path, data, args.threads, key_dir, args.plan, listeners)
    finally:
        listeners.close()  # each child has its own by now
    ok, failed = False, []
    try:
        ok = view.follow(swarm, args.timeout)
    except KeyboardInterrupt:
        print("\ninterrupted: draining nodes...", file=sys.stderr)
    finally:
        failed = swarm.failed()  # before stop(): stopping ends the broker too
        swarm.stop()
        view.close()
    wall = time.monotonic() - t0
    if not ok:
        for name in failed or list(swarm.nodes):
            print(f"--- {name} log (last lines) ---\n{swarm.log_tail(name)}", file=sys.stderr)
        for name in failed:
            print(f"ravq demo: {name} failed: {swarm.error_line(name)}", file=sys.stderr)
    report = summarize(run_dir, data, wall)  # also after a failure: what was trained until then
    if report is not None:
        report["completed"] = ok
        view.print_summary(report)
        if args.report:
            Path(args.report).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


def _user_topology(args: argparse.Namespace) -> tuple[dict[str, Any], Path, Path | None]:
    """A user's local topology (and plan): only the planned nodes are started."""
    from ravq.config import load_plan, load_topology

    topology = load_topology(args.topology)
    for node in topology.nodes:
        if not (node.host.startswith("127.") or node.host == "localhost"):
            raise ConfigError(f"{args.topology}: node {node.name} is on {node.host}; the demo runs local "
                              "topologies only (use `ravq node` on each PC)")
    data = yaml.safe_load(Path(args.topology).read_text())
    if args.plan:
        planned = {n for c in load_plan(args.plan).clusters for n in c.nodes}
        data["nodes"] = [n for n in data["nodes"] if n["name"] in planned]
    key_dir = (
        Path(topology.security.key_dir) if topology.security.curve and topology.security.key_dir else None
    )
    return data, Path(args.topology), key_dir


def _make_keys(data: dict[str, Any], run_dir: Path) -> Path:
    from ravq.net.security import keygen

    key_dir = run_dir / "keys"
    shutil.rmtree(key_dir, ignore_errors=True)  # demo keys are throwaway: fresh ones every run
    key_dir.mkdir(mode=0o700)
    data["broker"]["public_key"] = keygen("broker", key_dir)
    for node in data["nodes"]:
        node["public_key"] = keygen(node["name"], key_dir)
    data["security"] = {"curve": True, "key_dir": str(key_dir)}
    return key_dir
