"""The split cache (``ravq.cut.split_cache``): a hit rebuilds stages that compute the same outputs and
gradients as a fresh trace, with the same names, order and ties; a damaged or mismatched file is traced
again and rewritten, with one log line."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from ravq.cut.meta import build_meta_model, retarget_device
from ravq.cut.split import StageSpec, build_task_model, candidate_cuts, even_cuts, model_output
from ravq.cut.split_cache import cached_split, cached_stages, split_key
from ravq.tasks import charlm
from tests import zoo

TASKS = {"charlm": charlm, "tied": zoo.tied, "unused": zoo.unused}


def _cuts(task: Any, stages: int) -> list[str]:
    return even_cuts(candidate_cuts(build_meta_model(task, 0).model, task), stages)


def _split(task: Any, cuts: list[str], cache: Path) -> list[StageSpec]:
    return cached_split(build_meta_model(task, 0).model, task.example_inputs(2), cuts, cache)


def _run(task: Any, specs: list[StageSpec]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Give the stages the seed's weights, run one micro-batch through them and backward: loss and grads."""
    weights = build_task_model(task, 0).state_dict()
    for spec in specs:
        spec.module.to_empty(device="cpu")
        retarget_device(spec.module, "meta", "cpu")
        own = spec.module.state_dict()
        spec.module.load_state_dict({k: weights[k] for k in own}, strict=True)
        for b in spec.module.buffers():  # non-persistent buffers: not in the state dict, same on every build
            if b.is_floating_point() and not any(b is v for v in own.values()):
                b.zero_()
    inputs, targets = next(iter(task.train_batches(2, 0, 1, 0)))
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    outputs: dict[int, tuple[torch.Tensor, ...]] = {}
    torch.manual_seed(0)
    for spec in specs:
        got = [inputs[r.index] if r.stage < 0 else outputs[r.stage][r.index] for r in spec.received]
        out = spec.module(*got[: len(spec.inputs)])
        outputs[spec.index] = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    last = specs[-1]
    received = [inputs[r.index] if r.stage < 0 else outputs[r.stage][r.index] for r in last.received]
    raw = outputs[last.index] if last.returns_tuple else outputs[last.index][0]
    loss = task.loss_fn(model_output(last, raw, received), targets)
    loss.backward()
    grads = {f"{s.index}:{n}": p.grad.clone() for s in specs for n, p in s.module.named_parameters()
             if p.grad is not None}
    return loss.detach(), grads


def _describe(specs: list[StageSpec]) -> list[Any]:
    return [(s.inputs, s.num_outputs, s.returns_tuple, s.consumers, s.loss_inputs, s.output_leaves,
             str(s.output_spec), s.tied, list(s.module.state_dict()),
             [(n, p.shape, p.dtype) for n, p in s.module.named_parameters(remove_duplicate=False)],
             sorted(m._non_persistent_buffers_set for _, m in s.module.named_modules() if m._non_persistent_buffers_set))
            for s in specs]


@pytest.mark.parametrize(("name", "stages"), [("charlm", 2), ("charlm", 3), ("tied", 3), ("unused", 2)])
def test_a_hit_computes_what_a_fresh_trace_computes(tmp_path: Path, name: str, stages: int,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    task = TASKS[name]
    cuts = _cuts(task, stages)
    caplog.set_level(logging.INFO, logger="ravq.cut.split_cache")
    fresh, fresh_inputs = cached_stages(build_meta_model(task, 0).model, task.example_inputs(2), cuts, tmp_path)
    assert len(list(tmp_path.glob("split-*.json"))) == 1 and "read from the cache" not in caplog.text
    cached, cached_inputs = cached_stages(build_meta_model(task, 0).model, task.example_inputs(2), cuts, tmp_path)
    assert "read from the cache" in caplog.text
    assert _describe(cached) == _describe(fresh)
    assert cached_inputs == fresh_inputs
    loss_f, grads_f = _run(task, fresh)
    loss_c, grads_c = _run(task, cached)
    assert torch.equal(loss_f, loss_c)
    assert grads_f.keys() == grads_c.keys() and grads_f
    for k in grads_f:
        assert torch.equal(grads_f[k], grads_c[k]), k


def test_damaged_or_mismatched_cache_is_traced_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cuts = _cuts(charlm, 2)
    _split(charlm, cuts, tmp_path)
    path = next(tmp_path.glob("split-*.json"))
    good = path.read_text()
    doc = json.loads(good)
    for damaged in (good[: len(good) // 2],  # a torn write
                    json.dumps({**doc, "body": doc["body"].replace('"num_outputs": 1', '"num_outputs": 2', 1)}),
                    json.dumps({**doc, "key": "0" * 64})):  # another model's entry under this name
        path.write_text(damaged)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ravq.cut.split_cache"):
            specs = _split(charlm, cuts, tmp_path)
        assert "unusable" in caplog.text and "tracing again" in caplog.text
        assert [s.num_outputs for s in specs] == [1, 1]
        assert json.loads(path.read_text()) == doc  # rewritten whole
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ravq.cut.split_cache"):
        _split(charlm, cuts, tmp_path)
    assert "read from the cache" in caplog.text


def test_the_key_follows_model_inputs_and_cuts() -> None:
    model = build_meta_model(charlm, 0).model
    cuts = _cuts(charlm, 2)
    key = split_key(model, charlm.example_inputs(2), cuts)
    assert key == split_key(build_meta_model(charlm, 0).model, charlm.example_inputs(2), cuts)
    assert key != split_key(model, charlm.example_inputs(4), cuts)
    assert key != split_key(model, charlm.example_inputs(2), _cuts(charlm, 3)[:1])
    model.blocks[0].mlp_in.weight = torch.nn.Parameter(torch.empty(1, 1, device="meta"))
    assert key != split_key(model, charlm.example_inputs(2), cuts)


def test_code_fx_would_fold_into_constants_is_not_cached(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """GPT-2 computes its positions with torch.arange(context, device=meta), an op without a tensor input: fx's
    tracer, re-running the cached code, ran it once and kept its meta result as a constant, and a restarted
    GPT-2 stage failed at its first forward ('GraphModule' object has no attribute '_tensor_constant0').
    Such a split is not cached (one log line) and every start traces it, computing what a trace computes."""
    from ravq.tasks.text import configure
    task = configure(layers=2, hidden=32, heads=2, context=16)
    cuts = ["transformer.h.1"]
    caplog.set_level(logging.INFO, logger="ravq.cut.split_cache")
    first = _split(task, cuts, tmp_path)
    assert "not cached (fx folds ops without tensor inputs into constants" in caplog.text
    assert not list(tmp_path.glob("split-*.json"))
    again = _split(task, cuts, tmp_path)
    want_loss, want_grads = _run(task, first)
    got_loss, got_grads = _run(task, again)
    torch.testing.assert_close(got_loss, want_loss)
    assert got_grads.keys() == want_grads.keys()


def test_a_trace_shows_the_user_no_warning_about_torchs_own_deprecations() -> None:
    """torch's tracer deep-copies its pytree specs and warns (FutureWarning, LeafSpec) on every `ravq check` and
    demo: the split keeps it off the user's terminal, and lets every other warning through."""
    import warnings

    from ravq.cut.trace import split_pipe

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        split_pipe(model, (torch.randn(2, 4),), ["2"])
        warnings.warn("a user's own notice", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen if "LeafSpec" in str(w.message)] == []
    assert any("a user's own notice" in str(w.message) for w in seen)
