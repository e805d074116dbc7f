"""scripts/gpu_check.py without a GPU: every check is skipped, each saying why, and the exit status is 0."""

from __future__ import annotations

import os
import subprocess
import sys
import time
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


@pytest.mark.timeout(60)
def test_the_lines_are_written_as_json_under_out(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    import json

    lines = json.loads((tmp_path / "gpu_check.json").read_text())
    printed = [line.split(":")[0] for line in proc.stdout.splitlines()]
    assert [f"{x['status']} {x['check']}" for x in lines] == printed
    assert all(x["detail"].startswith("CUDA is not available: ") for x in lines)


@pytest.mark.timeout(60)
def test_a_job_that_hangs_is_killed_with_every_process_it_started(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    pid_file = tmp_path / "grandchild"
    # a job that starts a child of its own (as Lightning starts its ranks), then hangs
    job = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)"
    )
    assert gpu_check.run_in_own_session([sys.executable, "-c", job], timeout_s=3.0) is None
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is delivered at once; the process may still be a zombie a moment
        state = Path(f"/proc/{grandchild}/stat")
        if not state.exists() or state.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the job's own child {grandchild} outlived it")
    done = gpu_check.run_in_own_session([sys.executable, "-c", "print('ok')"], timeout_s=30.0)
    assert done is not None and done.returncode == 0 and done.stdout == "ok\n"
