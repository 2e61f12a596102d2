"""Issue #38 in emulation: four clusters of which one is 3x slower, global rings against groups paced by rate.

Runs ``benchmarks/scenarios/groups/slow_cluster.yaml`` on the testbed (real processes in network
namespaces with CPU quotas, CURVE on, the broker and nodes started as their systemd units start them):
the same four one-PC clusters train twice for the scenario's window, once with ``averaging: {mode:
global}`` and once with ``{mode: groups, group_size: 2, pace: rate}`` (the rates the cost model gives
each cluster, as the planner records them).  Reported:

- each cluster's samples/s over the window, and the fast clusters' rate in groups over theirs under
  global rings (target: >= 1.5x);
- the clusters' mean training loss at equal samples: ``ravq status`` every few seconds gives (samples
  all clusters trained, mean recent loss), and both runs' curves are read at the largest sample count
  both reached (target: groups within 5% of global rings).

    flock /tmp/ravq/bench.lock python benchmarks/bench_slow_cluster.py            # ~6 minutes
    python benchmarks/bench_slow_cluster.py --from /tmp/rq14-testbed-slow_cluster-N/result.json

Needs root (network namespaces, tc, cgroups).  The PCs share the machine's cores with anything else
running: the load average is printed at both ends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import testbed

SCENARIO = Path(__file__).resolve().parent / "scenarios" / "groups" / "slow_cluster.yaml"
PLANS = ("global_rings", "groups_rate")
TARGET_RATE, TARGET_LOSS = 1.5, 0.05


def loss_at(curve: list[dict[str, Any]], samples: float) -> float | None:
    """The curve's loss at ``samples`` (linear between the two status answers around it)."""
    points = [(p["samples"], p["loss"]) for p in curve if p.get("loss") is not None]
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        if s0 <= samples <= s1:
            return l0 if s1 == s0 else l0 + (l1 - l0) * (samples - s0) / (s1 - s0)
    return None


def compare(result: dict[str, Any]) -> dict[str, Any]:
    plans = result["plans"]
    g, r = plans["global_rings"], plans["groups_rate"]
    slow = min(r["cluster_samples_per_s"], key=r["cluster_samples_per_s"].get)  # the last stage of the slow one
    fast = [n for n in r["cluster_samples_per_s"] if n != slow]
    ratios = {n: r["cluster_samples_per_s"][n] / g["cluster_samples_per_s"][n] for n in fast}
    common = min(g["curve"][-1]["samples"], r["curve"][-1]["samples"])
    lg, lr = loss_at(g["curve"], common), loss_at(r["curve"], common)
    return {"slow": slow, "fast_rate_ratio": ratios, "fast_rate_ratio_min": min(ratios.values()),
            "equal_samples": common, "loss_global": lg, "loss_groups": lr,
            "loss_ratio": lr / lg if lg and lr else None,
            "rate_met": min(ratios.values()) >= TARGET_RATE,
            "loss_met": bool(lg and lr and abs(lr / lg - 1) <= TARGET_LOSS)}


def report(result: dict[str, Any], verdict: dict[str, Any]) -> list[str]:
    lines = []
    for kind in PLANS:
        p = result["plans"][kind]
        rates = ", ".join(f"{n} {v:.1f}" for n, v in sorted(p["cluster_samples_per_s"].items()))
        lines.append(f"{kind:<13} {p['samples_per_s']:.1f} samples/s ({rates}); predicted "
                     f"{p.get('predicted_samples_per_s', float('nan')):.1f}; window load average "
                     f"{p.get('load_average', float('nan')):.2f}; got {p.get('quota_received') or float('nan'):.2f} "
                     f"of the quotas")
    ratios = ", ".join(f"{n} {v:.2f}x" for n, v in sorted(verdict["fast_rate_ratio"].items()))
    lines.append(f"fast clusters in groups / under global rings: {ratios} (target >= {TARGET_RATE}x: "
                 f"{'met' if verdict['rate_met'] else 'NOT met'}); slow cluster {verdict['slow']}")
    lines.append(f"loss at {verdict['equal_samples']} samples: global rings {verdict['loss_global']:.4f}, groups "
                 f"{verdict['loss_groups']:.4f} ({verdict['loss_ratio']:.3f}x; target within {TARGET_LOSS:.0%}: "
                 f"{'met' if verdict['loss_met'] else 'NOT met'})")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-s", type=float, help="the window per plan (default: the scenario's)")
    p.add_argument("--from", dest="from_json", help="a result.json of an earlier run: compare it again")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
    else:
        result = testbed.run_scenario(SCENARIO, plans=PLANS, train_s=args.train_s)
    verdict = compare(result)
    print("\n".join(report(result, verdict)))
    print(f"load average after: {os.getloadavg()}; run dir {result.get('run_dir')}")
    if args.json:
        print(json.dumps({"verdict": verdict, "plans": {k: {x: v for x, v in result["plans"][k].items()
                                                            if x != "status_text"} for k in PLANS}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
