"""ring_allreduce against the reference: torch.distributed.all_reduce(SUM) / C on gloo.

One spawn of four processes serves C = 2, 3 and 4 through gloo subgroups (starting torch in a process
costs seconds on two cores).  Every rank draws its tensors from a seed the test can repeat, so the test
process recomputes the same inputs and averages them with ring_allreduce over the in-memory ring.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Any

import pytest
import torch

from tests.test_allreduce import ring_average

WORLD = 4
RING_SIZES = (2, 3, 4)
SIZES = (0, 1, 2, 3, 5, 17, 1000, 65537)  # uneven segments, several with fewer elements than C


def inputs(ring_size: int, numel: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1_000_003 * ring_size + 7 * numel + rank)
    return torch.randn(numel, generator=gen)


def _worker(rank: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        for ring_size in RING_SIZES:
            group = dist.new_group(list(range(ring_size)))  # every rank must take part in new_group
            if rank >= ring_size:
                continue
            for numel in SIZES:
                t = inputs(ring_size, numel, rank)
                if numel:
                    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
                    t /= ring_size
                results.put((ring_size, numel, rank, t.numpy().tobytes()))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def gloo_results() -> dict[tuple[int, int, int], torch.Tensor]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, results), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    expected = sum(c for c in RING_SIZES) * len(SIZES)
    out: dict[tuple[int, int, int], torch.Tensor] = {}
    try:
        for _ in range(expected):
            ring_size, numel, rank, data = results.get(timeout=60)
            out[ring_size, numel, rank] = torch.frombuffer(bytearray(data), dtype=torch.float32) if data \
                else torch.empty(0)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("ring_size", RING_SIZES)
@pytest.mark.parametrize("piece_bytes", [8, 4 << 20])
def test_matches_gloo(gloo_results: dict[tuple[int, int, int], torch.Tensor], ring_size: int,
                      piece_bytes: int) -> None:
    for numel in SIZES:
        # tiny pieces only where they stay affordable: at most ~64 pieces per chunk
        ring = ring_average([inputs(ring_size, numel, r) for r in range(ring_size)],
                            piece_bytes=max(piece_bytes, 4 * numel // 64))
        for rank in range(ring_size):
            gloo = gloo_results[ring_size, numel, rank]
            assert gloo.numel() == numel
            if numel == 0:
                assert ring[rank].numel() == 0
                continue
            # Both sum float32 left to right in some ring order and divide once; for C = 2 the order
            # cannot matter, beyond that summands differ in order and only rounding may differ.  The
            # atol covers results that cancel to near zero (inputs are N(0, 1), errors ~1e-7).
            if ring_size == 2:
                assert torch.equal(ring[rank], gloo)
            else:
                torch.testing.assert_close(ring[rank], gloo, rtol=1e-6, atol=1e-6)
            assert not torch.equal(ring[rank], inputs(ring_size, numel, rank))


@pytest.mark.multiprocess
@pytest.mark.parametrize("ring_size", RING_SIZES)
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_compressed_ring_matches_gloo_within_the_format_bound(
        gloo_results: dict[tuple[int, int, int], torch.Tensor], ring_size: int, fmt: str) -> None:
    """ravq.average.ring_compression against gloo's float32 average: within the format's bound, same bits on
    every member (the all-gather restores the same bytes everywhere)."""
    from ravq.codec.compress import Format
    from tests.test_ring_compression import compressed_average, ring_bound

    for numel in SIZES[1:]:
        flats = [inputs(ring_size, numel, r) for r in range(ring_size)]
        results, _, _ = compressed_average(flats, Format(fmt), piece_bytes=max(256, 4 * numel // 16))
        bound = ring_bound(flats, Format(fmt))
        for rank in range(ring_size):
            gloo = gloo_results[ring_size, numel, rank]
            assert torch.equal(results[rank], results[0])
            # gloo's own float32 rounding is within the bound's rounding allowance
            assert ((results[rank] - gloo).abs() <= bound).all(), float(((results[rank] - gloo).abs() - bound).max())
            if numel >= 1000:
                assert not torch.equal(results[rank], gloo), "compressed: not the exact average"
