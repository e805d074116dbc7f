"""How often the adaptive controller keeps pacing, fed synthetic windows: the A/B check's trade-off.

Not a test, and not a training run: it feeds :class:`~pace_strategy.core.policy.PacingPolicy` windows
of a persistent straggler (three ranks lead by 30 ms, the same as ``pacing_interleaved.py``'s
``persistent`` scenario at 4 ranks) whose median step time is 58 ms, plus Gaussian window-to-window
noise, times ``1 - gain`` while pacing is on. ``gain = 0`` is a run where pacing cannot help: every
paced window is a cost. A positive gain is a run where it helps: every unpaced window is a loss.
Reported: the share of windows paced, averaged over seeds, per ``ab_noise_factor``.

    python benchmarks/ab_check.py              # a few seconds
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

import torch

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.policy import PacingPolicy
from pace_strategy.core.skew import WindowStats

STEP_MS = 58.0
LEADS_MS = (30.0, 0.0, 30.0, 30.0)  # rank 1 is the straggler
STEPS = 32  # per window (the default exchange_every_steps)


def paced_share(cfg: PacingConfig, noise_ms: float, gain: float, windows: int, seed: int) -> float:
    """Share of ``windows`` the policy paced in one synthetic run."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    policy = PacingPolicy(cfg, len(LEADS_MS))
    paced = 0
    for w in range(windows):
        active = policy.last_decision.pacing_active
        paced += active
        leads = torch.tensor(LEADS_MS, dtype=torch.float64).unsqueeze(1)
        leads = (leads + torch.randn(len(LEADS_MS), STEPS, generator=gen, dtype=torch.float64)) * (leads > 0)
        median = STEP_MS * (1.0 - gain if active else 1.0) + rng.gauss(0.0, noise_ms)
        stats = WindowStats(
            window=w,
            world_size=len(LEADS_MS),
            steps=STEPS,
            median_step_ms=median,
            median_unpaced_skew_ms=max(LEADS_MS),
            pacable_lead_ms=leads.clamp_min(0.0),
            straggler_counts=tuple(STEPS if lead == 0 else 0 for lead in LEADS_MS),
        )
        policy.update(stats)
    return paced / windows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--windows", type=int, default=31, help="windows per run (31 = 1000 steps); default 31")
    p.add_argument("--seeds", type=int, default=300, help="runs per cell; default 300")
    p.add_argument("--factors", default="0,1,2", help="ab_noise_factor values; default 0,1,2")
    p.add_argument("--noise-ms", default="0.3,1.0", help="window-to-window noise (SD, ms); default 0.3,1.0")
    p.add_argument("--gains", default="0,0.02,0.05", help="pacing's true gain; default 0,0.02,0.05")
    args = p.parse_args()
    factors = [float(x) for x in args.factors.split(",")]
    noises = [float(x) for x in args.noise_ms.split(",")]
    gains = [float(x) for x in args.gains.split(",")]
    print(
        f"share of windows paced, {args.windows} windows x {args.seeds} seeds per cell, "
        f"step {STEP_MS:g} ms, defaults otherwise"
    )
    print("| window noise | true gain | " + " | ".join(f"ab_noise_factor {z:g}" for z in factors) + " |")
    print("|---|---|" + "---|" * len(factors))
    for noise in noises:
        for gain in gains:
            cells = []
            for z in factors:
                cfg = PacingConfig(ab_noise_factor=z)
                share = statistics.fmean(
                    paced_share(cfg, noise, gain, args.windows, seed) for seed in range(args.seeds)
                )
                cells.append(f"{share:.1%}")
            print(f"| {noise:g} ms | {gain:.0%} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
