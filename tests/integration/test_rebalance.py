"""Rebalancing's exact math with real Lightning DDP, Fabric, Accelerate and transformers.Trainer (2 CPU
processes, gloo): one run of ``rebalance_job.py`` (four fits in the same processes), its Accelerate job
and its Trainer job, read by several tests."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from pace_strategy.data.balance import Balancer, SampleCost
from pace_strategy.data.phases import share_phases
from pace_strategy.telemetry import read_run_record
from pace_strategy.telemetry.schema import batch_share_tag
from tests.integration import rebalance_job as job
from tests.integration.helpers import (
    ACCELERATE_CPU_CONFIG,
    demo_command,
    free_port,
    only_version_dir,
    read_scalars,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

#: float32 weights after 14 SGD steps: DDP's all-reduce and a single process sum the same terms in a
#: different order, so they agree to rounding, not to the bit.
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The four launches at once (Lightning + Fabric; Accelerate; Trainer; the slow-device demo), into
    one directory (the demo's under runs/)."""
    out = tmp_path_factory.mktemp("rebalance")
    config = out / "accelerate.yaml"
    config.write_text(ACCELERATE_CPU_CONFIG.format(kind="MULTI_GPU"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", ACCELERATE_USE_CPU="1")
    script = str(Path(job.__file__))
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    commands = {
        "demo": demo_command(out, "--scenario", "slow-device", "--steps", "64", "--quiet"),
        "lightning": [sys.executable, script, str(out)],
        "accelerate": [*accelerate, "--main_process_port", str(free_port()), script, str(out), "accelerate"],
        "trainer": [*accelerate, "--main_process_port", str(free_port()), script, str(out), "trainer"],
    }
    started = {
        name: subprocess.Popen(
            command, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, command in commands.items()
    }
    for name, process in started.items():
        try:
            output, _ = process.communicate(timeout=150)
        finally:
            process.kill()  # only on a timeout: the others are done
        assert process.returncode == 0, f"{name} job failed:\n{output[-4000:]}"
        (out / f"{name}.out").write_text(output)
    return out


def _trained(run: Path, name: str) -> list[list[dict]]:
    return [json.loads((run / f"{name}_rank{r}.json").read_text()) for r in (0, 1)]


def _expected_shares(step: int) -> tuple[int, int]:
    shares = (8, 8)
    for from_step, entry in job.ENTRIES:
        if step >= from_step:
            shares = entry
    return shares


@pytest.mark.parametrize("name", ["rebalanced", "fabric", "accelerate"])
def test_each_rank_trains_its_scheduled_share_and_every_sample_once_per_epoch(run, name):
    ranks = _trained(run, name)
    steps_per_epoch = -(-job.SAMPLES // (2 * job.BATCH))
    assert [b["step"] for b in ranks[0]] == list(range(job.EPOCHS * steps_per_epoch))
    epochs = []
    for t, (a, b) in enumerate(zip(*ranks, strict=True)):
        sizes = (len(a["indices"]), len(b["indices"]))
        if t % steps_per_epoch == steps_per_epoch - 1:  # the partial step: 4 samples, split by share
            assert sum(sizes) == job.SAMPLES % (2 * job.BATCH) and min(sizes) >= 1
        else:
            assert sizes == _expected_shares(t), f"step {t}"
        if t % steps_per_epoch == 0:
            epochs.append([])
        epochs[-1] += a["indices"] + b["indices"]
    for seen in epochs:
        assert sorted(seen) == list(range(job.SAMPLES))
    assert epochs[0] != epochs[1], "set_epoch did not reach the sampler: the same order twice"


@pytest.mark.parametrize("name", ["rebalanced", "fabric", "accelerate"])
def test_rebalanced_ddp_matches_one_process_trained_on_the_same_global_batches(run, name):
    ranks = _trained(run, name)
    got = torch.load(run / f"{name}.pt")
    for key, want in _single_process(ranks, scaled=True).items():
        torch.testing.assert_close(got[key], want, rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}")
    # and the scale mattered: DDP's plain mean of the two ranks' means is another update
    unscaled = _single_process(ranks, scaled=False)
    assert max((got[k] - unscaled[k]).abs().max().item() for k in got) > 100 * ATOL


def _single_process(ranks: list[list[dict]], scaled: bool) -> dict[str, torch.Tensor]:
    """One process trained on each step's global batch (the ranks' batches together): the mean over
    its samples, or (``scaled=False``) the mean of the ranks' own means."""
    x, y, _ = job.dataset().tensors
    reference = job.net()
    optimizer = torch.optim.SGD(reference.parameters(), lr=job.LR)
    for a, b in zip(*ranks, strict=True):
        optimizer.zero_grad()
        parts = [torch.tensor(a["indices"]), torch.tensor(b["indices"])]
        if scaled:
            batch = torch.cat(parts)
            loss = nn.functional.cross_entropy(reference(x[batch]), y[batch])
        else:
            loss = sum(nn.functional.cross_entropy(reference(x[p]), y[p]) for p in parts) / 2
        loss.backward()
        optimizer.step()
    return reference.state_dict()


def _accumulated_steps(run: Path, name: str, k: int) -> list[list[list[int]]]:
    """Per optimizer step of ``k`` micro-batches, each rank's indices over the step's micro-batches
    (the Trainer jobs record each micro-batch's indices, the Accelerate job each batch's record)."""
    per_rank = [json.loads((run / f"{name}_rank{r}.json").read_text()) for r in (0, 1)]
    per_rank = [[b["indices"] if isinstance(b, dict) else b for b in batches] for batches in per_rank]
    steps = range(len(per_rank[0]) // k)
    return [[list(itertools.chain(*batches[t * k : (t + 1) * k])) for batches in per_rank] for t in steps]


def _trainer_steps(run: Path, name: str) -> list[list[list[int]]]:
    return _accumulated_steps(run, name, job.TRAINER_ACCUMULATE)


def _check_accumulated_shares(run: Path, name: str) -> list[list[list[int]]]:
    """Every micro-batch of a step of job ``name`` (``accelerator.accumulate``) has the step's
    scheduled shares, and every sample is trained once per epoch; returns the steps."""
    steps = _accumulated_steps(run, name, job.ACCUMULATE)
    per_epoch = job.SAMPLES // (2 * job.BATCH * job.ACCUMULATE)  # drop_last: whole steps only
    assert len(steps) == job.EPOCHS * per_epoch
    for t, (a, b) in enumerate(steps):
        shares = (job.BATCH,) * 2
        for from_step, entry in job.ACCUMULATE_ENTRIES:
            shares = entry if t >= from_step else shares
        assert (len(a), len(b)) == tuple(job.ACCUMULATE * n for n in shares), f"step {t}"
    for epoch in range(job.EPOCHS):
        seen = list(itertools.chain(*itertools.chain(*steps[epoch * per_epoch : (epoch + 1) * per_epoch])))
        assert len(seen) == len(set(seen)) == per_epoch * 2 * job.BATCH * job.ACCUMULATE
    return steps


def test_accelerate_accumulation_takes_its_micro_batches_from_the_accelerator(run):
    """``accelerator.accumulate`` with 2 micro-batches per step and no RebalanceLoop: every micro-batch
    of a step has the step's shares, and the weights are one process's on each step's 32 samples."""
    steps = _check_accumulated_shares(run, "accelerate_accumulate")
    got = torch.load(run / "accelerate_accumulate.pt")
    merged = [[{"indices": part} for part in parts] for parts in zip(*steps, strict=True)]
    for key, want in _single_process(merged, scaled=True).items():
        torch.testing.assert_close(got[key], want, rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}")
    unscaled = _single_process(merged, scaled=False)
    assert max((got[k] - unscaled[k]).abs().max().item() for k in got) > 100 * ATOL


@pytest.mark.parametrize("name", ["trainer", "trainer_mean"])
def test_trainer_ranks_train_their_shares_of_each_accumulated_step(run, name):
    steps = _trainer_steps(run, name)
    # the tags follow the Trainer's own logging interval (logging_steps, 500 unless set)
    assert read_run_record(run / name).header["config"]["tag_every_steps"] == 500
    assert len(steps) == job.TRAINER_STEPS
    seen: list[int] = []
    for t, (a, b) in enumerate(steps):
        shares = (job.TRAINER_BATCH,) * 2
        for from_step, entry in job.TRAINER_ENTRIES:
            shares = entry if t >= from_step else shares
        # every micro-batch of step t has the step's shares
        assert (len(a), len(b)) == tuple(job.TRAINER_ACCUMULATE * n for n in shares), f"step {t}"
        seen += a + b
    assert len(seen) == len(set(seen)), "a sample was trained twice in one epoch"


@pytest.mark.parametrize("name", ["trainer", "trainer_mean"])
def test_rebalanced_trainer_matches_one_process_on_the_same_global_batches(run, name):
    """Both of the Trainer's loss normalizations give the global mean: over the global batch's tokens
    (the Trainer's own, no share factor) and each rank's mean times the share factor."""
    got = torch.load(run / f"{name}.pt")
    steps = _trainer_steps(run, name)
    want = _trainer_single_process(steps, scaled=True)
    for key in want:
        torch.testing.assert_close(
            got[key], want[key], rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}"
        )
    unscaled = _trainer_single_process(steps, scaled=False)
    assert max((got[k] - unscaled[k]).abs().max().item() for k in want) > 100 * ATOL


def _trainer_single_process(steps: list[list[list[int]]], scaled: bool) -> dict[str, torch.Tensor]:
    """The tiny GPT-2 trained in one process by plain SGD, each step on its global batch: the mean
    loss over all its tokens, or (``scaled=False``) the mean of the ranks' own means."""
    data = job.token_dataset()
    ids = torch.stack([data[i]["input_ids"] for i in range(len(data))])  # type: ignore[arg-type]
    model = job.gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=job.LR)
    for parts in steps:
        optimizer.zero_grad()
        if scaled:
            batch = ids[torch.tensor(list(itertools.chain(*parts)))]
            loss = model(input_ids=batch, labels=batch).loss
        else:
            loss = sum(model(input_ids=ids[p], labels=ids[p]).loss for p in map(torch.tensor, parts)) / 2
        loss.backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_resume_mid_epoch_continues_with_the_same_batches_shares_and_weights(run):
    whole, resumed = _trained(run, "rebalanced"), _trained(run, "resumed")
    # the resumed fit added no entries: its shares and position came from the checkpoint
    for rank in (0, 1):
        assert resumed[rank] == whole[rank][job.SAVE_AT :]
    got, want = torch.load(run / "resumed.pt"), torch.load(run / "rebalanced.pt")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_rebalance_off_is_bit_identical_to_plain_ddp(run):
    assert _trained(run, "paced") == _trained(run, "ddp")
    paced, plain = torch.load(run / "paced.pt"), torch.load(run / "ddp.pt")
    assert paced.keys() == plain.keys()
    for key in paced:
        assert torch.equal(paced[key], plain[key]), key


def test_slow_device_demo_names_the_straggler_and_moves_samples_off_it(run):
    output = (run / "demo.out").read_text()
    # named while it trains; once the split moves samples off it, the summary's straggler may be either
    assert "rank 1 is a persistent straggler" in output
    assert "rebalancing (per-rank samples per step, as trained):" in output and "samples/s" in output
    record = read_run_record(only_version_dir(run, "slow-device"))
    phases = share_phases(record.steps)
    assert phases[0].shares == (32, 32)
    # rank 1 is twice as slow per sample (as measured, whatever the machine's load: both are sleeps)
    assert phases[0].ms_per_sample[1] > 1.5 * phases[0].ms_per_sample[0]
    moved = [p for p in phases if p.shares[1] < p.shares[0]]
    assert moved, [p.shares for p in phases]
    assert all(sum(p.shares) == 64 and min(p.shares) >= 8 for p in phases)
    # the split reaches TensorBoard through Lightning's own logger, step by step as trained
    logged = read_scalars(only_version_dir(run, "slow-device"))[batch_share_tag(1)]
    trained = {s["step"]: s["ranks"]["samples"][1] for s in record.steps}
    common = logged.keys() & trained.keys()
    assert len(common) >= 32 and all(logged[step] == trained[step] for step in common)
    assert min(logged.values()) < 32


# ------------------------------------------------------------------ cost-balanced batches, every adapter
def _balanced_split(indices: list[int], per_rank: int) -> list[set[int]]:
    """The split the sampler must have made of one global (micro-)batch: the default cost model and
    layout on the job's lengths, with even shares as the weights (rebalancing off)."""
    balancer = Balancer(np.asarray(job.lengths(max(indices) + 1)), SampleCost(), "padded")
    return [set(part) for part in balancer(sorted(indices), (per_rank, per_rank))]


def _check_balanced_steps(steps: list[list[list[int]]], per_rank: int, epoch_samples: int) -> None:
    """Each step's parts are the cost-balanced split of their union, the counts differ where the
    lengths call for it, and no sample is trained twice within an epoch (``epoch_samples`` trained)."""
    seen: list[int] = []
    for t, parts in enumerate(steps):
        expected = _balanced_split(list(itertools.chain(*parts)), per_rank)
        assert [set(p) for p in parts] == expected, f"step {t}"
        seen += itertools.chain(*parts)
    assert any(len(a) != len(b) for a, b in steps), "no step had unequal counts: nothing was balanced"
    epochs = [seen[i : i + epoch_samples] for i in range(0, len(seen), epoch_samples)]
    assert all(len(e) == len(set(e)) for e in epochs), "a sample was trained twice in one epoch"


@pytest.mark.parametrize("name", ["balanced", "fabric_balanced"])
def test_balanced_batches_split_every_global_batch_by_cost_and_keep_its_mean(run, name):
    """Lightning's ``paced_ddp`` and Fabric with ``balance`` alone: every global batch drawn as the
    even split would draw it, split by the samples' predicted cost, every sample once per epoch; the
    weights are one process's trained on the same global batches (the gradient's share factor)."""
    ranks = _trained(run, name)
    steps = [[a["indices"], b["indices"]] for a, b in zip(*ranks, strict=True)]
    assert len(steps) == job.EPOCHS * -(-job.SAMPLES // (2 * job.BATCH))
    _check_balanced_steps(steps, job.BATCH, job.SAMPLES)
    per_epoch = len(steps) // job.EPOCHS
    for epoch in range(job.EPOCHS):
        seen = list(itertools.chain(*itertools.chain(*steps[epoch * per_epoch : (epoch + 1) * per_epoch])))
        assert sorted(seen) == list(range(job.SAMPLES))
    got = torch.load(run / f"{name}.pt")
    for key, want in _single_process(ranks, scaled=True).items():
        torch.testing.assert_close(got[key], want, rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}")
    unscaled = _single_process(ranks, scaled=False)
    assert max((got[k] - unscaled[k]).abs().max().item() for k in got) > 100 * ATOL


def test_lightning_follows_balancing_s_check_from_arm_to_arm(run):
    """``paced_ddp`` with the A/B check on (the default): each step's global batch is split by cost
    where the record says the balanced arm ran and cut in even slices where the plain one did; both
    ranks switch at the same steps, and the check reaches a verdict."""
    ranks = _trained(run, "balanced_checked")
    steps = [[a["indices"], b["indices"]] for a, b in zip(*ranks, strict=True)]
    assert len(steps) == job.CHECKED_EPOCHS * -(-job.SAMPLES // (2 * job.BATCH))
    record = read_run_record(run / "balanced_checked")
    assert record.header["config"]["tag_every_steps"] == 50  # the tags follow log_every_n_steps' default
    lines = [x for x in record.shares if x.get("balance")]
    assert lines[-1]["balance"] in ("kept", "dropped"), [x["reason"] for x in lines]
    switches = [(0, True)] + [(x["from_step"], x["balanced"]) for x in lines if x["from_step"] is not None]
    # balanced, plain, balanced, plain, and balanced again if kept
    assert [b for _, b in switches] == [True, False, True, False, True][: len(switches)], switches
    assert len(switches) == (5 if lines[-1]["balance"] == "kept" else 4), switches
    full = job.SAMPLES // (2 * job.BATCH)  # an epoch's full global batches (its last is partial)
    for t, parts in enumerate(steps):
        if t % (full + 1) == full:
            continue  # the partial batch: split in proportion, balanced or not
        balanced = [b for f, b in switches if f <= t][-1]
        if balanced:
            assert [set(p) for p in parts] == _balanced_split(list(itertools.chain(*parts)), job.BATCH), t
        else:
            assert [len(p) for p in parts] == [job.BATCH, job.BATCH], t


def test_balanced_accelerate_accumulation_splits_each_micro_batch_by_cost(run):
    """``attach_pacing`` with ``balance`` in ``accelerator.accumulate`` (2 micro-batches per step):
    each micro-batch's global batch split by cost; the weights are one process's on each step's 32."""
    per_rank = [json.loads((run / f"accelerate_balanced_rank{r}.json").read_text()) for r in (0, 1)]
    micro = [[a["indices"], b["indices"]] for a, b in zip(*per_rank, strict=True)]
    _check_balanced_steps(micro, job.BATCH, job.SAMPLES // (2 * job.BATCH) * 2 * job.BATCH)  # drop_last
    steps = _accumulated_steps(run, "accelerate_balanced", job.ACCUMULATE)
    got = torch.load(run / "accelerate_balanced.pt")
    merged = [[{"indices": part} for part in parts] for parts in zip(*steps, strict=True)]
    for key, want in _single_process(merged, scaled=True).items():
        torch.testing.assert_close(got[key], want, rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}")


def test_balanced_trainer_splits_each_micro_batch_and_keeps_the_global_mean(run):
    """The HF Trainer with ``PacingCallback`` and ``balance``, gradient accumulation 2, its loss over
    the global batch's tokens: each micro-batch split by cost, the weights one process's."""
    per_rank = [json.loads((run / f"trainer_balanced_rank{r}.json").read_text()) for r in (0, 1)]
    _check_balanced_steps([list(parts) for parts in zip(*per_rank, strict=True)], job.TRAINER_BATCH, 256)
    steps = _trainer_steps(run, "trainer_balanced")
    assert len(steps) == job.TRAINER_STEPS
    got, want = torch.load(run / "trainer_balanced.pt"), _trainer_single_process(steps, scaled=True)
    for key in want:
        torch.testing.assert_close(
            got[key], want[key], rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}"
        )


def test_a_step_the_grad_scaler_skips_is_still_a_step(run):
    """Under fp16 (a GradScaler) accelerate's optimizer wrapper skips the optimizer's own step where
    the gradients overflowed, as every fp16 run does at its first scales: such a step still ends a
    step (its gradients were synchronized), so the ranks' steps stay one per batch, the shares
    follow the schedule and the record holds every step, skipped ones included. With 2 micro-batches
    per step: a micro-batch that does not synchronize ends nothing, skipped step or not."""
    skipped = [json.loads((run / f"accelerate_fp16_skipped_rank{r}.json").read_text()) for r in (0, 1)]
    assert skipped[0] == skipped[1] == list(range(job.FP16_SKIPS)), skipped  # the same steps on both ranks
    steps = _check_accumulated_shares(run, "accelerate_fp16")
    record = read_run_record(run / "fp16")
    total = len(steps)
    assert record.end is not None and record.end["status"] == "completed", record.end
    assert [s["step"] for s in record.steps] == list(range(record.steps[0]["step"], total))
