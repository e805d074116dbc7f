"""Run the demo and recipe training scripts in real processes and read back what they wrote."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pace_strategy.cli import main as cli_main
from tests.integration.preloaded import run_python


def demo_command(tmp_path: Path, *args: str) -> list[str]:
    """``pace demo ARGS`` with logs under ``tmp_path/runs``."""
    return [sys.executable, "-m", "pace_strategy", "demo", "--root", str(tmp_path / "runs"), *args]


def run_demo(tmp_path: Path, *args: str, timeout: float = 150.0) -> subprocess.CompletedProcess[str]:
    """``pace demo ARGS``, forked from a process that has imported Lightning (preloaded.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return run_python(demo_command(tmp_path, *args)[1:], cwd=tmp_path, env=env, timeout=timeout)


RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "train"

#: an accelerate config for 2 CPU processes on this machine; ``kind``: MULTI_CPU (``pace launch``
#: rewrites it) or MULTI_GPU (with use_cpu, what accelerate 1.x needs for CPU workers)
ACCELERATE_CPU_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: {kind}
num_processes: 2
num_machines: 1
machine_rank: 0
mixed_precision: 'no'
use_cpu: true
"""


def run_recipe(
    tmp_path: Path, recipe: str, *overrides: str, timeout: float = 150.0
) -> subprocess.CompletedProcess[str]:
    """``recipes/train/lightning_train.py RECIPE`` with logs under ``tmp_path/runs``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    script = [str(RECIPES / "lightning_train.py"), str(RECIPES / recipe), f"output.root={tmp_path / 'runs'}"]
    return run_python([*script, *overrides], cwd=tmp_path, env=env, timeout=timeout)


def why_failed(output: str, tail: int = 3000) -> str:
    """A failed job's output for an assertion: the first lines that name an error (a launcher's tail
    shows the last rank to fail, not the first, and a rank's own message is cut from the middle of a
    long output) and then the output's tail."""
    errors = [line for line in output.splitlines() if "Error" in line or "pace_strategy:" in line]
    return "\n".join(dict.fromkeys(errors[:20])) + "\n...\n" + output[-tail:]


#: where :func:`free_port` looks: below Linux's ephemeral range (32768-60999 by default), which the
#: kernel hands to every connecting socket, gloo's pairs among them; a port from that range, free
#: when chosen, was taken by another job's connection before rank 0 bound it (seen in CI:
#: "Address already in use" for the metrics endpoint of one of four jobs started together)
PORTS = range(20000, 32768)


def free_port() -> int:
    """A TCP port free on every interface now, outside the kernel's ephemeral range, so that no
    other process's connection can be given it before the test's job binds it (for a launcher's
    main process port, a metrics endpoint)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(PORTS)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {PORTS.start}-{PORTS.stop - 1} after 200 tries")


def parse_metrics(text: str, prefix: str = "") -> dict[str, float]:
    """The ``pace_`` samples of a Prometheus text exposition: ``name{labels}`` -> value. ``prefix``:
    only lines starting with it count, and it is cut off first (a script's ``scraped `` lines)."""
    samples = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        line = line[len(prefix) :]
        if line.startswith("pace_"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def only_version_dir(tmp_path: Path, name: str = "demo") -> Path:
    versions = sorted((tmp_path / "runs" / name).glob("version_*"))
    assert len(versions) == 1, versions
    return versions[0]


def read_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar in the TensorBoard event files under ``log_dir``: tag -> {step: value}."""
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def read_mlflow(store: Path, key: str, run_id: str | None = None) -> dict[int, float]:
    """``key``'s values by step in the one run (or ``run_id``) of the MLflow file store ``store``,
    read by MLflow's own client (in any order: the HF Trainer's MLflow callback logs asynchronously,
    and MLflow keys a metric's values by step)."""
    from mlflow.tracking import MlflowClient

    allow = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 refuses a file store without it
    try:
        client = MlflowClient(tracking_uri=store.as_uri(), registry_uri=store.as_uri())
        if run_id is None:
            (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
            assert run.info.status == "FINISHED", run.info
            run_id = run.info.run_id
        history = client.get_metric_history(run_id, key)
    finally:
        if allow is None:
            del os.environ["MLFLOW_ALLOW_FILE_STORE"]
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = allow
    return {m.step: m.value for m in history}


def read_dashboard(log_dir: Path) -> dict[str, dict[str, tuple[str, list[str]]]]:
    """The custom-scalars layouts written under ``log_dir`` (TensorBoard's Custom Scalars tab), read
    back from the event files: category -> chart title -> ("Multiline", tag regexes) or ("Margin",
    [value, lower, upper] tags)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    found: dict[str, dict[str, tuple[str, list[str]]]] = {}
    for path in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag != metadata.CONFIG_SUMMARY_TAG:
                    continue
                layout = layout_pb2.Layout.FromString(value.tensor.string_val[0])
                for category in layout.category:
                    charts = found.setdefault(category.title, {})
                    for chart in category.chart:
                        if chart.HasField("multiline"):
                            charts[chart.title] = ("Multiline", list(chart.multiline.tag))
                        else:
                            margin = chart.margin.series[0]
                            charts[chart.title] = ("Margin", [margin.value, margin.lower, margin.upper])
    return found


def check_dashboard(log_dir: Path) -> dict[str, tuple[str, list[str]]]:
    """The ``pace`` dashboard under ``log_dir``: written, and every chart shows tags that were written
    there (a regex that matches none, or a margin tag never written, fails). Returns its charts."""
    layouts = read_dashboard(log_dir)
    assert list(layouts) == ["pace"], layouts
    written = set(read_scalars(log_dir))
    for title, (kind, series) in layouts["pace"].items():
        if kind == "Margin":
            assert set(series) <= written, (title, series)
        else:
            assert all(any(re.fullmatch(r, tag) for tag in written) for r in series), (title, series)
    return layouts["pace"]


def pace_diagnose(*args: str) -> tuple[int, str, str]:
    """`pace diagnose ARGS` in this process (the CLI entry point itself; saves a Lightning import)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["diagnose", *args])
    return code, out.getvalue(), err.getvalue()


def diagnose_json(run_dir: Path) -> dict:
    """`pace diagnose RUN_DIR --json`, parsed; fails the test when the command fails."""
    code, out, err = pace_diagnose(str(run_dir), "--json")
    assert code == 0, err
    return json.loads(out)
