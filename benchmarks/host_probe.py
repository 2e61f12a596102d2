"""How fast this PC trains right now: the training FLOP/s ``ravq profile`` measures (``measure_compute``:
the task's whole model, five windows over six seconds, the median), printed as one JSON line.

The testbed (``testbed.Testbed.host_speed``) runs it in each PC's namespace and cgroup just before and just
after a plan trains, and compares it with the PC's profile: the emulated PCs share a virtual machine whose
host changes how much a CPU second computes by tens of percent within minutes (docs/testbed.md), which a
profile taken minutes earlier cannot know and a real PC's own CPU does not do.

    python benchmarks/host_probe.py ravq.tasks.charlm 32
"""

from __future__ import annotations

import json
import sys

import torch


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: host_probe.py TASK MICRO_BATCH", file=sys.stderr)
        return 2
    from ravq.config import resolve_task_module
    from ravq.profile.compute import measure_compute
    from ravq.tuning import cpu_budget

    if cpu_budget() < torch.get_num_threads():
        torch.set_num_threads(cpu_budget())  # as ``ravq profile`` does
    sample = measure_compute(resolve_task_module(argv[0]), int(argv[1]), "cpu", window_s=6.0 / 5, windows=5)
    print(json.dumps({"flops": sample.flops, "spread": sample.spread, "cpu_share": sample.cpu_share}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
