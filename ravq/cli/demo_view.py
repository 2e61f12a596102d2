"""The demo's live display and final summary (the CLI's own output)."""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.live import Live
from rich.table import Table

from ravq.cli.status import status_once
from ravq.config import Topology

FIRST_ANSWER_S = 3.0
"""How long the demo waits for the broker's first status answer (it may still be importing: about 1 s
here).  Longer costs a run whose broker never answers (a plan error) as much in time to report it."""


class Followed(Protocol):
    """What the view asks of the demo's processes (``ravq.cli.demo.Swarm``)."""

    def running(self) -> list[str]: ...

    def failed(self) -> list[str]: ...


class RateMeter:
    """A count's rate over the last ``window_s`` seconds: what the swarm does now, not diluted by start-up."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._points: deque[tuple[float, int]] = deque()

    def update(self, now: float, count: int) -> float:
        points = self._points
        if points and count < points[-1][1]:  # a restarted count (a node came back): start over
            points.clear()
        points.append((now, count))
        while len(points) > 2 and now - points[1][0] >= self.window_s:
            points.popleft()  # keep the newest point that is at least window_s old, and all after it
        t0, c0 = points[0]
        return (count - c0) / (now - t0) if now > t0 else 0.0


class LiveView:
    """Polls the broker and shows per-node progress; a plain line every few seconds when not a TTY."""

    def __init__(
        self,
        topology: Topology,
        quiet: bool,
        key_dir: Path | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.topology, self.quiet, self.key_dir = topology, quiet, key_dir
        self.clock, self.sleep = clock, sleep
        """What polls are timed and paced with (tests pass a virtual pair)."""
        self.console = Console(stderr=False)
        self.interactive = self.console.is_terminal and not quiet
        self.live: Live | None = None
        self.started = self.clock()
        self.steps = topology.training.steps * max(1, len({n.cluster for n in topology.nodes}))
        self.rate = RateMeter()

    def follow(self, swarm: Followed, stall_s: float) -> bool:
        """Until every node exits; False if one failed, or if no node made progress for ``stall_s``
        seconds (0: wait forever).  A long healthy run is never cut short: only a stalled one is."""

        if self.interactive:
            self.live = Live(self._table(None), console=self.console, refresh_per_second=4)
            self.live.start()
        last_line = 0.0
        progress, progressed_at = -1, self.clock()
        answered = False
        while swarm.running():
            if swarm.failed():
                return False
            # Until the broker first answers, wait longer: a request given up while the broker (still
            # starting) runs its handshake shows in its log as a refused connection (handshake_failed).
            status = status_once(self.topology, self.key_dir, timeout_s=1.0 if answered else FIRST_ANSWER_S)
            answered = answered or status is not None
            done = _work_done(status)
            if done > progress:
                progress, progressed_at = done, self.clock()
            elif stall_s and self.clock() - progressed_at > stall_s:
                print(f"ravq demo: no progress for {stall_s:.0f}s (--timeout); stopping", file=sys.stderr)
                return False
            if self.live is not None:
                self.live.update(self._table(status))
            elif not self.quiet and self.clock() - last_line > 5.0 and status:
                last_line = self.clock()
                print(self._line(status), flush=True)
            self.sleep(0.5)
        return not swarm.failed()

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def _rows(self, status: dict[str, Any] | None) -> list[tuple[str, dict[str, Any], str]]:
        members = (status or {}).get("members", {})
        return [(n.name, members.get(n.name, {}).get("stats", {}), members.get(n.name, {}).get("state", "-"))
                for n in self.topology.nodes]

    def _progress(self, status: dict[str, Any] | None) -> tuple[int, float, float | None]:
        rows = self._rows(status)
        depth: dict[Any, int] = {}
        for _, st, _ in rows:
            if st.get("cluster") is not None:
                depth[st["cluster"]] = max(depth.get(st["cluster"], -1), st.get("stage", -1))
        last = [st for _, st, _ in rows if st and st.get("stage") == depth.get(st.get("cluster"))]
        samples = sum(st.get("samples", 0) for st in last)
        steps = sum(st.get("backwards", 0) for st in last)
        rate = self.rate.update(self.clock(), samples) if status else 0.0
        losses = [st["loss_recent"] for st in last if st.get("loss_recent") is not None]
        return steps, rate, (sum(losses) / len(losses) if losses else None)

    def _line(self, status: dict[str, Any]) -> str:
        steps, rate, loss = self._progress(status)
        loss_text = f"{loss:.3f}" if loss is not None else "-"
        elapsed_s = self.clock() - self.started
        return f"[{elapsed_s:6.1f}s] steps {steps}/{self.steps}  {rate:7.1f} samples/s  loss {loss_text}"

    def _table(self, status: dict[str, Any] | None) -> Table:
        steps, rate, loss = self._progress(status)
        loss_text = f"{loss:.3f}" if loss is not None else "-"
        table = Table(title=f"ravq demo  steps {steps}/{self.steps}  {rate:.1f} samples/s  loss {loss_text}")
        for col in ("node", "state", "cluster/stage", "version", "busy", "stale (upd.)", "in flight", "loss"):
            table.add_column(col, justify="right")
        for name, st, state in self._rows(status):
            table.add_row(
                name,
                state,
                f"{st.get('cluster', '-')}/{st.get('stage', '-')}",
                str(st.get("version", "-")),
                f"{st.get('busy_fraction', 0):.2f}",
                f"{st.get('staleness_updates', st.get('staleness_mean', 0)):.2f}",
                str(st.get("inflight", "-")),
                f"{st['loss_recent']:.3f}" if st.get("loss_recent") is not None else "",
            )
        return table

    def print_summary(self, report: dict[str, Any]) -> None:
        c = self.console
        def loss(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        c.print(
            f"\n[bold]ravq demo finished[/bold] in {report['wall_seconds']:.1f}s: {report['steps']} steps, "
            f"{report['samples_per_second']:.1f} samples/s; loss {loss(report['initial_loss'])} -> "
            f"{loss(report['final_loss'])}"
        )
        table = Table()
        for col in ("node", "cluster", "stage", "busy", "stale (updates)", "sent MB", "received MB"):
            table.add_column(col, justify="right")
        for n in report["nodes"]:
            stale = n.get("staleness_updates")
            stale = n["staleness_mean"] if stale is None else stale
            table.add_row(n["name"], str(n["cluster"]), str(n["stage"]), f"{n['busy_fraction']:.2f}",
                          f"{stale:.2f}", f"{n['bytes_sent'] / 1e6:.1f}", f"{n['bytes_received'] / 1e6:.1f}")
        c.print(table)
        self._print_asynchrony(report)
        if report.get("eval_loss"):
            curve = report["eval_loss"]
            shown = curve[:: max(1, len(curve) // 6)]
            shown += [] if shown[-1] == curve[-1] else curve[-1:]
            c.print("validation loss (held-out data, eval mode) at step: "
                    + " -> ".join(f"{loss:.3f}@{step}" for step, loss in shown))
        if report.get("allreduce_rounds"):
            rounds, mean_s = report["allreduce_rounds"], report["allreduce_seconds_mean"]
            c.print(f"all-reduce: {rounds} rounds, mean {mean_s:.3f}s")


    def _print_asynchrony(self, report: dict[str, Any]) -> None:
        """The batch, what "stale (updates)" means, and the nodes whose asynchrony guard warned."""
        c = self.console
        if report.get("batch"):
            c.print(f"batch {report['batch']} samples per optimizer step, {report['update_every']} "
                    "micro-batch(es) per cluster and step; stale (updates): the mean staleness of the latest "
                    "backwards, in optimizer updates")
        for n in report["nodes"]:
            if n.get("asynchrony_warning"):
                c.print(f"[bold]{n['name']}: asynchrony hurts[/bold] (stale and fresh gradients agree with "
                        f"cosine {n.get('stale_cosine') or 0:.2f}): try --max-inflight 1 or a larger --batch")


def _work_done(status: dict[str, Any] | None) -> int:
    """Forwards plus backwards of every node the broker reports: grows while anything trains."""
    members = (status or {}).get("members", {})
    return sum(int(st.get("forwards", 0)) + int(st.get("backwards", 0))
               for st in ((m.get("stats") or {}) for m in members.values()))


def _cluster_mean_curve(histories: list[list[list[float]]]) -> list[list[float]]:
    """[step, validation loss averaged over the clusters that evaluated at that step], by step."""
    by_step: dict[int, list[float]] = {}
    for history in histories:
        for step, loss in history:
            by_step.setdefault(int(step), []).append(loss)
    return [[step, sum(v) / len(v)] for step, v in sorted(by_step.items())]


def _batch(data: dict[str, Any], clusters: int) -> dict[str, int]:
    """The run's batch and the accumulation the nodes derived from it (``ravq.config.batch``)."""
    training = data.get("training", {})
    micro_batch = int(training.get("micro_batch", 16))
    batch = training.get("batch") or micro_batch * clusters * int(training.get("update_every", 1))
    return {"batch": int(batch), "update_every": max(1, int(batch) // (micro_batch * max(1, clusters)))}


def summarize(run_dir: Path, data: dict[str, Any], wall_s: float) -> dict[str, Any] | None:
    """The demo report, from the summaries the nodes wrote at exit (None when none did)."""
    nodes = []
    for node in data["nodes"]:
        path = run_dir / f"summary-{node['name']}.json"
        try:
            nodes.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # a node that crashed or was killed before writing one
            continue
    nodes = [n for n in nodes if "wall_s" in n]  # a node that failed before training wrote no statistics
    if not nodes:
        return None
    per_cluster: dict[int, list[dict[str, Any]]] = {}
    for n in nodes:
        per_cluster.setdefault(n["cluster"], []).append(n)
    lasts = [max(members, key=lambda m: m["stage"]) for members in per_cluster.values()]
    train_wall = max(n["wall_s"] for n in nodes) or wall_s
    samples = sum(n["samples"] for n in lasts)
    initial = [n["loss_initial"] for n in lasts if n.get("loss_initial") is not None]
    evals = [n["eval_history"] for n in lasts if n.get("eval_history")]
    final = [n["loss_recent"] for n in lasts if n.get("loss_recent") is not None]
    rounds = [n.get("allreduce_rounds", 0) for n in nodes]
    ar_means = [n["allreduce_seconds_mean"] for n in nodes if n.get("allreduce_seconds_mean")]
    return {
        "samples_per_second": samples / train_wall if train_wall else 0.0,
        "initial_loss": sum(initial) / len(initial) if initial else None,
        "final_loss": sum(final) / len(final) if final else None,
        "steps": sum(n["backwards"] for n in lasts), "samples": samples, "wall_seconds": wall_s,
        "train_seconds": train_wall, "clusters": len(per_cluster),
        "allreduce_rounds": min(rounds) if rounds else 0,
        "allreduce_seconds_mean": sum(ar_means) / len(ar_means) if ar_means else 0.0,
        "eval_loss": _cluster_mean_curve(evals),
        **_batch(data, len(per_cluster)),
        "nodes": [{k: n.get(k) for k in ("name", "cluster", "stage", "busy_fraction", "staleness_mean",
                                          "staleness_updates", "stale_cosine", "asynchrony_warning",
                                          "bytes_sent", "bytes_received", "version", "samples",
                                          "allreduce_rounds", "allreduce_seconds_mean", "bad_messages",
                                          "payload_wire_bytes_sent", "payload_logical_bytes_sent")}
                  for n in nodes],
    }
