"""The demo: a real multi-process CPU Lightning run with an injected straggler, TensorBoard logs, summary.

Run it as ``pace demo`` (or ``python -m pace_strategy.apps.demo``). It is the built-in recipe of
:mod:`pace_strategy.apps.recipes` plus the command line's overrides: each rank trains the example MLP
on seeded random data; ``--compute-ms`` adds a sleep to every step to stand in for accelerator time
(it keeps the two CPUs of a small machine from being the bottleneck); ``--straggler RANK:MS`` slows one
rank down, by default inside its backward (``--straggler-phase``), where a real model's slow rank
loses its time. ``--scenario NAME`` starts from a preset of these options (:data:`SCENARIOS`; options
given on the command line still win): ``slow-device`` is one rank twice as slow per sample with
rebalancing on, and reports the shares and samples/s before and after; ``slow-backward`` is real
compute only (no sleep before the forward) with one rank slow in its backward.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pace_strategy.apps.recipe_schema import TrainRecipe
from pace_strategy.apps.recipes import one_thread_per_rank, run_lightning
from pace_strategy.core.config import PacingConfig
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.settings import build, load_mapping
from pace_strategy.shutdown import leave_without_finalization
from pace_strategy.testing import PHASES, Straggler, parse_slow_devices, parse_stragglers

__all__ = ["SCENARIOS", "build_parser", "demo_recipe", "main", "parse_args"]

#: ``--scenario`` presets: option defaults (dest -> value) that the command line overrides.
SCENARIOS: dict[str, dict[str, Any]] = {
    # Every rank's emulated compute scales with its samples (1 ms each, plus 2 ms per step); rank 1
    # takes twice as long per sample. Rebalancing, exchanging every 8 steps so that it decides within
    # the run, should move samples off rank 1 and raise samples/s (docs/rebalancing.md).
    "slow-device": {
        "devices": 2,
        "steps": 200,
        "straggler": "",
        "compute_ms": 2.0,
        "sample_ms": 1.0,
        "slow_device": "1:2",
        "name": "slow-device",
        "pacing": ["rebalance=true", "exchange_every_steps=8"],
    },
    # Real compute only: the MLP's own forward and backward, no emulated time; rank 1's backward
    # takes 16 ms longer after its first block, so its first gradient is on time and its arrival is
    # not (the case a first-gradient arrival read as healthy).
    "slow-backward": {
        "devices": 2,
        "steps": 120,
        "compute_ms": 0.0,
        "straggler": "1:16",
        "straggler_phase": "backward",
        "name": "slow-backward",
    },
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pace demo",
        description="Train a small model on CPU ranks with an injected straggler and report the skew.",
    )
    _job_arguments(p.add_argument_group("the job"))
    _fault_arguments(p.add_argument_group("injected faults"))
    _output_arguments(p.add_argument_group("strategy, pacing and output"))
    return p


def _job_arguments(g: argparse._ArgumentGroup) -> None:
    """The ranks, the steps and the model's work."""
    g.add_argument("--devices", type=int, default=4, help="CPU processes (ranks) per node; default 4")
    g.add_argument(
        "--num-nodes",
        type=int,
        default=1,
        help="nodes (launch one process group per node with NODE_RANK set)",
    )
    g.add_argument("--steps", type=int, default=200, help="optimizer steps; default 200")
    g.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default=None,
        help="start from a preset (slow-device: one rank 2x slower per sample, rebalancing on; "
        "slow-backward: real compute, one rank slow in its backward)",
    )
    g.add_argument(
        "--sample-ms", type=float, default=0.0, help="emulated accelerator time per sample (sleep)"
    )
    g.add_argument(
        "--compute-ms", type=float, default=20.0, help="emulated accelerator time per step (sleep)"
    )
    g.add_argument(
        "--gc-heap-objects", type=int, default=0, help="long-lived objects per rank (a GC-heavy job)"
    )
    g.add_argument(
        "--gc-garbage-objects",
        type=int,
        default=0,
        help="cyclic garbage objects per step per rank, on average (a GC-heavy job)",
    )
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--hidden", type=int, default=256, help="MLP width")
    g.add_argument("--seed", type=int, default=0)


def _fault_arguments(g: argparse._ArgumentGroup) -> None:
    """Stragglers, slow devices and loaders, a failing rank."""
    g.add_argument(
        "--straggler",
        default=None,
        help="RANK:MS[:PROB][@FIRST-LAST],... injected delay (@: only in those steps, an episode); '' for "
        "none; default: rank 2 (the last rank of a smaller run) 30 ms",
    )
    g.add_argument(
        "--straggler-local",
        default="",
        metavar="LOCAL:MS[:PROB]",
        help="slow this local rank index on every node (locality)",
    )
    g.add_argument(
        "--straggler-phase",
        choices=PHASES,
        default="backward",
        help="where the time of --straggler, --straggler-local and --slow-device goes: step (a sleep "
        "before the forward), backward (inside backward, after hidden block --inject-after; default), "
        "forward_backward (half in each)",
    )
    g.add_argument(
        "--inject-after",
        type=int,
        default=1,
        help="hidden block after which a backward straggler is slowed (1: the end of backward; default 1)",
    )
    g.add_argument("--spin", action="store_true", help="stragglers do real CPU work instead of sleeping")
    g.add_argument("--data-delay", default="", metavar="RANK:MS[:PROB]", help="slow data loader on one rank")
    g.add_argument(
        "--slow-device",
        default="",
        metavar="RANK:FACTOR",
        help="RANK takes FACTOR times --sample-ms per sample (a slow device; rebalancing's case)",
    )
    g.add_argument("--fail-at", default=None, metavar="RANK:STEP", help="fault injection: RANK exits at STEP")


def _output_arguments(g: argparse._ArgumentGroup) -> None:
    """What runs the job, how it is paced, where it writes."""
    g.add_argument(
        "--strategy",
        default="paced_ddp",
        help="paced_ddp, paced_ddp_spawn, paced_ddp_fork, paced_fsdp, or the baselines ddp, ddp_fork, "
        "fsdp; default paced_ddp",
    )
    g.add_argument("--root", default="runs/demo", help="directory for TensorBoard logs and the run record")
    g.add_argument("--name", default="demo", help="experiment name under --root")
    g.add_argument(
        "--pacing",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="PacingConfig override, repeatable (e.g. --pacing mode=forced --pacing exchange_every_steps=8)",
    )
    g.add_argument("--save-weights", default=None, help="rank 0 saves the final state_dict here")
    g.add_argument("--step-times", default=None, help="rank 0 writes its per-step wall times (JSON) here")
    g.add_argument("--log-loss", action="store_true", help="log the loss every step, as a user's job does")
    g.add_argument("--quiet", action="store_true", help="no progress lines")
    g.add_argument("--no-diagnosis", action="store_true", help="skip the diagnosis at the end")


def demo_recipe(args: argparse.Namespace) -> TrainRecipe:
    """The demo's job: the built-in recipe (a 2-hidden-layer MLP, 4 CPU ranks, 200 steps) with the
    command line's overrides; validated like any recipe, so a bad ``--pacing`` field names itself."""
    pacing = load_mapping(None, args.pacing)
    PacingConfig.from_dict(pacing)  # --pacing takes PacingConfig fields: errors name them as such
    values: dict[str, Any] = {
        "seed": args.seed,
        "trainer": {
            "devices": args.devices,
            "num_nodes": args.num_nodes,
            "strategy": args.strategy,
            "max_steps": args.steps,
        },
        "model": {
            "width": args.hidden,
            "depth": 2,
            "compute_ms": args.compute_ms,
            "sample_ms": args.sample_ms,
            "gc_heap_objects": args.gc_heap_objects,
            "gc_garbage_objects": args.gc_garbage_objects,
            "inject_after": args.inject_after,
        },
        "data": {"batch_size": args.batch_size},
        "output": {"root": args.root, "name": args.name, "save_weights": args.save_weights},
        "pacing": pacing,
    }
    recipe = build(TrainRecipe, values)
    if recipe.pacing and not recipe.paced:
        raise PacingConfigError(f"--pacing needs a paced strategy, not --strategy {args.strategy!r}")
    return recipe


def default_straggler(devices: int, num_nodes: int) -> str:
    """``--straggler``'s default: rank 2 (or the last rank of a smaller run) 30 ms late; none on one rank."""
    world = devices * num_nodes
    return f"{min(2, world - 1)}:30" if world > 1 else ""


def _check_ranks(flag: str, stragglers: Sequence[Straggler], limit: int, what: str = "rank") -> None:
    """Every straggler of ``flag`` names a ``what`` in ``0..limit-1``, or the run would inject nothing
    and report a healthy run without a word."""
    counted = "--devices" if what == "local index" else "--devices x --num-nodes"
    for s in stragglers:
        if not 0 <= s.rank < limit:
            raise PacingConfigError(
                f"{flag}: {what} {s.rank} does not exist in this run: expected 0..{limit - 1} ({counted})"
            )


def _stragglers(args: argparse.Namespace) -> list[Straggler]:
    """``--straggler`` plus ``--straggler-local`` (that local index on every node), spent where
    ``--straggler-phase`` says, as sleeps or (``--spin``) CPU work. A rank or local index outside the
    run is an error naming the flag and the valid range."""
    world = args.devices * args.num_nodes
    stragglers = parse_stragglers(_straggler_text(args))
    _check_ranks("--straggler", stragglers, world)
    local = parse_stragglers(args.straggler_local)
    _check_ranks("--straggler-local", local, args.devices, "local index")
    # local index -> global ranks, as the launcher numbers them: node_rank * devices + local_rank
    for s in local:
        for node in range(args.num_nodes):
            rank = node * args.devices + s.rank
            stragglers.append(dataclasses.replace(s, rank=rank))
    placed = [dataclasses.replace(s, phase=args.straggler_phase, spin=args.spin) for s in stragglers]
    slow = [
        dataclasses.replace(s, spin=args.spin) for s in parse_slow_devices(args.slow_device, args.sample_ms)
    ]
    _check_ranks("--slow-device", slow, world)
    return placed + slow


def _straggler_text(args: argparse.Namespace) -> str:
    return default_straggler(args.devices, args.num_nodes) if args.straggler is None else args.straggler


def _callbacks(args: argparse.Namespace) -> list[Any]:
    from pace_strategy.apps.lightning_job import FailAt, LogLoss, StepTimes

    callbacks: list[Any] = [LogLoss()] if args.log_loss else []
    if args.fail_at:
        rank, _, step = args.fail_at.partition(":")
        callbacks.append(FailAt(int(rank), int(step)))
    if args.step_times:
        callbacks.append(StepTimes(args.step_times))
    return callbacks


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, over the ``--scenario`` preset when one is named."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.scenario is not None:
        parser.set_defaults(**SCENARIOS[args.scenario])
        args = parser.parse_args(argv)
    return args


#: third-party warnings a demo user can do nothing about, hidden in the demo's own processes (every
#: rank runs main): (message regex, category). The library itself filters nothing.
KNOWN_WARNINGS = (
    # torch 2.13 deprecates LeafSpec, which Lightning 2.6's _pytree still builds at every step
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
)


def quiet_known_warnings() -> None:
    """Hide :data:`KNOWN_WARNINGS` in this process, so that a newcomer sees the demo's own output."""
    for message, category in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        recipe = demo_recipe(args)
        stragglers = _stragglers(args)
        data_stragglers = parse_stragglers(args.data_delay)
        _check_ranks("--data-delay", data_stragglers, args.devices * args.num_nodes)
    except PacingConfigError as error:
        print(f"pace demo: error: {error}", file=sys.stderr)
        return 2
    one_thread_per_rank()
    quiet_known_warnings()
    is_launcher = os.environ.get("LOCAL_RANK") is None
    if is_launcher and not args.quiet:
        print(
            f"pace demo: {args.devices} CPU ranks, {args.steps} steps, strategy {args.strategy}, "
            f"straggler {_straggler_text(args) or 'none'}, emulated compute {args.compute_ms:g} ms/step",
            flush=True,
        )
    t0 = time.monotonic()
    trainer = run_lightning(
        recipe,
        stragglers=stragglers,
        data_stragglers=data_stragglers,
        callbacks=_callbacks(args),
        quiet=args.quiet,
    )
    if trainer.global_rank == 0:
        _report(args, trainer, time.monotonic() - t0)
    leave_without_finalization(0)


def recipe_rebalances(args: argparse.Namespace) -> bool:
    """Whether the demo's pacing turns rebalancing on."""
    return PacingConfig.from_dict(load_mapping(None, args.pacing)).rebalance.enabled


def _report(args: argparse.Namespace, trainer: Any, elapsed_s: float) -> None:
    """Rank 0: the summary, the diagnosis and where the logs are."""
    from pace_strategy.telemetry.run_record import RECORD_FILENAME, read_run_record, summarize

    log_dir = Path(trainer.logger.log_dir)
    record_path = log_dir / RECORD_FILENAME
    record = read_run_record(record_path) if record_path.exists() else None
    # a spawned or forked rank 0 trained, not this launcher: its record says how far it got
    steps = trainer.global_step if record is None else len(record.steps)
    print(f"\ntrained {steps} steps in {elapsed_s:.1f} s")
    if record is not None:
        print(summarize(record).table())
    else:
        print("  (no run record: the baseline strategy does not monitor)")
    if record is not None and not args.no_diagnosis:
        from pace_strategy.diagnose import DiagnosisConfig
        from pace_strategy.diagnose.findings import diagnose_run
        from pace_strategy.diagnose.report import render_report
        from pace_strategy.telemetry.arrays import load_lines

        lines = load_lines(record_path)  # its per-rank numbers read a block of steps at a time
        diagnosis, digest = diagnose_run(lines)
        report = render_report(lines, diagnosis, log_dir / "pace_report", DiagnosisConfig(), digest)
        print(f"\n  diagnosis: {diagnosis.summary}")
        print(f"  report            {report['html']}")
    if record is not None and recipe_rebalances(args):
        from pace_strategy.data.phases import describe_phases, share_phases

        print("\n  rebalancing (per-rank samples per step, as trained):")
        print("\n".join(describe_phases(share_phases(record.steps))))
    print(f"\n  TensorBoard logs  {log_dir}   (tensorboard --logdir {args.root})")
    if record is not None:
        print(f"  run record        {record_path}   (pace diagnose {log_dir})")


if __name__ == "__main__":
    sys.exit(main())
