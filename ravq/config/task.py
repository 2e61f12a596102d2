"""The task a topology or ``--task`` names, found where a user expects it.

A task spec is one of:

- ``module`` or ``module:attribute``: imported as Python imports it; when no installed module has that
  name, the current folder is searched too (``ravq demo --task mytask`` beside ``mytask.py``), as uvicorn,
  gunicorn and celery do;
- ``path/to/mytask.py`` or ``path/to/mytask.py:attribute``: that file, relative to the current folder or
  absolute; its folder is put on ``sys.path`` so that it can import its neighbours.

Processes started from another folder (a demo's nodes, a systemd unit) find the same task when they are
given ``portable_task_spec(spec)``: a file found in the current folder as its absolute path.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ravq.config.base import ConfigError

TASK_FUNCTIONS = ("build_model", "example_inputs", "loss_fn", "train_batches", "make_optimizer")


def _parts(spec: str) -> tuple[str, str]:
    """``spec`` as (module name or file path, attribute or "")."""
    target, colon, attr = spec.partition(":")
    if not target or (colon and not attr):
        raise ConfigError(f"{spec!r} is not an absolute module name, module:attribute, path/to/file.py "
                          "or path/to/file.py:attribute")
    return target, attr


def _is_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _cwd_file(module_name: str, folder: Path) -> Path | None:
    """``folder``'s file or package for ``module_name`` (``a.b``: ``a/b.py`` or ``a/b/__init__.py``)."""
    base = folder.joinpath(*module_name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def portable_task_spec(spec: str) -> str:
    """``spec`` as a process started in another folder finds it: a file path, or a module only the current
    folder holds, as the absolute path of its file; an importable module's name as it is."""
    target, attr = _parts(spec)
    suffix = f":{attr}" if attr else ""
    if _is_path(target):
        return f"{Path(target).resolve()}{suffix}"
    here = _cwd_file(target, Path.cwd())
    if here is None or "." in target:  # a dotted module in the folder needs its package: kept as named
        return spec
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        found = None
    if found is not None and found.origin and Path(found.origin).resolve() != here.resolve():
        return spec  # an installed module of that name is what Python imports here, and so will the nodes
    return f"{here.resolve()}{suffix}"


def _load_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise ConfigError(f"task file {path} not found (from {spec!r}; looked in {Path.cwd()} for a relative "
                          "path); give the file's path from the current folder, or an absolute one")
    folder = str(path.parent.resolve())
    if folder not in sys.path:
        sys.path.insert(0, folder)  # the task may import modules beside it
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path.resolve()):
        return loaded
    if loaded is not None:
        name = f"ravq_task_{abs(hash(str(path.resolve())))}"  # a module of that name is something else
    module_spec = importlib.util.spec_from_file_location(name, path.resolve())
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[name]
        if isinstance(err, Exception):
            raise ConfigError(f"task file {path} failed to import: {type(err).__name__}: {err}") from None
        raise
    return module


def _import_module(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not (module_name == err.name or module_name.startswith(err.name + ".")):
            raise ConfigError(f"task module {module_name!r} failed to import: {err}") from None
        cwd = Path.cwd()
        if _cwd_file(module_name, cwd) is not None and str(cwd) not in sys.path:
            sys.path.insert(0, str(cwd))  # the folder the user stands in, as `python -m` would
            return _import_module(module_name)
        looked = [p or "(current folder)" for p in sys.path[:6]] + (["..."] if len(sys.path) > 6 else [])
        raise ConfigError(
            f"cannot import task module {module_name!r}: no module named {err.name!r} on sys.path "
            f"({', '.join(looked)}) and no {module_name.replace('.', '/')}.py in the current folder {cwd}; "
            "run from the folder holding it, or give its path: --task path/to/mytask.py"
        ) from None
    except ImportError as err:
        raise ConfigError(f"cannot import task module {module_name!r}: {err}") from None
    except Exception as err:  # noqa: BLE001 - user code: any failure at import is the user's to fix
        raise ConfigError(f"task module {module_name!r} failed to import: "
                          f"{type(err).__name__}: {err}") from None


def resolve_task_module(spec: str, options: Mapping[str, Any] | None = None) -> Any:
    """Import the task ``spec`` names (module docstring), configured with a topology's ``task_options`` when
    there are any, and check it offers the task interface."""
    target, attr = _parts(spec)
    if _is_path(target):
        obj: Any = _load_file(Path(target), spec)
    elif target.startswith("."):
        raise ConfigError(f"{spec!r} is not an absolute module name (a relative one); give an absolute one "
                          "or the task file's path")
    else:
        obj = _import_module(target)
    module = obj
    if attr:
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            offered = _offered(module, target)
            raise ConfigError(f"task {target!r} has no attribute {attr!r}{offered}") from None
    if options:
        obj = _configured(obj, spec, options)
    missing = _missing(obj)
    if (missing and attr in TASK_FUNCTIONS) or (callable(obj) and len(missing) == len(TASK_FUNCTIONS)):
        raise ConfigError(f"task {spec!r} names {attr!r}, a {type(obj).__name__}, not a task: after ':' "
                          "name an object (a module, class or instance) that defines "
                          f"{', '.join(TASK_FUNCTIONS)}"
                          f"{_offered(module, target)} (docs/tasks.md)")
    if missing:
        raise ConfigError(f"task {spec!r} lacks {', '.join(missing)} (the task interface: docs/tasks.md)")
    return obj


def _missing(obj: Any) -> list[str]:
    return [f for f in TASK_FUNCTIONS if not callable(getattr(obj, f, None))]


def _offered(module: Any, target: str) -> str:
    """What a user may name instead: the module itself when it is a task, and the tasks it holds."""
    held = sorted(n for n, v in vars(module).items()
                  if not n.startswith("_") and v is not module and not _missing(v))
    itself = [f"{target!r} itself (no ':')"] if not _missing(module) else []
    options = itself + [f"{target}:{n}" for n in held]
    return f"; the tasks it offers: {', '.join(options)}" if options else ""


def _configured(task: Any, spec: str, options: Mapping[str, Any]) -> Any:
    """The task its ``configure(**options)`` returns."""
    configure = getattr(task, "configure", None)
    if not callable(configure):
        raise ConfigError(f"task_options: task {spec!r} takes no options (it has no configure(**options); "
                          "docs/tasks.md)")
    try:
        return configure(**options)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"task_options: {err}") from None
