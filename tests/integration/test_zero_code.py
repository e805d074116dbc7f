"""Zero-code pacing, 2 CPU processes: scripts with nothing of pace_strategy in them, started by `pace
launch` with a pacing_config section (paced, telemetry in the script's own TensorBoard logs) and by
plain `accelerate launch` (left alone). An Accelerate loop with gradient accumulation and a
transformers.Trainer (tiny BERT from a config, report_to tensorboard and mlflow, gradient accumulation
2).

The four launches start together (module fixture) and overlap: most of their time is imports.
Explicit attach_pacing under `pace launch` (taking over the automatic attach) runs in
tests/integration/test_accelerate.py, whose recipe calls it; the parts are unit-tested in
tests/unit/test_zero_code.py and tests/unit/test_pacing_callback.py."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pace_strategy.telemetry import TAGS, read_run_record
from tests.integration.helpers import (
    ACCELERATE_CPU_CONFIG,
    check_dashboard,
    free_port,
    parse_metrics,
    read_mlflow,
    read_scalars,
    why_failed,
)

pytestmark = [pytest.mark.integration, pytest.mark.alone, pytest.mark.timeout(150)]

HERE = Path(__file__).resolve().parent
PACING = "pacing_config:\n  mode: monitor\n  exchange_every_steps: 4\n  warmup_steps: 2\n"
PACE = [sys.executable, "-m", "pace_strategy.cli", "launch"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


#: name -> launcher, accelerate config, script, its arguments after OUT_DIR, extra environment

#: rank 0 of the paced accelerate launch serves Prometheus metrics here (pacing_config: metrics_port)
SCRAPE_PORT, TRAINER_SCRAPE_PORT = free_port(), free_port()
LAUNCHES = {
    "accelerate": (
        PACE,
        ACCELERATE_CPU_CONFIG.format(kind="MULTI_CPU") + PACING + f"  metrics_port: {SCRAPE_PORT}\n",
        "zero_code_accelerate_script.py",
        "12",
        {"SCRAPE_PORT": str(SCRAPE_PORT)},
    ),
    "plain": (
        ACCELERATE,
        ACCELERATE_CPU_CONFIG.format(kind="MULTI_GPU"),
        "zero_code_accelerate_script.py",
        "2",
        {"ACCELERATE_USE_CPU": "1", "PACE_MODE": "monitor"},  # PACE_* alone attach nothing
    ),
    "trainer": (
        PACE,
        ACCELERATE_CPU_CONFIG.format(kind="MULTI_CPU") + PACING + f"  metrics_port: {TRAINER_SCRAPE_PORT}\n",
        "zero_code_trainer_script.py",
        "8",
        # and reports to MLflow (a file store in the launch's directory) beside TensorBoard
        {
            "SCRAPE_PORT": str(TRAINER_SCRAPE_PORT),
            "MLFLOW_TRACKING_URI": "file://{dir}/mlruns",
            "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 refuses a file store without it
        },
    ),
    "trainer-late": (
        PACE,
        ACCELERATE_CPU_CONFIG.format(kind="MULTI_CPU") + PACING,
        "zero_code_trainer_script.py",
        "8",
        {"ZERO_CODE_TRAINER_MODE": "late"},
    ),
}


class Launch:
    def __init__(self, root: Path, name: str) -> None:
        command, config, script, steps, env = LAUNCHES[name]
        self.dir = root / name
        self.dir.mkdir()
        (self.dir / "accel.yaml").write_text(config)
        self.out = self.dir / "out"
        self._process = subprocess.Popen(
            [
                *command,
                # the three launches run at once: each its own free port, not accelerate's 29500
                "--main_process_port",
                str(free_port()),
                "--config_file",
                str(self.dir / "accel.yaml"),
                str(HERE / script),
                str(self.out),
                steps,
            ],
            env={**os.environ, "OMP_NUM_THREADS": "1", **{k: v.format(dir=self.dir) for k, v in env.items()}},
            cwd=self.dir,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def result(self) -> str:
        """The launch's stdout, once it has ended successfully."""
        try:
            stdout, stderr = self._process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self._process.kill()
            stdout, stderr = self._process.communicate()
        assert self._process.returncode == 0, why_failed(stderr, 4000)
        return stdout

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.communicate()


#: the launch each test reads: the fixture starts, all at once, only those of the selected tests (the
#: long one's is not started by ``make test``)
USES = {
    "test_an_unchanged_accelerate_script_is_paced_by_pace_launch": "accelerate",
    "test_plain_accelerate_launch_leaves_the_same_script_alone": "plain",
    "test_an_unchanged_trainer_script_gets_pace_tags_in_its_tensorboard_logs": "trainer",
    "test_the_trainer_s_pace_tags_go_to_mlflow_too": "trainer",
    "test_a_rank_late_to_the_trainer_s_pre_step_gather_is_the_straggler": "trainer-late",
}


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("zero_code")
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    assert selected <= set(USES), selected - set(USES)  # a new test names its launch here
    started = {name: Launch(root, name) for name in LAUNCHES if name in {USES[t] for t in selected}}
    yield started
    for launch in started.values():
        launch.stop()


#: how late rank 1 is per optimizer step in both scripts (a sleep before or inside its forwards)
LATE_MS = 40.0


def check_straggler(record, steps: int) -> None:
    assert record.end["status"] == "completed" and record.header["world_size"] == 2
    assert [s["step"] for s in record.steps] == list(range(steps))  # one per optimizer step
    measured = [s for s in record.steps if not s["warmup"]]
    assert sum(s["straggler_rank"] == 1 for s in measured) >= 0.8 * len(measured)
    # rank 1 is 40 ms late per step; three launches (six ranks) share 2 cores, so rank 0's own compute
    # is slowed too and the skew lands below the injection (22.7 ms at the median in one full run):
    # bounded by the injection, at least a quarter of it (no injection: ~1 ms), at most twice
    assert 0.25 * LATE_MS < statistics.median(s["skew_ms"] for s in measured) < 2 * LATE_MS


def check_scraped(stdout: str, steps: int = 4) -> None:
    """The script's rank 0 scraped its own Prometheus endpoint during the run: rank 1 the straggler."""
    scraped = parse_metrics(stdout, prefix="scraped ")
    assert scraped["pace_straggler_rank"] == 1.0 and scraped["pace_steps_total"] >= steps, scraped
    assert scraped['pace_lead_ms{rank="1"}'] == 0.0 and scraped['pace_lead_ms{rank="0"}'] > 10.0, scraped


@pytest.mark.long
def test_an_unchanged_accelerate_script_is_paced_by_pace_launch(launches):
    launch = launches["accelerate"]
    stdout = launch.result()
    assert "prepare wrapped: True" in stdout and "trained 12 steps" in stdout
    record = read_run_record(launch.out)  # the accelerator's logging_dir
    assert record.header["config"]["exchange_every_steps"] == 4
    check_straggler(record, 12)  # 24 micro-batches, accumulation 2: 12 steps
    scalars = read_scalars(launch.out / "run")  # the script's own TensorBoard tracker
    check_dashboard(launch.out / "run")
    check_scraped(stdout)  # rank 0's Prometheus endpoint, read over HTTP before end_training
    assert all(sorted(scalars[tag]) == list(range(12)) for tag in TAGS)


def test_plain_accelerate_launch_leaves_the_same_script_alone(launches):
    launch = launches["plain"]
    stdout = launch.result()
    assert "prepare wrapped: False" in stdout and "pace_strategy loaded: False" in stdout
    assert "trained 2 steps" in stdout and not list(launch.out.rglob("pace_run.jsonl"))
    assert not any(tag.startswith("pace/") for tag in read_scalars(launch.out / "run"))


def test_an_unchanged_trainer_script_gets_pace_tags_in_its_tensorboard_logs(launches):
    launch = launches["trainer"]
    stdout = launch.result()
    assert "'TensorBoardCallback'" in stdout and "'PacingCallback'" in stdout
    (log_dir,) = (launch.out / "runs").iterdir()  # the Trainer's TensorBoard directory
    check_straggler(read_run_record(log_dir), 8)  # 16 micro-batches, accumulation 2: 8 steps
    scalars = read_scalars(log_dir)
    check_dashboard(log_dir)
    # At the Trainer's global_step, beside its loss (the last window, published after the Trainer
    # closed its writer, is in a second event file in the same directory).
    assert sorted(scalars["train/loss"]) == list(range(1, 9))
    assert all(sorted(scalars[tag]) == list(range(1, 9)) for tag in TAGS)
    assert statistics.median(scalars["pace/straggler_rank"].values()) == 1.0
    check_scraped(stdout)


def test_the_trainer_s_pace_tags_go_to_mlflow_too(launches):
    """report_to=["tensorboard", "mlflow"], a file store: the tags reach MLflow through its own
    callback at the Trainer's global steps, in order, the last window's included (the Trainer ends
    its MLflow run in on_train_end, before pacing's callback: pacing finishes at the last step), and
    the Trainer's loss, logged at every step, is all there beside them."""
    launch = launches["trainer"]
    launch.result()
    store = launch.dir / "mlruns"
    assert sorted(read_mlflow(store, "loss")) == list(range(1, 9))  # the Trainer's own metric, untouched
    for tag in TAGS:
        assert sorted(read_mlflow(store, tag)) == list(range(1, 9)), tag
    assert statistics.median(read_mlflow(store, "pace/straggler_rank").values()) == 1.0


def test_a_rank_late_to_the_trainer_s_pre_step_gather_is_the_straggler(launches):
    # Rank 1 starts each step 40 ms late; rank 0 waits for it in the Trainer's label-count gather
    # before the step, and both reach the gradient sync together. The gather is timed as a sync
    # point of the step: rank 0's wait there is its wait, so rank 1 is named.
    launch = launches["trainer-late"]
    launch.result()
    (log_dir,) = (launch.out / "runs").iterdir()
    record = read_run_record(log_dir)
    check_straggler(record, 8)
    early = [s["ranks"]["wait_ms"][0] - s["ranks"]["wait_ms"][1] for s in record.steps if not s["warmup"]]
    # rank 0 waited, at the gather, for rank 1: by the injection, within check_straggler's bounds (the
    # launches beside it slow rank 0's own work too: 23.6 ms at the median in one run, 9.5-51 per step)
    assert 0.25 * LATE_MS < statistics.median(early) < 2 * LATE_MS, early
