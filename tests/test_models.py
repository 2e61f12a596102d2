"""The models people train, in one process: BatchNorm, rotary embeddings, structured outputs, tied weights,
and the errors for what ravq cannot split."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ravq.average.segments import apply_average_delta, averaged_names, flatten
from ravq.cut.split import SplitError, build_task_model, split_model, stage_input_specs
from tests import zoo
from tests.pipeline_harness import make_workers, merged_state, run_workers, train_one_process


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", ["batchnorm", "rotary", "structured"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_sync_pipeline_equals_one_process(name: str, stages: int) -> None:
    """max_inflight 1: weights AND buffers (BatchNorm's running statistics, num_batches_tracked) equal one
    process's; the structured model's loss_fn asserts it gets the model's own NetOutput."""
    task = getattr(zoo, name)
    workers = make_workers(task, stages, steps=12, max_inflight=1)
    run_workers(workers)
    _assert_same(merged_state(workers), train_one_process(task, steps=12))


def test_running_statistics_move_in_training() -> None:
    """The equivalence above would be vacuous if BatchNorm's statistics stayed put."""
    fresh = build_task_model(zoo.batchnorm, 0).state_dict()
    trained = train_one_process(zoo.batchnorm, steps=3)
    assert (trained["bn1.running_mean"] - fresh["bn1.running_mean"]).abs().max() > 0.1
    assert int(trained["bn2.num_batches_tracked"]) == 3


def test_split_and_shape_pass_leave_buffers_alone() -> None:
    model = build_task_model(zoo.batchnorm, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    example = (torch.randn(4, zoo.FEATURES) * 3 + 2,)
    specs = split_model(model, example, ["bn1", "bn2"])
    stage_input_specs(specs, example)
    after = {k: v for s in specs for k, v in s.module.state_dict().items()}
    for name, value in before.items():
        assert torch.equal(after[name], value), name


@pytest.mark.parametrize("name", ["batchnorm", "rotary", "structured"])
def test_async_pipeline_trains(name: str) -> None:
    task = getattr(zoo, name)
    workers = make_workers(task, 3, steps=30, max_inflight=3)
    run_workers(workers)
    assert all(w.stats.backwards == 30 for w in workers)
    assert workers[0].stats.staleness_max > 0


def test_non_persistent_buffer_stays_non_persistent() -> None:
    """Rotary's inv_freq: on the stage that uses it, not in state_dict (so not averaged or checkpointed)."""
    model = build_task_model(zoo.rotary, 0)
    specs = split_model(model, zoo.rotary.example_inputs(2), ["layers.1", "layers.2"])
    holders = [s.index for s in specs if "rotary.inv_freq" in dict(s.module.named_buffers())]
    assert holders == [0]
    assert all("rotary.inv_freq" not in s.module.state_dict() for s in specs)
    assert "rotary.inv_freq" not in averaged_names(build_task_model(zoo.rotary, 0))
    # cos/sin (made under no_grad in stage 0) cross both cuts as stage inputs
    assert specs[2].producer_stages == [0, 1]


def test_structured_output_leaf_from_an_earlier_stage_reaches_the_loss() -> None:
    """``extras["early"]`` is made in stage 0 and goes straight to the last stage (and its gradient back)."""
    model = build_task_model(zoo.structured, 0)
    specs = split_model(model, zoo.structured.example_inputs(2), ["l2", "l3", "head"])
    assert specs[-1].loss_inputs and specs[-1].loss_inputs[0].stage == 0
    assert 3 in specs[0].consumer_stages


def test_tuple_and_dict_outputs_reach_loss_as_returned() -> None:
    """One stage or several: loss_fn gets the tuple / dict the model returns, not a flat tensor."""

    class TupleNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            h = self.b(torch.tanh(self.a(x)))
            return self.c(torch.tanh(h)), {"h": h}

    def loss(out: tuple[torch.Tensor, dict[str, torch.Tensor]], targets: torch.Tensor) -> torch.Tensor:
        assert isinstance(out, tuple) and isinstance(out[1], dict), type(out)
        logits, extras = out
        return nn.functional.cross_entropy(logits, targets) + 0.01 * extras["h"].square().mean()

    task = SimpleNamespace(**{**vars(zoo.structured), "build_model": TupleNet, "loss_fn": loss,
                              "split_points": lambda: ["b", "c"]})
    want = train_one_process(task, steps=6)
    for stages in (1, 2, 3):
        workers = make_workers(task, stages, steps=6, max_inflight=1)
        run_workers(workers)
        _assert_same(merged_state(workers), want)


class _Cache:
    """Stands in for transformers' DynamicCache: an object in the output that is not a tensor."""


class _CachingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        return {"logits": self.b(self.a(x)), "past_key_values": _Cache()}


class _Plain:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class _PlainNet(_CachingNet):
    def forward(self, x: torch.Tensor) -> _Plain:  # type: ignore[override]
        return _Plain(self.b(self.a(x)))


class _BranchyNet(_CachingNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        h = self.a(x)
        if h.sum() > 0:  # data-dependent Python control flow: the tracer cannot capture it
            h = h * 2
        return self.b(h)


def test_cache_output_is_refused_with_what_to_do() -> None:
    with pytest.raises(SplitError, match=r"output\['past_key_values'\] is a _Cache.*use_cache=False"):
        split_model(_CachingNet(), (torch.zeros(2, 4),), ["b"])


def test_unknown_output_class_is_refused_with_what_to_do() -> None:
    with pytest.raises(SplitError, match=r"_Plain.*register_dataclass"):
        split_model(_PlainNet(), (torch.zeros(2, 4),), ["b"])


def test_tracer_failure_says_its_real_reason() -> None:
    with pytest.raises(SplitError) as info:
        split_model(_BranchyNet(), (torch.zeros(2, 4),), ["b"])
    text = str(info.value)
    assert "cannot capture" in text and "data-dependent" in text.lower(), text
    assert info.value.__cause__ is not None  # torch's own error stays attached


def test_fresh_buffers_keep_in_flight_forwards_valid() -> None:
    """Averaging adds its delta to the buffers while forwards are in flight: they must get new storage,
    or backward finds BatchNorm's saved running statistics modified in place."""
    (worker,) = make_workers(zoo.batchnorm, 1, steps=2, max_inflight=2)
    batches = zoo.batchnorm.train_batches(4, 0, 1, 0)
    losses = {}
    for seq in range(2):  # two forwards in flight
        (x,), t = next(batches)
        worker.passes.run_module((0, seq), [x])
        losses[seq] = zoo.batchnorm.loss_fn(worker.state.stash[(0, seq)].outputs[0], t)
    names = [n for n in averaged_names(worker.module) if n in worker.buffers]
    live = worker.fresh_buffers(names)
    snapshot = flatten(list(live.values()))
    apply_average_delta(list(live.values()), snapshot, snapshot + 1.0)  # a round's delta, in place
    assert all(worker.module.get_buffer(n) is worker.buffers[n] for n in names)
    for seq, loss in losses.items():
        worker.passes.backward_from((0, seq), worker.state.stash[(0, seq)], [loss], [None], lambda out: None)
    assert worker.version == 2
