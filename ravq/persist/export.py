"""``ravq export``: one cluster's stage checkpoints as one model, written a tensor at a time.

Every stage 0..n-1 must be there, from the same run (``run_id``, or the run of the newest stage), agree
on n and have coexisted (the newest such set is taken); otherwise ``CheckpointError`` names the missing
stages and their nodes, the runs, or each stage's versions.  The
stages are read lazily (safetensors' ``safe_open``) and written by ``write_safetensors``: the PC that
exports holds one tensor at a time, never the model.

Given the model (on ``meta``, from the task), the export is checked against it (every tensor it
declares, nothing else) and written as the model loads it: a transformers model as a directory that
``from_pretrained`` reads (``config.json`` and ``model.safetensors``, a tied tensor once, under the
name the model keeps); any other model as one file whose ``load_file`` result
``load_state_dict(strict=True)`` takes (a tied tensor under each of its names, as ``state_dict`` has it).
A tensor held by several stages (tied weights) must be equal in all of them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ravq.persist import lineage
from ravq.persist.checkpoint import (
    CheckpointError,
    newest_run,
    runs_of,
    select_stage,
    stage_metas,
    stages_found,
)
from ravq.persist.safetensors_io import NAMES, Entry, write_safetensors


@dataclass(frozen=True, slots=True)
class _Source:
    stage: int
    path: Path
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def export_cluster(root: str | Path, out: str | Path, cluster: int = 0, run_id: str | None = None, *,
                   model: nn.Module | None = None) -> dict[str, Any]:
    """Write cluster ``cluster``'s model to ``out``; returns what was written."""
    root = Path(root)
    metas, paths = _stages(root, cluster, run_id)
    run_id = metas[0].get("run_id")
    sources = _sources(paths)
    _furthest_copies(sources, metas)
    names = list(sources)
    hf = model is not None and callable(getattr(getattr(model, "config", None), "to_json_file", None))
    if model is not None:
        names = _model_names(model, sources, keep_aliases=not hf)
    with contextlib.ExitStack() as files:
        opened = {s: files.enter_context(safe_open(str(p), framework="pt")) for s, p in enumerate(paths)}
        _check_tied(sources, opened)
        entries = [_entry(name, sources[name][0], opened) for name in names]
        metadata = {"format": "pt", "cluster": str(cluster), "run_id": str(run_id),
                    "versions": ",".join(str(m["version"]) for m in metas)}
        target = Path(out)
        if hf:
            assert model is not None
            target.mkdir(parents=True, exist_ok=True)
            model.config.to_json_file(str(target / "config.json"))  # type: ignore[union-attr, operator]
            target = target / "model.safetensors"
        tmp = target.with_name(f".{target.name}.tmp")
        try:
            size = write_safetensors(tmp, entries, metadata)
            tmp.replace(target)
        finally:
            tmp.unlink(missing_ok=True)
    return {
        "cluster": cluster,
        "stages": len(paths),
        "tensors": len(entries),
        "run_id": run_id,
        "bytes": size,
        "versions": [m["version"] for m in metas],
        "format": "transformers" if hf else "state_dict",
    }


def _stages(root: Path, cluster: int, run_id: str | None) -> tuple[list[dict[str, Any]], list[Path]]:
    found = stages_found(root, cluster)
    cdir = root / f"cluster{cluster}"
    if not found:
        raise FileNotFoundError(f"no stage checkpoints under {cdir}")
    run_id = run_id if run_id is not None else newest_run(root, cluster, found)
    chosen: dict[int, tuple[dict[str, Any], Path]] = {}
    other_runs: dict[int, set[str]] = {}
    for s in found:
        try:
            chosen[s] = select_stage(root, cluster, s, run_id)
        except FileNotFoundError:
            other_runs[s] = runs_of(root, cluster, s)
    counts = {meta["num_stages"] for meta, _ in chosen.values()}
    if len(counts) > 1:
        raise CheckpointError(f"{cdir}: stages of run {run_id} disagree on the number of stages "
                              f"({sorted(counts)}): checkpoints of different plans")
    num_stages = counts.pop() if counts else len(found)
    missing = [s for s in range(num_stages) if s not in chosen]
    if missing:
        nodes = next((m.get("cluster_nodes") for m, _ in chosen.values() if m.get("cluster_nodes")), None)
        what = ", ".join(f"stage {s}" + (f" (node {nodes[s]})" if nodes and s < len(nodes) else "")
                         + (f" [only run(s) {', '.join(sorted(other_runs[s]))}]" if s in other_runs else "")
                         for s in missing)
        raise CheckpointError(
            f"{cdir}: cluster {cluster} has {num_stages} stages; run {run_id} lacks {what}. "
            f"Copy each missing stage's {cdir.name}/stageN.* from the PC that trained it "
            "(or pass --run-id)"
        )
    chosen = _coexisting(root, cluster, run_id, chosen)
    return [chosen[s][0] for s in range(num_stages)], [chosen[s][1] for s in range(num_stages)]


def _coexisting(root: Path, cluster: int, run_id: str | None,
                newest: dict[int, tuple[dict[str, Any], Path]]) -> dict[int, tuple[dict[str, Any], Path]]:
    """The newest checkpoint of every stage such that all of them coexisted (``ravq.persist.lineage``: a
    power cut between two stages' saves leaves one a save ahead); one line naming each stage's
    checkpoints when none did."""
    stages = sorted(newest)
    if lineage.coexisted([lineage.Point.of(newest[s][0]) for s in stages]):
        return newest
    metas = [[m for m in stage_metas(root, cluster, s) if m.get("run_id") == run_id] for s in stages]
    points = [[lineage.Point.of(m) for m in ms] for ms in metas]
    choice = lineage.consistent_choice(points)
    if choice is None:
        raise CheckpointError(f"{root / f'cluster{cluster}'}: the stages of run {run_id} hold versions that "
                              f"never coexisted ({lineage.describe(points)}); export each stage's own PC's "
                              "newest checkpoints together, or train on until every stage saves again")
    return {
        s: select_stage(root, cluster, s, run_id, metas[i][choice[i]]["version"])
        for i, s in enumerate(stages)
    }


def _sources(paths: list[Path]) -> dict[str, list[_Source]]:
    """Model tensor name -> where each stage holding it keeps it, in stage order."""
    sources: dict[str, list[_Source]] = {}
    for stage, path in enumerate(paths):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if key.startswith("model."):
                    sl = f.get_slice(key)
                    sources.setdefault(key.removeprefix("model."), []).append(
                        _Source(stage, path, key, tuple(sl.get_shape()), NAMES[sl.get_dtype()]))
    return sources


def _furthest_copies(sources: dict[str, list[_Source]], metas: list[dict[str, Any]]) -> None:
    """Every name of a tied weight held by several stages (``ravq.cut.tied``) reads the copy that applied
    the most tied steps (each stage's checkpoint records them): one value under all its names, equal to
    every copy once training ended."""
    best: dict[str, tuple[int, int]] = {}
    names: dict[str, set[str]] = {}
    for stage, meta in enumerate(metas):
        for group in meta.get("tied", []):
            names.setdefault(group["key"], set()).update(group["names"])
            if group["key"] not in best or group["applied"] > best[group["key"]][0]:
                best[group["key"]] = (group["applied"], stage)
    for key, (_, stage) in best.items():
        source = next(s for n in sorted(names[key]) for s in sources.get(n, []) if s.stage == stage)
        for name in names[key]:
            sources[name] = [source]


def _model_names(model: nn.Module, sources: dict[str, list[_Source]], *, keep_aliases: bool) -> list[str]:
    """The names to write, in the model's order: its persistent state, a tied tensor once (transformers
    keeps the first name) or under every name; the stages must hold exactly that."""
    wanted = list(model.state_dict(keep_vars=True).keys())
    groups: dict[int, list[str]] = {}
    state = model.state_dict(keep_vars=True)
    for name in wanted:
        groups.setdefault(id(state[name]), []).append(name)
    for names in groups.values():  # a tied tensor stored by its stages under one of its names only
        held = next((n for n in names if n in sources), None)
        for n in names:
            if n not in sources and held is not None:
                sources[n] = sources[held]
    missing = [n for n in wanted if n not in sources]
    extra = [n for n in sources if n not in set(wanted)]
    if missing or extra:
        raise CheckpointError("the checkpoints do not hold the task's model: "
                              + (f"missing {', '.join(missing[:5])}" if missing else "")
                              + ("; " if missing and extra else "")
                              + (f"not in the model {', '.join(extra[:5])}" if extra else "")
                              + " (was the topology's task changed since training?)")
    if keep_aliases:
        return wanted
    return [names[0] for names in groups.values()]


def _check_tied(sources: dict[str, list[_Source]], opened: dict[int, Any]) -> None:
    """A tensor several stages hold (a tied weight) must be the same in each: export writes one."""
    for name, held in sources.items():
        for other in held[1:]:
            if not torch.equal(
                opened[held[0].stage].get_tensor(held[0].key), opened[other.stage].get_tensor(other.key)
            ):
                raise CheckpointError(
                    f"{name}: stages {held[0].stage} and {other.stage} hold different values of "
                    "this tied tensor (checkpoints of different steps?)"
                )


def _entry(name: str, source: _Source, opened: dict[int, Any]) -> Entry:
    return Entry(name, source.shape, source.dtype, lambda: opened[source.stage].get_tensor(source.key))

