"""Topology validation: every mistake a user can make is one ConfigError line naming field and problem."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from ravq.config import ConfigError, Topology, load_plan, load_topology, parse_topology

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
EXAMPLES = sorted((REPO / "deploy" / "topologies").glob("*.yaml"))
TASK = "tasks_for_tests"  # tests/tasks_for_tests.py, importable once tests/ is on sys.path
BUILTIN_TASK = "ravq.tasks.charlm"
KEY = zmq.curve_keypair()[0].decode()


@pytest.fixture(autouse=True)
def _test_task_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))


def valid() -> dict[str, Any]:
    """A fresh, valid topology: two clusters' worth of nodes on one host, no cluster set."""
    return {
        "task": TASK,
        "training": {"micro_batch": 4, "steps": 10},
        "broker": {"host": "127.0.0.1", "pub_port": 5550, "router_port": 5551},
        "nodes": [
            {"name": "n0", "pipeline_port": 5600, "ring_port": 5601},
            {"name": "n1", "pipeline_port": 5610, "ring_port": 5611},
            {"name": "n2", "pipeline_port": 5620, "ring_port": 5621, "metrics_port": 9102},
        ],
    }


DELETE = object()


def edit(*changes: tuple[str, Any]) -> Callable[[dict[str, Any]], None]:
    """changes: (dotted path, value); a path part that is a number indexes a list; DELETE removes."""

    def apply(data: dict[str, Any]) -> None:
        for path, value in changes:
            *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
            target: Any = data
            for part in parents:
                target = target.setdefault(part, {}) if isinstance(part, str) else target[part]
            if value is DELETE:
                del target[last]
            else:
                target[last] = value

    return apply


def curve_keys(data: dict[str, Any]) -> None:
    data["security"] = {"curve": True}
    data["broker"]["public_key"] = KEY
    for node in data["nodes"]:
        node["public_key"] = KEY


def then(*steps: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def apply(data: dict[str, Any]) -> None:
        for step in steps:
            step(data)

    return apply


def set_all_nodes(field: str, values: list[Any]) -> Callable[[dict[str, Any]], None]:
    def apply(data: dict[str, Any]) -> None:
        for node, value in zip(data["nodes"], values, strict=True):
            node[field] = value

    return apply


# (id, change to valid(), the field the message must start with, words the message must contain)
MALFORMED: list[tuple[str, Callable[[dict[str, Any]], None], str, list[str]]] = [
    # missing fields
    ("missing-task", edit(("task", DELETE)), "task", ["required field is missing"]),
    ("missing-broker", edit(("broker", DELETE)), "broker", ["required field is missing"]),
    ("missing-nodes", edit(("nodes", DELETE)), "nodes", ["required field is missing"]),
    ("missing-pub-port", edit(("broker.pub_port", DELETE)), "broker.pub_port", ["missing"]),
    ("missing-pipeline-port", edit(("nodes.1.pipeline_port", DELETE)), "nodes[1].pipeline_port", ["missing"]),
    ("missing-node-name", edit(("nodes.2.name", DELETE)), "nodes[2].name", ["missing"]),
    # wrong types: nothing is coerced
    ("port-as-string", edit(("nodes.1.pipeline_port", "5612")), "nodes[1].pipeline_port",
     ["valid integer", "'5612'"]),
    ("port-as-bool", edit(("nodes.0.ring_port", True)), "nodes[0].ring_port", ["valid integer", "True"]),
    ("port-as-float", edit(("broker.router_port", 5551.5)), "broker.router_port", ["valid integer"]),
    ("steps-as-word", edit(("training.steps", "many")), "training.steps", ["valid integer", "'many'"]),
    ("micro-batch-as-bool", edit(("training.micro_batch", True)), "training.micro_batch", ["valid integer"]),
    ("curve-as-string", edit(("security.curve", "yes")), "security.curve", ["valid boolean"]),
    ("timeout-with-unit", edit(("timeouts.drain_s", "20s")), "timeouts.drain_s", ["valid number", "'20s'"]),
    ("task-as-number", edit(("task", 7)), "task", ["valid string"]),
    ("nodes-as-mapping", edit(("nodes", {"n0": {"pipeline_port": 1}})), "nodes", ["valid list"]),
    ("node-as-string", edit(("nodes.0", "n0")), "nodes[0]", ["valid dictionary"]),
    ("training-as-list", edit(("training", [1, 2])), "training", ["valid dictionary"]),
    ("node-name-as-number", edit(("nodes.0.name", 17)), "nodes[0].name", ["valid string"]),
    # out-of-range values
    ("port-zero", edit(("broker.pub_port", 0)), "broker.pub_port", ["1..65535", "got 0"]),
    ("port-too-high", edit(("nodes.1.pipeline_port", 70000)), "nodes[1].pipeline_port",
     ["1..65535", "70000"]),
    ("port-negative", edit(("nodes.2.metrics_port", -1)), "nodes[2].metrics_port", ["1..65535", "-1"]),
    ("broker-metrics-port-too-high", edit(("broker.metrics_port", 65536)), "broker.metrics_port",
     ["1..65535"]),
    ("negative-steps", edit(("training.steps", -5)), "training.steps", ["greater than or equal to 1", "-5"]),
    ("zero-micro-batch", edit(("training.micro_batch", 0)), "training.micro_batch",
     ["greater than or equal to 1"]),
    ("negative-timeout", edit(("timeouts.peer_s", -1.0)), "timeouts.peer_s", ["greater than 0"]),
    ("too-few-frames", edit(("limits.max_frames", 1)), "limits.max_frames", ["greater than or equal to 2"]),
    ("negative-cluster", set_all_nodes("cluster", [0, 0, -1]), "nodes[2].cluster",
     ["greater than or equal to 0"]),
    ("empty-node-list", edit(("nodes", [])), "nodes", ["at least 1 item"]),
    # names, hosts, devices
    ("duplicate-node-name", edit(("nodes.2.name", "n0")), "nodes[2].name", ["duplicate node name", "'n0'"]),
    ("node-name-with-space", edit(("nodes.0.name", "pc alpha")), "nodes[0].name",
     ["letters, digits", "'pc alpha'"]),
    ("node-name-empty", edit(("nodes.1.name", "")), "nodes[1].name", ["1-64"]),
    ("empty-host", edit(("nodes.1.host", "")), "nodes[1].host", ["at least 1 character"]),
    ("device-gpu", edit(("nodes.0.device", "gpu")), "nodes[0].device", ["cpu, cuda, cuda:N or mps", "'gpu'"]),
    ("device-cuda-letter", edit(("nodes.1.device", "cuda:x")), "nodes[1].device", ["'cuda:x'"]),
    # ports that collide on one host
    ("duplicate-port-between-nodes", edit(("nodes.1.ring_port", 5600)), "nodes[1].ring_port",
     ["port 5600 on 127.0.0.1", "already used by nodes[0].pipeline_port"]),
    ("duplicate-port-within-node", edit(("nodes.2.metrics_port", 5620)), "nodes[2].metrics_port",
     ["already used by nodes[2].pipeline_port"]),
    ("node-port-is-broker-port", edit(("nodes.0.pipeline_port", 5550)), "nodes[0].pipeline_port",
     ["already used by broker.pub_port"]),
    ("broker-ports-equal", edit(("broker.router_port", 5550)), "broker.router_port",
     ["already used by broker.pub_port"]),
    # unknown fields (typos) at every level
    ("unknown-top-level", edit(("trainig", {"steps": 3})), "trainig", ["unknown field", "'training'"]),
    ("unknown-training", edit(("training.micro_bach", 8)), "training.micro_bach",
     ["unknown field", "did you mean 'micro_batch'"]),
    ("unknown-timeouts", edit(("timeouts.drain", 5)), "timeouts.drain", ["unknown field", "'drain_s'"]),
    ("unknown-limits", edit(("limits.max_msg_bytes", 4096)), "limits.max_msg_bytes", ["unknown field"]),
    ("unknown-security", edit(("security.curv", True)), "security.curv", ["unknown field", "'curve'"]),
    ("unknown-broker", edit(("broker.pubport", 1)), "broker.pubport", ["unknown field", "'pub_port'"]),
    ("unknown-node", edit(("nodes.1.gpu", True)), "nodes[1].gpu", ["unknown field"]),
    ("misspelt-required-node-field",
     edit(("nodes.1.pipline_port", 5610), ("nodes.1.pipeline_port", DELETE)),
     "nodes[1].pipline_port", ["unknown field", "did you mean 'pipeline_port'"]),
    # the task
    ("unknown-task-module", edit(("task", "no_such_task_module")), "task",
     ["cannot import task module 'no_such_task_module'"]),
    ("task-lacks-functions", edit(("task", f"{TASK}:incomplete")), "task",
     ["lacks example_inputs, train_batches, make_optimizer"]),
    ("task-unknown-attribute", edit(("task", f"{TASK}:nothing_here")), "task",
     ["no attribute 'nothing_here'"]),
    ("task-empty", edit(("task", "")), "task", ["not an absolute module name"]),
    ("task-relative", edit(("task", ".tasks")), "task", ["not an absolute module name"]),
    # CURVE
    ("bad-node-key", edit(("nodes.1.public_key", "not-a-key")), "nodes[1].public_key",
     ["40-character Z85", "got 9 characters"]),
    ("bad-broker-key", edit(("broker.public_key", "x" * 39 + "~")), "broker.public_key",
     ["40-character Z85", "outside the Z85 alphabet"]),
    ("curve-without-node-key", then(curve_keys, edit(("nodes.2.public_key", DELETE))), "nodes[2].public_key",
     ["required when security.curve is true"]),
    ("curve-without-broker-key", then(curve_keys, edit(("broker.public_key", DELETE))), "broker.public_key",
     ["required when security.curve is true"]),
    # clusters and stages
    ("cluster-on-some-nodes", set_all_nodes("cluster", [0, 1, None]), "nodes[2].cluster",
     ["nodes[0] sets one", "every node or on none"]),
    ("duplicate-stage", then(set_all_nodes("cluster", [0, 0, 1]), set_all_nodes("stage", [0, 0, 0])),
     "nodes[1].stage", ["stage 0 of cluster 0", "already taken by nodes[0]"]),
]


def assert_one_line(err: ConfigError, starts: str, words: list[str]) -> None:
    text = str(err)
    assert "\n" not in text and "\r" not in text, text
    assert text.startswith(starts), f"{text!r} should start with {starts!r}"
    for word in words:
        assert word in text, f"{text!r} should contain {word!r}"


def test_the_base_topology_is_valid() -> None:
    topo = parse_topology(valid())
    assert [n.name for n in topo.nodes] == ["n0", "n1", "n2"]
    assert topo.training.steps == 10 and topo.nodes[2].metrics_port == 9102


@pytest.mark.parametrize(("change", "field", "words"), [case[1:] for case in MALFORMED],
                         ids=[case[0] for case in MALFORMED])
def test_malformed_topology_is_one_line_naming_the_field(
    change: Callable[[dict[str, Any]], None], field: str, words: list[str]
) -> None:
    data = valid()
    change(data)
    with pytest.raises(ConfigError) as info:
        parse_topology(data)
    assert_one_line(info.value, f"topology: {field}: ", words)


def test_malformed_table_is_big_and_distinct() -> None:
    assert len(MALFORMED) >= 25
    assert len({case[0] for case in MALFORMED}) == len(MALFORMED)


@pytest.mark.parametrize(("data", "words"), [
    ([{"task": TASK}], ["expected a mapping", "got list"]),
    ("task: x", ["expected a mapping", "got str"]),
    (None, ["empty document"]),
], ids=["list", "string", "none"])
def test_top_level_must_be_a_mapping(data: Any, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_topology(data, "my.yaml")
    assert_one_line(info.value, "my.yaml: ", words)


def test_config_error_is_a_value_error_and_always_one_line() -> None:
    err = ConfigError("a\n  b\r\nc")
    assert isinstance(err, ValueError) and str(err) == "a b c"


def test_several_problems_are_counted() -> None:
    data = valid()
    data["nodes"][0]["pipeline_port"] = "x"
    data["nodes"][1]["ring_port"] = "y"
    with pytest.raises(ConfigError) as info:
        parse_topology(data)
    assert_one_line(info.value, "topology: nodes[0].pipeline_port: ", ["and 1 more problem"])


def test_long_bad_values_are_shortened() -> None:
    data = valid()
    data["nodes"][0]["pipeline_port"] = "9" * 500
    with pytest.raises(ConfigError) as info:
        parse_topology(data)
    assert_one_line(info.value, "topology: nodes[0].pipeline_port: ", ["..."])
    assert len(str(info.value)) < 200


def test_same_ports_on_different_hosts_are_fine() -> None:
    data = valid()
    for i, node in enumerate(data["nodes"]):
        node.update(host=f"10.0.0.{i + 1}", pipeline_port=5600, ring_port=5601)
    assert {n.pipeline_port for n in parse_topology(data).nodes} == {5600}


def test_curve_with_keys_everywhere_is_valid() -> None:
    data = valid()
    curve_keys(data)
    topo = parse_topology(data)
    assert topo.security.curve and topo.broker.public_key == KEY


def test_clusters_and_stages_on_every_node_are_valid() -> None:
    data = valid()
    set_all_nodes("cluster", [0, 0, 1])(data)
    set_all_nodes("stage", [0, 1, 0])(data)
    assert [(n.cluster, n.stage) for n in parse_topology(data).nodes] == [(0, 0), (0, 1), (1, 0)]


def test_ints_are_accepted_for_float_fields() -> None:
    data = valid()
    data["timeouts"] = {"drain_s": 20}
    assert parse_topology(data).timeouts.drain_s == 20.0


def test_unknown_node_name() -> None:
    with pytest.raises(ConfigError) as info:
        parse_topology(valid()).node("n9")
    assert_one_line(info.value, "--name: ", ["no node named 'n9'", "n0, n1, n2"])


# --- files ------------------------------------------------------------------------------------------

VALID_YAML = f"""\
task: {TASK}
broker: {{pub_port: 5550, router_port: 5551}}
nodes:
  - {{name: n0, pipeline_port: 5600, ring_port: 5601}}
"""

# (id, file bytes, words the message must contain after "PATH: ")
BAD_FILES: list[tuple[str, bytes, list[str]]] = [
    ("invalid-yaml", b"task: x\nbroker: [5550,\n", ["not valid YAML at line 3", "expected the node content"]),
    ("tab-indent", b"task: x\nbroker:\n\tpub_port: 1\n", ["not valid YAML at line 3", "'\\t'"]),
    ("two-documents", b"task: x\n---\ntask: y\n", ["not valid YAML at line 2", "single document"]),
    ("duplicate-key", VALID_YAML.replace("nodes:", "task: other\nnodes:").encode(),
     ["line 3", "key 'task' appears twice"]),
    ("python-tag", b"task: !!python/object/apply:os.system ['true']\n",
     ["could not determine a constructor"]),
    ("non-utf8", VALID_YAML.encode() + b"# caf\xe9\n", ["not UTF-8 text", "byte 0xe9 at line 5"]),
    ("empty", b"", ["empty document"]),
    ("only-comments", b"# nothing here\n", ["empty document"]),
    ("top-level-list", b"- task: x\n", ["expected a mapping", "got list"]),
    ("top-level-scalar", b"42\n", ["expected a mapping", "got int"]),
    ("bad-field-in-file", VALID_YAML.replace("5601", "99999").encode(), ["nodes[0].ring_port: ", "1..65535"]),
]


@pytest.mark.parametrize(("content", "words"), [case[1:] for case in BAD_FILES],
                         ids=[case[0] for case in BAD_FILES])
def test_bad_file_is_one_line_naming_the_file(tmp_path: Path, content: bytes, words: list[str]) -> None:
    path = tmp_path / "topology.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_topology(path)
    assert_one_line(info.value, f"{path}: ", words)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_topology(tmp_path / "nope.yaml")
    assert_one_line(info.value, f"{tmp_path / 'nope.yaml'}: ", ["file not found"])


def test_unreadable_file(tmp_path: Path) -> None:
    # Tests may run as root, where chmod 000 still reads; a directory is unreadable as a file for all.
    with pytest.raises(ConfigError) as info:
        load_topology(tmp_path)
    assert_one_line(info.value, f"{tmp_path}: ", ["is a directory"])


def test_valid_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "topology.yaml"
    path.write_text(VALID_YAML)
    assert load_topology(path).nodes[0].name == "n0"
    assert load_topology(str(path)).broker.pub_port == 5550


def test_byte_order_mark_and_crlf_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "windows.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + VALID_YAML.replace("\n", "\r\n").encode())
    assert load_topology(path).nodes[0].ring_port == 5601


def test_yaml_merge_keys_may_be_overridden(tmp_path: Path) -> None:
    # `<<: *defaults` followed by an explicit key is not a duplicate key.
    path = tmp_path / "merge.yaml"
    path.write_text(f"""\
task: {TASK}
broker: {{pub_port: 5550, router_port: 5551}}
nodes:
  - &first {{name: n0, device: cpu, pipeline_port: 5600, ring_port: 5601}}
  - {{<<: *first, name: n1, pipeline_port: 5610, ring_port: 5611}}
""")
    assert [(n.name, n.device, n.pipeline_port) for n in load_topology(path).nodes] == [
        ("n0", "cpu", 5600), ("n1", "cpu", 5610)]


# --- plans share the loader -------------------------------------------------------------------------

@pytest.mark.parametrize(("content", "words"), [
    (b"clusters: [\n", ["not valid YAML at line 2"]),
    (b"\xff\n", ["not UTF-8 text"]),
    (b"clusters:\n  - {nodes: [a, b], cuts: []}\n", ["clusters[0]: ", "2 stages need 1 cuts"]),
    (b"clusters:\n  - {nodes: [a], cutz: []}\n", ["clusters[0].cutz: unknown field", "'cuts'"]),
], ids=["invalid-yaml", "non-utf8", "cuts-mismatch", "typo"])
def test_bad_plan_is_one_line(tmp_path: Path, content: bytes, words: list[str]) -> None:
    path = tmp_path / "plan.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_plan(path)
    assert_one_line(info.value, f"{path}: ", words)


# --- the example topologies in deploy/ --------------------------------------------------------------

def builtin_task_exists() -> bool:
    try:
        return importlib.util.find_spec(BUILTIN_TASK) is not None
    except ModuleNotFoundError:
        return False


def test_there_are_example_topologies() -> None:
    assert {p.name for p in EXAMPLES} >= {"local-1x3.yaml", "local-2x2.yaml", "lan-example.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_topology_is_valid(path: Path, tmp_path: Path) -> None:
    """The schema part; the task is swapped for the test task while ravq.tasks.charlm is unwritten."""
    text = path.read_text()
    assert f"task: {BUILTIN_TASK}\n" in text
    if not builtin_task_exists():
        path = tmp_path / path.name
        path.write_text(text.replace(f"task: {BUILTIN_TASK}\n", f"task: {TASK}\n"))
    topo: Topology = load_topology(path)
    assert len(topo.nodes) >= 3


@pytest.mark.skipif(not builtin_task_exists(), reason=f"{BUILTIN_TASK} is not written yet")
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_topology_loads_with_the_builtin_task(path: Path) -> None:
    assert load_topology(path).task == BUILTIN_TASK


# --- the command line -------------------------------------------------------------------------------

def cli_exists() -> bool:
    return importlib.util.find_spec("ravq.cli.main") is not None


@pytest.mark.skipif(not cli_exists(), reason="ravq/cli/main.py is not written yet")
@pytest.mark.parametrize(("argv", "problem"), [
    (["node", "--name", "n0"], "bad-port"),
    (["broker"], "missing-file"),
], ids=["node-bad-port", "broker-missing-file"])
def test_cli_exits_2_with_one_line(tmp_path: Path, argv: list[str], problem: str) -> None:
    path = tmp_path / "bad.yaml"
    if problem == "bad-port":
        path.write_text(VALID_YAML.replace("5601", "99999"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
    proc = subprocess.run([sys.executable, "-m", "ravq", argv[0], "--topology", str(path), *argv[1:]],
                          cwd=REPO, env=env, check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(path) in lines[0]
    assert ("nodes[0].ring_port" if problem == "bad-port" else "file not found") in lines[0]


def test_original_valid_is_not_shared() -> None:
    # The table edits copies: valid() must hand out a fresh dict each time.
    first = valid()
    first["nodes"].clear()
    assert valid()["nodes"] and copy.deepcopy(valid()) == valid()


def test_relays_and_reachable_in_the_topology() -> None:
    """Relays are named apart from nodes and the broker, their ports are claimed like any other, and
    under CURVE each needs its key (issue #24)."""
    import pytest as _pytest

    from ravq.config import ConfigError, parse_topology

    base = {"task": "tests.tasks_for_tests", "broker": {"pub_port": 5500, "router_port": 5501, "relay_port": 5502},
            "nodes": [{"name": "a", "pipeline_port": 5510, "ring_port": 5511, "reachable": False}]}
    topo = parse_topology({**base, "relays": [{"name": "r", "host": "10.0.0.9", "port": 6000}]}, resolve_task=False)
    assert topo.nodes[0].reachable is False and topo.relays[0].queue_bytes == 64 << 20
    for relays, match in (([{"name": "a", "host": "h", "port": 6000}], "relays.0.name|already the name"),
                          ([{"name": "broker", "host": "h", "port": 6000}], "already the name"),
                          ([{"name": "r", "host": "127.0.0.1", "port": 5510}], "port 5510")):
        with _pytest.raises(ConfigError, match=match):
            parse_topology({**base, "relays": relays}, resolve_task=False)
    with _pytest.raises(ConfigError, match="broker.relay_port"):
        parse_topology({**base, "broker": {**base["broker"], "relay_port": 5501}}, resolve_task=False)
