"""Try a deployment before buying it: unequal PCs on slow, distant links, emulated on this machine.

    python benchmarks/testbed.py benchmarks/scenarios/link_bound.yaml                 # the planner's plan
    python benchmarks/testbed.py SCENARIO.yaml --plans planner,ravnest,naive --json   # plans compared
    python benchmarks/testbed.py SCENARIO.yaml --check-only   # build the PCs, check them, tear down

A scenario (YAML, see benchmarks/scenarios/) names PCs with a region, an upload rate, a CPU quota and
optionally a memory limit, and a one-way latency between regions.  The testbed builds one emulated PC
per entry (benchmarks/_emulate.py: network namespace, tc tbf, delay relays, cgroups), checks that the
round trips through the relays are within 10% of the configuration and every quota holds, then runs
the real deployment flow:

1. ``ravq keygen`` for the broker and every PC (CURVE on every socket);
2. ``ravq profile`` on every PC at once, inside its namespace and cgroup;
3. ``ravq plan`` (the planner's plan); Ravnest's rule (GA clusters, equal parameter splits,
   ``ravnest_plan(split="equal")``) and a naive plan (clusters and stages in listing order, even cuts)
   are made from the same profiles for comparison;
4. for each plan: the broker and the plan's nodes started with the command lines of
   deploy/systemd/ravq-broker.service and ravq-node@.service (the broker gets ``--plan``, as a drop-in
   would add), ``ravq status`` polled until every node trains, then a window of ``train_s`` seconds
   measured from the last stages' heartbeat statistics: samples/s, loss, busy and waiting time; just
   before and just after it every PC of the plan is probed for its training FLOP/s
   (benchmarks/host_probe.py): the host's drift since the profile, and the prediction from fresh compute;
5. everything stopped and removed, even on Ctrl-C or SIGTERM.

``run_scenario(path, plans=...)`` does the same from Python and returns the figures as a dict (for
the simulator's validation).  Needs root, iproute2, the tbf qdisc and a cgroup cpu controller.

The machine's cores are shared by every emulated PC: keep the sum of a scenario's CPU quotas well
under the core count (the scenarios here stay at or under 1.5 of 2 cores), or the PCs slow each
other down and the emulation no longer says what separate PCs would do.  Other work on the machine
has the same effect; the report shows each PC's quota check.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
import _emulate

_common.use_repo_checkout()

from ravq.config.topology import INFLIGHT_WARMUP_STEPS  # the checkout's, once on the path

REPO = _common.REPO
HERE = Path(__file__).resolve().parent
UNITS = REPO / "deploy" / "systemd"
PIPELINE_PORT, RING_PORT, PUB_PORT, ROUTER_PORT = 5560, 5561, 5550, 5551
PLANS = ("planner", "ravnest", "naive")


@dataclass(kw_only=True)
class Scenario:
    name: str
    task: str
    training: dict[str, Any]
    regions: dict[str, dict[str, float]]
    """One-way latency in ms from region a to region b (both directions listed, or taken as symmetric)."""
    pcs: list[dict[str, Any]]
    broker_region: str
    train_s: float = 60.0
    seed: int = 1234
    description: str = ""
    layouts: dict[str, list[list[str]]] = field(default_factory=dict)
    """Candidate layouts to train as plans, by name: clusters of PC names in stage order; ``cut_plan``
    cuts them from the profiles."""
    averaging: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per layout name, the averaging its plan records (``Plan.averaging``; a layout given as ``{clusters:
    ..., averaging: ...}``).  ``pace: rate`` without ``rates`` takes the cost model's rate of each cluster,
    as the planner records them."""
    curve_every_s: float = 0.0
    """When > 0, ``ravq status`` every this many seconds of the window: samples and loss over time."""
    plans: list[str] = field(default_factory=list)
    """Plans ``bench_testbed.py`` trains by default (planner, ravnest, naive or layout names)."""

    def one_way_ms(self, a: str, b: str) -> float:
        if b in self.regions.get(a, {}):
            return float(self.regions[a][b])
        if a in self.regions.get(b, {}):
            return float(self.regions[b][a])
        raise ValueError(f"regions: no latency between {a!r} and {b!r}")

    def dilation(self, cores: float) -> float:
        """Time dilation for a machine that gives the PCs ``cores`` cores in all: 1 when their quotas fit,
        else cores / the quotas' sum.  The whole world then runs that much slower (every quota and upload
        x d, every latency / d), so what compute and links do relative to each other is as the scenario
        says, and the profiles, the plans and their predictions are all made in the same slowed world."""
        total = sum(float(p["cpu"]) for p in self.pcs if p.get("cpu"))
        if total <= cores:
            return 1.0
        if any(not p.get("cpu") for p in self.pcs):
            raise ValueError(f"scenario {self.name}: the quotas sum to {total:.2f} cores, more than {cores:.2f}, "
                             f"and some PCs have no cpu quota: nothing would slow them down with the rest")
        return cores / total

    def specs(self, dilation: float = 1.0) -> list[_emulate.PCSpec]:
        return [_emulate.PCSpec(name=p["name"], upload_mbit=float(p["upload_mbit"]) * dilation,
                                cpu_quota=float(p["cpu"]) * dilation if p.get("cpu") else None,
                                memory_bytes=int(p["memory_mb"]) << 20 if p.get("memory_mb") else None)
                for p in self.pcs] + [_emulate.PCSpec(name="broker", upload_mbit=1000.0 * dilation)]

    def region_of(self, name: str) -> str:
        return self.broker_region if name == "broker" else next(p["region"] for p in self.pcs if p["name"] == name)

    def latency_s(self, dilation: float = 1.0) -> dict[str, dict[str, float]]:
        names = [p["name"] for p in self.pcs] + ["broker"]
        return {a: {b: self.one_way_ms(self.region_of(a), self.region_of(b)) / 1e3 / dilation
                    for b in names if b != a} for a in names}


def load_scenario(path: str | Path) -> Scenario:
    data = yaml.safe_load(Path(path).read_text())
    pcs = data.get("pcs") or []
    if len(pcs) < 2:
        raise ValueError(f"{path}: pcs: at least 2 PCs, got {len(pcs)}")
    for i, pc in enumerate(pcs):
        for key in ("name", "region", "upload_mbit"):
            if key not in pc:
                raise ValueError(f"{path}: pcs[{i}]: {key} missing")
        if pc["region"] not in data["regions"]:
            raise ValueError(f"{path}: pcs[{i}].region: {pc['region']!r} is not in regions")
    layouts, averaging = {}, {}
    for kind, given in (data.get("layouts") or {}).items():
        if isinstance(given, dict):  # {clusters: [...], averaging: {...}}
            if set(given) - {"clusters", "averaging"} or "clusters" not in given:
                raise ValueError(f"{path}: layouts.{kind}: a list of clusters or {{clusters, averaging}}, got "
                                 f"{sorted(given)}")
            layouts[kind] = given["clusters"]
            if given.get("averaging"):
                averaging[kind] = dict(given["averaging"])
        else:
            layouts[kind] = given
    scenario = Scenario(name=data.get("name", Path(path).stem), task=data["task"], training=data.get("training", {}),
                        regions=data["regions"], pcs=pcs, broker_region=data.get("broker_region", pcs[0]["region"]),
                        train_s=float(data.get("train_s", 60)), seed=int(data.get("seed", 1234)),
                        description=data.get("description", ""), layouts=layouts, averaging=averaging,
                        plans=list(data.get("plans") or []), curve_every_s=float(data.get("curve_every_s", 0)))
    names = {p["name"] for p in pcs}
    for kind, clusters in scenario.layouts.items():
        unknown = [n for c in clusters for n in c if n not in names]
        if kind in PLANS or unknown or not clusters:
            raise ValueError(f"{path}: layouts.{kind}: clusters of the scenario's PCs under a new name, got {clusters}")
    scenario.latency_s()  # every pair has a latency
    return scenario


# ---------------------------------------------------------------------------------------------- the flow


def unit_command(unit: str, topology: Path, name: str | None = None) -> list[str]:
    """ExecStart of a deploy/systemd unit, run from this checkout: the venv's ``ravq`` becomes
    ``python -m ravq``, /etc/ravq/topology.yaml the testbed's topology and %i the node's name."""
    for line in (UNITS / unit).read_text().splitlines():
        if line.startswith("ExecStart="):
            argv = shlex.split(line.removeprefix("ExecStart="))
            assert argv[0].endswith("/bin/ravq"), argv
            return [sys.executable, "-m", "ravq", *(str(topology) if a == "/etc/ravq/topology.yaml" else
                                                     a.replace("%i", name or "") for a in argv[1:])]
    raise RuntimeError(f"{unit}: no ExecStart line")


@dataclass
class Testbed:
    """One scenario's emulated PCs and the deployment on them."""

    scenario: Scenario
    world: _emulate.World
    run_dir: Path
    dilation: float = 1.0
    """Every quota and upload x this, every latency / this (``Scenario.dilation``)."""
    topology_path: Path = field(init=False)
    checks: dict[str, Any] = field(default_factory=dict)

    def env(self, name: str) -> dict[str, str]:
        cpu = next((p.get("cpu") for p in self.scenario.pcs if p["name"] == name), None)
        threads = str(max(1, math.ceil(cpu))) if cpu else "1"
        return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": threads,
                "XDG_CACHE_HOME": str(self.run_dir / "cache" / name)}

    def ravq(self, name: str, *args: str, timeout_s: float = 120, limited: bool = True) -> str:
        return self.world.run(name, [sys.executable, "-m", "ravq", *args], timeout_s, env=self.env(name),
                              limited=limited)

    def check(self) -> dict[str, Any]:
        """Round trips, link rates and CPU quotas really in force (RuntimeError when not)."""
        rtt = self.world.check_rtt()
        rates = {n: _emulate.tc_rate_bits(pc) / 1e6 for n, pc in self.world.pcs.items()}
        shares: dict[str, float] = {}
        for p in self.scenario.pcs:
            if p.get("cpu"):
                shares[p["name"]] = self.world.cpu_share(p["name"], seconds=1.5)
        self.checks = {"rtt_ms": {a: {b: round(v * 1e3, 2) for b, v in row.items()} for a, row in rtt.items()},
                       "tbf_mbit": rates, "cpu_share": shares}
        return self.checks

    def write_topology(self) -> Path:
        keys = self.run_dir / "keys"
        public = {}
        for name in ["broker", *(p["name"] for p in self.scenario.pcs)]:
            out = self.ravq(name, "keygen", name, "--key-dir", str(keys), timeout_s=60, limited=False)  # setup
            public[name] = yaml.safe_load(next(ln for ln in out.splitlines() if ln.startswith("public_key")))["public_key"]
        pcs = self.world.pcs
        training = {"steps": 1_000_000, "checkpoint_every": 0, **self.scenario.training}
        topology = {
            "task": self.scenario.task, "seed": self.scenario.seed, "training": training,
            "timeouts": {"connect_s": 300, "peer_s": 300, "ring_step_s": 120, "drain_s": 10},
            "security": {"curve": True, "key_dir": str(keys)},
            "broker": {"host": pcs["broker"].address, "bind_host": "127.0.0.1", "pub_port": PUB_PORT,
                       "router_port": ROUTER_PORT, "public_key": public["broker"]},
            "nodes": [{"name": p["name"], "host": pcs[p["name"]].address, "bind_host": "127.0.0.1",
                       "pipeline_port": PIPELINE_PORT, "ring_port": RING_PORT, "device": "cpu",
                       "public_key": public[p["name"]]} for p in self.scenario.pcs],
        }
        self.topology_path = self.run_dir / "topology.yaml"
        self.topology_path.write_text(yaml.safe_dump(topology, sort_keys=False))
        return self.topology_path

    def profile(self) -> dict[str, Any]:
        """``ravq profile`` on every PC at once; the profiles as written."""
        out = self.run_dir / "profiles"
        names = [p["name"] for p in self.scenario.pcs]
        procs = {n: self.world.spawn(n, [sys.executable, "-m", "ravq", "profile", "--topology", str(self.topology_path),
                                         "--name", n, "--out", str(out), "--peers-wait", "240"],
                                     self.run_dir / f"profile-{n}.log", env=self.env(n)) for n in names}
        for n, proc in procs.items():
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"ravq profile on {n} failed:\n{(self.run_dir / f'profile-{n}.log').read_text()}")
        return {n: json.loads((out / f"profile-{n}.json").read_text()) for n in names}

    def host_speed(self, names: Sequence[str]) -> dict[str, float]:
        """Per PC, all at once: the training FLOP/s its profile measured, measured again now in its namespace
        and cgroup (benchmarks/host_probe.py, ~10 s); {} when a probe fails (the figure is only reported)."""
        micro_batch = yaml.safe_load(self.topology_path.read_text())["training"].get("micro_batch", 32)
        stamp = time.monotonic_ns()
        logs = {n: self.run_dir / f"probe-{n}-{stamp}.log" for n in names}
        procs = {n: self.world.spawn(n, [sys.executable, str(HERE / "host_probe.py"), self.scenario.task,
                                         str(micro_batch)], logs[n], env=self.env(n)) for n in names}
        flops = {}
        for n, proc in procs.items():
            try:
                if proc.wait(timeout=120) == 0:
                    flops[n] = json.loads(logs[n].read_text().strip().splitlines()[-1])["flops"]
            except (subprocess.TimeoutExpired, OSError, ValueError, KeyError, IndexError):
                _emulate.stop(proc)  # a probe that hangs or prints nothing: no figure, the run goes on
        return flops if len(flops) == len(procs) else {}

    def status(self) -> dict[str, Any]:
        out = self.ravq("broker", "status", "--topology", str(self.topology_path), "--json", "--timeout", "10",
                        timeout_s=90, limited=False)
        return json.loads(out[out.index("{"):])

    def plan_file(self, kind: str) -> tuple[Path, dict[str, Any]]:
        """The plan of ``kind`` as a plan file, with the cost model's prediction for it."""
        from testbed_plans import make_plans  # torch tracing only when planning

        path = self.run_dir / f"plan-{kind}.yaml"
        if kind == "planner":
            self.ravq("broker", "plan", "--topology", str(self.topology_path), "--profiles",
                      str(self.run_dir / "profiles"), "--out", str(path), timeout_s=600)
        info = make_plans(self.topology_path, self.run_dir / "profiles", kind, path,
                          layout=self.scenario.layouts.get(kind))
        averaging = self.scenario.averaging.get(kind)
        if averaging and not info.get("error"):
            if averaging.get("pace") == "rate" and not averaging.get("rates"):  # as the planner records them
                averaging["rates"] = [round(r, 3) for r in info["cluster_rates"]]
            data = yaml.safe_load(path.read_text())
            data["plan"]["averaging"] = averaging
            path.write_text(yaml.safe_dump(data, sort_keys=False))
            from testbed_plans import predict  # the cost model on the plan with its averaging

            info["averaging"] = averaging
            info["predicted_samples_per_s"] = predict(self.topology_path, self.run_dir / "profiles", path, {})
        return path, info

    def train(self, plan_path: Path, train_s: float, tag: str) -> dict[str, Any]:
        """Broker and the plan's nodes under the units' command lines; measured over ``train_s``."""
        plan = yaml.safe_load(plan_path.read_text())["plan"]
        nodes = [n for c in plan["clusters"] for n in c["nodes"]]
        last = {c["nodes"][-1] for c in plan["clusters"]}
        before = self.host_speed(nodes)
        procs = [self.world.spawn("broker", [*unit_command("ravq-broker.service", self.topology_path), "--plan",
                                             str(plan_path)], self.run_dir / f"{tag}-broker.log",
                                  env=self.env("broker"))]
        try:
            procs += [self.world.spawn(n, unit_command("ravq-node@.service", self.topology_path, n),
                                       self.run_dir / f"{tag}-{n}.log", env=self.env(n)) for n in nodes]
            first = self._wait_training(nodes, procs, tag)
            cpu0, t0 = {n: process_cpu_s(p.pid) for n, p in zip(nodes, procs[1:])}, time.monotonic()
            curve = [curve_point(first, last)]
            every = self.scenario.curve_every_s / self.dilation
            while every > 0 and time.monotonic() + every < t0 + train_s:
                time.sleep(every)
                curve.append(curve_point(self.status(), last))
            time.sleep(max(0.0, t0 + train_s - time.monotonic()))
            end = self.status()
            curve.append(curve_point(end, last))
            shown = self.ravq("broker", "status", "--topology", str(self.topology_path), "--timeout", "10",
                              timeout_s=90, limited=False)  # what an operator sees
            (self.run_dir / f"{tag}-status.txt").write_text(shown)
            cpu1, t1 = {n: process_cpu_s(p.pid) for n, p in zip(nodes, procs[1:])}, time.monotonic()
            self._check_alive(procs, tag)
        finally:
            _stop_all(procs)
        after = self.host_speed(nodes)
        result = measure(first, end, nodes, last, plan)
        result["status_text"] = shown
        if self.scenario.curve_every_s > 0:
            result["curve"] = curve
        quotas = {p["name"]: p["cpu"] * self.dilation if p.get("cpu") else None for p in self.scenario.pcs}
        for n in nodes:  # what each PC really got: under its quota when the machine is oversubscribed
            result["nodes"][n]["cpu_cores"] = round((cpu1[n] - cpu0[n]) / (t1 - t0), 3)
            result["nodes"][n]["cpu_quota"] = quotas[n]
        result["quota_received"] = quota_received(result["nodes"])
        from testbed_plans import predict  # torch tracing only once the window is over

        profiles = self.run_dir / "profiles"
        scale = self.speed_vs_profile(result["nodes"])
        if scale:
            result["speed_vs_profile"] = scale
            result["predicted_load_adjusted"] = predict(self.topology_path, profiles, plan_path, scale)
        fresh, drift = self.host_vs_profile(before), self.host_vs_profile(after)
        if fresh:  # the cost model on the profiles with each PC's compute measured again just before the window
            result["fresh_speed_vs_profile"] = fresh
            result["predicted_fresh"] = predict(self.topology_path, profiles, plan_path, fresh)
        if drift:
            result["after_speed_vs_profile"] = drift
        result["load_average"] = os.getloadavg()[0]  # the machine's, over the last minute of the window
        return result

    def host_vs_profile(self, probed: dict[str, float]) -> dict[str, float]:
        """Per PC: its training FLOP/s probed now (``host_speed``) over its profile's.  The emulated PCs share
        a virtual machine whose host moves what a CPU second computes by tens of percent within minutes
        (docs/testbed.md); a real PC's own CPU does not.  The cost model on the profiles with every PC's
        speed scaled by this, probed just before a plan trains, is a prediction from a profile as fresh
        as a user's who profiles and then trains; the same probe just after the window shows how far the
        host moved meanwhile.  Both are reported beside the prediction from the one profile, not instead."""
        scale = {}
        for name, flops in probed.items():
            profile = json.loads((self.run_dir / "profiles" / f"profile-{name}.json").read_text())
            if profile.get("flops"):
                scale[name] = round(flops / profile["flops"], 3)
        return scale

    def speed_vs_profile(self, nodes: dict[str, dict[str, Any]]) -> dict[str, float]:
        """Per PC: the CPU share it got while computing in the window (CPU seconds over busy seconds)
        over the share its compute profile got.  Other work on the machine changes between the two;
        a prediction with each PC's FLOP/s scaled by this is what the cost model would have said of
        the machine as it was during the window."""
        scale = {}
        for name, v in nodes.items():
            profile = json.loads((self.run_dir / "profiles" / f"profile-{name}.json").read_text())
            if profile.get("cpu_share") and v["busy_fraction"] > 0.05:
                scale[name] = round(min(1.0, v["cpu_cores"] / v["busy_fraction"]) / profile["cpu_share"], 3)
        return scale

    def _wait_training(self, nodes: Sequence[str], procs: Sequence[Any], tag: str,
                       timeout_s: float = 600) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive(procs, tag)
            try:
                status = self.status()
            except RuntimeError:
                time.sleep(2)
                continue
            members = status.get("members", {})
            if all(members.get(n, {}).get("stats", {}).get("backwards", 0) >= settled_backwards(self.scenario.training)
                   for n in nodes):
                return status
            time.sleep(2)
        raise RuntimeError(f"{tag}: nodes did not all start training within {timeout_s:.0f} s")

    def _check_alive(self, procs: Sequence[Any], tag: str) -> None:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{tag}: a process exited early ({proc.args[-6:]}, status {proc.returncode});"
                                   f" logs in {self.run_dir}")


def quota_received(nodes: dict[str, dict[str, Any]]) -> float | None:
    """The share of their CPU quota the PCs got while they computed: CPU seconds used over quota x busy
    time, summed over the plan's PCs.  1.0 on a machine with cores to spare; below when other work
    competes for the cores, and the PCs then compute that much slower than their profiles say (a
    prediction scaled by it is the "load-adjusted" one).  None without quotas."""
    used = sum(v["cpu_cores"] for v in nodes.values() if v.get("cpu_quota"))
    entitled = sum(v["cpu_quota"] * v["busy_fraction"] for v in nodes.values() if v.get("cpu_quota"))
    return min(1.0, used / entitled) if entitled > 0 else None


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) of a live process."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stop_all(procs: Sequence[Any], grace_s: float = 15.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        _emulate.stop(proc, grace_s=max(0.0, deadline - time.monotonic()), term=False)


WINDOW_COUNTERS = ("forwards", "backwards", "forward_s", "backward_s", "forward_step_sq_s")
"""Stage statistics kept per node as their change over the window: compute per micro-batch and its spread."""


def settled_backwards(training: dict[str, Any]) -> int:
    """Micro-batches every node finishes before the window opens: two, and its cluster's asynchrony warm-up
    (``training.inflight_warmup_steps`` optimizer steps with one micro-batch in flight) past.  The planner
    predicts the steady state; the warm-up is the first steps of a run (20 by default), and inside a 45 s
    window it held a 3-stage pipeline of quarter cores to 0.73 of its prediction (memory_bound)."""
    return 2 + training.get("inflight_warmup_steps", INFLIGHT_WARMUP_STEPS) * training.get("update_every", 1)


def measure(first: dict[str, Any], end: dict[str, Any], nodes: Sequence[str], last: set[str],
            plan: dict[str, Any]) -> dict[str, Any]:
    """Samples/s of the window between two status answers: per cluster, its last stage's samples over
    that stage's own wall clock (both from one heartbeat), summed over clusters."""
    a, b = first["members"], end["members"]
    rate, losses, per_cluster = 0.0, [], {}
    for n in last:
        s0, s1 = a[n]["stats"], b[n]["stats"]
        wall = s1["wall_s"] - s0["wall_s"]
        if wall > 0:
            per_cluster[n] = (s1["samples"] - s0["samples"]) / wall
            rate += per_cluster[n]
        if s1.get("loss_recent") is not None:
            losses.append(s1["loss_recent"])
    per_node = {}
    for n in nodes:
        s0, s1 = a[n]["stats"], b[n]["stats"]
        wall = max(s1["wall_s"] - s0["wall_s"], 1e-9)
        waits0, waits1 = s0.get("wait_s", {}), s1.get("wait_s", {})
        per_node[n] = {"busy_fraction": round((s1["busy_s"] - s0["busy_s"]) / wall, 3),
                       "wait_fraction": {r: round((waits1[r] - waits0.get(r, 0.0)) / wall, 3) for r in waits1},
                       "cluster": s1.get("cluster"), "stage": s1.get("stage"),
                       # the window's compute, as the stage timed it (for the simulator's validation)
                       **{k: s1.get(k, 0) - s0.get(k, 0) for k in WINDOW_COUNTERS}}
    return {"samples_per_s": rate, "cluster_samples_per_s": per_cluster,
            "loss": sum(losses) / len(losses) if losses else None,
            "window_s": max(b[n]["stats"]["wall_s"] - a[n]["stats"]["wall_s"] for n in last),
            "clusters": [c["nodes"] for c in plan["clusters"]], "nodes": per_node}


def curve_point(status: dict[str, Any], last: set[str]) -> dict[str, Any]:
    """From one status answer: the samples every cluster's last stage trained so far (in all and per last
    stage) and the clusters' mean recent training loss."""
    stats = {n: status["members"][n]["stats"] for n in sorted(last)}
    losses = [s["loss_recent"] for s in stats.values() if s.get("loss_recent") is not None]
    return {"samples": sum(s["samples"] for s in stats.values()), "per_cluster": {n: s["samples"] for n, s in stats.items()},
            "loss": sum(losses) / len(losses) if losses else None}


def _sigterm_to_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def default_cores() -> float:
    """Cores the emulated PCs may use in all: three quarters of the machine's (the rest runs the delay
    relays, the broker, the testbed and ZeroMQ's threads)."""
    return 0.75 * (os.cpu_count() or 1)


def run_scenario(path: str | Path, plans: Sequence[str] = ("planner",), *, train_s: float | None = None,
                 run_dir: Path | None = None, check_only: bool = False, cores: float | None = None,
                 repeat: bool = False) -> dict[str, Any]:
    """Build the scenario's PCs, profile, plan and train each of ``plans`` ("planner", "ravnest",
    "naive" or a plan file's path) for ``train_s`` seconds of the scenario's time (longer on the wall
    clock when the world is dilated to fit ``cores``); with ``repeat`` the planner's plan trains once
    more at the end (its ``repeat_samples_per_s``: the run-to-run noise); the figures as a dict.  Tears everything down on
    the way out."""
    scenario = load_scenario(path)
    dilation = scenario.dilation(cores or default_cores())
    if reason := _emulate.unavailable_reason():
        raise RuntimeError(f"cannot emulate PCs here: {reason}")
    run_dir = run_dir or Path("/tmp") / f"rq14-testbed-{scenario.name}-{os.getpid()}"
    previous = signal.signal(signal.SIGTERM, _sigterm_to_exit)
    result: dict[str, Any] = {"scenario": scenario.name, "run_dir": str(run_dir), "dilation": dilation}
    try:
        with _emulate.emulated_pcs(scenario.specs(dilation), scenario.latency_s(dilation), run_dir) as world:
            ports = {p["name"]: [PIPELINE_PORT, RING_PORT] for p in scenario.pcs}
            world.start_relays({**ports, "broker": [PUB_PORT, ROUTER_PORT]})
            bed = Testbed(scenario, world, run_dir, dilation)
            result["checks"] = bed.check()
            if check_only:
                return result
            bed.write_topology()
            result["profiles"] = {n: {"gflops": p["flops"] / 1e9, "flops_spread": p.get("flops_spread"),
                                      "memory_gib": p["memory_bytes"] / (1 << 30)}
                                  for n, p in bed.profile().items()}
            result["profile_load_average"] = os.getloadavg()[0]
            result["plans"] = {}
            trained: dict[str, tuple[Any, str]] = {}
            for kind in plans:
                known = kind in PLANS or kind in scenario.layouts
                plan_path, info = bed.plan_file(kind) if known else (Path(kind), {"kind": "file"})
                if info.get("error"):
                    result["plans"][kind] = info
                    continue
                layout = yaml.safe_load(plan_path.read_text())["plan"]  # clusters, cuts and averaging
                same = next((k for k, (other, _) in trained.items() if other == layout), None)
                if same is not None:  # the very same plan: one run of it says all there is to say
                    result["plans"][kind] = {**result["plans"][same], **info, "same_plan_as": same}
                    continue
                trained[kind] = (layout, str(plan_path))
                measured = bed.train(plan_path, (train_s or scenario.train_s) / dilation, tag=kind)
                if info.get("predicted_samples_per_s"):
                    measured["predicted_over_measured"] = info["predicted_samples_per_s"] / measured["samples_per_s"]
                if known:  # ``ravq simulate`` as a user runs it: the profiles alone, no measured compute
                    from testbed_plans import simulate_profiles

                    measured["simulated_samples_per_s"] = simulate_profiles(bed.topology_path, run_dir / "profiles",
                                                                            plan_path)
                    if measured.get("fresh_speed_vs_profile"):
                        measured["simulated_fresh"] = simulate_profiles(bed.topology_path, run_dir / "profiles",
                                                                        plan_path, measured["fresh_speed_vs_profile"])
                result["plans"][kind] = {**info, **measured}
            if repeat and "planner" in trained:  # once more, last: how far two runs of one plan differ here
                again = bed.train(Path(trained["planner"][1]), (train_s or scenario.train_s) / dilation,
                                  tag="planner-again")
                result["plans"]["planner"]["repeat_samples_per_s"] = again["samples_per_s"]
    finally:
        signal.signal(signal.SIGTERM, previous)
    (run_dir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario")
    parser.add_argument("--plans", default="planner", help="comma-separated: planner, ravnest, naive, or plan files")
    parser.add_argument("--train-s", type=float, help="measured training window per plan (default: the scenario's)")
    parser.add_argument("--run-dir", type=Path, help="where logs, keys, profiles and plans go")
    parser.add_argument("--check-only", action="store_true", help="build and check the PCs, run nothing")
    parser.add_argument("--cores", type=float, help="cores the PCs may use in all; a scenario asking more is "
                        "dilated (slowed down as a whole) to fit (default: 3/4 of this machine's)")
    parser.add_argument("--json", action="store_true", help="last line: the figures as one JSON object")
    args = parser.parse_args(argv)
    result = run_scenario(args.scenario, [p for p in args.plans.split(",") if p], train_s=args.train_s,
                          run_dir=args.run_dir, check_only=args.check_only, cores=args.cores)
    for line in report_lines(result):
        print(line)
    if args.json:
        print(json.dumps(result))
    return 0


def report_lines(result: dict[str, Any]) -> Iterator[str]:
    checks = result.get("checks", {})
    yield f"scenario {result['scenario']} (logs in {result['run_dir']})"
    if result.get("dilation", 1.0) < 1.0:
        d = result["dilation"]
        yield (f"  dilated x{d:.2f} to fit this machine: every quota and upload x{d:.2f}, every latency / {d:.2f}; "
               f"samples/s below are the slowed world's (/ {d:.2f} for the scenario's PCs)")
    for name, share in checks.get("cpu_share", {}).items():
        yield f"  cpu check {name}: {share:.3f} cores"
    for name, prof in result.get("profiles", {}).items():
        spread = prof["flops_spread"]
        yield (f"  profile {name}: {prof['gflops']:.3g} GFLOP/s (windows within "
               f"{'?' if spread is None else f'{spread:.0%}'}), {prof['memory_gib']:.2f} GiB")
    for kind, r in result.get("plans", {}).items():
        if r.get("error"):
            yield f"  {kind}: {r['error']}"
            continue
        if r.get("same_plan_as"):
            yield f"  {kind:<8} the same plan as {r['same_plan_as']}'s (trained once): clusters {r['clusters']}"
            continue
        loss = "?" if r.get("loss") is None else f"{r['loss']:.3f}"
        pred, sim = r.get("predicted_samples_per_s"), r.get("simulated_samples_per_s")
        yield (f"  {kind:<8} measured {r['samples_per_s']:8.1f} samples/s, predicted "
               f"{'?' if pred is None else f'{pred:.1f}'}, simulated from profiles {'?' if sim is None else f'{sim:.1f}'}"
               f", loss {loss}, clusters {r['clusters']}")
        if r.get("quota_received") is not None:
            yield f"           the PCs got {r['quota_received']:.0%} of their CPU quota while computing"
        if r.get("predicted_load_adjusted") is not None:
            yield (f"           load-adjusted prediction {r['predicted_load_adjusted']:.1f} (each PC's speed scaled by "
                   f"its CPU share in the window over its share while profiled: "
                   + ", ".join(f"{n} {f:.2f}" for n, f in r["speed_vs_profile"].items()) + ")")
        if r.get("predicted_fresh") is not None:
            yield (f"           prediction from fresh compute {r['predicted_fresh']:.1f}, simulated "
                   f"{r.get('simulated_fresh', float('nan')):.1f} (each PC's training FLOP/s probed just before the "
                   f"window over its profile's: " + ", ".join(f"{n} {f:.2f}" for n, f in r["fresh_speed_vs_profile"].items())
                   + "; just after: " + ", ".join(f"{n} {f:.2f}" for n, f in r.get("after_speed_vs_profile", {}).items())
                   + ")")
        nodes = r.get("nodes", {})
        yield "           busy / waiting / cpu got of quota: " + "; ".join(
            f"{n} {v['busy_fraction']:.2f} / {sum(v['wait_fraction'].values()):.2f} / "
            f"{v.get('cpu_cores', float('nan')):.2f} of {v.get('cpu_quota')}" for n, v in nodes.items())


if __name__ == "__main__":
    raise SystemExit(main())
