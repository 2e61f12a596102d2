"""The package keeps the shape docs/design.md draws: small modules, layers that import one way.

The layers and the absence of import circles are import-linter contracts in pyproject.toml, which
`make test` checks with `lint-imports` before pytest; this test runs the same contracts, so a plain
`pytest` run catches a broken layer too, and adds what import-linter cannot say: module and line
length, no ``Any`` standing for a ravq class, no fault injection in library code.  ruff (private
members, line length) runs here as in `make test`.  Each check is shown to catch an offender.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 400
MAX_LINE_CHARS = 110  # pyproject.toml's [tool.ruff] line-length


def _modules(root: Path = ROOT) -> list[Path]:
    return sorted(p for top in ("ravq", "brokers") for p in (root / top).rglob("*.py"))


def test_no_module_is_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by responsibility): {long}"


def test_the_size_check_sees_every_subsystem() -> None:
    folders = {p.parent.relative_to(ROOT).as_posix() for p in _modules()}
    for folder in ("ravq/codec", "ravq/net", "ravq/cut", "ravq/persist", "ravq/stage", "ravq/average",
                   "ravq/swarm", "ravq/node", "ravq/profile", "ravq/planner", "ravq/simulate", "ravq/cli",
                   "brokers"):
        assert folder in folders


# ------------------------------------------------------------------------------------------ line length
def _long_lines(root: Path) -> list[str]:
    return [f"{p.relative_to(root)}:{i} ({len(line)} characters)" for p in _modules(root)
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > MAX_LINE_CHARS]


def test_no_line_is_over_110_characters() -> None:
    """The 400-line cap is met by design, not by packing lines (wrap, name a step, or split the module)."""
    long = _long_lines(ROOT)
    assert not long, f"{len(long)} lines over {MAX_LINE_CHARS} characters: {long[:40]}"


def test_a_long_line_is_caught(tmp_path: Path) -> None:
    (tmp_path / "ravq").mkdir()
    (tmp_path / "ravq" / "packed.py").write_text(f"x = 1\n{'y' * MAX_LINE_CHARS}\n# {'z' * 109}\n")
    assert _long_lines(tmp_path) == ["ravq/packed.py:3 (111 characters)"]


# --------------------------------------------------------------------------- no Any for a ravq class
# `Name = Any` (or `Name: TypeAlias = Any`) hides a class behind an alias; `worker: Any` types a ravq
# part as anything.  A parameter or attribute is taken to stand for a ravq class when its name is a
# class's name in snake_case (`stage_worker`, `averager`) or the class name's last word (`worker`,
# `curve`), except words that name any value (`result`); `*args: Any` and `**kwargs: Any` never do.
_ALIAS = re.compile(r"^\s*[A-Z]\w*\s*(?::\s*TypeAlias\s*)?=\s*Any\b")
_ANNOTATED = re.compile(r"(?<![*\w])(\w+)\s*:\s*Any\b")
_ANY_VALUE = {"result", "value", "data"}


def _role_names(root: Path) -> set[str]:
    names = set()
    for p in _modules(root):
        for cls in re.findall(r"^class (\w+)", p.read_text(), re.MULTILINE):
            words = [w.lower() for w in re.findall(r"[A-Z][a-z0-9]*|[a-z0-9]+", cls)]
            names |= {"_".join(words), words[-1]}
    return {n for n in names if len(n) >= 3} - _ANY_VALUE


def _any_for_ravq_classes(root: Path) -> list[str]:
    roles, found = _role_names(root), []
    for p in _modules(root):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            typed = [m.group(1) for m in _ANNOTATED.finditer(line) if m.group(1).lstrip("_") in roles]
            if _ALIAS.match(line) or typed:
                found.append(f"{p.relative_to(root)}:{i}: {line.strip()}")
    return found


def test_no_any_stands_for_a_ravq_class() -> None:
    """Use the class (``if TYPE_CHECKING:`` where an import would make a circle) or a Protocol naming what
    the code uses of it."""
    found = _any_for_ravq_classes(ROOT)
    assert not found, "Any standing for a ravq class:\n" + "\n".join(found)


def test_an_any_for_a_ravq_class_is_caught(tmp_path: Path) -> None:
    """The offenders issue #36 removed are caught; a user's task, a value or ``**kwargs`` are not."""
    (tmp_path / "ravq").mkdir()
    (tmp_path / "ravq" / "pipeline.py").write_text(
        "class StageWorker:\n    pass\n\n\nclass Averager:\n    pass\n")
    (tmp_path / "ravq" / "recipe.py").write_text(
        "from typing import Any, TypeAlias\n\n"
        "StageWorker = Any\n"
        "Averager: TypeAlias = Any\n"
        "def deliver_tied(worker: Any, micro_batch: tuple[int, int], source: int) -> str | None: ...\n"
        "def run(task: Any, result: Any, *args: Any, **settings: Any) -> Any: ...\n"
        "class Holder:\n    averager: Any = None\n")
    assert [f.split(": ", 1)[0] for f in _any_for_ravq_classes(tmp_path)] == [
        "ravq/recipe.py:3", "ravq/recipe.py:4", "ravq/recipe.py:5", "ravq/recipe.py:8"]


# ------------------------------------------------------------------------- fault injection only in tests
_FAULT = re.compile(r"RAVQ_FAULT|os\.kill\(\s*os\.getpid\(\)")


def _fault_injection(root: Path) -> list[str]:
    return [f"{p.relative_to(root)}:{i}: {line.strip()}" for p in _modules(root)
            for i, line in enumerate(p.read_text().splitlines(), 1) if _FAULT.search(line)]


def test_no_fault_injection_in_library_code() -> None:
    """Faults are the tests' to inject (subclasses, hooks the tests install): nothing a user runs reads a
    fault variable or kills its own process."""
    found = _fault_injection(ROOT)
    assert not found, "fault injection in ravq/ or brokers/:\n" + "\n".join(found)


def test_fault_injection_is_caught(tmp_path: Path) -> None:
    """The lines issue #36 removed from ravq/average are caught."""
    (tmp_path / "ravq").mkdir()
    (tmp_path / "ravq" / "averager.py").write_text(
        "import os\nimport signal\n\n"
        "if os.environ.get(\"RAVQ_FAULT\") == \"kill_in_catchup\":\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "os.kill(child_pid, signal.SIGTERM)\n")
    found = [f.split(": ", 1)[0] for f in _fault_injection(tmp_path)]
    assert found == ["ravq/averager.py:4", "ravq/averager.py:5"]


def _lint_imports() -> str:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    return exe


def test_import_contracts_hold() -> None:
    proc = subprocess.run([_lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " 0 broken" in proc.stdout.split("Contracts:")[-1]


def test_a_broken_layer_is_caught(tmp_path: Path) -> None:
    """The contracts are not vacuous: a copy of the tree in which ravq.net imports ravq.stage fails."""
    for top in ("ravq", "brokers"):
        shutil.copytree(ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__", "data"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    wire = tmp_path / "ravq" / "net" / "wire.py"
    wire.write_text(wire.read_text()
                    + "\nfrom ravq.persist import checkpoint  # noqa: E402  (a layer broken)\n")
    ring = tmp_path / "ravq" / "average" / "ring.py"
    ring.write_text(ring.read_text() + "\nimport zmq  # noqa: E402\n")
    segments = tmp_path / "ravq" / "average" / "segments.py"  # imported by ring: a circle
    segments.write_text(segments.read_text()
                        + "\n\ndef _late() -> None:\n    from ravq.average import ring  # noqa\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([_lint_imports(), "--no-cache"], cwd=tmp_path, capture_output=True, text=True,
                          check=False, timeout=300, env=env)
    assert proc.returncode != 0
    assert "ravq.net.wire -> ravq.persist.checkpoint" in proc.stdout
    assert "ravq.average is not allowed to import zmq" in proc.stdout
    assert "No cycles are allowed in ravq.average" in proc.stdout


# ------------------------------------------------------------------------------------------------ ruff
def _ruff() -> str:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return exe


def _ruff_check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_ruff(), "check", "--no-cache", "--output-format", "concise", "ravq", "brokers"],
                          cwd=root, capture_output=True, text=True, timeout=300, check=False)


def test_ruff_passes() -> None:
    """As `make test` runs it: ruff's defaults, private members (SLF001) and line length (E501)."""
    proc = _ruff_check(ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_ruff_catches_a_private_member_and_a_long_line(tmp_path: Path) -> None:
    """pyproject.toml's ruff settings are not vacuous: a copy of the tree with an offender of each fails."""
    for top in ("ravq", "brokers"):
        shutil.copytree(ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__", "data"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    wire = tmp_path / "ravq" / "net" / "wire.py"
    lines = len(wire.read_text().splitlines())
    wire.write_text(wire.read_text() + f"\n\ndef _peek(worker: object) -> object:\n"
                    f"    return worker._stash  # {'x' * 100}\n")
    proc = _ruff_check(tmp_path)
    assert proc.returncode != 0
    assert f"ravq/net/wire.py:{lines + 4}:12: SLF001" in proc.stdout, proc.stdout[-4000:]
    assert f"ravq/net/wire.py:{lines + 4}:111: E501" in proc.stdout, proc.stdout[-4000:]
