"""Rebalancing exactness jobs (2 CPU ranks): ``python rebalance_job.py OUT`` (Lightning, Fabric),
``accelerate launch ... rebalance_job.py OUT accelerate`` (Accelerate's ``attach_pacing``) and
``accelerate launch ... rebalance_job.py OUT trainer`` (``transformers.Trainer`` with PacingCallback).

Trainer fits in the same two processes, each from the same seeded model: (1) ``rebalance=True``
with a fixed uneven schedule changed twice during the run (the decision is held off, so that only
the test's entries apply), checkpointed mid-epoch, (2) resumed from that checkpoint, (3)
``paced_ddp`` with ``rebalance=False`` and (4) stock ``ddp``; then (5) Fabric's ``paced_ddp`` with
``rebalance=True`` and the same schedule; under accelerate, the same with ``attach_pacing``, and
once more in ``accelerator.accumulate`` (2 micro-batches per step, its own schedule); under the
Trainer, a tiny GPT-2 built from a config trained twice with gradient accumulation 2, its loss
normalized over the global batch by the Trainer ("trainer") and, with ``accepts_loss_kwargs =
False``, each rank's own mean ("trainer_mean"). Cost-balanced batches (``balance``, rebalancing off)
in each: a Lightning fit ("balanced"), a Fabric loop ("fabric_balanced"), an Accelerate loop with 2
micro-batches per step ("accelerate_balanced") and a Trainer run ("trainer_balanced"), on datasets
whose ``lengths`` attribute gives every sample a different length (the model itself sees fixed-size
inputs: these runs check the split and the math, not the speed). Each rank writes the dataset
indices of every batch it trained and rank 0 the final weights, under OUT.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pace_strategy.integrations.lightning import PacedDDPStrategy
from pace_strategy.shutdown import leave_without_finalization

SAMPLES = 100  # 6 full steps of 16 and a partial one of 4 per epoch
BATCH = 8  # per rank: a global batch of 16
EPOCHS = 2
LR = 0.1
#: the fixed schedule: (from step, shares); steps 0-2 even, then uneven, then the other way round
ENTRIES = ((3, (12, 4)), (9, (3, 13)))
#: the rebalanced fit checkpoints after this many steps (mid-epoch, after the first share change);
#: the "resumed" fit continues from there
SAVE_AT = 5
#: rebalancing on, its own decision held off (only the fixed entries apply)
PACING = {"rebalance": {"enabled": True, "persist_windows": 10_000}, "exchange_every_steps": 4}
#: cost-balanced batches alone (padded: the split gives the ranks unequal counts), every step, at the
#: configured cost (the tests recompute each split): the A/B check, which would run plain slices for
#: some steps, is tested in tests/unit/test_balance_check.py, the online fit in test_cost_fit.py
BALANCE = {
    "balance": {"enabled": True, "layout": "padded", "verify": False, "fit": False},
    "exchange_every_steps": 4,
}
#: the same with balancing's A/B check on ("balanced_checked", Lightning): arms of 2 windows of 4 steps
CHECKED = {**BALANCE, "balance": {**BALANCE["balance"], "verify": True}, "warmup_steps": 1}
#: epochs of the checked fit: room for the check's four arms and its verdict (7 steps an epoch)
CHECKED_EPOCHS = 12


def lengths(samples: int) -> list[int]:
    """Every sample a different length, 16-511 tokens, long and short mixed (distinct lengths: the
    split of a global batch does not depend on the order its samples were drawn in)."""
    return [16 + (37 * i) % 496 for i in range(samples)]


def dataset(with_lengths: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(SAMPLES, 6, generator=g)
    data = TensorDataset(x, torch.randint(0, 3, (SAMPLES,), generator=g), torch.arange(SAMPLES))
    if with_lengths:
        data.lengths = lengths(SAMPLES)  # type: ignore[attr-defined]
    return data


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = net()
        self.trained: list[dict[str, Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.trained.append({"step": self.trainer.global_step, "indices": idx.tolist()})
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class FixedShares(L.Callback):
    """Adds the test's entries before the first batch is built (identically on every rank), and saves
    a checkpoint to ``save`` after step SAVE_AT (the resumed fit gets the entries from it)."""

    def __init__(self, save: Path) -> None:
        self.save = save

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rebalance = trainer.strategy.pacing.rebalance  # type: ignore[attr-defined]
        assert rebalance is not None and rebalance.schedule is not None, "rebalancing is not attached"
        for from_step, shares in ENTRIES:
            rebalance.schedule.add(from_step, shares, "test")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == SAVE_AT:
            trainer.save_checkpoint(self.save)


def fit(name: str, out: Path) -> None:
    callbacks: list[L.Callback] = []
    checkpoint = out / "rebalanced.ckpt"
    if name in ("rebalanced", "resumed"):
        strategy: Any = PacedDDPStrategy(pacing=PACING)
        if name == "rebalanced":
            callbacks.append(FixedShares(checkpoint))
    elif name == "paced":
        strategy = PacedDDPStrategy(pacing={"rebalance": False, "exchange_every_steps": 4})
    elif name == "balanced":
        strategy = PacedDDPStrategy(pacing=BALANCE)
    elif name == "balanced_checked":
        strategy = PacedDDPStrategy(pacing=CHECKED, run_dir=out / name)
    else:
        strategy = "ddp"
    L.seed_everything(3, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=CHECKED_EPOCHS if name == "balanced_checked" else EPOCHS,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    module = Module()
    resume = checkpoint if name == "resumed" else None
    data = dataset(with_lengths=name.startswith("balanced"))
    trainer.fit(module, DataLoader(data, batch_size=BATCH, shuffle=True), ckpt_path=resume)
    rank = trainer.global_rank
    (out / f"{name}_rank{rank}.json").write_text(json.dumps(module.trained))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in module.net.state_dict().items()}, out / f"{name}.pt")


def train_loop(
    loader: Iterable[Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    backward: Callable[[Any], Any],
    context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> list[dict[str, Any]]:
    """EPOCHS of plain SGD steps through ``backward`` (Fabric's or Accelerate's), each batch inside
    ``context`` (Accelerate's ``accumulate``); the sample indices each batch trained, in order."""
    trained, step = [], 0
    for _ in range(EPOCHS):
        for x, y, idx in loader:
            with context():
                trained.append({"step": step, "indices": idx.tolist()})
                backward(nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                state = getattr(optimizer, "gradient_state", None)  # accelerate's, under a GradScaler
                if state is not None and state.sync_gradients and optimizer.step_was_skipped:
                    trained[-1]["skipped"] = True
                optimizer.zero_grad()
            step += 1
    return trained


def fabric_fit(out: Path, balanced: bool = False) -> None:
    from lightning.fabric import Fabric

    from pace_strategy.integrations.fabric import PacedFabricDDPStrategy, finish_pacing

    name = "fabric_balanced" if balanced else "fabric"
    strategy = PacedFabricDDPStrategy(pacing=BALANCE if balanced else PACING)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(3, verbose=False)
    model = net()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    loader = fabric.setup_dataloaders(DataLoader(dataset(balanced), batch_size=BATCH, shuffle=True))
    rebalance = strategy.pacing.rebalance
    assert rebalance is not None and rebalance.schedule is not None, "rebalancing is not attached"
    for from_step, shares in () if balanced else ENTRIES:
        rebalance.schedule.add(from_step, shares, "test")
    trained = train_loop(loader, model, optimizer, fabric.backward)
    finish_pacing(fabric)
    (out / f"{name}_rank{fabric.global_rank}.json").write_text(json.dumps(trained))
    if fabric.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, out / f"{name}.pt")


#: the accumulating Accelerate job: 2 micro-batches per optimizer step, whole steps only (drop_last:
#: 6 micro-batches of 16, 3 steps, per epoch); shares change at steps 1 and 4 of 6
ACCUMULATE = 2
ACCUMULATE_ENTRIES = ((1, (12, 4)), (4, (3, 13)))


def accelerate_fit(out: Path, accumulate: bool = False, balanced: bool = False) -> None:
    """``attach_pacing`` on a plain loop, or (``accumulate``) one in ``accelerator.accumulate`` with
    ACCUMULATE micro-batches per step: rebalancing takes them from the Accelerator. ``balanced``:
    cost-balanced batches instead of the fixed schedule (with ``accumulate``: per micro-batch)."""
    from accelerate import Accelerator

    from pace_strategy.core.config import PacingConfig
    from pace_strategy.integrations.accelerate import attach_pacing

    name, entries = ("accelerate_accumulate", ACCUMULATE_ENTRIES) if accumulate else ("accelerate", ENTRIES)
    if balanced:
        name, entries = "accelerate_balanced", ()
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE if accumulate else 1)
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(dataset(balanced), batch_size=BATCH, shuffle=True, drop_last=accumulate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = PacingConfig.from_dict(BALANCE if balanced else PACING)
    handle = attach_pacing(accelerator, model, config, optimizer=optimizer, dataloaders=[loader], run_dir=out)
    assert handle.rebalance is not None and handle.rebalance.schedule is not None, (
        "rebalancing is not attached"
    )
    for from_step, shares in entries:
        handle.rebalance.schedule.add(from_step, shares, "test")
    trained = train_loop(
        loader, model, optimizer, accelerator.backward, lambda: accelerator.accumulate(model)
    )
    handle.finish()
    rank = accelerator.process_index
    (out / f"{name}_rank{rank}.json").write_text(json.dumps(trained))
    if rank == 0:
        weights = accelerator.unwrap_model(model).state_dict()
        torch.save({k: v.detach().clone() for k, v in weights.items()}, out / f"{name}.pt")


#: the optimizer steps the fp16 job's scaler skips (its first two; 2 micro-batches per step)
FP16_SKIPS = 2


def accelerate_fp16_fit(out: Path) -> None:
    """The fp16 path of a GPU on CPU: accelerate's own optimizer wrapper and ``backward`` with a real
    ``GradScaler`` (accelerate gives CPU none), whose first steps are skipped as fp16 training's are
    at its first scales: the optimizer's own step does not run there, yet each is an optimizer step
    of the loop (its gradients were synchronized). In ``accelerator.accumulate`` (ACCUMULATE
    micro-batches per step), rebalancing on with the accumulating schedule; each rank writes its
    micro-batches and which of them ended a step the scaler skipped."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    from pace_strategy.core.config import PacingConfig
    from pace_strategy.integrations.accelerate import attach_pacing

    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE)
    model = net()
    loader = DataLoader(dataset(), batch_size=BATCH, shuffle=True, drop_last=True)
    model, prepared, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR), loader)
    scaler = torch.amp.GradScaler("cpu", growth_interval=10_000)
    accelerator.scaler = scaler
    # fp16's overflow at the first scales, made certain: on rank 0 the first micro-batch of each of
    # the first FP16_SKIPS steps gives one gradient an inf (DDP's all-reduce spreads it at the step's
    # sync), so the scaler skips those steps on every rank
    backwards = [0]
    inf_at = {s * ACCUMULATE for s in range(FP16_SKIPS)} if accelerator.process_index == 0 else set()

    def overflow(grad: torch.Tensor) -> torch.Tensor:
        backwards[0] += 1
        return torch.full_like(grad, float("inf")) if backwards[0] - 1 in inf_at else grad

    accelerator.unwrap_model(model)[0].bias.register_hook(overflow)
    optimizer = AcceleratedOptimizer(prepared.optimizer, device_placement=False, scaler=scaler)
    config = PacingConfig.from_dict(PACING)
    handle = attach_pacing(
        accelerator, model, config, optimizer=optimizer, dataloaders=[loader], run_dir=out / "fp16"
    )
    assert handle.rebalance is not None and handle.rebalance.schedule is not None
    for from_step, shares in ACCUMULATE_ENTRIES:
        handle.rebalance.schedule.add(from_step, shares, "test")
    trained = train_loop(
        loader, model, optimizer, accelerator.backward, lambda: accelerator.accumulate(model)
    )
    skipped = [t // ACCUMULATE for t, b in enumerate(trained) if b.get("skipped")]
    handle.finish()
    (out / f"accelerate_fp16_rank{accelerator.process_index}.json").write_text(json.dumps(trained))
    (out / f"accelerate_fp16_skipped_rank{accelerator.process_index}.json").write_text(json.dumps(skipped))


#: the Trainer jobs: per-rank micro-batch, accumulation, steps and their fixed schedule (per micro-batch
#: global batch of 8; shares change at steps 2 and 5 of 8)
TRAINER_BATCH, TRAINER_ACCUMULATE, TRAINER_STEPS = 4, 2, 8
TRAINER_ENTRIES = ((2, (6, 2)), (5, (1, 7)))
TOKENS, VOCAB = 8, 64


def token_dataset(with_lengths: bool = False) -> torch.utils.data.Dataset[dict[str, Any]]:
    """256 fixed sequences of TOKENS tokens; each item its own labels and its index (``with_lengths``:
    a ``lengths`` attribute for cost-balanced batches)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (256, TOKENS), generator=g)
    sample_lengths = lengths(len(ids)) if with_lengths else None

    class Tokens(torch.utils.data.Dataset[dict[str, Any]]):
        lengths = sample_lengths

        def __len__(self) -> int:
            return len(ids)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": ids[i], "labels": ids[i], "idx": i}

    return Tokens()


def gpt2() -> Any:
    """The tiny GPT-2 (no dropout), seeded: the same weights in the job and in the test's reference."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=TOKENS, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def trainer_fit(out: Path, name: str, mean_loss: bool, balanced: bool = False) -> None:
    from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from pace_strategy.core.config import PacingConfig
    from pace_strategy.integrations.huggingface import PacingCallback

    trained: list[list[int]] = []  # every micro-batch's indices, in order

    # "ForCausalLM" in the name: transformers takes a model's loss type from its class name, and the
    # Trainer then counts the shifted labels (7 per sequence), the items the causal LM loss divides by.
    class RecordingForCausalLM(GPT2LMHeadModel):
        accepts_loss_kwargs = not mean_loss  # the Trainer's own switch (see trainer_loop)

        def forward(self, input_ids=None, labels=None, idx=None, **kwargs):  # type: ignore[no-untyped-def]
            trained.append(idx.tolist())
            return super().forward(input_ids=input_ids, labels=labels, **kwargs)

    model = RecordingForCausalLM(gpt2().config)
    model.load_state_dict(gpt2().state_dict())
    args = TrainingArguments(
        output_dir=str(out / name), report_to=[], per_device_train_batch_size=TRAINER_BATCH,
        gradient_accumulation_steps=TRAINER_ACCUMULATE, max_steps=TRAINER_STEPS, optim="sgd",
        learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0, save_strategy="no",
        use_cpu=True, disable_tqdm=True, dataloader_drop_last=True, seed=3,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(balanced))
    pacing_values = BALANCE if balanced else {**PACING, "rebalance": {**PACING["rebalance"], "quantum": 1}}
    pacing = PacingCallback(trainer, PacingConfig.from_dict(pacing_values), run_dir=out / name)
    trainer.add_callback(pacing)

    class FixedTrainerShares(TrainerCallback):  # after PacingCallback: its on_train_begin attached
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            assert pacing.handle is not None and pacing.handle.rebalance is not None
            schedule = pacing.handle.rebalance.schedule
            assert schedule is not None, "rebalancing is not attached"
            for from_step, shares in () if balanced else TRAINER_ENTRIES:
                schedule.add(from_step, shares, "test")

    trainer.add_callback(FixedTrainerShares())
    trainer.train()
    rank = trainer.args.process_index
    (out / f"{name}_rank{rank}.json").write_text(json.dumps(trained))
    if rank == 0:
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save(weights, out / f"{name}.pt")


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    if sys.argv[2:] == ["accelerate"]:
        accelerate_fit(out)
        accelerate_fit(out, accumulate=True)
        accelerate_fit(out, accumulate=True, balanced=True)
        accelerate_fp16_fit(out)
        leave_without_finalization(0)
    if sys.argv[2:] == ["trainer"]:
        trainer_fit(out, "trainer", mean_loss=False)
        trainer_fit(out, "trainer_mean", mean_loss=True)
        trainer_fit(out, "trainer_balanced", mean_loss=False, balanced=True)
        leave_without_finalization(0)
    for name in ("rebalanced", "resumed", "paced", "ddp", "balanced", "balanced_checked"):
        fit(name, out)
    fabric_fit(out)
    fabric_fit(out, balanced=True)
    leave_without_finalization(0)  # gloo's finalization race (see there)


if __name__ == "__main__":
    main()
