"""Models built on ``meta``: each stage gets real weights of its own only, the same whatever the cut; a
pretrained checkpoint is read per stage; export writes what the model loads; errors say what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ravq.cut.materialize import MaterializeError, materialize
from ravq.cut.meta import build_meta_model, is_meta, retarget_device
from ravq.cut.split import SplitError, build_task_model, candidate_cuts, even_cuts, split_model
from ravq.persist.export import export_cluster
from ravq.tasks import charlm
from tests import zoo

transformers = pytest.importorskip("transformers")


def _gpt2_task() -> SimpleNamespace:
    from ravq.tasks.hf_causal_lm import make_task

    return make_task("gpt2", layers=3, hidden=32, heads=2, context=16)


@pytest.mark.parametrize("task", [charlm, zoo.rotary, zoo.batchnorm, zoo.structured, "gpt2", "llama"],
                         ids=["charlm", "rotary", "batchnorm", "structured", "gpt2", "llama"])
def test_every_stage_starts_from_the_same_weights_whatever_the_cut(task: object) -> None:
    """Two plans with different cuts: each stage's tensors equal the one-process model's, bit for bit, and
    the rest of the model stays on meta (a node never holds more than its stage)."""
    if isinstance(task, str):
        from ravq.tasks.hf_causal_lm import make_task

        task = make_task(task, layers=4, hidden=32, heads=2, context=16)
    whole = build_task_model(task, 5)
    reference = {k: v.clone() for k, v in whole.state_dict().items()}  # a train-mode forward moves BatchNorm's
    example = task.example_inputs(2)  # type: ignore[attr-defined]
    candidates = candidate_cuts(build_meta_model(task, 5).model, task)
    for stages in (2, 3):
        specs = split_model(build_meta_model(task, 5).model, example, even_cuts(candidates, stages))
        for spec in specs:
            assert is_meta(spec.module)
            materialize(spec.module, task, 5)
            retarget_device(spec.module, "meta", "cpu")
            assert not is_meta(spec.module)
            for name, value in spec.module.state_dict().items():
                assert torch.equal(value, reference[name]), (stages, spec.index, name)
        # and they run: devices traced on meta (arange(device=...), .to(device)) now say cpu
        x = next(iter(task.train_batches(2, 0, 1, 0)))[0]  # type: ignore[attr-defined]
        x = tuple(x) if isinstance(x, (tuple, list)) else (x,)
        with torch.no_grad():
            got = _pipeline(specs, x)
            want = whole(*x)
        got, want = (getattr(o, "logits", o) for o in (got, want))
        got, want = (o[0] if isinstance(o, tuple) else o for o in (got, want))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_different_seed_gives_other_weights() -> None:
    a, b = build_task_model(charlm, 1).state_dict(), build_task_model(charlm, 2).state_dict()
    assert not torch.equal(a["blocks.0.qkv.weight"], b["blocks.0.qkv.weight"])


def test_materialize_gives_memory_only_to_what_is_still_on_meta() -> None:
    """An eval graph points its weights at the training stage's first: materializing then leaves those
    tensors as they are (the same objects), gives the rest the values they would have had, and allocates
    nothing at all once nothing is left on meta (no transient second copy of the stage)."""
    model = build_meta_model(charlm, 3).model
    live = build_task_model(charlm, 3)
    real = dict(live.named_parameters())
    kept = "blocks.0.qkv.weight"
    model.get_submodule("blocks.0.qkv")._parameters["weight"] = real[kept]
    report = materialize(model, charlm, 3)
    assert model.get_parameter(kept) is real[kept]
    assert report.names > 0
    torch.testing.assert_close(model.state_dict(), live.state_dict(), rtol=0, atol=0)
    assert materialize(model, charlm, 3).names == 0


class _OwnParameter(nn.Module):
    """A bare parameter set in ``__init__`` with no reset_parameters: only the constructor knows its value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_a_parameter_no_initialiser_sets_takes_the_constructors_value(caplog: pytest.LogCaptureFixture) -> None:
    task = SimpleNamespace(build_model=_OwnParameter)
    model = build_meta_model(task, 3).model
    report = materialize(model, task, 3)
    assert report.from_constructor == ["scale"]
    torch.manual_seed(3)
    assert torch.equal(model.scale, _OwnParameter().scale)
    assert "no initialiser sets scale" in caplog.text


@pytest.mark.parametrize(("kind", "module"), [("bert_edited", "cls.predictions"), ("t5_edited", "t5")])
def test_a_model_edited_after_init_starts_from_what_its_modules_hold(kind: str, module: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """BERT MLM without its head bias, T5 with ``shared`` replaced: transformers' ``_init_weights`` fails on the
    changed module, which falls back (one warning names it); every stage of a cut starts from the whole model's
    values, and 2 stages train like one process."""
    from tests import zoo_hf
    from tests.pipeline_harness import make_workers, merged_state, run_workers, train_one_process

    task = getattr(zoo_hf, kind)
    with caplog.at_level("WARNING", logger="ravq.cut.materialize"):
        reference = dict(build_task_model(task, 5).state_dict())
    warned = [r.getMessage() for r in caplog.records if "_init_weights cannot initialise" in r.getMessage()]
    assert len(warned) == 1 and f"initialise {module}," in warned[0], warned
    assert not any(torch.isnan(v).any() for v in reference.values() if v.is_floating_point())
    model = build_meta_model(task, 5).model
    for spec in split_model(model, task.example_inputs(2), even_cuts(candidate_cuts(model, task), 2)):
        materialize(spec.module, task, 5)
        for name, value in spec.module.state_dict().items():
            assert torch.equal(value, reference[name]), (spec.index, name)
    workers = make_workers(task, 2, steps=2, max_inflight=1)
    run_workers(workers, timeout_s=120)
    want = train_one_process(task, steps=2)
    for name, value in merged_state(workers).items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=1e-5, msg=name)


def test_a_task_init_weights_runs_last_per_module() -> None:
    seen: list[str] = []

    def init_weights(module: nn.Module, name: str) -> None:
        seen.append(name)
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.weight)

    task = SimpleNamespace(build_model=lambda: nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)),
                           init_weights=init_weights)
    model = build_task_model(task, 0)
    assert torch.count_nonzero(model[0].weight) == 0 and torch.count_nonzero(model[2].weight) == 0
    assert seen == ["0", "2", ""]  # children first; only modules that own tensors, and their ancestors


class _Eval(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(self.a(x)))


def test_a_model_built_in_eval_mode_trains_with_dropout() -> None:
    """``from_pretrained`` gives a model in eval mode; the stages must still train with dropout on."""
    task = SimpleNamespace(build_model=lambda: _Eval().eval())
    specs = split_model(build_meta_model(task, 0).model, (torch.ones(4, 8),), ["drop"])
    materialize(specs[1].module, task, 0)
    retarget_device(specs[1].module, "meta", "cpu")
    h = torch.ones(4, 8)
    outs = {tuple(specs[1].module(h).flatten().tolist()) for _ in range(4)}
    assert len(outs) > 1, "dropout is off"


def test_plan_errors_say_how_to_get_more_cut_points() -> None:
    with pytest.raises(ValueError, match="split_points"):
        even_cuts(["a", "b"], 4)


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:  # data-dependent control flow: the tracer cannot capture it
            h = -h
        return self.b(h)


def test_a_tracer_error_names_the_line_in_the_users_code() -> None:
    with pytest.raises(SplitError) as err:
        split_model(_Branchy(), (torch.ones(2, 4),), ["b"])
    assert "test_meta_build.py" in str(err.value) and "h.sum() > 0" in str(err.value)


def _save_pretrained(tmp: Path, tied: bool) -> nn.Module:
    config = transformers.GPT2Config(n_embd=32, n_layer=3, n_head=2, n_positions=16, vocab_size=charlm.VOCAB,
                                     use_cache=False, tie_word_embeddings=tied, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    torch.manual_seed(11)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp)
    return model.eval()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_pretrained_checkpoint_is_read_per_stage(tmp_path: Path, tied: bool) -> None:
    """A GPT-2 saved with save_pretrained (tied: the file holds the embedding once, the last stage's head
    reads it too), loaded stage by stage, each stage reading only its own tensors: the pipeline's logits
    equal the unsplit model's."""
    original = _save_pretrained(tmp_path / "gpt2", tied=tied)
    task = SimpleNamespace(build_model=lambda: transformers.GPT2LMHeadModel(original.config),
                           pretrained=str(tmp_path / "gpt2"))
    x = torch.randint(0, charlm.VOCAB, (2, 16))
    specs = split_model(build_meta_model(task, 0).model, (x,), ["transformer.h.1", "transformer.h.2"])
    loaded = []
    for spec in specs:
        report = materialize(spec.module, task, 0)
        retarget_device(spec.module, "meta", "cpu")
        assert report.loaded and not report.missing and not report.from_constructor
        assert len(report.loaded) == report.names  # every tensor of the stage came from the checkpoint
        loaded += report.loaded
    from safetensors import safe_open

    with safe_open(str(tmp_path / "gpt2" / "model.safetensors"), framework="pt") as f:
        assert set(loaded) == set(f.keys())  # the stages together read the file once over
    with torch.no_grad():
        torch.testing.assert_close(_pipeline(specs, (x,)).logits, original(x).logits, rtol=0, atol=1e-5)


def _pipeline(specs: list, args: tuple) -> object:  # type: ignore[type-arg]
    """The stages run one after the other, each handed what it receives, as nodes do."""
    from ravq.cut.split import model_output

    outputs: dict[int, tuple] = {}  # type: ignore[type-arg]
    for spec in specs:
        got = [args[r.index] if r.stage < 0 else outputs[r.stage][r.index] for r in spec.received]
        raw = spec.module(*got[: len(spec.inputs)])
        outputs[spec.index] = tuple(raw) if isinstance(raw, (tuple, list)) else (raw,)
    return model_output(specs[-1], raw, got)


def test_a_checkpoint_that_does_not_fit_the_model_is_refused(tmp_path: Path) -> None:
    _save_pretrained(tmp_path / "gpt2", tied=False)
    other = transformers.GPT2Config(n_embd=64, n_layer=3, n_head=2, n_positions=16, vocab_size=charlm.VOCAB,
                                    use_cache=False, tie_word_embeddings=False)
    task = SimpleNamespace(build_model=lambda: transformers.GPT2LMHeadModel(other), pretrained=str(tmp_path / "gpt2"))
    with pytest.raises(MaterializeError, match="has shape"):
        build_task_model(task, 0)


def test_export_writes_what_the_model_loads(tmp_path: Path) -> None:
    """Stage checkpoints of a 3-stage charlm: the export (a tensor at a time) loads with strict=True and
    holds each stage's weights; checked against the task's model, a wrong model is refused."""
    from ravq.persist.checkpoint import save_stage

    model = build_meta_model(charlm, 0).model
    specs = split_model(model, charlm.example_inputs(2), even_cuts(candidate_cuts(model, charlm), 3))
    for spec in specs:
        materialize(spec.module, charlm, 0)
        opt = torch.optim.SGD(spec.module.parameters(), lr=0.1)
        save_stage(tmp_path, cluster=0, stage=spec.index, num_stages=3, node=f"n{spec.index}", module=spec.module,
                   optimizer=opt, version=4, data_position=0, run_id="r")
    out = tmp_path / "model.safetensors"
    info = export_cluster(tmp_path, out, 0, model=build_meta_model(charlm, 0).model)
    assert info["format"] == "state_dict" and info["versions"] == [4, 4, 4]
    from safetensors.torch import load_file

    fresh = charlm.build_model()
    fresh.load_state_dict(load_file(str(out)), strict=True)
    assert torch.equal(fresh.state_dict()["pos"], build_task_model(charlm, 0).state_dict()["pos"])
    with pytest.raises(ValueError, match="do not hold the task's model"):
        export_cluster(tmp_path, out, 0, model=build_meta_model(zoo.rotary, 0).model)


def test_ravq_export_writes_a_from_pretrained_directory(tmp_path: Path) -> None:
    """With the topology, a transformers model is exported as a directory from_pretrained loads."""
    import yaml

    from ravq.persist.checkpoint import save_stage

    task = _gpt2_task()
    model = build_meta_model(task, 0).model
    specs = split_model(model, task.example_inputs(2), ["transformer.h.2"])
    for spec in specs:
        materialize(spec.module, task, 0)
        save_stage(tmp_path / "ckpt", cluster=0, stage=spec.index, num_stages=2, node=f"n{spec.index}",
                   module=spec.module, optimizer=torch.optim.SGD(spec.module.parameters(), lr=0.1), version=1,
                   data_position=0, run_id="r")
    topology = {"task": "tests.test_meta_build:GPT2_TASK", "nodes": [{"name": "a", "pipeline_port": 1, "ring_port": 2}],
                "broker": {"pub_port": 3, "router_port": 4}}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(topology))
    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-m", "ravq", "export", "--checkpoint-dir", str(tmp_path / "ckpt"),
                           "--out", str(out), "--topology", str(tmp_path / "t.yaml")],
                          cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "from_pretrained" in proc.stdout
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    want = build_task_model(task, 0).eval()
    x = torch.randint(0, charlm.VOCAB, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, want(x).logits, rtol=0, atol=1e-6)


GPT2_TASK = _gpt2_task()


def test_a_swarm_trains_from_a_pretrained_checkpoint_and_exports_it(tmp_path: Path) -> None:
    """A 1x2 swarm starts from a saved GPT-2 (each node reads its stage's tensors), trains, checkpoints;
    `ravq export --topology` writes a directory from_pretrained loads, whose logits are the trained
    stages' logits."""
    from ravq.persist.checkpoint import load_stage
    from tests.swarm import Swarm, local_topology

    original = _save_pretrained(tmp_path / "gpt2", tied=True)
    ckpt = tmp_path / "ckpt"
    training = {"steps": 6, "micro_batch": 2, "max_inflight": 1, "checkpoint_dir": str(ckpt)}
    env = {"RAVQ_TEST_PRETRAINED": str(tmp_path / "gpt2")}
    swarm = Swarm(tmp_path, local_topology("tests.pretrained_task", [2], training),
                  env={"c0s0": env, "c0s1": env})
    try:
        codes = swarm.wait(timeout_s=300)
        assert all(c == 0 for c in codes.values()), {n: swarm.log(n)[-2000:] for n, c in codes.items() if c}
    finally:
        swarm.close()
    assert "from the pretrained checkpoint" in swarm.log("c0s0") + swarm.log("c0s1")
    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-m", "ravq", "export", "--checkpoint-dir", str(ckpt), "--out", str(out),
                           "--topology", str(swarm.path)], cwd=Path(__file__).parent.parent,
                          env={**__import__("os").environ, **env}, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    exported = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    trained = transformers.GPT2LMHeadModel(original.config).eval()
    state = {**load_stage(ckpt, 0, 0).model, **load_stage(ckpt, 0, 1).model}
    trained.load_state_dict(state, strict=True)
    assert not torch.equal(state["lm_head.weight"], original.state_dict()["lm_head.weight"])  # it trained
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])  # and stayed tied
    x = torch.randint(0, charlm.VOCAB, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(exported(x).logits, trained(x).logits, rtol=0, atol=1e-6)


def test_profiling_a_model_that_does_not_fit_times_its_largest_block() -> None:
    """``ravq profile`` times the whole model when it fits in the budget, else its largest block alone,
    its inputs made by the blocks before it (each given weights only while it runs)."""
    from ravq.profile.step import training_step_target

    whole, _ = training_step_target(charlm, 2, "cpu", budget_bytes=1 << 40)
    assert len(whole) == len(list(build_task_model(charlm, 0).parameters()))
    block, forward = training_step_target(charlm, 2, "cpu", budget_bytes=1)
    assert 0 < sum(p.numel() for p in block) < sum(p.numel() for p in whole)
    loss = forward()
    loss.backward()
    assert all(p.grad is not None for p in block)


def test_a_new_run_starts_from_an_export_whatever_the_new_cuts(tmp_path: Path) -> None:
    """Re-planning keeps the weights: a 3-stage charlm trained away from the seed is exported, and the stages
    of a 2-stage plan built with ``training.init_from`` set to that export hold its tensors, each stage its
    own; without it they hold the seed's."""
    from safetensors.torch import load_file

    from ravq.config import TrainingConfig
    from ravq.metrics import Metrics
    from ravq.persist.checkpoint import save_stage
    from ravq.stage.build import build_stage

    model = build_meta_model(charlm, 0).model
    candidates = candidate_cuts(model, charlm)
    old = split_model(model, charlm.example_inputs(2), even_cuts(candidates, 3))
    for spec in old:
        materialize(spec.module, charlm, 0)
        with torch.no_grad():
            for p in spec.module.parameters():
                p.add_(0.5)  # "trained": far from the seed's values
        save_stage(tmp_path / "old", cluster=0, stage=spec.index, num_stages=3, node=f"n{spec.index}",
                   module=spec.module, optimizer=torch.optim.SGD(spec.module.parameters(), lr=0.1), version=9,
                   data_position=0, run_id="r1")
    out = tmp_path / "model.safetensors"
    export_cluster(tmp_path / "old", out, 0, model=build_meta_model(charlm, 0).model)
    exported, seed = load_file(str(out)), build_task_model(charlm, 0).state_dict()
    new_cuts = even_cuts(candidates, 2)
    assert new_cuts != even_cuts(candidates, 3)
    for init_from, want in ((str(out), exported), (None, seed)):
        training = TrainingConfig(micro_batch=2, init_from=init_from)
        for stage in range(2):
            built = build_stage(charlm, training, seed=0, cuts=new_cuts, stage=stage, cluster=0, clusters=1,
                                device="cpu", metrics=Metrics(f"s{stage}"))
            held = built.worker.module.state_dict()
            assert held
            for name, value in held.items():
                assert torch.equal(value, want[name]), (init_from, stage, name)
