"""A split kept on disk, so a restarted node skips torch's tracer (seconds of CPU, and importing
torch.distributed.pipelining, torch.export and dynamo, which take as long again).

A cached split is one JSON file per (model, example inputs, cuts): for every stage, each graph module of
its hierarchy as the Python code fx generated for it, each parameter and buffer as name, shape, dtype
(and which names are one tensor), and the rest of its ``StageSpec`` (inputs, consumers, how the last
stage rebuilds the model's output, tied groups).  Reading it rebuilds the stages on ``meta`` by running
that code under fx's symbolic tracer (as fx's own deserialiser does), never unpickling anything.

The file is keyed by a hash of the model (its module tree, tensor names, shapes and dtypes, and the source
files of its classes), the example inputs' shapes, the cuts, torch's version and this package's splitting
code; it lives in the node's checkpoint directory (its own disk, written by itself, never received from a
peer), is written atomically, and is ignored and rebuilt, with one log line, on any mismatch or damage.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.fx.graph_module import _format_import_block, _forward_from_src
from torch.package import sys_importer

from ravq.cut.modules import (
    adopt_members,
    child_names,
    graph_pytree_spec,
    holds,
    non_persistent_buffers,
    own_buffers,
    own_parameters,
)
from ravq.cut.split import Constant, InputRef, StageSpec, TensorSpec, split_model, stage_input_specs
from ravq.cut.tied import TiedGroup

log = logging.getLogger(__name__)

FORMAT = 1
_OWN_CODE = ("split.py", "trace.py", "tied.py", "meta.py", "split_cache.py")


def cache_dir(checkpoint_dir: str | None) -> Path | None:
    """Where a node keeps its cached splits: beside its checkpoints (none without a checkpoint directory)."""
    return Path(checkpoint_dir) / "split-cache" if checkpoint_dir else None


class CacheMiss(Exception):
    """This cache file cannot serve the split (missing, another key, damaged, or not representable)."""


def cached_split(model: nn.Module, example_args: tuple[Any, ...], cuts: list[str],
                 cache_dir: str | os.PathLike[str] | None) -> list[StageSpec]:
    """``split_model(model, example_args, cuts)``, read from ``cache_dir`` when a valid entry is there, else
    traced and written there (when ``cache_dir`` is given and the split can be represented)."""
    return cached_stages(model, example_args, cuts, cache_dir)[0]


def cached_stages(model: nn.Module, example_args: tuple[Any, ...], cuts: list[str],
                  cache_dir: str | os.PathLike[str] | None) -> tuple[list[StageSpec], list[list[TensorSpec]]]:
    """``cached_split`` and ``stage_input_specs`` of it: a hit needs no shape pass either (torch's fake
    tensors import torch._dynamo, a second or more of a start)."""
    if cache_dir is None or not cuts:
        specs = split_model(model, example_args, cuts)
        return specs, stage_input_specs(specs, example_args)
    key = split_key(model, example_args, cuts)
    path = Path(cache_dir) / f"split-{key[:32]}.json"
    if path.exists():
        try:
            specs, in_specs = load(path, key)
            log.info("split: read from the cache %s (cuts %s): no trace", path.name, cuts)
            return specs, in_specs
        except Exception as err:  # noqa: BLE001 - damaged, stale or unreadable: trace again
            log.warning("split cache %s unusable (%s: %s); tracing again and rewriting it", path,
                        type(err).__name__, str(err)[:200])
    specs = split_model(model, example_args, cuts)
    in_specs = stage_input_specs(specs, example_args)
    try:
        write(path, key, specs, in_specs)
    except CacheMiss as why:
        log.info("split: not cached (%s)", why)
    except Exception as err:  # noqa: BLE001 - a cache is an optimisation: the traced split is served anyway
        log.warning("split cache %s not written (%s: %s)", path, type(err).__name__, str(err)[:200])
    return specs, in_specs


def split_key(model: nn.Module, example_args: tuple[Any, ...], cuts: list[str]) -> str:
    """What the split depends on: the model's structure, tensors and code, the inputs' shapes, the cuts, and
    the versions of torch and of this package's splitting code."""
    h = hashlib.sha256()

    def add(*parts: Any) -> None:
        for part in parts:
            h.update(str(part).encode())
            h.update(b"\0")

    add(FORMAT, torch.__version__, repr(model), cuts)
    for name, t in model.state_dict(keep_vars=True).items():
        add(name, tuple(t.shape), t.dtype)
    for name, p in model.named_parameters(remove_duplicate=False):  # tied weights: one tensor, several names
        add(name, p.requires_grad)
    for leaf in pytree.tree_leaves(example_args):
        add(("tensor", tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else repr(leaf))
    sources = {inspect.getsourcefile(type(m)) for m in model.modules()}
    sources |= {str(Path(__file__).with_name(f)) for f in _OWN_CODE}
    for src in sorted(s for s in sources if s and "/torch/" not in s):
        add(src, hashlib.sha256(Path(src).read_bytes()).hexdigest())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------- writing
def write(path: Path, key: str, specs: list[StageSpec], in_specs: list[list[TensorSpec]]) -> None:
    """Write ``specs`` and their input shapes under ``key``, atomically (a temporary file renamed over)."""
    inputs = [[[list(shape), str(dtype)] for shape, dtype in stage] for stage in in_specs]
    stages = [_spec_entry(s) for s in specs]
    for stage in stages:  # what a hit would rebuild: CacheMiss if the code does not give the graph back
        _module(stage["module"])
    body = json.dumps({"stages": stages, "inputs": inputs}, sort_keys=True)
    doc = {"format": FORMAT, "key": key, "sha256": hashlib.sha256(body.encode()).hexdigest(), "body": body}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(doc))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _spec_entry(spec: StageSpec) -> dict[str, Any]:
    leaves = (
        None
        if spec.output_leaves is None
        else [
            {"value": _constant(leaf.value)} if isinstance(leaf, Constant) else _ref(leaf)
            for leaf in spec.output_leaves
        ]
    )
    try:
        out_spec = None if spec.output_spec is None else pytree.treespec_dumps(spec.output_spec)
    except Exception as err:
        raise CacheMiss(f"the model's output structure cannot be written: {err}") from err
    return {
        "index": spec.index,
        "inputs": [_ref(r) for r in spec.inputs],
        "num_outputs": spec.num_outputs,
        "returns_tuple": spec.returns_tuple,
        "consumers": {str(k): v for k, v in spec.consumers.items()},
        "loss_inputs": [_ref(r) for r in spec.loss_inputs],
        "output_leaves": leaves,
        "output_spec": out_spec,
        "tied": [{"key": g.key, "names": list(g.names), "holders": list(g.holders)} for g in spec.tied],
        "module": _module_entry(spec.module),
    }


def _ref(ref: InputRef) -> list[int]:
    return [ref.stage, ref.index]


def _constant(value: Any) -> Any:
    if value is not None and not isinstance(value, (bool, int, float, str)):
        raise CacheMiss(f"an output constant of type {type(value).__name__}")
    return value


def _module_entry(module: nn.Module) -> dict[str, Any]:
    modules, tensors, first_name = [], [], {}
    for path, sub in module.named_modules(remove_duplicate=False):
        holder = getattr(sub, "graph_module", None) or sub  # an InterpreterModule keeps it in graph_module
        graph = getattr(holder, "graph", None)
        if not isinstance(graph, fx.Graph) and type(sub) is not nn.Module:
            raise CacheMiss(f"module {path or '(stage)'} is a {type(sub).__name__}, not a graph")
        entry: dict[str, Any] = {"path": path, "children": child_names(sub),
                                 "non_persistent": sorted(non_persistent_buffers(sub))}
        if isinstance(graph, fx.Graph):
            entry.update(_graph_code(graph, sub))
        modules.append(entry)
        for kind, own in (("param", own_parameters(sub)), ("buffer", own_buffers(sub))):
            for leaf, t in own.items():
                if t is None:
                    raise CacheMiss(f"{path}.{leaf} is None")
                name = f"{path}.{leaf}" if path else leaf
                alias = first_name.setdefault(id(t), name)
                tensors.append(
                    {
                        "name": name,
                        "kind": kind,
                        "shape": list(t.shape),
                        "dtype": str(t.dtype),
                        "requires_grad": bool(t.requires_grad),
                        "alias": None if alias == name else alias,
                    }
                )
    return {"modules": modules, "tensors": tensors}


def _graph_code(graph: fx.Graph, owner: nn.Module) -> dict[str, Any]:
    code = graph.python_code(root_module="self")
    for node in graph.nodes:
        if node.op == "get_attr" and not _is_tensor_or_module(owner, str(node.target)):
            raise CacheMiss(f"graph attribute {node.target} is neither a parameter, buffer nor module")
    specs = {}
    for name in ("_in_spec", "_out_spec"):
        if f"self.{name}" in code.src:
            specs[name] = pytree.treespec_dumps(graph_pytree_spec(graph, name[1:]))
    return {"code": _format_import_block(code.globals, sys_importer) + "\n" + code.src, "specs": specs}


def _is_tensor_or_module(owner: nn.Module, target: str) -> bool:
    *prefix, leaf = target.split(".")
    try:
        holder = owner.get_submodule(".".join(prefix))
    except AttributeError:
        return False
    return holds(holder, leaf)


# ----------------------------------------------------------------------------------------------- reading
def load(path: Path, key: str) -> tuple[list[StageSpec], list[list[TensorSpec]]]:
    doc = json.loads(path.read_text())
    if doc.get("format") != FORMAT or doc.get("key") != key:
        raise CacheMiss("written for another model, cut, torch or ravq")
    body = doc["body"]
    if hashlib.sha256(body.encode()).hexdigest() != doc.get("sha256"):
        raise CacheMiss("its checksum does not match (a damaged file)")
    entry = json.loads(body)
    inputs = [[(torch.Size(shape), _dtype(dtype)) for shape, dtype in stage] for stage in entry["inputs"]]
    return [_spec(e) for e in entry["stages"]], inputs


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."))
    if not isinstance(dtype, torch.dtype):
        raise CacheMiss(f"{name} is not a dtype")
    return dtype


def _spec(e: dict[str, Any]) -> StageSpec:
    leaves = None if e["output_leaves"] is None else [
        Constant(x["value"]) if isinstance(x, dict) else InputRef(*x) for x in e["output_leaves"]]
    return StageSpec(
        index=e["index"],
        module=_module(e["module"]),
        inputs=[InputRef(*r) for r in e["inputs"]],
        num_outputs=e["num_outputs"],
        returns_tuple=e["returns_tuple"],
        consumers={int(k): list(v) for k, v in e["consumers"].items()},
        loss_inputs=[InputRef(*r) for r in e["loss_inputs"]],
        output_leaves=leaves,
        output_spec=None if e["output_spec"] is None else pytree.treespec_loads(e["output_spec"]),
        tied=[
            TiedGroup(key=g["key"], names=tuple(g["names"]), holders=tuple(g["holders"])) for g in e["tied"]
        ],
    )


class _KeepModules(fx.Tracer):
    """Records every submodule call as a call (they are rebuilt graphs of their own), as fx's deserialiser."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def _module(e: dict[str, Any]) -> nn.Module:
    """The stage module on ``meta``, rebuilt bottom-up: tensors first (aliases share one), then each module
    with its children and own tensors, its graph traced from the cached code, in the original order."""
    tensors: dict[str, torch.Tensor] = {}
    for t in e["tensors"]:
        if t["alias"] is not None:
            tensors[t["name"]] = tensors[t["alias"]]
            continue
        value = torch.empty(t["shape"], dtype=_dtype(t["dtype"]), device="meta")
        tensors[t["name"]] = (
            nn.Parameter(value, requires_grad=t["requires_grad"]) if t["kind"] == "param" else value
        )
    built: dict[str, nn.Module] = {}
    for m in sorted(e["modules"], key=lambda m: -(m["path"].count(".") + bool(m["path"]))):  # deepest first
        path = m["path"]
        holder = nn.Module()
        for child in m["children"]:
            holder.add_module(child, built[f"{path}.{child}" if path else child])
        for t in (t for t in e["tensors"] if t["name"].rpartition(".")[0] == path):
            leaf = t["name"].rpartition(".")[2]
            if t["kind"] == "param":
                holder.register_parameter(leaf, tensors[t["name"]])  # type: ignore[arg-type]
            else:
                holder.register_buffer(leaf, tensors[t["name"]], persistent=leaf not in m["non_persistent"])
        built[path] = _graph_module(holder, m) if "code" in m else holder
    return built[""]


def _graph_module(holder: nn.Module, m: dict[str, Any]) -> fx.GraphModule:
    for name, text in m["specs"].items():
        setattr(holder, name, pytree.treespec_loads(text))
    forward = _forward_from_src(m["code"], {})
    cls = type("CachedStage", (nn.Module,), {"forward": forward})
    root = cls()
    root.__dict__.update({k: v for k, v in holder.__dict__.items() if k != "training"})
    gm = fx.GraphModule(root, _KeepModules().trace(root))
    # the graph keeps only what it reads: give back the rest, in the original order
    adopt_members(gm, holder)
    # an op without a tensor input (GPT-2's torch.arange of its positions, traced on meta) runs once under
    # fx's tracer, whose result the graph would read as a constant on meta: that code is not cacheable
    folded = [str(n.target) for n in gm.graph.nodes
              if n.op == "get_attr" and not _is_tensor_or_module(gm, str(n.target))]
    if folded:
        raise CacheMiss(f"fx folds ops without tensor inputs into constants ({', '.join(folded)})")
    return gm
