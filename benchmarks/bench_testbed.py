"""Plans compared for real: the planner's plan, Ravnest's rule and a naive plan, each trained on the same
emulated PCs for the same wall time (benchmarks/testbed.py), against the cost model's predictions.

For every scenario (default: all of benchmarks/scenarios/*.yaml) the PCs are built once, profiled once
with ``ravq profile``, and each plan trains for the scenario's ``train_s`` after every node has started.
Reported per plan: measured samples/s, loss reached, predicted samples/s and predicted / measured.
Targets (issue #14):

- the planner's measured samples/s >= 1.5x Ravnest's rule's, where Ravnest's plan fits in memory;
- predicted within 15% of measured for every plan (issue #26; 25% in issue #14), from the profiles
  alone, and ``ravq simulate``'s figure from the same profiles too; the plans ranked as measured;
- the planner's plan the fastest of the three measured.  The planner's plan trains twice (first and
  last) unless --no-repeat: the mean is compared, and the two runs' difference is reported as the noise
  (a plan faster by less than that is "within noise").

    python benchmarks/bench_testbed.py                        # every scenario, ~10 minutes each
    flock /tmp/ravq-bench.lock python benchmarks/bench_testbed.py --no-repeat --json   # issue #26's run
    python benchmarks/bench_testbed.py benchmarks/scenarios/link_bound.yaml --train-s 30
    python benchmarks/bench_testbed.py --json                 # last line: one JSON object

Needs root (network namespaces, tc, cgroups).  The PCs share this machine's cores with everything else
running on it; the figures are as noisy as the machine is.
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

SCENARIOS = sorted((Path(__file__).resolve().parent / "scenarios").glob("*.yaml"))
TARGET_RAVNEST = 1.5
TARGET_PREDICTION = 0.15
"""Issue #26: predicted (cost model) and simulated (``ravq simulate``), both from the profiles alone,
within 15% of measured for every plan trained (issue #14's target was 25%)."""


def judge(result: dict[str, Any]) -> dict[str, Any]:
    plans = {k: v for k, v in result["plans"].items() if not v.get("error")}
    measured = {k: v["samples_per_s"] for k, v in plans.items()}
    verdict: dict[str, Any] = {"measured_over_predicted": {
        k: v["samples_per_s"] / v["predicted_samples_per_s"] for k, v in plans.items()}}
    verdict["prediction_met"] = all(abs(r - 1) <= TARGET_PREDICTION
                                    for r in verdict["measured_over_predicted"].values())
    verdict["measured_over_simulated"] = {k: v["samples_per_s"] / v["simulated_samples_per_s"]
                                          for k, v in plans.items() if v.get("simulated_samples_per_s")}
    verdict["simulation_met"] = all(abs(r - 1) <= TARGET_PREDICTION
                                    for r in verdict["measured_over_simulated"].values())
    verdict["ranking"] = ranking(plans)
    # The PCs share this machine's cores with other work, which changes between profiling and training:
    # the load-adjusted prediction re-scores the plan with each PC's speed scaled by the CPU share it
    # got in the window over the share it got while profiled (testbed.Testbed.speed_vs_profile).
    verdict["quota_received"] = {k: v.get("quota_received") for k, v in plans.items()}
    verdict["measured_over_load_adjusted"] = {
        k: v["samples_per_s"] / v["predicted_load_adjusted"] for k, v in plans.items()
        if v.get("predicted_load_adjusted")}
    verdict["load_adjusted_prediction_met"] = all(abs(r - 1) <= TARGET_PREDICTION
                                                  for r in verdict["measured_over_load_adjusted"].values())
    # What a CPU second computes here moves with the virtual machine's host by tens of percent within
    # minutes, and the plans train one after another for 10-40 minutes after the one profile.  The
    # prediction from fresh compute is the cost model (and ``ravq simulate``) on the same profiles with
    # each PC's speed scaled by its training FLOP/s probed just before the plan trains over its
    # profile's (testbed.Testbed.host_vs_profile): nothing measured in the run goes into it.
    for name, key in (("fresh", "predicted_fresh"), ("fresh_simulated", "simulated_fresh")):
        ratios = {k: v["samples_per_s"] / v[key] for k, v in plans.items() if v.get(key)}
        verdict[f"measured_over_{name}"] = ratios
        verdict[f"{name}_met"] = bool(ratios) and len(ratios) == len(plans) and all(
            abs(r - 1) <= TARGET_PREDICTION for r in ratios.values())
    if "planner" in measured and "ravnest" in measured:
        verdict["planner_over_ravnest"] = measured["planner"] / measured["ravnest"]
        verdict["ravnest_met"] = verdict["planner_over_ravnest"] >= TARGET_RAVNEST
    else:
        verdict["ravnest_met"] = None  # Ravnest's plan does not fit: not scored
    if "planner" in measured:
        # A plan identical to the planner's was not trained again (a tie).  With --repeat the planner's plan
        # ran twice: its mean is compared, and a plan faster by less than the two runs differ is within noise.
        runs = [measured["planner"], *([plans["planner"]["repeat_samples_per_s"]]
                                       if plans["planner"].get("repeat_samples_per_s") else [])]
        mean = sum(runs) / len(runs)
        verdict["planner_runs"] = runs
        verdict["noise"] = (max(runs) - min(runs)) / mean
        others = [v for k, v in measured.items() if k != "planner" and not plans[k].get("same_plan_as")]
        best_other = max(others, default=0.0)
        verdict["planner_over_best_other"] = mean / best_other if best_other else None
        verdict["planner_best"] = mean >= best_other
        verdict["planner_best_within_noise"] = mean >= best_other * (1 - verdict["noise"])
        verdict["same_plan"] = {k: v["same_plan_as"] for k, v in plans.items() if v.get("same_plan_as")}
    return verdict


def ranking(plans: dict[str, Any]) -> dict[str, Any]:
    """The distinct plans trained, ordered by measured samples/s, by the cost model's prediction and by
    the simulation from profiles; whether each order is the measured one."""
    trained = {k: v for k, v in plans.items() if not v.get("same_plan_as")}
    measured = sorted(trained, key=lambda k: -trained[k]["samples_per_s"])
    out: dict[str, Any] = {"measured": measured}
    for name, key in (("predicted", "predicted_samples_per_s"), ("simulated", "simulated_samples_per_s")):
        if all(trained[k].get(key) for k in trained):
            order = sorted(trained, key=lambda k: -trained[k][key])
            out[name], out[f"{name}_matches"] = order, order == measured
    return out


def rejudge(path: Path) -> None:
    """Judge a saved --json output again (the last line of a bench_testbed.py run)."""
    data = json.loads(path.read_text().strip().splitlines()[-1])
    for result in data["scenarios"]:
        print(result["scenario"], json.dumps(judge(result), indent=1))


def uptime() -> str:
    """The machine's load averages (1, 5, 15 minutes): every figure here is as noisy as they are high."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", type=Path, default=SCENARIOS)
    parser.add_argument("--plans", help="comma-separated plans (default: the scenario's plans, else "
                        "planner,ravnest,naive)")
    parser.add_argument("--train-s", type=float)
    parser.add_argument("--cores", type=float, help="cores the PCs may use in all (see testbed.py --cores)")
    parser.add_argument("--no-repeat", action="store_true", help="train the planner's plan once, not twice")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: the first scenario, the planner's plan and Ravnest's, 15 s each, once")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.scenarios, args.plans = args.scenarios[:1], "planner,ravnest"
        args.train_s, args.no_repeat = args.train_s or 15.0, True
    results = []
    print(f"uptime: {uptime()}", flush=True)
    for path in args.scenarios:
        plans = args.plans.split(",") if args.plans else testbed.load_scenario(path).plans or list(testbed.PLANS)
        try:
            result = testbed.run_scenario(path, plans, train_s=args.train_s, cores=args.cores,
                                          repeat=not args.no_repeat)
        except (RuntimeError, OSError, ValueError) as err:  # one scenario failing keeps the others' figures
            print(f"scenario {path.stem} failed: {err}", flush=True)
            results.append({"scenario": path.stem, "error": str(err)})
            continue
        result["verdict"] = judge(result)
        results.append(result)
        for line in testbed.report_lines(result):
            print(line)
        v = result["verdict"]
        ratios = ", ".join(f"{k} {r:.2f}" for k, r in v["measured_over_predicted"].items())
        print(f"  measured/predicted: {ratios} (within {TARGET_PREDICTION:.0%}: {v['prediction_met']})")
        simulated = ", ".join(f"{k} {r:.2f}" for k, r in v["measured_over_simulated"].items())
        print(f"  measured/simulated from profiles: {simulated} (within {TARGET_PREDICTION:.0%}: "
              f"{v['simulation_met']})")
        rank = v["ranking"]
        print(f"  ranking measured {' > '.join(rank['measured'])}; predicted {' > '.join(rank.get('predicted', []))} "
              f"(matches: {rank.get('predicted_matches')}); simulated {' > '.join(rank.get('simulated', []))} "
              f"(matches: {rank.get('simulated_matches')}); uptime {uptime()}", flush=True)
        adjusted = ", ".join(f"{k} {r:.2f}" for k, r in v["measured_over_load_adjusted"].items())
        print(f"  measured/load-adjusted prediction: {adjusted} (within {TARGET_PREDICTION:.0%}: "
              f"{v['load_adjusted_prediction_met']})")
        for name, what in (("fresh", "prediction"), ("fresh_simulated", "simulation")):
            if v[f"measured_over_{name}"]:
                ratios = ", ".join(f"{k} {r:.2f}" for k, r in v[f"measured_over_{name}"].items())
                print(f"  measured/{what} from fresh compute: {ratios} (within {TARGET_PREDICTION:.0%}: "
                      f"{v[f'{name}_met']})")
        if v.get("planner_over_ravnest") is not None:
            print(f"  planner / ravnest measured: {v['planner_over_ravnest']:.2f} (target >= {TARGET_RAVNEST})")
        noise = f"; the planner's plan ran {' and '.join(f'{r:.1f}' for r in v['planner_runs'])} (noise {v['noise']:.1%})" \
            if len(v.get("planner_runs", [])) > 1 else ""
        ratio = v.get("planner_over_best_other")
        print(f"  planner's plan fastest measured: {v.get('planner_best')} (over the next best: "
              f"{'-' if ratio is None else f'{ratio:.3f}'}{noise}; within noise: {v.get('planner_best_within_noise')})",
              flush=True)
    print(f"uptime: {uptime()}", flush=True)
    if args.json:
        print(json.dumps({"scenarios": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
