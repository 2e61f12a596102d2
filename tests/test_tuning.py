"""ravq.tuning: the process settings a node applies at start."""

from __future__ import annotations

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
