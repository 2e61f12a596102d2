"""Stage checkpoints: safetensors for tensors, a small JSON for the rest; never pickle.

Layout: ``DIR/cluster{c}/stage{s}.safetensors`` + ``stage{s}.json`` (the newest checkpoint) and
``stage{s}.prev.safetensors`` + ``stage{s}.prev.json`` (the one before).  A pair is one unit: both
carry the same random ``checkpoint_id`` (the tensor file in its safetensors metadata) and the JSON
names the tensor file's size and SHA-256, and the run id of the training run.  A save writes both to
temporary names, fsyncs them, moves the current pair to ``.prev`` and renames the new pair in; loading
matches JSON and tensors by id across the four files, so a save killed at any point, a torn pair
(tensors of one save beside the JSON of another) or a corrupt file leaves a loadable checkpoint: the
newest pair that checks out, else the previous one.  Temporary files of a killed save are removed
when the stage next starts (``remove_temp_files``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ravq.persist.safetensors_io import entry, write_safetensors

log = logging.getLogger(__name__)

FORMAT = 2


class CheckpointError(ValueError):
    """No usable checkpoint, or checkpoints that do not belong together; ``str()`` is one line."""


@dataclass(kw_only=True, slots=True)
class StageCheckpoint:
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    meta: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _Files:
    tensors: Path
    meta: Path
    prev_tensors: Path
    prev_meta: Path

    @classmethod
    def of(cls, root: Path, cluster: int, stage: int) -> _Files:
        d = root / f"cluster{cluster}"
        return cls(d / f"stage{stage}.safetensors", d / f"stage{stage}.json",
                   d / f"stage{stage}.prev.safetensors", d / f"stage{stage}.prev.json")


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write: Any) -> None:
    tmp = _temp_path(path)
    write(tmp)
    _fsync(tmp)
    os.replace(tmp, path)


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _tensor_file_id(path: Path) -> str | None:
    """The checkpoint id in a safetensors file's metadata (None: missing, torn or not ours)."""
    if path.exists() and not os.access(path, os.R_OK):
        raise CheckpointError(
            f"{path}: permission denied (owner uid {path.stat().st_uid}, mode "
            f"{path.stat().st_mode & 0o777:04o}); make it readable by the user running ravq"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("checkpoint_id")
    except Exception:  # noqa: BLE001 - a torn or foreign file may raise anything
        return None


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and isinstance(meta.get("checkpoint_id"), str) else None


def optimizer_names(optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor]) -> list[str]:
    """Parameter names in the optimizer's own order: its state dict numbers parameters group by group,
    which is not the module's order once a task builds groups (e.g. no weight decay on biases)."""
    name_of = {id(p): n for n, p in params.items()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


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
               data_position: int, run_id: str | None = None, cluster_nodes: list[str] | None = None,
               extra: dict[str, Any] | None = None) -> Path:
    """Write one stage's checkpoint (the previous one is kept as ``.prev``); returns the JSON path."""
    files = _Files.of(Path(root), cluster, stage)
    files.tensors.parent.mkdir(parents=True, exist_ok=True)
    names = optimizer_names(optimizer, dict(module.named_parameters()))
    # written tensor by tensor from the live state (this runs in the compute thread, or after it ended):
    # no copy of the stage or of its optimizer state
    tensors = {f"model.{k}": v for k, v in module.state_dict().items()}
    opt_tensors, opt_rest = optimizer_tensors(optimizer, names)
    tensors.update(opt_tensors)
    checkpoint_id = secrets.token_hex(8)
    # A directory of this save's own: safetensors itself writes through a temporary file beside its target.
    tmp_dir = files.tensors.with_name(f".stage{stage}.tmp{os.getpid()}")
    tmp_dir.mkdir(exist_ok=True)
    tmp_tensors, tmp_meta = tmp_dir / files.tensors.name, tmp_dir / files.meta.name
    try:
        write_safetensors(
            tmp_tensors,
            [entry(k, v) for k, v in tensors.items()],
            metadata={"format": str(FORMAT), "checkpoint_id": checkpoint_id, "run_id": run_id or ""},
        )
        os.chmod(tmp_tensors, 0o666 & ~_umask())  # safetensors makes it 0600; the JSON follows the umask
        _fsync(tmp_tensors)
        meta = {
            "format": FORMAT,
            "checkpoint_id": checkpoint_id,
            "run_id": run_id,
            "node": node,
            "cluster": cluster,
            "stage": stage,
            "num_stages": num_stages,
            "cluster_nodes": cluster_nodes,
            "version": version,
            "data_position": data_position,
            "written_at": time.time(),
            "tensor_bytes": tmp_tensors.stat().st_size,
            "tensor_sha256": _sha256(tmp_tensors),
            "optimizer": opt_rest,
            "parameter_names": names,
            **(extra or {}),
        }
        tmp_meta.write_text(json.dumps(meta, indent=1, default=float))
        _fsync(tmp_meta)
        _rotate(files)
        os.replace(tmp_tensors, files.tensors)
        os.replace(tmp_meta, files.meta)  # last: until here the previous pair is the loadable one
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    _fsync(files.meta.parent)
    return files.meta


def _rotate(files: _Files) -> None:
    """Make the current pair the previous one.  A current tensor file without its JSON is the
    leftover of a killed save (overwritten next), unless a killed rotation already moved its JSON."""
    if not files.meta.exists():
        if files.tensors.exists() and (prev := _read_meta(files.prev_meta)) is not None \
                and _tensor_file_id(files.tensors) == prev["checkpoint_id"]:
            os.replace(files.tensors, files.prev_tensors)  # finish the rotation a kill interrupted
        return
    os.replace(files.meta, files.prev_meta)
    if files.tensors.exists():
        os.replace(files.tensors, files.prev_tensors)


def remove_temp_files(root: str | Path, cluster: int, stage: int) -> list[Path]:
    """Delete the temporary files a killed save of this stage left behind (call it when the stage
    starts: only its own node writes them); returns what was removed."""
    directory = Path(root) / f"cluster{cluster}"
    if not directory.is_dir():
        return []
    removed = []
    for path in directory.glob(f".stage{stage}.tmp*"):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.info(
            "removed %d temporary file(s) of an interrupted checkpoint save in %s", len(removed), directory
        )
    return removed


def _candidates(files: _Files) -> list[dict[str, Any]]:
    """The JSON halves found for a stage, newest first."""
    metas = [m for m in (_read_meta(files.meta), _read_meta(files.prev_meta)) if m is not None]
    return sorted(metas, key=lambda m: (m.get("version", -1), m.get("written_at", 0.0)), reverse=True)


def stage_metas(root: str | Path, cluster: int, stage: int) -> list[dict[str, Any]]:
    """The JSON halves of a stage's checkpoints (current and previous), newest first; not verified."""
    return _candidates(_Files.of(Path(root), cluster, stage))


def set_aside(root: str | Path, cluster: int, stage: int, run_id: str) -> list[Path]:
    """Move this stage's checkpoint files of runs other than ``run_id`` into ``cluster{c}/run-{RUN}/``
    (never loaded, never deleted); returns where they went."""
    files = _Files.of(Path(root), cluster, stage)
    moved = []
    for path in (files.meta, files.prev_meta, files.tensors, files.prev_tensors):
        run = _file_run(path)
        if run is None or run == run_id:
            continue
        target = path.parent / f"run-{run or 'unknown'}" / path.name
        target.parent.mkdir(exist_ok=True)
        os.replace(path, target)
        moved.append(target)
    return moved


def _file_run(path: Path) -> str | None:
    """The run a checkpoint file belongs to ("" for one written without a run id); None: no such file,
    or not readable as ours."""
    if path.suffix == ".json":
        meta = _read_meta(path)
        return None if meta is None else str(meta.get("run_id") or "")
    if not path.exists() or _tensor_file_id(path) is None:
        return None
    with safe_open(str(path), framework="pt") as f:
        return (f.metadata() or {}).get("run_id", "")


def _check_pair(files: _Files, meta: dict[str, Any]) -> tuple[Path | None, str]:
    """The tensor file that belongs to ``meta`` and checks out, or None and why not."""
    if meta.get("format") != FORMAT:
        return None, f"unknown checkpoint format {meta.get('format')!r}"
    reason = "no tensor file with its checkpoint id (torn pair)"
    for path in (files.tensors, files.prev_tensors):
        if _tensor_file_id(path) != meta["checkpoint_id"]:
            continue
        if path.stat().st_size != meta.get("tensor_bytes"):
            reason = f"{path.name}: size does not match its JSON (torn write)"
        elif _sha256(path) != meta.get("tensor_sha256"):
            reason = f"{path.name}: checksum does not match its JSON (corrupt)"
        else:
            return path, ""
    return None, reason


def select_stage(root: str | Path, cluster: int, stage: int, run_id: str | None = None,
                 version: int | None = None) -> tuple[dict[str, Any], Path]:
    """The JSON and tensor file of a stage's newest checkpoint that checks out (of ``run_id`` and at
    ``version`` if given)."""
    files = _Files.of(Path(root), cluster, stage)
    metas = [m for m in _candidates(files) if (run_id is None or m.get("run_id") == run_id)
             and (version is None or m.get("version") == version)]
    if not metas:
        run = (f" of run {run_id}" if run_id else "") + (
            f" at version {version}" if version is not None else ""
        )
        raise FileNotFoundError(f"no checkpoint{run} for cluster {cluster} stage {stage} in {root}")
    problems = []
    for meta in metas:
        path, reason = _check_pair(files, meta)
        if path is None:
            problems.append(f"version {meta.get('version')}: {reason}")
            continue
        if problems:
            log.warning("cluster %d stage %d: newest checkpoint unusable (%s); using version %s",
                        cluster, stage, "; ".join(problems), meta.get("version"))
        return meta, path
    raise CheckpointError(
        f"cluster {cluster} stage {stage} in {root}: no usable checkpoint ({'; '.join(problems)})"
    )


def load_stage(root: str | Path, cluster: int, stage: int, run_id: str | None = None,
               version: int | None = None) -> StageCheckpoint:
    """The newest checkpoint of a stage whose JSON and tensors check out (of ``run_id`` and at ``version``
    if given)."""
    meta, path = select_stage(root, cluster, stage, run_id, version)
    tensors = load_file(str(path))
    model = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    optim = {k: v for k, v in tensors.items() if k.startswith("optim.")}
    return StageCheckpoint(model=model, optimizer={"tensors": optim, "rest": meta["optimizer"]}, meta=meta)


def stages_found(root: Path, cluster: int) -> list[int]:
    """The stage numbers with a checkpoint JSON under ``root/cluster{cluster}``."""
    cdir = root / f"cluster{cluster}"
    return sorted({int(p.name.split(".")[0].removeprefix("stage")) for p in cdir.glob("stage*.json")
                   if p.name.split(".")[0].removeprefix("stage").isdigit()}) if cdir.is_dir() else []


def newest_run(root: Path, cluster: int, stages: list[int]) -> str | None:
    """The run id of the newest checkpoint among ``stages``."""
    newest = max((m for s in stages for m in _candidates(_Files.of(root, cluster, s))),
                 key=lambda m: m.get("written_at", 0.0), default={})
    return newest.get("run_id")


def runs_of(root: Path, cluster: int, stage: int) -> set[str]:
    return {str(m.get("run_id")) for m in _candidates(_Files.of(root, cluster, stage))}
