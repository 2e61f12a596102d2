"""The systemd units' own command lines, run on namespaced "PCs" as the unprivileged user they run as
(``nobody`` here, ``ravq`` in deploy/README.md): shared by the walkthrough (tests/test_walkthrough.py)
and the emulated-NAT test (tests/test_nat_netns.py).

Every PC's /etc/ravq, /var/lib/ravq and /var/cache/ravq live under a temporary root of its own; the
units' ExecStart, Environment and WorkingDirectory are read from deploy/systemd and moved there.
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

from tests.service_user import USER, python_for

UNITS = Path(__file__).resolve().parents[1] / "deploy" / "systemd"


def unit_exec(unit: str) -> tuple[list[str], dict[str, str], str]:
    """(ExecStart argv, Environment, WorkingDirectory) of a unit file, as systemd would run them."""
    argv: list[str] = []
    env: dict[str, str] = {}
    cwd = "/"
    for line in (UNITS / unit).read_text().splitlines():
        key, _, value = line.strip().partition("=")
        if key == "ExecStart" and value:
            argv = shlex.split(value)
        elif key == "Environment":
            name, _, val = value.partition("=")
            env[name] = val
        elif key == "WorkingDirectory":
            cwd = value
    return argv, env, cwd


def restart_delay_s(unit: str) -> float:
    """The unit's RestartSec (seconds), what systemd waits before starting a failed unit again."""
    for line in (UNITS / unit).read_text().splitlines():
        key, _, value = line.strip().partition("=")
        if key == "RestartSec":
            return float(value.rstrip("s"))
    return 0.1  # systemd's default


def unavailable_reason() -> str | None:
    """Why units cannot run as the service user here (None: they can)."""
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) not found"
    if python_for(USER) is None:
        return f"no Python that user {USER} can run with this venv's packages"
    return None


class Site:
    """The PCs: their namespaces and addresses, file trees under one root, and the processes started."""

    def __init__(self, root: Path, ns: Mapping[str, str], addr: Mapping[str, str]) -> None:
        python = python_for(USER)
        assert python is not None, unavailable_reason()
        self.root, self.python, self.procs = root, python, []
        self.ns, self.addr = dict(ns), dict(addr)
        user = pwd.getpwnam(USER)
        self.uid, self.gid = user.pw_uid, user.pw_gid
        for pc in self.ns:  # what the README's install step makes: /etc/ravq and the units' state directories
            for d in ("etc/ravq", "var/lib/ravq/checkpoints", "var/cache/ravq"):
                (self.path(pc, "/" + d)).mkdir(parents=True, exist_ok=True)
            for d in ("var/lib/ravq", "var/lib/ravq/checkpoints", "var/cache/ravq"):
                os.chown(self.path(pc, "/" + d), self.uid, self.gid)

    def path(self, pc: str, absolute: str) -> Path:
        """Where PC ``pc``'s file ``absolute`` lives in this test."""
        return self.root / pc / absolute.lstrip("/")

    def _move(self, pc: str, arg: str) -> str:
        for prefix in ("/etc/ravq", "/var/lib/ravq", "/var/cache/ravq"):
            if arg.startswith(prefix):
                return str(self.path(pc, arg))
        return arg

    def command(self, pc: str, argv: list[str], as_user: bool = True) -> list[str]:
        """``argv`` (starting with ``ravq``) run on ``pc`` as the service user."""
        exe, _ = self.python
        assert Path(argv[0]).name == "ravq", argv
        args = [exe, "-m", "ravq", *(self._move(pc, a) for a in argv[1:])]
        drop = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--"] if as_user else []
        return ["ip", "netns", "exec", self.ns[pc], *drop, *args]

    def env(self, pc: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        moved = {k: self._move(pc, v) for k, v in (extra or {}).items()}
        return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": self.python[1], "OMP_NUM_THREADS": "1",
                "HOME": "/nonexistent", **moved}

    def run(self, pc: str, *argv: str, timeout: float = 120, as_user: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(pc, ["ravq", *argv], as_user), capture_output=True, text=True,
                              env=self.env(pc), timeout=timeout, check=False, cwd=self.root)

    def log_path(self, pc: str, unit: str) -> Path:
        """Where a unit's output goes (its journal, this start's only: a restart writes it anew)."""
        return self.root / f"{pc}-{unit.split('@')[0].split('.')[0]}.log"

    def start_unit(self, pc: str, unit: str, instance: str = "",
                   env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """``unit`` (``instance`` for a template) on ``pc``; ``env``: a drop-in's extra Environment=."""
        argv, unit_env, cwd = unit_exec(unit)
        argv = [a.replace("%i", instance) for a in argv]
        env = {k: v.replace("%i", instance) for k, v in {**unit_env, **(env or {})}.items()}
        log = open(self.log_path(pc, unit), "wb")  # noqa: SIM115 - the process keeps it
        proc = subprocess.Popen(self.command(pc, argv), stdout=log, stderr=subprocess.STDOUT, env=self.env(pc, env),
                                cwd=self.path(pc, cwd))
        log.close()
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
        """systemctl stop: SIGTERM (KillMode=mixed: the main process), then SIGKILL after the timeout."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
