"""Tied weights across stages and weights forward never reads (issue #23 parts 3 and 4), in one process.

Which stage holds which name after a split; tied copies trained in a pipeline equal one process in sync mode
and each other bit for bit (also asynchronously); stage 0 keeps unread weights unchanged; export writes every
name of the unsplit model, a tie's names with one value.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ravq.cut.split import build_task_model, candidate_cuts, even_cuts, split_model
from ravq.persist import checkpoint
from ravq.persist.export import export_cluster
from ravq.stage.build import save
from ravq.stage.pipeline import StageWorker
from tests import zoo
from tests.pipeline_harness import make_workers, merged_state, run_workers, train_one_process

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed (pip install transformers)")


def _split(task: Any, stages: int) -> list[Any]:
    model = build_task_model(task, 0)
    return split_model(model, task.example_inputs(2), even_cuts(candidate_cuts(model, task), stages))


def _holders(specs: list[Any]) -> dict[int, dict[str, tuple[tuple[str, ...], tuple[int, ...]]]]:
    """stage -> group key -> (names it holds, holders)."""
    return {s.index: {g.key: (g.names, g.holders) for g in s.tied} for s in specs}


def _assert_copies_equal(workers: list[StageWorker]) -> None:
    """Every name of every tied group, on every holder, is bit-identical to the group key's first copy."""
    groups = {g.key for w in workers for g in w.spec.tied}
    assert groups, "no tied weights"
    for key in groups:
        copies = [(w.spec.index, n, w.module.get_parameter(n)) for w in workers for g in w.spec.tied
                  if g.key == key for n in g.names]
        assert len({s for s, _, _ in copies}) > 1
        first = copies[0][2]
        for stage, name, value in copies:
            assert torch.equal(value, first), f"stage {stage} {name} differs from {copies[0][:2]}"
        assert all(w.tied is not None and w.tied.settled() for w in workers if any(g.key == key for g in w.spec.tied))


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)


# ------------------------------------------------------------------------------------- the split
def test_tied_embedding_is_held_by_the_stages_that_read_it() -> None:
    """TiedNet (embed = head) in 3 stages: stage 0 reads it as embed.weight, stage 2 as head.weight, stage 1
    not at all; the tracer's stray copy in stage 0 (head.weight, read nowhere there) is gone."""
    specs = _split(zoo.tied, 3)
    assert _holders(specs) == {0: {"embed.weight": (("embed.weight",), (0, 2))}, 1: {},
                               2: {"embed.weight": (("head.weight",), (0, 2))}}
    names = [list(s.module.state_dict()) for s in specs]
    assert "head.weight" not in names[0] and "embed.weight" not in names[2]
    assert sorted(n for ns in names for n in ns) == sorted(build_task_model(zoo.tied, 0).state_dict())


def test_unsplit_model_keeps_its_tie() -> None:
    specs = _split(zoo.tied, 1)
    assert specs[0].tied == [] and specs[0].module.head.weight is specs[0].module.embed.weight


def test_unread_weight_and_buffer_go_to_stage_0() -> None:
    specs = _split(zoo.unused, 2)
    first = specs[0].module.state_dict()
    assert "head.spare" in first and "head.count" in first
    assert "head.spare" not in specs[1].module.state_dict() and "head.count" not in specs[1].module.state_dict()


@needs_transformers
def test_transformers_ties_split_by_name() -> None:
    """GPT-2: wte on stage 0, lm_head on the last.  T5 in 4 stages: the encoder's stage holds shared and
    encoder.embed_tokens (one tensor), the decoder's decoder.embed_tokens, the head's lm_head.  BERT MLM: the
    decoder weight is tied across stages, its bias to cls.predictions.bias inside the last stage only."""
    from tests import zoo_hf

    assert _holders(_split(zoo_hf.gpt2, 2)) == {0: {"transformer.wte.weight": (("transformer.wte.weight",), (0, 1))},
                                                1: {"transformer.wte.weight": (("lm_head.weight",), (0, 1))}}
    t5 = _split(zoo_hf.t5, 4)
    key, holders = "t5.shared.weight", (0, 2, 3)
    assert _holders(t5) == {0: {key: (("t5.encoder.embed_tokens.weight", "t5.shared.weight"), holders)}, 1: {},
                            2: {key: (("t5.decoder.embed_tokens.weight",), holders)},
                            3: {key: (("t5.lm_head.weight",), holders)}}
    first = t5[0].module
    assert first.get_parameter("t5.shared.weight") is first.get_parameter("t5.encoder.embed_tokens.weight")
    bert = _split(zoo_hf.bert, 2)
    key = "bert.embeddings.word_embeddings.weight"
    assert _holders(bert) == {0: {key: ((key,), (0, 1))}, 1: {key: (("cls.predictions.decoder.weight",), (0, 1))}}
    last = bert[1].module
    assert last.get_parameter("cls.predictions.bias") is last.get_parameter("cls.predictions.decoder.bias")


# ------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("stages", [2, 3])
def test_tied_sync_equals_one_process_and_copies_stay_identical(stages: int) -> None:
    workers = make_workers(zoo.tied, stages, steps=8, max_inflight=1)
    run_workers(workers)
    _assert_close(merged_state(workers), train_one_process(zoo.tied, steps=8))
    _assert_copies_equal(workers)


@pytest.mark.parametrize("update_every", [1, 2])
def test_tied_copies_identical_after_asynchronous_training(update_every: int) -> None:
    """max_inflight 3 with weight prediction: the holders apply their tied steps at different times, and end
    bit-identical once drained."""
    workers = make_workers(zoo.tied, 3, steps=24, max_inflight=3, update_every=update_every, predict_weights=1.0)
    run_workers(workers)
    _assert_copies_equal(workers)
    assert all(w.tied is None or w.tied.contributed == w.version for w in workers)


def test_unread_weights_stay_unchanged_and_train_like_one_process() -> None:
    before = build_task_model(zoo.unused, 0).state_dict()
    workers = make_workers(zoo.unused, 2, steps=6, max_inflight=1)
    run_workers(workers)
    got = merged_state(workers)
    _assert_close(got, train_one_process(zoo.unused, steps=6))
    assert torch.equal(got["head.spare"], before["head.spare"]) and torch.equal(got["head.count"], before["head.count"])


@needs_transformers
@pytest.mark.parametrize("kind", ["gpt2", "t5", "bert"])
def test_transformers_tied_sync_equals_one_process(kind: str) -> None:
    """2 stages, max_inflight 1: every weight equals one process's to 1e-5; the tied copies are bit-identical."""
    from tests import zoo_hf

    task = getattr(zoo_hf, kind)
    workers = make_workers(task, 2, steps=4, max_inflight=1)
    run_workers(workers, timeout_s=120)
    _assert_close(merged_state(workers), train_one_process(task, steps=4))
    _assert_copies_equal(workers)


@needs_transformers
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_tied_gpt2_eval_loss_equals_the_exported_model_in_one_process(stages: int) -> None:
    """Sync mode: the round at the last step evaluates the trained model, its head the trained embedding (one
    stage: not the initial head that repointing by deduplicated names left; cut: the eval graph holds the
    tie under the names the training stage does)."""
    import itertools

    from ravq.stage.types import RecipeOptions
    from tests import zoo_hf

    task = zoo_hf.gpt2
    recipe = RecipeOptions(eval_every=3, eval_count=2, eval_batches=task.eval_batches)
    workers = make_workers(task, stages, steps=6, max_inflight=1, recipe=recipe)
    run_workers(workers, timeout_s=120)
    history = workers[-1].recipe.evaluator.history
    assert [v for v, _ in history] == [3, 6]
    model = build_task_model(task, 0)
    model.load_state_dict(merged_state(workers))
    model.eval()
    with torch.no_grad():
        losses = [float(task.loss_fn(model(*x), y)) for x, y in itertools.islice(task.eval_batches(4, 0), 2)]
    assert history[-1][1] == pytest.approx(sum(losses) / len(losses), abs=1e-5)


# ------------------------------------------------------------------------------------- checkpoint and export
def test_export_writes_every_name_of_a_tie_with_one_value(tmp_path: Path) -> None:
    """Stage checkpoints hold each copy under the names that stage reads; the export names everything the
    unsplit model's state_dict does, the tie's names with the copy that applied the most tied steps."""
    workers = make_workers(zoo.tied, 3, steps=6, max_inflight=1)
    run_workers(workers)
    with torch.no_grad():  # as a checkpoint written mid-run: the last stage's copy one tied step behind
        workers[2].module.get_parameter("head.weight").add_(1.0)
    workers[2].tied.applied["embed.weight"] -= 1  # type: ignore[union-attr]
    for w in workers:
        save(w, str(tmp_path), cluster=0, stage=w.spec.index, node=f"n{w.spec.index}", run_id="r",
             cluster_nodes=["n0", "n1", "n2"])
    assert "head.weight" not in checkpoint.load_stage(tmp_path, 0, 0).model
    assert checkpoint.load_stage(tmp_path, 0, 2).meta["tied"][0]["applied"] == 5
    for model in (None, build_task_model(zoo.tied, 0)):
        out = tmp_path / "model.safetensors"
        export_cluster(tmp_path, out, model=model)
        exported = load_file(str(out))
        build_task_model(zoo.tied, 0).load_state_dict(exported, strict=True)
        assert torch.equal(exported["embed.weight"], exported["head.weight"])
        _assert_close(exported, train_one_process(zoo.tied, steps=6))


def test_frame_limit_admits_a_tied_gradient() -> None:
    """A stage's derived frame limit covers the tied weight's gradient another holder sends it (the
    vocabulary-sized embedding can be larger than any activation)."""
    from ravq.cut.split import stage_input_specs
    from ravq.stage.frames import largest_inbound_frame

    specs = _split(zoo.tied, 3)
    in_specs = stage_input_specs(specs, zoo.tied.example_inputs(2))
    embed = specs[0].module.get_parameter("embed.weight")
    for stage in (0, 2):
        assert largest_inbound_frame(specs, in_specs, stage) >= embed.numel() * embed.element_size()


def test_copies_resynchronise_after_a_disruption() -> None:
    """A pause drops the work in flight and may load other weights (a checkpoint, a catch-up from another
    cluster): at resume the key holder's copy and optimizer state go to the other holders, the count of tied
    steps starts again, and training ends with the copies bit-identical and nothing waiting."""
    adam = SimpleNamespace(**{**vars(zoo.tied), "make_optimizer": lambda params: torch.optim.Adam(params, lr=1e-2)})
    workers = make_workers(adam, 3, steps=6, max_inflight=2)
    run_workers(workers)
    last = workers[2]
    with torch.no_grad():
        last.module.get_parameter("head.weight").add_(1.0)  # as a catch-up from another cluster would
    for w in workers:
        w.options.steps = 12
        w.reset(1)
    assert last.tied is not None and last.tied.behind()  # no forward before the key holder's copy
    for w in workers:
        w.resume(6)
    last.run_pending()  # the compute thread's work: take the copy that arrived
    assert not last.tied.behind()
    first = workers[0].module.get_parameter("embed.weight")
    assert torch.equal(last.module.get_parameter("head.weight"), first)
    state0, state2 = (w.optimizer.state[w.module.get_parameter(n)] for w, n in ((workers[0], "embed.weight"),
                                                                                (last, "head.weight")))
    assert all(torch.equal(state0[k], state2[k]) for k in state0)
    run_workers(workers)
    _assert_copies_equal(workers)
    assert all(w.trained == 12 for w in workers)
