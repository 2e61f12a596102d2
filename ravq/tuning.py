"""Process-wide settings a node (or broker) applies once at start, before it allocates big buffers.

ZeroMQ's I/O thread allocates every received frame with ``malloc``, and Python frees it in the event
loop's thread when the tensor made over it goes away.  glibc serves blocks above its mmap threshold
(128 KiB, raised dynamically up to 32 MiB) with a fresh ``mmap`` and returns freed heap above its trim
threshold to the kernel, so a stream of 1 MiB or 16 MiB frames keeps touching fresh memory: one page
fault and one kernel page clear per 4 KiB, in the I/O thread, plus an ``munmap`` per frame in the
event loop.  On loopback that was a third of a receiver's CPU time.  Keeping such blocks in the heap
makes a frame's buffer a recycled one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import math
import os
import resource
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks below this come from the heap; glibc refuses more than 32 MiB (HEAP_MAX_SIZE / 2) on 64-bit."""
TRIM_THRESHOLD_BYTES = 1 << 30
"""Freed heap kept for reuse instead of being returned to the kernel."""

_tuned = False


def tune_process(env: Mapping[str, str] | None = None) -> bool:
    """Keep large freed blocks for reuse and move start-up objects out of the garbage collector's way.

    Idempotent; returns whether glibc's malloc accepted the settings (False elsewhere, e.g. musl).
    ``gc.freeze`` moves everything made so far (torch's import is ~10^5 objects) to a generation that
    full collections skip, so a node's periodic collections stay cheap.  A threshold the user set for
    glibc (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or ``GLIBC_TUNABLES``' ``glibc.malloc.*``
    in ``env``, the process's environment by default) is left as set: a heap that keeps freed blocks holds
    1-2 stages of memory it cannot reuse (docs/convergence.md, "Memory (session 11)"), and
    ``MALLOC_MMAP_THRESHOLD_=1048576`` trades that for a page fault per 4 KiB of every big tensor.
    """
    global _tuned
    if _tuned:
        return True
    gc.freeze()
    settings = [(option, value) for option, value, name in _SETTINGS if not _user_set(name, env)]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        accepted = [libc.mallopt(option, value) for option, value in settings]  # each, not up to a refusal
        ok = all(accepted)
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.info("malloc tuning not applied (not glibc?); large messages will cost more page faults")
    elif len(settings) < len(_SETTINGS):
        log.info("malloc: the thresholds set in the environment are kept")
    _tuned = ok
    return ok


BROKER_FILES_PER_NODE = 2
"""Connections a broker holds per node of the topology: the node's DEALER and its SUB."""
SPARE_FILES = 256
"""Files a process holds besides its peers' connections (ZeroMQ's own, logs, metrics, ``ravq status``)."""


def allow_open_files(needed: int, what: str) -> int:
    """Raise this process's soft limit on open files to ``needed`` where the hard limit allows; the soft limit
    after.  A broker holds a connection per node and socket, and past its limit ZeroMQ's listener fails every
    accept without a word: started from a shell with the common 1,024, a broker would refuse nodes past about
    500.  A hard limit under ``needed`` is logged (``what`` says for what) with the remedy."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    target = needed if hard == unlimited else min(needed, hard)
    if soft != unlimited and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if hard != unlimited and hard < needed:
        log.warning("open files: %s needs %d, and this process may have only %d (the hard limit): raise it "
                    "(LimitNOFILE= in its systemd unit, or ulimit -Hn as root)", what, needed, hard)
    return soft


_SETTINGS = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES, "mmap_threshold"),
             (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES, "trim_threshold"))


def _user_set(name: str, env: Mapping[str, str] | None) -> bool:
    """Whether ``env`` sets glibc's malloc threshold ``name`` (``mmap_threshold``, ``trim_threshold``)."""
    env = os.environ if env is None else env
    tunables = env.get("GLIBC_TUNABLES", "")
    return f"MALLOC_{name.upper()}_" in env or f"glibc.malloc.{name}=" in tunables


def cpu_budget(cgroup_fs: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> int:
    """CPUs this process may use: its affinity, capped by a cgroup CPU quota (systemd CPUQuota=,
    containers).  torch sizes its thread pool by the machine's cores and ignores both, so a node in a
    2-CPU cgroup on a 16-core PC would run 16 threads that take turns."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota(Path(cgroup_fs), Path(self_cgroup))
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota - 1e-9)))
    return max(1, cpus)


def _cgroup_cpu_quota(root: Path, self_cgroup: Path) -> float | None:
    """The tightest CPU quota (in CPUs) on this process's cgroup and its ancestors, or None."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2: cpu.max = "QUOTA PERIOD" or "max PERIOD"
            parts = Path(path.lstrip("/")).parts
            for depth in range(len(parts), -1, -1):
                text = _read(root / Path(*parts[:depth]) / "cpu.max")
                if text and not text.startswith("max"):
                    quota, period = text.split()[:2]
                    limits.append(int(quota) / int(period))
        elif "cpu" in controllers.split(","):  # cgroup v1
            for base in (root / "cpu,cpuacct", root / "cpu"):
                quota_text = _read(base / path.lstrip("/") / "cpu.cfs_quota_us") or _read(
                    base / "cpu.cfs_quota_us"
                )
                period_text = _read(base / path.lstrip("/") / "cpu.cfs_period_us") or _read(
                    base / "cpu.cfs_period_us"
                )
                if quota_text and period_text and int(quota_text) > 0:
                    limits.append(int(quota_text) / int(period_text))
                    break
    return min(limits) if limits else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return None


def peak_rss_bytes(status: str = "/proc/self/status") -> int | None:
    """This process's peak resident memory (Linux's VmHWM), or None where the kernel does not say."""
    return status_bytes("VmHWM", status)


def rss_bytes(status: str = "/proc/self/status") -> int | None:
    """This process's resident memory now (Linux's VmRSS), or None where the kernel does not say."""
    return status_bytes("VmRSS", status)


def status_bytes(field: str, status: str = "/proc/self/status") -> int | None:
    """A size in kB from ``/proc/self/status`` (VmHWM, VmRSS, ...) in bytes, or None."""
    try:
        for line in Path(status).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


MEMORY_HEADROOM = 0.1
"""Share of free memory a node leaves unused (the profiler's and a standby's usable memory)."""


def usable_memory_bytes(device: str = "cpu", meminfo: str = "/proc/meminfo",
                        cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """Free device memory (cuda) or MemAvailable (otherwise), less MEMORY_HEADROOM.  On a CPU the memory
    cgroup's limit less its usage caps it when lower (a container or a systemd MemoryMax= limit)."""
    if device.startswith("cuda"):
        import torch  # only for a GPU: this module stays light

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free * (1 - MEMORY_HEADROOM))
    available = None
    for line in Path(meminfo).read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        raise RuntimeError(f"{meminfo} has no MemAvailable line")
    limited = cgroup_memory_free(cgroup_root, proc_cgroup)
    return int(min(available, limited if limited is not None else available) * (1 - MEMORY_HEADROOM))


def cgroup_memory_free(
    cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
) -> int | None:
    """Limit less usage of this process's memory cgroup (v1 ``memory.limit_in_bytes`` or v2
    ``memory.max``), or None when it has no limit or no such file can be read."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            group, limit_file, usage_file = (
                Path(cgroup_root, "memory", path.lstrip("/")),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        elif controllers == "":
            group, limit_file, usage_file = (
                Path(cgroup_root, path.lstrip("/")),
                "memory.max",
                "memory.current",
            )
        else:
            continue
        try:
            limit_text = (group / limit_file).read_text().strip()
            usage = int((group / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= 1 << 60:  # v1 reports "no limit" as a huge number
            continue
        return max(0, int(limit_text) - usage)
    return None
