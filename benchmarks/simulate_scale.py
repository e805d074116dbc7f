"""How long the simulator takes at 1,024 nodes x 8 GPUs x 1,000 steps (not a test; prints what it measured).

python benchmarks/simulate_scale.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from pace_strategy.settings import build, load_mapping
from pace_strategy.sim.model import SimConfig
from pace_strategy.sim.sweep import simulate


def main() -> int:
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "simulate" / "paper.yaml"
    cfg = build(SimConfig, load_mapping(recipe, ["nodes=[1024]", "steps=1000"]))
    for paced in (False, True):
        started = time.perf_counter()
        run = simulate(cfg, 1024, paced=paced)
        elapsed = time.perf_counter() - started
        print(
            f"1024 nodes x 8 GPUs x 1000 steps, {'paced' if paced else 'plain'}: {elapsed:.2f} s "
            f"(mean step {run.mean_step_ms:.1f} ms, CV {run.cv:.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
