"""Checkpoint integrity: a stage's tensors and JSON are one unit; torn pairs, corrupt files and saves
killed at any moment leave a loadable checkpoint (the newest that checks out, else the previous one);
export refuses stages of different runs or a missing stage, and names it."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ravq.persist import checkpoint
from ravq.persist.checkpoint import CheckpointError, load_stage, remove_temp_files, save_stage
from ravq.persist.export import export_cluster

REPO = Path(__file__).resolve().parents[1]


def _stage(seed: int, width: int = 8) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    module = torch.nn.Linear(width, width)
    opt = torch.optim.Adam(module.parameters())
    module(torch.randn(2, width)).sum().backward()
    opt.step()
    return module, opt


def _save(root: Path, version: int, *, stage: int = 0, num_stages: int = 1, run_id: str = "run-a",
          module: torch.nn.Module | None = None) -> Path:
    m, opt = _stage(version)
    if module is not None:
        m = module
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
    return save_stage(root, cluster=0, stage=stage, num_stages=num_stages, node=f"n{stage}", module=m,
                      optimizer=opt, version=version, data_position=version, run_id=run_id,
                      cluster_nodes=[f"n{s}" for s in range(num_stages)])


def test_save_keeps_the_previous_pair_and_loads_the_newest(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    _save(tmp_path, 3)
    d = tmp_path / "cluster0"
    assert sorted(p.name for p in d.iterdir()) == ["stage0.json", "stage0.prev.json", "stage0.prev.safetensors",
                                                   "stage0.safetensors"]
    ckpt = load_stage(tmp_path, 0, 0)
    assert ckpt.meta["version"] == 3 and ckpt.meta["run_id"] == "run-a"
    assert torch.equal(ckpt.model["weight"], _stage(3)[0].weight.detach())
    assert json.loads((d / "stage0.prev.json").read_text())["version"] == 2


@pytest.mark.parametrize("damage", ["torn_pair", "flipped_byte", "truncated", "json_missing", "json_garbage"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path, damage: str,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    d = tmp_path / "cluster0"
    current = d / "stage0.safetensors"
    if damage == "torn_pair":  # the tensors of another save beside this JSON
        other = tmp_path / "other"
        _save(other, 7)
        shutil.copy(other / "cluster0" / "stage0.safetensors", current)
    elif damage == "flipped_byte":
        data = bytearray(current.read_bytes())
        data[-3] ^= 0xFF
        current.write_bytes(bytes(data))
    elif damage == "truncated":
        current.write_bytes(current.read_bytes()[:-100])
    elif damage == "json_missing":  # killed before the JSON's rename
        (d / "stage0.json").unlink()
    else:
        (d / "stage0.json").write_text("{\"format\": 2, \"checkpoint")
    ckpt = load_stage(tmp_path, 0, 0)
    assert ckpt.meta["version"] == 1
    assert torch.equal(ckpt.model["weight"], _stage(1)[0].weight.detach())
    if damage not in ("json_missing", "json_garbage"):
        assert "newest checkpoint unusable" in caplog.text


def test_no_usable_checkpoint_is_a_one_line_error(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    (tmp_path / "cluster0" / "stage0.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no usable checkpoint .*torn pair"):
        load_stage(tmp_path, 0, 0)
    with pytest.raises(FileNotFoundError):
        load_stage(tmp_path, 0, 1)


def test_an_interrupted_rotation_is_finished_by_the_next_save(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    d = tmp_path / "cluster0"
    # killed between moving the JSON and moving the tensors of version 2 to .prev
    os.replace(d / "stage0.json", d / "stage0.prev.json")
    assert load_stage(tmp_path, 0, 0).meta["version"] == 2  # matched by id, whatever the names
    _save(tmp_path, 3)
    assert load_stage(tmp_path, 0, 0).meta["version"] == 3
    (d / "stage0.safetensors").write_bytes(b"x")
    assert load_stage(tmp_path, 0, 0).meta["version"] == 2  # the previous pair survived


_SAVER = textwrap.dedent("""
    import os, sys, torch
    from ravq.persist.checkpoint import save_stage
    root = sys.argv[1]
    for line in sys.stdin:  # "go": a saver of its own, forked from this process (torch imported once)
        if line.strip() == "reap":
            os.wait()
            print("reaped", flush=True)
            continue
        pid = os.fork()
        if pid:
            print("pid", pid, flush=True)
            continue
        torch.manual_seed(0)
        module = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # ~8 MiB + Adam state
        opt = torch.optim.Adam(module.parameters())
        version = 0
        while True:
            version += 1
            with torch.no_grad():
                for p in module.parameters():
                    p.fill_(version)
            save_stage(root, cluster=0, stage=0, num_stages=1, node="n0", module=module, optimizer=opt,
                       version=version, data_position=version, run_id="kill")
            print(version, flush=True)
""")


def _read_until(proc: subprocess.Popen[str], done: object) -> list[str]:
    """The saver's lines up to and including the first for which ``done(line)`` holds."""
    assert proc.stdout is not None
    lines = []
    while True:
        line = proc.stdout.readline()
        assert line, f"saver ended: {lines}"
        lines.append(line.strip())
        if done(line.strip()):  # type: ignore[operator]
            return lines


@pytest.mark.fault
def test_saves_killed_at_random_moments_always_leave_a_good_checkpoint(tmp_path: Path) -> None:
    """Six savers, each killed (SIGKILL) at a random moment within 0.4 s of its first finished save; each is
    forked from one process that imported torch, so the six cost one interpreter start, not six."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    rng = random.Random(13)
    loaded = []
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    try:
        for _ in range(6):
            proc.stdin.write("go\n")
            proc.stdin.flush()
            pid = None
            try:
                lines = _read_until(proc, lambda line: line.startswith("pid "))
                pid = int(lines[-1].split()[1])
                if not any(line.isdigit() for line in lines):
                    _read_until(proc, str.isdigit)  # at least one save finished
                time.sleep(rng.uniform(0.0, 0.4))
            finally:
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    proc.stdin.write("reap\n")
                    proc.stdin.flush()
                    _read_until(proc, lambda line: line == "reaped")
            remove_temp_files(tmp_path, 0, 0)
            assert not list((tmp_path / "cluster0").glob(".*tmp*")), "temporary files left behind"
            ckpt = load_stage(tmp_path, 0, 0, run_id="kill")
            version = ckpt.meta["version"]
            assert all(bool((t == version).all()) for t in ckpt.model.values()), "tensors of another save"
            loaded.append(version)
    finally:
        proc.stdin.close()
        proc.kill()
        proc.wait()
    assert all(v >= 1 for v in loaded)


def test_temp_files_of_a_killed_save_are_removed_for_that_stage_only(tmp_path: Path) -> None:
    d = tmp_path / "cluster0"
    d.mkdir()
    mine = [d / ".stage1.tmp123", d / ".stage1.tmp77"]
    other = d / ".stage2.tmp9"
    for p in [*mine, other]:
        p.mkdir()
        (p / "stage.safetensors").write_bytes(b"partial")
        (p / ".tmpAbCdEf").write_bytes(b"safetensors' own temporary file")
    assert sorted(remove_temp_files(tmp_path, 0, 1)) == sorted(mine)
    assert other.exists() and not any(p.exists() for p in mine)


def _two_stage_run(root: Path, run_id: str, version: int) -> None:
    for s in range(2):
        torch.manual_seed(100 * s + version)
        _save(root, version, stage=s, num_stages=2, run_id=run_id,
              module=torch.nn.Linear(4, 4) if s == 0 else torch.nn.Sequential(torch.nn.Identity(),
                                                                               torch.nn.Linear(4, 2)))


def test_export_merges_one_run_and_refuses_a_stage_of_another(tmp_path: Path) -> None:
    _two_stage_run(tmp_path, "old", 5)
    out = tmp_path / "m.safetensors"
    info = export_cluster(tmp_path, out, 0)
    assert info["run_id"] == "old" and info["stages"] == 2 and info["versions"] == [5, 5]
    assert set(load_file(str(out))) == {"weight", "bias", "1.weight", "1.bias"}
    # a new run in the same directory whose stage 1 never wrote a checkpoint
    time.sleep(0.01)
    torch.manual_seed(0)
    _save(tmp_path, 2, stage=0, num_stages=2, run_id="new", module=torch.nn.Linear(4, 4))
    with pytest.raises(CheckpointError, match=r"run new lacks stage 1 \(node n1\) \[only run\(s\) old\]"):
        export_cluster(tmp_path, out, 0)
    assert export_cluster(tmp_path, out, 0, run_id="old")["versions"] == [5, 5]  # old's stage 0 is .prev


def test_export_names_a_stage_that_was_not_copied_here(tmp_path: Path) -> None:
    _two_stage_run(tmp_path, "r", 3)
    for p in (tmp_path / "cluster0").glob("stage1.*"):
        p.unlink()
    proc = subprocess.run([sys.executable, "-m", "ravq", "export", "--checkpoint-dir", str(tmp_path), "--out",
                           str(tmp_path / "m.safetensors")], capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 2
    assert "lacks stage 1 (node n1)" in proc.stderr and "Copy each missing stage" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "m.safetensors").exists()


def test_checkpoint_module_never_unpickles() -> None:
    text = Path(checkpoint.__file__).read_text()
    assert "torch.load" not in text and "pickle" not in text.replace("never pickle", "")


def test_tensor_files_follow_the_umask_like_their_json(tmp_path: Path) -> None:
    """A copied stage (gathered for export by another user) must be as readable as its JSON."""
    old = os.umask(0o027)
    try:
        _save(tmp_path, 1)
    finally:
        os.umask(old)
    d = tmp_path / "cluster0"
    assert (d / "stage0.safetensors").stat().st_mode & 0o777 == 0o640
    assert (d / "stage0.json").stat().st_mode & 0o777 == 0o640
