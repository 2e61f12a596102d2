"""Metrics over HTTP: the exposition a node serves, and a real Prometheus server scraping it."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from ravq.demo import free_ports
from ravq.metrics import Metrics


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
