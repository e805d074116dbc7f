"""scripts/gpu_check.py without a GPU: every check is skipped, each saying why, and the exit status is 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


@pytest.mark.timeout(60)
def test_without_cuda_every_check_is_skipped_with_its_reason():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU even on a machine that has one
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"SKIP {name}" for name in gpu_check.CHECKS]
    assert all("CUDA is not available: " in line for line in lines), lines
