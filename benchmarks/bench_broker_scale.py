"""The broker at scale (issue #37): N emulated members against a real broker process, this tree's broker
and another tree's (today's code, e.g. ``git worktree add /tmp/ravq/old dc9d577``) in the same run.

Each emulated member has its own sockets to the broker (a DEALER and a SUB, CURVE on, its own key),
thousands per process on one epoll loop (``_members.py``); it registers, follows the published state as
a node does (sequence numbers, snapshots of its topics on a gap) without applying it, and sends a
heartbeat every interval like a training node's, with its checkpoints (three points, a new one every
``--checkpoint-s``) and its cluster's generation.  Nothing trains.  Members read frames of any size (a
node drops headers over 64 KiB: the largest frame is printed), so the old tree's members join too.
Printed per tree and size, over a window after every member joined: the broker's CPU (cores, from
/proc: its own process, whatever the emulators take; and its event loop's thread alone), PUB bytes per
second (what all SUBs received), the largest frame a SUB received, and the worst member's view: the
longest a member lacked an update the broker had published (the next number of one of its topics, timed
from when the first member of its emulator process received it; old: the next whole state), sampled
twice a second.  Then what says whether the emulator kept up (``_emulator_behind``): its beats more than
a quarter interval late, its worst lag, its processes' CPU; a line under the figures says when it fell
behind, so that a shortfall is not read as the broker's.  The load average is printed beside.

    python benchmarks/bench_broker_scale.py --members 1000 10000 --old /tmp/ravq/old [--window-s 30]
    python benchmarks/bench_broker_scale.py --members 1000 --pin 1:0   # the broker alone on CPU 1

A broker runs on a PC of its own; here it shares two cores with the emulated members, whose thousands of
sockets evict its caches between heartbeats, so its CPU time per heartbeat is inflated.  ``--pin B:E`` puts
the broker (all its threads) on CPUs B and the emulators on CPUs E, closer to a broker's own PC.

Run timed figures under ``flock /tmp/ravq/bench.lock``.  Each tree's code runs from its own checkout (its
broker, and its ``ravq.net.wire`` for what members send; the heartbeat's fields as that tree names them).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
import zmq

REPO = Path(__file__).resolve().parents[1]
STAGES = 2


def _cpu_s(pid: int, task: int | None = None) -> float:
    """CPU seconds of process ``pid`` (or of its thread ``task``)."""
    path = f"/proc/{pid}/stat" if task is None else f"/proc/{pid}/task/{task}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _threads_s(pid: int) -> dict[str, float]:
    """CPU seconds of each of process ``pid``'s threads, by name and id (the event loop's, ZeroMQ's I/O
    thread ``ZMQbg/IO/0``, its reaper, ...), and under "<name>:<id> sys" the kernel's part of them."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            out[f"{name}:{task.name}"] = _cpu_s(pid, int(task.name))
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[f"{name}:{task.name} sys"] = int(fields[12]) / os.sysconf("SC_CLK_TCK")  # of that, the kernel's
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def _cpus(pin: str) -> tuple[set[int], set[int]]:
    """``--pin`` 'B:E' (each a comma-separated list of CPU numbers) as the broker's and the emulators' CPUs."""
    broker, emulators = pin.split(":")
    return {int(c) for c in broker.split(",")}, {int(c) for c in emulators.split(",")}


def _emulate(tree: str, names: list[str], keys: dict[str, tuple[str, str]], broker_key: str, pub: str,
             router: str, args: argparse.Namespace, join_by: float, end_at: float, window_at: float,
             conn: Any) -> None:
    """One emulator process: ``names`` members (``_members.Emulator``); sends its figures on ``conn``."""
    from _members import Emulator

    if args.pin:
        os.sched_setaffinity(0, _cpus(args.pin)[1])

    sys.path.insert(0, tree)
    from ravq.net.pubsub import Subscriber

    new = "topics" in Subscriber.connect.__code__.co_varnames
    emulator = Emulator(tree=tree, names=names, clusters={n: int(n[1:]) // STAGES for n in names}, keys=keys,
                        broker_key=broker_key, pub=pub, router=router, new=new, interval_s=args.interval_s,
                        checkpoint_s=args.checkpoint_s, follow=args.max_subs, trace=args.trace)
    start = time.time()
    join_at = {n: random.uniform(start, max(start, join_by)) for n in names}
    emulator.run(join_at, window_at, end_at, *_control_messages(tree))
    conn.send(emulator.stats)


def _control_messages(tree: str) -> tuple[Any, Any]:
    """REGISTER's and HEARTBEAT's meta as ``tree``'s broker reads them: the typed messages where it has them
    (``ravq.net.protocol``), else the dictionaries dc9d577's broker read (``gen``, not ``generation``).  A
    heartbeat's phase: training, or starting while the member has not heard that every member is up."""
    stats = {"loss": 2.5, "samples_per_s": 12.0, "rss_bytes": 1 << 30}
    try:
        from ravq.net.protocol import Heartbeat, Register
    except ImportError:
        return (lambda inc: {"incarnation": inc},
                lambda inc, points, gen, _: {"incarnation": inc, "phase": "training", "gen": gen, "ready": gen,
                                             "trained": points[0]["trained"], "stage_bytes": 1 << 28,
                                             "checkpoints": points, "stats": stats})
    return (lambda inc: Register(incarnation=inc).meta(),
            lambda inc, points, gen, training: Heartbeat(
                incarnation=inc, phase="training" if training else "starting", generation=gen, ready=gen,
                trained=points[0]["trained"], stage_bytes=1 << 28, checkpoints=points, stats=stats).meta())


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def measure(tree: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One broker of ``tree`` and ``n`` emulated members; the window's figures."""
    from ravq.net.security import keygen

    tmp = Path(tempfile.mkdtemp(prefix="ravq-scale-"))
    key_dir = tmp / "keys"
    key_dir.mkdir(mode=0o700)
    broker_key = keygen("broker", key_dir)
    pairs = {f"m{i}": tuple(k.decode() for k in zmq.curve_keypair()) for i in range(n)}
    ports = _free_ports(2)
    nodes = [{"name": f"m{i}", "host": f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", "pipeline_port": 5000,
              "ring_port": 5001,  # never dialled (reachable: true); distinct hosts, so no port is shared
              "reachable": True, "public_key": pairs[f"m{i}"][0], "cluster": i // STAGES, "stage": i % STAGES}
             for i in range(n)]
    topology = {"task": "tests.sgd_task", "nodes": nodes,
                "training": {"checkpoint_dir": str(tmp / "ckpt")},
                "broker": {"host": "127.0.0.1", "pub_port": ports[0], "router_port": ports[1],
                           "public_key": broker_key, "state_dir": str(tmp / "state")},
                "security": {"curve": True, "key_dir": str(key_dir)},
                "timeouts": {"heartbeat_interval_s": args.interval_s, "lost_s": 10 * args.interval_s}}
    path = tmp / "topology.yaml"
    path.write_text(yaml.safe_dump(topology))
    env = {**os.environ, "PYTHONPATH": tree}
    run_cli = "import sys; from ravq.cli.main import main; sys.exit(main())"
    profiled = bool(args.profile) and tree == str(REPO)
    if profiled:  # the broker's event loop under cProfile over the window (SIGUSR1), written when it stops
        out = Path(args.profile).resolve() / f"broker-{n}.prof"
        run_cli = ("import cProfile, gc, json, signal, time; from ravq.cli.main import main\n"
                   "p = cProfile.Profile(time.thread_time)\n"
                   "gcs = {'on': False, 't0': 0.0, 's': 0.0, 'n': [0, 0, 0], 'collected': 0}\n"
                   "def _gc(phase, info):\n"
                   "    if not gcs['on']: return\n"
                   "    if phase == 'start': gcs['t0'] = time.thread_time(); return\n"
                   "    gcs['s'] += time.thread_time() - gcs['t0']; gcs['n'][info['generation']] += 1\n"
                   "    gcs['collected'] += info['collected']\n"
                   "gc.callbacks.append(_gc)\n"
                   "def _on(*_): gcs.update(on=True); p.enable()\n"
                   "signal.signal(signal.SIGUSR1, _on)\n"
                   f"try:\n    main()\nfinally:\n    p.disable(); p.dump_stats({str(out)!r})\n"
                   f"    open({str(out) + '.gc.json'!r}, 'w').write(json.dumps(gcs))")
    if args.account and tree == str(REPO):  # the loop's time by step (``_account.py``), over the window
        out = Path(args.account).resolve() / f"account-{n}.json"
        profiled = True  # SIGUSR1 at the window
        run_cli = (f"import sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); import _account\n"
                   f"dump = _account.install({str(out)!r})\nfrom ravq.cli.main import main\n"
                   "try:\n    main()\nfinally:\n    dump()")
    with (tmp / "broker.log").open("w") as log:
        argv = [sys.executable, "-c", run_cli, "broker", "--topology", str(path), "--new-run"]
        if args.pin:  # every thread the broker starts inherits the CPUs
            argv = ["taskset", "-c", ",".join(map(str, sorted(_cpus(args.pin)[0]))), *argv]
        broker = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=log)
    up_by = time.time() + 120  # 10,000 nodes' topology takes seconds to load: members join once it listens
    while "broker up" not in (tmp / "broker.log").read_text() and time.time() < up_by and broker.poll() is None:
        time.sleep(0.2)
    t0 = time.time()
    join_by, window_at = t0 + args.join_s, t0 + args.join_s + args.settle_s
    end_at = window_at + args.window_s
    names = [f"m{i}" for i in range(n)]
    spawn = mp.get_context("spawn")
    procs, conns = [], []
    per = -(-n // args.procs)
    for k in range(args.procs):
        mine = names[k * per:(k + 1) * per]
        parent, child = spawn.Pipe()
        proc = spawn.Process(target=_emulate, daemon=True, args=(
            tree, mine, {m: pairs[m] for m in mine}, broker_key, f"tcp://127.0.0.1:{ports[0]}",
            f"tcp://127.0.0.1:{ports[1]}", args, join_by, end_at, window_at, child))
        proc.start()
        procs.append(proc)
        conns.append(parent)
    time.sleep(max(0.0, window_at - time.time()))
    if profiled:
        broker.send_signal(signal.SIGUSR1)
    cpu0, main0, w0 = _cpu_s(broker.pid), _cpu_s(broker.pid, broker.pid), time.time()
    threads0 = _threads_s(broker.pid)
    time.sleep(max(0.0, end_at - time.time()))
    cpu1, main1, w1 = _cpu_s(broker.pid), _cpu_s(broker.pid, broker.pid), time.time()
    threads = {k: (v - threads0.get(k, 0.0)) / (w1 - w0) for k, v in _threads_s(broker.pid).items()}
    load = Path("/proc/loadavg").read_text().split()[0]
    lost = {"bytes": 0, "largest": 0, "stale": float("inf"), "joined": 0, "gaps": 0, "late": 0, "retries": 0,
            "beats": 0, "lag": float("inf"), "cpu_s": 0.0, "unconnected": 0}
    stats = [c.recv() if c.poll(120) else lost for c in conns]
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    broker.terminate()
    try:
        broker.wait(20)
    except subprocess.TimeoutExpired:
        broker.kill()
    seconds = w1 - w0
    return {"tree": tree, "members": n, "subscribers": min(n, args.max_subs),
            "joined": sum(s["joined"] for s in stats), "broker_cores": (cpu1 - cpu0) / seconds,
            "broker_loop_cores": (main1 - main0) / seconds,
            "pub_mb_s": sum(s["bytes"] for s in stats) / seconds / 1e6,
            "largest_frame_kib": max(s["largest"] for s in stats) / 1024,
            "worst_stale_intervals": max(s["stale"] for s in stats) / args.interval_s,
            "gaps": sum(s["gaps"] for s in stats), "late_beats": sum(s["late"] for s in stats),
            "beats": sum(s["beats"] for s in stats), "unconnected": sum(s["unconnected"] for s in stats), "emulator_lag_s": max(s["lag"] for s in stats),
            "emulator_cores": sum(s["cpu_s"] for s in stats) / (end_at - t0),
            "register_retries": sum(s["retries"] for s in stats),
            "join_waits": sorted(w for s in stats for w in s.get("join_waits", [])),
            "loadavg": float(load), "window_s": seconds,
            "threads": {k: round(v, 3) for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v > 0.0005}}


def _emulator_behind(r: dict[str, Any], args: argparse.Namespace) -> str:
    """Why the emulator, not the broker, may account for a shortfall ('' when it kept up): beats it sent
    over a quarter interval late (the broker then sees members silent), fewer beats than its members owe
    in the window, or a registration it never sent."""
    owed = r["joined"] * r["window_s"] / args.interval_s
    why = []
    if r["late_beats"] > 0.01 * max(owed, 1):
        why.append(f"{r['late_beats']} beats over a quarter interval late, lag up to {r['emulator_lag_s']:.1f}s")
    if r["beats"] < 0.95 * owed:
        why.append(f"{r['beats']} beats sent of {owed:.0f} owed")
    return "; ".join(why)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--old", help="a checkout of the code to compare with (e.g. a worktree of dc9d577)")
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--checkpoint-s", type=float, default=30.0)
    parser.add_argument("--join-s", type=float, default=20.0, help="members join spread over this")
    parser.add_argument("--settle-s", type=float, default=10.0)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--procs", type=int, default=4, help="emulator processes")
    parser.add_argument("--max-subs", type=int, default=9800,
                        help="members past this many send heartbeats only (the broker may hold 20,000 files)")
    parser.add_argument("--profile", help="write this tree's broker's cProfile (its event loop's CPU time, "
                        "over the window) to DIR/broker-N.prof")
    parser.add_argument("--account", help="write this tree's broker's event-loop time by step (a few methods "
                        "timed, _account.py) over the window to DIR/account-N.json")
    parser.add_argument("--pin", help="BROKER_CPUS:EMULATOR_CPUS, e.g. 1:0: the broker (every thread) on its own "
                        "CPU, as on its own PC, and the emulated members on the other (sharing one core with "
                        "them inflates the broker's CPU time: cold caches on every wake-up)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--trace", action="store_true", help="each emulator process prints, every 10 s, how far "
                        "behind it is, its CPU, its SUBs' bytes and one member's updates by topic and key")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    rows = []
    for n in args.members:
        for tree in [str(REPO), *([args.old] if args.old else [])]:
            r = measure(tree, n, args)
            rows.append(r)
            label = "new" if tree == str(REPO) else "old"
            print(f"{label} {n:>6} members ({r['subscribers']} subscribed, {r['joined']} joined): "
                  f"broker {r['broker_cores']:.3f} cores ({r['broker_loop_cores']:.3f} its event loop), "
                  f"PUB {r['pub_mb_s']:.2f} MB/s, largest frame {r['largest_frame_kib']:.1f} KiB, worst view "
                  f"{r['worst_stale_intervals']:.2f} intervals stale, {r['gaps']} gaps, "
                  f"{r['late_beats']} late beats, {r['register_retries']} registrations retried, "
                  f"{r['unconnected']} sends with no connection to the broker yet; emulators "
                  f"{r['emulator_cores']:.2f} cores, their worst lag {r['emulator_lag_s']:.2f}s  "
                  f"[load {r['loadavg']:.2f}, window {r['window_s']:.0f}s]", flush=True)
            print(f"  broker threads (cores): {r['threads']}", flush=True)
            if waits := r["join_waits"]:
                print(f"  registrations answered in {waits[len(waits) // 2]:.2f}s (median), "
                      f"{waits[int(0.9 * (len(waits) - 1))]:.2f}s (90%), {waits[-1]:.2f}s (longest)", flush=True)
            if behind := _emulator_behind(r, args):
                print(f"  ^ the emulator fell behind ({behind}): these figures are not the broker's alone",
                      flush=True)
    for n in args.members:
        new, old = ([r for r in rows if r["members"] == n and (r["tree"] == str(REPO)) == want]
                    for want in (True, False))
        if new and old:
            a, b = new[0], old[0]
            cpu = b["broker_cores"] / max(a["broker_cores"], 1e-9)
            print(f"{n} members, old/new: broker CPU {cpu:.1f}x, "
                  f"PUB {b['pub_mb_s'] / max(a['pub_mb_s'], 1e-9):.1f}x")
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "join_waits"} for r in rows]))


if __name__ == "__main__":
    main()
