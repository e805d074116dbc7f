"""Rebalancing against plain DDP, run by run in alternating order: samples/s and the capacity bound.

Not a test: it prints what it measured. Every case trains the demo's MLP (``pace demo``) on W CPU
ranks whose emulated accelerator time scales with their samples (``--sample-ms`` per sample, no
fixed per-step sleep), one rank ``FACTOR`` times slower per sample (``--slow-device 1:FACTOR``;
``FACTOR`` 1 is the clean case). The baseline is stock ``ddp``; the candidate is ``paced_ddp`` with
``mode=monitor`` (no pacing: rebalancing alone) and ``rebalance=true``, exchanging every 8 steps so
that it decides within the run. Each repetition runs the two arms back to back, in alternating
order (AB, BA, ...), so both see the same minutes of a shared machine.

Reported per case: samples/s of each arm over the steps after ``--skip`` (rank 0's wall time between
batch ends, the same ruler for both; the global batch is constant), the candidate/baseline ratio
(median over repetitions, and its spread), the split the candidate ended at, the bound of the best
split in whole quanta, what is attainable (that split's step plus the measured per-step time outside
compute), and each arm against the capacity bound: the sum of the ranks' speeds (1 / per-sample
compute time), measured from the candidate's run record in its even phase (compute time to the sync
point over samples; it leaves out the all-reduce and the optimizer, so 100% is out of reach). With
one rank FACTOR x slower of W, plain DDP's theoretical share of the bound is W / (FACTOR * (W - 1 +
1/FACTOR)).

The clean case's own cost, which run-level A/B cannot resolve on a shared machine, is measured
apart first (``--data-path-batches``): in one process, epochs through a DataLoader with the
``DistributedSampler`` Lightning injects and through one with ``ShareBatchSampler`` (plus the
per-batch ``pop_built`` the integrations call), in alternating order: microseconds per batch.

``--control`` adds a third arm to the clean cases: ``paced_ddp`` with ``mode=monitor`` and
rebalancing off, the same monitoring without the controller and its sampler. Its ratios
(rebalance / monitor, monitor / ddp) say which part of a clean-case cost is rebalancing and which
is monitoring.

The two-node cases (``--node-ranks``, root only) run each arm on 2 emulated nodes of the test bed
(network namespaces on one bridge), rank 1 being node 0's second local rank.

The CPU-quota cases (``--quota-ranks``, root only) are real compute only: no emulated time at all,
the MLP at width ``--quota-hidden``, one node of 2 under a cgroup CPU quota of ``--quota`` CPUs (a
throttled or shared host: slow in bursts, normal at the median). Their "per sample" column reads the
quota; the theory column does not apply.

    python benchmarks/rebalance.py --reps 3     # 2, 4 ranks x 1, 1.5, 2; 4 on 2 nodes x 2 (~25 min)
    python benchmarks/rebalance.py --ranks 2 --factors 2 --reps 1     # a quick look
    python benchmarks/rebalance.py --ranks 2,4 --factors 1 --node-ranks "" --reps 8 --control
    python benchmarks/rebalance.py --ranks 2 --factors 2 --node-ranks "" --phase backward   # slow in backward
    python benchmarks/rebalance.py --ranks "" --node-ranks "" --quota-ranks 2 --reps 3     # a CPU quota
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _runs import provenance, run_demo, write_results

from pace_strategy import testbed
from pace_strategy.core.config import PacingConfig
from pace_strategy.core.shares import best_split
from pace_strategy.data.phases import SharePhase, share_phases
from pace_strategy.telemetry import read_run_record

MONITOR = ["--pacing", "mode=monitor", "--pacing", "exchange_every_steps=8"]  #: the control arm (--control)
CANDIDATE = [*MONITOR, "--pacing", "rebalance=true"]
#: the arms in the order of even repetitions (odd ones reverse it); "monitor" only with --control
ARMS = ("ddp", "rebalance", "monitor")


def data_path_cost(batches: int, rounds: int = 6) -> dict[str, float]:
    """Microseconds per batch of the two data paths (one rank of two, 32 samples per batch), epochs
    in alternating order; the median epoch of each."""
    import time

    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from pace_strategy.core.shares import ShareSchedule
    from pace_strategy.data import ShareBatchSampler

    data = TensorDataset(torch.randn(batches * 64, 64), torch.randint(0, 10, (batches * 64,)))
    plain = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, 2, 0, shuffle=True, seed=0))
    sampler = ShareBatchSampler(data, ShareSchedule(64, 2), 0, shuffle=True, seed=0)
    shared = DataLoader(data, batch_sampler=sampler)

    def epoch(loader: DataLoader[Any], pop: bool) -> float:
        started = time.perf_counter()
        for _ in loader:
            if pop:
                sampler.pop_built()
        return (time.perf_counter() - started) * 1e6 / batches

    times: dict[str, list[float]] = {"distributed_sampler_us": [], "share_sampler_us": []}
    for i in range(rounds):
        for name in ("distributed_sampler_us", "share_sampler_us")[:: 1 if i % 2 == 0 else -1]:
            times[name].append(epoch(plain, False) if name.startswith("dist") else epoch(shared, True))
    return {name: statistics.median(v) for name, v in times.items()}


@dataclass(frozen=True)
class Arm:
    samples_per_s: float
    phases: list[SharePhase]  #: the candidate's share phases (empty for the baseline)


@dataclass(frozen=True)
class Case:
    ranks: int  #: world size
    nodes: int  #: 1: every rank on loopback; 2: one emulated node per half of the ranks (test bed)
    factor: float  #: rank 1's per-sample slowdown (1: clean)
    quota: float = 0.0  #: CPUs node 1 may use (0: no quota); real compute only

    @property
    def label(self) -> str:
        return f"{self.ranks}" if self.nodes == 1 else f"{self.ranks} on {self.nodes} nodes"


def run_arm(work: Path, index: int, case: Case, kind: str, args: Any, fabric: testbed.Fabric | None) -> Arm:
    """One run of arm ``kind`` (one of ARMS)."""
    demo = ["--devices", str(case.ranks // case.nodes), "--steps", str(args.steps), "--straggler", ""]
    demo += ["--compute-ms", "0", "--sample-ms", str(args.sample_ms), "--batch-size", str(args.batch_size)]
    if case.quota:  # real compute only: the quota alone makes node 1 slow
        demo += ["--sample-ms", "0", "--hidden", str(args.quota_hidden)]
    if case.factor > 1.0:
        demo += ["--slow-device", f"1:{case.factor:g}"]  # a global rank: node 0's local rank 1
        demo += ["--straggler-phase", args.phase]  # where the slow rank's extra time goes
    quantum = ["--pacing", f"rebalance.quantum={args.quantum}"] if args.quantum else []
    if kind == "ddp":
        demo += ["--strategy", "ddp"]
    else:
        demo += ["--strategy", "paced_ddp", *(CANDIDATE if kind == "rebalance" else MONITOR), *quantum]
    times, record = run_demo(work, index, demo, skip=args.skip, fabric=fabric)
    global_batch = args.batch_size * case.ranks
    phases = share_phases(read_run_record(record).steps) if record is not None else []
    return Arm(global_batch * 1e3 / statistics.fmean(times), phases)


def cases(args: Any) -> list[Case]:
    """The single-host cases (every world size x factor), then the two-node ones (root only)."""
    out = [Case(int(r), 1, float(f)) for r in args.ranks.split(",") if r for f in args.factors.split(",")]
    two_node = [
        Case(int(r), 2, float(f))
        for r in args.node_ranks.split(",")
        if r
        for f in args.node_factors.split(",")
    ]
    two_node += [Case(int(r), 2, 1.0, args.quota) for r in args.quota_ranks.split(",") if r]
    if two_node and os.geteuid() != 0:
        print("skipping the two-node cases: the test bed (network namespaces) needs root", flush=True)
        return out
    return out + two_node


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,4", help="world sizes on one host, comma-separated")
    p.add_argument("--factors", default="1,1.5,2", help="per-sample slowdown of rank 1 (1: clean)")
    p.add_argument("--node-ranks", default="4", help="world sizes on 2 emulated nodes ('' for none)")
    p.add_argument("--node-factors", default="2", help="rank 1's slowdown in the two-node cases")
    p.add_argument("--quota-ranks", default="", help="world sizes on 2 nodes, node 1 under a CPU quota")
    p.add_argument("--quota", type=float, default=0.5, help="CPUs node 1 may use in the quota cases")
    p.add_argument("--quota-hidden", type=int, default=1024, help="MLP width in the quota cases")
    p.add_argument("--reps", type=int, default=2, help="repetitions of each arm pair")
    p.add_argument("--steps", type=int, default=128, help="optimizer steps per run")
    p.add_argument("--skip", type=int, default=64, help="steps left out at the start (decision + trial)")
    p.add_argument("--sample-ms", type=float, default=1.0, help="emulated compute per sample, ms")
    p.add_argument("--batch-size", type=int, default=128, help="samples per rank per step at even shares")
    p.add_argument("--quantum", type=int, default=0, help="rebalance.quantum (0: the config default)")
    p.add_argument(
        "--control", action="store_true", help="clean cases: a third arm, monitoring alone (no rebalancing)"
    )
    p.add_argument(
        "--phase",
        default="step",
        choices=("step", "backward", "forward_backward"),
        help="where the slow rank's extra time goes: before the forward (step), inside backward after "
        "the first hidden block (backward), or half in each",
    )
    p.add_argument("--data-path-batches", type=int, default=2000, help="batches per data-path epoch")
    p.add_argument("--out", default="benchmarks/results/rebalance.json")
    p.add_argument("--markdown", default="benchmarks/results/rebalance.md")
    args = p.parse_args()
    args.quantum_used = args.quantum or PacingConfig().rebalance.quantum
    data_path = data_path_cost(args.data_path_batches)
    print(f"data path per batch: {data_path}", flush=True)
    rows, result = [], {**provenance(args), "data_path": data_path, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        work, index = Path(tmp), 0
        for case in cases(args):
            quota = {1: case.quota} if case.quota else {}
            spec = (
                testbed.FabricSpec(nodes=case.nodes, racks=1, prefix="pace-rb", cpu_quota=quota)
                if case.nodes > 1
                else None
            )
            with testbed.running(spec) if spec is not None else contextlib.nullcontext(None) as fabric:
                arms: dict[str, list[Arm]] = {kind: [] for kind in ARMS}
                kinds = ARMS if args.control and case.factor == 1.0 else ARMS[:2]
                for rep in range(args.reps):
                    for kind in kinds if rep % 2 == 0 else kinds[::-1]:
                        arm = run_arm(work, index, case, kind, args, fabric)
                        arms[kind].append(arm)
                        index += 1
                        print(
                            f"W={case.label} x{case.factor:g} rep {rep} "
                            f"{kind:9} {arm.samples_per_s:7.0f} samples/s",
                            flush=True,
                        )
            rows.append(case_row(case, args, arms["ddp"], arms["rebalance"], arms["monitor"]))
            result["cases"].append(rows[-1])
    write_results(args.out, args.markdown, table(rows, args, data_path), result)
    return 0


def case_row(case: Case, args: Any, base: list[Arm], cand: list[Arm], control: list[Arm]) -> dict[str, Any]:
    """One case's medians and bounds. The bounds come from each candidate run's even phase (median
    over runs): the capacity bound (sum of speeds), the bound of the best split in whole quanta, and
    that split's step with the measured per-step time outside compute added (what is attainable).
    With a control arm (monitoring alone), the candidate's and plain DDP's ratios over it, pair by
    pair: what rebalancing adds and what monitoring costs."""
    ratios = [c.samples_per_s / b.samples_per_s for b, c in zip(base, cand, strict=True)]
    even = [a.phases[0] for a in cand if a.phases]
    global_batch = args.batch_size * case.ranks

    def median_over_runs(value: Callable[[SharePhase], float]) -> float:
        return statistics.median(value(ph) for ph in even) if even else float("nan")

    def best_ms(ph: SharePhase) -> float:
        return best_split(ph.ms_per_sample, global_batch, args.quantum_used)[1]

    def paired(arms: list[Arm]) -> list[tuple[Arm, Arm]]:
        return list(zip(arms, control, strict=True)) if control else []

    capacity = median_over_runs(lambda ph: ph.capacity_per_s)
    quantized = median_over_runs(lambda ph: global_batch * 1e3 / best_ms(ph))
    attainable = median_over_runs(lambda ph: global_batch * 1e3 / (best_ms(ph) + ph.outside_ms))
    base_sps = statistics.median(a.samples_per_s for a in base)
    cand_sps = statistics.median(a.samples_per_s for a in cand)
    return {
        "ranks": case.ranks,
        "nodes": case.nodes,
        "factor": case.factor,
        "quota": case.quota,
        "ddp_samples_per_s": base_sps,
        "rebalance_samples_per_s": cand_sps,
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        "capacity_per_s": capacity,
        "best_split_bound_per_s": quantized,
        "attainable_per_s": attainable,
        "outside_compute_ms": median_over_runs(lambda ph: ph.outside_ms),
        "ddp_of_capacity": base_sps / capacity,
        "rebalance_of_capacity": cand_sps / capacity,
        "rebalance_of_attainable": cand_sps / attainable,
        "theory_ddp_of_capacity": (
            float("nan") if case.quota else case.ranks / (case.factor * (case.ranks - 1 + 1 / case.factor))
        ),
        "final_shares": [list(a.phases[-1].shares) for a in cand if a.phases],
        "rebalance_over_monitor": [c.samples_per_s / m.samples_per_s for c, m in paired(cand)],
        "monitor_over_ddp": [m.samples_per_s / b.samples_per_s for b, m in paired(base)],
    }


def table(rows: list[dict[str, Any]], args: Any, data_path: dict[str, float]) -> str:
    extra = data_path["share_sampler_us"] - data_path["distributed_sampler_us"]
    lines = [
        f"Data path per batch (one process, alternating epochs of {args.data_path_batches} batches): "
        f"DistributedSampler {data_path['distributed_sampler_us']:.1f} us, ShareBatchSampler + pop_built "
        f"{data_path['share_sampler_us']:.1f} us ({extra:+.1f} us per step).",
        "",
        f"Rebalancing vs plain DDP ({args.reps} alternating pairs of runs per case, {args.steps} steps, "
        f"first {args.skip} left out; {args.sample_ms:g} ms emulated compute per sample, the slow rank's "
        f"extra time in phase {args.phase!r}"
        + (
            f"; the quota cases real compute only, width {args.quota_hidden}, node 1 under {args.quota:g} CPU"
            if any(r.get("quota") for r in rows)
            else ""
        )
        + ", "
        f"{args.batch_size} samples per rank at even shares, rebalance.quantum {args.quantum_used})",
        "",
        "| ranks | rank 1 per sample | ddp samples/s | rebalance samples/s | ratio (median; each pair) "
        "| capacity bound | best split's bound | attainable (outside compute) | ddp / bound (theory) "
        "| rebalance / bound | rebalance / attainable | final split |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        each = ", ".join(f"{x:.3f}" for x in r["ratios"])
        label = f"{r['ranks']}" if r["nodes"] == 1 else f"{r['ranks']} on {r['nodes']} nodes"
        slow = f"quota {r['quota']:g} CPU" if r.get("quota") else f"{r['factor']:g}x"
        theory = "-" if r.get("quota") else f"{r['theory_ddp_of_capacity']:.0%}"
        lines.append(
            f"| {label} | {slow} | {r['ddp_samples_per_s']:.0f} | "
            f"{r['rebalance_samples_per_s']:.0f} | {r['ratio_median']:.3f} ({each}) | "
            f"{r['capacity_per_s']:.0f} | {r['best_split_bound_per_s']:.0f} | "
            f"{r['attainable_per_s']:.0f} ({r['outside_compute_ms']:.1f} ms) | "
            f"{r['ddp_of_capacity']:.0%} ({theory}) | "
            f"{r['rebalance_of_capacity']:.0%} | {r['rebalance_of_attainable']:.0%} | "
            f"{' / '.join(map(str, r['final_shares']))} |"
        )
    controlled = [r for r in rows if r["rebalance_over_monitor"]]
    if controlled:
        lines += [
            "",
            "Clean cases against the control arm (`paced_ddp` `mode=monitor`, rebalancing off):",
            "",
            "| ranks | rebalance / monitor-only (median; each) | monitor-only / ddp (median; each) |",
            "|---|---|---|",
        ]
        for r in controlled:
            cells = [
                f"{statistics.median(v):.3f} ({', '.join(f'{x:.3f}' for x in v)})"
                for v in (r["rebalance_over_monitor"], r["monitor_over_ddp"])
            ]
            lines.append(f"| {r['ranks']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
