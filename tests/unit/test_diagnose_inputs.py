"""Uneven inputs: ranks whose compute follows the tokens they drew (synthetic, and a tiny transformer's
real compute on variable-length sequences measured here), named as input_imbalance with the waiting
the tokens explain; without tokens recorded, the report's first suspect."""

import time

import numpy as np
import torch

from pace_strategy.diagnose import diagnose, load_arrays
from pace_strategy.telemetry.importer import import_table
from tests.unit.test_importer import write_csv


def token_job(rng, steps, world, *, jitter=0.02):
    """Each rank's padded batch: 8 sequences, its longest drawn log-normal per step; compute grows
    with the tokens and, through attention, with their square."""
    longest = np.clip(rng.lognormal(np.log(512), 0.5, (steps, world)), 32, 4096).round()
    tokens = 8 * longest
    ideal = 20.0 + 0.004 * tokens + 0.6e-6 * tokens * tokens  # ms
    compute = ideal * rng.lognormal(0.0, jitter, (steps, world))
    return tokens, ideal, compute


def table(path, compute, tokens=None):
    steps, world = compute.shape
    cols = ["rank", "step", "compute_ms", *(["tokens"] if tokens is not None else [])]
    rows = [
        [r, s, f"{compute[s, r]:.3f}", *([int(tokens[s, r])] if tokens is not None else [])]
        for s in range(steps)
        for r in range(world)
    ]
    return write_csv(path, cols, rows)


def mean_lead(c):
    return float((c.max(axis=1, keepdims=True) - c).mean(axis=1).sum())


def test_a_64_rank_job_whose_compute_follows_its_tokens_is_input_imbalance(tmp_path):
    rng = np.random.default_rng(21)
    tokens, ideal, compute = token_job(rng, 400, 64)
    import_table(table(tmp_path / "t.csv", compute, tokens), tmp_path / "run")
    d = diagnose(load_arrays(tmp_path / "run"), project_ranks=None)
    top = d.findings[0]
    assert top.mode == "input_imbalance", d.summary
    assert top.details["work"] == "tokens" and top.details["r2"] > 0.9
    # the truth: the waiting of the token-driven compute alone (the same draws without the jitter)
    truth = mean_lead(ideal) / float(compute.max(axis=1).sum())
    assert abs(top.lost_step_fraction - truth) < 0.05, (top.lost_step_fraction, truth)
    assert "length" in top.action and "sync_amplification" not in [f.mode for f in d.findings]


def test_without_tokens_uneven_inputs_are_the_first_suspect(tmp_path):
    rng = np.random.default_rng(22)
    _, _, compute = token_job(rng, 400, 64)
    import_table(table(tmp_path / "t.csv", compute), tmp_path / "run")
    top = diagnose(load_arrays(tmp_path / "run"), project_ranks=None).findings[0]
    assert top.mode == "sync_amplification", top.evidence
    assert top.action.startswith("uneven inputs are the first suspect")


def test_tokens_that_do_not_explain_the_compute_are_not_input_imbalance(tmp_path):
    rng = np.random.default_rng(23)
    tokens, _, compute = token_job(rng, 300, 16)
    shuffled = rng.permuted(tokens, axis=1)  # recorded tokens that are not what each rank computed on
    import_table(table(tmp_path / "t.csv", compute, shuffled), tmp_path / "run")
    d = diagnose(load_arrays(tmp_path / "run"), project_ranks=None)
    assert "input_imbalance" not in [f.mode for f in d.findings], d.summary


def test_a_tiny_transformer_on_variable_length_sequences_is_input_imbalance(tmp_path):
    """Real compute: each "rank" trains a tiny transformer (forward and backward through real
    attention) on its own batch of padded sequences, lengths drawn per rank and step; the ranks are
    measured one after another on this process, and the waits follow from the synchronous model. Each
    batch's compute is the shorter of two runs of it: the suite shares 2 cores, and a preemption in the
    middle of a run is the machine's, not the input's."""
    torch.manual_seed(0)
    rng = np.random.default_rng(24)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2)
    world, steps = 4, 24
    lengths = rng.integers(16, 257, (steps, world))
    compute = np.zeros((steps, world))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for s in range(steps):
            for r in range(world):
                x = torch.randn(4, int(lengths[s, r]), 32)
                times = []
                for _ in range(2):
                    start = time.perf_counter()
                    model(x).sum().backward()
                    times.append((time.perf_counter() - start) * 1e3)
                compute[s, r] = min(times)
    finally:
        torch.set_num_threads(threads)
    import_table(table(tmp_path / "t.csv", compute, 4 * lengths), tmp_path / "run")
    d = diagnose(load_arrays(tmp_path / "run"), project_ranks=None)
    top = d.findings[0]
    assert top.mode == "input_imbalance" and top.details["r2"] > 0.5, (d.summary, compute.round(1))


def test_a_forward_counts_the_tokens_of_its_input_ids():
    from pace_strategy.integrations.data import forward_tokens

    ids = torch.ones(4, 37, dtype=torch.long)
    assert forward_tokens((), {"input_ids": ids, "attention_mask": torch.ones(4, 37)}) == 148
    assert forward_tokens((ids,), {}) == 148  # positional token ids
    assert forward_tokens(({"input_ids": ids},), {}) == 148  # a batch dict
    assert forward_tokens(((ids, torch.zeros(4)),), {}) == 148  # a tuple batch: its first element
    assert forward_tokens((torch.randn(4, 16),), {}) == 0  # features, not tokens
    assert forward_tokens((), {}) == 0
