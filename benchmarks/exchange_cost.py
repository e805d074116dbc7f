"""The window exchange's cost on this machine, and a ring model fitted to it (not a test).

Times real gloo all-gathers of window-shaped payloads (``K x 17`` float64 per rank) on thread ranks
(each a ``ProcessGroupGloo`` on one TCP store, as the distributed tests build them) at several world
sizes W and window lengths K, then fits the ring all-gather model

    t(W, bytes) = (W - 1) * (alpha + beta * bytes)          bytes: one rank's rows

by least squares and prints alpha (latency per hop), beta (time per byte per hop) and each point's
measured and modelled time. With the fit it prints what the model says of a window at 1,024 and
8,192 ranks, flat and through node leaders (8 ranks per node), and the bytes each rank receives per
window, which the exchange pins exactly: ``(W - 1) x K x 17 x 8`` flat; a non-leader ``(L - 1) x K
x 17 x 8`` plus the decision.

What the fit is worth: every "rank" is a thread of one process on a 2-core machine, so a hop is a
loopback TCP message between threads that share two cores and the GIL; alpha is an upper bound of a
real fabric's per-hop latency and beta says nothing of a NIC. It is the cost model of this test bed,
measured, not of a cluster.

    python benchmarks/exchange_cost.py [--ranks 2,4,8,16] [--steps 8,32,128] [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from pace_strategy.core.records import NUM_FIELDS

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from tests.distributed.ranks import raise_first, run_ranks


def time_all_gather(world: int, steps: int, repeat: int) -> float:
    """Median seconds of one all-gather of ``[steps, NUM_FIELDS]`` float64 per rank, over ``repeat``."""

    def rank(r: int, group: dist.ProcessGroup) -> list[float]:
        rows = torch.full((steps, NUM_FIELDS), float(r), dtype=torch.float64)
        outputs = [torch.empty_like(rows) for _ in range(world)]
        times = []
        for i in range(repeat + 2):
            group.barrier().wait(timedelta(seconds=30))
            started = time.perf_counter()
            group.allgather([outputs], [rows]).wait(timedelta(seconds=30))
            if i >= 2:  # the first two open the connections
                times.append(time.perf_counter() - started)
        return times

    per_rank = raise_first(run_ranks(world, rank, timeout_s=120))
    return statistics.median(max(ts) for ts in zip(*per_rank, strict=True))  # the slowest rank's


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,4,8,16")
    p.add_argument("--steps", default="8,32,128", help="K values: window lengths")
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    points = []
    print(f"{'ranks':>6} {'K':>5} {'bytes/rank':>11} {'measured':>10}")
    for world in (int(w) for w in args.ranks.split(",")):
        for steps in (int(k) for k in args.steps.split(",")):
            seconds = time_all_gather(world, steps, args.repeat)
            size = steps * NUM_FIELDS * 8
            points.append((world, size, seconds))
            print(f"{world:>6} {steps:>5} {size:>11,} {seconds * 1e3:>8.3f} ms", flush=True)
    # t = (W - 1) * alpha + (W - 1) * bytes * beta
    a = np.array([[w - 1, (w - 1) * b] for w, b, _ in points], dtype=np.float64)
    t = np.array([s for _, _, s in points])
    (alpha, beta), *_ = np.linalg.lstsq(a, t, rcond=None)
    note = ""
    if beta < 0:  # more bytes cannot take less time: the sizes measured are below this test bed's noise
        beta = 0.0
        alpha = float(a[:, 0] @ t / (a[:, 0] @ a[:, 0]))
        note = " (the free fit's beta was negative: the payload's cost is below the noise; beta set to 0)"
    print(f"\nfit: alpha {alpha * 1e6:.1f} us per hop, beta {beta * 1e9:.3f} ns per byte per hop{note}")
    for (world, size, seconds), model in zip(points, a @ np.array([alpha, beta]), strict=True):
        print(f"  W {world:>3}, {size:>7,} B: measured {seconds * 1e3:7.3f} ms, model {model * 1e3:7.3f} ms")
    k = 32
    size = k * NUM_FIELDS * 8
    print(f"\nthe model, K = {k} ({size:,} bytes per rank):")
    for world in (1024, 8192):
        flat = (world - 1) * (alpha + beta * size)
        leaders = world // 8
        tiered = (leaders - 1) * (alpha + beta * 8 * size) + 7 * (alpha + beta * size)
        received = (world - 1) * size / 1e6
        print(
            f"  W {world:>5}: flat {flat * 1e3:8.1f} ms, each rank receives {received:6.2f} MB; "
            f"node leaders (8 per node) {tiered * 1e3:7.1f} ms, a non-leader receives "
            f"{7 * size / 1e6:.3f} MB plus the decision"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
