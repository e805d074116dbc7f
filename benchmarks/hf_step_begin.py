"""How often the HF Trainer path names a rank that is late to its forward (an ``on_step_begin``
callback sleeping 25 ms on rank 1, ``logging_steps=1``), and what ``pace diagnose`` says: two CPU
processes under ``pace launch`` (accelerate, gloo). Not a test; prints what it measured.

    python benchmarks/hf_step_begin.py [--steps 40] [--sleep-ms 25]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
num_processes: 2
num_machines: 1
machine_rank: 0
mixed_precision: 'no'
use_cpu: true
pacing_config:
  mode: monitor
  exchange_every_steps: 4
  warmup_steps: 2
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sleep-ms", type=float, default=25.0)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "accel.yaml").write_text(CONFIG)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        job = Path(__file__).with_name("hf_step_begin_job.py")
        command = [sys.executable, "-m", "pace_strategy.cli", "launch", "--main_process_port", str(port)]
        command += ["--config_file", str(root / "accel.yaml"), str(job), str(root / "out"), str(args.steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SLEEP_MS": str(args.sleep_ms)}
        subprocess.run(command, env=env, check=True, capture_output=True, timeout=600)
        lines = [json.loads(x) for x in (root / "out" / "pace_run.jsonl").read_text().splitlines()]
        steps = [x for x in lines if x["record"] == "step" and not x["warmup"]]
        named = sum(x["straggler_rank"] == 1 for x in steps)
        print(f"rank 1 named the straggler in {named} of {len(steps)} steps ({named / len(steps):.0%})")
        diagnosis = subprocess.run(
            [
                sys.executable,
                "-m",
                "pace_strategy.cli",
                "diagnose",
                str(root / "out"),
                "--json",
                "--no-report",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        top = json.loads(diagnosis.stdout)["findings"][0]
        print(
            f"pace diagnose: {top['mode']} ranks {top['ranks']} "
            f"({top['lost_step_fraction']:.1%} of step time)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
