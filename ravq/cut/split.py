"""Cutting a model into pipeline stages with torch.distributed.pipelining's tracer.

``split_model`` traces the unsplit model once, cuts it where stages begin and describes, for every
stage, where each of its inputs comes from: a model input (read by stage 0's data loader) or an
output of an earlier stage, which need not be the previous one (skip connections across cuts are
direct edges).  Stage modules keep the unsplit model's parameter names, and non-persistent buffers
stay non-persistent.  The last stage also learns how to rebuild what the unsplit model returns (a
``ModelOutput``, dataclass, dict or tuple, some of its tensors possibly made by earlier stages), so
``loss_fn`` sees the same thing with one stage or many.  Nothing here moves a buffer: the passes over
example inputs put BatchNorm's running statistics back as they were.  What cannot be split raises
``SplitError`` naming the parameter, buffer or output and what to change.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.utils._pytree import TreeSpec

from ravq.cut.meta import build_meta_model, is_meta, shape_pass, to_meta
from ravq.cut.modules import mark_non_persistent, non_persistent_buffers
from ravq.cut.tied import TiedGroup, give_unused_to_first, settle_ties, tie_groups


@dataclass(frozen=True, slots=True)
class InputRef:
    """One positional input of a stage: model input ``index`` (stage == -1) or output ``index`` of
    ``stage``."""

    stage: int
    index: int


@dataclass(kw_only=True, slots=True)
class StageSpec:
    index: int
    module: nn.Module
    inputs: list[InputRef]
    """The module's positional inputs."""
    num_outputs: int
    returns_tuple: bool
    """Whether the module returns a tuple (else a single tensor)."""
    consumers: dict[int, list[int]] = field(default_factory=dict)
    """Output index -> stages that read it (the last stage's outputs go to the loss)."""
    loss_inputs: list[InputRef] = field(default_factory=list)
    """Last stage: tensors of the model's output made elsewhere (an earlier stage, a model input), sent
    here so the output can be rebuilt for ``loss_fn``."""
    output_leaves: list[InputRef | Constant] | None = None
    """Last stage of a split model: each leaf of the model's output, in pytree order (``InputRef`` with
    this stage's index: one of its own outputs).  None for an unsplit model (its output is used as is)."""
    output_spec: TreeSpec | None = None
    """The structure ``output_leaves`` are put back into (a ModelOutput, dataclass, dict, tuple...)."""
    tied: list[TiedGroup] = field(default_factory=list)
    """The tied weights this stage holds a copy of, beside other stages (``ravq.cut.tied``)."""

    @property
    def received(self) -> list[InputRef]:
        """Everything this stage is handed per micro-batch: module inputs, then ``loss_inputs``."""
        return [*self.inputs, *self.loss_inputs]

    @property
    def producer_stages(self) -> list[int]:
        return sorted({ref.stage for ref in self.received if ref.stage >= 0})

    @property
    def consumer_stages(self) -> list[int]:
        return sorted({s for stages in self.consumers.values() for s in stages})

    @property
    def model_inputs(self) -> list[int]:
        return sorted({ref.index for ref in self.received if ref.stage < 0})


@dataclass(frozen=True, slots=True)
class Constant:
    """A model-output leaf that is not a tensor (an int, a float...): the same every micro-batch."""

    value: Any


def model_output(spec: StageSpec, raw: Any, received: Sequence[torch.Tensor]) -> Any:
    """What the unsplit model returns, on the last stage: ``raw`` is the stage module's own output,
    ``received`` the tensors of ``spec.received`` in order.  ``loss_fn`` gets this with any number of
    stages: the same ModelOutput, dataclass, dict, namedtuple or tuple the model builds."""
    if spec.output_spec is None or spec.output_leaves is None:
        return raw
    own = tuple(raw) if isinstance(raw, (tuple, list)) else (raw,)
    by_ref = dict(zip(spec.received, received))
    leaves = [leaf.value if isinstance(leaf, Constant) else own[leaf.index] if leaf.stage == spec.index
              else by_ref[leaf] for leaf in spec.output_leaves]
    return pytree.tree_unflatten(leaves, spec.output_spec)


class SplitError(ValueError):
    """The model cannot be cut as asked; the message says which module, buffer or output, and what to do."""


def candidate_cuts(model: nn.Module, task: Any = None) -> list[str]:
    """Module names where a stage may begin: the task's own list, else top-level children with
    ModuleList/Sequential containers expanded into their items (the first child is excluded)."""
    if task is not None and callable(getattr(task, "split_points", None)):
        return list(task.split_points())
    names: list[str] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            names.extend(f"{name}.{sub}" for sub, _ in child.named_children())
        else:
            names.append(name)
    return names[1:]


def even_cuts(candidates: list[str], num_stages: int) -> list[str]:
    """``num_stages - 1`` cuts spread evenly over the candidates."""
    if not 1 <= num_stages <= len(candidates) + 1:
        raise ValueError(
            f"stages: {num_stages} stages need {num_stages - 1} cut point(s) and the model offers "
            f"{len(candidates)}; give the task a split_points() listing more module names where a "
            "stage may begin (e.g. every block of a ModuleList), or plan fewer stages"
        )
    slots = len(candidates) + 1
    return [candidates[round(i * slots / num_stages) - 1] for i in range(1, num_stages)]


def _source(node: object, stage_of: dict[fx.Node, int], input_index: dict[fx.Node, int]) -> InputRef:
    if not isinstance(node, fx.Node):
        raise SplitError(f"unsupported value crossing a stage cut: {node!r}")
    if node.op == "placeholder":
        return InputRef(-1, input_index[node])
    if node in stage_of:
        return InputRef(stage_of[node], 0)
    if node.op == "call_function" and node.target is operator.getitem:
        producer, idx = node.args
        assert isinstance(producer, fx.Node) and isinstance(idx, int)
        return InputRef(stage_of[producer], idx)
    raise SplitError(f"unsupported value crossing a stage cut: {node.format_node()}")


def split_model(model: nn.Module, example_args: tuple[Any, ...], cuts: list[str]) -> list[StageSpec]:
    """Cut ``model`` before each module named in ``cuts``; return one StageSpec per stage.

    Leaves the model's buffers (e.g. BatchNorm's running statistics) as it found them."""
    known = dict(model.named_modules())
    for cut in cuts:
        if cut not in known:
            raise ValueError(f"cuts: {cut!r} is not a module of the model")
    if not cuts:
        return [_whole_model_stage(model, example_args)]
    # imported here: torch's pipelining, export and dynamo take seconds to import, and a cached split
    # needs none
    from ravq.cut.trace import split_pipe

    groups = tie_groups(model)
    leaves, out_spec = _output_structure(model, example_args)
    try:
        pipe = split_pipe(model, to_meta(example_args) if is_meta(model) else example_args, cuts)
    except Exception as err:  # torch's tracer: any failure means "cannot split this model"
        raise SplitError(_tracer_advice(err)) from err
    graph = pipe.split_gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    input_index = {n: i for i, n in enumerate(placeholders)}
    calls = [n for n in graph.nodes if n.op == "call_module"]
    stage_of = {n: i for i, n in enumerate(calls)}
    specs = []
    for i, call in enumerate(calls):
        module = pipe.get_stage_module(i)
        inputs = [_source(arg, stage_of, input_index) for arg in call.args]
        out = module.graph.output_node().args[0]
        returns_tuple = isinstance(out, (tuple, list))
        specs.append(StageSpec(index=i, module=module, inputs=inputs,
                               num_outputs=len(out) if returns_tuple else 1, returns_tuple=returns_tuple))
    _attach_output(specs[-1], graph, leaves, out_spec, stage_of, input_index)
    for spec in specs:
        for ref in spec.received:
            if ref.stage >= 0 and ref.stage != spec.index:
                users = specs[ref.stage].consumers.setdefault(ref.index, [])
                if spec.index not in users:
                    users.append(spec.index)
    _mark_non_persistent(model, specs)
    for index, tied in settle_ties(model, [s.module for s in specs], groups).items():
        specs[index].tied = tied
    give_unused_to_first(model, [s.module for s in specs])
    _check_names(model, specs)
    return specs


def _attach_output(last: StageSpec, graph: fx.Graph, leaves: list[Any], out_spec: TreeSpec,
                   stage_of: dict[fx.Node, int], input_index: dict[fx.Node, int]) -> None:
    """Where each leaf of the model's output comes from, so the last stage can rebuild it."""
    returned = graph.output_node().args[0]
    returned = list(returned) if isinstance(returned, (tuple, list)) else [returned]
    if len(returned) != len(leaves):
        raise SplitError(
            f"the traced model returns {len(returned)} values where it returns {len(leaves)} when run; "
            "return tensors in a tuple, dict, namedtuple or ModelOutput"
        )
    out: list[InputRef | Constant] = []
    for node, leaf in zip(returned, leaves):
        if not isinstance(node, fx.Node):
            out.append(Constant(leaf))
            continue
        ref = _source(node, stage_of, input_index)
        out.append(ref)
        if ref.stage != last.index and ref not in last.loss_inputs:
            last.loss_inputs.append(ref)
    last.output_leaves, last.output_spec = out, out_spec


def _output_structure(model: nn.Module, example_args: tuple[Any, ...]) -> tuple[list[Any], TreeSpec]:
    """The leaves and structure of what the model returns, from one forward on the example inputs
    (buffers and random state left as they were).  Refuses outputs the tracer cannot carry."""
    with shape_pass([model], example_args) as args, keep_buffers([model]), torch.no_grad(), \
            torch.random.fork_rng(devices=[]):
        out = model(*args)
    with_paths, spec = pytree.tree_flatten_with_path(out)
    for path, leaf in with_paths:
        if isinstance(leaf, torch.Tensor) or leaf is None or isinstance(leaf, (bool, int, float, str)):
            continue
        where = f"output{pytree.keystr(path)}" if path else "output"
        kind = type(leaf).__name__
        if "Cache" in kind:
            raise SplitError(
                f"the model's {where} is a {kind}, not a tensor: stages hand each other and loss_fn "
                "tensors only; build or call the model with use_cache=False (a key/value cache is "
                "for generation, not training)"
            )
        raise SplitError(
            f"the model's {where} is a {kind}, which torch's pytree does not know: return tensors in "
            "a tuple, dict, namedtuple or transformers ModelOutput, or register the class "
            f"(torch.utils._pytree.register_dataclass({kind}) for a dataclass)"
        )
    return [leaf for _, leaf in with_paths], spec


def _tracer_advice(err: BaseException) -> str:
    """torch's tracer error with its root cause (torch's own message only says it "cannot capture") and the
    line of the user's code it points at, which a long message would otherwise bury."""
    causes = [err]
    while causes[-1].__cause__ is not None and len(causes) < 10:
        causes.append(causes[-1].__cause__)  # type: ignore[arg-type]
    root = causes[-1]
    text = " ".join(str(root).split())
    where = _user_frames(root)
    if len(text) > 600:
        text = text[:600] + " ..."
    return (
        f"torch's tracer cannot capture the model as one graph ({type(root).__name__}: {text})"
        + (f" [in your code: {where}]" if where else "")
        + ". Typical fixes: "
        "use_cache=False (transformers), no data-dependent Python control flow in forward, return tensors "
        "in a tuple/dict/ModelOutput; or give the task split_points() that avoid the failing module"
    )


def _user_frames(err: BaseException) -> str:
    """The frames outside torch and the standard library that the error names: those in torch's own "from
    user code" section, else the innermost such frame of the traceback."""
    import re
    import traceback

    def outside(path: str) -> bool:
        return not any(
            part in path for part in ("/torch/", "/site-packages/torch", "/lib/python3", "<frozen")
        )

    named = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\s*\n\s*(.*)', str(err))
    frames = [f"{path}:{line} in {func}: {code.strip()}" for path, line, func, code in named if outside(path)]
    if not frames:
        tb = [f for f in traceback.extract_tb(err.__traceback__) if outside(f.filename)]
        frames = [f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}" for f in tb[-1:]]
    return "; ".join(frames[-3:])


def _mark_non_persistent(model: nn.Module, specs: list[StageSpec]) -> None:
    """The tracer makes every buffer persistent; give back the model's non-persistent ones (e.g. rotary
    embeddings' ``inv_freq``) their kind: on the stages that use them, never saved, checkpointed or
    averaged."""
    wanted = {f"{prefix}.{b}" if prefix else b for prefix, mod in model.named_modules()
              for b in non_persistent_buffers(mod)}
    for spec in specs:
        for full, _ in spec.module.named_buffers():
            if full in wanted:
                mark_non_persistent(spec.module, full)


def _whole_model_stage(model: nn.Module, example_args: tuple[Any, ...]) -> StageSpec:
    return StageSpec(index=0, module=model, inputs=[InputRef(-1, i) for i in range(len(example_args))],
                     num_outputs=1, returns_tuple=False)


def _check_names(model: nn.Module, specs: list[StageSpec]) -> None:
    """Every parameter and persistent buffer lands in a stage under its own name, and only a tied one
    (``ravq.cut.tied``) in several."""
    want = list(model.state_dict().keys())
    holders: dict[str, list[int]] = {}
    for spec in specs:
        for k in spec.module.state_dict():
            holders.setdefault(k, []).append(spec.index)
    tied = {n for spec in specs for group in spec.tied for n in group.names}
    shared = {k: v for k, v in holders.items() if len(v) > 1 and k not in tied}
    missing = [k for k in want if k not in holders]
    extra = [k for k in holders if k not in set(want)]
    if not (shared or missing or extra):
        return
    parts = [f"{k} is used by stages {v}" for k, v in list(shared.items())[:5]]
    parts += [f"{k} is in no stage" for k in missing[:5]]
    parts += [f"{k} is not a name of the unsplit model" for k in extra[:5]]
    raise SplitError(
        "cannot split the model so that each persistent buffer lives in one stage: "
        + "; ".join(parts)
        + ". Cut elsewhere (the task's split_points()) so each buffer is used by one "
        "stage, or make a buffer that is a constant non-persistent "
        "(register_buffer(..., persistent=False)); weights read by several stages are tied copies"
    )


@contextlib.contextmanager
def keep_buffers(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Run a pass that must leave every buffer as it found it (a training-mode forward moves
    BatchNorm's running statistics and counts ``num_batches_tracked``)."""
    saved = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def build_task_model(task: Any, seed: int) -> nn.Module:
    """The whole task model with real weights, as every cluster starts from it (``ravq.cut.materialize``'s
    rule: the same values a stage of any cut gets).  For one process: references, tests, export checks."""
    from ravq.cut.materialize import materialize

    blueprint = build_meta_model(task, seed)
    materialize(blueprint.model, task, seed)
    torch.manual_seed(seed)  # what comes next (a reference's dropout) is reproducible, as it always was
    return blueprint.model


TensorSpec = tuple[torch.Size, torch.dtype]


def stage_input_specs(specs: list[StageSpec], example_args: tuple[Any, ...]) -> list[list[TensorSpec]]:
    """Shape and dtype of every tensor each stage receives (``StageSpec.received``), from one no-grad
    pass over the example inputs that leaves every buffer as it was.

    Nodes use these to reject a well-formed message whose tensors do not fit before torch sees it."""
    outputs: dict[int, tuple[torch.Tensor, ...]] = {}
    result = []
    modules = [s.module for s in specs]
    with shape_pass(modules, example_args) as args, keep_buffers(modules), torch.no_grad(), \
            torch.random.fork_rng(devices=[]):
        for spec in specs:
            got = [args[r.index] if r.stage < 0 else outputs[r.stage][r.index] for r in spec.received]
            result.append([(a.shape, a.dtype) for a in got])
            if spec.index < len(specs) - 1:
                out = spec.module(*got[: len(spec.inputs)])
                outputs[spec.index] = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return result
