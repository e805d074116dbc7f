"""Uneven inputs: how much of the waiting the ranks' work sizes (tokens, else samples) explain.

In LLM training each rank draws sequences of different lengths; its compute follows its tokens (and,
through attention, their squares), and every step waits for the rank that drew the most. Per step,
each rank's compute and work size are taken relative to the step's mean over the ranks (what every
rank shares that step, a longer batch for everyone, drops out), and the compute differences are fitted
by least squares on the work size and its square (no intercept: equal work, equal compute). The fit's
R^2 is the share of the ranks' compute differences the work sizes explain; the fitted compute gives the
waiting they cause: each step's mean over ranks of the slowest predicted arrival minus each rank's.
The fit is on the calibration sample's steps (a seeded sample of a long run, every step of a short one).
The run's noise floor is measured on the spread of the ranks' arrivals, which the work sizes cause: the
finding is compared with the part of it they leave unexplained.
"""

from __future__ import annotations

import numpy as np

from pace_strategy.diagnose.result import Finding, Mode, pct
from pace_strategy.diagnose.run_stats import EPSILON, RunStats

__all__ = ["input_imbalance", "work_sizes"]


def work_sizes(run: RunStats) -> tuple[str, np.ndarray] | None:
    """The recorded work size per sampled step and rank that differs between ranks: ``("tokens",
    [n, W])`` where every rank reported tokens, else ``("samples", ...)``; ``None`` when neither was
    recorded or every rank had the same in every step (nothing for it to explain)."""
    s = run.digest.sample
    for name, values in (("tokens", s.tokens), ("samples", s.samples)):
        if values is None or len(values) == 0 or not (values > 0).all():
            continue
        if np.ptp(values, axis=1).max() > 0:
            return name, values
    return None


def input_imbalance(run: RunStats, explained: set[int]) -> list[Finding]:
    """``input_imbalance``: the ranks' work sizes explain at least ``input_explained_share`` of their
    compute differences (module docstring); its share is the waiting the fitted compute gives."""
    cfg = run.cfg
    found = work_sizes(run)
    if found is None:
        return []
    name, work = found
    s = run.digest.sample
    c = s.compute - s.compute.mean(axis=1, keepdims=True)
    w = work / max(float(work.mean()), EPSILON)  # scaled: the square stays well conditioned
    features = np.stack([w - w.mean(axis=1, keepdims=True), w * w - (w * w).mean(axis=1, keepdims=True)], -1)
    x, y = features.reshape(-1, 2), c.reshape(-1)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    fitted = (x @ coef).reshape(c.shape)
    total = float((y * y).sum())
    r2 = 1.0 - float(((y - fitted.reshape(-1)) ** 2).sum()) / total if total > 0 else 0.0
    # more work, more compute: a fit that predicts the opposite explains nothing a user can act on
    more = float(np.corrcoef(fitted.reshape(-1), w.reshape(-1))[0, 1]) if fitted.std() > 0 else 0.0
    if r2 < cfg.input_explained_share or more <= 0:
        return []
    step_total = float(s.step_ms.sum())
    predicted = float((fitted.max(axis=1, keepdims=True) - fitted).mean(axis=1).sum())
    actual = float((s.wait - s.wait.min(axis=1, keepdims=True)).mean(axis=1).sum())
    lost = predicted / step_total if step_total > 0 else 0.0
    run_lost = run.lost_when(run.all_steps)
    scale = run_lost / (actual / step_total) if actual > 0 and step_total > 0 else 1.0
    # The run's noise floor is read from the spread of the arrivals, which the work sizes explain
    # R^2 of (in variance): what is noise is the rest, sigma x sqrt(1 - R^2).
    whole = run.jitter_when(run.all_steps)
    jitter = whole * float(np.sqrt(max(0.0, 1.0 - r2)))
    # the waiting it explains is its own; the checks that read the whole run's waiting count the rest
    run.account(min(lost * scale, run_lost), whole - jitter)
    explains = predicted / actual if actual > 0 else 0.0
    spread = float(np.median(np.ptp(work, axis=1) / np.maximum(work.mean(axis=1), EPSILON)))
    last = np.bincount(s.wait.argmin(axis=1), minlength=run.W)
    return [
        Finding(
            mode=Mode.INPUT_IMBALANCE,
            ranks=sorted(int(r) for r in np.nonzero(last)[0]),
            hosts=sorted(set(run.hosts)),
            confidence=float(np.clip(r2, 0.0, 1.0)),
            lost_step_fraction=lost * scale,
            noise_floor_fraction=jitter,
            evidence=(
                f"the ranks' {name} per step differ (max minus min {pct(spread)} of the mean at the median "
                f"step) and explain {pct(r2)} of the differences in their compute (least squares on {name} "
                f"and its square, per step relative to the ranks' mean); the compute they predict costs "
                f"{pct(lost * scale)} of step time in waiting, {pct(explains)} "
                f"of the waiting measured; the last rank changes with the inputs ({int((last > 0).sum())} of "
                f"{run.W} ranks were last)"
            ),
            action=(
                "balance the work per rank, not the sample count: assign each global batch's samples to "
                "ranks by their predicted cost (tokens, or attention's length squared), bucket or sort by "
                "length, or pack sequences to a fixed token budget; rebalancing by shares cannot help (the "
                "slow rank changes with every batch), nor can pacing"
            ),
            details={"work": name, "r2": r2, "explained_waiting": explains},
        )
    ]
