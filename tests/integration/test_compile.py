"""``torch.compile`` with pace_strategy: a compiled DDP model in a plain loop, 2 CPU ranks under
torchrun (``compile_script.py``). Forced pacing leaves the weights bit-identical to the same compiled
model unpaced, and the rank slow in backward is the one measured late."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pace_strategy.telemetry import read_run_record
from tests.integration.compile_script import SLOW_MS
from tests.integration.helpers import free_port, why_failed

pytestmark = [pytest.mark.integration, pytest.mark.long, pytest.mark.timeout(240)]

SCRIPT = Path(__file__).resolve().parent / "compile_script.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compile")
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr"]
    command = [*launch, "127.0.0.1", "--master_port", str(free_port()), str(SCRIPT), str(out)]
    done = subprocess.run(
        command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=220
    )
    assert done.returncode == 0, why_failed(done.stderr, 4000)
    return out


def test_forced_pacing_of_a_compiled_model_leaves_its_weights_bit_identical(run):
    plain, paced = torch.load(run / "plain.pt"), torch.load(run / "paced.pt")
    assert plain.keys() == paced.keys() and len(plain) == 6
    for key in plain:
        assert torch.equal(plain[key], paced[key]), key
    record = read_run_record(run / "record")
    assert max(max(s["ranks"]["delay_ms"]) for s in record.steps) > 1.0, "pacing was never applied"


def test_the_rank_slow_in_backward_of_a_compiled_model_is_measured_late(run):
    steps = [s for s in read_run_record(run / "record").steps if not s["warmup"]]
    assert len(steps) >= 16
    # by medians: one step of a loaded machine may read anything; the injection is every step's
    compute = [statistics.median(s["ranks"]["compute_ms"][r] for s in steps) for r in (0, 1)]
    assert compute[1] - compute[0] > SLOW_MS / 2, compute
    assert statistics.median(s["straggler_rank"] for s in steps) == 1
