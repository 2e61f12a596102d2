"""Metrics over HTTP: the exposition a node serves, and a real Prometheus server scraping it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from ravq.cli.demo import free_ports
from ravq.metrics import _LATENCY_BUCKETS, HopCounter, HopHistogram, Metrics

ROOT = Path(__file__).resolve().parents[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def test_node_metrics_are_served_over_http() -> None:
    (port,) = free_ports(1)
    m = Metrics("n0")
    m.serve(port, "127.0.0.1")
    m.samples.inc(48)
    m.bytes_sent.labels("pipeline", "n1", "fwd").inc(1024)
    m.staleness.observe(2)
    text = _get(f"http://127.0.0.1:{port}/metrics")
    assert "ravq_samples_total 48.0" in text
    assert 'ravq_bytes_sent_total{peer="n1",socket="pipeline",type="fwd"} 1024.0' in text
    assert 'ravq_staleness_bucket{le="2.0"} 1.0' in text


@pytest.mark.parametrize("generate", [generate_latest, generate_openmetrics])
@pytest.mark.parametrize("touched", [False, True])
def test_hop_metrics_expose_exactly_what_prometheus_client_would(generate: Any, touched: bool) -> None:
    """The per-hop families count in plain numbers; what a scrape sees must not change."""
    texts = []
    for counter, histogram in ((Counter, Histogram), (HopCounter, HopHistogram)):
        registry = CollectorRegistry(auto_describe=True)
        hop = ["socket", "peer", "type"]
        c = counter("ravq_messages_sent_total", "Messages sent", hop, registry=registry)
        h = histogram("ravq_send_seconds", "Time", hop, buckets=_LATENCY_BUCKETS, registry=registry)
        if touched:
            c.labels("pipeline", "n1", "fwd").inc()
            c.labels(socket="ring", peer="n2", type="ring_chunk").inc(1024)
            for seconds in (0.0, 1e-4, 2e-4, 0.05, 5.0, 100.0):
                h.labels("pipeline", "n1", "fwd").observe(seconds)
        texts.append(re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", generate(registry).decode()))
    assert texts[0] == texts[1]


def test_hop_counter_labels_are_checked() -> None:
    m = Metrics()
    assert m.messages_sent.labels("a", "b", "c") is m.messages_sent.labels(socket="a", peer="b", type="c")
    with pytest.raises(ValueError):
        m.messages_sent.labels("a", "b")
    with pytest.raises(ValueError):
        m.bytes_received.labels(socket="a", peer="b")


def test_totals_in_one_pass_agree_with_total_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    m = Metrics()
    m.bytes_sent.labels("pipeline", "b", "fwd").inc(100)
    m.bytes_sent.labels("ring", "b", "piece").inc(30)
    m.bytes_sent.labels("ring", "c", "piece").inc(5)
    m.bad_messages.labels("pipeline", "decode").inc(2)
    queries = {"all": ("ravq_bytes_sent_total", {}), "ring": ("ravq_bytes_sent_total", {"socket": "ring"}),
               "ring_c": ("ravq_bytes_sent_total", {"socket": "ring", "peer": "c"}),
               "bad": ("ravq_bad_messages_total", {}), "none": ("ravq_no_such_total", {})}
    collections = []
    collect = m.registry.collect
    monkeypatch.setattr(m.registry, "collect", lambda: (collections.append(1), collect())[1])
    assert m.totals(queries) == {"all": 135, "ring": 35, "ring_c": 5, "bad": 2, "none": 0}
    assert len(collections) == 1                            # one pass over the registry for all five
    for key, (name, labels) in queries.items():
        assert m.total(name, **labels) == m.totals(queries)[key]


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus is not installed")
def test_real_prometheus_scrapes_and_queries(tmp_path: Path) -> None:
    target, web = free_ports(2)
    m = Metrics("n0")
    m.serve(target, "127.0.0.1")
    m.samples.inc(123)
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: ravq\n"
                      f"    static_configs: [{{targets: ['127.0.0.1:{target}'], labels: {{node: n0}}}}]\n")
    proc = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{web}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        value = None
        while time.monotonic() < deadline and value is None:
            time.sleep(1)
            try:
                reply = json.loads(_get(f"http://127.0.0.1:{web}/api/v1/query?query=ravq_samples_total"))
            except OSError:
                continue
            results = reply.get("data", {}).get("result", [])
            if results:
                value = float(results[0]["value"][1])
                assert results[0]["metric"]["node"] == "n0"
        assert value == 123.0
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.multiprocess
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus is not installed")
def test_every_dashboard_query_answers_on_a_demo_swarm(tmp_path: Path) -> None:
    """``ravq demo`` (2 clusters of 2 stages) on its task without metrics_fn and without checkpoints, as a
    first run has them, scraped by a real Prometheus with ``ravq scrape-config``'s targets: every panel's
    query returns data, or a zero its panel documents (the evaluation and training metrics and the
    checkpoint time had none)."""
    from ravq.cli.scrape import scrape_config
    from ravq.config import load_topology
    from tests.dashboard import unanswered

    run, (web,) = tmp_path / "run", free_ports(1)
    demo = subprocess.Popen([sys.executable, "-m", "ravq", "demo", "--quiet", "--no-curve", "--run-dir", str(run),
                             "--task", "tests.tasks_for_tests:charlm_without_metrics", "--steps", "100000",
                             "--eval-every", "4"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    prometheus = None
    try:
        deadline = time.monotonic() + 60
        while not (run / "topology.yaml").exists():
            assert demo.poll() is None and time.monotonic() < deadline, "the demo wrote no topology"
            time.sleep(0.2)
        time.sleep(0.2)  # written whole: the demo starts its processes after it
        config = scrape_config(load_topology(run / "topology.yaml", resolve_task=False), "demo")
        (tmp_path / "prometheus.yml").write_text(config.replace("scrape_interval: 5s", "scrape_interval: 1s"))
        prometheus = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                                       f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                       f"--web.listen-address=127.0.0.1:{web}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        problems = ["nothing asked yet"]
        deadline = time.monotonic() + 150
        while problems and time.monotonic() < deadline:
            time.sleep(1)
            assert demo.poll() is None, f"the demo ended: {demo.communicate()[0][-3000:]}"
            try:
                problems = unanswered(lambda expr: _ask(web, expr))
            except OSError:  # Prometheus is not listening yet
                continue
        assert not problems, "\n".join(problems)
    finally:
        for proc in (demo, prometheus):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _ask(port: int, expr: str) -> list[dict[str, Any]]:
    reply = json.loads(_get(f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    assert reply.get("status") == "success", f"{expr}: {reply}"
    return reply["data"]["result"]


def test_every_stage_counts_the_samples_it_trains() -> None:
    """ravq_samples_total is counted by the process that trains (the throughput panels read it)."""
    from tests import models_for_tests as skipnet
    from tests.pipeline_harness import make_workers, run_workers

    workers = make_workers(skipnet, 2, steps=6, max_inflight=2, micro_batch=4)
    registries = []
    for w in workers:
        w.metrics = Metrics(f"s{w.spec.index}")
        registries.append(w.metrics.registry)
    run_workers(workers)
    for registry in registries:
        assert registry.get_sample_value("ravq_samples_total") == 6 * 4
