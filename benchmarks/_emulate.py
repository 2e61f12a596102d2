"""Emulated PCs on one machine: a network namespace per PC on a bridge, its upload shaped by tc tbf,
one-way latency to every other PC from a user-space delay relay (benchmarks/_relay.py; netem is not
available here), and its compute speed (and optionally memory) limited by a cgroup.

``emulated_pcs(specs, latency_s)`` builds them and yields a ``World``; on the way out (exceptions,
Ctrl-C, SIGTERM turned into SystemExit by the caller) every process it started is killed and the
relays, cgroups, namespaces and bridge are removed.  Names carry the prefix ``rq14`` and the process id.

- Network: a hub namespace holds the bridge; each PC's veth egress is shaped to its ``upload_mbit``
  (a -> b runs at a's rate; the bridge side is not shaped), as in benchmarks/_netns.py.
- Latency: ``World.start_relays(ports)`` starts, in every PC's namespace, a relay listening on the
  PC's address at each given port and forwarding to 127.0.0.1 (where the real process binds); it holds
  bytes from peer a for ``latency_s[a][me]`` and bytes back for ``latency_s[me][a]``.  ``check_rtt``
  measures every pair's round trip through them (an echo port behind each relay) before a run.
- Compute: cgroup v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max`` (whichever the machine has) set to
  ``cpu_quota`` cores over a period of a few milliseconds (``cpu_period_us``: a slow PC, not a fast one
  in slices); ``memory_bytes`` sets ``memory.limit_in_bytes`` (v1) or ``memory.max`` (v2).
  Relays run outside the PC's cgroup: a network costs its PC no CPU.  The quotas of all PCs should sum
  well under the machine's cores, or they compete for the cores and the emulation lies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _netns

PREFIX = "rq14"
RELAY = Path(__file__).resolve().parent / "_relay.py"
ECHO_PORT = 29999
CGROUP_ROOT = Path("/sys/fs/cgroup")
MIN_QUOTA_US = 1_000
"""The kernel's smallest CFS quota per period."""
MIN_PERIOD_US = 5_000
"""Shorter periods cost the PC CPU: a busy loop under 0.545 cores over a 2 ms period got 0.467 (0.27 over
3.7 ms: 0.268; 0.136 over 7.4 ms: all of it), each period's throttling ending a little late."""


def cpu_period_us(cores: float) -> int:
    """CFS period for a quota of ``cores``: as short as the kernel allows (a quota of at least 1 ms),
    so that the PC is slow all the time rather than fast in slices.  Under a 100 ms period a quarter
    core runs at full speed for 25 ms and then waits 75 ms: a 20 ms forward took 19.5 ms instead of
    the 80 ms a quarter-speed PC needs, and pipelines of short stages ran about twice as fast as slow
    PCs would.  With a 5 ms period it took 69.5 ms (the first period's quota comes at once)."""
    return max(MIN_PERIOD_US, -(-MIN_QUOTA_US * 1_000_000 // int(cores * 1_000_000)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PCSpec:
    """One emulated PC."""

    name: str
    upload_mbit: float
    """Egress rate of its link (tc tbf)."""
    cpu_quota: float | None = None
    """CPU time per wall second, in cores (0.25 = a quarter of one core); None: unlimited."""
    memory_bytes: int | None = None
    """Memory limit of its processes; None: unlimited."""

    def __post_init__(self) -> None:
        if not self.upload_mbit > 0:
            raise ValueError(f"pc {self.name}: upload_mbit must be > 0, got {self.upload_mbit}")
        if self.cpu_quota is not None and not 0.01 <= self.cpu_quota <= 64:
            raise ValueError(f"pc {self.name}: cpu_quota must be 0.01..64 cores, got {self.cpu_quota}")
        if self.memory_bytes is not None and self.memory_bytes < 64 << 20:
            raise ValueError(f"pc {self.name}: memory_bytes must be at least 64 MiB, got {self.memory_bytes}")


@dataclasses.dataclass(frozen=True)
class PC:
    spec: PCSpec
    netns: str
    address: str
    cgroups: tuple[Path, ...]
    """cgroup directories its processes join (one per controller on v1, one on v2)."""


# ---------------------------------------------------------------------------------------------- cgroups


def cpu_weight(cores: float, v1: bool) -> int:
    """CPU weight in proportion to the quota (v1 ``cpu.shares``, default 1024; v2 ``cpu.weight``, default
    100, both for one core): when the machine's cores are contended, each PC still gets its quota's share.
    With equal weights the scheduler splits the cores evenly among whatever runs, and a full-core PC next
    to quarter-core ones got 0.42 of its 0.55 cores while they got all of theirs."""
    return max(2, round(cores * 1024)) if v1 else max(1, min(10_000, round(cores * 100)))


def _own_cgroup(controller: str) -> str:
    """This process's cgroup path for a v1 controller ("" key for v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return "/"


def cgroup_layout() -> str:
    """"v1" (separate cpu and memory hierarchies), "v2" (unified with the cpu controller) or why neither."""
    if (CGROUP_ROOT / "cpu" / "cpu.cfs_quota_us").exists():
        return "v1"
    controllers = CGROUP_ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return "v2"
    return "no cgroup cpu controller (neither v1 cpu.cfs_quota_us nor v2 cpu.max)"


def _make_cgroups(layout: str, name: str, spec: PCSpec) -> list[Path]:
    made: list[Path] = []
    try:
        if layout == "v1":
            cpu = CGROUP_ROOT / "cpu" / _own_cgroup("cpu").lstrip("/") / name
            cpu.mkdir()
            made.append(cpu)
            period = MIN_PERIOD_US if spec.cpu_quota is None else cpu_period_us(spec.cpu_quota)
            (cpu / "cpu.cfs_quota_us").write_text("-1")  # a new period must not be below the current quota
            (cpu / "cpu.cfs_period_us").write_text(str(period))
            if spec.cpu_quota is not None:
                (cpu / "cpu.cfs_quota_us").write_text(str(int(spec.cpu_quota * period)))
                (cpu / "cpu.shares").write_text(str(cpu_weight(spec.cpu_quota, v1=True)))
            if spec.memory_bytes is not None:
                # Under our own memory cgroup: the limit nests inside whatever limits this process.
                mem = CGROUP_ROOT / "memory" / _own_cgroup("memory").lstrip("/") / name
                mem.mkdir()
                made.append(mem)
                (mem / "memory.limit_in_bytes").write_text(str(spec.memory_bytes))
        else:
            group = CGROUP_ROOT / _own_cgroup("").lstrip("/") / name
            group.mkdir()
            made.append(group)
            period = MIN_PERIOD_US if spec.cpu_quota is None else cpu_period_us(spec.cpu_quota)
            quota = "max" if spec.cpu_quota is None else str(int(spec.cpu_quota * period))
            (group / "cpu.max").write_text(f"{quota} {period}")
            if spec.cpu_quota is not None:
                (group / "cpu.weight").write_text(str(cpu_weight(spec.cpu_quota, v1=False)))
            if spec.memory_bytes is not None:
                (group / "memory.max").write_text(str(spec.memory_bytes))
    except BaseException:
        _remove_cgroups(made)
        raise
    return made


def _remove_cgroups(groups: Sequence[Path]) -> None:
    for group in reversed(groups):
        for _ in range(50):
            try:
                pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
            except OSError:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                group.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)  # killed processes take a moment to leave


def throttled_s(pc: PC) -> float:
    """Seconds the PC's processes were held back by the quota (cpu.stat throttled_time / throttled_usec)."""
    stat = pc.cgroups[0] / "cpu.stat"
    for line in stat.read_text().splitlines():
        key, value = line.split()
        if key == "throttled_time":
            return int(value) / 1e9
        if key == "throttled_usec":
            return int(value) / 1e6
    return 0.0


def cpu_period_s(pc: PC) -> float:
    """The CFS period in force on the PC's cgroup, read back from the kernel."""
    group = pc.cgroups[0]
    if (group / "cpu.cfs_period_us").exists():
        return int((group / "cpu.cfs_period_us").read_text()) / 1e6
    return int((group / "cpu.max").read_text().split()[1]) / 1e6


def cpu_quota_cores(pc: PC) -> float | None:
    """The CPU quota in force on the PC's cgroup, read back from the kernel (None: unlimited)."""
    group = pc.cgroups[0]
    if (group / "cpu.cfs_quota_us").exists():
        quota = int((group / "cpu.cfs_quota_us").read_text())
        return None if quota < 0 else quota / int((group / "cpu.cfs_period_us").read_text())
    quota_text, period = (group / "cpu.max").read_text().split()
    return None if quota_text == "max" else int(quota_text) / int(period)


# ---------------------------------------------------------------------------------------------- the world


class World:
    """The emulated PCs, the relays in front of their ports and every process started in them."""

    def __init__(self, pcs: dict[str, PC], latency_s: Mapping[str, Mapping[str, float]], run_dir: Path) -> None:
        self.pcs, self.latency_s, self.run_dir = pcs, latency_s, run_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def one_way_s(self, a: str, b: str) -> float:
        return 0.0 if a == b else float(self.latency_s[a][b])

    def spawn(self, name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
              limited: bool = True) -> subprocess.Popen[bytes]:
        """Run ``argv`` inside PC ``name``: its namespace and (``limited``) its cgroups."""
        pc = self.pcs[name]
        joins = "".join(f'echo $$ > "{g}/cgroup.procs" && ' for g in pc.cgroups) if limited else ""
        wrapper = ["sh", "-c", joins + 'exec "$@"', "sh", *enter_netns(pc.netns), *argv]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(wrapper, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=dict(env) if env is not None else None, start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, name: str, argv: Sequence[str], timeout_s: float, limited: bool = True,
            env: Mapping[str, str] | None = None) -> str:
        """Run ``argv`` in PC ``name`` to completion; its output (RuntimeError on failure)."""
        log = self.run_dir / f"run-{name}-{len(self.procs)}.log"
        proc = self.spawn(name, argv, log, env, limited)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            raise RuntimeError(f"{name}: {' '.join(argv)} took more than {timeout_s:.0f} s") from None
        out = log.read_text(errors="replace")
        if proc.returncode != 0:
            raise RuntimeError(f"{name}: {' '.join(argv)} exited {proc.returncode}:\n{out[-2000:]}")
        return out

    def start_relays(self, ports: Mapping[str, Sequence[int]]) -> None:
        """A delay relay in every PC named in ``ports``, listening on its address at those ports."""
        by_address = {pc.address: n for n, pc in self.pcs.items()}
        for name, pc in self.pcs.items():
            config = {"address": pc.address, "ports": sorted(set(ports.get(name, ()))), "echo_port": ECHO_PORT,
                      "delays_s": {addr: [self.one_way_s(peer, name), self.one_way_s(name, peer)]
                                   for addr, peer in by_address.items() if peer != name}}
            path = self.run_dir / f"relay-{name}.json"
            path.write_text(json.dumps(config))
            log = self.run_dir / f"relay-{name}.log"
            self.spawn(name, [sys.executable, str(RELAY), "serve", str(path)], log, limited=False)
            deadline = time.monotonic() + 20
            while "ready" not in (log.read_text() if log.exists() else ""):
                if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                    raise RuntimeError(f"relay of {name} did not start:\n{log.read_text()}")
                time.sleep(0.05)

    def check_rtt(self, pings: int = 11, tolerance: float = 0.1, tries: int = 5) -> dict[str, dict[str, float]]:
        """Measured round trip a -> b -> a through the relays (median of ``pings``), for every pair;
        RuntimeError when one is off its configured one-way sum by more than ``tolerance`` (+0.3 ms) in
        each of ``tries`` attempts (a busy machine may delay one attempt's wake-ups)."""
        measured: dict[str, dict[str, float]] = {}
        errors = []
        for a in self.pcs:
            todo = [b for b in self.pcs if b != a]
            for _ in range(tries):
                rtts = self._median_rtts(a, todo, pings)
                measured.setdefault(a, {}).update(rtts)
                todo = [b for b in todo if not self._rtt_ok(a, b, rtts[b], tolerance)]
                if not todo:
                    break
                time.sleep(1.0)  # a load spike on a shared machine delays wake-ups for a moment
            errors += [f"{a}->{b}: {measured[a][b] * 1e3:.2f} ms round trip, configured "
                       f"{(self.one_way_s(a, b) + self.one_way_s(b, a)) * 1e3:.2f} ms" for b in todo]
        if errors:
            raise RuntimeError(f"latency emulation off by more than {tolerance:.0%}:\n" + "\n".join(errors))
        return measured

    def _rtt_ok(self, a: str, b: str, rtt: float, tolerance: float) -> bool:
        want = self.one_way_s(a, b) + self.one_way_s(b, a)
        return abs(rtt - want) <= tolerance * want + 3e-4

    def _median_rtts(self, a: str, peers: Sequence[str], pings: int) -> dict[str, float]:
        hosts = {self.pcs[b].address: b for b in peers}
        out = self.run(a, [sys.executable, str(RELAY), "ping", str(ECHO_PORT), str(pings), *hosts],
                       timeout_s=60, limited=False)
        found = json.loads(out.strip().splitlines()[-1])
        return {hosts[h]: sorted(rtts)[len(rtts) // 2] for h, rtts in found.items()}

    def cpu_share(self, name: str, seconds: float = 2.0) -> float:
        """CPU seconds per wall second a busy loop gets inside PC ``name`` (its quota, if the machine
        has the cores to spare)."""
        loop = ("import time, os\nt0 = time.monotonic(); c0 = time.process_time()\n"
                f"while time.monotonic() - t0 < {seconds}: sum(range(1000))\n"
                "print((time.process_time() - c0) / (time.monotonic() - t0))")
        return float(self.run(name, [sys.executable, "-c", loop], timeout_s=seconds + 30).strip().splitlines()[-1])

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            stop(proc, grace_s=0.0)
        self.procs.clear()


def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0, term: bool = True) -> None:
    """SIGTERM the process group (unless ``term`` is False: already sent), then SIGKILL it after
    ``grace_s``."""
    if proc.poll() is None and term:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def enter_netns(netns: str) -> list[str]:
    """The command prefix that runs a program in ``netns``.  nsenter rather than ``ip netns exec``,
    which remounts /sys and so hides /sys/fs/cgroup: a PC's processes must see their memory limit."""
    if shutil.which("nsenter"):
        return ["nsenter", f"--net={os.path.join(_netns.NETNS_DIR, netns)}"]
    return ["ip", "netns", "exec", netns]


def unavailable_reason() -> str | None:
    """Why PCs cannot be emulated here, or None."""
    if reason := _netns.unavailable_reason():
        return reason
    layout = cgroup_layout()
    return None if layout in ("v1", "v2") else layout


def leftovers() -> list[str]:
    """Namespaces and cgroups of this process still present (empty after a clean exit)."""
    tag = f"{PREFIX}"
    found = [f"netns {n}" for n in (os.listdir(_netns.NETNS_DIR) if os.path.isdir(_netns.NETNS_DIR) else [])
             if n.startswith(tag) and n.endswith(f"-{os.getpid()}")]
    for root in (CGROUP_ROOT / "cpu" / _own_cgroup("cpu").lstrip("/"),
                 CGROUP_ROOT / "memory" / _own_cgroup("memory").lstrip("/"),
                 CGROUP_ROOT / _own_cgroup("").lstrip("/")):
        if root.is_dir():
            found += [f"cgroup {p}" for p in root.iterdir() if p.name.startswith(tag) and
                      p.name.endswith(f"-{os.getpid()}")]
    return found


@contextlib.contextmanager
def emulated_pcs(specs: Sequence[PCSpec], latency_s: Mapping[str, Mapping[str, float]],
                 run_dir: Path) -> Iterator[World]:
    """The PCs of ``specs`` (``latency_s[a][b]``: one-way latency a -> b); everything removed on exit."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"pcs: duplicate names in {names}")
    for a in names:
        for b in names:
            if a != b and not 0 <= latency_s[a][b] < 10:
                raise ValueError(f"latency {a}->{b}: must be 0..10 s, got {latency_s[a][b]}")
    layout = cgroup_layout()
    if layout not in ("v1", "v2"):
        raise RuntimeError(layout)
    tag = os.getpid()
    subnet = f"10.14.{tag % 250}"
    hub = f"{PREFIX}hub-{tag}"
    made_ns: list[str] = []
    made_groups: list[Path] = []
    world: World | None = None
    try:
        for ns in (hub,):
            _netns._check(_netns._run("ip", "netns", "add", ns))
            made_ns.append(ns)
        _netns._check(_netns._run("ip", "-n", hub, "link", "add", "br0", "type", "bridge"))
        _netns._check(_netns._run("ip", "-n", hub, "link", "set", "br0", "up"))
        pcs = {}
        for i, spec in enumerate(specs):
            ns = f"{PREFIX}pc{i}-{tag}"
            _netns._check(_netns._run("ip", "netns", "add", ns))
            made_ns.append(ns)
            _netns._check(_netns._run("ip", "-n", ns, "link", "set", "lo", "up"))
            address = f"{subnet}.{i + 1}"
            _netns._check(_netns._run("ip", "link", "add", "v0", "netns", ns, "type", "veth", "peer", "name",
                                      f"h{i}", "netns", hub))
            _netns._check(_netns._run("ip", "-n", hub, "link", "set", f"h{i}", "master", "br0"))
            _netns._check(_netns._run("ip", "-n", hub, "link", "set", f"h{i}", "up"))
            _netns._check(_netns._run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "v0"))
            _netns._check(_netns._run("ip", "-n", ns, "link", "set", "v0", "up"))
            _netns._check(_netns._run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "v0", "root", "tbf",
                                      "rate", f"{spec.upload_mbit:g}mbit",
                                      "burst", str(_netns.tbf_burst_bytes(spec.upload_mbit)), "latency", "50ms"))
            groups = _make_cgroups(layout, f"{PREFIX}{spec.name}-{tag}", spec)
            made_groups += groups
            pcs[spec.name] = PC(spec=spec, netns=ns, address=address, cgroups=tuple(groups))
        run_dir.mkdir(parents=True, exist_ok=True)
        world = World(pcs, latency_s, run_dir)
        yield world
    finally:
        if world is not None:
            world.stop_all()
        _remove_cgroups(made_groups)
        for ns in reversed(made_ns):
            _netns._run("ip", "netns", "del", ns)


def tc_rate_bits(pc: PC) -> float:
    """The tbf rate in force on the PC's link, read back from ``tc`` (bits/s)."""
    out = _netns._run("ip", "netns", "exec", pc.netns, "tc", "-j", "qdisc", "show", "dev", "v0").stdout
    for qdisc in json.loads(out or "[]"):
        if qdisc.get("kind") == "tbf":
            return float(qdisc["options"]["rate"]) * 8
    raise RuntimeError(f"{pc.netns}: no tbf qdisc on v0")
