"""Compression of pipeline and ring traffic, as a topology's ``training.compress`` states it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ravq.config.base import UserModel


class CompressConfig(UserModel):
    """Defaults from the measurements in docs/compression.md (benchmarks/bench_allreduce.py --link-mbit 200,
    bench_pipeline_link.py, bench_convergence.py --compare-compress): on home links the bytes decide, int8
    moves a quarter of them, and training needed no more samples for it."""

    pipeline: Literal["none", "bf16", "fp16", "int8"] = "int8"
    """How activations and gradients cross pipeline links: as they are, cast to bf16/fp16, or int8 with
    one scale per int8_block values; restored to the stage's dtype on arrival.  Integer tensors, masks
    and targets are never compressed.  none: exactly as float32 (the synchronous equivalence holds)."""
    ring: Literal["none", "bf16", "int8"] = "int8"
    """How all-reduce pieces cross ring links: as they are (results bit for bit as uncompressed), or
    compressed with error feedback (ravq.average.ring_compression)."""
    int8_block: int = Field(128, ge=64, le=256)
    """Values per int8 scale (64-256): smaller blocks are more precise and add more scale bytes."""
