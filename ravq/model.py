"""Cutting a model into pipeline stages with torch.distributed.pipelining's tracer.

``split_model`` traces the unsplit model once, cuts it where stages begin and describes, for every
stage, where each of its inputs comes from: a model input (read by stage 0's data loader) or an
output of an earlier stage, which need not be the previous one (skip connections across cuts are
direct edges).  Stage modules keep the unsplit model's parameter names.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.pipelining import SplitPoint, pipeline


@dataclass(frozen=True, slots=True)
class InputRef:
    """One positional input of a stage: model input ``index`` (stage == -1) or output ``index`` of ``stage``."""

    stage: int
    index: int


@dataclass(kw_only=True, slots=True)
class StageSpec:
    index: int
    module: nn.Module
    inputs: list[InputRef]
    num_outputs: int
    returns_tuple: bool
    """Whether the module returns a tuple (else a single tensor)."""
    consumers: dict[int, list[int]] = field(default_factory=dict)
    """Output index -> stages that read it (the last stage's outputs go to the loss)."""

    @property
    def producer_stages(self) -> list[int]:
        return sorted({ref.stage for ref in self.inputs if ref.stage >= 0})

    @property
    def consumer_stages(self) -> list[int]:
        return sorted({s for stages in self.consumers.values() for s in stages})

    @property
    def model_inputs(self) -> list[int]:
        return [ref.index for ref in self.inputs if ref.stage < 0]


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
        raise ValueError(f"stages: {num_stages} stages need 0..{len(candidates)} cut points; "
                         f"the model offers {len(candidates)}")
    slots = len(candidates) + 1
    return [candidates[round(i * slots / num_stages) - 1] for i in range(1, num_stages)]


def _source(node: fx.Node, stage_of: dict[fx.Node, int], input_index: dict[fx.Node, int]) -> InputRef:
    if node.op == "placeholder":
        return InputRef(-1, input_index[node])
    if node in stage_of:
        return InputRef(stage_of[node], 0)
    if node.op == "call_function" and node.target is operator.getitem:
        producer, idx = node.args
        assert isinstance(producer, fx.Node) and isinstance(idx, int)
        return InputRef(stage_of[producer], idx)
    raise ValueError(f"unsupported value crossing a stage cut: {node.format_node()}")


def split_model(model: nn.Module, example_args: tuple[Any, ...], cuts: list[str]) -> list[StageSpec]:
    """Cut ``model`` before each module named in ``cuts``; return one StageSpec per stage."""
    known = dict(model.named_modules())
    for cut in cuts:
        if cut not in known:
            raise ValueError(f"cuts: {cut!r} is not a module of the model")
    if not cuts:
        return [_whole_model_stage(model, example_args)]
    pipe = pipeline(model, mb_args=example_args, split_spec={c: SplitPoint.BEGINNING for c in cuts})
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
    for spec in specs:
        for ref in spec.inputs:
            if ref.stage >= 0:
                specs[ref.stage].consumers.setdefault(ref.index, [])
                if spec.index not in specs[ref.stage].consumers[ref.index]:
                    specs[ref.stage].consumers[ref.index].append(spec.index)
    _check_names(model, specs)
    return specs


def _whole_model_stage(model: nn.Module, example_args: tuple[Any, ...]) -> StageSpec:
    return StageSpec(index=0, module=model, inputs=[InputRef(-1, i) for i in range(len(example_args))],
                     num_outputs=1, returns_tuple=False)


def _check_names(model: nn.Module, specs: list[StageSpec]) -> None:
    """Every parameter and buffer of the model must land in exactly one stage under its own name."""
    want = set(model.state_dict().keys())
    got: list[str] = [k for s in specs for k in s.module.state_dict()]
    if len(got) != len(set(got)) or set(got) != want:
        shared = {k for k in got if got.count(k) > 1}
        raise ValueError("splitting changed parameter names or shares parameters across stages "
                         f"(shared: {sorted(shared)[:5]}, missing: {sorted(want - set(got))[:5]}); "
                         "tied weights must live in one stage")


def build_task_model(task: Any, seed: int) -> nn.Module:
    """The task's model with the weights every cluster starts from."""
    torch.manual_seed(seed)
    return task.build_model()


TensorSpec = tuple[torch.Size, torch.dtype]


def stage_input_specs(specs: list[StageSpec], example_args: tuple[Any, ...]) -> list[list[TensorSpec]]:
    """Shape and dtype of every stage input, from one no-grad pass over the example inputs.

    Nodes use these to reject a well-formed message whose tensors do not fit before torch sees it."""
    outputs: dict[int, tuple[torch.Tensor, ...]] = {}
    result = []
    with torch.no_grad():
        for spec in specs:
            args = [example_args[r.index] if r.stage < 0 else outputs[r.stage][r.index] for r in spec.inputs]
            result.append([(a.shape, a.dtype) for a in args])
            out = spec.module(*args)
            outputs[spec.index] = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return result
