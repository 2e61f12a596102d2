"""ravq.codec.compress: round-trip error bounds per format, error feedback, the compressed wire frames and the
pipeline's compressed links (in-process harness)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson
import pytest
import torch

from ravq.codec import compress
from ravq.codec.compress import ErrorFeedback, Format, Packed, error_bound, pack, unpack
from ravq.net.wire import DecodeLimits, Message, MsgType, WireError, decode, encode
from tests import models_for_tests as skipnet
from tests.pipeline_harness import make_workers, merged_state, run_workers

FORMATS = [Format.BF16, Format.FP16, Format.INT8]


def sample(numel: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * scale
    x[:: max(1, numel // 7)] *= 50  # outliers: int8's error follows its block's largest value
    return x


# -------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("numel", [2, 63, 64, 65, 128, 1000, 4097])
@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e3])
def test_round_trip_within_the_format_bound(fmt: Format, numel: int, scale: float) -> None:
    x = sample(numel, numel, scale).reshape(-1, 1) if numel % 2 else sample(numel, numel, scale)
    if fmt is Format.FP16 and x.abs().max() > torch.finfo(torch.float16).max:
        assert pack(x, fmt) is x  # beyond fp16's range: sent as it is
        return
    packed = pack(x, fmt)
    assert isinstance(packed, Packed) and packed.shape == x.shape and packed.dtype == torch.float32
    y = unpack(packed)
    assert y.shape == x.shape and y.dtype == x.dtype
    err = (y - x).abs()
    assert (err <= error_bound(x, fmt)).all(), float((err - error_bound(x, fmt)).max())
    assert packed.wire_bytes < packed.logical_bytes
    if fmt is Format.INT8:
        assert packed.wire_bytes == numel + 4 * compress.num_blocks(numel, compress.DEFAULT_BLOCK)


@pytest.mark.parametrize("block", [64, 100, 256])
def test_int8_bound_is_half_a_step_of_each_block(block: int) -> None:
    x = sample(3 * block + 5, block)
    y = unpack(pack(x, Format.INT8, block))
    for lo in range(0, x.numel(), block):
        part = slice(lo, lo + block)
        step = float(x[part].abs().max()) / 127
        assert float((y[part] - x[part]).abs().max()) <= step / 2 * (1 + 1e-5)
    assert unpack(pack(-x, Format.INT8, block)).equal(-y), "symmetric: -x packs to -pack(x)"


def test_relative_precision_of_the_casts() -> None:
    x = sample(10_000, 3)
    for fmt, bits in ((Format.BF16, 8), (Format.FP16, 11)):
        rel = ((unpack(pack(x, fmt)) - x).abs() / x.abs()).max()
        assert 2.0 ** -(bits + 2) < rel <= 2.0 ** -bits


@pytest.mark.parametrize("block", [63, 257, 0])
def test_block_size_is_checked(block: int) -> None:
    with pytest.raises(ValueError, match="int8_block"):
        compress.check_block(block)


@pytest.mark.parametrize("t", [
    torch.arange(10), torch.ones(4, dtype=torch.bool), torch.zeros(3, dtype=torch.uint8), torch.empty(0),
], ids=["int64", "bool", "uint8", "empty"])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_integer_bool_and_empty_tensors_are_never_packed(t: torch.Tensor, fmt: Format) -> None:
    assert pack(t, fmt) is t


def test_int8_packs_only_what_it_shrinks() -> None:
    one, two = torch.ones(1), torch.ones(2)
    assert pack(one, Format.INT8) is one and isinstance(pack(two, Format.INT8), Packed)
    assert isinstance(pack(torch.ones(1), Format.BF16), Packed)


def test_casts_only_narrow() -> None:
    half = torch.randn(8).half()
    assert pack(half, Format.FP16) is half and pack(half, Format.BF16) is half
    assert isinstance(pack(half, Format.INT8), Packed)
    assert unpack(pack(half, Format.INT8)).dtype == torch.float16
    assert unpack(pack(torch.randn(4, dtype=torch.float64), Format.BF16)).dtype == torch.float64


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_go_uncompressed(fmt: Format, bad: float) -> None:
    x = torch.randn(300)
    x[200] = bad
    assert pack(x, fmt) is x


def test_fp16_overflow_goes_uncompressed() -> None:
    x = torch.tensor([1.0, 1e6])
    assert pack(x, Format.FP16) is x
    assert isinstance(pack(x, Format.BF16), Packed)


def test_zero_blocks_restore_to_zero() -> None:
    x = torch.zeros(300)
    x[290] = 1.0
    packed = pack(x, Format.INT8)
    assert isinstance(packed, Packed) and packed.scales is not None and float(packed.scales[0]) == 0.0
    assert torch.equal(unpack(packed)[:256], torch.zeros(256))


# ------------------------------------------------------------------------------ error feedback


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_error_feedback_sends_the_sum_of_the_inputs(fmt: Format) -> None:
    """Over rounds, what a node sent plus what it still holds is what it was given: nothing is lost."""
    feedback = ErrorFeedback(fmt)
    gen = torch.Generator().manual_seed(1)
    inputs_sum, sent_sum, naive_sum = torch.zeros(1000, dtype=torch.float64), torch.zeros(1000, dtype=torch.float64), \
        torch.zeros(1000, dtype=torch.float64)
    for _ in range(50):
        x = torch.randn(1000, generator=gen) * 1e-2 + 0.3  # a bias that plain rounding would keep losing
        inputs_sum += x.double()
        sent_sum += unpack(feedback.pack(x)).double()
        naive_sum += unpack(pack(x, fmt)).double()
    assert feedback.residual is not None
    held = sent_sum + feedback.residual.double()
    torch.testing.assert_close(held, inputs_sum, rtol=0, atol=50 * 2e-7)  # float32 rounding, 50 rounds
    # the residual stays one round's worth: the sum sent is within one compression of the inputs'
    assert ((sent_sum - inputs_sum).abs() <= 2 * error_bound(torch.full((1000,), 0.4), fmt).double()).all()
    assert (naive_sum - inputs_sum).abs().max() > (sent_sum - inputs_sum).abs().max()


# ------------------------------------------------------------------------------------ the wire


def packed_message(**packed: Packed | torch.Tensor) -> Message:
    tensors = {n: t for n, t in packed.items() if isinstance(t, torch.Tensor)}
    return Message(type=MsgType.FORWARD, sender="s0", micro_batch=(0, 1), sent_at=1.0, tensors=tensors,
                   packed={n: p for n, p in packed.items() if isinstance(p, Packed)})


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_packed_tensors_round_trip_over_the_wire(fmt: Format) -> None:
    x = sample(1000, 5).reshape(10, 100)
    packed = pack(x, fmt)
    assert isinstance(packed, Packed)
    msg = packed_message(a=packed, ids=torch.arange(3))
    frames = [bytes(f) for f in encode(msg)]
    assert sum(len(f) for f in frames[1:]) == packed.wire_bytes + 24
    got = decode(frames)
    assert list(got.tensors) == ["ids"] and list(got.packed) == ["a"]
    assert torch.equal(unpack(got.packed["a"]), unpack(packed))
    again = decode([bytes(f) for f in encode(got)])
    assert torch.equal(unpack(again.packed["a"]), unpack(packed))


def frames_of(x: torch.Tensor, fmt: Format = Format.INT8, block: int = 64) -> tuple[dict[str, Any], list[bytes]]:
    packed = pack(x, fmt, block)
    assert isinstance(packed, Packed)
    frames = [bytes(f) for f in encode(packed_message(x=packed))]
    return orjson.loads(frames[0]), frames[1:]


def with_descriptors(header: dict[str, Any], descriptors: list[dict[str, Any]], frames: list[bytes]) -> list[bytes]:
    return [orjson.dumps({**header, "tensors": descriptors}), *frames]


def _scales(values: list[float]) -> bytes:
    return np.array(values, dtype=np.float32).tobytes()


def malformed() -> list[tuple[str, list[bytes], str]]:
    x = torch.randn(130)
    h, (q, s) = frames_of(x)
    q8, scale = h["tensors"]
    bf = frames_of(x, Format.BF16)
    cast = bf[0]["tensors"][0]
    good = with_descriptors(h, [q8, scale], [q, s])
    assert decode(good).packed["x"].shape == (130,)  # the base of every case is valid
    return [
        ("kind-unknown", with_descriptors(h, [{**q8, "kind": "q4"}, scale], [q, s]), "bad_codec"),
        ("kind-not-string", with_descriptors(h, [{**q8, "kind": [1]}, scale], [q, s]), "bad_codec"),
        ("q8-without-scale", with_descriptors(h, [q8], [q]), "bad_codec"),
        ("scale-alone", with_descriptors(h, [scale], [s]), "bad_codec"),
        ("scale-before-q8", with_descriptors(h, [scale, q8], [s, q]), "bad_codec"),
        ("q8-then-plain", with_descriptors(h, [q8, {"name": "x", "dtype": "float32", "shape": [3]}], [q, s]),
         "bad_codec"),
        ("scale-other-name", with_descriptors(h, [q8, {**scale, "name": "y"}], [q, s]), "bad_codec"),
        ("scale-count-short", with_descriptors(h, [q8, {**scale, "shape": [2]}], [q, s[:8]]), "bad_codec"),
        ("scale-count-long", with_descriptors(h, [q8, {**scale, "shape": [4]}], [q, s + bytes(4)]), "bad_codec"),
        ("scale-float16", with_descriptors(h, [q8, {**scale, "dtype": "float16", "shape": [6]}], [q, s]),
         "bad_codec"),
        ("scale-nan", with_descriptors(h, [q8, scale], [q, _scales([0.1, float("nan"), 0.1])]), "bad_scale"),
        ("scale-inf", with_descriptors(h, [q8, scale], [q, _scales([0.1, 0.1, float("inf")])]), "bad_scale"),
        ("scale-negative", with_descriptors(h, [q8, scale], [q, _scales([-0.1, 0.1, 0.1])]), "bad_scale"),
        ("q8-payload-float32", with_descriptors(h, [{**q8, "dtype": "float32"}, scale], [q * 4, s]), "bad_codec"),
        ("q8-block-small", with_descriptors(h, [{**q8, "block": 32}, {**scale, "shape": [5]}],
                                            [q, _scales([0.1] * 5)]), "bad_codec"),
        ("q8-block-large", with_descriptors(h, [{**q8, "block": 512}, {**scale, "shape": [1]}],
                                            [q, _scales([0.1])]), "bad_codec"),
        ("q8-block-float", with_descriptors(h, [{**q8, "block": 64.0}, scale], [q, s]), "bad_codec"),
        ("q8-block-missing", with_descriptors(h, [{k: v for k, v in q8.items() if k != "block"}, scale], [q, s]),
         "bad_codec"),
        ("q8-to-int64", with_descriptors(h, [{**q8, "to": "int64"}, scale], [q, s]), "bad_codec"),
        ("q8-to-missing", with_descriptors(h, [{k: v for k, v in q8.items() if k != "to"}, scale], [q, s]),
         "bad_codec"),
        ("q8-payload-short", with_descriptors(h, [q8, scale], [q[:-1], s]), "frame_size"),
        ("q8-duplicate-name", with_descriptors(h, [q8, scale, q8, scale], [q, s, q, s]), "bad_descriptor"),
        ("q8-and-plain-same-name", with_descriptors(h, [{"name": "x", "dtype": "int8", "shape": [130]}, q8, scale],
                                                    [q, q, s]), "bad_descriptor"),
        ("cast-of-float32", with_descriptors(bf[0], [{**cast, "dtype": "float32", "shape": [65]}], bf[1]),
         "bad_codec"),
        ("cast-of-int8", with_descriptors(bf[0], [{**cast, "dtype": "int8", "shape": [260]}], bf[1]), "bad_codec"),
        ("cast-to-bool", with_descriptors(bf[0], [{**cast, "to": "bool"}], bf[1]), "bad_codec"),
        ("cast-to-float16", with_descriptors(bf[0], [{**cast, "to": "float16"}], bf[1]), "bad_codec"),
        ("scale-overflows-float32", with_descriptors(h, [q8, scale], [q, _scales([0.1, 3e36, 0.1])]), "bad_scale"),
        ("scale-overflows-float16", with_descriptors(h, [{**q8, "to": "float16"}, scale],
                                                     [q, _scales([0.1, 600.0, 0.1])]), "bad_scale"),
    ]


MALFORMED = malformed()


@pytest.mark.parametrize(("frames", "reason"), [(f, r) for _, f, r in MALFORMED], ids=[n for n, _, _ in MALFORMED])
def test_malformed_compressed_frames_are_rejected(frames: list[bytes], reason: str) -> None:
    from tests.test_wire import KNOWN_REASONS

    assert reason in KNOWN_REASONS
    with pytest.raises(WireError) as caught:
        decode(frames)
    assert caught.value.reason == reason, str(caught.value)


def test_what_a_q8_frame_restores_to_is_within_the_tensor_limit() -> None:
    h, frames = frames_of(torch.randn(130))
    with pytest.raises(WireError) as caught:
        decode([orjson.dumps(h), *frames], DecodeLimits(max_tensor_bytes=519))  # 130 bytes, 520 restored
    assert caught.value.reason == "tensor_too_large"
    assert decode([orjson.dumps(h), *frames], DecodeLimits(max_tensor_bytes=520)).packed["x"].shape == (130,)


def test_a_malformed_compressed_frame_is_dropped_and_counted() -> None:
    """Through a real socket pair: the bad message is counted in ravq_bad_messages_total, the next
    good one arrives."""
    import asyncio

    import zmq
    import zmq.asyncio

    from ravq.metrics import Metrics
    from ravq.net.options import SocketOptions
    from ravq.net.transport import Inbox

    async def main() -> None:
        ctx, metrics = zmq.asyncio.Context(), Metrics("t")
        inbox = Inbox.bind(ctx, "tcp://127.0.0.1:*", "pipeline", metrics, DecodeLimits(), SocketOptions())
        addr = inbox.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        raw = ctx.socket(zmq.DEALER)
        raw.connect(addr)
        try:
            h, (q, _) = frames_of(torch.randn(130))
            await raw.send_multipart([orjson.dumps(h), q, _scales([0.1, float("nan"), 0.1])])
            good = pack(torch.randn(130), Format.INT8)
            assert isinstance(good, Packed)
            await raw.send_multipart([bytes(f) for f in encode(packed_message(x=good))])
            _, msg = await asyncio.wait_for(inbox.recv(), 10)
            assert torch.equal(unpack(msg.packed["x"]), unpack(good))
            assert metrics.bad_messages.labels("pipeline", "bad_scale")._value.get() == 1
            wire = metrics.payload_wire_bytes.labels("pipeline", "received", "int8").value
            logical = metrics.payload_logical_bytes.labels("pipeline", "received", "int8").value
            assert (wire, logical) == (130 + 2 * 4, 130 * 4)  # 2 blocks of 128
        finally:
            raw.close(0)
            inbox.sock.setsockopt(zmq.LINGER, 0)
            inbox.close()
            ctx.term()

    asyncio.run(main())


# ------------------------------------------------------------------------------------ pipeline


@pytest.mark.parametrize("fmt", [Format.BF16, Format.FP16, Format.INT8], ids=str)
def test_pipeline_sends_activations_and_gradients_compressed(fmt: Format) -> None:
    """A synchronous 3-stage pipeline with compressed links trains close to the uncompressed one; every
    activation and gradient went packed, model inputs and targets never did."""
    sent: list[tuple[str, str, Any]] = []
    plain = make_workers(skipnet, 3, steps=20, max_inflight=1)
    run_workers(plain)
    workers = make_workers(skipnet, 3, steps=20, max_inflight=1, compress=fmt)
    for w in workers:
        pack_original = w.passes.pack

        def logged(tensors: dict[str, torch.Tensor], pack_original: Any = pack_original) -> dict[str, Any]:
            out = pack_original(tensors)
            sent.extend((name, type(v).__name__, v.dtype) for name, v in out.items())
            return out
        w.passes.pack = logged  # type: ignore[method-assign]
    run_workers(workers)
    assert all(w.stats.backwards == 20 for w in workers)
    names = {name[0] for name, _, _ in sent}
    assert names == {"o", "g"} and all(kind == "Packed" for _, kind, _ in sent), sent[:5]
    want, got = merged_state(plain), merged_state(workers)
    drift = max(float((got[n] - want[n]).abs().max()) for n in want)
    assert 0 < drift < {Format.FP16: 1e-3, Format.BF16: 1e-2, Format.INT8: 3e-2}[fmt], drift
    losses, plain_losses = workers[-1].stats.loss_history, plain[-1].stats.loss_history
    assert all(math.isfinite(v) for v in losses)
    assert abs(losses[-1] - plain_losses[-1]) < 0.05 * plain_losses[-1]


def test_stage_refuses_packed_targets_and_wrong_restored_shapes() -> None:
    workers = make_workers(skipnet, 2, steps=1, max_inflight=1)
    last = workers[1]
    expected = last.state.expected_fwd[0]
    parts: dict[str, Any] = {}
    for name, (shape, dtype) in expected.items():
        parts[name] = torch.zeros(shape, dtype=dtype) if not dtype.is_floating_point else torch.randn(shape)
    float_targets = [n for n in parts if n.startswith("t") and parts[n].is_floating_point()]
    activations = [n for n in parts if n.startswith("o")]
    assert activations
    wrong = dict(parts)
    a = activations[0]
    bigger = pack(torch.randn(parts[a].numel() + 1), Format.INT8)
    wrong[a] = bigger
    assert last.deliver("fwd", (0, 0), 0, wrong) == "bad_tensor_shape"
    for t in float_targets:
        packed_target = dict(parts)
        packed_target[t] = pack(parts[t], Format.BF16)
        assert last.deliver("fwd", (0, 0), 0, packed_target) == "unexpected_tensors"
    good = dict(parts)
    good[a] = pack(parts[a], Format.INT8)
    assert last.deliver("fwd", (0, 0), 0, good) is None



@pytest.mark.parametrize(("compress", "message"), [
    ({"pipeline": "int4"}, "training.compress.pipeline"),
    ({"ring": "fp16"}, "training.compress.ring"),
    ({"int8_block": 32}, "training.compress.int8_block"),
    ({"int8_block": 512}, "training.compress.int8_block"),
    ({"rings": "int8"}, "did you mean 'ring'"),
])
def test_compress_config_errors_name_the_field(compress: dict[str, Any], message: str) -> None:
    from ravq.config import ConfigError, parse_topology

    topo = {"task": "tests.models_for_tests", "training": {"compress": compress},
            "broker": {"pub_port": 5000, "router_port": 5001},
            "nodes": [{"name": "a", "pipeline_port": 5002, "ring_port": 5003}]}
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        parse_topology(topo)
    topo["training"] = {"compress": {"pipeline": "bf16", "ring": "none", "int8_block": 64}}
    assert parse_topology(topo).training.compress.pipeline == "bf16"


def test_wire_knows_the_codec_limits_without_importing_torch() -> None:
    """ravq.net.wire checks compressed frames before torch is imported (it loads lazily): its copies of the
    codec's limits must be the codec's."""
    from ravq.net import wire

    assert wire.Q8_BLOCKS == (compress.MIN_BLOCK, compress.MAX_BLOCK)
    assert wire._TO == {str(d).removeprefix("torch.") for d in compress.FLOAT_DTYPES}
    for name, limit in wire._MAX_SCALE.items():
        dtype = getattr(torch, name)
        largest = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)
        assert abs(limit * 127 / largest - 1) < 2e-6, name
