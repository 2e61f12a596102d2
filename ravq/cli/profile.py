"""``ravq profile``: measure this node (``ravq.profile.measure``), write profile-NAME.json and say what
was measured and how far to trust it."""

from __future__ import annotations

from ravq.config import load_topology
from ravq.planner.types import size_text
from ravq.profile.measure import measure_node
from ravq.profile.store import Measurement, save_profile


def compute_confidence(measurement: Measurement) -> str:
    """How sure the compute figure is, in words a user can act on."""
    if measurement.flops_spread is None:
        return "from matmuls only (the task's model did not run)"
    n, spread = len(measurement.flops_windows), measurement.flops_spread
    verdict = "steady" if spread <= 0.1 else "unsteady: other work on this PC? profile again when it is idle"
    cpu = (
        ""
        if measurement.cpu_share is None
        else f"; it got {measurement.cpu_share:.2f} CPU seconds per second"
    )
    return f"median of {n} windows, which were within {spread:.0%} of each other ({verdict}){cpu}"


def profile_main(topology_path: str, name: str, out_dir: str = ".", peers_wait_s: float = 120.0) -> int:
    """`ravq profile`: measure this node and write profile-NAME.json; 0 when every link was measured,
    1 when some peer never answered, 2 on a configuration error."""
    try:
        topology = load_topology(topology_path)
        topology.node(name)
        measurement = measure_node(topology, name, wait_s=peers_wait_s)
    except ValueError as err:  # ConfigError, or CURVE keys that do not match the topology
        print(f"error: {err}")
        return 2
    path = save_profile(measurement, out_dir)
    missing = sorted({n.name for n in topology.nodes} - {name} - set(measurement.bandwidth_bytes_per_s))
    print(f"{name}: {measurement.flops / 1e9:.3g} GFLOP/s (matmul {measurement.matmul_flops / 1e9:.3g}), "
          f"{measurement.memory_bytes / (1 << 30):.3g} GiB usable")
    print(f"  compute: {compute_confidence(measurement)}")
    if measurement.message_s:
        print("  pipeline messages (CPU time at this speed): " + ", ".join(
            f"{size_text(size)} {seconds * 1e3:.3g} ms" for size, seconds in measurement.message_s))
    if measurement.averaging_s:
        nbytes, seconds = measurement.averaging_s
        print(
            f"  averaging: {seconds * 1e3:.3g} ms per round of {size_text(int(nbytes))} in a ring of two "
            f"as a node runs it ({measurement.averaging_cpu_s[1] * 1e3:.3g} ms of CPU"
            + (
                f"; the bare ring {measurement.ring_cpu_s[1] * 1e3:.3g} ms)"
                if measurement.ring_cpu_s
                else ")"
            )
        )
    elif measurement.ring_s:
        nbytes, seconds = measurement.ring_s
        print(f"  averaging: {seconds * 1e3:.3g} ms per round of {size_text(int(nbytes))} in a ring of two "
              f"({measurement.ring_cpu_s[1] * 1e3:.3g} ms of CPU)")
    if measurement.loss_s:
        print(f"  loss stage: {measurement.loss_s * 1e3:.3g} ms more per micro-batch "
              f"({measurement.loss_cpu_s * 1e3:.3g} ms of CPU: loss forward and backward, metrics)")
    if measurement.pipeline_cpu_s:
        print(
            f"  pipeline stage: {measurement.stage_s * 1e3:.3g} ms more per micro-batch "
            f"({measurement.stage_cpu_s * 1e3:.3g} ms of CPU: the model as two stages over this node's "
            f"sockets {measurement.pipeline_cpu_s * 1e3:.3g} ms, "
            f"as one {measurement.single_cpu_s * 1e3:.3g} ms)"
        )
    for peer in sorted(measurement.bandwidth_bytes_per_s):
        print(f"  -> {peer}: {measurement.bandwidth_bytes_per_s[peer] * 8 / 1e6:.4g} Mbit/s, "
              f"{measurement.latency_s[peer] * 1e3:.3g} ms")
    if missing:
        print(f"  not measured (no answer within {peers_wait_s:.0f} s): {', '.join(missing)}")
    print(f"wrote {path}")
    return 1 if missing else 0
