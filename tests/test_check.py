"""``ravq check`` (ravq.preflight) and finding a task where the user stands (ravq.config.task): the check
passes on the built-in tasks and the models of tests/test_hf_models.py, and names cause and fix on a zoo of
broken tasks (tests/check_zoo.py), one per problem; all in-process on tiny models."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from ravq.config import ConfigError, portable_task_spec, resolve_task_module
from ravq.preflight import CheckSettings, PlacedMemory, Report, run_checks

ROOT = Path(__file__).resolve().parent.parent
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def check(spec: str, stages: int = 2, **settings: object) -> Report:
    settings = {"micro_batch": 4, "stages": stages, "runtime_bytes": 0, **settings}
    return run_checks(spec, CheckSettings(**settings))  # type: ignore[arg-type]


def findings(report: Report, level: str) -> str:
    return "\n".join(f.format() for f in report.findings if f.level == level)


# ---------------------------------------------------------------- finding the task
@pytest.fixture
def user_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty folder holding a copy of the task the README says to copy, as the current folder; sys.path
    and sys.modules put back after."""
    shutil.copy(ROOT / "ravq" / "tasks" / "charlm.py", tmp_path / "mytask.py")
    (tmp_path / "sub").mkdir()
    shutil.copy(ROOT / "ravq" / "tasks" / "charlm.py", tmp_path / "sub" / "othertask.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    for name in ("mytask", "othertask"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


def test_task_found_in_the_current_folder_and_by_path(user_folder: Path) -> None:
    assert resolve_task_module("mytask").__file__ == str(user_folder / "mytask.py")
    by_path = resolve_task_module("sub/othertask.py")
    assert by_path.__file__ == str(user_folder / "sub" / "othertask.py")
    assert resolve_task_module("./sub/othertask.py") is by_path  # the same module, not a second copy
    assert callable(resolve_task_module(str(user_folder / "mytask.py")).build_model)
    # a process started elsewhere (a node, a unit) is handed the file, not a name only this folder resolves
    assert portable_task_spec("mytask") == str(user_folder / "mytask.py")
    assert portable_task_spec("sub/othertask.py:CharGPT") == f"{user_folder / 'sub' / 'othertask.py'}:CharGPT"
    assert portable_task_spec("ravq.tasks.charlm") == "ravq.tasks.charlm"


def test_task_not_found_says_where_ravq_looked(user_folder: Path) -> None:
    where = rf"no nothere\.py in the current folder {user_folder}.*--task path/to"
    with pytest.raises(ConfigError, match=where):
        resolve_task_module("nothere")
    with pytest.raises(ConfigError, match=r"task file .*missing\.py not found"):
        resolve_task_module("sub/missing.py")


def test_a_wrong_attribute_names_the_tasks_the_file_offers(user_folder: Path) -> None:
    """``file.py:function`` (a task function, not a task) and ``file.py:typo`` say what to name instead; the
    check's header does not claim a layout it never cut."""
    with pytest.raises(ConfigError, match=r"'build_model', a function, not a task.*'mytask.py' itself"):
        resolve_task_module("mytask.py:build_model")
    (user_folder / "two.py").write_text("from ravq.tasks import hf_causal_lm as gpt\nfrom mytask import *\n")
    with pytest.raises(ConfigError, match=r"no attribute 'typo'; the tasks it offers: 'two.py' itself .*two.py:gpt"):
        resolve_task_module("two.py:typo")
    report = check("mytask.py:build_model", stages=3)
    assert report.format().splitlines()[0] == (
        "ravq check: task mytask.py:build_model, 3 stage(s) asked for, not cut (see below), micro-batch 4")
    assert "fix: name a task after ':'" in findings(report, "error")


# ---------------------------------------------------------------- the check passes
def test_check_passes_on_charlm_with_memory_and_no_difference() -> None:
    report = check("ravq.tasks.charlm")
    assert not report.failed, report.format()
    assert report.cuts == ["blocks.3"] and len(report.memory) == 2
    assert report.largest_difference is not None and report.largest_difference < 1e-5
    first, last = report.memory[0], report.memory[-1]
    assert first.weights > 0 and first.optimizer == 3 * first.grads  # Adam: two moments and a step's temporary
    assert first.activations > last.activations > 0  # two micro-batches in flight at stage 0, one at the end
    assert last.stash == 0 and first.stash > 0


@pytest.mark.parametrize("spec", ["tests.check_zoo:tiny", "tests.check_zoo:resumable"])
def test_check_passes_on_working_tasks(spec: str) -> None:
    report = check(spec)
    assert not report.failed and not findings(report, "warning"), report.format()


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize("spec", ["ravq.tasks.hf_causal_lm:gpt2", "tests.zoo_hf:llama", "tests.zoo_hf:t5",
                                  "tests.zoo_hf:bert"])
def test_check_passes_on_hf_models(spec: str) -> None:
    """GPT-2 tied, with evaluation, on 2 stages included (issue #41's defect 1 until 67585a7)."""
    report = check(spec)
    assert not report.failed, report.format()
    assert report.largest_difference is not None and report.largest_difference < 1e-4
    if "gpt2" in spec:
        assert "transformer.wte.weight (= lm_head.weight) is one tensor" in findings(report, "info")


# ---------------------------------------------------------------- the zoo: cause and fix named
ZOO = [
    ("lacks_loss", "error", ["lacks loss_fn"], "define them"),
    ("wrong_signature", "error", ["train_batches(micro_batch) cannot be called"],
     "train_batches(micro_batch, shard"),
    ("wrong_shape", "error", ["train_batches's input 0 is (4, 9) float32", "(4, 8) float32"],
     "make example_inputs(micro_batch) return what train_batches yields"),
    ("eval_not_pairs", "error", ["eval_batches yields a Tensor"], "yield (inputs, targets)"),
    ("loss_not_scalar", "error", ["loss_fn returns a tensor of shape (4,)"], "one floating-point scalar"),
    ("wrong_start", "error", ["start=2)'s first batch is not the batch at position 2"], "make start=k yield"),
    ("untraceable", "error", ["torch's tracer cannot capture", "check_zoo.py", "x.sum() > 0"],
     "no data-dependent Python control flow"),
    ("cache_output", "error", ["output['past_key_values'] is a DynamicCache"], "use_cache=False"),
    ("python_state", "error", ["split stages differ from the unsplit model by"], "frozen by the tracer"),
    ("eval_only", "error", ["stage 1's eval graph cannot be built as a node builds it",
                            "eval graph has calibrate.weight, which the training stage lacks"],
     "eval_every: 0"),
    ("unused", "warning", ["spare.weight", "never"], "freeze them"),
    ("no_reset", "warning", ["nothing initialises scale.gain"], "reset_parameters()"),
]


@pytest.mark.parametrize(("name", "level", "causes", "fix"), ZOO, ids=[z[0] for z in ZOO])
def test_check_names_cause_and_fix(name: str, level: str, causes: list[str], fix: str) -> None:
    report = check(f"tests.check_zoo:{name}")
    text = findings(report, level)
    for cause in causes:
        assert cause in text, report.format()
    assert "fix: " in text and fix in text, report.format()
    assert report.failed == (level == "error")


def test_untraceable_model_is_named_without_torchs_graph_dump(capsys: pytest.CaptureFixture[str]) -> None:
    """torch.export prints a failed trace's partial graph (dozens of lines per attempt) to stderr before
    raising; the check's finding already names the cause and the user's line."""
    report = check("tests.check_zoo:untraceable")
    assert "x.sum() > 0" in findings(report, "error")
    assert "def forward(" not in capsys.readouterr().err


def test_data_that_raises_at_the_call_is_named_once_per_function() -> None:
    """train_batches raising at the call (the start= check calls it three times) and eval_batches: one error
    each, not three copies and a 'yields nothing' with the wrong fix."""
    errors = findings(check("tests.check_zoo:no_data"), "error").splitlines()
    assert [line for line in errors if line.startswith("error:")] == [
        "error: [interface] train_batches(4, 0, 1, 0) raised ValueError: data: /nowhere holds no .txt",
        "error: [interface] eval_batches(4, 0) raised ValueError: data: /nowhere holds no .txt",
    ]


def test_check_tells_what_eval_mode_changes() -> None:
    report = check("tests.check_zoo:batch_norm")
    assert not report.failed, report.format()
    info = findings(report, "info")
    assert "dropout is off in 1 module(s) (drop)" in info and "BatchNorm uses its running statistics" in info
    assert "norm.running_mean" in info
    # the eval graphs' held-out loss against the unsplit model's in eval mode is reported, not only checked
    assert report.eval_difference is not None and report.eval_difference < 1e-5
    assert "split vs unsplit eval graphs: held-out loss difference" in report.format()


def test_memory_line_names_the_unit_its_parts_add_up_in() -> None:
    """Each stage's parts are printed in MiB beside a total in GiB: the line says so, and they add up."""
    report = check("tests.check_zoo:tiny", runtime_bytes=300 << 20)
    for stage in report.memory:
        line = stage.format()
        total_gib, parts = line.split(" GiB", 1)[0].rsplit(" ", 1)[1], line.split("= in MiB: ", 1)[1]
        mib = sum(float(part.rsplit(" ", 1)[1]) for part in parts.split(" + "))
        assert mib / 1024 == pytest.approx(float(total_gib), abs=2e-3), line


def test_stage_that_does_not_fit_its_pc_fails_naming_the_pc() -> None:
    placed = [PlacedMemory("pc-a", 1 << 40, "profile"), PlacedMemory("pc-b", 1 << 10, "topology")]
    report = check("tests.check_zoo:tiny", placed=placed)
    assert report.failed and [m.node for m in report.memory] == ["pc-a", "pc-b"]
    assert "stage 1 on pc-b needs" in findings(report, "error") and "more stages" in findings(report, "error")


def test_model_too_large_to_compare_is_checked_on_meta_and_still_names_eval_failures() -> None:
    """No weight made real (``compare_budget_bytes`` 1): the eval graphs are checked on meta alone."""
    ok = check("tests.check_zoo:tiny", compare_budget_bytes=1)
    assert not ok.failed and ok.largest_difference is None and "not compared" in findings(ok, "info")
    broken = check("tests.check_zoo:eval_only", meta_only=True)
    assert "stage 1's eval graph reads calibrate.weight, calibrate.bias, which its training stage lacks" in \
        findings(broken, "error")


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_cli_check_takes_task_options_as_demo_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/tasks.md's text task on the user's own folder, checked without writing a topology."""
    from ravq.cli.main import main

    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    size = ["--task-option", "context=8", "--task-option", "layers=2", "--task-option", "hidden=16",
            "--task-option", "heads=2"]
    args = ["check", "--task", "ravq.tasks.text", "--stages", "2", "--micro-batch", "2", *size]
    assert main([*args, "--task-option", f"data={tmp_path}"]) == 0
    assert "OK: the task should train as planned" in capsys.readouterr().out
    assert main([*args, "--task-option", f"data={tmp_path / 'missing'}"]) == 1
    out = capsys.readouterr().out
    assert "task_options: data: " in out and "missing does not exist" in out
    assert "fix: correct the option it names (--task-option" in out and "importable" not in out


def test_cli_exit_status_and_output(capsys: pytest.CaptureFixture[str]) -> None:
    from ravq.cli.main import main

    assert main(["check", "--task", "tests.check_zoo:tiny", "--stages", "2", "--micro-batch", "4"]) == 0
    assert "OK: the task should train as planned" in capsys.readouterr().out
    assert main(["check", "--task", "tests.check_zoo:wrong_shape", "--micro-batch", "4"]) == 1
    out = capsys.readouterr().out
    assert "FAILED: 1 error(s)" in out and "fix: make example_inputs" in out


def test_cli_checks_a_topology_at_its_planned_cuts_against_each_nodes_memory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from ravq.cli.main import main
    from tests.swarm import local_topology

    topology = local_topology("tests.check_zoo:tiny", [2], {"micro_batch": 4})
    topology["nodes"][1]["memory_bytes"] = 4096  # c0s1's PC, as the topology overrides it
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(topology))
    assert main(["check", "--topology", str(path), "--profiles", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "2 stage(s) cut at ['blocks.2']" in out and "stage 1 on c0s1 needs" in out
    assert "of 0.00 GiB (topology)" in out and "more stages" in out


def test_node_and_demo_refuse_a_broken_task_at_start_with_its_fix() -> None:
    """``check_at_start`` (what ``ravq node`` and ``ravq demo`` run before anything starts)."""
    from ravq.config import parse_topology
    from ravq.preflight import check_at_start
    from tests.swarm import local_topology

    check_at_start(parse_topology(local_topology("tests.check_zoo:tiny", [2], {"micro_batch": 4})))
    broken = parse_topology(local_topology("tests.check_zoo:wrong_shape", [2], {"micro_batch": 4}))
    with pytest.raises(ConfigError, match=r"train_batches's input 0 is \(4, 9\).*fix: make example_inputs"):
        check_at_start(broken)
