"""The curve over the number of clusters (issue #38 part 4): samples and wall time to a target loss, global
rings against group averaging, for C = 1, 2, 4, 8 clusters of one stage each (``bench_convergence.py
--clusters 1,2,4,8``).

Every cluster is the task's unsplit model from the same seed with its own optimizer (the task's: the demo
task's ClusterAdam, told C as a node tells it: fewer in effect when paced by rate) and its own data shard,
trained in this one process.  Every ``sync_every`` steps the clusters average: global mode in one group of
all C, groups mode in the groups ``ravq.average.groups.groups_for`` derives (the node's own derivation, grid
places shuffled per cycle).  As ravq's defaults do (overlap_averaging, averaging_lead 1), a round averages
snapshots while its members train on; one step later each member waits for its round to end, then adds
(group mean - its snapshot) to its weights, keeping the step it took meanwhile.

Wall time is a virtual clock, not this machine's: two shared cores cannot run 8 PCs.  A cluster's step
takes ``step_s`` (this task's median measured step time here, times ``--slow`` for the last cluster when
given); a round ends for a group when its slowest member reaches it plus the ring's time on the modelled
links: 2(n-1)/n of the model's float32 bytes at ``--link-mbit`` and 2(n-1) hops of ``--latency-ms``
(float32 rings; ravq's default int8 rings would send about a quarter of those bytes).  With ``--slow`` a
third mode, ``rates``, orders the grid by the clusters' rates (ravq.average.groups' rate-aware places), and
a fourth, ``paced``, paces rounds by rate (``ravq.planner.pacing``): the slow cluster trains its share of
each round's ``sync_every`` steps (round(sync_every / slow)), so it no longer holds the others, and the
groups (as ``groups``) mix each cluster by the samples it trained since its last round.

The target loss is one cluster's smoothed training loss after ``budget`` micro-batches (the trailing mean
over ``window`` steps, as bench_convergence's references); for C clusters the swarm reaches it at the first
step where the clusters' mean smoothed loss is at or below it: samples C x steps x micro_batch, and the
virtual time at which the last cluster finished that step.
"""

from __future__ import annotations

import importlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ravq.average.groups import Mode, groups_for
from ravq.cut.split import build_task_model
from ravq.planner.pacing import effective_clusters, mix_weights, round_steps
from ravq.stage.optim import set_clusters


@dataclass(kw_only=True, slots=True)
class CurveSettings:
    task: str
    micro_batch: int
    sync_every: int
    group_size: int
    budget: int
    """Micro-batches one cluster trains to set the target loss."""
    window: int
    seed: int
    links: list[tuple[float, float]]
    """Modelled ring links, each (Mbit/s, ms per hop): one virtual clock each, over the same training."""
    slow: float = 1.0
    step_ms: float | None = None
    """A step's virtual time; None: the median measured here."""
    """How many times slower than the others the last cluster steps (1: all alike)."""
    headroom: float = 5.0
    """A swarm trains at most this many times the budget's samples before it is called short."""


@dataclass(slots=True)
class Run:
    clusters: int
    mode: str
    losses: list[list[float]] = field(default_factory=list)
    finished_s: list[list[float]] = field(default_factory=list)
    """Per link model: virtual seconds at which the slowest cluster finished each step."""
    rounds: int = 0
    reached_step: int | None = None
    samples: list[int] = field(default_factory=list)
    """Per step of the loop, the micro-batches all clusters trained so far."""


def trailing_mean(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def ring_seconds(members: int, nbytes: int, link: tuple[float, float]) -> float:
    """A ring round of ``members`` over a modelled link: bytes streamed plus each hop's latency."""
    mbit, latency_ms = link
    wire = 2 * (members - 1) / members * nbytes * 8 / (mbit * 1e6)
    return wire + 2 * (members - 1) * latency_ms / 1000


def train(clusters: int, mode: str, s: CurveSettings, step_s: float | None, target: float | None,
          max_steps: int) -> tuple[Run, list[float]]:
    """Train ``clusters`` clusters for up to ``max_steps`` steps each (stopping ``window`` steps after the
    target is reached); returns the run and the real seconds each step of cluster 0 took."""
    task = importlib.import_module(s.task)
    torch.set_num_threads(1)
    models = [build_task_model(task, s.seed) for _ in range(clusters)]
    opts = [task.make_optimizer(m.parameters()) for m in models]
    slow = s.slow if clusters > 1 else 1.0
    share = round_steps(s.sync_every, [1.0] * (clusters - 1) + [1.0 / slow]) if mode == "paced" else None
    for opt in opts:  # as a node tells it: every cluster, fewer in effect when paced (ravq.planner.pacing)
        set_clusters(opt, effective_clusters(share) if share is not None else clusters)
    data = [task.train_batches(s.micro_batch, c, clusters, s.seed) for c in range(clusters)]
    nbytes = sum(p.numel() * 4 for p in models[0].parameters())
    run = Run(clusters, mode, losses=[[] for _ in range(clusters)], finished_s=[[] for _ in s.links])
    clocks = [[0.0] * clusters for _ in s.links]
    timed: list[float] = []
    pending: dict[int, tuple[int, list[float], list[torch.Tensor], list[torch.Tensor]]] = {}
    """Cluster -> (step after which its round applies, when the round ends, its snapshot, the mean)."""
    trained = 0
    for step in range(max_steps):
        for c in range(clusters):
            if share is not None and (step + 1) * share[c] // s.sync_every == step * share[c] // s.sync_every:
                continue  # paced by rate: not this cluster's turn (its own pace: share[c] of every sync_every)
            trained += 1
            inputs, targets = next(data[c])
            t0 = time.perf_counter()
            loss = task.loss_fn(models[c](*inputs), targets)
            opts[c].zero_grad()
            loss.backward()
            opts[c].step()
            if c == 0:
                timed.append(time.perf_counter() - t0)
            run.losses[c].append(float(loss.detach()))
            for clock in clocks:  # paced: the slow cluster's fewer steps take as long as the others' steps
                clock[c] += (step_s or timed[-1]) * (slow if c == clusters - 1 else 1.0)
            if c in pending and pending[c][0] <= step:  # averaging_lead 1: wait for the round, then apply
                _, ends, snapshot, mean = pending.pop(c)
                for clock, end in zip(clocks, ends):
                    clock[c] = max(clock[c], end)
                _apply(models[c], snapshot, mean)
        if (step + 1) % s.sync_every == 0 and clusters > 1:
            for group in _groups(run.rounds, clusters, mode, s):
                if len(group) < 2:
                    continue
                snapshots = {c: _floats(models[c]) for c in group}
                weights = mix_weights(group, share) if share is not None else dict.fromkeys(group, 1 / len(group))
                mean = [sum(weights[c] * x for c, x in zip(group, t)) for t in zip(*snapshots.values())]
                ends = [max(clock[c] for c in group) + ring_seconds(len(group), nbytes, link)
                        for clock, link in zip(clocks, s.links)]
                pending.update({c: (step + 1, ends, snapshots[c], mean) for c in group})
            run.rounds += 1
        run.samples.append(trained * s.micro_batch)
        for finished, clock in zip(run.finished_s, clocks):
            finished.append(max(clock))
        if target is not None and run.reached_step is None:
            smooth = [sum(losses[-s.window:]) / max(1, len(losses[-s.window:])) for losses in run.losses]
            if step + 1 >= s.window and sum(smooth) / clusters <= target:
                run.reached_step = step + 1
        if run.reached_step is not None and step + 1 >= run.reached_step + s.window:
            break
    return run, timed


def _groups(round_index: int, clusters: int, mode: str, s: CurveSettings) -> list[tuple[int, ...]]:
    """The round's groups: ravq's derivation; ``rates`` orders the grid by the clusters' step rates."""
    if mode == "paced":
        mode = "groups"
    if mode == "rates":
        rates = {c: 1 / s.slow if c == clusters - 1 else 1.0 for c in range(clusters)}
        return groups_for(0, round_index, range(clusters), "groups", s.group_size, rates)
    assert mode in ("global", "groups")
    grid: Mode = "global" if mode == "global" else "groups"
    return groups_for(0, round_index, range(clusters), grid, s.group_size)


def _floats(model: torch.nn.Module) -> list[torch.Tensor]:
    """A snapshot of the model's floating-point tensors (what ravq averages)."""
    return [t.detach().clone() for t in model.state_dict().values() if t.is_floating_point()]


@torch.no_grad()
def _apply(model: torch.nn.Module, snapshot: list[torch.Tensor], mean: list[torch.Tensor]) -> None:
    """Add (mean - snapshot) to the live weights: the round's result, keeping the step taken since."""
    live = [t for t in model.state_dict().values() if t.is_floating_point()]
    for t, before, after in zip(live, snapshot, mean, strict=True):
        t.add_(after - before)


def curve(counts: list[int], s: CurveSettings) -> dict[str, Any]:
    """The target from one cluster, then each count in global and groups mode (once when they agree)."""
    base, timed = train(1, "global", s, None, None, s.budget)
    step_s = s.step_ms / 1000 if s.step_ms else statistics.median(timed)
    target = trailing_mean(base.losses[0], s.window)[-1]
    rows = []
    for clusters in counts:
        same = clusters <= s.group_size  # groups mode is then one group of all: global rings
        slowed = ("rates", "paced") if s.slow != 1 and clusters > 1 else ()
        for mode in ("global", *(("paced",) if slowed else ())) if same else ("global", "groups", *slowed):
            max_steps = int(s.headroom * s.budget / clusters) + s.window
            run, _ = train(clusters, mode, s, step_s, target, max_steps)
            k = run.reached_step
            rows.append({"clusters": clusters, "mode": mode if not same or mode == "paced" else "global=groups",
                         "reached_step": k, "samples": run.samples[k - 1] if k else None,
                         "virtual_s": [f[k - 1] for f in run.finished_s] if k else None, "rounds": run.rounds,
                         "trained_steps": len(run.losses[0])})
    return {"target_loss": target, "step_s": step_s, "rows": rows}


def print_curve(result: dict[str, Any], s: CurveSettings) -> None:
    print(f"target loss {result['target_loss']:.4f}: one cluster's mean of the last {s.window} losses after "
          f"{s.budget} micro-batches of {s.micro_batch}; step {result['step_s'] * 1000:.1f} ms "
          f"({'given' if s.step_ms else 'median, here'})"
          f"{f', the last cluster {s.slow:g}x slower' if s.slow != 1 else ''}; sync_every {s.sync_every}, "
          f"groups of {s.group_size}")
    one = next((r for r in result["rows"] if r["clusters"] == 1 and r["samples"]), None)
    by_count = {r["clusters"]: r for r in result["rows"] if r["mode"].startswith("global")}
    links = "".join(f" {f'{m:g}Mb/{ms:g}ms s':>15} {'x 1 cl':>7}" for m, ms in s.links)
    print(f"{'clusters':>8} {'mode':>14} {'samples':>8} {'x 1 cl':>7} {'x global':>9} {'rounds':>7}{links}")
    for r in result["rows"]:
        glob = by_count.get(r["clusters"])
        x_one = r["samples"] / one["samples"] if one and r["samples"] else None
        x_glob = r["samples"] / glob["samples"] if glob and glob["samples"] and r["samples"] else None
        times = "".join(f" {_f(t, '.1f', 15)} {_f(t / t1 if t and t1 else None, '.3f', 7)}"
                        for t, t1 in zip(r["virtual_s"] or [None] * len(s.links),
                                         one["virtual_s"] if one else [None] * len(s.links)))
        print(f"{r['clusters']:>8} {r['mode']:>14} {_f(r['samples'], 'd', 8)} {_f(x_one, '.3f', 7)} "
              f"{_f(x_glob, '.3f', 9)} {r['rounds']:>7}{times}")


def _f(value: float | None, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"
