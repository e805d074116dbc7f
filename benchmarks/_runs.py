"""What the benchmarks share: one demo training run in a subprocess, and the machine description."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pace_strategy import testbed


def run_demo(
    workdir: Path, index: int, demo_args: list[str], *, skip: int, fabric: testbed.Fabric | None = None
) -> tuple[list[float], Path | None]:
    """One ``pace demo`` run (quiet, no diagnosis); returns rank 0's step times in ms, the first
    ``skip`` dropped (the same ruler for every strategy: one callback on rank 0), and the run record
    of a paced run (``None`` for a plain one). With ``fabric``, the run spans its nodes (one demo
    per node namespace, gloo over the emulated links); without, all ranks share loopback."""
    times_path = workdir / f"{index:03d}-steps.json"
    name = f"run{index:03d}"
    args = ["--quiet", "--no-diagnosis", "--root", str(workdir / "runs"), "--name", name]
    args += ["--step-times", str(times_path), *demo_args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if fabric is None:
        cmd = [sys.executable, "-m", "pace_strategy", "demo", *args]
        done = [subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)]
    else:  # a fresh port per run: the last run's store socket may still be in TIME_WAIT
        done = testbed.run_on_nodes(fabric, args, env=env, port=29520 + index % 400, timeout_s=900)
    for d in done:
        if d.returncode != 0:
            raise SystemExit(f"run failed: {' '.join(map(str, d.args))}\n{d.stderr[-3000:]}")
    times = json.loads(times_path.read_text())["step_ms"][skip:]
    records = list((workdir / "runs" / name).glob("version_*/pace_run.jsonl"))
    return times, (records[0] if records else None)


def transient_spec(ranks: int, ms: int = 30, probability: float = 0.1) -> str:
    """The ``--straggler`` spec of transient stragglers: every rank ``+ms`` with ``probability`` per step."""
    return ",".join(f"{r}:{ms}:{probability}" for r in range(ranks))


def blocked(
    base: list[float], arm: list[float], blocks: int, stat: Callable[[list[float], list[float]], float]
) -> tuple[float, float, list[float]]:
    """``stat(base, arm)`` over all steps, its standard error over ``blocks`` consecutive blocks of
    steps (the spread of ``stat`` per block), and the per-block values."""
    size = len(base) // blocks
    values = [stat(base[i * size : (i + 1) * size], arm[i * size : (i + 1) * size]) for i in range(blocks)]
    return stat(base, arm), statistics.stdev(values) / math.sqrt(blocks), values


def write_results(out: str, markdown_path: str, table: str, result: dict[str, Any]) -> None:
    """Print the Markdown table, write it and the JSON result (parent folders created), say where."""
    print("\n" + table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    Path(markdown_path).write_text(table)
    print(f"wrote {out} and {markdown_path}")


def provenance(args: Any) -> dict[str, Any]:
    """Date, machine and command of a benchmark result."""
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "command": "python " + " ".join(sys.argv),
        "settings": vars(args),
    }
