"""deploy/ and grafana/: dashboards query real metrics, units and configs pass their own tools."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq.utils.z85
from prometheus_client import Counter, Gauge, Histogram

from ravq.config import TimeoutConfig, Topology, parse_topology
from ravq.metrics import HopCounter, HopHistogram, Metrics

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
DEPLOY = REPO / "deploy"
GRAFANA = REPO / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
UNITS = {"broker": DEPLOY / "systemd" / "ravq-broker.service",
         "backup": DEPLOY / "systemd" / "ravq-broker-backup.service",
         "node": DEPLOY / "systemd" / "ravq-node@.service",
         "relay": DEPLOY / "systemd" / "ravq-relay@.service"}
TOPOLOGY_PATH = "/etc/ravq/topology.yaml"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or ""
PROMTOOL = shutil.which("promtool") or ""
NEEDS_SYSTEMD = pytest.mark.skipif(not SYSTEMD_ANALYZE,
                                   reason="systemd-analyze not found (Debian package: systemd)")
NEEDS_PROMTOOL = pytest.mark.skipif(not PROMTOOL,
                                    reason="promtool not found (Debian package: prometheus)")


# --- what ravq/metrics.py declares -------------------------------------------------------------------

def declared_series() -> dict[str, set[str]]:
    """Every series name a scrape of ravq can hold -> its label names (histograms add `le`)."""
    metrics = Metrics()
    labels = {m._name: set(m._labelnames)
              for m in vars(metrics).values() if isinstance(m, Counter | Gauge | Histogram)}
    # The per-hop families are counted in plain Python and published at scrape (ravq.metrics).
    labels |= {next(m.describe()).name: set(m.labelnames)
               for m in vars(metrics).values() if isinstance(m, HopCounter | HopHistogram)}
    series: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        names = labels[family.name]
        if family.type == "counter":
            series[f"{family.name}_total"] = names
        elif family.type == "histogram":
            series.update({f"{family.name}_bucket": names | {"le"},
                           f"{family.name}_sum": names, f"{family.name}_count": names})
        else:
            series[family.name] = names
    return series


PROMETHEUS_SERIES: dict[str, set[str]] = {"up": set()}
"""Series Prometheus makes itself for every target (1: scraped, 0: down)."""


def scrape_labels() -> set[str]:
    """Labels Prometheus adds to every series: its own and those deploy/prometheus.yml sets."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    added = {"instance", "job"}
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            added |= set(static.get("labels", {}))
    return added


# --- a small PromQL reader: enough to find metric and label names --------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{([^}]*)\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENT = re.compile(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on", "ignoring",
             "group_left", "group_right"}


def metric_names(expr: str) -> set[str]:
    expr = _MATCHERS.sub(" ", _STRING.sub('""', expr))
    expr = _GROUPING.sub(" ", _RANGE.sub(" ", expr))
    names = set()
    for match in _IDENT.finditer(expr):
        if expr[match.end():].lstrip().startswith("("):
            continue  # a function or an aggregation
        if match.group().lower() not in _KEYWORDS:
            names.add(match.group())
    return names


def label_names(expr: str) -> set[str]:
    expr = _STRING.sub('""', expr)
    used = set()
    for group in _GROUPING.findall(expr):
        used |= {name.strip() for name in group.split(",") if name.strip()}
    for matchers in _MATCHERS.findall(expr):
        used |= set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
    return used


def test_promql_reader_finds_names() -> None:
    expr = ('histogram_quantile(0.9, sum by (le, node) '
            '(rate(a_bucket{node=~"$node", x="y{z}"}[$__rate_interval])))'
            ' / on (node) group_left b_total offset 5m and c > 1e3 unless count(d)')
    assert metric_names(expr) == {"a_bucket", "b_total", "c", "d"}
    assert label_names(expr) == {"le", "node", "x"}


# --- (a) and (b): the dashboards ---------------------------------------------------------------------

def load_dashboard(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard["panels"]:
        found += [panel] if panel.get("type") != "row" else []
        found += panel.get("panels", [])  # collapsed rows keep their panels inside
    return found


def all_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expr) for every query of every panel."""
    return [(f"panel {panel['id']} {panel['title']!r} target {target['refId']}", target["expr"])
            for panel in panels(dashboard) for target in panel["targets"]]


def datasource_uid() -> str:
    provisioned = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    (source,) = provisioned["datasources"]
    assert source["type"] == "prometheus"
    return source["uid"]


def test_there_is_a_dashboard() -> None:
    assert GRAFANA / "dashboards" / "ravq.json" in DASHBOARDS


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_queries_only_declared_metrics_and_labels(path: Path) -> None:
    series = declared_series() | PROMETHEUS_SERIES
    allowed_extra = scrape_labels()
    dashboard = load_dashboard(path)
    for where, expr in all_exprs(dashboard):
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        unknown = names - series.keys()
        assert not unknown, f"{where}: {sorted(unknown)} not declared in ravq/metrics.py: {expr!r}"
        known_labels = set().union(*(series[n] for n in names)) | allowed_extra
        assert label_names(expr) <= known_labels, f"{where}: unknown label in {expr!r}"
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query", {})
        text = query.get("query", "") if isinstance(query, dict) else query
        match = re.fullmatch(r"label_values\((\w+)(\{[^}]*\})?,\s*(\w+)\)", text)
        assert match, f"variable {variable['name']}: unexpected query {text!r}"
        assert match[1] in series and match[3] in series[match[1]] | allowed_extra
        assert label_names(match[2] or "") <= series[match[1]] | allowed_extra


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_panels_have_datasource_and_targets(path: Path) -> None:
    uid = datasource_uid()
    dashboard = load_dashboard(path)
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    ids = [panel["id"] for panel in dashboard["panels"]] + [
        inner["id"] for panel in dashboard["panels"] for inner in panel.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        name = f"panel {panel['id']} {panel.get('title')!r}"
        assert panel.get("title"), name
        assert panel.get("datasource", {}).get("uid") == uid, f"{name}: datasource must be {uid!r}"
        assert panel.get("targets"), f"{name}: no targets"
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and grid["x"] + grid["w"] <= 24, f"{name}: gridPos"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), f"{name}: duplicate refId"
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), f"{name}: target {target['refId']} has no expr"
            assert target.get("datasource", {}).get("uid", uid) == uid, f"{name}: target datasource"


def test_dashboard_covers_what_operators_need() -> None:
    exprs = [expr for path in DASHBOARDS for _, expr in all_exprs(load_dashboard(path))]
    used = set().union(*(metric_names(expr) for expr in exprs))
    needed = {
        "ravq_samples_total",              # throughput
        "ravq_loss",                       # loss
        "ravq_staleness_bucket",           # staleness quantiles
        "ravq_stage_busy_seconds_total",   # busy fraction
        "ravq_stage_wait_seconds_total",   # waiting, by reason (not counted as busy)
        "ravq_bytes_sent_total", "ravq_bytes_received_total",  # link bandwidth
        "ravq_queue_depth", "ravq_inflight_micro_batches",
        "ravq_allreduce_seconds_bucket", "ravq_allreduce_rounds_total", "ravq_allreduce_aborts_total",
        "ravq_bad_messages_total", "ravq_auth_failures_total",
    }
    assert needed <= used, f"no panel for {sorted(needed - used)}"


def test_link_bandwidth_is_per_peer_and_type() -> None:
    exprs = [expr for path in DASHBOARDS for _, expr in all_exprs(load_dashboard(path))]
    for metric in ("ravq_bytes_sent_total", "ravq_bytes_received_total"):
        assert any(metric in e and "rate(" in e and {"peer", "type"} <= label_names(e) for e in exprs), metric


def test_grafana_dashboard_provider_is_valid() -> None:
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "ravq.yaml").read_text())
    assert provider["apiVersion"] == 1
    (entry,) = provider["providers"]
    assert entry["type"] == "file" and entry["options"]["path"].startswith("/")


@NEEDS_PROMTOOL
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    # promtool parses PromQL when it checks rules: make one recording rule per panel query.
    rules = []
    for path in DASHBOARDS:
        for i, (_, expr) in enumerate(all_exprs(load_dashboard(path))):
            concrete = expr.replace("$__rate_interval", "1m").replace("$node", ".*")
            rules.append({"record": f"ravq:dashboard_query_{path.stem}_{i}", "expr": concrete})
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    check = subprocess.run([PROMTOOL, "check", "rules", str(rules_file)],
                           check=False, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"{len(rules)} rules found" in check.stdout


# --- (c): systemd units ------------------------------------------------------------------------------

def unit_settings(path: Path) -> dict[str, list[str]]:
    """'Section.Key' -> values in order (keys may repeat in unit files)."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        settings.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return settings


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|m)?", value)
    assert match, value
    return float(match[1]) * (60 if match[2] in ("min", "m") else 1)


@pytest.mark.parametrize(("role", "command"), [
    ("broker", f"broker --topology {TOPOLOGY_PATH} --plan /etc/ravq/plan.yaml"),
    ("backup", f"broker --topology {TOPOLOGY_PATH} --plan /etc/ravq/plan.yaml --backup"),
    ("node", f"node --topology {TOPOLOGY_PATH} --name %i"),
])
def test_unit_runs_ravq_and_stops_gracefully(role: str, command: str, examples: dict[str, Topology]) -> None:
    unit = unit_settings(UNITS[role])
    (exec_start,) = unit["Service.ExecStart"]
    binary, _, args = exec_start.partition(" ")
    assert Path(binary).name == "ravq" and binary.startswith("/"), exec_start
    assert args == command
    assert unit["Service.Restart"] == ["on-failure"]
    assert unit["Service.KillSignal"] == ["SIGTERM"]
    assert "2" in unit["Service.RestartPreventExitStatus"][0].split(), "a bad topology must not restart-loop"
    # systemd must not SIGKILL a node that is still inside its drain window
    drain = max(TimeoutConfig.model_validate({}).drain_s, *(t.timeouts.drain_s for t in examples.values()))
    assert seconds(unit["Service.TimeoutStopSec"][0]) > drain
    assert unit["Install.WantedBy"] == ["multi-user.target"]


@pytest.mark.parametrize("role", UNITS)
def test_unit_is_hardened(role: str) -> None:
    unit = unit_settings(UNITS[role])
    assert unit["Service.User"][0] not in ("", "root") and unit["Service.Group"] == unit["Service.User"]
    expected = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                "PrivateTmp": "yes", "CapabilityBoundingSet": "", "RestrictSUIDSGID": "yes",
                "ProtectKernelModules": "yes"}
    for key, value in expected.items():
        assert unit.get(f"Service.{key}") == [value], f"{UNITS[role].name}: {key}={value}"


def test_node_may_write_its_checkpoints(examples: dict[str, Topology]) -> None:
    unit = unit_settings(UNITS["node"])
    read_write = [Path(p) for value in unit["Service.ReadWritePaths"] for p in value.split()]
    state = [Path("/var/lib") / p for value in unit["Service.StateDirectory"] for p in value.split()]
    for name, topo in examples.items():
        if topo.training.checkpoint_dir is not None:
            target = Path(topo.training.checkpoint_dir)
            assert target in read_write, f"{name}: checkpoint_dir {target} is not in ReadWritePaths"
            # systemd creates a StateDirectory owned by User=; a bare ReadWritePaths must already exist
            assert target in state, f"{name}: checkpoint_dir {target} is not created by StateDirectory"
    assert examples["lan-example.yaml"].training.checkpoint_dir == "/var/lib/ravq/checkpoints"


def verify_copy(
    path: Path, tmp_path: Path, edit: tuple[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """systemd-analyze verify on a copy whose ExecStart binary exists (ravq is not installed system-wide)."""
    text = path.read_text()
    binary = unit_settings(path)["Service.ExecStart"][0].split()[0]
    text = text.replace(f"ExecStart={binary} ", f"ExecStart={shutil.which('true')} ")
    if edit:
        assert edit[0] in text
        text = text.replace(*edit)
    copy = tmp_path / path.name
    copy.write_text(text)
    return subprocess.run([SYSTEMD_ANALYZE, "verify", str(copy)], check=False, capture_output=True,
                          text=True, timeout=60, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "SYSTEMD_LOG_COLOR": "0"})


def complaints(result: subprocess.CompletedProcess[str]) -> list[str]:
    # In containers systemd-analyze may also talk about the host's own units; keep what is about ours.
    return [line for line in (result.stdout + result.stderr).splitlines() if "ravq-" in line]


@NEEDS_SYSTEMD
@pytest.mark.parametrize("role", UNITS)
def test_systemd_analyze_verify(role: str, tmp_path: Path) -> None:
    result = verify_copy(UNITS[role], tmp_path)
    assert result.returncode == 0 and not complaints(result), result.stdout + result.stderr


@NEEDS_SYSTEMD
def test_systemd_analyze_verify_would_notice_a_mistake(tmp_path: Path) -> None:
    """The check above is only worth something if a broken unit makes it speak."""
    result = verify_copy(UNITS["node"], tmp_path, ("ProtectSystem=strict", "ProtectSystem=stric"))
    assert any("stric" in line for line in complaints(result)), result.stdout + result.stderr


@NEEDS_SYSTEMD
@pytest.mark.parametrize("role", UNITS)
def test_systemd_exposure_is_low(role: str, tmp_path: Path) -> None:
    # `systemd-analyze security` scores 0 (locked down) .. 100 (wide open); "OK" is below 3.0 (30).
    path = tmp_path / UNITS[role].name
    path.write_text(UNITS[role].read_text())
    command = [SYSTEMD_ANALYZE, "security", "--offline=true", "--threshold=30", "--no-pager", str(path)]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    if "--offline" in result.stderr and "unrecognized" in result.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    assert result.returncode == 0, result.stdout[-600:] + result.stderr


# --- (d): Prometheus ---------------------------------------------------------------------------------

@NEEDS_PROMTOOL
def test_promtool_check_config() -> None:
    check = subprocess.run([PROMTOOL, "check", "config", str(DEPLOY / "prometheus.yml")],
                           check=False, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_prometheus_yml_is_made_by_ravq_scrape_config() -> None:
    """Labels are never copied by hand: deploy/prometheus.yml is exactly `ravq scrape-config`'s output."""
    from ravq.cli.scrape import scrape_config
    from ravq.config import load_topology

    source = "deploy/topologies/local-2x2.yaml"
    topology = load_topology(REPO / source, resolve_task=False)
    assert (DEPLOY / "prometheus.yml").read_text() == scrape_config(topology, source)


def test_every_target_has_a_node_label_and_the_variable_lists_nodes_only() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            assert static["labels"]["node"] and static["labels"]["role"] in ("broker", "node")
    (variable,) = load_dashboard(GRAFANA / "dashboards" / "ravq.json")["templating"]["list"]
    assert 'role="node"' in variable["query"]["query"]


def test_per_cluster_panels_and_zero_instead_of_no_data() -> None:
    dashboard = load_dashboard(GRAFANA / "dashboards" / "ravq.json")
    by_title = {panel["title"]: panel for panel in panels(dashboard)}
    for title in ("Throughput per cluster (samples/s)", "Loss per cluster", "Slowest stage per cluster (busy fraction)"):
        assert all("by (cluster)" in t["expr"] for t in by_title[title]["targets"]), title
    for panel in panels(dashboard):
        for target in panel["targets"]:
            if "increase(" in target["expr"] and "_total" in target["expr"]:
                assert target["expr"].endswith("or on () vector(0)"), (panel["title"], target["expr"])
    assert 'state="up"' in by_title["Nodes up (broker)"]["targets"][0]["expr"]


def test_prometheus_scrapes_every_process_of_local_2x2(examples: dict[str, Topology]) -> None:
    topo = examples["local-2x2.yaml"]
    expected: dict[str, str | None] = {f"{topo.broker.host}:{topo.broker.metrics_port}": "broker"}
    expected |= {f"{node.host}:{node.metrics_port}": node.name for node in topo.nodes}
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    scraped: dict[str, str | None] = {}
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            for target in static["targets"]:
                assert target not in scraped, f"{target} scraped twice"
                scraped[target] = static.get("labels", {}).get("node")
    assert scraped == expected  # and the `node` label the dashboards group by is each node's name


# --- (e): the example topologies ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def examples() -> Iterator[dict[str, Topology]]:
    """The validated example topologies by file name.

    Task resolution is test_config's business (ravq.tasks.charlm may not be written yet), so the
    schema is checked with the test task in its place.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(TESTS))
        found = {}
        for path in sorted((DEPLOY / "topologies").glob("*.yaml")):
            data = yaml.safe_load(path.read_text())
            assert data["task"] == "ravq.tasks.charlm", path.name
            found[path.name] = parse_topology({**data, "task": "tasks_for_tests"}, path.name)
        yield found


def test_examples_validate_and_have_the_promised_shapes(examples: dict[str, Topology]) -> None:
    topos = examples
    assert set(topos) == {"local-1x3.yaml", "local-2x2.yaml", "lan-example.yaml"}

    def shape(topo: Topology) -> list[int]:
        clusters: dict[int | None, int] = {}
        for node in topo.nodes:
            clusters[node.cluster] = clusters.get(node.cluster, 0) + 1
        return [clusters[c] for c in sorted(clusters, key=str)]

    assert shape(topos["local-1x3.yaml"]) == [3]
    assert shape(topos["local-2x2.yaml"]) == [2, 2]
    for name in ("local-1x3.yaml", "local-2x2.yaml"):
        hosts = {topos[name].broker.host} | {node.host for node in topos[name].nodes}
        assert hosts == {"127.0.0.1"}, name
    lan = topos["lan-example.yaml"]
    assert len({node.host for node in lan.nodes}) == len(lan.nodes) >= 3


def test_local_examples_can_run_side_by_side(examples: dict[str, Topology]) -> None:
    """Within a file the schema rejects collisions; across the local files no port repeats either."""
    owners: dict[int, str] = {}
    for name, topo in examples.items():
        if not name.startswith("local-"):
            continue
        ports = [topo.broker.pub_port, topo.broker.router_port, topo.broker.metrics_port]
        ports += [p for n in topo.nodes for p in (n.pipeline_port, n.ring_port, n.metrics_port)]
        assert None not in ports, f"{name}: every process should serve metrics"
        for port in filter(None, ports):
            assert port not in owners, f"{name}: port {port} is also used by {owners[port]}"
            owners[port] = name


def test_lan_example_uses_real_curve_keys(examples: dict[str, Topology]) -> None:
    lan = examples["lan-example.yaml"]
    assert lan.security.curve
    keys = [lan.broker.public_key] + [node.public_key for node in lan.nodes]
    assert len(set(keys)) == len(keys), "every machine has its own key"
    for key in keys:
        assert key is not None and len(zmq.utils.z85.decode(key)) == 32


def test_lan_example_explains_every_field() -> None:
    text = (DEPLOY / "topologies" / "lan-example.yaml").read_text()
    commented = {line.split(":")[0].strip(" -")
                 for line in text.splitlines() if "#" in line.partition(":")[2]}
    fields = {"task", "seed", "micro_batch", "steps", "max_inflight", "batch", "sync_every",
              "average_optimizer_state", "checkpoint_every", "checkpoint_dir", "ring_chunk_bytes", "state_dir",
              "connect_s", "request_s", "peer_s", "ring_step_s", "drain_s", "heartbeat_interval_s",
              "max_message_bytes", "max_header_bytes", "max_frames", "curve", "key_dir", "host", "pub_port",
              "router_port", "metrics_port", "public_key", "name", "pipeline_port", "ring_port", "device",
              "bind_host", "memory_bytes", "flops", "bandwidth_bytes_per_s"}
    # task and seed carry their comment on the line above
    assert fields - {"task", "seed"} <= commented, sorted(fields - {"task", "seed"} - commented)
    assert "# Importable Python module" in text and "# Seed for" in text


def _installed_root(root: Path, with_binary: bool = True) -> Path:
    """A file system root laid out as deploy/README.md installs ravq: the venv's ravq at the path the
    units run, the units in /etc/systemd/system, and this system's own units (targets the units name)."""
    binary = root / "opt/ravq/venv/bin/ravq"
    binary.parent.mkdir(parents=True)
    if with_binary:
        binary.write_text("#!/bin/sh\nexit 0\n")
        binary.chmod(0o755)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    for path in UNITS.values():
        shutil.copy(path, units / path.name)
    system = Path("/usr/lib/systemd/system")
    shutil.copytree(system, root / "usr/lib/systemd/system", symlinks=True)
    return root


@NEEDS_SYSTEMD
@pytest.mark.skipif(not Path("/usr/lib/systemd/system/sysinit.target").exists(), reason="no systemd unit tree here")
def test_systemd_analyze_verify_with_the_readme_install_path(tmp_path: Path) -> None:
    """The units as installed by deploy/README.md (ExecStart=/opt/ravq/venv/bin/ravq, unmodified)."""
    root = _installed_root(tmp_path / "root")
    units = [f"/etc/systemd/system/{path.name}" for path in UNITS.values()]
    command = [SYSTEMD_ANALYZE, "verify", f"--root={root}", *units]
    env = {"PATH": "/usr/bin:/bin", "SYSTEMD_LOG_COLOR": "0"}
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0 and not complaints(result), result.stdout + result.stderr
    # and it notices when ravq is not where the units look for it
    missing = _installed_root(tmp_path / "missing", with_binary=False)
    result = subprocess.run([SYSTEMD_ANALYZE, "verify", f"--root={missing}", *units], check=False,
                            capture_output=True, text=True, timeout=60, env=env)
    assert "/opt/ravq/venv/bin/ravq is not executable" in result.stdout + result.stderr
