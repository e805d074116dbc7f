"""Accelerate, 2 CPU processes: `pace launch` with a pacing_config section, plain `accelerate launch`
with PACE_* variables, gradient accumulation, a bad section failing before any worker starts, and
attach_pacing's handle removing every hook it registered (detach, finish, attach again).

The PACE_* parsing itself is tested in tests/unit/test_accelerate_env.py."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pace_strategy.integrations.accelerate import config_from_env
from pace_strategy.telemetry import TAGS, lead_tag, read_run_record
from tests.integration.helpers import ACCELERATE_CPU_CONFIG, read_mlflow, read_scalars, why_failed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "train"
SCRIPT = RECIPES / "accelerate_train.py"
RECIPE = RECIPES / "accelerate_ddp.yaml"


def launch(tmp_path: Path, command: list[str], config: str, *overrides: str, env: dict | None = None):
    """The Accelerate recipe, 40 optimizer steps, rank 1 40 ms late; run record in tmp_path/proj."""
    cfg = tmp_path / "accel.yaml"
    cfg.write_text(config)
    return subprocess.run(
        [
            *command,
            "--config_file",
            str(cfg),
            str(SCRIPT),
            str(RECIPE),
            f"output.root={tmp_path}",
            "output.name=proj",
            "trainer.max_steps=40",
            "straggler.delay_ms=40",
            "data.batch_size=8",
            *overrides,
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=150,
    )


PACE = [sys.executable, "-m", "pace_strategy.cli", "launch"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


def check_straggler(tmp_path: Path, steps: int) -> None:
    scalars = read_scalars(tmp_path / "proj" / "run")
    for tag in (*TAGS, lead_tag(0), lead_tag(1)):
        assert sorted(scalars[tag]) == list(range(steps)), tag
    post = range(5, steps)
    assert sum(scalars["pace/straggler_rank"][s] == 1.0 for s in post) / len(post) >= 0.9
    assert abs(statistics.median(scalars["pace/skew_ms"][s] for s in post) - 40.0) < 12.0


def test_pace_launch_reads_the_pacing_config_section(tmp_path):
    section = "pacing_config:\n  mode: monitor\n  exchange_every_steps: 8\n"
    out = launch(tmp_path, PACE, ACCELERATE_CPU_CONFIG.format(kind="MULTI_CPU") + section, "data.workers=1")
    assert out.returncode == 0, why_failed(out.stderr, 3000)
    check_straggler(tmp_path, 40)
    record = read_run_record(tmp_path / "proj")
    assert record.header["framework"] == "accelerate" and record.header["world_size"] == 2
    # each rank's prepared loader runs one worker process: recorded for the oversubscription check
    assert [t["dataloader_workers"] for t in record.header["topology"]] == [1, 1]
    assert record.header["config"]["exchange_every_steps"] == 8 and record.end["status"] == "completed"


def test_plain_accelerate_launch_with_pace_variables_and_accumulation(tmp_path):
    """Also: accelerate's MLflow tracker (a file store) instead of TensorBoard, the script logging its
    loss every step: the tags reach MLflow (handed over on the training thread) beside the loss."""
    env = {"ACCELERATE_USE_CPU": "1", "PACE_MODE": "monitor", "PACE_EXCHANGE_EVERY_STEPS": "4"}
    config = ACCELERATE_CPU_CONFIG.format(kind="MULTI_GPU")
    overrides = ("trainer.max_steps=10", "trainer.accumulate=4")
    overrides += ("output.logger=mlflow", "output.log_loss=true")
    out = launch(tmp_path, ACCELERATE, config, *overrides, env=env)
    assert out.returncode == 0, why_failed(out.stderr, 3000)
    assert "trained 10 steps" in out.stdout  # 40 micro-batches, 4 per optimizer step
    record = read_run_record(tmp_path / "proj")
    assert record.header["config"]["exchange_every_steps"] == 4
    assert [s["step"] for s in record.steps] == list(range(10))  # only synchronizing steps
    assert all(s["valid"] for s in record.steps)
    assert sorted(read_mlflow(tmp_path / "mlruns", "loss")) == list(range(10))  # the script's own
    for tag in TAGS:
        assert sorted(read_mlflow(tmp_path / "mlruns", tag)) == list(range(10)), tag


def test_bad_pacing_config_fails_at_launch(tmp_path):
    out = launch(
        tmp_path, PACE, ACCELERATE_CPU_CONFIG.format(kind="MULTI_CPU") + "pacing_config:\n  max_delay: 5\n"
    )
    assert out.returncode == 2
    assert "pacing_config" in out.stderr and "Did you mean 'max_delay_ms'?" in out.stderr
    assert not (tmp_path / "proj").exists(), "no worker may start"
    out = launch(
        tmp_path, PACE, ACCELERATE_CPU_CONFIG.format(kind="MULTI_CPU") + "pacing_config:\n  gain: high\n"
    )
    assert out.returncode == 2 and "PacingConfig.gain='high'" in out.stderr


def test_pace_variables_are_parsed_and_checked():
    cfg = config_from_env(
        {"PACE_MODE": "forced", "PACE_MAX_DELAY_MS": "7.5", "PACE_RUN_RECORD": "false", "PACE_HOSTNAME": "x"}
    )
    assert cfg.mode == "forced" and cfg.max_delay_ms == 7.5 and cfg.run_record is False
    assert config_from_env({"PATH": "/bin"}) is None
    with pytest.warns(UserWarning, match="Did you mean 'PACE_MAX_DELAY_MS'"):  # ignored, said
        assert config_from_env({"PACE_MAX_DELAY": "3"}) is None
    with pytest.raises(ValueError, match="PACE_EXCHANGE_EVERY_STEPS='x'"):
        config_from_env({"PACE_EXCHANGE_EVERY_STEPS": "x"})


@pytest.mark.long
def test_the_handle_removes_every_hook_it_registered(tmp_path):
    cfg, script = tmp_path / "accel.yaml", Path(__file__).parent / "accelerate_attach_script.py"
    cfg.write_text(ACCELERATE_CPU_CONFIG.format(kind="MULTI_GPU"))
    out = subprocess.run(
        [*ACCELERATE, "--config_file", str(cfg), str(script), str(tmp_path / "run")],
        env={**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, why_failed(out.stderr, 3000)
    results = [json.loads((tmp_path / "run" / f"result_{rank}.json").read_text()) for rank in (0, 1)]
    for r in results:
        before = r["before"]
        attached = {"forward_pre": 1, "step_post": 1, "grad": 1, "loader": "TimedDataLoaderShard"}
        assert {k: v - before[k] if k != "loader" else v for k, v in r["attached"].items()} == attached
        assert "already paced" in r["twice"]
        assert r["steps"] == 4 and r["steps_after_detach"] == 4  # nothing counted once detached
        assert r["detached"] == before == r["finished"] == r["after_comm"]
        assert r["reattached"] == r["attached"] and r["steps_again"] == 4 and r["steps_comm"] == 4
    first, again, comm = (read_run_record(tmp_path / "run" / d) for d in ("", "again", "comm"))
    assert first.end["status"] == "detached"
    assert again.end["status"] == "completed" and [s["step"] for s in again.steps] == [0, 1, 2, 3]
    assert comm.end["status"] == "completed" and comm.header["config"]["ddp_monitor"] == "comm_hook"
    # end_training without finish: the last window (step 3, after the exchange at step 2) is kept
    assert all(r["steps_ended"] == 4 and r["after_end"] == r["before"] for r in results)
    ended = read_run_record(tmp_path / "run" / "ended")
    assert ended.end["status"] == "completed" and [s["step"] for s in ended.steps] == [0, 1, 2, 3]
