"""``pace simulate RECIPE.yaml [key=value ...] [--json]`` and ``pace simulate --from-run RUN_DIR``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from pace_strategy.core.errors import PacingConfigError
from pace_strategy.telemetry.run_record import RunRecordError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pace simulate",
        description="What-if simulator of synchronous data-parallel training, from 4 to 1,024+ nodes, "
        "with and without the pacing controller.",
    )
    p.add_argument("recipe", nargs="?", help="a simulation recipe (YAML), e.g. recipes/simulate/paper.yaml")
    p.add_argument(
        "overrides", nargs="*", help="dotlist overrides, e.g. network.oversubscription=4 nodes=[4,64]"
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--from-run", metavar="RUN_DIR", help="calibrate from a recorded run instead of a recipe")
    p.add_argument(
        "--ranks",
        default="",
        help="with --from-run: rank counts to predict, e.g. 4,64,512 (default: x1 x16 x128)",
    )
    p.add_argument("--steps", type=int, default=1000, help="with --from-run: simulated steps per run")
    p.add_argument(
        "--calibration-steps",
        type=int,
        default=5000,
        help="with --from-run: recorded steps the fit reads, a seeded sample of a longer run (default "
        "5000, as pace diagnose's projection; every step of a shorter one): the memory of the sample, not "
        "the run",
    )
    p.add_argument(
        "--oversubscription",
        type=float,
        default=None,
        help="with --from-run: what-if spine oversubscription of the fabric (1 = full bisection)",
    )
    p.add_argument("--gpus-per-node", type=int, default=8, help="with --oversubscription: ranks per node")
    p.add_argument(
        "--nodes-per-leaf", type=int, default=16, help="with --oversubscription: nodes per leaf switch"
    )
    p.add_argument(
        "--ring-order",
        choices=("topology", "interleaved"),
        default="interleaved",
        help="with --oversubscription",
    )
    p.add_argument("--seed", type=int, default=0)
    return p


def _table(rows: list[dict[str, Any]], title: str) -> str:
    head = (
        f"{'nodes':>6} {'ranks':>6} {'thrpt plain':>12} {'thrpt paced':>12} {'ratio':>7} "
        f"{'CV plain':>9} {'CV paced':>9} {'p99 plain':>10} {'p99 paced':>10} {'scal.eff':>9} {'paced %':>8}"
    )
    lines = [title, head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['nodes']:>6} {r['ranks']:>6} {r['throughput_plain']:>12.1f} {r['throughput_paced']:>12.1f} "
            f"{r['throughput_ratio']:>7.4f} {r['cv_plain']:>9.3f} {r['cv_paced']:>9.3f} "
            f"{r['p99_ms_plain']:>8.1f}ms {r['p99_ms_paced']:>8.1f}ms {r['scaling_efficiency_plain']:>9.3f} "
            f"{r['pacing_active_share']:>7.0%}"
        )
    lines.append(
        "throughput in rank-steps/s; ratio = paced/plain; scal.eff = per-rank throughput vs the first row"
    )
    if rows and "throughput_gc_sync" in rows[0]:
        lines += ["", _gc_table(rows)]
    return "\n".join(lines)


def _gc_table(rows: list[dict[str, Any]]) -> str:
    """What synchronized collection (compute.gc_sync) does at each size, against the unpaced run."""
    head = (
        f"{'nodes':>6} {'ranks':>6} {'waiting plain':>14} {'waiting gc_sync':>16} {'thrpt gc_sync':>14} "
        f"{'gc_sync/plain':>14} {'p99 gc_sync':>12}"
    )
    lines = ["GC pauses, each rank at its own steps (plain) or all at the same steps (gc_sync):", head]
    lines.append("-" * len(head))
    for r in rows:
        lines.append(
            f"{r['nodes']:>6} {r['ranks']:>6} {r['lost_fraction_plain']:>14.1%} "
            f"{r['lost_fraction_gc_sync']:>16.1%} {r['throughput_gc_sync']:>14.1f} "
            f"{r['gc_sync_throughput_ratio']:>14.4f} {r['p99_ms_gc_sync']:>10.1f}ms"
        )
    lines.append("waiting = share of step time ranks spend waiting at the sync point; no pacing in either")
    return "\n".join(lines)


def _mechanism(cfg: Any, rows: list[dict[str, Any]]) -> str:
    best = max(rows, key=lambda r: r["throughput_ratio"])
    if best["throughput_ratio"] <= 1.005:
        return (
            "pacing did not raise throughput anywhere in this sweep (best ratio "
            f"{best['throughput_ratio']:.4f}): holding early ranks cannot shorten a step the last rank sets, "
            "and this model has no contention that holding them would relieve"
            + (" (network.spin_contention = 0)" if cfg.network.spin_contention == 0 else "")
        )
    return (
        f"pacing raised throughput by up to {best['throughput_ratio'] - 1:.1%} (at {best['nodes']} nodes) "
        f"through the one modelled mechanism: busy-polling early ranks slow their node-mates' compute "
        f"(network.spin_contention = {cfg.network.spin_contention}); a pacing delay sleeps instead of polling"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.from_run:
            return _from_run(args)
        if not args.recipe:
            raise PacingConfigError("pass a recipe (e.g. recipes/simulate/paper.yaml) or --from-run RUN_DIR")
        return _sweep(args)
    except (PacingConfigError, RunRecordError, OSError) as error:
        print(f"pace simulate: error: {error}", file=sys.stderr)
        return 2


def _sweep(args: argparse.Namespace) -> int:
    from pace_strategy.settings import build, load_mapping
    from pace_strategy.sim.model import SimConfig
    from pace_strategy.sim.sweep import sweep

    cfg = build(SimConfig, load_mapping(args.recipe, args.overrides))
    started = time.monotonic()
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if not args.json else None

    def progress(msg: str) -> None:
        if log is not None:
            log(f"  {msg}  ({time.monotonic() - started:.1f} s)")

    rows = [r.to_dict() for r in sweep(cfg, progress=progress)]
    mechanism = _mechanism(cfg, rows)
    if args.json:
        print(
            json.dumps(
                {"recipe": args.recipe, "name": cfg.name, "rows": rows, "mechanism": mechanism}, indent=2
            )
        )
        return 0
    print(
        _table(
            rows, f"{cfg.name}: {cfg.gpus_per_node} GPUs per node, {cfg.steps} steps per run, seed {cfg.seed}"
        )
    )
    print(f"\n{mechanism}")
    return 0


def _from_run(args: argparse.Namespace) -> int:
    from pace_strategy.core.config import PacingConfig
    from pace_strategy.settings import build
    from pace_strategy.sim.calibrate import fit, oversubscription_factor, predict
    from pace_strategy.sim.model import NetworkModel
    from pace_strategy.telemetry.arrays import load_lines, sample_arrays, sample_steps

    if args.calibration_steps < 1:
        raise PacingConfigError(
            f"--calibration-steps {args.calibration_steps} is invalid: the fit needs at least 1 step"
        )
    lines = load_lines(args.from_run)  # the per-rank numbers of the sampled steps only are held
    arrays = sample_arrays(lines, sample_steps(lines.steps, args.calibration_steps))
    cal = fit(arrays)
    ranks = [int(x) for x in args.ranks.split(",") if x] or [cal.ranks, cal.ranks * 16, cal.ranks * 128]
    try:
        recorded = PacingConfig.from_dict(arrays.header.get("config") or {})
    except PacingConfigError as error:  # a record of an earlier version (flat names)
        print(
            f"pace simulate: the record's pacing config is not this version's ({error}); the paced "
            "what-if uses the default pacing settings",
            file=sys.stderr,
        )
        recorded = PacingConfig()
    # what-if "pacing on": the recorded controller settings, in adaptive mode whatever the run used
    pacing = recorded.replace(mode="adaptive")
    k = pacing.exchange_every_steps
    rows = []
    for n in ranks:
        plain = predict(cal, n, steps=args.steps, seed=args.seed, window_steps=k)
        paced = predict(cal, n, steps=args.steps, seed=args.seed, pacing=pacing)
        fixed = predict(cal, n, steps=args.steps, seed=args.seed, remove_stragglers=True, window_steps=k)
        row = {
            "ranks": n,
            "mean_step_ms": plain.mean_step_ms,
            "cv": plain.cv,
            "p99_ms": plain.p99_ms,
            "paced_throughput_ratio": paced.throughput / plain.throughput,
            "no_straggler_throughput_ratio": fixed.throughput / plain.throughput,
        }
        if args.oversubscription is not None:
            net = build(
                NetworkModel,
                {
                    "oversubscription": args.oversubscription,
                    "nodes_per_leaf": args.nodes_per_leaf,
                    "ring_order": args.ring_order,
                },
            )
            factor = oversubscription_factor(net, max(1, n // args.gpus_per_node))
            over = predict(cal, n, steps=args.steps, seed=args.seed, window_steps=k, transfer_factor=factor)
            row["oversubscribed_transfer_factor"] = factor
            row["oversubscribed_throughput_ratio"] = over.throughput / plain.throughput
        rows.append(row)
    if args.json:
        print(json.dumps({"fit": cal.report(), "rows": rows}, indent=2))
        return 0
    print(cal.report())
    over_head = f" {'oversubscribed/plain':>21}" if args.oversubscription is not None else ""
    print(
        f"\n{'ranks':>7} {'mean step':>10} {'CV':>7} {'p99':>9} {'paced/plain':>12} "
        f"{'no stragglers/plain':>20}{over_head}"
    )
    for r in rows:
        extra = (
            f" {r['oversubscribed_throughput_ratio']:>21.4f}"
            if "oversubscribed_throughput_ratio" in r
            else ""
        )
        print(
            f"{r['ranks']:>7} {r['mean_step_ms']:>8.2f}ms {r['cv']:>7.3f} {r['p99_ms']:>7.1f}ms "
            f"{r['paced_throughput_ratio']:>12.4f} {r['no_straggler_throughput_ratio']:>20.4f}{extra}"
        )
    print("throughput ratios are what-ifs against the calibrated job without pacing at the same rank count")

    return 0
