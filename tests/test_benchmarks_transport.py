"""The transport benchmarks run end to end in smoke mode and keep their --json contract: the last
line of output is one JSON object with the keys the README and CI read."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.bench, pytest.mark.timeout(180)]


def run_quick(script: str) -> tuple[str, dict[str, Any]]:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--quick", "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=150, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    return proc.stdout, json.loads(lines[-1])


def positive(x: Any) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_bench_transport_quick_json() -> None:
    out, result = run_quick("bench_transport.py")
    assert result["benchmark"] == "transport" and result["unit"] == "bytes/s"
    assert set(result["results"]) == {str(s) for s in (64 << 10, 1 << 20, 16 << 20)}
    for row in result["results"].values():
        for mode in ("ravq", "raw_dealer_router", "raw_dealer_router_asyncio", "raw_push_pull"):
            assert positive(row[mode]), mode
            assert positive(row[f"{mode}_recv_cpu_us_per_message"])
        assert row["ratio_ravq_over_raw_dealer_router"] == pytest.approx(row["ravq"] / row["raw_dealer_router"])
        assert positive(row["ratio_ravq_over_raw_push_pull"])
    assert isinstance(result["meets_target"], bool) and result["target_ratio"] == 0.8
    assert "ravq/raw D->R" in out  # the table for people comes before the JSON


def test_bench_asyncio_binding_quick_json() -> None:
    out, result = run_quick("bench_asyncio_binding.py")
    assert result["benchmark"] == "asyncio_binding" and result["size_bytes"] == 1 << 20
    assert positive(result["results"]["zmq_asyncio"]["bytes_per_s"])
    if result["aiozmq_error"] is None:
        assert positive(result["results"]["aiozmq"]["bytes_per_s"])
        assert positive(result["ratio_zmq_asyncio_over_aiozmq"])
    else:  # this machine cannot run aiozmq: the next test checks how that is reported
        assert "aiozmq not measured" in out


def test_bench_asyncio_binding_says_why_when_aiozmq_cannot_run() -> None:
    code = ("import sys; sys.modules['aiozmq'] = None; sys.path.insert(0, 'benchmarks'); "
            "import bench_asyncio_binding as b; sys.exit(b.main(['--quick', '--json', '--repeats', '1']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=150,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "cannot be imported" in result["aiozmq_error"] and result["ratio_zmq_asyncio_over_aiozmq"] is None
    assert set(result["results"]) == {"zmq_asyncio", "zmq_asyncio_copy"}
    assert "aiozmq not measured: aiozmq cannot be imported" in proc.stdout
