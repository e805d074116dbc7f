"""The demo: a real multi-process CPU Lightning run with an injected straggler, TensorBoard logs, summary.

Run it as ``pace demo`` (or ``python -m pace_strategy.demo``). Each rank trains a small MLP on random
data; ``--compute-ms`` adds a sleep to every step to stand in for accelerator time (it keeps the two
CPUs of a small machine from being the bottleneck); ``--straggler RANK:MS`` slows one rank down.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["QUIET_TRAINER", "build_parser", "main"]

#: Trainer settings of the demo and the recipes: step-bounded, no bar/summary/checkpoints, log every step.
QUIET_TRAINER: dict[str, Any] = {
    "max_epochs": -1,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pace demo",
        description="Train a small model on CPU ranks with an injected straggler and report the skew.",
    )
    p.add_argument("--devices", type=int, default=4, help="CPU processes (ranks) per node; default 4")
    p.add_argument(
        "--num-nodes",
        type=int,
        default=1,
        help="nodes (launch one process group per node with NODE_RANK set)",
    )
    p.add_argument("--steps", type=int, default=200, help="optimizer steps; default 200")
    p.add_argument("--straggler", default="2:30", help="RANK:MS[:PROB],... injected delay; '' for none")
    p.add_argument(
        "--straggler-local",
        default="",
        metavar="LOCAL:MS[:PROB]",
        help="slow this local rank index on every node (locality)",
    )
    p.add_argument("--data-delay", default="", metavar="RANK:MS[:PROB]", help="slow data loader on one rank")
    p.add_argument(
        "--compute-ms", type=float, default=20.0, help="emulated accelerator time per step (sleep)"
    )
    p.add_argument("--strategy", default="paced_ddp", help="paced_ddp, paced_ddp_spawn, or ddp (baseline)")
    p.add_argument("--root", default="runs/demo", help="directory for TensorBoard logs and the run record")
    p.add_argument("--name", default="demo", help="experiment name under --root")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256, help="MLP width")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--pacing",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="PacingConfig override, repeatable (e.g. --pacing mode=forced --pacing exchange_every_steps=8)",
    )
    p.add_argument("--save-weights", default=None, help="rank 0 saves the final state_dict here")
    p.add_argument("--fail-at", default=None, metavar="RANK:STEP", help="fault injection: RANK exits at STEP")
    p.add_argument("--step-times", default=None, help="rank 0 writes its per-step wall times (JSON) here")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--no-diagnosis", action="store_true", help="skip the diagnosis at the end")
    return p


def demo_net(hidden: int) -> Any:
    """The demo's model: an MLP from 64 inputs through two ``hidden``-wide layers to 10 classes."""
    from torch import nn

    return nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
    )


def _build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from pace_strategy.core.config import PacingConfig
    from pace_strategy.core.errors import PacingConfigError
    from pace_strategy.inject import Straggler, parse_stragglers
    from pace_strategy.integrations.lightning import InjectStraggler, PacedDDPStrategy
    from pace_strategy.settings import load_mapping

    compute_s = args.compute_ms / 1e3

    class DemoModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = demo_net(args.hidden)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            if compute_s > 0:
                time.sleep(compute_s)  # stands in for accelerator time
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    n = args.steps * args.batch_size * args.devices * args.num_nodes
    g = torch.Generator().manual_seed(1234)
    data = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
    loader = DataLoader(
        data,
        batch_size=args.batch_size,
        shuffle=False,
        collate_fn=_SlowCollate(parse_stragglers(args.data_delay)),
    )

    overrides = load_mapping(None, args.pacing)
    strategy: Any = args.strategy  # a registered name: "paced_ddp" uses the default PacingConfig
    if overrides and args.strategy in ("paced_ddp", "paced_ddp_spawn"):
        start = "spawn" if args.strategy.endswith("spawn") else "popen"
        strategy = PacedDDPStrategy(pacing=PacingConfig.from_dict(overrides), start_method=start)
    elif overrides:
        raise PacingConfigError(f"--pacing needs a paced strategy, not --strategy {args.strategy!r}")
    callbacks: list[Any] = []
    stragglers = parse_stragglers(args.straggler or "")
    if args.straggler_local:
        # local index -> global ranks, as the launcher numbers them: node_rank * devices + local_rank
        for s in parse_stragglers(args.straggler_local):
            for node in range(args.num_nodes):
                stragglers.append(
                    Straggler(
                        rank=node * args.devices + s.rank, delay_ms=s.delay_ms, probability=s.probability
                    )
                )
    if stragglers:
        callbacks.append(InjectStraggler(stragglers))
    callbacks.append(_Progress(args.steps, quiet=args.quiet))
    if args.fail_at:
        rank, _, step = args.fail_at.partition(":")
        callbacks.append(_FailAt(int(rank), int(step)))
    if args.save_weights:
        callbacks.append(_SaveWeights(args.save_weights))
    if args.step_times:
        callbacks.append(_StepTimes(args.step_times))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=args.steps,
        logger=L.pytorch.loggers.TensorBoardLogger(args.root, name=args.name),
        callbacks=callbacks,
        **QUIET_TRAINER,
    )
    return trainer, DemoModel(), loader


def _callback_base() -> type:
    import lightning as L

    return L.Callback


class _SlowCollate:
    """Default collation, plus an injected input delay on chosen ranks (a slow data loader)."""

    def __init__(self, stragglers: Sequence[Any]) -> None:
        self.stragglers = list(stragglers)
        self.calls = 0

    def __call__(self, items: Any) -> Any:
        from torch.utils.data import default_collate

        if self.stragglers:
            import torch.distributed as dist

            from pace_strategy.inject import sleep_injected

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            sleep_injected(self.stragglers, rank, self.calls)
        self.calls += 1
        return default_collate(items)


class _Progress(_callback_base()):  # type: ignore[misc]
    """Rank 0 prints a progress line every tenth of the run."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.quiet = total, quiet
        self.every = max(1, total // 10)
        self.t0 = time.monotonic()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.t0 = time.monotonic()

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        step = trainer.global_step
        if trainer.global_rank == 0 and not self.quiet and (step % self.every == 0 or step == self.total):
            print(f"  step {step:>5}/{self.total}  {time.monotonic() - self.t0:6.1f} s", flush=True)


class _FailAt(_callback_base()):  # type: ignore[misc]
    """Fault injection: the chosen rank exits abruptly (no cleanup), as a crashed process would."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step >= self.step:
            print(f"[rank {self.rank}] fault injection: exiting at step {trainer.global_step}", flush=True)
            os._exit(17)


class _SaveWeights(_callback_base()):  # type: ignore[misc]
    """Rank 0 saves the final full state_dict (FSDP shards are gathered first, on every rank)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        import torch
        from torch.distributed.tensor import DTensor

        state = pl_module.state_dict()
        # Every rank holds the same kind of parameters, so every rank takes the same branch here.
        if any(isinstance(v, DTensor) for v in state.values()):
            state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
        if trainer.global_rank == 0:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            torch.save({k: v.detach().clone() for k, v in state.items()}, self.path)


class _StepTimes(_callback_base()):  # type: ignore[misc]
    """Rank 0 records the wall time between consecutive batch ends: the same ruler for every strategy."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_rank == 0:
            self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        import json

        if trainer.global_rank == 0:
            steps_ms = [(b - a) * 1e3 for a, b in zip(self.ends[:-1], self.ends[1:], strict=True)]
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.path).write_text(json.dumps({"step_ms": steps_ms}))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # One intra-op thread per rank: threads x local ranks > cores makes every step several times slower.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import lightning as L

    import pace_strategy  # noqa: F401  (registers the strategies)
    from pace_strategy.telemetry.run_record import RECORD_FILENAME, read_run_record, summarize

    L.seed_everything(args.seed, verbose=False)
    trainer, model, loader = _build(args)
    is_launcher = os.environ.get("LOCAL_RANK") is None
    if is_launcher and not args.quiet:
        print(
            f"pace demo: {args.devices} CPU ranks, {args.steps} steps, strategy {args.strategy}, "
            f"straggler {args.straggler or 'none'}, emulated compute {args.compute_ms:g} ms/step",
            flush=True,
        )
    t0 = time.monotonic()
    trainer.fit(model, loader)
    if trainer.global_rank != 0:
        return 0
    log_dir = Path(trainer.logger.log_dir)
    record_path = log_dir / RECORD_FILENAME
    print(f"\ntrained {trainer.global_step} steps in {time.monotonic() - t0:.1f} s")
    if record_path.exists():
        summary = summarize(read_run_record(record_path))
        print(summary.table())
    else:
        print("  (no run record: the baseline strategy does not monitor)")
    if record_path.exists() and not args.no_diagnosis:
        from pace_strategy.diagnose import DiagnosisConfig, diagnose, load_arrays
        from pace_strategy.diagnose.report import render_report

        arrays = load_arrays(record_path)
        diagnosis = diagnose(arrays)
        report = render_report(arrays, diagnosis, log_dir / "pace_report", DiagnosisConfig())
        print(f"\n  diagnosis: {diagnosis.summary}")
        print(f"  report            {report['html']}")
    print(f"\n  TensorBoard logs  {log_dir}   (tensorboard --logdir {args.root})")
    if record_path.exists():
        print(f"  run record        {record_path}   (pace diagnose {log_dir})")
    return 0


if __name__ == "__main__":
    from pace_strategy.cli import main as cli_main

    sys.exit(cli_main(["demo", *sys.argv[1:]]))
