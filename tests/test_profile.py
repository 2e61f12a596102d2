"""Node measurement (compute, memory, links over real ZeroMQ sockets), profile files, `ravq plan`, and the
model profile per block."""

from __future__ import annotations

import asyncio
import gc
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
import zmq.asyncio

import tests.models_for_tests as skipnet
import tests.tasks_for_tests as mlp
from ravq.cli.plan import plan_main
from ravq.cli.profile import compute_confidence, profile_main
from ravq.config import ConfigError, Topology, load_plan, load_topology
from ravq.net.wire import Message, MsgType
from ravq.profile.blocks import profile_blocks
from ravq.profile.compute import (
    ComputeSample,
    measure_compute,
    measure_matmul_flops,
    measure_model_flops,
)
from ravq.profile.links import (
    Link,
    LinkGate,
    ProbeClient,
    ProbeConfig,
    measure_links,
    serve_probes,
)
from ravq.profile.messages import MessageConfig, measure_messages, measure_ring
from ravq.profile.stage_cost import StageCpu
from ravq.profile.store import Measurement, load_profile, load_profiles, save_profile
from ravq.tuning import usable_memory_bytes
from tests.conftest import free_port
from tests.virtual_time import now, run_virtual

GIB = 1 << 30


def write_topology(path: Path, nodes: list[dict[str, object]], task: str = "tests.tasks_for_tests") -> Path:
    ports = iter(range(27000, 28000, 2))
    listed = [{"pipeline_port": next(ports), "ring_port": next(ports) + 1000, **n} for n in nodes]
    path.write_text(yaml.safe_dump({"task": task, "training": {"micro_batch": 4, "sync_every": 5},
                                    "broker": {"pub_port": 26901, "router_port": 26902}, "nodes": listed}))
    return path


# --- compute and memory


def test_usable_memory_is_mem_available_less_headroom(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:         1000 kB\nMemAvailable:    8000000 kB\n")
    no_cgroup = str(tmp_path / "no-such-cgroup-file")
    assert usable_memory_bytes("cpu", str(meminfo), proc_cgroup=no_cgroup) == int(8_000_000 * 1024 * 0.9)
    meminfo.write_text("MemTotal:       16000000 kB\n")
    with pytest.raises(RuntimeError, match="MemAvailable"):
        usable_memory_bytes("cpu", str(meminfo))
    assert 0 < usable_memory_bytes() < 1 << 50


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_usable_memory_is_capped_by_the_memory_cgroup(tmp_path: Path, version: str) -> None:
    """An emulated or containerised PC: the cgroup's limit less its usage, when below MemAvailable."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:    8000000 kB\n")
    proc = tmp_path / "cgroup"
    if version == "v1":
        proc.write_text("5:cpu,cpuacct:/\n4:memory:/box/pc1\n0::/\n")
        group = tmp_path / "memory" / "box" / "pc1"
        group.mkdir(parents=True)
        limit, usage = group / "memory.limit_in_bytes", group / "memory.usage_in_bytes"
    else:
        proc.write_text("0::/box/pc1\n")
        group = tmp_path / "box" / "pc1"
        group.mkdir(parents=True)
        limit, usage = group / "memory.max", group / "memory.current"
    limit.write_text(str(512 << 20))
    usage.write_text(str(200 << 20))
    got = usable_memory_bytes("cpu", str(meminfo), cgroup_root=str(tmp_path), proc_cgroup=str(proc))
    assert got == int((312 << 20) * 0.9)
    limit.write_text("max\n" if version == "v2" else str(1 << 62))  # no limit: MemAvailable decides
    got = usable_memory_bytes("cpu", str(meminfo), cgroup_root=str(tmp_path), proc_cgroup=str(proc))
    assert got == int(8_000_000 * 1024 * 0.9)


def test_compute_is_measured_in_windows_and_says_how_steady_it_was() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # cpu_share counts CPU seconds: with torch's default threads it may pass 1
    try:
        sample = measure_compute(skipnet, 64, window_s=0.1, windows=3, warmup_s=0.05)
    finally:
        torch.set_num_threads(threads)
    assert len(sample.window_flops) == 3
    assert sample.flops == sorted(sample.window_flops)[1]  # the median window
    assert 0 < sample.cpu_share <= 1.2  # one thread (a little more: the measuring process's other threads)
    assert sample.spread == pytest.approx((max(sample.window_flops) - min(sample.window_flops)) / sample.flops)
    steady = Measurement(name="a", device="cpu", flops=1e9, matmul_flops=2e9, model_flops=1e9, memory_bytes=GIB,
                         flops_windows=[0.98e9, 1e9, 1.02e9], flops_spread=0.04)
    assert "median of 3 windows, which were within 4% of each other (steady)" in compute_confidence(steady)
    steady.cpu_share = 0.25
    assert compute_confidence(steady).endswith("; it got 0.25 CPU seconds per second")
    shaky = Measurement(name="a", device="cpu", flops=1e9, matmul_flops=2e9, model_flops=1e9, memory_bytes=GIB,
                        flops_windows=[0.6e9, 1.4e9], flops_spread=0.8)
    assert "unsteady" in compute_confidence(shaky)
    old = Measurement(name="a", device="cpu", flops=1e9, matmul_flops=2e9, model_flops=None, memory_bytes=GIB)
    assert "matmuls only" in compute_confidence(old)


def test_compute_measurements_are_plausible() -> None:
    matmul = measure_matmul_flops(seconds=0.2, size=256)
    assert 1e8 < matmul < 1e14
    model = measure_model_flops(skipnet, 64, seconds=0.2)
    assert 0 < model < matmul * 10


# --- links


def test_probes_measure_latency_and_bandwidth_on_loopback() -> None:
    """The probe protocol over real sockets completes and yields a link; how fast loopback is belongs to
    the benchmarks (the arithmetic is checked exactly on a simulated link, on a virtual clock, below)."""
    async def run() -> tuple[dict[str, Any], set[str]]:
        ctx = zmq.asyncio.Context()
        port = free_port()
        stop, finished = asyncio.Event(), set[str]()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(serve_probes(ctx, f"tcp://127.0.0.1:{port}", "b", stop=stop, finished=finished))
                try:
                    links = await measure_links(ctx, "a", {"b": f"tcp://127.0.0.1:{port}"}, wait_s=10,
                                                config=ProbeConfig(stream_s=0.1, repeats=2))
                    client = ProbeClient.connect(ctx, f"tcp://127.0.0.1:{port}", "a", "b", ProbeConfig())
                    try:
                        rate = await client.stream_rate(4 << 20)
                    finally:
                        client.close()
                finally:
                    stop.set()
        finally:
            ctx.destroy(linger=0)
        return {"link": links["b"], "rate": rate}, finished

    result, finished = asyncio.run(run())
    link = result["link"]
    assert finished == {"a"}                                   # the client said it was done
    assert 0 < link.latency_s < math.inf
    assert 0 < link.bandwidth_bytes_per_s < math.inf
    assert 0 < result["rate"] < math.inf


class _SimulatedLink:
    """A link that carries ``rate`` bytes/s with ``one_way_s`` each way, whose receiver is asleep when
    the first message lands and wakes ``late_s`` later (a PC throttled by its CPU quota).  On the
    running loop's clock: run it on a virtual one (``run_virtual``)."""

    def __init__(self, rate: float, one_way_s: float, late_s: float) -> None:
        self.rate, self.one_way_s, self.late_s = rate, one_way_s, late_s
        self.wire_free = 0.0
        self.acks: list[tuple[float, int]] = []

    async def send(self, msg: Message) -> None:
        now = asyncio.get_running_loop().time()
        nbytes = sum(t.numel() * t.element_size() for t in msg.tensors.values())
        self.wire_free = max(self.wire_free, now) + nbytes / self.rate
        landed = self.wire_free + self.one_way_s
        if not self.acks:
            landed += self.late_s
        acked = max([landed, *(t for t, _ in self.acks)]) + self.one_way_s
        self.acks.append((acked, msg.meta["seq"]))

    async def recv(self, timeout_s: float) -> Message:
        acked, seq = self.acks.pop(0)
        await asyncio.sleep(max(0.0, acked - asyncio.get_running_loop().time()))
        return Message(type=MsgType.PROBE, sender="b", meta={"ack": seq})

    def close(self) -> None:
        pass


@pytest.mark.parametrize("late_s", [0.0, 0.2])
def test_stream_rate_is_not_inflated_by_a_late_first_acknowledgement(late_s: float) -> None:
    """4 MiB at 8 MB/s: the last acknowledgement comes 4 MiB / rate + one round trip after the first
    send, however late the first one was, so the rate reads exactly the link's (timed from the first
    acknowledgement, 0.2 s late, it read about 2x the link; not less the round trip, 7% low)."""
    rate, one_way = 8e6, 0.02

    async def run() -> float:
        client = ProbeClient(_SimulatedLink(rate, one_way, late_s), "a", "b", ProbeConfig(), clock=now)
        return await client.stream_rate(4 << 20, 2 * one_way)

    assert run_virtual(run()) == pytest.approx(rate, rel=1e-9)


def test_a_link_is_measured_as_its_rate_and_half_its_round_trip() -> None:
    """``measure``: latency is half the round trip of small probes, bandwidth the median of streams
    sized to last ``stream_s`` at a first rough rate."""
    rate, one_way = 8e6, 0.02

    async def run() -> tuple[Link, float]:
        client = ProbeClient(_SimulatedLink(rate, one_way, 0.0), "a", "b", ProbeConfig(), clock=now)
        return await client.measure(), now()

    link, spent = run_virtual(run())
    assert link.latency_s == pytest.approx(one_way, rel=1e-9)
    assert link.bandwidth_bytes_per_s == pytest.approx(rate, rel=1e-9)
    # 5 pings, a 1 MiB rough stream, then 3 streams of 0.5 s: each stream + a round trip
    assert spent == pytest.approx(5 * 2 * one_way + (1 << 20) / rate + 2 * one_way
                                  + 3 * (ProbeConfig().stream_s + 2 * one_way), rel=1e-9)


def test_silent_peer_is_skipped_after_the_wait() -> None:
    async def run() -> dict[str, Link]:
        ctx = zmq.asyncio.Context()
        try:
            return await measure_links(ctx, "a", {"ghost": f"tcp://127.0.0.1:{free_port()}"}, wait_s=0.5,
                                       config=ProbeConfig())
        finally:
            ctx.destroy(linger=0)

    assert asyncio.run(asyncio.wait_for(run(), 10)) == {}


def test_link_gate_holds_one_measurement_at_a_time() -> None:
    """On a virtual clock (``tests.virtual_time``): leases lapse and holds give up at their exact times."""
    async def run() -> None:
        gate = LinkGate(lease_s=0.2, clock=now)
        assert gate.try_hold("from b") and gate.try_hold("from b")   # the holder may renew
        assert not gate.try_hold("from c") and gate.holder == "from b"
        assert not await gate.hold("to c", 0.05)                      # still held by b
        assert now() == pytest.approx(0.05)                           # gave up at its timeout
        waiter = asyncio.create_task(gate.hold("to c", 5.0))
        await asyncio.sleep(0.02)
        gate.release("from c")                                        # not the holder: no effect
        assert gate.holder == "from b" and not waiter.done()
        gate.release("from b")
        assert await waiter and gate.holder == "to c"
        assert now() == pytest.approx(0.07)                           # taken the moment b let go
        await asyncio.sleep(10.0)
        assert gate.holder == "to c"                                  # a local hold never lapses
        gate.release("to c")
        assert gate.try_hold("from d")                                # d's lease: 0.2 s from now
        await asyncio.sleep(0.15)
        gate.renew("from d")                                          # d's stream goes on: 0.2 s again
        await asyncio.sleep(0.15)
        assert gate.holder == "from d"
        await asyncio.sleep(0.05)                                     # d silent for its whole lease
        assert gate.holder is None and gate.try_hold("from e")
        start = now()                                                 # e goes silent too:
        assert await gate.hold("to f", 5.0)                           # its lease lapses while we wait
        assert 0.2 <= now() - start <= 0.5 + 1e-6                     # seen at the next look (0.5 s)

    run_virtual(run())


def test_concurrent_profiles_never_put_a_node_in_two_measurements(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three nodes measure each other at once, as ``ravq profile`` on three PCs does: every link is
    measured, and no node ever sends or receives two measurement streams at the same time."""
    names = ["a", "b", "c"]
    intervals: list[tuple[float, float, str, str]] = []
    measure = ProbeClient.measure

    async def recorded(self: ProbeClient) -> Link:
        start = asyncio.get_running_loop().time()
        try:
            return await measure(self)
        finally:
            intervals.append((start, asyncio.get_running_loop().time(), self.name, self.peer))

    monkeypatch.setattr(ProbeClient, "measure", recorded)
    config = ProbeConfig(stream_s=0.05, repeats=2, pings=2)

    async def run() -> dict[str, dict[str, Link]]:
        ctx = zmq.asyncio.Context()
        addrs = {n: f"tcp://127.0.0.1:{free_port()}" for n in names}
        gates = {n: LinkGate(lease_s=5.0) for n in names}
        stop = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as group:
                for n in names:
                    group.create_task(serve_probes(ctx, addrs[n], n, stop=stop, gate=gates[n]))
                try:
                    found = await asyncio.gather(*[
                        measure_links(ctx, n, {p: a for p, a in addrs.items() if p != n}, wait_s=10, config=config,
                                      gate=gates[n]) for n in names])
                finally:
                    stop.set()
        finally:
            ctx.destroy(linger=0)
        return dict(zip(names, found, strict=True))

    links = asyncio.run(asyncio.wait_for(run(), 60))
    assert {n: set(found) for n, found in links.items()} == {n: set(names) - {n} for n in names}
    assert len(intervals) == 6
    for i, (s1, e1, a1, b1) in enumerate(intervals):
        for s2, e2, a2, b2 in intervals[i + 1:]:
            if {a1, b1} & {a2, b2}:
                assert e1 <= s2 or e2 <= s1, f"{a1}->{b1} overlapped {a2}->{b2}"


# --- profile files and overrides


def test_profile_round_trip_and_overrides(tmp_path: Path) -> None:
    topo = load_topology(write_topology(tmp_path / "t.yaml", [
        {"name": "a"}, {"name": "b", "memory_bytes": 5 * GIB, "flops": 3e12, "bandwidth_bytes_per_s": 1e6},
        {"name": "c", "memory_bytes": GIB, "flops": 1e12, "bandwidth_bytes_per_s": 2e6}]))
    save_profile(Measurement(name="a", device="cpu", flops=1e11, matmul_flops=2e11, model_flops=1e11,
                             memory_bytes=7 * GIB, bandwidth_bytes_per_s={"b": 5e7, "c": 6e7},
                             latency_s={"b": 0.001, "c": 0.002}), tmp_path / "p")
    save_profile(Measurement(name="b", device="cpu", flops=1e11, matmul_flops=2e11, model_flops=None,
                             memory_bytes=7 * GIB, bandwidth_bytes_per_s={"a": 5e7}, latency_s={"a": 0.001},
                             message_s=[[1024, 0.002], [1 << 20, 0.01]], message_cpu_s=[[1024, 0.001],
                                                                                      [1 << 20, 0.005]],
                             ring_s=[4 << 20, 0.02], ring_cpu_s=[4 << 20, 0.01]),
                 tmp_path / "p")
    assert load_profile(tmp_path / "p" / "profile-a.json").bandwidth_bytes_per_s == {"b": 5e7, "c": 6e7}
    a, b, c = load_profiles(topo, tmp_path / "p")
    assert (a.flops, a.memory_bytes, a.bandwidth_bytes_per_s) == (1e11, 7 * GIB, {"b": 5e7, "c": 6e7})
    assert (b.flops, b.memory_bytes, b.bandwidth_bytes_per_s) == (3e12, 5 * GIB, {"a": 1e6, "c": 1e6})
    assert b.latency_s == {"a": 0.001}
    assert b.message_s == ((1024, 0.002), (1 << 20, 0.01)) and a.message_s == ()   # a: profiled before messages
    assert b.ring_s_per_byte == pytest.approx(0.02 / (4 << 20)) and a.ring_s_per_byte == 0.0
    assert (c.memory_bytes, c.bandwidth_bytes_per_s) == (GIB, {"a": 2e6, "b": 2e6})   # no file: overrides only
    (tmp_path / "p" / "profile-a.json").unlink()
    with pytest.raises(ConfigError, match="ravq profile"):
        load_profiles(topo, tmp_path / "p")
    (tmp_path / "p" / "profile-b.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a ravq profile"):
        load_profile(tmp_path / "p" / "profile-b.json")


def one_node_topology(tmp_path: Path, curve: bool, training: dict[str, object]) -> Topology:
    """A topology of node "a" alone with these training settings, its links under CURVE when ``curve``."""
    from ravq.net.security import keygen

    nodes: list[dict[str, object]] = [{"name": "a"}]
    if curve:
        nodes[0]["public_key"] = keygen("a", tmp_path / "keys")
    path = write_topology(tmp_path / "t.yaml", nodes)
    data = yaml.safe_load(path.read_text())
    data["training"].update(training)
    if curve:
        data["security"] = {"curve": True, "key_dir": str(tmp_path / "keys")}
        data["broker"]["public_key"] = keygen("broker", tmp_path / "keys")
    path.write_text(yaml.safe_dump(data))
    return load_topology(path)


@pytest.mark.parametrize("curve", [False, True], ids=["plaintext", "curve"])
@pytest.mark.parametrize("fmt", ["none", "int8"])
def test_messages_cost_cpu_time_that_grows_with_their_size(tmp_path: Path, curve: bool, fmt: str) -> None:
    topology = one_node_topology(tmp_path, curve, {"compress": {"pipeline": fmt}})
    costs = measure_messages(topology, "a",
                             MessageConfig(sizes=(4 << 20, 1 << 10), cpu_s=0.02, min_messages=4, window=2))
    assert [size for size, _ in costs] == [1 << 10, 4 << 20]
    (_, small), (_, large) = costs
    assert 0 < small < large < 1.0     # CPU seconds: packing, copying and (with CURVE) encrypting 4 MiB


@pytest.mark.parametrize("curve", [False, True], ids=["plaintext", "curve"])
@pytest.mark.parametrize("fmt", ["none", "int8"])
def test_an_averaging_round_costs_cpu_time_that_grows_with_the_segment(tmp_path: Path, curve: bool,
                                                                       fmt: str) -> None:
    # ring_chunk_bytes 1 MiB: the large segment crosses in several pieces
    topology = one_node_topology(tmp_path, curve, {"compress": {"ring": fmt}, "ring_chunk_bytes": 1 << 20})
    small = measure_ring(topology, "a", 64 << 10, cpu_s=0.02, min_rounds=3)
    large = measure_ring(topology, "a", 8 << 20, cpu_s=0.02, min_rounds=3)
    # a member quantizes, sums and moves its segment once: at least a memory pass over 8 MiB
    assert 0 < small < large < 2.0
    assert large > 1e-4


def test_profile_main_writes_the_node_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topo = write_topology(tmp_path / "t.yaml", [{"name": "solo"}])
    assert profile_main(str(topo), "solo", str(tmp_path / "out"), 1.0) == 0
    data = json.loads((tmp_path / "out" / "profile-solo.json").read_text())
    assert data["name"] == "solo" and data["flops"] > 0 and data["memory_bytes"] > 0
    assert data["bandwidth_bytes_per_s"] == {}
    sizes = [size for size, _ in data["message_s"]]
    assert sizes == sorted(sizes) and len(sizes) >= 2 and all(t > 0 for _, t in data["message_s"])
    # wall seconds at the compute's CPU share: CPU seconds over the share
    for (_, wall), (_, cpu) in zip(data["message_s"], data["message_cpu_s"]):
        assert wall == pytest.approx(cpu / data["cpu_share"])
    ring_bytes, ring_wall = data["ring_s"]
    assert ring_bytes >= 1 << 20 and data["ring_cpu_s"][0] == ring_bytes
    assert ring_wall == pytest.approx(data["ring_cpu_s"][1] / data["cpu_share"]) and ring_wall > 0
    # rounds as a node runs them: the whole model's bytes, timed (a failed measurement leaves it empty)
    avg_bytes, avg_wall = data["averaging_s"]
    assert data["averaging_cpu_s"][0] == avg_bytes > 0
    assert avg_wall == pytest.approx(data["averaging_cpu_s"][1] / data["cpu_share"]) and avg_wall >= 0
    assert data["loss_s"] == pytest.approx(data["loss_cpu_s"] / data["cpu_share"]) and data["loss_s"] > 0
    out = capsys.readouterr().out
    assert "wrote" in out and "pipeline messages" in out and "as a node runs it" in out and "loss stage:" in out
    assert profile_main(str(topo), "nobody", str(tmp_path / "out"), 1.0) == 2


def test_a_compute_window_holds_at_least_a_few_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a slow PC a step takes most of a second: every window runs ``window_steps`` steps at least,
    whatever ``window_s`` says (two-step windows were 9-20% apart on 0.14-core PCs)."""
    from ravq.profile import compute as profile

    calls = 0

    def step() -> None:
        nonlocal calls
        calls += 1

    assert profile._timed_steps(step, 0.0, 5)[0] == 5 and calls == 5
    seen: list[int] = []
    timed = profile._timed_steps
    monkeypatch.setattr(profile, "_timed_steps", lambda f, s, n=2: (seen.append(n), timed(f, s, n))[1])
    sample = profile.measure_compute(skipnet, 8, window_s=0.0, windows=3, warmup_s=0.0)
    assert seen == [2, profile.WINDOW_STEPS, profile.WINDOW_STEPS, profile.WINDOW_STEPS]  # warm-up, then windows
    assert profile.WINDOW_STEPS >= 4 and len(sample.window_flops) == 3


def test_links_are_measured_before_compute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node serves probes until every peer measured its link to it, so compute measured after the
    links starts on every PC at about the same moment: PCs sharing a host all compute then, as in
    training (measured first, the slowest PCs computed alone and read up to 15% fast)."""
    from ravq.profile import measure as profile

    order: list[str] = []

    async def links(*args: object, **kwargs: object) -> dict[str, Link]:
        order.append("links")
        return {"b": Link(bandwidth_bytes_per_s=1e8, latency_s=0.001)}

    def compute(*args: object, **kwargs: object) -> ComputeSample:
        order.append("compute")
        return ComputeSample(flops=1e10, window_flops=[1e10], spread=0.0, cpu_share=0.5)

    monkeypatch.setattr(profile, "profile_links", links)
    monkeypatch.setattr(profile, "measure_compute", compute)
    monkeypatch.setattr(profile, "measure_messages", lambda *a, **k: order.append("messages") or [[1024, 0.001]])
    monkeypatch.setattr(profile, "measure_ring", lambda *a, **k: order.append("ring") or 0.01)
    stage = StageCpu(pipeline_cpu_s=0.05, single_cpu_s=0.03, act_bytes=1024, grad_bytes=1024)
    monkeypatch.setattr(profile, "measure_stage_cpu", lambda *a, **k: order.append("stage") or stage)
    monkeypatch.setattr(profile, "measure_averaging_cpu", lambda *a, **k: order.append("averaging") or 0.004)
    free = iter(range(8 * GIB, 0, -GIB // 4))  # every later read finds less: what the measurements built
    read: list[int] = []
    monkeypatch.setattr(profile, "usable_memory_bytes",
                        lambda *a, **k: order.append("memory") or read.append(next(free)) or read[-1])
    topo = load_topology(write_topology(tmp_path / "t.yaml", [{"name": "a"}, {"name": "b"}]))
    m = profile.measure_node(topo, "a", wait_s=1.0)
    # memory last, after the model was built as a node builds its stage (the guards read it before)
    assert order[-1] == "memory" and m.memory_bytes == read[-1] == min(read)
    assert [o for o in order if o != "memory"] == ["links", "compute", "messages", "ring", "stage", "averaging"]
    assert m.averaging_cpu_s[1] == 0.004 and m.averaging_s[1] == pytest.approx(0.008)   # at half a core
    assert m.bandwidth_bytes_per_s == {"b": 1e8} and m.flops == 1e10 and m.message_s == [[1024, 0.002]]
    # per stage: (two stages 50 ms - one stage 30 ms - two messages of 1 ms) / 2, at half a core
    assert m.stage_cpu_s == pytest.approx(0.009) and m.stage_s == pytest.approx(0.018)


def test_working_set_is_what_the_measurement_took_at_its_peak() -> None:
    from ravq.profile.measure import working_set

    def allocate() -> float:
        gc.collect()                                       # as Python may collect while a measurement runs
        block = torch.ones(64 << 18)                       # 64 MiB of float32, touched
        return float(block[-1])

    class Cycle:
        pass

    garbage = Cycle()
    garbage.self, garbage.tensor = garbage, torch.ones(48 << 18)   # 48 MiB only a collection frees
    del garbage
    value, taken = working_set("cpu", allocate)
    assert value == 1.0 and taken >= 60 << 20
    _, nothing = working_set("cpu", lambda: None)
    assert nothing < 16 << 20


def test_two_stages_are_timed_at_a_micro_batch_that_fits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small-memory PC's profile was killed for memory timing two stages: the guard counted parameters
    alone, and charlm's activations are a hundred times its weights.  Where two training steps do not fit
    the stages run at a smaller micro-batch; not at all below one sample, or when the weights do not fit."""
    from ravq.profile import measure as profile

    stage = StageCpu(pipeline_cpu_s=0.05, single_cpu_s=0.03, act_bytes=1024, grad_bytes=1024)
    timed: list[int | None] = []
    monkeypatch.setattr(profile, "measure_stage_cpu", lambda t, n, task, config: timed.append(config.micro_batch)
                        or stage)
    monkeypatch.setattr(profile, "usable_memory_bytes", lambda *a, **k: 300 << 20)
    monkeypatch.setattr(profile, "model_param_bytes", lambda task: 2 << 20)
    topo = load_topology(write_topology(tmp_path / "t.yaml", [{"name": "a"}, {"name": "b"}]))
    micro_batch = topo.training.micro_batch
    assert micro_batch >= 4
    assert profile._stage_cpu(topo, "a", mlp, None, step_bytes=140 << 20) is stage     # two steps fit
    assert profile._stage_cpu(topo, "a", mlp, None, step_bytes=300 << 20) is stage     # at 0.8 x half
    assert profile._stage_cpu(topo, "a", mlp, None, step_bytes=micro_batch * (300 << 20)) is None  # < 1 sample
    monkeypatch.setattr(profile, "model_param_bytes", lambda task: 40 << 20)       # 160 MiB > half of 300
    assert profile._stage_cpu(topo, "a", mlp, None, step_bytes=0) is None
    assert timed == [None, int(0.8 * micro_batch / 2)]


def test_plan_main_writes_a_loadable_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes = [{"name": n, "memory_bytes": GIB, "flops": f, "bandwidth_bytes_per_s": 1e8}
             for n, f in (("a", 1e10), ("b", 2e10), ("c", 4e10))]
    topo = write_topology(tmp_path / "t.yaml", nodes)
    assert plan_main(str(topo), str(tmp_path / "none"), str(tmp_path / "plan.yaml")) == 0
    out = capsys.readouterr().out
    assert "predicted" in out and "samples/s" in out
    plan = load_plan(tmp_path / "plan.yaml")
    assert plan.predicted_samples_per_s and plan.predicted_samples_per_s > 0
    assert {n for c in plan.clusters for n in c.nodes} <= {"a", "b", "c"}

    fixed = write_topology(tmp_path / "fixed.yaml", [{**n, "cluster": 0} for n in nodes])
    assert plan_main(str(fixed), str(tmp_path / "none"), str(tmp_path / "fixed-plan.yaml")) == 0
    plan = load_plan(tmp_path / "fixed-plan.yaml")
    assert [c.nodes for c in plan.clusters] == [["a", "b", "c"]] and len(plan.clusters[0].cuts) == 2

    tiny = write_topology(tmp_path / "tiny.yaml", [{**n, "memory_bytes": 16} for n in nodes])
    assert plan_main(str(tiny), str(tmp_path / "none"), str(tmp_path / "x.yaml")) == 1
    assert "missing" in capsys.readouterr().out


# --- the model profile


def test_blocks_of_a_model_with_skip_connections() -> None:
    blocks = profile_blocks(skipnet, 4, max_inflight=3)
    assert [b.name for b in blocks] == ["l1", "l2", "l3", "l4", "head"]
    assert [b.param_bytes for b in blocks] == [288, 288, 288, 288, 108]      # (8x8 + 8) floats; head 8x3 + 3
    # l1: 4x8 -> 8 linear, 2*4*8*8 FLOPs forward; backward only for the weight (the model input needs none)
    assert (blocks[0].fwd_flops, blocks[0].bwd_flops) == (512, 512)
    assert (blocks[1].fwd_flops, blocks[1].bwd_flops) == (512, 1024)
    # after l1: its output a (read by l2, l3 and the head) and model input y (read by l2) cross the cut
    assert blocks[0].act_bytes_out == 2 * 4 * 8 * 4
    assert blocks[-1].act_bytes_out == 0
    for b in blocks:   # parameters + gradients + SGD momentum, and 3 in-flight stashes
        assert b.memory_bytes == 3 * b.param_bytes + 3 * b.inflight_bytes
        assert b.inflight_bytes > b.param_bytes                                   # a weight copy and activations
    adam = profile_blocks(skipnet, 4, max_inflight=1, optimizer_state_factor=2.0)
    assert all(b.memory_bytes == 4 * b.param_bytes + b.inflight_bytes for b in adam)


def test_blocks_scale_with_the_micro_batch() -> None:
    small, large = profile_blocks(mlp, 2), profile_blocks(mlp, 8)
    assert [b.name for b in small] == ["0", "1", "2", "3", "4"]
    for s, big in zip(small, large):
        assert big.fwd_flops == 4 * s.fwd_flops and big.act_bytes_out == 4 * s.act_bytes_out
        assert big.param_bytes == s.param_bytes
    assert sum(b.param_bytes for b in small) == 4 * sum(p.numel() for p in mlp.build_model().parameters())
    assert torch.get_default_dtype() == torch.float32
