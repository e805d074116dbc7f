"""The simulator against theory, against a recorded run, and against its own claims."""

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from pace_strategy import PacingConfigError
from pace_strategy.diagnose import load_arrays
from pace_strategy.settings import build, load_mapping
from pace_strategy.sim.calibrate import fit, predict
from pace_strategy.sim.command import main as simulate_main
from pace_strategy.sim.model import ComputeModel, NetworkModel, SimConfig
from pace_strategy.sim.network import inter_node_bandwidth_gbps, ring_allreduce_ms, step_collective_ms
from pace_strategy.sim.sweep import simulate
from pace_strategy.telemetry.arrays import load_lines, sample_arrays, sample_steps

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def config(nodes, gpus=8, steps=400, **compute):
    return SimConfig(
        nodes=(nodes,),
        gpus_per_node=gpus,
        steps=steps,
        compute=ComputeModel(**compute),
        network=NetworkModel(gradient_mb=50.0),
    )


def collective(cfg, nodes):
    return float(step_collective_ms(cfg.network, nodes, cfg.gpus_per_node, np.zeros(1))[0])


def test_no_jitter_no_stragglers_gives_compute_plus_collective_and_zero_cv():
    cfg = config(4, base_ms=80.0, jitter_ms=0.0, other_ms=3.0)
    run = simulate(cfg, 4, paced=True)
    assert run.cv < 1e-12  # zero up to float rounding
    assert np.allclose(run.step_ms, 80.0 + collective(cfg, 4) + 3.0)
    assert run.pacing_active_share == 0.0


def expected_max_normal(n, mu, sigma):
    """E[max of n iid N(mu, sigma)] by numerical integration of the order statistic's density."""
    x = np.linspace(-8.0, 8.0, 200001)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    density = n * pdf * cdf ** (n - 1)
    return mu + sigma * float(np.sum(x * density) * (x[1] - x[0]))


@pytest.mark.parametrize("nodes", [8, 128])  # 64 and 1,024 ranks
def test_iid_jitter_matches_the_expected_maximum(nodes):
    cfg = config(nodes, steps=1000, base_ms=100.0, jitter_ms=5.0)
    run = simulate(cfg, nodes, paced=False)
    expected = expected_max_normal(nodes * 8, 100.0, 5.0) + collective(cfg, nodes)
    assert abs(run.mean_step_ms - expected) / expected < 0.02, (run.mean_step_ms, expected)


def test_one_persistent_straggler_sets_the_step():
    cfg = config(4, base_ms=100.0, jitter_ms=0.0, slow_ranks=(5,), slow_factor=1.5)
    run = simulate(cfg, 4, paced=False)
    assert np.allclose(run.step_ms, 150.0 + collective(cfg, 4))


def test_ring_allreduce_closed_form():
    # 2 (n-1)/n * S/B + 2 (n-1) alpha with S = 100 MB, n = 8, B = 100 Gbit/s, alpha = 10 us
    assert math.isclose(ring_allreduce_ms(100.0, 8, 100.0, 10.0), 2 * 7 / 8 * 800e6 / 100e9 * 1e3 + 14 * 0.01)
    assert ring_allreduce_ms(100.0, 1, 100.0, 10.0) == 0.0


def test_oversubscribed_interleaved_ring_shares_the_uplinks():
    full = NetworkModel(node_gbps=400.0, nodes_per_leaf=8, oversubscription=1.0, ring_order="interleaved")
    over = NetworkModel(node_gbps=400.0, nodes_per_leaf=8, oversubscription=4.0, ring_order="interleaved")
    topo = NetworkModel(node_gbps=400.0, nodes_per_leaf=8, oversubscription=4.0, ring_order="topology")
    assert inter_node_bandwidth_gbps(full, 64) == 400.0
    assert inter_node_bandwidth_gbps(over, 64) == 100.0  # 8 flows on an 800 Gbit/s uplink
    assert inter_node_bandwidth_gbps(topo, 64) == 400.0  # one flow per uplink: not the bottleneck
    assert inter_node_bandwidth_gbps(over, 8) == 400.0  # a single leaf never touches the spine


def test_without_a_contention_mechanism_pacing_never_shortens_a_step():
    cfg = config(8, steps=600, base_ms=100.0, jitter_ms=1.0, slow_local_ranks=(2,), slow_factor=1.2)
    plain, paced = simulate(cfg, 8, paced=False), simulate(cfg, 8, paced=True)
    assert paced.pacing_active_share > 0  # the controller did try
    assert np.all(paced.step_ms >= plain.step_ms - 1e-9)  # same draws: a delay can only add time


def test_spin_contention_is_the_mechanism_through_which_pacing_can_help():
    cfg = build(SimConfig, load_mapping(ROOT / "recipes/simulate/spin_contention.yaml", ["nodes=[4]"]))
    plain, paced = simulate(cfg, 4, paced=False), simulate(cfg, 4, paced=True)
    assert paced.throughput > plain.throughput and paced.pacing_active_share > 0.5


def test_calibrated_from_a_real_run_reproduces_it():
    arrays = load_arrays(ROOT / "tests/fixtures/run4_transient.jsonl")  # 4 CPU ranks, transient stragglers
    cal = fit(arrays)
    run = predict(cal, 4, steps=2000, seed=1)
    assert abs(run.mean_step_ms - cal.measured_mean_step_ms) / cal.measured_mean_step_ms < 0.10
    assert abs(run.cv - cal.measured_cv) < 0.05
    assert "persistent stragglers" in cal.report()


def test_every_recipe_loads_and_bad_keys_are_named():
    for path in sorted((ROOT / "recipes/simulate").glob("*.yaml")):
        build(SimConfig, load_mapping(path))
    with pytest.raises(PacingConfigError, match=re.escape("Did you mean 'compute.base_ms'")):
        build(SimConfig, load_mapping(None, ["compute.base=3"]))
    with pytest.raises(PacingConfigError, match=re.escape("network.oversubscription")):
        build(SimConfig, load_mapping(None, ["network.oversubscription=0.5"]))
    with pytest.raises(PacingConfigError, match=re.escape("Did you mean 'pacing.max_delay_ms'")):
        build(SimConfig, load_mapping(None, ["pacing.max_delay=3"]))


def test_cli_json_rows(capsys):
    code = simulate_main([str(ROOT / "recipes/simulate/clean.yaml"), "nodes=[4,16]", "steps=200", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["nodes"] for r in out["rows"]] == [4, 16]
    assert {"throughput_ratio", "cv_plain", "cv_paced", "p99_ms_plain", "scaling_efficiency_plain"} <= set(
        out["rows"][0]
    )
    assert "did not raise throughput" in out["mechanism"]
    assert simulate_main(["nope.yaml"]) == 2


def test_from_run_what_ifs(capsys):
    fixture = str(ROOT / "tests/fixtures/run4_transient.jsonl")
    args = ["--from-run", fixture, "--ranks", "4,32", "--steps", "300", "--json"]
    assert (
        simulate_main([*args, "--oversubscription", "4", "--gpus-per-node", "4", "--nodes-per-leaf", "2"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    small, large = out["rows"]
    assert small["ranks"] == 4 and large["ranks"] == 32
    assert small["oversubscribed_transfer_factor"] == 1.0  # one node: nothing crosses the spine
    assert large["oversubscribed_transfer_factor"] == 4.0  # interleaved ring, 8 nodes under 4 leaves
    assert large["oversubscribed_throughput_ratio"] < 1.0
    assert small["paced_throughput_ratio"] == pytest.approx(1.0, abs=0.02)
    assert "fitted from" in out["fit"]


def test_from_run_calibrates_on_a_sample_read_a_block_at_a_time(capsys):
    fixture = ROOT / "tests/fixtures/run4_transient.jsonl"
    whole, lines = load_arrays(fixture), load_lines(fixture)
    # a run no longer than the sample: every step, the same fit as the run loaded whole
    every = fit(sample_arrays(lines, sample_steps(lines.steps, 5000)))
    for f in dataclasses.fields(every):
        x, y = getattr(every, f.name), getattr(fit(whole), f.name)
        assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y, f.name
    # a longer one: the seeded sample's rows, as the run loaded whole holds them
    rows = sample_steps(lines.steps, 50)
    sample = sample_arrays(lines, rows)
    assert len(rows) == 50 and np.array_equal(rows, np.sort(rows))
    for name in ("wait", "compute", "data", "gap", "step_ms", "step"):
        assert np.array_equal(getattr(sample, name), getattr(whole, name)[rows]), name
    args = ["--from-run", str(fixture), "--ranks", "4", "--steps", "100", "--json"]
    assert simulate_main([*args, "--calibration-steps", "50"]) == 0
    assert json.loads(capsys.readouterr().out)["fit"].startswith("fitted from 50 steps x 4 ranks")
    assert simulate_main([*args, "--calibration-steps", "0"]) == 2
    assert "--calibration-steps 0 is invalid" in capsys.readouterr().err
