"""Run Python as an unprivileged user (the `ravq` service user of the walkthrough; here `nobody`).

The test venv's interpreter may live where that user cannot go (a pyenv under /root); then a system
Python of the same version runs with the venv's packages on its path.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
USER = "nobody"


@functools.cache
def python_for(user: str = USER) -> tuple[str, str] | None:
    """(interpreter, PYTHONPATH) with which ``user`` can import ravq and torch, or None."""
    entry = pwd.getpwnam(user)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    site = sysconfig.get_paths()["purelib"]
    candidates = [(sys.executable, str(REPO)), (shutil.which(f"python{version}") or "", f"{REPO}:{site}"),
                  (f"/usr/bin/python{version}", f"{REPO}:{site}")]
    for exe, path in candidates:
        if not exe:
            continue
        try:
            probe = subprocess.run([exe, "-c", "import ravq.node"], env={**os.environ, "PYTHONPATH": path},
                                   user=entry.pw_uid, group=entry.pw_gid, extra_groups=[], capture_output=True,
                                   timeout=120, check=False, cwd="/")
        except (PermissionError, FileNotFoundError):
            continue
        if probe.returncode == 0:
            return exe, path
    return None


@contextlib.contextmanager
def traversable_tmp(prefix: str = "rq13-") -> Iterator[Path]:
    """A temporary directory other users can reach (pytest's tmp_path sits under a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
