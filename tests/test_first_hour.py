"""A new user's first hour: the commands before training starts give one-line answers that say what
to do, `ravq status` and `ravq keygen` never import torch, and keys work for the service user."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ravq.cli.status import format_status, status_identity
from ravq.config import ConfigError, parse_topology
from ravq.net.security import keygen, load_secret
from tests.service_user import python_for, traversable_tmp

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _topology(key_dir: Path | None = None, curve: bool = True) -> dict:
    nodes = [{"name": f"pc{i}", "host": "127.0.0.1", "pipeline_port": 7000 + 2 * i, "ring_port": 7001 + 2 * i}
             for i in range(2)]
    data = {"task": "tests.tasks_for_tests", "broker": {"host": "127.0.0.1", "pub_port": 7100, "router_port": 7101},
            "nodes": nodes}
    if curve:
        assert key_dir is not None
        data["security"] = {"curve": True, "key_dir": str(key_dir)}
        data["broker"]["public_key"] = "0" * 40
        for n in nodes:
            n["public_key"] = "0" * 40
    return data


def test_status_of_a_two_stage_cluster_formats_missing_values() -> None:
    status = {"seq": 7, "run_id": "r1", "plan": {"clusters": [{"nodes": ["pc0", "pc1"]}]},
              "members": {"pc0": {"state": "up", "stats": {"cluster": 0, "stage": 0, "version": 3, "samples": 48,
                                                           "busy_fraction": 0.5, "staleness_mean": 1.0,
                                                           "loss": None}},
                          "pc1": {"state": "lost", "stats": {"cluster": 0, "stage": 1, "loss": 2.5,
                                                             "staleness_mean": None, "failure": "peer gone"}},
                          "pc2": {"state": "new", "stats": None}}}
    text = format_status(status)
    lines = text.splitlines()
    assert "pc0 -> pc1" in lines[0] and "run r1" in lines[0]
    assert lines[2].split()[-1] == "-" and "2.500" in lines[3] and "failure: peer gone" in text
    assert lines[-1].startswith("pc2")


def test_status_uses_the_key_found_on_this_pc(tmp_path: Path) -> None:
    topo = parse_topology(_topology(tmp_path), resolve_task=False)
    with pytest.raises(ConfigError, match="no secret key of the broker or of any node"):
        status_identity(topo, None, None)
    keygen("pc1", tmp_path)
    assert status_identity(topo, None, None) == ("pc1", str(tmp_path))  # a node's PC
    keygen("broker", tmp_path)
    assert status_identity(topo, None, None) == ("broker", str(tmp_path))  # the broker's PC
    assert status_identity(topo, None, "pc1") == ("pc1", str(tmp_path))


_NO_TORCH = textwrap.dedent("""
    import sys
    from ravq.cli.main import main
    code = main(sys.argv[1:])
    print("exit", code, "torch imported" if "torch" in sys.modules else "no torch")
""")


def _cli(*args: str, user: int | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _NO_TORCH, *args], capture_output=True, text=True, env=ENV,
                          timeout=120, check=False, user=user)


def test_keygen_and_status_never_import_torch(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    proc = _cli("keygen", "pc0", "--key-dir", str(keys))
    assert proc.stdout.strip().endswith("exit 0 no torch"), proc.stdout + proc.stderr
    import yaml

    path = tmp_path / "t.yaml"
    data = _topology(curve=False)
    data["task"] = "ravq.tasks.charlm"  # a task that imports torch: status must not import it
    path.write_text(yaml.safe_dump(data))
    proc = _cli("status", "--topology", str(path), "--timeout", "0.3")
    assert proc.stdout.strip().endswith("exit 1 no torch"), proc.stdout + proc.stderr
    assert "did not answer within" in proc.stderr and "Traceback" not in proc.stderr


def test_status_without_a_usable_key_is_one_line(tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(_topology(tmp_path / "keys")))
    proc = _cli("status", "--topology", str(path), "--timeout", "0.3")
    assert proc.stdout.strip().endswith("exit 2 no torch"), proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "--name NODE" in line
    keygen("pc0", tmp_path / "keys")  # a key pair, but not the one the topology lists
    proc = _cli("status", "--topology", str(path), "--timeout", "0.3")
    (line,) = proc.stderr.strip().splitlines()
    assert "is not the key the topology lists for 'pc0'" in line and "--key-dir DIR --name NODE" in line


def test_broker_without_its_plan_file_says_how_to_make_it(tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(_topology(curve=False)))
    proc = subprocess.run([sys.executable, "-m", "ravq", "broker", "--topology", str(path), "--plan",
                           str(tmp_path / "plan.yaml")], capture_output=True, text=True, env=ENV, timeout=120,
                          check=False)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "file not found" in line and f"--out {tmp_path / 'plan.yaml'}" in line


# --- key permissions for the service user --------------------------------------------------------

def test_a_secret_owned_by_someone_else_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keygen("pc0", tmp_path)
    monkeypatch.setattr(os, "geteuid", lambda: 4242)  # not the owner, and not root
    with pytest.raises(ValueError, match=r"owned by .*, not by uid 4242 who runs ravq.*chown uid 4242: "):
        load_secret("pc0", tmp_path)


def test_a_group_readable_secret_says_chmod(tmp_path: Path) -> None:
    keygen("pc0", tmp_path)
    (tmp_path / "pc0.key_secret").chmod(0o640)
    with pytest.raises(ValueError, match=r"mode 0640.*chmod 600"):
        load_secret("pc0", tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make keys for another user")
def test_keygen_owner_makes_keys_the_service_user_can_use() -> None:
    with traversable_tmp() as tmp_path:
        _keygen_owner(tmp_path)


def _keygen_owner(tmp_path: Path) -> None:
    """As the walkthrough does it: root makes the pair for the user the units run as (here nobody)."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    keys = tmp_path / "keys"
    proc = subprocess.run([sys.executable, "-m", "ravq", "keygen", "pc0", "--key-dir", str(keys), "--owner", "nobody"],
                          capture_output=True, text=True, env=ENV, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "owner nobody" in proc.stdout
    for path in (keys, keys / "pc0.key_secret", keys / "pc0.key"):
        assert path.stat().st_uid == nobody.pw_uid
    assert (keys / "pc0.key_secret").stat().st_mode & 0o777 == 0o600
    check = textwrap.dedent(f"""
        from ravq.net.security import load_secret
        print(load_secret("pc0", {str(keys)!r})[0])
    """)
    found = python_for("nobody")
    if found is None:
        pytest.skip("no Python that user nobody can run with this venv's packages")
    exe, path = found
    env = {**os.environ, "PYTHONPATH": path}
    as_nobody = subprocess.run([exe, "-c", check], capture_output=True, text=True, env=env, timeout=120,
                               check=False, user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[], cwd="/")
    assert as_nobody.returncode == 0, as_nobody.stderr
    # root-owned keys (made without --owner) give the service user one line that says what to do
    root_keys = tmp_path / "root-keys"
    keygen("pc1", root_keys)
    check = textwrap.dedent(f"""
        from ravq.net.security import load_secret
        try:
            load_secret("pc1", {str(root_keys)!r})
        except ValueError as err:
            print(err)
    """)
    as_nobody = subprocess.run([exe, "-c", check], capture_output=True, text=True, env=env, timeout=120,
                               check=False, user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[], cwd="/")
    assert "permission denied" in as_nobody.stdout and "chown nobody:" in as_nobody.stdout, as_nobody.stdout


# --- silent mistakes -----------------------------------------------------------------------------

def test_cuda_on_a_cpu_only_pc_is_a_one_line_config_error(tmp_path: Path) -> None:
    import torch
    import yaml

    if torch.cuda.is_available():
        pytest.skip("this PC has a GPU")
    data = _topology(curve=False)
    data["nodes"][1]["device"] = "cuda"
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(data))
    for command in (["node", "--topology", str(path), "--name", "pc1"],
                    ["profile", "--topology", str(path), "--name", "pc1", "--peers-wait", "1"]):
        proc = subprocess.run([sys.executable, "-m", "ravq", *command], capture_output=True, text=True, env=ENV,
                              timeout=120, check=False)
        assert proc.returncode == 2, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert "nodes[1].device: 'cuda' for pc1" in line and "set device: cpu" in line


def test_cpu_budget_follows_the_cgroup_quota(tmp_path: Path) -> None:
    from ravq.tuning import cpu_budget

    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "self").write_text("0::/system.slice/ravq-node@pc1.service\n")
    unit = tmp_path / "fs" / "system.slice" / "ravq-node@pc1.service"
    unit.mkdir(parents=True)
    (tmp_path / "fs" / "system.slice" / "cpu.max").write_text("max 100000\n")
    (unit / "cpu.max").write_text("150000 100000\n")  # CPUQuota=150%
    assert cpu_budget(str(tmp_path / "fs"), str(tmp_path / "self")) == min(affinity, 2)
    (unit / "cpu.max").write_text("50000 100000\n")
    assert cpu_budget(str(tmp_path / "fs"), str(tmp_path / "self")) == 1
    (unit / "cpu.max").write_text("max 100000\n")
    assert cpu_budget(str(tmp_path / "fs"), str(tmp_path / "self")) == affinity
    # cgroup v1
    (tmp_path / "self").write_text("1:cpu,cpuacct:/lxc/box\n")
    v1 = tmp_path / "fs" / "cpu,cpuacct" / "lxc" / "box"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_budget(str(tmp_path / "fs"), str(tmp_path / "self")) == 1


def test_an_override_that_idles_the_others_is_warned() -> None:
    from ravq.checks import override_warnings
    from ravq.config import Plan
    from ravq.planner import NodeProfile

    data = _topology(curve=False)
    data["nodes"].append({"name": "pc2", "host": "127.0.0.1", "pipeline_port": 7010, "ring_port": 7011,
                          "flops": 2e12})
    topo = parse_topology(data, resolve_task=False)
    profiles = [NodeProfile(name=n.name, flops=2e12 if n.name == "pc2" else 5e10, memory_bytes=8 << 30,
                            bandwidth_bytes_per_s={}, latency_s={}) for n in topo.nodes]
    (warning,) = override_warnings(topo, Plan(clusters=[{"nodes": ["pc2"]}]), profiles)
    assert "2 node(s) idle (pc0, pc1)" in warning and "pc2 (flops: 2e+12, 40x the largest other node's)" in warning
    assert override_warnings(topo, Plan(clusters=[{"nodes": ["pc0", "pc1", "pc2"], "cuts": ["a", "b"]}]),
                             profiles) == []


class _Clock:
    """A clock that moves only when slept on: the view's polls, without their wall-clock time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _FakeSwarm:
    def __init__(self, polls: int) -> None:
        self.polls = polls

    def running(self) -> list[str]:
        self.polls -= 1
        return ["n"] if self.polls > 0 else []

    def failed(self) -> list[str]:
        return []


def test_demo_timeout_stops_a_stalled_run_never_a_progressing_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import ravq.cli.demo_view
    from ravq.cli.demo_view import LiveView

    topo = parse_topology(_topology(curve=False), resolve_task=False)
    counter = iter(range(1000))
    monkeypatch.setattr(ravq.cli.demo_view, "status_once", lambda *a, **k: {
        "members": {"n": {"stats": {"forwards": next(counter), "backwards": 0}}}})
    clock = _Clock()
    assert LiveView(topo, quiet=True, key_dir=None, clock=clock, sleep=clock.sleep).follow(_FakeSwarm(6), 0.8)
    assert clock.now == 2.5  # progressing at every poll for longer than 0.8 s, and never cut short
    monkeypatch.setattr(ravq.cli.demo_view, "status_once", lambda *a, **k: {
        "members": {"n": {"stats": {"forwards": 5, "backwards": 5}}}})
    clock = _Clock()
    assert not LiveView(topo, quiet=True, key_dir=None, clock=clock, sleep=clock.sleep).follow(_FakeSwarm(100), 0.8)
    assert clock.now == 1.0  # stopped at the first poll more than 0.8 s after the last progress
