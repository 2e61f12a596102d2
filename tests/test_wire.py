"""ravq.net.wire: round trips of every message type and dtype, zero-copy both ways, and a table of
malformed messages each rejected with its WireError reason (the label of ravq_bad_messages_total)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest
import torch
import zmq

from ravq.net import wire
from ravq.net.wire import (
    DTYPES,
    PROTOCOL_VERSION,
    REQUIRED_META,
    DecodeLimits,
    Message,
    MsgType,
    WireError,
    decode,
    encode,
)

# Every reason decode may give; a new one is a new metric label and should be added on purpose.
KNOWN_REASONS = {
    "no_frames", "too_many_frames", "header_too_large", "bad_json", "bad_version", "bad_type",
    "missing_field", "bad_field", "bad_descriptor", "bad_dtype", "bad_shape", "tensor_too_large",
    "frame_count", "frame_size", "bad_codec", "bad_scale",
}
_SAMPLE_BY_KIND: dict[type, Any] = {int: 3, str: "s", float: 0.5, bool: True, dict: {}, list: []}


def required_meta(mtype: MsgType) -> dict[str, Any]:
    """Values of the right JSON type for the meta fields ``mtype`` requires."""
    meta = {}
    for key, kind in REQUIRED_META.get(mtype, {}).items():
        meta[key] = _SAMPLE_BY_KIND[kind[0] if isinstance(kind, tuple) else kind]
    return meta


def make_message(mtype: MsgType = MsgType.FORWARD, /, **tensors: torch.Tensor) -> Message:
    needs_mb = mtype in (MsgType.FORWARD, MsgType.BACKWARD, MsgType.TIED)
    return Message(type=mtype, sender="stage-0", micro_batch=(1, 42) if needs_mb else None, version=5,
                   sent_at=1_700_000_000.25, meta={**required_meta(mtype), "note": "hi"}, tensors=tensors)


def over_the_wire(msg: Message) -> list[bytes]:
    """The frames as a receiver gets them: plain bytes, nothing shared with the sender's tensors."""
    return [bytes(f) for f in encode(msg)]


def raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes, bit for bit (so NaNs and -0.0 compare exactly)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def address(buf: Any) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def assert_same(got: Message, want: Message) -> None:
    assert got.type is want.type
    assert (got.sender, got.micro_batch, got.version, got.sent_at, got.meta) == (
        want.sender, want.micro_batch, want.version, want.sent_at, want.meta)
    assert list(got.tensors) == list(want.tensors)  # names, in order
    for name, t in want.tensors.items():
        g = got.tensors[name]
        assert (g.dtype, g.shape) == (t.dtype, t.shape), name
        assert raw_bytes(g) == raw_bytes(t), name
    assert list(got.packed) == list(want.packed)
    for name, p in want.packed.items():
        q = got.packed[name]
        assert (q.format, q.dtype, q.shape, q.block) == (p.format, p.dtype, p.shape, p.block), name
        assert raw_bytes(q.data) == raw_bytes(p.data), name
        assert (q.scales is None) == (p.scales is None), name
        if p.scales is not None and q.scales is not None:
            assert raw_bytes(q.scales) == raw_bytes(p.scales), name


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)


# ------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("mtype", list(MsgType), ids=str)
def test_every_message_type_round_trips(mtype: MsgType) -> None:
    msg = make_message(mtype, x=torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert_same(decode(over_the_wire(msg)), msg)


@pytest.mark.parametrize("mtype", list(MsgType), ids=str)
def test_every_message_type_round_trips_without_tensors(mtype: MsgType) -> None:
    msg = make_message(mtype)
    frames = over_the_wire(msg)
    assert len(frames) == 1
    assert_same(decode(frames), msg)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_every_dtype_round_trips(dtype_name: str) -> None:
    t = random_tensor(DTYPES[dtype_name], (3, 5), seed=len(dtype_name))
    msg = make_message(x=t)
    header = orjson.loads(over_the_wire(msg)[0])
    assert header["tensors"] == [{"name": "x", "dtype": dtype_name, "shape": [3, 5]}]
    assert_same(decode(over_the_wire(msg)), msg)


@pytest.mark.parametrize("t", [
    torch.empty(0), torch.empty(3, 0, 2), torch.empty(0, 0, dtype=torch.int64), torch.empty(0, dtype=torch.bool),
    torch.tensor(2.5), torch.tensor(-7, dtype=torch.int64), torch.tensor(True), torch.tensor(1.5).bfloat16(),
], ids=lambda t: f"{str(t.dtype)[6:]}{list(t.shape)}")
def test_empty_and_zero_dim_tensors_round_trip(t: torch.Tensor) -> None:
    msg = make_message(x=t)
    frames = over_the_wire(msg)
    assert len(frames[1]) == t.numel() * t.element_size()
    assert_same(decode(frames), msg)


_BASE = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5)


@pytest.mark.parametrize("make", [
    lambda: _BASE.transpose(0, 2),
    lambda: _BASE[:, ::2, 1:4],
    lambda: _BASE.to(torch.bfloat16).permute(2, 0, 1),
    lambda: _BASE.to(torch.int16)[:, 2, :],
    lambda: torch.arange(3.0).reshape(3, 1).expand(3, 4),  # stride 0
    lambda: torch.ones(10, dtype=torch.bool)[::3],
], ids=["transpose", "slice-step", "permute-bf16", "narrow-int16", "expand", "bool-step"])
def test_non_contiguous_tensors_round_trip(make: Callable[[], torch.Tensor]) -> None:
    t = make()
    assert not t.is_contiguous()
    got = decode(over_the_wire(make_message(x=t))).tensors["x"]
    assert got.is_contiguous() and got.shape == t.shape and got.dtype == t.dtype
    assert torch.equal(got, t)


def test_several_tensors_keep_names_and_order() -> None:
    tensors = {"z": torch.ones(2), "a": torch.zeros(3, dtype=torch.int8), "m": torch.tensor(False)}
    msg = make_message(**tensors)
    assert_same(decode(over_the_wire(msg)), msg)


def test_tensor_that_requires_grad_is_sent_detached() -> None:
    t = torch.randn(4, requires_grad=True) * 2
    got = decode(over_the_wire(make_message(x=t))).tensors["x"]
    assert not got.requires_grad and torch.equal(got, t.detach())


def test_unset_send_time_is_stamped_at_encode() -> None:
    msg = make_message()
    msg.sent_at = 0.0
    before = time.time()
    got = decode(over_the_wire(msg))
    assert before <= got.sent_at <= time.time()


def test_decodes_zmq_frames() -> None:
    msg = make_message(x=torch.randn(100), y=torch.tensor([1, 2], dtype=torch.int32))
    assert_same(decode([zmq.Frame(bytes(f)) for f in encode(msg)]), msg)


def test_decoded_tensors_are_usable_by_torch() -> None:
    # Frames start at arbitrary offsets in ZeroMQ's buffers: an odd address must still work.
    t = torch.randn(33, dtype=torch.float64)
    header, payload = encode(make_message(x=t))
    shifted = memoryview(bytearray(b"\0" + bytes(payload)))[1:]
    got = decode([bytes(header), shifted]).tensors["x"]
    assert got.data_ptr() % 8 != 0
    assert torch.equal(got * 2, t * 2) and got.sum().item() == pytest.approx(t.sum().item())


# -------------------------------------------------------------------------------------- zero copy


def test_decoded_tensor_shares_memory_with_the_frame() -> None:
    t = torch.arange(8, dtype=torch.float32)
    header, payload = over_the_wire(make_message(x=t))
    frame = bytearray(payload)
    got = decode([header, frame]).tensors["x"]
    assert got.data_ptr() == address(frame)
    frame[0:4] = np.float32(99.0).tobytes()
    assert got[0].item() == 99.0  # a write to the frame is seen by the tensor: no copy was made


def test_decoded_tensor_shares_memory_with_a_zmq_frame_and_keeps_it_alive() -> None:
    t = torch.randn(1 << 16)
    header, payload = over_the_wire(make_message(x=t))
    frame = zmq.Frame(payload)
    got = decode([header, frame]).tensors["x"]
    assert got.data_ptr() == address(frame.buffer)
    del frame, payload
    gc.collect()
    assert torch.equal(got, t)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(1000),
    lambda: torch.randn(10, 100)[3:],  # contiguous, at a storage offset
    lambda: torch.randn(7, 3).to(torch.bfloat16),
    lambda: torch.ones(5, dtype=torch.bool),
    lambda: torch.tensor(4.0),
], ids=["float32", "offset", "bfloat16", "bool", "0-d"])
def test_encode_of_contiguous_cpu_tensor_is_a_view_of_its_storage(make: Callable[[], torch.Tensor]) -> None:
    t = make()
    frame = encode(make_message(x=t))[1]
    assert isinstance(frame, memoryview)
    assert frame.format == "B" and frame.ndim == 1 and len(frame) == t.numel() * t.element_size()
    assert address(frame) == t.data_ptr()
    before = bytes(frame)
    flat = t.view(-1)
    flat[0] = (flat[0] == 0).to(t.dtype)  # a later write shows through: the frame is the storage itself
    assert bytes(frame) != before and bytes(frame) == raw_bytes(t)


def test_encode_of_non_contiguous_tensor_copies_once() -> None:
    t = torch.randn(6, 4).t()
    frame = encode(make_message(x=t))[1]
    assert address(frame) != t.data_ptr() and bytes(frame) == raw_bytes(t)


# ------------------------------------------------------------------------------ malformed messages

DROP = object()
FLOAT32_2x3 = bytes(24)


def header(**changes: Any) -> bytes:
    """A valid FORWARD header with one float32 [2, 3] tensor "x", with ``changes`` applied."""
    h: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": "fwd", "sender": "stage-0", "mb": [0, 3],
                         "ver": 1, "ts": 1.5, "meta": {},
                         "tensors": [{"name": "x", "dtype": "float32", "shape": [2, 3]}]}
    for key, value in changes.items():
        if value is DROP:
            del h[key]
        else:
            h[key] = value
    return orjson.dumps(h)


def descriptor(**changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"name": "x", "dtype": "float32", "shape": [2, 3]}
    for key, value in changes.items():
        if value is DROP:
            del d[key]
        else:
            d[key] = value
    return d


def one_tensor(frame: bytes = FLOAT32_2x3, **changes: Any) -> list[bytes]:
    """A message whose single descriptor has ``changes``."""
    return [header(tensors=[descriptor(**changes)]), frame]


def meta_cases() -> list[tuple[str, list[bytes], str]]:
    cases = []
    for mtype, fields in REQUIRED_META.items():
        for key in fields:
            good = required_meta(mtype)
            missing = {k: v for k, v in good.items() if k != key}
            cases += [
                (f"{mtype}-meta-{key}-missing", [header(type=str(mtype), meta=missing, tensors=[])],
                 "missing_field"),
                (f"{mtype}-meta-{key}-str", [header(type=str(mtype), meta={**good, key: "7"}, tensors=[])],
                 "bad_field"),
                (f"{mtype}-meta-{key}-bool", [header(type=str(mtype), meta={**good, key: True}, tensors=[])],
                 "bad_field"),
            ]
    return cases


MALFORMED: list[tuple[str, list[bytes], str]] = [
    ("no-frames", [], "no_frames"),
    # the header's JSON
    ("not-json", [b"{not json"], "bad_json"),
    ("empty-header", [b""], "bad_json"),
    ("invalid-utf8", [b'{"v": "\xff"}'], "bad_json"),
    ("too-deeply-nested", [b"[" * 2000], "bad_json"),
    ("header-is-list", [b"[1, 2]"], "bad_json"),
    ("header-is-string", [b'"fwd"'], "bad_json"),
    ("header-is-null", [b"null"], "bad_json"),
    # protocol version
    ("version-2", [header(v=2), FLOAT32_2x3], "bad_version"),
    ("version-missing", [header(v=DROP), FLOAT32_2x3], "bad_version"),
    ("version-true", [header(v=True), FLOAT32_2x3], "bad_version"),
    ("version-float", [header(v=1.0), FLOAT32_2x3], "bad_version"),
    ("version-string", [header(v="1"), FLOAT32_2x3], "bad_version"),
    # message type
    ("type-unknown", [header(type="nope"), FLOAT32_2x3], "bad_type"),
    ("type-wrong-case", [header(type="FWD"), FLOAT32_2x3], "bad_type"),
    ("type-missing", [header(type=DROP), FLOAT32_2x3], "missing_field"),
    ("type-int", [header(type=5), FLOAT32_2x3], "bad_field"),
    # sender
    ("sender-missing", [header(sender=DROP), FLOAT32_2x3], "missing_field"),
    ("sender-int", [header(sender=5), FLOAT32_2x3], "bad_field"),
    ("sender-null", [header(sender=None), FLOAT32_2x3], "bad_field"),
    ("sender-empty", [header(sender=""), FLOAT32_2x3], "bad_field"),
    ("sender-too-long", [header(sender="n" * 129), FLOAT32_2x3], "bad_field"),
    # micro-batch id
    ("mb-missing", [header(mb=DROP), FLOAT32_2x3], "missing_field"),
    ("mb-null-on-forward", [header(mb=None), FLOAT32_2x3], "missing_field"),
    ("mb-null-on-backward", [header(type="bwd", mb=None), FLOAT32_2x3], "missing_field"),
    ("mb-one-item", [header(mb=[0]), FLOAT32_2x3], "bad_field"),
    ("mb-three-items", [header(mb=[0, 1, 2]), FLOAT32_2x3], "bad_field"),
    ("mb-negative", [header(mb=[0, -1]), FLOAT32_2x3], "bad_field"),
    ("mb-float", [header(mb=[0, 1.0]), FLOAT32_2x3], "bad_field"),
    ("mb-bool", [header(mb=[True, 1]), FLOAT32_2x3], "bad_field"),
    ("mb-string", [header(mb="0,1"), FLOAT32_2x3], "bad_field"),
    # version, timestamp, meta, descriptor list
    ("ver-missing", [header(ver=DROP), FLOAT32_2x3], "missing_field"),
    ("ver-string", [header(ver="1"), FLOAT32_2x3], "bad_field"),
    ("ver-bool", [header(ver=True), FLOAT32_2x3], "bad_field"),
    ("ver-float", [header(ver=1.5), FLOAT32_2x3], "bad_field"),
    ("ts-missing", [header(ts=DROP), FLOAT32_2x3], "missing_field"),
    ("ts-string", [header(ts="now"), FLOAT32_2x3], "bad_field"),
    ("ts-bool", [header(ts=True), FLOAT32_2x3], "bad_field"),
    ("ts-null", [header(ts=None), FLOAT32_2x3], "bad_field"),
    ("meta-missing", [header(meta=DROP), FLOAT32_2x3], "missing_field"),
    ("meta-list", [header(meta=[]), FLOAT32_2x3], "bad_field"),
    ("tensors-missing", [header(tensors=DROP), FLOAT32_2x3], "missing_field"),
    ("tensors-object", [header(tensors={}), FLOAT32_2x3], "bad_field"),
    # one descriptor
    ("descriptor-not-object", [header(tensors=[5]), FLOAT32_2x3], "bad_descriptor"),
    ("name-missing", one_tensor(name=DROP), "bad_descriptor"),
    ("name-int", one_tensor(name=5), "bad_descriptor"),
    ("name-too-long", one_tensor(name="n" * 257), "bad_descriptor"),
    ("dtype-missing", one_tensor(dtype=DROP), "bad_dtype"),
    ("dtype-float128", one_tensor(dtype="float128"), "bad_dtype"),
    ("dtype-complex64", one_tensor(dtype="complex64"), "bad_dtype"),
    ("dtype-torch-name", one_tensor(dtype="torch.float32"), "bad_dtype"),
    ("dtype-int", one_tensor(dtype=5), "bad_dtype"),
    ("dtype-list", one_tensor(dtype=["float32"]), "bad_dtype"),
    ("dtype-object", one_tensor(dtype={"a": 1}), "bad_dtype"),
    ("shape-missing", one_tensor(shape=DROP), "bad_shape"),
    ("shape-string", one_tensor(shape="2,3"), "bad_shape"),
    ("shape-negative", one_tensor(shape=[-2, -3]), "bad_shape"),
    ("shape-float", one_tensor(shape=[2.0, 3]), "bad_shape"),
    ("shape-bool", one_tensor(shape=[True, 6]), "bad_shape"),
    ("shape-17-dims", one_tensor(frame=bytes(4), shape=[1] * 17), "bad_shape"),
    ("shape-empty-but-huge", one_tensor(frame=b"", shape=[0, 1 << 40, 1 << 40]), "bad_shape"),
    ("shape-empty-beyond-int64", one_tensor(frame=b"", shape=[(1 << 64) - 1, 0]), "bad_shape"),
    # frames against descriptors
    ("frame-missing", [header()], "frame_count"),
    ("frame-extra", [header(), FLOAT32_2x3, FLOAT32_2x3], "frame_count"),
    ("frame-without-descriptor", [header(tensors=[]), FLOAT32_2x3], "frame_count"),
    ("frame-short", [header(), bytes(23)], "frame_size"),
    ("frame-long", [header(), bytes(25)], "frame_size"),
    ("frame-empty", [header(), b""], "frame_size"),
    ("frames-swapped", [header(tensors=[descriptor(), descriptor(name="y", shape=[1])]), bytes(4),
                        FLOAT32_2x3], "frame_size"),
    ("duplicate-names", [header(tensors=[descriptor(), descriptor()]), FLOAT32_2x3, FLOAT32_2x3],
     "bad_descriptor"),
    # limits (defaults)
    ("too-many-frames", [header(tensors=[descriptor(name=str(i), shape=[0]) for i in range(1024)]),
                         *[b""] * 1024], "too_many_frames"),
    ("header-too-large", [header(meta={"pad": "x" * (64 << 10)}), FLOAT32_2x3], "header_too_large"),
    ("tensor-too-large", one_tensor(frame=b"", shape=[(1 << 28) + 1]), "tensor_too_large"),
    ("tensor-beyond-int64", one_tensor(frame=b"", shape=[1 << 40, 1 << 40]), "tensor_too_large"),
    *meta_cases(),
]


@pytest.mark.parametrize(("frames", "reason"), [(f, r) for _, f, r in MALFORMED],
                         ids=[name for name, _, _ in MALFORMED])
def test_malformed_message_is_rejected_with_its_reason(frames: list[bytes], reason: str) -> None:
    assert reason in KNOWN_REASONS
    with pytest.raises(WireError) as caught:
        decode(frames)
    assert caught.value.reason == reason, str(caught.value)


def test_the_valid_base_of_the_malformed_table_decodes() -> None:
    # Otherwise a case could pass for a reason other than the one it is about.
    msg = decode([header(), FLOAT32_2x3])
    assert msg.type is MsgType.FORWARD and msg.tensors["x"].shape == (2, 3)
    assert decode(one_tensor()).tensors["x"].dtype == torch.float32
    for mtype in REQUIRED_META:
        assert decode([header(type=str(mtype), meta=required_meta(mtype), tensors=[])]).type is mtype


@pytest.mark.parametrize(("limits", "frames", "reason"), [
    (DecodeLimits(max_frames=3), [header(tensors=[descriptor(name=str(i)) for i in range(3)]),
                                  *[FLOAT32_2x3] * 3], "too_many_frames"),
    (DecodeLimits(max_header_bytes=100), [header(meta={"pad": "x" * 100}), FLOAT32_2x3], "header_too_large"),
    (DecodeLimits(max_tensor_bytes=23), [header(), FLOAT32_2x3], "tensor_too_large"),
], ids=["max_frames", "max_header_bytes", "max_tensor_bytes"])
def test_limits_are_configurable(limits: DecodeLimits, frames: list[bytes], reason: str) -> None:
    with pytest.raises(WireError) as caught:
        decode(frames, limits)
    assert caught.value.reason == reason
    decode(frames)  # the same frames pass the default limits


def test_limits_are_inclusive() -> None:
    frames = [header(), FLOAT32_2x3]
    decode(frames, DecodeLimits(max_frames=2, max_header_bytes=len(frames[0]), max_tensor_bytes=24))


def test_no_tensor_is_made_before_the_whole_message_is_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    real = wire._tensor

    def recording(buf: memoryview, dtype: str, shape: list[int]) -> torch.Tensor:
        made.append(dtype)
        return real(buf, dtype, shape)

    monkeypatch.setattr(wire, "_tensor", recording)
    frames = [header(tensors=[descriptor(), descriptor(name="y", dtype="bogus")]), FLOAT32_2x3, bytes(4)]
    with pytest.raises(WireError, match="bad_dtype"):
        decode(frames)
    assert made == []
    decode([header(), FLOAT32_2x3])
    assert made == ["float32"]


def test_wire_error_is_a_value_error_with_a_short_reason() -> None:
    with pytest.raises(ValueError) as caught:
        decode([header(sender=7), FLOAT32_2x3])
    assert isinstance(caught.value, WireError)
    assert caught.value.reason == "bad_field" and "sender" in str(caught.value)
