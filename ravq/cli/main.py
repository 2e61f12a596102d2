"""The ``ravq`` command: parse, build, run, clean up.  User errors are one line and exit status 2."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from ravq.config import ClusterPlan, ConfigError, Plan, Topology, load_plan, load_topology

log = logging.getLogger("ravq")

EXIT_USAGE = 2


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def plan_for(topology: Topology, plan_path: str | None) -> Plan:
    """The plan to run: a planner's file when given, else the topology's clusters split evenly."""
    if plan_path:
        if not Path(plan_path).exists():
            raise ConfigError(
                f"--plan {plan_path}: file not found; make it with `ravq plan --topology TOPOLOGY "
                f"--profiles DIR --out {plan_path}` (deploy/README.md, step 4)"
            )
        plan = load_plan(plan_path)
        names = {n.name for n in topology.nodes}
        for cluster in plan.clusters:
            for node in cluster.nodes:
                if node not in names:
                    raise ConfigError(f"{plan_path}: plan names node {node!r} that the topology lacks")
        return plan
    training = [n for n in topology.nodes if not n.standby]  # standbys wait outside the plan
    if any(n.cluster is None for n in training):
        raise ConfigError("nodes: no node sets 'cluster'; set clusters in the topology or run "
                          "`ravq plan` and pass --plan")
    from ravq.config import resolve_task_module
    from ravq.cut.meta import build_meta_model
    from ravq.cut.split import candidate_cuts, even_cuts

    task = resolve_task_module(topology.task, topology.task_options)
    if callable(getattr(task, "split_points", None)):
        candidates = list(task.split_points())
    else:
        candidates = candidate_cuts(build_meta_model(task, topology.seed).model, task)
    clusters: dict[int, list[tuple[int, int, str]]] = {}
    for i, n in enumerate(topology.nodes):
        if n.standby:
            continue
        assert n.cluster is not None
        clusters.setdefault(n.cluster, []).append((n.stage if n.stage is not None else i, i, n.name))
    ordered = [[name for _, _, name in sorted(members)] for _, members in sorted(clusters.items())]
    for nodes in ordered:
        try:
            even_cuts(candidates, len(nodes))
        except ValueError as err:
            raise ConfigError(f"nodes: a cluster of {len(nodes)} nodes: {err}") from None
    return Plan(
        clusters=[ClusterPlan(nodes=nodes, cuts=even_cuts(candidates, len(nodes))) for nodes in ordered]
    )


def cmd_broker(args: argparse.Namespace) -> int:
    from brokers.pair import as_backup, run_broker
    from ravq.metrics import Metrics
    from ravq.net import listen
    from ravq.net.security import socket_options_for
    from ravq.net.socket_io import install_uvloop
    from ravq.tuning import tune_process

    topology = load_topology(args.topology)
    if args.backup:  # serve as broker.backup: its address, ports and state directory are "the broker"'s
        topology = as_backup(topology, dict(os.environ))
    if args.state_dir is not None:
        broker = topology.broker.model_copy(update={"state_dir": args.state_dir})
        topology = topology.model_copy(update={"broker": broker})
    plan = plan_for(topology, args.plan)
    metrics = Metrics("broker")
    metrics.set_role("broker")
    listen.name_ports(topology, "broker")
    if topology.broker.metrics_port is not None:
        listen.serve_metrics(
            metrics, topology.broker.metrics_port, topology.broker.bind_host or topology.broker.host
        )
    tune_process()
    install_uvloop()
    try:
        opts = socket_options_for(topology, "broker", args.key_dir, metrics)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    run_broker(topology, plan, metrics, opts, new_run=args.new_run, backup=args.backup)
    return 0


class _StoppedWhileStarting(BaseException):
    """SIGTERM/SIGINT while ``ravq node`` imports torch and its task (before its event loop runs); a
    BaseException, as KeyboardInterrupt, so no `except Exception` on the way swallows it."""


def _stop_while_importing(signum: int, frame: object) -> None:
    raise _StoppedWhileStarting(signal.Signals(signum).name)


def cmd_node(args: argparse.Namespace) -> int:
    # A stop before the node's own handler runs (importing torch takes seconds on a busy PC) ends the
    # process at once, with a line and status 0, as systemd expects of a stop; run_node then takes over.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_while_importing)
    try:
        return _run_node(args)
    except _StoppedWhileStarting as sig:
        log.info("%s: %s while starting (importing): stopping before training", args.name, sig)
        return 0


def _run_node(args: argparse.Namespace) -> int:
    from ravq.checks import check_device
    from ravq.net import listen
    from ravq.net.socket_io import install_uvloop
    from ravq.node import NodeOptions, run_node
    from ravq.preflight import check_at_start
    from ravq.tuning import tune_process

    topology = load_topology(args.topology)
    topology.node(args.name)
    listen.name_ports(topology, args.name)
    check_device(topology, args.name)
    check_at_start(topology)  # the task's interface and first batches (ravq check runs the rest)
    tune_process()  # before the node allocates its buffers and ZeroMQ its first frames
    install_uvloop()
    from ravq.node.membership import BrokerUnavailable

    options = NodeOptions(summary_path=args.summary, threads=args.threads, key_dir=args.key_dir)
    try:
        failure = asyncio.run(run_node(topology, args.name, options))
    except ValueError as err:  # keys that do not match the topology, a plan the model cannot take
        raise ConfigError(str(err)) from None
    except (BrokerUnavailable, TimeoutError) as err:
        print(f"ravq node {args.name}: {err}", file=sys.stderr)
        return 1
    if failure:
        print(f"ravq node {args.name}: {failure}", file=sys.stderr)
    _exit_now(1 if failure else 0)


def _exit_now(code: int) -> NoReturn:
    """End a node that has written its checkpoint and summary, sent its last heartbeat and closed every
    socket, without the interpreter's teardown: tearing torch and its thousands of objects down costs
    about a CPU-second, which on a busy PC is several seconds of a `systemctl stop` (issue #27)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_export(args: argparse.Namespace) -> int:
    from ravq.persist.export import export_cluster

    model = None
    if args.topology:
        from ravq.config import resolve_task_module
        from ravq.cut.meta import build_meta_model

        topology = load_topology(args.topology)
        task = resolve_task_module(topology.task, topology.task_options)
        model = build_meta_model(task, topology.seed).model
    try:
        info = export_cluster(args.checkpoint_dir, args.out, args.cluster, args.run_id, model=model)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(str(err)) from None
    kind = "a transformers directory (from_pretrained)" if info["format"] == "transformers" else \
        "a safetensors state_dict (load_state_dict(strict=True))"
    print(
        f"wrote {args.out}: {kind}; cluster {info['cluster']}, run {info['run_id']}, "
        f"{info['stages']} stages, {info['tensors']} tensors, stage versions {info['versions']}"
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from ravq.cli.status import fetch_status, format_status

    topology = load_topology(args.topology, resolve_task=False)  # no task import: no torch
    try:
        status = asyncio.run(fetch_status(topology, args.timeout, args.key_dir, args.name))
    except TimeoutError:
        print(
            f"ravq status: the broker at {topology.broker.host}:{topology.broker.router_port} did not answer "
            f"within {args.timeout:.0f}s",
            file=sys.stderr,
        )
        return 1
    except ValueError as err:  # a key file that is missing, unreadable or not the listed one
        raise ConfigError(f"{err} (with CURVE, ravq status uses a key pair on this PC: --key-dir DIR "
                          "--name NODE; run it as the user that owns the key, e.g. sudo -u ravq)") from None
    print(json.dumps(status, indent=1) if args.json else format_status(status))
    return 0


def cmd_relay(args: argparse.Namespace) -> int:
    from ravq.cli.relay import relay_main

    return relay_main(load_topology(args.topology, resolve_task=False), args.name, args.key_dir)


def cmd_keygen(args: argparse.Namespace) -> int:
    from ravq.net.security import keygen_main

    return keygen_main(args.name, args.key_dir, args.owner)


def cmd_demo(args: argparse.Namespace) -> int:
    from ravq.cli.demo import run_demo

    return run_demo(args)


def cmd_profile(args: argparse.Namespace) -> int:
    from ravq.checks import check_device
    from ravq.cli.profile import profile_main

    topology = load_topology(args.topology)
    topology.node(args.name)
    check_device(topology, args.name)

    return profile_main(args.topology, args.name, args.out, args.peers_wait)


def cmd_scrape_config(args: argparse.Namespace) -> int:
    from ravq.cli.scrape import scrape_config

    text = scrape_config(load_topology(args.topology, resolve_task=False), args.topology)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    if args.simulate:
        from ravq.cli.simulate import plan_simulate_main

        return plan_simulate_main(args.topology, args.profiles, args.out, candidates=args.candidates,
                                  steps=args.sim_steps, host_cores=args.host_cores)
    from ravq.cli.plan import plan_main

    return plan_main(args.topology, args.profiles, args.out)


def cmd_simulate(args: argparse.Namespace) -> int:
    from ravq.cli.simulate import simulate_main

    return simulate_main(args.topology, args.profiles, args.plan, steps=args.steps, churn_per_hour=args.churn,
                         json_path=args.json, host_cores=args.host_cores, jitter=args.jitter, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ravq", description="Train one model on many unequal PCs.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="a local swarm training a built-in task (no file needed)")
    from ravq.cli.demo import add_demo_arguments
    add_demo_arguments(d)
    d.set_defaults(func=cmd_demo)

    c = sub.add_parser("check", help="pre-flight a task: will it split, train, evaluate and fit, as planned?")
    from ravq.cli.check import add_check_arguments, check_main
    add_check_arguments(c)
    c.set_defaults(func=lambda args: check_main(args, plan_for))  # check.py cannot import main (a cycle)

    b = sub.add_parser("broker", help="run the topology broker")
    b.add_argument("--topology", required=True)
    b.add_argument("--plan", help="plan YAML from `ravq plan` (default: the topology's clusters, even split)")
    b.add_argument("--key-dir", help="directory with broker.key_secret (CURVE)")
    b.add_argument("--state-dir", help="where the run survives restarts (default: broker.state_dir, else "
                   "$STATE_DIRECTORY/broker, else training.checkpoint_dir/broker)")
    b.add_argument("--new-run", action="store_true",
                   help="start a new training run instead of continuing the one in the state directory")
    b.add_argument("--backup", action="store_true", help="run as broker.backup (Binary Star): passive until "
                   "the broker fails, then active")
    b.set_defaults(func=cmd_broker)

    n = sub.add_parser("node", help="run one node")
    n.add_argument("--topology", required=True)
    n.add_argument("--name", required=True)
    n.add_argument("--summary", help="write this node's JSON summary here at exit")
    n.add_argument("--threads", type=int, help="torch threads for the compute thread")
    n.add_argument("--key-dir", help="directory with NAME.key_secret (CURVE)")
    n.set_defaults(func=cmd_node)

    e = sub.add_parser("export", help="merge a cluster's stage checkpoints into one model file")
    e.add_argument("--checkpoint-dir", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--cluster", type=int, default=0)
    e.add_argument("--run-id", help="export this run (default: the run of the newest checkpoint)")
    e.add_argument(
        "--topology",
        help="the run's topology: checks the export against the task's model, and writes "
        "a transformers model as a from_pretrained directory",
    )
    e.set_defaults(func=cmd_export)

    s = sub.add_parser("status", help="ask the broker for membership and live statistics")
    s.add_argument("--topology", required=True)
    s.add_argument("--timeout", type=float, default=5.0)
    s.add_argument("--json", action="store_true")
    s.add_argument(
        "--key-dir", help="with CURVE: directory holding this PC's key pair (default: security.key_dir)"
    )
    s.add_argument("--name", help="with CURVE: whose key pair to use (default: the broker's if its secret is "
                                  "in the key directory, else the first node's that is)")
    s.set_defaults(func=cmd_status)

    r = sub.add_parser("relay", help="forward traffic between nodes behind NAT (on a reachable PC)")
    r.add_argument("--topology", required=True)
    r.add_argument("--name", required=True, help="the relay's name under relays: in the topology")
    r.add_argument("--key-dir", help="directory with NAME.key_secret (CURVE)")
    r.set_defaults(func=cmd_relay)

    k = sub.add_parser("keygen", help="make a CURVE key pair for a node or the broker")
    k.add_argument("name")
    k.add_argument("--key-dir", default=".")
    k.add_argument(
        "--owner", help="user that runs ravq on this PC (e.g. ravq): it owns the pair (needs root)"
    )
    k.set_defaults(func=cmd_keygen)

    pr = sub.add_parser("profile", help="measure this node and its links")
    pr.add_argument("--topology", required=True)
    pr.add_argument("--name", required=True)
    pr.add_argument("--out", default=".", help="directory for profile-NAME.json")
    pr.add_argument("--peers-wait", type=float, default=120.0, help="seconds to wait for the peers' profiles")
    pr.set_defaults(func=cmd_profile)

    pl = sub.add_parser("plan", help="choose clusters, stage order and cut points from profiles")
    pl.add_argument("--topology", required=True)
    pl.add_argument("--profiles", default=".", help="directory with profile-*.json")
    pl.add_argument("--out", required=True)
    pl.add_argument("--simulate", action="store_true",
                    help="rank the planner's best candidates by simulated samples/s (ravq simulate)")
    pl.add_argument("--candidates", type=int, default=4, help="with --simulate: candidates simulated")
    pl.add_argument(
        "--sim-steps", type=int, help="with --simulate: micro-batches per cluster (default: training.steps)"
    )
    pl.add_argument(
        "--host-cores", type=float, help="with --simulate: nodes on one host address share this many cores"
    )
    pl.set_defaults(func=cmd_plan)

    sc = sub.add_parser("scrape-config", help="print the Prometheus scrape config of a topology")
    sc.add_argument("--topology", required=True)
    sc.add_argument("--out", help="write it here instead of stdout")
    sc.set_defaults(func=cmd_scrape_config)

    sm = sub.add_parser("simulate", help="simulate a plan on profiled PCs: samples/s, busy, links, averaging")
    sm.add_argument("--topology", required=True)
    sm.add_argument("--profiles", default=".", help="directory with profile-*.json")
    sm.add_argument("--plan", required=True, help="plan YAML from `ravq plan`")
    sm.add_argument("--steps", type=int, help="micro-batches per cluster (default: training.steps)")
    sm.add_argument("--churn", type=float, default=0.0, help="failures per node per hour (exponential)")
    sm.add_argument("--json", help="write the results as JSON here")
    sm.add_argument(
        "--host-cores",
        type=float,
        help="nodes on the same host address share this many cores (default: each node its own PC)",
    )
    sm.add_argument("--jitter", type=float, default=0.0, help="coefficient of variation of compute times")
    sm.add_argument("--seed", type=int, default=0)
    sm.set_defaults(func=cmd_simulate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ConfigError as err:
        print(f"ravq {args.command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
