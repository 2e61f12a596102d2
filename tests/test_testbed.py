"""Emulated PCs (benchmarks/_emulate.py) really have the links, latency and CPU they are given, as
ravq's own profiler sees them, and leave nothing behind.

Three PCs: uploads 200/50/20 Mbit/s (tc tbf), one-way latency 10-30 ms through the user-space delay
relays, CPU quotas of half and a quarter of a core, a 512 MiB memory limit on one.  Round trips are
checked by the emulation itself (within 10%), each PC's quota reads back from the kernel, and a busy
loop in it gets no more than that.  ``ravq profile`` then runs in every PC at once: bandwidth at most 20% over the
shaping (and not below 60% of it), latency at least 90% of the configuration (at most 1.5x + 2 ms),
compute measured under the quota, and the memory-limited PC must report less than its limit.  Speed
is checked as the ceiling or floor that the emulation enforces, since a loaded machine (these tests
share it) can only make things slower.  Afterwards (and after an interrupted
world) no namespace, cgroup or relay is left.  Needs root; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks import _emulate

pytestmark = [pytest.mark.netns, pytest.mark.alone]

REPO = Path(__file__).resolve().parents[1]
UPLOAD_MBIT = {"a": 200.0, "b": 50.0, "c": 20.0}
CPU = {"a": 0.5, "b": 0.25, "c": 0.25}
MEMORY = {"c": 512 << 20}
ONE_WAY_MS = {("a", "b"): 10.0, ("a", "c"): 30.0, ("b", "c"): 20.0}
PORT = 26401


def one_way_s(a: str, b: str) -> float:
    return ONE_WAY_MS.get((a, b), ONE_WAY_MS.get((b, a), 0.0)) / 1e3


@pytest.fixture
def available() -> None:
    if reason := _emulate.unavailable_reason():
        pytest.skip(reason)


def test_emulated_pcs_have_their_links_latency_and_cpu_and_leave_nothing(available: None, tmp_path: Path) -> None:
    specs = [_emulate.PCSpec(name=n, upload_mbit=UPLOAD_MBIT[n], cpu_quota=CPU[n], memory_bytes=MEMORY.get(n))
             for n in UPLOAD_MBIT]
    latency = {a: {b: one_way_s(a, b) for b in UPLOAD_MBIT if b != a} for a in UPLOAD_MBIT}
    with _emulate.emulated_pcs(specs, latency, tmp_path / "run") as world:
        world.start_relays({n: [PORT] for n in UPLOAD_MBIT})
        relays = list(world.procs)
        rtt = world.check_rtt()  # raises when a round trip stays off by more than 10% (five tries)
        assert set(rtt["a"]) == {"b", "c"}
        for name, pc in world.pcs.items():
            assert _emulate.tc_rate_bits(pc) == UPLOAD_MBIT[name] * 1e6
        for name in UPLOAD_MBIT:  # a ceiling, whatever else runs on the machine
            share = world.cpu_share(name, seconds=2.0)
            assert 0 < share <= CPU[name] * 1.25, f"{name}: a busy loop got {share:.3f} cores, quota {CPU[name]}"
            assert _emulate.cpu_quota_cores(world.pcs[name]) == CPU[name]
            assert _emulate.cpu_period_s(world.pcs[name]) == _emulate.cpu_period_us(CPU[name]) / 1e6
            weight = world.pcs[name].cgroups[0] / ("cpu.shares" if _emulate.cgroup_layout() == "v1" else "cpu.weight")
            assert int(weight.read_text()) == _emulate.cpu_weight(CPU[name], v1=_emulate.cgroup_layout() == "v1")

        topology = tmp_path / "topology.yaml"
        topology.write_text(yaml.safe_dump({
            "task": "tests.tasks_for_tests", "training": {"micro_batch": 32},
            "broker": {"host": "127.0.0.1", "pub_port": PORT + 10, "router_port": PORT + 11},
            "nodes": [{"name": n, "host": pc.address, "bind_host": "127.0.0.1", "pipeline_port": PORT,
                       "ring_port": PORT + 1} for n, pc in world.pcs.items()]}))
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        out = tmp_path / "profiles"
        procs = {n: world.spawn(n, [sys.executable, "-m", "ravq", "profile", "--topology", str(topology), "--name", n,
                                    "--out", str(out)], tmp_path / f"profile-{n}.log", env=env) for n in UPLOAD_MBIT}
        for n, proc in procs.items():
            # a quarter of a core takes tens of seconds to import torch: the default --peers-wait (120 s) covers it
            assert proc.wait(timeout=300) == 0, "\n".join(
                f"--- {m}\n" + (tmp_path / f"profile-{m}.log").read_text() for m in procs)
        profiles = {n: json.loads((out / f"profile-{n}.json").read_text()) for n in UPLOAD_MBIT}
        # What ravq's own profiler sees.  Shaping and delay are checked as the ceiling and floor they are
        # (a loaded machine can only make a link slower or later), with a loose bound on the other side.
        errors = []
        for a, prof in profiles.items():
            for b, measured in prof["bandwidth_bytes_per_s"].items():
                if not 0.6 <= measured * 8 / 1e6 / UPLOAD_MBIT[a] <= 1.2:
                    errors.append(f"{a}->{b}: {measured * 8 / 1e6:.1f} Mbit/s, shaped {UPLOAD_MBIT[a]}")
            for b, measured in prof["latency_s"].items():
                if not 0.9 * one_way_s(a, b) <= measured <= 1.5 * one_way_s(a, b) + 2e-3:
                    errors.append(f"{a}->{b}: {measured * 1e3:.1f} ms, configured {one_way_s(a, b) * 1e3:.0f} ms")
            if not 0 < prof["cpu_share"] <= CPU[a] * 1.25:  # the profile ran under the quota
                errors.append(f"{a}: compute measured with {prof['cpu_share']:.3f} cores, quota {CPU[a]}")
        assert not errors, "\n".join(errors)
        assert profiles["c"]["memory_bytes"] < MEMORY["c"] < profiles["a"]["memory_bytes"]
        assert all(p["flops_spread"] is not None and len(p["flops_windows"]) == 5 for p in profiles.values())
    assert _emulate.leftovers() == []
    assert all(p.poll() is not None for p in relays), "a relay outlived its world"


def test_an_interrupted_world_is_torn_down(available: None, tmp_path: Path) -> None:
    specs = [_emulate.PCSpec(name="solo", upload_mbit=10, cpu_quota=0.1, memory_bytes=256 << 20),
             _emulate.PCSpec(name="peer", upload_mbit=10)]
    latency = {"solo": {"peer": 0.005}, "peer": {"solo": 0.005}}
    with pytest.raises(KeyboardInterrupt), _emulate.emulated_pcs(specs, latency, tmp_path) as world:
        world.start_relays({"solo": [PORT]})
        sleeper = world.spawn("solo", ["sleep", "600"], tmp_path / "sleep.log")
        assert _emulate.leftovers()
        raise KeyboardInterrupt
    assert _emulate.leftovers() == []
    assert sleeper.poll() is not None
