"""deploy/README.md's procedures for what PC owners do, run on namespaced "PCs" as the walkthrough runs
its steps (tests/units.py's Site, as the walkthrough: the units' own command lines, as the service user, CURVE
keys per PC), one swarm through all of them: upgrading ravq on every PC without losing the run (a
rolling stop/start: each node resumes from its checkpoint, the broker restarted), adding a PC as a
standby and rotating a node's key (the new topology everywhere, then that same rolling restart: the
procedures share it, so each node restarts once for the three), rebooting the broker's PC (the broker
and its node stopped and started: training resumes), and re-planning so that the added PC trains
(other cut points: the old run exported and given to the new one as training.init_from, the old checkpoints and
the broker's run state set aside, a new run that starts from the old weights).

The model is tests.churn_task (a small network whose last stages are throttled): the procedures are
about processes, keys and state on disk, and a small, quiet model keeps each node's start short.  The
upgrade itself (``pip install --upgrade``) is the one command not run: the test's ravq is the checkout
under test.  Needs root, iproute2, setpriv; skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from benchmarks import _netns
from tests import test_walkthrough as walk
from tests import units
from tests.service_user import USER, traversable_tmp
from tests.units import Site

pytestmark = [pytest.mark.netns, pytest.mark.multiprocess, pytest.mark.timeout(600)]

PCS = ["pc1", "pc2", "pc3", "pc4"]
TRAINING = ["pc1", "pc2", "pc3"]
CLUSTERS = {"pc1": 0, "pc2": 0, "pc3": 1}
TOPOLOGY = "/etc/ravq/topology.yaml"
START = "/var/lib/ravq/start.safetensors"
"""Where the re-plan procedure puts the old run's export on every PC (``training.init_from``)."""


@pytest.fixture
def site() -> Iterator[Site]:
    if reason := _netns.unavailable_reason():
        pytest.skip(reason)
    if reason := units.unavailable_reason():
        pytest.skip(reason)
    with traversable_tmp("rq27-proc-") as root, _netns.shaped_links(len(PCS), 1000, prefix="rqp") as links:
        s = Site(root, {pc: link.netns for pc, link in zip(PCS, links)},  # pc4 is the PC added later
                 {pc: link.address for pc, link in zip(PCS, links)})
        try:
            yield s
        finally:
            s.kill_all()


def _topology(site: Site, keys: dict[str, str], nodes: list[str], clusters: dict[str, int] = CLUSTERS,
              init_from: str | None = None) -> dict[str, Any]:
    entries = []
    for pc in nodes:
        entry: dict[str, Any] = {"name": pc, "host": site.addr[pc], "pipeline_port": 5560, "ring_port": 5561,
                                 "device": "cpu", "public_key": keys[pc],
                                 # measurements given: `ravq plan` needs no profiles here
                                 "memory_bytes": 4 << 30, "flops": 1e10, "bandwidth_bytes_per_s": 1e8}
        entry.update({"cluster": clusters[pc]} if pc in clusters else {"standby": True})
        entries.append(entry)
    return {"task": "tests.churn_task", "seed": 27,
            "training": {"micro_batch": 8, "steps": 1_000_000, "sync_every": 20, "checkpoint_every": 10,
                         "log_every": 100, "checkpoint_dir": "/var/lib/ravq/checkpoints",
                         **({"init_from": init_from} if init_from else {})},
            # replace_s: no standby takes a stage while its node is away for a procedure
            "timeouts": {"drain_s": 10, "connect_s": 120, "lost_s": 6, "replace_s": 600},
            "security": {"curve": True, "key_dir": "/etc/ravq/keys"},
            "broker": {"host": site.addr["pc1"], "pub_port": 5550, "router_port": 5551, "public_key": keys["broker"],
                       "state_dir": "/var/lib/ravq/broker"},  # where the run survives the broker's restarts
            "nodes": entries}


def _install(site: Site, topology: dict[str, Any]) -> None:
    """`install -m 0644 topology.yaml /etc/ravq/topology.yaml` on every PC (paths moved under its root)."""
    text = yaml.safe_dump(topology, sort_keys=False)
    for pc in PCS:
        moved = text.replace("/etc/ravq/keys", str(site.path(pc, "/etc/ravq/keys")))
        for state in ("/var/lib/ravq/checkpoints", "/var/lib/ravq/broker", START):
            moved = moved.replace(state, str(site.path(pc, state)))
        site.path(pc, TOPOLOGY).write_text(moved)


def _keygen(site: Site, pc: str, name: str, key_dir: str = "/etc/ravq/keys") -> str:
    made = site.run(pc, "keygen", name, "--key-dir", key_dir, "--owner", USER, as_user=False)
    assert made.returncode == 0, made.stderr
    return yaml.safe_load(made.stdout)["public_key"]


def _status(site: Site) -> dict[str, Any] | None:
    got = site.run("pc3", "status", "--topology", TOPOLOGY, "--json", timeout=60)
    return yaml.safe_load(got.stdout) if got.returncode == 0 else None


def _versions(status: dict[str, Any] | None) -> dict[str, int]:
    members = (status or {}).get("members", {})
    return {n: int(m.get("stats", {}).get("version") or 0) for n, m in members.items() if m.get("state") == "up"}


def _all_train(site: Site, nodes: list[str], above: dict[str, int] | None = None,
               where: dict[str, int] = CLUSTERS) -> dict[str, int] | None:
    """Versions when the clusters of ``nodes`` train and each of ``nodes`` is up past ``above`` (else None)."""
    status = _status(site)
    versions = _versions(status)
    clusters = (status or {}).get("clusters", [])
    ok = len(clusters) == 2 and all(clusters[where[n]].get("state") == "training" for n in nodes) and all(
        versions.get(n, 0) > (above or {}).get(n, 0) for n in nodes)
    return versions if ok else None


WAIT_S = 120


def _wait_training(site: Site, what: str, nodes: list[str], above: dict[str, int] | None = None,
                   where: dict[str, int] = CLUSTERS) -> dict[str, int]:
    deadline = time.monotonic() + WAIT_S
    while (versions := _all_train(site, nodes, above, where)) is None:
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}: status {_status(site)}\n{_log_tails(site)}")
        time.sleep(0.5)
    return versions


def _log_tails(site: Site, lines: int = 12) -> str:
    """The last lines of every unit's log, but progress lines (what a failure needs to be understood)."""
    out = []
    for log in sorted(site.root.glob("*.log")):
        kept = [line for line in log.read_text(errors="replace").splitlines() if "samples/s" not in line]
        out.append(f"--- {log.name}\n" + "\n".join(kept[-lines:]))
    return "\n".join(out)


def _restart(site: Site, procs: dict[str, Any], pc: str, up: list[str]) -> None:
    """`systemctl restart ravq-node@NAME` while the clusters of ``up`` train: it resumes from its checkpoint."""
    before = _wait_training(site, "the clusters training", up)
    assert site.stop(procs[pc]) == 0, (site.root / f"{pc}-ravq-node.log").read_text()[-2000:]
    procs[pc] = site.start_unit(pc, "ravq-node@.service", pc)
    # resumed, not restarted from the seed: its version goes on from where it stopped
    _wait_training(site, f"{pc} training again past version {before[pc]}", up, {pc: before[pc]})
    _assert_resumed(site, pc)


def _stop_together(procs: list[Any], timeout: float = 30) -> list[int]:
    """`systemctl stop` on several PCs at once: SIGTERM to each, then their exit statuses."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)  # once: a second signal forces the exit
    deadline, codes = time.monotonic() + timeout, []
    for proc in procs:
        try:
            codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return codes


def _assert_resumed(site: Site, pc: str) -> None:
    log = (site.root / f"{pc}-ravq-node.log").read_text()
    assert "resumed at version" in log, log[-2000:]


def _run_id(site: Site) -> str:
    return str(yaml.safe_load(site.path("pc1", "/var/lib/ravq/broker/run.json").read_text())["run_id"])


def test_upgrade_add_a_standby_pc_rotate_a_key_reboot_the_broker_and_replan(site: Site) -> None:
    t0 = time.monotonic()
    keys = {pc: _keygen(site, pc, pc) for pc in TRAINING} | {"broker": _keygen(site, "pc1", "broker")}
    _install(site, _topology(site, keys, TRAINING))
    planned = site.run("pc1", "plan", "--topology", TOPOLOGY, "--profiles", "/etc/ravq", "--out",
                       "/etc/ravq/plan.yaml", as_user=False)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    broker = site.start_unit("pc1", "ravq-broker.service")
    procs = {pc: site.start_unit(pc, "ravq-node@.service", pc) for pc in TRAINING}
    walk._wait_for("a checkpoint on every PC", lambda: all(
        list(site.path(pc, "/var/lib/ravq/checkpoints").glob("*/*.json")) for pc in TRAINING), WAIT_S, 0.5)
    run_id = _run_id(site)
    print(f"procedures: swarm up {time.monotonic() - t0:.0f} s")

    # Adding a PC as a standby and rotating pc3's key, with the upgrade's rolling restart, in which the
    # broker's PC reboots: a new pair for pc3 beside the old one and pc4's, the new topology on every PC, pc3
    # stopped and its new key moved in, the broker's PC rebooted (the broker and pc1's node stopped and
    # started: the broker's restart, and pc1's), every other node restarted one at a time (each resumes from
    # its checkpoint, as after `pip install --upgrade`), then pc3 started (it resumes too) and the new PC.
    before = _wait_training(site, "every cluster training", TRAINING)  # (`ravq status` as pc3: its old key)
    keys["pc4"] = _keygen(site, "pc4", "pc4")
    keys["pc3"] = _keygen(site, "pc3", "pc3", "/etc/ravq/keys.new")
    old_keys = set(site.path("pc3", "/etc/ravq/keys").iterdir())
    _install(site, _topology(site, keys, PCS))
    assert site.stop(procs["pc3"]) == 0
    for path in site.path("pc3", "/etc/ravq/keys.new").iterdir():  # mv /etc/ravq/keys.new/pc3.* /etc/ravq/keys/
        path.replace(site.path("pc3", "/etc/ravq/keys") / path.name)
    assert set(site.path("pc3", "/etc/ravq/keys").iterdir()) == old_keys
    assert _stop_together([broker, procs["pc1"]]) == [0, 0]  # systemctl reboot on the broker's PC
    broker = site.start_unit("pc1", "ravq-broker.service")
    procs["pc1"] = site.start_unit("pc1", "ravq-node@.service", "pc1")
    _wait_training(site, "training again after the broker's PC rebooted", ["pc1", "pc2"], {"pc1": before["pc1"]})
    _assert_resumed(site, "pc1")
    assert _run_id(site) == run_id  # the broker continued the run
    _restart(site, procs, "pc2", up=["pc1", "pc2"])
    procs["pc3"] = site.start_unit("pc3", "ravq-node@.service", "pc3")
    procs["pc4"] = site.start_unit("pc4", "ravq-node@.service", "pc4")

    def standby_up() -> bool:
        members = (_status(site) or {}).get("members", {})
        return members.get("pc4", {}).get("phase") == "standby" and members.get("pc4", {}).get("state") == "up"

    _wait_training(site, "every cluster training, pc3 with its new key", TRAINING, {"pc3": before["pc3"]})
    _assert_resumed(site, "pc3")
    walk._wait_for("pc4 standing by", standby_up, WAIT_S, 0.5)
    assert _run_id(site) == run_id
    print(f"procedures: upgrade, broker's PC rebooted, a PC added, a key rotated {time.monotonic() - t0:.0f} s")

    # Re-planning so that pc4 trains (cluster 1: pc3 and pc4): other cuts, so a new run that starts from the
    # old run's weights (its export, training.init_from), the old checkpoints and the broker's run state set aside.
    replanned = {**CLUSTERS, "pc4": 1}
    _install(site, _topology(site, keys, PCS, replanned, init_from=START))
    planned = site.run("pc1", "plan", "--topology", TOPOLOGY, "--profiles", "/etc/ravq", "--out",
                       "/etc/ravq/plan.yaml", as_user=False)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    print(f"procedures: re-planned {time.monotonic() - t0:.0f} s")
    assert _stop_together([procs[pc] for pc in PCS]) == [0] * len(PCS)  # systemctl stop 'ravq-node@*'
    gathered = site.path("pc1", "/var/lib/ravq/export/cluster0")  # cluster 0's stages copied to pc1 (scp)
    gathered.mkdir(parents=True)
    for pc in ("pc1", "pc2"):
        for f in site.path(pc, "/var/lib/ravq/checkpoints").glob("cluster0/stage*"):
            shutil.copy(f, gathered)
    os.chown(gathered.parent, site.uid, site.gid)
    exported = site.run("pc1", "export", "--checkpoint-dir", "/var/lib/ravq/export", "--cluster", "0", "--out", START)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    for pc in PCS[1:]:  # scp to every PC
        shutil.copy(site.path("pc1", START), site.path(pc, START))
    for pc in PCS:
        checkpoints = site.path(pc, "/var/lib/ravq/checkpoints")
        checkpoints.rename(checkpoints.with_name("checkpoints.before-replan"))
        checkpoints.mkdir()  # what the unit's StateDirectory= does at start
        os.chown(checkpoints, site.uid, site.gid)
    assert site.stop(broker) == 0
    state = site.path("pc1", "/var/lib/ravq/broker")
    state.rename(state.with_name("broker.before-replan"))
    broker = site.start_unit("pc1", "ravq-broker.service")
    procs = {pc: site.start_unit(pc, "ravq-node@.service", pc) for pc in PCS}
    print(f"procedures: started again {time.monotonic() - t0:.0f} s")
    _wait_training(site, "the new plan training", PCS, where=replanned)
    print(f"procedures: trains {time.monotonic() - t0:.0f} s")
    status = _status(site)
    assert status is not None and [c["nodes"] for c in status["plan"]["clusters"]] == [["pc1", "pc2"], ["pc3", "pc4"]]
    assert _run_id(site) != run_id
    for pc in PCS:  # every stage of the new cuts started from the old run's weights, not from the seed
        assert f"from {site.path(pc, START)})" in (site.root / f"{pc}-ravq-node.log").read_text(), pc
    for pc in TRAINING:  # started after the new topology: nobody's key refused (the logs are of those processes)
        assert "refused a connection" not in (site.root / f"{pc}-ravq-node.log").read_text(), pc
    for proc in (*procs.values(), broker):
        assert site.stop(proc) == 0
    print(f"procedures: re-planned, all stopped {time.monotonic() - t0:.0f} s")
