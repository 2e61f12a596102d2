"""Message encoding: one orjson header frame, then one raw frame per tensor.

Nothing here unpickles or evaluates anything.  ``decode`` treats every frame as hostile: it checks
the JSON, every field's type, the dtype against an allowlist, the frame count and each frame's
length before a single tensor is made, and raises ``WireError`` with a short ``reason`` (used as a
metric label) otherwise.  Tensor frames are sent without a copy (a memoryview over the tensor's
storage) and received without a copy (``torch.frombuffer`` over the frame).

Compressed tensors (``ravq.codec.compress.Packed``, in ``Message.packed``) are frames of their own kinds,
named in the descriptor's ``kind``: ``cast`` (a bf16/fp16 frame standing for a wider float tensor,
``to`` naming it), ``q8`` (int8 values of a float tensor, ``to`` and ``block`` as sent) always followed
by its ``q8_scale`` frame (one float32 scale per block).  They are validated like every frame and
more: kinds, ``to`` and ``block`` from allowlists, a q8 frame's scale frame present and of exactly its
block count, every scale finite and not negative.  A frame without ``kind`` is a plain tensor.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import orjson

if TYPE_CHECKING:
    import torch

    from ravq.codec.compress import Packed

PROTOCOL_VERSION = 1


class MsgType(enum.StrEnum):
    # pipeline links
    FORWARD = "fwd"          # activations (+ model inputs, + targets for the last stage)
    BACKWARD = "bwd"         # gradients w.r.t. a stage's inputs, to their producer
    TIED = "tied"            # a tied weight's gradient or averaging delta, between the stages holding it
    # broker (clone pattern) and node control
    REGISTER = "register"    # node -> broker: I am up
    HEARTBEAT = "heartbeat"  # node -> broker: alive, with live statistics in meta
    SNAPSHOT_REQ = "snapshot_req"
    SNAPSHOT = "snapshot"    # broker -> node: its state in parts, with its topics' sequence numbers
    UPDATE = "update"        # broker PUB: keyed changes (or a tick) with their topic's sequence number
    STATUS_REQ = "status_req"
    STATUS = "status"
    REPLY = "reply"          # generic acknowledgement
    REACH_REQ = "reach_req"  # node -> broker: dial my ports back (reachability, issue #24)
    # ring all-reduce
    RING_CHUNK = "ring_chunk"
    RING_ABORT = "ring_abort"
    CATCHUP_REQ = "catchup_req"  # ring socket: a (re)joining stage asks a live holder for its tensors
    CATCHUP = "catchup"          # the reply: raw tensor frames (weights, buffers, optimizer state)
    # measurement
    PROBE = "probe"


# dtype name on the wire -> torch dtype; nothing outside this table is ever accepted.
# (``DTYPES``, the torch dtypes, is made on first use: see _load_torch.)
_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1}
_DTYPES: dict[str, Any] = {}
_DTYPE_NAMES: dict[Any, str] = {}
_torch: Any = None


def _load_torch() -> Any:
    """torch, imported on the first message that carries a tensor.

    Importing torch takes a second or more; ``ravq status`` and ``ravq keygen`` speak this wire format
    without ever touching a tensor, and must not pay for it."""
    global _torch
    if _torch is None:
        import torch

        _DTYPES.update({name: getattr(torch, name) for name in _ITEMSIZE})
        _DTYPE_NAMES.update({v: k for k, v in _DTYPES.items()})
        assert all(torch.empty((), dtype=_DTYPES[k]).element_size() == n for k, n in _ITEMSIZE.items())
        _torch = torch
    return _torch


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # dtype name on the wire -> torch dtype
        _load_torch()
        return _DTYPES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# Per message type: meta fields that must be present, with their JSON types.
REQUIRED_META: dict[MsgType, dict[str, type | tuple[type, ...]]] = {
    MsgType.RING_CHUNK: {"ring": int, "round": int, "step": int, "piece": int},
    MsgType.RING_ABORT: {"ring": int, "round": int},
    MsgType.UPDATE: {"seq": int},
    MsgType.SNAPSHOT: {"seq": int},
}
NEEDS_MICRO_BATCH = (MsgType.FORWARD, MsgType.BACKWARD, MsgType.TIED)
_MSG_TYPES: dict[str, MsgType] = {t.value: t for t in MsgType}  # MsgType(value) costs 10x a lookup
_MAX_DIMS = 16


WIRE_REASONS = ("missing_field", "bad_field", "header_too_large", "bad_json", "bad_descriptor", "bad_dtype",
                "bad_shape", "tensor_too_large", "no_frames", "too_many_frames", "bad_version", "bad_type",
                "frame_count", "frame_size", "bad_codec", "bad_scale")
"""Every ``WireError.reason`` (``ravq_bad_messages_total{socket,reason}``)."""


class WireError(ValueError):
    """A message that failed validation; ``reason`` is a short, fixed label for metrics."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in WIRE_REASONS, reason  # listed: its series is exported at 0 from the start
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    max_header_bytes: int = 64 << 10
    max_frames: int = 1024
    max_tensor_bytes: int = 1 << 30


@dataclass(kw_only=True, slots=True)
class Message:
    type: MsgType
    sender: str
    micro_batch: tuple[int, int] | None = None
    """(cluster, sequence number) for pipeline messages."""
    version: int = 0
    sent_at: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    packed: dict[str, Packed] = field(default_factory=dict)
    """Compressed tensors (see ``ravq.codec.compress``); their names differ from those in ``tensors``."""


def tensor_frame(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU tensor (made contiguous if it is not)."""
    if not t.is_cpu:
        t = t.to("cpu")
    if t.requires_grad:  # numpy() refuses tensors that require grad
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    torch = _torch or _load_torch()
    if t.dtype is torch.bfloat16:  # numpy has no bfloat16; the bytes are what matter
        t = t.view(torch.int16)
    # On the send path of every message: this is half the cost of reshape + view(uint8) + numpy.
    return t.numpy().data.cast("B")


def encode(msg: Message) -> list[bytes | memoryview]:
    """Frames for ``msg``: header first, then each tensor's raw bytes."""
    descriptors = []
    frames: list[bytes | memoryview] = []
    if (msg.tensors or msg.packed) and _torch is None:
        _load_torch()
    for name, t in msg.tensors.items():
        dtype = _DTYPE_NAMES.get(t.dtype)
        assert dtype is not None, f"dtype {t.dtype} of {name!r} is not sendable"
        descriptors.append({"name": name, "dtype": dtype, "shape": list(t.shape)})
        frames.append(tensor_frame(t))
    for name, p in msg.packed.items():
        assert name not in msg.tensors, f"{name!r} is both a tensor and a packed tensor"
        descriptors.extend(_packed_descriptors(name, p))
        frames.append(tensor_frame(p.data))
        if p.scales is not None:
            frames.append(tensor_frame(p.scales))
    header = {
        "v": PROTOCOL_VERSION, "type": str(msg.type), "sender": msg.sender,
        "mb": list(msg.micro_batch) if msg.micro_batch is not None else None,
        "ver": msg.version, "ts": msg.sent_at or time.time(), "meta": msg.meta, "tensors": descriptors,
    }
    return [orjson.dumps(header), *frames]


def _packed_descriptors(name: str, p: Packed) -> list[dict[str, Any]]:
    shape, to = list(p.shape), _DTYPE_NAMES[p.dtype]
    if p.format == "int8":
        assert p.scales is not None and _DTYPE_NAMES[p.scales.dtype] == "float32"
        return [{"name": name, "dtype": "int8", "shape": shape, "kind": "q8", "to": to, "block": p.block},
                {"name": name, "dtype": "float32", "shape": [p.scales.numel()], "kind": "q8_scale"}]
    return [{"name": name, "dtype": _DTYPE_NAMES[p.data.dtype], "shape": shape, "kind": "cast", "to": to}]


_MISSING = object()


def _field(header: dict[str, Any], key: str, kind: type | tuple[type, ...], nullable: bool = False) -> Any:
    """``header[key]`` if it has JSON type ``kind`` (a bool is not an int); WireError otherwise.

    Values come from orjson, so their types are exact (dict, list, str, int, float, bool, None) and a
    ``type(...) is`` test means ``isinstance`` minus bool's being an int.
    """
    value = header.get(key, _MISSING)
    if value is _MISSING:
        raise WireError("missing_field", key)
    if value is None and nullable:
        return None
    if type(value) is not kind and (type(kind) is not tuple or type(value) not in kind):
        raise WireError("bad_field", key)
    return value


def _parse_header(frame: Any, limits: DecodeLimits) -> dict[str, Any]:
    if type(frame) is not bytes:  # a zmq.Frame or another buffer: orjson reads memoryviews
        frame = memoryview(frame)
    if len(frame) > limits.max_header_bytes:
        raise WireError("header_too_large", str(len(frame)))
    try:
        header = orjson.loads(frame)
    except orjson.JSONDecodeError:
        raise WireError("bad_json") from None
    if type(header) is not dict:
        raise WireError("bad_json", "header is not an object")
    return header


def _check_descriptor(d: Any, limits: DecodeLimits) -> tuple[str, str, list[int], int]:
    if type(d) is not dict:
        raise WireError("bad_descriptor")
    name, dtype, shape = d.get("name"), d.get("dtype"), d.get("shape")
    if type(name) is not str or len(name) > 256:
        raise WireError("bad_descriptor", "name")
    itemsize = _ITEMSIZE.get(dtype) if type(dtype) is str else None  # a list or dict is unhashable
    if itemsize is None:
        raise WireError("bad_dtype", str(dtype)[:32])
    if type(shape) is not list or len(shape) > _MAX_DIMS:
        raise WireError("bad_shape")
    numel = 1
    for s in shape:
        if type(s) is not int or s < 0:
            raise WireError("bad_shape")
        numel *= s
    nbytes = numel * itemsize
    if nbytes > limits.max_tensor_bytes:
        raise WireError("tensor_too_large", str(nbytes))
    # An empty tensor's other dims still size its strides: [0, 2**40, 2**40] would overflow in torch.
    # (With no zero dim that product is ``nbytes``, checked just above.)
    if numel == 0 and math.prod(max(s, 1) for s in shape) * itemsize > limits.max_tensor_bytes:
        raise WireError("bad_shape", "empty tensor with oversized dims")
    return name, cast(str, dtype), shape, nbytes


def _tensor(buf: memoryview, dtype: str, shape: list[int]) -> torch.Tensor:
    torch = _torch or _load_torch()
    if len(buf) == 0:
        return torch.empty(shape, dtype=_DTYPES[dtype])
    if buf.readonly:
        # bytes frames (tests, tools): copied, so every decoded tensor is writable; receivers such as the
        # ring all-reduce add into what they receive.  ZeroMQ frames (the hot path) are writable already.
        buf = memoryview(bytearray(buf))
    t = torch.frombuffer(buf, dtype=_DTYPES[dtype])
    # frombuffer's result is already 1-d; reshape costs ~3 us, more than the rest of a tensor.
    return t if len(shape) == 1 else t.reshape(shape)


def decode(frames: Sequence[Any], limits: DecodeLimits = DecodeLimits()) -> Message:
    """Validate and decode a multipart message; raise WireError on anything malformed."""
    if not frames:
        raise WireError("no_frames")
    if len(frames) > limits.max_frames:
        raise WireError("too_many_frames", str(len(frames)))
    header = _parse_header(frames[0], limits)
    v = header.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:  # true == 1 in Python
        raise WireError("bad_version", str(v)[:16])
    mtype = _MSG_TYPES.get(_field(header, "type", str))
    if mtype is None:
        raise WireError("bad_type", header["type"][:32])
    sender = _field(header, "sender", str)
    if not 0 < len(sender) <= 128:
        raise WireError("bad_field", "sender")
    mb = _field(header, "mb", list, nullable=True)
    if mb is None:
        if mtype in NEEDS_MICRO_BATCH:
            raise WireError("missing_field", "mb")
    elif len(mb) != 2 or type(mb[0]) is not int or type(mb[1]) is not int or mb[0] < 0 or mb[1] < 0:
        raise WireError("bad_field", "mb")
    version = _field(header, "ver", int)
    sent_at = _field(header, "ts", (int, float))
    meta = _field(header, "meta", dict)
    required = REQUIRED_META.get(mtype)
    if required:
        for key, kind in required.items():
            _field(meta, key, kind)
    descriptors = _field(header, "tensors", list)
    if len(descriptors) != len(frames) - 1:
        raise WireError("frame_count", f"{len(descriptors)} descriptors, {len(frames) - 1} frames")
    checked: dict[str, tuple[memoryview, str, list[int]]] = {}
    packed: dict[str, _PackedFrames] = {}
    q8: _PackedFrames | None = None  # a q8 frame waiting for its scale frame
    for i, d in enumerate(descriptors, 1):
        name, dtype, shape, nbytes = _check_descriptor(d, limits)
        buf = memoryview(frames[i])
        if nbytes != len(buf):
            raise WireError("frame_size", f"{name}: expected {nbytes} bytes, got {len(buf)}")
        kind = d.get("kind", _MISSING)
        if q8 is not None:
            _check_scales(q8, kind, name, shape, dtype, buf)
            q8.scales = buf
            q8 = None
            continue
        if name in checked or name in packed:
            raise WireError("bad_descriptor", "duplicate name")
        if kind is _MISSING:
            checked[name] = (buf, dtype, shape)
            continue
        entry = packed[name] = _packed_frames(name, d, kind, dtype, shape, buf, limits)
        if entry.format == "int8":
            q8 = entry
    if q8 is not None:
        raise WireError("bad_codec", "q8 frame without its q8_scale frame")
    # Only a fully validated message reaches torch.
    tensors = {name: _tensor(buf, dtype, shape) for name, (buf, dtype, shape) in checked.items()}
    return Message(type=mtype, sender=sender, micro_batch=(mb[0], mb[1]) if mb else None, version=version,
                   sent_at=float(sent_at), meta=meta, tensors=tensors,
                   packed={name: entry.make() for name, entry in packed.items()})


@dataclass(slots=True)
class _PackedFrames:
    name: str
    format: str
    """A ``ravq.codec.compress.Format`` value (that module, and torch, load only once such a frame
    arrives)."""
    data: memoryview
    dtype: str
    shape: list[int]
    to: str
    block: int = 0
    scales: memoryview | None = None

    def make(self) -> Packed:
        from ravq.codec.compress import Format, Packed

        data = _tensor(self.data, self.dtype, self.shape)  # loads torch
        if self.format != Format.INT8:
            return Packed(Format(self.format), data, _DTYPES[self.to], data.shape)
        assert self.scales is not None
        scales = _tensor(self.scales, "float32", [len(self.scales) // 4])
        return Packed(Format.INT8, data.view(-1), _DTYPES[self.to], data.shape, scales, self.block)


Q8_BLOCKS = (64, 256)
"""Smallest and largest int8 block (ravq.codec.compress.MIN_BLOCK, MAX_BLOCK; a test holds them equal: this
module does not import torch until a tensor arrives)."""
_FLOAT32_MAX, _FLOAT16_MAX, _BFLOAT16_MAX = 3.4028234663852886e38, 65504.0, 3.3895313892515355e38
_MAX_SCALE = {"float32": _FLOAT32_MAX / 127 * (1 - 1e-6), "float64": _FLOAT32_MAX / 127 * (1 - 1e-6),
              "float16": _FLOAT16_MAX / 127 * (1 + 1e-6), "bfloat16": _BFLOAT16_MAX / 127 * (1 + 1e-6)}
"""Largest int8 scale per restored dtype (the float dtypes a compressed tensor may restore to): 127 x
scale stays finite (restoring multiplies in float32, then casts; a 2-byte dtype's largest value rounds
to itself, not to inf, up to half an ulp above it)."""
_TO = set(_MAX_SCALE)
_CAST_FORMATS = {"bfloat16": "bf16", "float16": "fp16"}


def _packed_frames(name: str, d: dict[str, Any], kind: Any, dtype: str, shape: list[int], buf: memoryview,
                   limits: DecodeLimits) -> _PackedFrames:
    """The first frame of a compressed tensor: a ``cast`` or a ``q8`` frame."""
    to = d.get("to")
    if type(to) is not str or to not in _TO:
        raise WireError("bad_codec", f"to: {str(to)[:32]}")
    if math.prod(shape) * _ITEMSIZE[to] > limits.max_tensor_bytes:  # what it restores to is bounded too
        raise WireError("tensor_too_large", f"{name} restored")
    if kind == "cast":
        fmt = _CAST_FORMATS.get(dtype)
        if fmt is None or _ITEMSIZE[to] <= _ITEMSIZE[dtype]:  # a cast only ever narrows
            raise WireError("bad_codec", f"cast frame of {dtype} to {to}")
        return _PackedFrames(name, fmt, buf, dtype, shape, to)
    if kind == "q8":
        block = d.get("block")
        if dtype != "int8" or type(block) is not int or not Q8_BLOCKS[0] <= block <= Q8_BLOCKS[1]:
            raise WireError("bad_codec", f"q8 frame of {dtype}, block {str(block)[:16]}")
        return _PackedFrames(name, "int8", buf, dtype, shape, to, block)
    raise WireError("bad_codec", f"kind: {str(kind)[:32]}")


def _check_scales(
    q8: _PackedFrames, kind: Any, name: str, shape: list[int], dtype: str, buf: memoryview
) -> None:
    """The frame after a q8 frame: its scales, one finite, non-negative float32 per block."""
    numel = len(q8.data)
    if (kind != "q8_scale" or name != q8.name or dtype != "float32"
            or shape != [-(-numel // q8.block)]):
        raise WireError("bad_codec", f"{q8.name}: q8 frame not followed by its q8_scale frame")
    scales = np.frombuffer(buf, dtype=np.float32)
    # finite and not negative, and small enough that 127 x scale is finite in what it restores to
    if not (np.isfinite(scales).all() and (scales >= 0).all() and (scales <= _MAX_SCALE[q8.to]).all()):
        raise WireError("bad_scale", name)
