"""The simulator's GC pauses: independent per rank or synchronized (gc_sync), against theory."""

from __future__ import annotations

import re

import numpy as np
import pytest

from pace_strategy import PacingConfigError
from pace_strategy.settings import build, load_mapping
from pace_strategy.sim.command import main as simulate_main
from pace_strategy.sim.model import ComputeModel, NetworkModel, SimConfig
from pace_strategy.sim.sweep import simulate, sweep

pytestmark = pytest.mark.timeout(120)


def _config(nodes: tuple[int, ...], **compute: object) -> SimConfig:
    return SimConfig(
        nodes=nodes,
        gpus_per_node=8,
        steps=400,
        compute=ComputeModel(base_ms=100.0, jitter_ms=0.0, **compute),  # type: ignore[arg-type]
        network=NetworkModel(gradient_mb=50.0),
    )


def test_pauses_are_per_rank_or_shared_and_use_the_same_random_stream():
    model = ComputeModel(gc_pause_probability=0.1, gc_pause_ms=80.0)
    own = model.gc_pauses_ms(np.random.default_rng(3), 500, 16)
    synced_model = ComputeModel(gc_pause_probability=0.1, gc_pause_ms=80.0, gc_sync=True)
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    synced = synced_model.gc_pauses_ms(rng_a, 500, 16)
    model.gc_pauses_ms(rng_b, 500, 16)
    assert rng_a.random() == rng_b.random()  # common random numbers: the rest of the draws line up
    assert set(np.unique(own)) == {0.0, 80.0} and abs((own > 0).mean() - 0.1) < 0.02
    assert (synced == synced[:, :1]).all()  # every rank pauses at the same steps...
    assert (synced[:, 0] == own[:, 0]).all()  # ...as often as one rank's own collector would
    assert not ComputeModel().gc_pauses_ms(np.random.default_rng(0), 4, 4).any()


def test_independent_pauses_cost_the_slowest_of_w_and_gc_sync_pays_one():
    p, pause = 0.01, 150.0
    cfg = _config((1, 16), gc_pause_probability=p, gc_pause_ms=pause)
    synced = _config((1, 16), gc_pause_probability=p, gc_pause_ms=pause, gc_sync=True)
    for nodes in (1, 16):
        w = nodes * 8
        plain, sync = simulate(cfg, nodes, paced=False), simulate(synced, nodes, paced=False)
        # theory: a step pauses when any of W ranks does (1 - (1-p)^W), against p with gc_sync
        base = plain.step_ms.min()
        hit_plain = float((plain.step_ms > base + pause / 2).mean())
        hit_sync = float((sync.step_ms > base + pause / 2).mean())
        assert abs(hit_plain - (1 - (1 - p) ** w)) < 0.08, (w, hit_plain)
        assert abs(hit_sync - p) < 0.02, (w, hit_sync)
        assert sync.throughput >= plain.throughput
    assert sync.throughput / plain.throughput > 1.5  # 128 ranks: most steps pause without gc_sync


def test_the_sweep_reports_what_gc_sync_saves_at_each_size(capsys):
    cfg = _config((1, 8), gc_pause_probability=0.005, gc_pause_ms=150.0)
    rows = [r.to_dict() for r in sweep(cfg)]
    ratios = [r["gc_sync_throughput_ratio"] for r in rows]
    assert 1.0 <= ratios[0] < ratios[1]  # the saving grows with the number of ranks
    assert rows[1]["lost_fraction_plain"] > rows[1]["lost_fraction_gc_sync"]
    without = [r.to_dict() for r in sweep(_config((1,)))]
    assert "gc_sync_throughput_ratio" not in without[0]  # no GC modelled, no column
    args = ["compute.gc_pause_probability=0.01", "nodes=[1,4]", "steps=100", "gpus_per_node=4"]
    assert simulate_main([str(_recipe()), *args]) == 0
    assert "GC pauses, each rank at its own steps" in capsys.readouterr().out


def test_bad_gc_settings_are_named():
    with pytest.raises(PacingConfigError, match=re.escape("compute.gc_pause_probability")):
        build(SimConfig, load_mapping(None, ["compute.gc_pause_probability=1.5"]))
    with pytest.raises(PacingConfigError, match=re.escape("compute.gc_pause_ms")):
        build(SimConfig, load_mapping(None, ["compute.gc_pause_ms=-1"]))


def _recipe():
    from pathlib import Path

    return Path(__file__).resolve().parents[2] / "recipes" / "simulate" / "clean.yaml"
