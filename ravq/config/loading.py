"""Reading topology and plan files: YAML parsed safely (no duplicate keys), validated into the models,
and every problem reported as one ``ConfigError`` line naming the file and the field.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from ravq.config.base import ConfigError
from ravq.config.plan import Plan
from ravq.config.task import resolve_task_module
from ravq.config.topology import Topology


def _format_error(err: ValidationError, root: type[BaseModel]) -> str:
    errors = err.errors()
    # A misspelt field is also reported missing under its real name: name the misspelling first.
    first = min(errors, key=lambda e: e["type"] != "extra_forbidden")
    loc = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in first["loc"]).replace(".[", "[")
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown field" + _did_you_mean(root, first["loc"])
    elif first["type"] == "missing":
        msg = "required field is missing"
    elif "input" in first and first["type"] not in ("value_error",):
        msg = f"{msg} (got {_short_repr(first['input'])})"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more problem(s))"
    return f"{loc}: {msg}" if loc else msg


def _did_you_mean(root: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    model: type[BaseModel] | None = root
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue  # a list index: the list's item model was taken at the field before it
        field = model.model_fields.get(part)
        candidates = (field.annotation, *get_args(field.annotation)) if field is not None else ()
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1) if model else []
    return f" (did you mean {close[0]!r}?)" if close else " (typo?)"


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_topology(data: Any, source: str = "topology", resolve_task: bool = True) -> Topology:
    """Validate already-parsed YAML/JSON data; raise ConfigError with one line on failure.

    ``resolve_task=False`` skips importing the task (and with it torch): for commands that only talk
    to the broker (``ravq status``)."""
    if data is None:
        raise ConfigError(f"{source}: empty document; expected a mapping with task, broker and nodes")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping (task, broker, nodes, ...) at top level, "
                          f"got {type(data).__name__}")
    try:
        topo = Topology.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}: {_format_error(err, Topology)}") from None
    if not resolve_task:
        return topo
    try:
        resolve_task_module(topo.task, topo.task_options)
    except ConfigError as err:
        raise ConfigError(f"{source}: task: {err}") from None
    return topo


def load_topology(path: str | Path, resolve_task: bool = True) -> Topology:
    """Read and validate a topology YAML file."""
    path = Path(path)
    return parse_topology(_read_yaml(path), str(path), resolve_task)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping; plain YAML silently keeps the last."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str | int | float | bool):
                continue  # unhashable keys are left to SafeLoader's own error
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a file") from None
    except UnicodeDecodeError as err:
        line = err.object[: err.start].count(b"\n") + 1
        byte = err.object[err.start]
        raise ConfigError(f"{path}: not UTF-8 text: byte {byte:#04x} at line {line}") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: builds plain data only
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: {_yaml_problem(err)}") from None


def _yaml_problem(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    if context and problem.startswith("but "):  # "expected a single document ..., but found another"
        problem = f"{context}, {problem}"
    return f"not valid YAML{where}: {problem}"


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    data = _read_yaml(path)
    if isinstance(data, dict) and "plan" in data:
        data = data["plan"]
    try:
        return Plan.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{path}: {_format_error(err, Plan)}") from None
