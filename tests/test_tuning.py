"""ravq.tuning: the process settings a node applies at start."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_tune_process_applies_and_is_idempotent() -> None:
    # In a fresh interpreter: the settings are process-wide and gc.freeze is not undone.
    code = ("import gc; from ravq.tuning import tune_process; "
            "assert tune_process() and tune_process(); assert gc.get_freeze_count() > 0")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


_MMAPPED = """
import ctypes, torch
from ravq.tuning import tune_process
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
assert tune_process()
before = libc.mallinfo2().hblkhd
block = torch.ones(1 << 20)  # 4 MiB
print(libc.mallinfo2().hblkhd - before >= 4 << 20)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
@pytest.mark.parametrize(("env", "mmapped"), [({}, "False"), ({"MALLOC_MMAP_THRESHOLD_": "1048576"}, "True"),
                                              ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"}, "True")])
def test_a_threshold_the_user_set_is_kept(env: dict[str, str], mmapped: str) -> None:
    # tune_process keeps a 4 MiB block in the heap (its 32 MiB mmap threshold) unless the user set one
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _MMAPPED], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == mmapped


_FILES = """
import logging, resource, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from ravq.tuning import allow_open_files
soft, hard = {soft}, {hard}
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print(allow_open_files({needed}, "a broker of 3000 nodes"), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


@pytest.mark.parametrize(("soft", "hard", "needed", "after", "warned"), [
    (512, 4096, 2048, 2048, False),  # raised to what is needed
    (512, 1024, 2048, 1024, True),  # only up to the hard limit, and said
    (4096, 4096, 2048, 4096, False),  # never lowered
])
def test_a_broker_raises_its_open_files_to_what_its_nodes_need(soft: int, hard: int, needed: int, after: int,
                                                               warned: bool) -> None:
    """Past its open-file limit a broker's ZeroMQ listener fails every accept without a word (from a shell
    with the common 1,024, nodes past about 500): the broker raises its soft limit to two connections a node,
    and says so when the hard limit is lower, with the remedy."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < hard:
        pytest.skip("this machine's hard limit on open files is lower than the case's")
    code = _FILES.format(soft=soft, hard=hard, needed=needed)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == [str(after), str(after)], done.stdout
    assert ("needs 2048" in done.stderr and "LimitNOFILE" in done.stderr) == warned, done.stderr
