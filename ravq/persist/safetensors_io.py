"""Writing safetensors one tensor at a time: a stage's checkpoint or a whole exported model costs no copy.

``safetensors.torch.save_file`` turns every tensor into ``bytes`` before it writes (a second copy of the
whole stage, and of its optimizer state); ``write_safetensors`` writes the header from shapes and dtypes,
then each tensor's own memory, fetched only when its turn comes.  The files are plain safetensors
(``safe_open``, ``load_file`` and transformers' ``from_pretrained`` read them).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fetch: Callable[[], torch.Tensor]
    """Returns the tensor (on any device) when it is written."""

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def entry(name: str, tensor: torch.Tensor) -> Entry:
    return Entry(name, tuple(tensor.shape), tensor.dtype, lambda: tensor)


def write_safetensors(
    path: str | Path, entries: Sequence[Entry], metadata: dict[str, str] | None = None
) -> int:
    """Write ``entries`` to ``path`` (replacing it); returns the bytes written."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {})} if metadata else {}
    offset = 0
    for e in entries:
        if e.dtype not in DTYPES:
            raise ValueError(f"{e.name}: dtype {e.dtype} has no safetensors name")
        header[e.name] = {
            "dtype": DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors' own writer does it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for e in entries:
            t = e.fetch().detach()
            if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                raise ValueError(f"{e.name}: got {tuple(t.shape)} {t.dtype}, announced {e.shape} {e.dtype}")
            t = t.to("cpu").contiguous().reshape(-1)
            if t.numel():
                f.write(memoryview(t.view(torch.uint8).numpy()))
    return 8 + len(text) + offset
