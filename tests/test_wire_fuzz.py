"""Property and mutation fuzzing of ravq.net.wire.decode.

The claim under test (docs/design.md, "Wire format"): whatever bytes arrive, ``decode`` either returns a
Message that satisfies every invariant a receiver relies on, or raises ``WireError`` with a known
reason.  Nothing else may escape: a TypeError or a torch RuntimeError would take a node down.

Deterministic for CI: hypothesis is derandomized without a database, and the mutation loop seeds
each case from its index (a failure names the case; ``RAVQ_FUZZ_CASES`` runs more of them).
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ravq.codec.compress import FLOAT_DTYPES, MAX_BLOCK, MIN_BLOCK, Format, Packed, pack, unpack
from ravq.net.wire import (
    DTYPES,
    NEEDS_MICRO_BATCH,
    REQUIRED_META,
    DecodeLimits,
    Message,
    MsgType,
    WireError,
    decode,
    encode,
)
from tests.test_wire import KNOWN_REASONS, assert_same, raw_bytes

settings.register_profile("ravq-wire-fuzz", derandomize=True, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = settings.get_profile("ravq-wire-fuzz")

MUTATION_CASES = int(os.environ.get("RAVQ_FUZZ_CASES", "30000"))
MIN_MUTATION_CASES = 20_000
MUTATION_BUDGET_S = 20.0
SMALL_LIMITS = DecodeLimits(max_header_bytes=512, max_frames=4, max_tensor_bytes=256)
DEFAULT_LIMITS = DecodeLimits()


def check_invariants(msg: Message, frames: Sequence[Any], limits: DecodeLimits) -> None:
    """What every receiver may assume of a decoded message."""
    assert isinstance(msg.type, MsgType)
    assert isinstance(msg.sender, str) and 0 < len(msg.sender) <= 128
    if msg.micro_batch is None:
        assert msg.type not in NEEDS_MICRO_BATCH
    else:
        assert isinstance(msg.micro_batch, tuple) and len(msg.micro_batch) == 2
        assert all(type(x) is int and x >= 0 for x in msg.micro_batch)
    assert type(msg.version) is int and type(msg.sent_at) is float
    assert isinstance(msg.meta, dict)
    for key, kind in REQUIRED_META.get(msg.type, {}).items():
        assert isinstance(msg.meta[key], kind) and not isinstance(msg.meta[key], bool), key
    packed_frames = sum(1 if p.scales is None else 2 for p in msg.packed.values())
    assert len(msg.tensors) + packed_frames == len(frames) - 1 <= limits.max_frames - 1
    assert not set(msg.tensors) & set(msg.packed)
    for p in msg.packed.values():  # what a receiver restores: the shape and dtype it was told, finite scales
        assert p.dtype in FLOAT_DTYPES and math.prod(p.shape) == p.data.numel()
        if p.format is Format.INT8:
            assert p.data.dtype == torch.int8 and p.scales is not None and MIN_BLOCK <= p.block <= MAX_BLOCK
            assert p.scales.numel() == -(-p.data.numel() // p.block)
            assert bool(torch.isfinite(p.scales).all()) and bool((p.scales >= 0).all())
            assert bool(torch.isfinite(unpack(p)).all())
        else:
            assert p.data.dtype in (torch.bfloat16, torch.float16) and p.scales is None
        restored = unpack(p)
        assert restored.shape == p.shape and restored.dtype == p.dtype
    descriptors = orjson.loads(bytes(memoryview(frames[0])))["tensors"]
    plain_frames = [f for d, f in zip(descriptors, frames[1:]) if "kind" not in d]  # frames of plain tensors
    for (name, t), frame in zip(msg.tensors.items(), plain_frames, strict=True):
        assert isinstance(name, str) and len(name) <= 256
        assert t.dtype in DTYPES.values() and t.dim() <= 16 and t.device.type == "cpu"
        nbytes = t.numel() * t.element_size()
        assert nbytes == len(memoryview(frame)) <= limits.max_tensor_bytes
        assert raw_bytes(t) == bytes(frame)  # the tensor is exactly the frame's bytes
    # A decoded message encodes again, to the same message.
    again = decode([bytes(f) for f in encode(msg)], DecodeLimits(max_header_bytes=1 << 30))
    if msg.sent_at == 0.0:  # encode stamps an unset time
        again.sent_at = 0.0
    assert_same(again, msg)


def decode_or_wire_error(frames: Sequence[Any], limits: DecodeLimits = DEFAULT_LIMITS) -> str:
    """"ok" or the WireError reason; any other exception propagates and fails the test."""
    try:
        msg = decode(frames, limits)
    except WireError as err:
        assert err.reason in KNOWN_REASONS, err.reason
        return err.reason
    check_invariants(msg, frames, limits)
    return "ok"


# ----------------------------------------------------------------------------------- strategies

json_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
names = st.text(st.characters(codec="utf-8"), max_size=40)
non_negative = st.integers(0, 2**63 - 1)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    shape = draw(st.lists(st.integers(0, 5), max_size=4))
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    data = draw(st.binary(min_size=nbytes, max_size=nbytes))  # any bit pattern: NaN, -0.0, bool 7
    t = torch.frombuffer(bytearray(data), dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
    t = t.reshape(shape)
    return t.t() if t.dim() == 2 and draw(st.booleans()) else t  # sometimes non-contiguous


@st.composite
def messages(draw: st.DrawFn) -> Message:
    mtype = draw(st.sampled_from(list(MsgType)))
    needs_mb = mtype in NEEDS_MICRO_BATCH
    micro_batch = draw(st.tuples(non_negative, non_negative) if needs_mb
                       else st.none() | st.tuples(non_negative, non_negative))
    meta = draw(st.dictionaries(st.text(max_size=8), json_values, max_size=4))
    meta.update({key: draw(st.integers(-(2**63), 2**63 - 1)) for key in REQUIRED_META.get(mtype, {})})
    plain = draw(st.dictionaries(names, tensors(), max_size=4))
    packed = {name: p for name, p in draw(st.dictionaries(names, packed_tensors(), max_size=3)).items()
              if name not in plain}
    return Message(type=mtype, sender=draw(st.text(st.characters(codec="utf-8"), min_size=1, max_size=128)),
                   micro_batch=micro_batch, version=draw(st.integers(-(2**63), 2**63 - 1)),
                   sent_at=draw(st.floats(min_value=1e-6, max_value=1e12)), meta=meta,
                   tensors=plain, packed=packed)


@st.composite
def packed_tensors(draw: st.DrawFn) -> Packed:
    """A compressed tensor as ravq.codec.compress makes it (from finite values of any size and scale)."""
    fmt = draw(st.sampled_from([Format.BF16, Format.FP16, Format.INT8]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    shape = draw(st.lists(st.integers(1, 70), min_size=1, max_size=3))
    values = draw(st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=16))
    block = draw(st.integers(MIN_BLOCK, MAX_BLOCK))
    numel = math.prod(shape)  # the drawn values, tiled (hypothesis draws lists of a few thousand slowly)
    t = torch.tensor(values, dtype=dtype).repeat(-(-numel // len(values)))[:numel].reshape(shape)
    packed = pack(t, fmt, block)
    if not isinstance(packed, Packed):  # int8 of one value, or a cast that would not narrow
        packed = pack(torch.cat([t.reshape(-1), t.reshape(-1)]).reshape(2, *shape), Format.BF16)
    assert isinstance(packed, Packed)
    return packed


def as_buffers(frames: list[bytes], kind: str) -> list[Any]:
    if kind == "bytes":
        return frames
    if kind == "bytearray":  # writable, like ZeroMQ frames
        return [bytearray(f) for f in frames]
    return [memoryview(b"\0" + f)[1:] for f in frames]  # read-only, at odd addresses


# ------------------------------------------------------------------------------ property tests


@settings(PROFILE, max_examples=300)
@given(msg=messages(), kind=st.sampled_from(["bytes", "bytearray", "offset"]))
def test_valid_messages_round_trip(msg: Message, kind: str) -> None:
    frames = [bytes(f) for f in encode(msg)]
    got = decode(as_buffers(frames, kind), DecodeLimits(max_header_bytes=1 << 30))
    assert_same(got, msg)
    assert all(t.is_contiguous() for t in got.tensors.values())


@settings(PROFILE, max_examples=400)
@given(frames=st.lists(st.binary(max_size=64), max_size=6))
def test_arbitrary_frames_only_raise_wire_error(frames: list[bytes]) -> None:
    decode_or_wire_error(frames)


_HEADER_FIELDS = {"v": st.just(1), "type": st.sampled_from([str(t) for t in MsgType]),
                  "sender": st.text(min_size=1, max_size=8),
                  "mb": st.none() | st.tuples(non_negative, non_negative).map(list),
                  "ver": st.integers(0, 9), "ts": st.floats(0, 1e10), "meta": st.just({})}
_DESCRIPTOR_FIELDS = {"name": names, "dtype": st.sampled_from(sorted(DTYPES)),
                      "shape": st.lists(st.integers(0, 4) | st.sampled_from([2**31, 2**40, 2**64 - 1]),
                                        max_size=4)}


def _object(draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]]) -> dict[str, Any]:
    """Each field mostly valid, else arbitrary JSON, else missing."""
    obj: dict[str, Any] = {}
    for key, valid in fields.items():
        choice = draw(st.integers(0, 9))
        if choice < 7:
            obj[key] = draw(valid)
        elif choice < 9:
            obj[key] = draw(json_values)
    return obj


def _frame_size(d: Any) -> int:
    if not (isinstance(d, dict) and isinstance(d.get("dtype"), str) and d["dtype"] in DTYPES
            and isinstance(d.get("shape"), list) and all(type(s) is int and s >= 0 for s in d["shape"])):
        return 0
    size = math.prod(d["shape"]) * torch.empty((), dtype=DTYPES[d["dtype"]]).element_size()
    return size if size <= 1 << 16 else 0


@st.composite
def near_valid_messages(draw: st.DrawFn) -> list[bytes]:
    """Header and descriptor fields each valid, arbitrary JSON or missing; frames sized about right."""
    header = _object(draw, _HEADER_FIELDS)
    mtype = header.get("type")
    if isinstance(mtype, str) and mtype in REQUIRED_META and isinstance(header.get("meta"), dict):
        header["meta"] = {k: draw(st.integers(0, 5) | json_values) for k in REQUIRED_META[MsgType(mtype)]}
    descriptors = [_object(draw, _DESCRIPTOR_FIELDS) if draw(st.integers(0, 9)) else draw(json_values)
                   for _ in range(draw(st.integers(0, 4)))]
    header["tensors"] = descriptors if draw(st.integers(0, 9)) else draw(json_values)
    frames = [orjson.dumps(header)]
    for d in descriptors:
        frames.append(bytes(max(0, _frame_size(d) + draw(st.sampled_from([0, 0, 0, -1, 1])))))
    return frames[: len(frames) + draw(st.integers(-1, 1))] if draw(st.booleans()) else frames


@settings(PROFILE, max_examples=400)
@given(frames=near_valid_messages(), small=st.booleans())
def test_near_valid_messages_only_raise_wire_error(frames: list[bytes], small: bool) -> None:
    decode_or_wire_error(frames, SMALL_LIMITS if small else DecodeLimits())


# -------------------------------------------------------------------------------- mutation loop


def _packed(t: torch.Tensor, fmt: Format, block: int) -> Packed:
    packed = pack(t, fmt, block)
    assert isinstance(packed, Packed)
    return packed


def corpus() -> list[list[bytes]]:
    gen = torch.Generator().manual_seed(0)
    msgs = [
        Message(type=MsgType.FORWARD, sender="stage-0", micro_batch=(0, 17), version=3, sent_at=12.5,
                tensors={"activations": torch.randn(4, 8, generator=gen),
                         "targets": torch.randint(0, 50, (4,), generator=gen)}),
        Message(type=MsgType.BACKWARD, sender="stage-1", micro_batch=(1, 2), version=9, sent_at=1.0,
                tensors={"grad": torch.randn(2, 3, 2, generator=gen).to(torch.bfloat16)}),
        Message(type=MsgType.RING_CHUNK, sender="n3", version=1, sent_at=2.0,
                meta={"ring": 0, "round": 4, "step": 1, "piece": 2},
                tensors={"chunk": torch.randn(16, generator=gen).half()}),
        Message(type=MsgType.SNAPSHOT, sender="broker", sent_at=3.0,
                meta={"seq": 41, "nodes": {"a": {"addr": "127.0.0.1", "port": 5555}}, "epoch": [1, 2]}),
        Message(type=MsgType.UPDATE, sender="broker", sent_at=4.0, meta={"seq": 42, "change": "join"}),
        Message(type=MsgType.PROBE, sender="probe", sent_at=5.0,
                tensors={"empty": torch.empty(0, 3), "scalar": torch.tensor(2.0, dtype=torch.float64),
                         "mask": torch.tensor([True, False, True]), "u8": torch.arange(5, dtype=torch.uint8)}),
        Message(type=MsgType.HEARTBEAT, sender="node-7", sent_at=6.0, meta={"loss": 1.25, "ok": True}),
        # compressed frames (ravq.codec.compress): int8 payload + scales, and a bf16 cast, beside a plain tensor
        Message(type=MsgType.FORWARD, sender="stage-0", micro_batch=(0, 18), version=3, sent_at=13.5,
                tensors={"t": torch.randint(0, 50, (4,), generator=gen)},
                packed={"o0": _packed(torch.randn(3, 70, generator=gen), Format.INT8, 64),
                        "o1": _packed(torch.randn(5, generator=gen), Format.BF16, 64)}),
        Message(type=MsgType.RING_CHUNK, sender="n2", sent_at=7.0,
                meta={"ring": 1, "round": 5, "step": 0, "piece": 1, "base": 4},
                packed={"piece": _packed(torch.randn(300, generator=gen), Format.INT8, 128)}),
    ]
    return [[bytes(f) for f in encode(m)] for m in msgs]


_INTERESTING = [None, True, False, 0, -1, 1, 2, 17, 2**31, 2**63 - 1, 2**64 - 1, -(2**63), 1.5, -0.0, 1e308,
                "", "x" * 300, "float32", "bool", "fwd", "ring_chunk", [], {}, [0, 0], [0, -1], [1] * 17,
                "int8", "bfloat16", "q8", "q8_scale", "cast", 63, 64, 256, 257,
                [0, 2**40, 2**40], {"name": "x"}, {"name": "x", "dtype": "int8", "shape": []}]
_JSON_BYTES = b'{}[]",:0123456789-eE.tfnul \\'


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _paths(value, (*path, i))
    return found


def _mutate_json(header: bytes, rng: random.Random) -> bytes:
    """Set, delete or add one value somewhere in the header's JSON."""
    try:
        doc = orjson.loads(header)
    except orjson.JSONDecodeError:
        return header
    path = rng.choice(_paths(doc))
    if not path:
        return orjson.dumps(rng.choice(_INTERESTING))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    action = rng.random()
    if action < 0.15:
        del parent[path[-1]]
    elif action < 0.25 and isinstance(parent, list):
        parent.append(rng.choice(_INTERESTING))
    else:
        parent[path[-1]] = rng.choice(_INTERESTING)
    return orjson.dumps(doc)


def _flip_bits(frames: list[bytes], rng: random.Random) -> None:
    i = 0 if rng.random() < 0.7 or len(frames) == 1 else rng.randrange(1, len(frames))
    if not frames[i]:
        return
    data = bytearray(frames[i])
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    frames[i] = bytes(data)


def _json_byte(frames: list[bytes], rng: random.Random) -> None:
    data = bytearray(frames[0])
    if data:
        data[rng.randrange(len(data))] = rng.choice(_JSON_BYTES)
    frames[0] = bytes(data)


def _truncate(frames: list[bytes], rng: random.Random) -> None:
    i = rng.randrange(len(frames))
    frames[i] = frames[i][: rng.randint(0, max(0, len(frames[i]) - 1))]


def _extend(frames: list[bytes], rng: random.Random) -> None:
    i = rng.randrange(len(frames))
    frames[i] = frames[i] + rng.randbytes(rng.choice([1, 2, 4, 8, 100]))


def _drop(frames: list[bytes], rng: random.Random) -> None:
    if frames:
        del frames[rng.randrange(len(frames))]


def _duplicate(frames: list[bytes], rng: random.Random) -> None:
    if frames:
        frames.insert(rng.randrange(len(frames) + 1), frames[rng.randrange(len(frames))])


def _swap(frames: list[bytes], rng: random.Random) -> None:
    if len(frames) > 1:
        i, j = rng.sample(range(len(frames)), 2)
        frames[i], frames[j] = frames[j], frames[i]


def _json_edit(frames: list[bytes], rng: random.Random) -> None:
    frames[0] = _mutate_json(frames[0], rng)


MUTATORS: list[Callable[[list[bytes], random.Random], None]] = [
    _flip_bits, _json_byte, _truncate, _extend, _drop, _duplicate, _swap, _json_edit, _json_edit, _json_edit,
]


def mutant(seeds: list[list[bytes]], case: int) -> tuple[list[bytes], DecodeLimits]:
    rng = random.Random(case)
    frames = list(rng.choice(seeds))
    if rng.random() < 0.05:  # splice: one message's header on another's tensor frames
        frames = frames[:1] + rng.choice(seeds)[1:]
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        if not frames:
            break
        rng.choice(MUTATORS)(frames, rng)
    return frames, SMALL_LIMITS if rng.random() < 0.2 else DecodeLimits()


def test_mutated_messages_decode_validly_or_raise_wire_error() -> None:
    seeds = corpus()
    outcomes: dict[str, int] = {}
    deadline = time.monotonic() + MUTATION_BUDGET_S
    done = 0
    for case in range(MUTATION_CASES):
        if time.monotonic() > deadline:
            break
        frames, limits = mutant(seeds, case)
        try:
            outcome = decode_or_wire_error(frames, limits)
        except Exception as err:  # name the case, so it can be replayed with mutant(corpus(), case)
            raise AssertionError(f"mutation case {case}: {type(err).__name__}: {err}") from err
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        done += 1
    assert done >= min(MUTATION_CASES, MIN_MUTATION_CASES), f"only {done} cases in {MUTATION_BUDGET_S}s"
    # The mutations reach deep into decode, not just its JSON parser: many reasons, and survivors.
    reasons = set(outcomes) - {"ok"}
    assert len(reasons) >= 12, sorted(reasons)
    assert outcomes.get("ok", 0) >= done // 100, outcomes


def test_every_mutator_changes_something() -> None:
    seeds = corpus()
    for mutate in MUTATORS:
        changed = 0
        for case in range(50):
            rng = random.Random(case)
            frames = list(seeds[case % len(seeds)])
            mutate(frames, rng)
            changed += frames != seeds[case % len(seeds)]
        assert changed >= 25, mutate.__name__


@pytest.mark.parametrize("case", range(5))
def test_mutants_are_deterministic(case: int) -> None:
    assert mutant(corpus(), case) == mutant(corpus(), case)
