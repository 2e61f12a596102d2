"""Compressed ring all-reduce (ravq.average.ring_compression) without sockets: C members as coroutines in one
event loop, every piece encoded and decoded by ravq.net.wire as a node's ring socket would."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch

from ravq.average.mailbox import Mailbox, RingAborted, received_piece
from ravq.average.ring_compression import RingCompression, compressed_ring_allreduce
from ravq.average.rounds import average_segments
from ravq.average.segments import plan_segments
from ravq.codec.compress import Format, Packed, error_bound
from ravq.net.wire import decode, encode
from ravq.node.ring_port import ring_chunk

FORMATS = [Format.BF16, Format.INT8]


class WireNet:
    """Ring links whose pieces cross ravq.net.wire; counts the tensor bytes each member puts on the wire."""

    def __init__(self, names: Sequence[str]) -> None:
        self.boxes = {n: Mailbox() for n in names}
        self.wire_bytes = {n: 0 for n in names}
        self.base_override: dict[str, int] = {}

    def link(self, me: str) -> WireLink:
        return WireLink(self, me)


class WireLink:
    def __init__(self, net: WireNet, me: str) -> None:
        self.net, self.me = net, me

    async def send(self, peer: str, meta: dict[str, int], tensor: torch.Tensor | Packed) -> None:
        if self.me in self.net.base_override:
            meta = {**meta, "base": self.net.base_override[self.me]}
        frames = [bytes(f) for f in encode(ring_chunk(self.me, meta, tensor))]
        self.net.wire_bytes[self.me] += sum(len(f) for f in frames[1:])
        await asyncio.sleep(0)
        msg = decode(frames)
        piece = received_piece(msg.meta, msg.tensors, msg.packed)
        assert piece is not None
        self.net.boxes[peer].deliver(self.me, msg.meta, piece)

    async def send_abort(self, peer: str, ring_id: int, round_id: int, reason: str) -> None:
        self.net.boxes[peer].deliver_abort(self.me, ring_id, round_id, reason)


def names(c: int) -> list[str]:
    return [f"m{i}" for i in range(c)]


def compressed_average(flats: Sequence[torch.Tensor], fmt: Format, piece_bytes: int = 4 << 20, block: int = 128,
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor], WireNet]:
    """(results, residuals, net) of one compressed round over a WireNet."""
    members = names(len(flats))
    net = WireNet(members)

    async def main() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return await asyncio.gather(*[
            compressed_ring_allreduce(flats[i], ring_id=0, round_id=0, members=members, me=m, link=net.link(m),
                                      mailbox=net.boxes[m], piece_bytes=piece_bytes, timeout_s=5.0, fmt=fmt,
                                      block=block)
            for i, m in enumerate(members)])
    outcomes = asyncio.run(main())
    return [o[0] for o in outcomes], [o[1] for o in outcomes], net


def ring_bound(flats: Sequence[torch.Tensor], fmt: Format, block: int = 128) -> torch.Tensor:
    """How far a compressed round's average may be from the exact one, per element.

    A chunk is compressed C times on its way (by each member once: C-1 partial sums and the full sum),
    each time a value no larger than the sum of the members' magnitudes; the errors add up in the sum
    and are divided by C with it.  Plus float32 rounding of the adds."""
    magnitude = torch.stack([f.abs() for f in flats]).sum(0)
    if fmt is Format.INT8:  # a piece's blocks start where the piece does: any block around an element
        magnitude = torch.nn.functional.max_pool1d(magnitude.view(1, 1, -1), 2 * block + 1, stride=1,
                                                   padding=block).view(-1)
        return magnitude / 254 * (1 + 1e-5) + magnitude * 1e-6 + 1e-30
    return error_bound(magnitude, fmt, block) + magnitude * 1e-6 + 1e-30


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("ring_size", [2, 3, 4, 5])
@pytest.mark.parametrize("piece_bytes", [256, 4 << 20])
def test_within_the_format_bound_and_identical_on_every_member(fmt: Format, ring_size: int, piece_bytes: int) -> None:
    gen = torch.Generator().manual_seed(ring_size)
    for numel in (1, 2, 3, 7, 200, 1001, 5000):
        flats = [torch.randn(numel, generator=gen) * (i + 1) for i in range(ring_size)]
        originals = [f.clone() for f in flats]
        results, residuals, _ = compressed_average(flats, fmt, piece_bytes)
        exact = torch.stack(originals).double().sum(0) / ring_size
        for i, result in enumerate(results):
            assert torch.equal(result, results[0]), "members must end with identical bits"
            assert torch.equal(flats[i], originals[i]), "input must not be modified"
            assert ((result.double() - exact).abs() <= ring_bound(originals, fmt).double()).all()
        # what the ring summed is the inputs less what each member's compressions kept back
        summed = results[0].double() * ring_size + torch.stack(residuals).double().sum(0)
        torch.testing.assert_close(summed, exact * ring_size, rtol=0, atol=2e-6 * float(exact.abs().max() + 1))


@pytest.mark.parametrize(("fmt", "ratio"), [(Format.BF16, 0.5), (Format.INT8, (1 + 4 / 128) / 4)], ids=str)
def test_bytes_on_the_wire_shrink_by_the_format(fmt: Format, ratio: float) -> None:
    numel, size = 128 * 3000, 4
    flats = [torch.randn(numel) for _ in range(size)]
    _, _, net = compressed_average(flats, fmt, piece_bytes=128 * 4 * 500)
    uncompressed = 4 * 2 * (size - 1) * numel / size
    for sent in net.wire_bytes.values():
        assert sent == pytest.approx(uncompressed * ratio, rel=1e-3)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_error_feedback_over_rounds_loses_nothing(fmt: Format) -> None:
    """Each member adds its last round's residual to its next input: over K rounds the sum of the C
    averages times C is the sum of every input, less only the last round's residuals."""
    size, numel, rounds = 3, 999, 12
    members = names(size)
    gen = torch.Generator().manual_seed(9)
    net = WireNet(members)
    residuals = [torch.zeros(numel) for _ in members]
    inputs_sum = torch.zeros(numel, dtype=torch.float64)
    results_sum = torch.zeros(numel, dtype=torch.float64)
    plain_sum = torch.zeros(numel, dtype=torch.float64)

    async def main() -> None:
        nonlocal inputs_sum, results_sum
        for k in range(rounds):
            inputs = [torch.randn(numel, generator=gen) * 0.01 + 0.1 for _ in members]
            inputs_sum += torch.stack(inputs).double().sum(0)
            outcomes = await asyncio.gather(*[
                compressed_ring_allreduce(inputs[i] + residuals[i], ring_id=0, round_id=k, members=members, me=m,
                                          link=net.link(m), mailbox=net.boxes[m], piece_bytes=1024, timeout_s=5.0,
                                          fmt=fmt) for i, m in enumerate(members)])
            for i, (_, residual) in enumerate(outcomes):
                residuals[i] = residual
            results_sum += outcomes[0][0].double() * size
            rounds_inputs.append(inputs)

    rounds_inputs: list[list[torch.Tensor]] = []
    asyncio.run(main())
    for inputs in rounds_inputs:  # the same rounds without feedback
        plain_sum += compressed_average(inputs, fmt, piece_bytes=1024)[0][0].double() * size
    held = torch.stack(residuals).double().sum(0)
    torch.testing.assert_close(results_sum + held, inputs_sum, rtol=0, atol=rounds * size * 1e-6)
    assert (results_sum - inputs_sum).abs().max() < (plain_sum - inputs_sum).abs().max()


def segment_state_run(compression: list[RingCompression], flats: Sequence[torch.Tensor], round_id: int,
                      net: WireNet) -> list[torch.Tensor]:
    members = names(len(flats))
    segs = plan_segments(["w"], [flats[0].numel()], [{"w": m} for m in members])

    async def main() -> list[torch.Tensor]:
        results = await asyncio.gather(*[
            average_segments({0: flats[i]}, segs, me=m, round_id=round_id, link=net.link(m), mailbox=net.boxes[m],
                             piece_bytes=4096, timeout_s=2.0, compression=compression[i])
            for i, m in enumerate(members)])
        return [r.averaged.get(0, torch.empty(0)) for r in results]
    return asyncio.run(main())


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_anchor_makes_later_rounds_nearly_exact(fmt: Format) -> None:
    """Weights change little between rounds: averaged as their difference from the previous result (the
    same bits on every member), the error shrinks with that difference, not with the weights."""
    size, numel = 3, 5000
    members = names(size)
    net = WireNet(members)
    compression = [RingCompression(fmt) for _ in members]
    common = torch.randn(numel)  # every cluster starts from the same weights
    weights = [common.clone() for _ in members]
    errors = []
    for k in range(4):
        weights = [w + 1e-3 * torch.randn(numel) for w in weights]  # a step of training on each
        results = segment_state_run(compression, weights, k, net)
        assert all(torch.equal(r, results[0]) for r in results)
        errors.append(float((results[0] - torch.stack(weights).mean(0)).abs().max()))
        weights = [results[0].clone() for _ in members]  # each applies the average
    assert errors[-1] < errors[0] / 20, errors


def test_a_member_with_another_anchor_aborts_the_round_and_all_start_again() -> None:
    size, numel = 3, 600
    members = names(size)
    net = WireNet(members)
    compression = [RingCompression(Format.INT8) for _ in members]
    weights = [torch.randn(numel) for _ in members]
    segment_state_run(compression, weights, 0, net)
    assert all(c.states[next(iter(c.states))].base == 0 for c in compression)
    net.base_override["m1"] = 7  # m1 claims an anchor nobody else has
    results = segment_state_run(compression, weights, 1, net)
    assert all(r.numel() == 0 for r in results), "the round must abort on every member"
    assert all(c.states[next(iter(c.states))].anchor is None for c in compression)
    del net.base_override["m1"]
    results = segment_state_run(compression, weights, 2, net)
    exact = torch.stack(weights).mean(0)
    assert all(torch.equal(r, results[0]) for r in results)
    # absolute values again, and round 0's residuals come back in: within two rounds' bound
    assert ((results[0] - exact).abs() <= 2 * ring_bound(weights, Format.INT8)).all()


def test_a_plain_piece_in_a_compressed_round_aborts_it() -> None:
    members = names(2)
    net = WireNet(members)
    box = net.boxes["m1"]

    async def main() -> None:
        async def bad_peer() -> None:
            await asyncio.sleep(0.01)
            box.deliver("m0", {"ring": 0, "round": 0, "step": 0, "piece": 0}, torch.zeros(5))
        async with asyncio.TaskGroup() as tg:
            tg.create_task(bad_peer())
            with pytest.raises(RingAborted, match="bad_piece"):
                await compressed_ring_allreduce(torch.randn(10), ring_id=0, round_id=0, members=members, me="m1",
                                                link=net.link("m1"), mailbox=box, piece_bytes=1 << 20, timeout_s=2.0,
                                                fmt=Format.INT8)
    asyncio.run(main())


def test_ring_compression_config_is_checked() -> None:
    with pytest.raises(ValueError, match="compress.ring"):
        RingCompression(Format.FP16)
    with pytest.raises(ValueError, match="int8_block"):
        RingCompression(Format.INT8, block=300)


def test_optimizer_state_that_was_non_negative_stays_so() -> None:
    """A compressed average of Adam's second moments may land a hair below zero; they are clamped back
    (only optimizer state that was non-negative in the snapshot; weights and first moments stay)."""
    from ravq.average.correction import keep_non_negative_state as _keep_non_negative_state
    from ravq.average.rounds import RoundResult
    from ravq.average.segments import Segment

    named = {"w": torch.tensor([-1.0, 2.0]), "w::exp_avg": torch.tensor([-1e-9, 1.0]),
             "w::exp_avg_sq": torch.tensor([-1e-9, 3.0])}
    seg = Segment(ring_id=0, names=("w", "w::exp_avg", "w::exp_avg_sq"), numel=6, ring=("a", "b"))
    snapshots = {0: torch.tensor([-1.0, 2.0, -0.5, 1.0, 0.0, 3.0])}
    _keep_non_negative_state(named, [seg], snapshots, RoundResult(averaged={0: torch.zeros(6)}))
    assert named["w::exp_avg_sq"].tolist() == [0.0, 3.0]
    assert named["w::exp_avg"][0] == -1e-9 and named["w"][0] == -1.0
