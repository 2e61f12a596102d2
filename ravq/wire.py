"""Message encoding: one orjson header frame, then one raw frame per tensor.

Nothing here unpickles or evaluates anything.  ``decode`` treats every frame as hostile: it checks
the JSON, every field's type, the dtype against an allowlist, the frame count and each frame's
length before a single tensor is made, and raises ``WireError`` with a short ``reason`` (used as a
metric label) otherwise.  Tensor frames are sent without a copy (a memoryview over the tensor's
storage) and received without a copy (``torch.frombuffer`` over the frame).
"""

from __future__ import annotations

import enum
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import torch

PROTOCOL_VERSION = 1


class MsgType(enum.StrEnum):
    # pipeline links
    FORWARD = "fwd"          # activations (+ model inputs, + targets for the last stage)
    BACKWARD = "bwd"         # gradients w.r.t. a stage's inputs, to their producer
    # broker (clone pattern) and node control
    REGISTER = "register"    # node -> broker: I am up
    HEARTBEAT = "heartbeat"  # node -> broker: alive, with live statistics in meta
    SNAPSHOT_REQ = "snapshot_req"
    SNAPSHOT = "snapshot"    # broker -> node: full state with its sequence number
    UPDATE = "update"        # broker PUB: one state change with a sequence number
    STATUS_REQ = "status_req"
    STATUS = "status"
    REPLY = "reply"          # generic acknowledgement
    # ring all-reduce
    RING_CHUNK = "ring_chunk"
    RING_ABORT = "ring_abort"
    # measurement
    PROBE = "probe"


# dtype name on the wire -> torch dtype; nothing outside this table is ever accepted.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}

# Per message type: meta fields that must be present, with their JSON types.
REQUIRED_META: dict[MsgType, dict[str, type | tuple[type, ...]]] = {
    MsgType.RING_CHUNK: {"ring": int, "round": int, "step": int, "piece": int},
    MsgType.RING_ABORT: {"ring": int, "round": int},
    MsgType.UPDATE: {"seq": int},
    MsgType.SNAPSHOT: {"seq": int},
}
_NEEDS_MICRO_BATCH = (MsgType.FORWARD, MsgType.BACKWARD)
_MAX_DIMS = 16


class WireError(ValueError):
    """A message that failed validation; ``reason`` is a short, fixed label for metrics."""

    def __init__(self, reason: str, detail: str = "") -> None:
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


def tensor_frame(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU tensor (made contiguous if it is not)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    if t.dtype is torch.bfloat16:  # numpy has no bfloat16; the bytes are what matter
        t = t.view(torch.int16)
    # On the send path of every message: this is half the cost of reshape + view(uint8) + numpy.
    return t.numpy().data.cast("B")


def encode(msg: Message) -> list[bytes | memoryview]:
    """Frames for ``msg``: header first, then each tensor's raw bytes."""
    descriptors = []
    frames: list[bytes | memoryview] = []
    for name, t in msg.tensors.items():
        dtype = _DTYPE_NAMES.get(t.dtype)
        assert dtype is not None, f"dtype {t.dtype} of {name!r} is not sendable"
        descriptors.append({"name": name, "dtype": dtype, "shape": list(t.shape)})
        frames.append(tensor_frame(t))
    header = {
        "v": PROTOCOL_VERSION, "type": str(msg.type), "sender": msg.sender,
        "mb": list(msg.micro_batch) if msg.micro_batch is not None else None,
        "ver": msg.version, "ts": msg.sent_at or time.time(), "meta": msg.meta, "tensors": descriptors,
    }
    return [orjson.dumps(header), *frames]


def _field(header: dict[str, Any], key: str, kind: type | tuple[type, ...], nullable: bool = False) -> Any:
    if key not in header:
        raise WireError("missing_field", key)
    value = header[key]
    if value is None and nullable:
        return None
    if isinstance(value, bool) and kind is not bool and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise WireError("bad_field", key)
    if not isinstance(value, kind):
        raise WireError("bad_field", key)
    return value


def _parse_header(frame: memoryview, limits: DecodeLimits) -> dict[str, Any]:
    if len(frame) > limits.max_header_bytes:
        raise WireError("header_too_large", str(len(frame)))
    try:
        header = orjson.loads(frame)
    except orjson.JSONDecodeError:
        raise WireError("bad_json") from None
    if not isinstance(header, dict):
        raise WireError("bad_json", "header is not an object")
    return header


def _check_descriptor(d: Any, limits: DecodeLimits) -> tuple[str, str, list[int], int]:
    if not isinstance(d, dict):
        raise WireError("bad_descriptor")
    name, dtype, shape = d.get("name"), d.get("dtype"), d.get("shape")
    if not isinstance(name, str) or len(name) > 256:
        raise WireError("bad_descriptor", "name")
    if not isinstance(dtype, str) or dtype not in DTYPES:  # a list or dict here is unhashable
        raise WireError("bad_dtype", str(dtype)[:32])
    if (not isinstance(shape, list) or len(shape) > _MAX_DIMS
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s for s in shape)):
        raise WireError("bad_shape")
    nbytes = math.prod(shape) * _ITEMSIZE[dtype]
    if nbytes > limits.max_tensor_bytes:
        raise WireError("tensor_too_large", str(nbytes))
    # An empty tensor's other dims still size its strides: [0, 2**40, 2**40] would overflow in torch.
    if math.prod(max(s, 1) for s in shape) * _ITEMSIZE[dtype] > limits.max_tensor_bytes:
        raise WireError("bad_shape", "empty tensor with oversized dims")
    return name, dtype, shape, nbytes


def _tensor(buf: memoryview, dtype: str, shape: list[int]) -> torch.Tensor:
    if len(buf) == 0:
        return torch.empty(shape, dtype=DTYPES[dtype])
    if not buf.readonly:  # ZeroMQ frames: the hot path, without catch_warnings' cost
        return torch.frombuffer(buf, dtype=DTYPES[dtype]).reshape(shape)
    with warnings.catch_warnings():
        # bytes frames (tests, tools) are read-only; the tensors are only read (and copied to a device).
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=DTYPES[dtype]).reshape(shape)


def decode(frames: Sequence[Any], limits: DecodeLimits = DecodeLimits()) -> Message:
    """Validate and decode a multipart message; raise WireError on anything malformed."""
    if not frames:
        raise WireError("no_frames")
    if len(frames) > limits.max_frames:
        raise WireError("too_many_frames", str(len(frames)))
    views = [memoryview(f) for f in frames]
    header = _parse_header(views[0], limits)
    if type(header.get("v")) is not int or header["v"] != PROTOCOL_VERSION:  # true == 1 in Python
        raise WireError("bad_version", str(header.get("v"))[:16])
    try:
        mtype = MsgType(_field(header, "type", str))
    except ValueError as err:
        if isinstance(err, WireError):
            raise
        raise WireError("bad_type", str(header.get("type"))[:32]) from None
    sender = _field(header, "sender", str)
    if not 0 < len(sender) <= 128:
        raise WireError("bad_field", "sender")
    mb = _field(header, "mb", list, nullable=True)
    if mb is not None and (len(mb) != 2 or not all(type(x) is int and x >= 0 for x in mb)):
        raise WireError("bad_field", "mb")
    if mb is None and mtype in _NEEDS_MICRO_BATCH:
        raise WireError("missing_field", "mb")
    version = _field(header, "ver", int)
    sent_at = _field(header, "ts", (int, float))
    meta = _field(header, "meta", dict)
    for key, kind in REQUIRED_META.get(mtype, {}).items():
        _field(meta, key, kind)
    descriptors = _field(header, "tensors", list)
    if len(descriptors) != len(views) - 1:
        raise WireError("frame_count", f"{len(descriptors)} descriptors, {len(views) - 1} frames")
    checked: dict[str, tuple[memoryview, str, list[int]]] = {}
    for d, buf in zip(descriptors, views[1:]):
        name, dtype, shape, nbytes = _check_descriptor(d, limits)
        if nbytes != len(buf):
            raise WireError("frame_size", f"{name}: expected {nbytes} bytes, got {len(buf)}")
        if name in checked:
            raise WireError("bad_descriptor", "duplicate name")
        checked[name] = (buf, dtype, shape)
    # Only a fully validated message reaches torch.
    tensors = {name: _tensor(buf, dtype, shape) for name, (buf, dtype, shape) in checked.items()}
    return Message(type=mtype, sender=sender, micro_batch=tuple(mb) if mb else None, version=version,
                   sent_at=float(sent_at), meta=meta, tensors=tensors)
