"""The task a topology names: an importable module (or module:attribute) offering ``TASK_FUNCTIONS``."""

from __future__ import annotations

import importlib
from typing import Any

from ravq.config.base import ConfigError

TASK_FUNCTIONS = ("build_model", "example_inputs", "loss_fn", "train_batches", "make_optimizer")


def resolve_task_module(spec: str) -> Any:
    """Import ``module`` or ``module:attr`` and check it offers the task interface."""
    module_name, colon, attr = spec.partition(":")
    if not module_name or module_name.startswith(".") or (colon and not attr):
        raise ConfigError(f"{spec!r} is not an absolute module name or module:attribute")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"cannot import task module {module_name!r}: {err}") from None
    except Exception as err:  # noqa: BLE001 - user code: any failure at import is the user's to fix
        raise ConfigError(f"task module {module_name!r} failed to import: "
                          f"{type(err).__name__}: {err}") from None
    if attr:
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise ConfigError(f"task module {module_name!r} has no attribute {attr!r}") from None
    missing = [f for f in TASK_FUNCTIONS if not callable(getattr(obj, f, None))]
    if missing:
        raise ConfigError(f"task {spec!r} lacks {', '.join(missing)}")
    return obj
