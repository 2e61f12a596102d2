"""Fault test: a training node flooded with malformed messages on every socket trains on unharmed."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import orjson
import pytest
import torch
import zmq

from tests import sgd_task
from tests.pipeline_harness import train_one_process
from tests.swarm import Swarm, export, local_topology

pytestmark = [pytest.mark.multiprocess, pytest.mark.fault]
FLOOD = 10_000


def _header(**over: object) -> bytes:
    h = {"v": 1, "type": "fwd", "sender": "c0s0", "mb": [0, 5], "ver": 0, "ts": 0.0, "meta": {},
         "tensors": [{"name": "o0", "dtype": "float32", "shape": [4, 8]}]}
    h.update(over)
    return orjson.dumps(h)


def malformed(rng: random.Random) -> list[bytes]:
    """One malformed multipart message; every kind is refused before torch sees it."""
    good = bytes(4 * 8 * 4)
    kinds = [
        lambda: [rng.randbytes(rng.randint(0, 300))],
        lambda: [b"{not json", good],
        lambda: [_header(), good, good],                                          # frame count
        lambda: [_header(), good[:-4]],                                           # frame size
        lambda: [_header(tensors=[{"name": "o0", "dtype": "object", "shape": [4, 8]}]), good],
        lambda: [_header(tensors=[{"name": "o0", "dtype": "float32", "shape": [2**40, 2**40]}]), good],
        lambda: [_header(v=True), good],
        lambda: [_header(type="ring_chunk", meta={"ring": "x"}), good],             # bad required meta
        lambda: [_header(tensors=[{"name": "o9", "dtype": "float32", "shape": [4, 8]}]), good],  # wrong name
        lambda: [_header(tensors=[{"name": "o0", "dtype": "float32", "shape": [8, 4, 1]}]), good],  # wrong shape
        lambda: [_header(sender="intruder"), good],                               # not a pipeline peer
        lambda: [_header()[: rng.randint(1, 40)], good],                          # truncated header
        lambda: [_header(mb=[-1, 2]), good],
    ]
    return rng.choice(kinds)()


def flood(endpoint: str, seed: int) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, -1)  # deliver everything, however long the node takes to start
    sock.connect(endpoint)
    rng = random.Random(seed)
    for _ in range(FLOOD):
        sock.send_multipart(malformed(rng))
    sock.close()


def test_flooded_node_trains_on_and_ends_with_unflooded_weights(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    training = {"steps": 400, "micro_batch": 4, "max_inflight": 1, "sync_every": 1, "overlap_averaging": False,
                "checkpoint_dir": str(ckpt)}
    topo = local_topology("tests.sgd_task", [2, 2], training)
    victim = next(n for n in topo["nodes"] if n["name"] == "c0s1")
    targets = [f"tcp://127.0.0.1:{victim['pipeline_port']}", f"tcp://127.0.0.1:{victim['ring_port']}",
               f"tcp://127.0.0.1:{topo['broker']['router_port']}"]
    swarm = Swarm(tmp_path, topo)
    try:
        floods = [threading.Thread(target=flood, args=(ep, i)) for i, ep in enumerate(targets)]
        for t in floods:
            t.start()
        codes = swarm.wait()
        for t in floods:
            t.join(60)
        assert all(c == 0 for c in codes.values()), {n: swarm.log(n) for n, c in codes.items() if c}
        assert swarm.broker.poll() is None, "the broker died under the flood"
    finally:
        swarm.close()
    summary = swarm.summary("c0s1")
    assert summary["backwards"] == 400
    # every malformed message on the pipeline and ring sockets was dropped and counted
    assert summary["bad_messages"] >= 2 * FLOOD, summary["bad_messages"]
    want = train_one_process(sgd_task, steps=400, micro_batch=4, shards=2)
    out = tmp_path / "c0.safetensors"
    got = export(ckpt, 0, out)  # what `ravq export` writes (cluster 0)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)
