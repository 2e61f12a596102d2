"""The package keeps the shape DESIGN.md draws: small modules, layers that import one way.

The layers and the absence of import circles are import-linter contracts in pyproject.toml, which
`make test` checks with `lint-imports` before pytest; this test runs the same contracts, so a plain
`pytest` run catches a broken layer too, and adds what import-linter cannot say: module length.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 400


def _modules() -> list[Path]:
    return sorted(p for top in ("ravq", "brokers") for p in (ROOT / top).rglob("*.py"))


def test_no_module_is_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by responsibility): {long}"


def test_the_size_check_sees_every_subsystem() -> None:
    folders = {p.parent.relative_to(ROOT).as_posix() for p in _modules()}
    for folder in ("ravq/codec", "ravq/net", "ravq/cut", "ravq/persist", "ravq/stage", "ravq/average", "ravq/swarm",
                   "ravq/node", "ravq/profile", "ravq/planner", "ravq/simulate", "ravq/cli", "brokers"):
        assert folder in folders


def _lint_imports() -> str:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    return exe


def test_import_contracts_hold() -> None:
    proc = subprocess.run([_lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " 0 broken" in proc.stdout.split("Contracts:")[-1]


def test_a_broken_layer_is_caught(tmp_path: Path) -> None:
    """The contracts are not vacuous: a copy of the tree in which ravq.net imports ravq.stage fails."""
    for top in ("ravq", "brokers"):
        shutil.copytree(ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__", "data"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    wire = tmp_path / "ravq" / "net" / "wire.py"
    wire.write_text(wire.read_text() + "\nfrom ravq.persist import checkpoint  # noqa: E402  (a layer broken)\n")
    ring = tmp_path / "ravq" / "average" / "ring.py"
    ring.write_text(ring.read_text() + "\nimport zmq  # noqa: E402\n")
    segments = tmp_path / "ravq" / "average" / "segments.py"  # imported by ring: a circle
    segments.write_text(segments.read_text() + "\n\ndef _late() -> None:\n    from ravq.average import ring  # noqa\n")
    proc = subprocess.run([_lint_imports(), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, check=False,
                          timeout=300, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0
    assert "ravq.net.wire -> ravq.persist.checkpoint" in proc.stdout
    assert "ravq.average is not allowed to import zmq" in proc.stdout
    assert "No cycles are allowed in ravq.average" in proc.stdout
