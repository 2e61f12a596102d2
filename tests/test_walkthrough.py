"""deploy/README.md's walkthrough on three namespaced "PCs": every step as a new user would run it.

Three network namespaces on one bridge stand for three PCs.  On each, as the unprivileged user the units
run as (``nobody`` here, ``ravq`` in the README): keys made with ``ravq keygen --owner``, profiles taken
on every PC at once and gathered for ``ravq plan``, the broker and nodes started with the systemd units'
own ExecStart lines (every PC's /etc/ravq, /var/lib/ravq and /var/cache/ravq moved under a temporary
root of its own, in the command lines and the topology's key_dir and checkpoint_dir), ``ravq status`` from a node's PC, a real
Prometheus (Debian's) scraping the targets ``ravq scrape-config`` makes and answering every dashboard
query while the swarm trains, ``systemctl stop`` (SIGTERM: leave the run, final checkpoint), then the
checkpoints gathered on one PC and exported.

Needs root, iproute2, setpriv and prometheus; skipped with the reason otherwise.  Namespaces are made
by benchmarks/_netns.py (deleted on every exit path); every process started here is killed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks import _netns
from tests import units
from tests.dashboard import unanswered
from tests.service_user import USER, traversable_tmp
from tests.units import Site

pytestmark = [pytest.mark.netns, pytest.mark.multiprocess]

REPO = Path(__file__).resolve().parents[1]
PCS = ["pc1", "pc2", "pc3"]
CLUSTERS = {"pc1": 0, "pc2": 0, "pc3": 1}
"""Two clusters (a 2-stage pipeline and a 1-stage one), so every all-reduce panel has rings to show."""
PROM_PORT = 9390
RATE_MBIT = 1000


@pytest.fixture
def site() -> Iterator[Site]:
    if reason := _netns.unavailable_reason():
        pytest.skip(reason)
    if shutil.which("prometheus") is None:
        pytest.skip("Debian's prometheus is not installed (make system-deps)")
    if shutil.which("curl") is None:
        pytest.skip("curl not found (asks Prometheus from inside the namespace)")
    if reason := units.unavailable_reason():
        pytest.skip(reason)
    with traversable_tmp("rq13-walk-") as root, _netns.shaped_links(len(PCS), RATE_MBIT) as links:
        s = Site(root, {pc: link.netns for pc, link in zip(PCS, links)},
                 {pc: link.address for pc, link in zip(PCS, links)})
        try:
            yield s
        finally:
            s.kill_all()


def _topology(site: Site, keys: dict[str, str]) -> str:
    """The topology every PC gets at /etc/ravq/topology.yaml (README step 2), with the keys pasted in."""
    nodes = [{"name": pc, "host": site.addr[pc], "pipeline_port": 5560, "ring_port": 5561, "metrics_port": 9101,
              "device": "cpu", "cluster": CLUSTERS[pc], "public_key": keys[pc]} for pc in PCS]
    data = {"task": "ravq.tasks.charlm", "seed": 13,
            "training": {"micro_batch": 8, "steps": 100000, "sync_every": 5, "checkpoint_every": 10, "log_every": 10,
                         "eval_every": 5,
                         "checkpoint_dir": "/var/lib/ravq/checkpoints"},
            "timeouts": {"drain_s": 10, "connect_s": 60},
            "security": {"curve": True, "key_dir": "/etc/ravq/keys"},
            "broker": {"host": site.addr["pc1"], "pub_port": 5550, "router_port": 5551, "metrics_port": 9100,
                       "public_key": keys["broker"]},
            "nodes": nodes}
    return yaml.safe_dump(data, sort_keys=False)


def _query(site: Site, expr: str) -> list[dict[str, Any]]:
    url = f"http://{site.addr['pc1']}:{PROM_PORT}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    out = subprocess.run(["ip", "netns", "exec", site.ns["pc1"], "curl", "-s", "--max-time", "5", url],
                         capture_output=True, text=True, timeout=20, check=False).stdout
    reply = json.loads(out or "{}")
    assert reply.get("status") == "success", f"{expr}: {out[:300]}"
    return reply["data"]["result"]


def _unanswered(site: Site) -> list[str]:
    """Dashboard queries that return nothing, or only zeros their panel does not document."""
    return unanswered(lambda expr: _query(site, expr))


def _wait_for(what: str, check: Any, timeout_s: float, interval_s: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(interval_s)


def test_walkthrough_from_empty_pcs_to_an_exported_model(site: Site) -> None:
    t0 = time.monotonic()

    def step(what: str) -> None:
        print(f"[{time.monotonic() - t0:5.1f}s] {what}", flush=True)

    # Step 2: keys, made by root for the service user; only public halves leave a PC.
    keys = {}
    for pc, name in [*((pc, pc) for pc in PCS), ("pc1", "broker")]:
        made = site.run(pc, "keygen", name, "--key-dir", "/etc/ravq/keys", "--owner", USER, as_user=False)
        assert made.returncode == 0, made.stderr
        keys[name] = yaml.safe_load(made.stdout)["public_key"]
    topology = _topology(site, keys)
    for pc in PCS:  # the same file everywhere, but for the two paths that live under this PC's root here
        text = topology.replace("/etc/ravq/keys", str(site.path(pc, "/etc/ravq/keys")))
        text = text.replace("/var/lib/ravq/checkpoints", str(site.path(pc, "/var/lib/ravq/checkpoints")))
        site.path(pc, "/etc/ravq/topology.yaml").write_text(text)

    step('Step 3:')
    # Step 3: profile every PC at once (within profile's --peers-wait), gather the files on the broker's PC.
    profile_dir = {pc: site.path(pc, "/var/lib/ravq") for pc in PCS}
    profiling = [subprocess.Popen(site.command(pc, ["ravq", "profile", "--topology", "/etc/ravq/topology.yaml",
                                                    "--name", pc, "--out", "/var/lib/ravq", "--peers-wait", "60"]),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=site.env(pc), cwd=site.root)
                 for pc in PCS]
    site.procs += profiling
    deadline = time.monotonic() + 90
    outputs = {}
    for pc, proc in zip(PCS, profiling):
        try:
            outputs[pc] = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0].decode()
        except subprocess.TimeoutExpired:
            proc.kill()
            outputs[pc] = "(timed out) " + proc.communicate()[0].decode()
    assert all(p.returncode == 0 for p in profiling), "\n".join(f"--- {k}:\n{v}" for k, v in outputs.items())
    gathered = site.path("pc1", "/etc/ravq/profiles")
    gathered.mkdir()
    for pc in PCS:
        shutil.copy(profile_dir[pc] / f"profile-{pc}.json", gathered)

    step('Step 4:')
    # Step 4: the plan, where the broker unit reads it.
    planned = site.run("pc1", "plan", "--topology", "/etc/ravq/topology.yaml", "--profiles", "/etc/ravq/profiles",
                       "--out", "/etc/ravq/plan.yaml", as_user=False)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    plan = yaml.safe_load(site.path("pc1", "/etc/ravq/plan.yaml").read_text())["plan"]
    assert sorted(sorted(c["nodes"]) for c in plan["clusters"]) == [["pc1", "pc2"], ["pc3"]]

    step('Step 7 (st')
    # Step 7 (started first: it must see training): Prometheus with `ravq scrape-config`'s targets.
    scrape = site.run("pc1", "scrape-config", "--topology", "/etc/ravq/topology.yaml")
    assert scrape.returncode == 0, scrape.stderr
    prom_yml = site.root / "prometheus.yml"
    prom_yml.write_text(scrape.stdout.replace("scrape_interval: 5s", "scrape_interval: 1s"))
    prometheus = subprocess.Popen(["ip", "netns", "exec", site.ns["pc1"], "prometheus", f"--config.file={prom_yml}",
                                   f"--storage.tsdb.path={site.root / 'tsdb'}",
                                   f"--web.listen-address={site.addr['pc1']}:{PROM_PORT}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    site.procs.append(prometheus)

    step('Step 5:')
    # Step 5: the units, with their own command lines, as the service user.
    broker = site.start_unit("pc1", "ravq-broker.service")
    nodes = {pc: site.start_unit(pc, "ravq-node@.service", pc) for pc in PCS}

    step('Step 6:')
    # Step 6: `ravq status` from a node's PC (pc3 holds only its own key).
    def all_training() -> str | None:
        got = site.run("pc3", "status", "--topology", "/etc/ravq/topology.yaml", timeout=60)
        lines = got.stdout.splitlines()
        rows = [line.split() for line in lines[2:] if line.split() and line.split()[0] in PCS]
        ok = got.returncode == 0 and len(rows) == len(PCS) and all(r[1] == "alive" and r[3] not in ("-", "0") for r in rows)
        return got.stdout if ok else None

    status = _wait_for("all nodes training (ravq status from pc3)", all_training, 120, 2)
    assert "pc1 -> pc2" in status or "pc2 -> pc1" in status
    # (step 9's first half, run now to save time: pc1's checkpoints alone lack pc2's stage)
    _wait_for("a checkpoint on pc1", lambda: list(site.path("pc1", "/var/lib/ravq/checkpoints").glob("*/*.json")),
              60)
    export_alone = subprocess.Popen(site.command("pc1", ["ravq", "export", "--checkpoint-dir",
                                                         "/var/lib/ravq/checkpoints", "--cluster", "0", "--out",
                                                         "/var/lib/ravq/model.safetensors"]),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=site.env("pc1"),
                                    cwd=site.root)
    site.procs.append(export_alone)  # type: ignore[arg-type]

    step('Step 7: ev')
    # Step 7: every dashboard query answers while the swarm trains.
    problems: list[str] = []

    def answered() -> bool:
        problems[:] = _unanswered(site)
        return not problems

    deadline = time.monotonic() + 45
    while not answered() and time.monotonic() < deadline:
        time.sleep(3)
    assert not problems, "\n".join(problems)
    assert broker.poll() is None and all(p.poll() is None for p in nodes.values())

    step('Step 8:')
    # Step 8: systemctl stop: every node leaves the run and writes a final checkpoint.
    codes = {pc: site.stop(proc) for pc, proc in nodes.items()}
    assert codes == dict.fromkeys(PCS, 0), codes
    assert site.stop(broker) == 0
    for pc in PCS:
        text = (site.root / f"{pc}-ravq-node.log").read_text()
        assert "leaving the run" in text and "micro-batch" in text and "samples/s" in text, text[-2000:]

    step('Step 9:')
    # Step 9: export cluster 0 on pc1: first without pc2's stage (named), then with it copied over.
    export_dir = site.path("pc1", "/var/lib/ravq/checkpoints")
    out = site.path("pc1", "/var/lib/ravq/model.safetensors")
    _, first_err = export_alone.communicate(timeout=120)
    stage_of = {n: s for s, n in enumerate(next(c["nodes"] for c in plan["clusters"] if "pc1" in c["nodes"]))}
    missing = 1 - stage_of["pc1"]  # pc1 alone lacks the stage pc2 trained
    assert export_alone.returncode == 2 and f"stage {missing} (node pc2)" in first_err, first_err
    for f in site.path("pc2", "/var/lib/ravq/checkpoints").glob("cluster0/stage*"):
        shutil.copy(f, export_dir / "cluster0")
    done = site.run("pc1", "export", "--checkpoint-dir", "/var/lib/ravq/checkpoints", "--cluster", "0",
                    "--out", "/var/lib/ravq/model.safetensors")
    assert done.returncode == 0, done.stderr
    assert "2 stages" in done.stdout
    from safetensors.torch import load_file

    from ravq.tasks import charlm
    assert set(load_file(str(out))) == set(charlm.build_model().state_dict())
