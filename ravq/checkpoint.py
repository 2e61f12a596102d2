"""Stage checkpoints: safetensors for tensors, a small JSON for the rest; never pickle.

Layout: ``DIR/cluster{c}/stage{s}.safetensors`` + ``stage{s}.json``.  Both are written to a temporary
name, flushed and renamed; the JSON is renamed last and names the tensor file's size, so a crash
mid-write leaves the previous checkpoint intact and a torn pair is detected on load.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT = 1


@dataclass(kw_only=True, slots=True)
class StageCheckpoint:
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    meta: dict[str, Any]


def _paths(root: Path, cluster: int, stage: int) -> tuple[Path, Path]:
    d = root / f"cluster{cluster}"
    return d / f"stage{stage}.safetensors", d / f"stage{stage}.json"


def _write_atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[dict[str, torch.Tensor],
                                                                                     dict[str, Any]]:
    """Split an optimizer's state into named tensors and JSON-able rest (param indices -> names)."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{names[idx]}.{key}"] = value
            else:
                plain.setdefault(names[idx], {})[key] = value
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
              for g in sd["param_groups"]]
    return tensors, {"state": plain, "param_groups": groups}


def restore_optimizer(optimizer: torch.optim.Optimizer, names: list[str], tensors: dict[str, torch.Tensor],
                      rest: dict[str, Any]) -> None:
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, _, tail = key.partition(".")
        name, _, field = tail.rpartition(".")
        state.setdefault(index[name], {})[field] = value
    for name, fields in rest["state"].items():
        state.setdefault(index[name], {}).update(fields)
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in rest["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def save_stage(root: str | Path, *, cluster: int, stage: int, num_stages: int, node: str,
               module: torch.nn.Module, optimizer: torch.optim.Optimizer, version: int,
               data_position: int, extra: dict[str, Any] | None = None) -> Path:
    """Write one stage's checkpoint atomically; returns the JSON path."""
    root = Path(root)
    tensor_path, json_path = _paths(root, cluster, stage)
    tensor_path.parent.mkdir(parents=True, exist_ok=True)
    names = [n for n, _ in module.named_parameters()]
    tensors = {f"model.{k}": v.detach().to("cpu").contiguous().clone() for k, v in module.state_dict().items()}
    opt_tensors, opt_rest = optimizer_tensors(optimizer, names)
    tensors.update({k: v.detach().to("cpu").contiguous().clone() for k, v in opt_tensors.items()})
    _write_atomic(tensor_path, lambda p: save_file(tensors, str(p), metadata={"format": str(FORMAT)}))
    meta = {
        "format": FORMAT, "node": node, "cluster": cluster, "stage": stage, "num_stages": num_stages,
        "version": version, "data_position": data_position, "written_at": time.time(),
        "tensor_file": tensor_path.name, "tensor_bytes": tensor_path.stat().st_size,
        "optimizer": opt_rest, "parameter_names": names, **(extra or {}),
    }

    def write_json(p: Path) -> None:
        p.write_text(json.dumps(meta, indent=1, default=float))

    _write_atomic(json_path, write_json)
    return json_path


def load_stage(root: str | Path, cluster: int, stage: int) -> StageCheckpoint:
    tensor_path, json_path = _paths(Path(root), cluster, stage)
    if not json_path.exists():
        raise FileNotFoundError(f"no checkpoint for cluster {cluster} stage {stage} in {root}")
    meta = json.loads(json_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{json_path}: unknown checkpoint format {meta.get('format')!r}")
    if tensor_path.stat().st_size != meta["tensor_bytes"]:
        raise ValueError(f"{tensor_path}: size does not match {json_path.name} (torn write?)")
    tensors = load_file(str(tensor_path))
    model = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    optim = {k: v for k, v in tensors.items() if k.startswith("optim.")}
    return StageCheckpoint(model=model, optimizer={"tensors": optim, "rest": meta["optimizer"]}, meta=meta)


def export_cluster(root: str | Path, out: str | Path, cluster: int = 0) -> dict[str, Any]:
    """Merge the stages of one cluster into the unsplit model's state_dict, saved as safetensors."""
    root = Path(root)
    cdir = root / f"cluster{cluster}"
    metas = sorted(cdir.glob("stage*.json")) if cdir.is_dir() else []
    if not metas:
        raise FileNotFoundError(f"no stage checkpoints under {cdir}")
    num_stages = json.loads(metas[0].read_text())["num_stages"]
    state: dict[str, torch.Tensor] = {}
    versions = []
    for s in range(num_stages):
        ckpt = load_stage(root, cluster, s)
        overlap = set(state) & set(ckpt.model)
        assert not overlap, f"stages share tensors: {sorted(overlap)[:3]}"
        state.update(ckpt.model)
        versions.append(ckpt.meta["version"])
    _write_atomic(Path(out), lambda p: save_file(state, str(p), metadata={"cluster": str(cluster)}))
    return {"cluster": cluster, "stages": num_stages, "tensors": len(state), "versions": versions}
