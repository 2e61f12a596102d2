"""CPU cost of ravq.codec.compress on one thread: pack and unpack throughput per format and piece size.

What a link needs: a ring member at R Mbit/s sends R/8 MB/s of packed bytes, i.e. (R/8) / ratio MB/s of
float32 (ratio: packed bytes over float32 bytes); it packs about that much and unpacks, adds and packs
again about as much on receipt.  ``headroom`` is the measured pack+unpack throughput over that rate:
above 1 the codec keeps up with the link on one core (the figure to watch on a 2-core machine with 4
processes is headroom well above 2).

    python benchmarks/bench_codec.py [--link-mbit 200] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

from _common import use_repo_checkout

use_repo_checkout()

import torch

from ravq.codec.compress import Format, Packed, pack, unpack
from ravq.tuning import tune_process


def seconds(fn: object, repeats: int) -> float:
    """Least wall time of ``fn()`` over ``repeats`` (after two warm-up calls): on a shared machine other
    jobs only ever add time, so the least is the codec's own cost."""
    assert callable(fn)
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link-mbit", type=float, default=200.0)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    tune_process()  # as a node does (malloc keeps big buffers instead of fresh pages per call)
    sizes = [1 << 14, 1 << 20] if args.quick else [1 << 14, 1 << 18, 1 << 20, 1 << 22]
    rows = []
    for numel in sizes:
        x = torch.randn(numel)
        for fmt in (Format.BF16, Format.FP16, Format.INT8):
            packed = pack(x, fmt)
            assert isinstance(packed, Packed)
            t_pack = seconds(lambda: pack(x, fmt), args.repeats)  # noqa: B023
            t_unpack = seconds(lambda: unpack(packed), args.repeats)  # noqa: B023
            ratio = packed.wire_bytes / packed.logical_bytes
            need = args.link_mbit * 1e6 / 8 / ratio  # float32 bytes/s behind a link that busy
            mb = numel * 4
            rows.append({"format": fmt.value, "float32_bytes": mb, "pack_mb_per_s": mb / t_pack / 1e6,
                         "unpack_mb_per_s": mb / t_unpack / 1e6, "wire_over_float32": ratio,
                         "needed_mb_per_s": need / 1e6, "headroom": mb / (t_pack + t_unpack) / need})
            r = rows[-1]
            print(f"{fmt.value:<5} {mb / 2**20:6.2f} MiB  pack {r['pack_mb_per_s']:7.0f} MB/s  unpack "
                  f"{r['unpack_mb_per_s']:7.0f} MB/s  (float32 MB/s)   {args.link_mbit:g} Mbit/s needs "
                  f"{r['needed_mb_per_s']:5.0f} MB/s: headroom x{r['headroom']:.1f}")
    if args.json:
        print(json.dumps({"benchmark": "codec", "link_mbit": args.link_mbit, "threads": 1, "rows": rows}))


if __name__ == "__main__":
    main()
