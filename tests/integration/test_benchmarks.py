"""Smoke runs of the benchmarks (one short scenario each): they run, measure every arm, write their table.

Not a check of what pacing achieves: the benchmark's numbers are not pass/fail (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.helpers import why_failed

pytestmark = [pytest.mark.integration, pytest.mark.long, pytest.mark.timeout(240)]

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _invoke(tmp_path, script, args):
    """``benchmarks/SCRIPT ARGS`` writing into ``tmp_path``; returns the process, its JSON result and
    the Markdown table."""
    out_json, out_md = tmp_path / "out.json", tmp_path / "out.md"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args, "--out", str(out_json), "--markdown", str(out_md)],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert done.returncode == 0, why_failed(done.stderr, 3000)
    return done, json.loads(out_json.read_text()), out_md.read_text()


def _run_benchmark(tmp_path, script, args):
    """As :func:`_invoke`, for a benchmark of one scenario: the process, its one row, the table."""
    done, result, table = _invoke(tmp_path, script, args)
    (row,) = result["rows"]
    return done, row, table


def _smoke_run(tmp_path, scenario, steps=40):
    """One short pair of ``scenario`` of the run-level A/B benchmark (ranks forked: a faster start)."""
    args = ["--repeats", "1", "--steps", str(steps), "--skip", "10", "--scenarios", scenario, "--fork"]
    return _run_benchmark(tmp_path, "pacing_ab.py", args)


@pytest.mark.alone
def test_pacing_ab_smoke_run_writes_both_arms(tmp_path):
    """Two ranks of real compute, rank 1's backward 16 ms longer: both arms run, and the paced run's
    record sees the injection."""
    done, row, table = _smoke_run(tmp_path, "real-backward@2")
    assert "real-backward@2" in done.stdout and "ddp" in done.stdout and "paced_ddp" in done.stdout
    assert row["scenario"] == "real-backward@2" and row["ranks"] == 2
    assert 0.5 < row["throughput_ratio_median"] < 2.0  # both arms ran and were timed
    assert 0.5 * 16.0 < row["median_skew_ms"] < 2 * 16.0  # the injected 16 ms, in the paced run's record
    # The in-run figures come from the paced run's record: the Pacer's own cost timer is a small
    # positive share of the step, and the estimate combines it with the paced share.
    cost, share = row["monitor_cost_fraction"], row["pacing_active_share"]
    paced = row["paced_over_unpaced_step"]
    assert 0.0 < cost < 0.05 and 0.0 <= share <= 1.0
    assert math.isclose(row["in_run_ratio"], 1.0 / ((1.0 + cost) * (1.0 + share * (paced - 1.0))))
    assert 0.5 < row["in_run_ratio"] < 1.5
    assert "| real-backward@2 | 2 |" in table


def test_the_control_scenario_runs_plain_ddp_against_itself(tmp_path, monkeypatch, capsys):
    """The A/A control's wiring: both arms of each pair launch plain ``ddp``, nothing is read from a
    record, and the table names it. The demo runs themselves are replaced by step times of our own
    (the persistent smoke run above launches real ones through the same ``run_demo``)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import pacing_ab

    launched = []

    def fake_run_demo(workdir, number, demo, skip, fabric):
        launched.append(demo[demo.index("--strategy") + 1])
        return [50.0 + number] * 10, None  # no record: a plain ddp run writes none

    monkeypatch.setattr(pacing_ab, "run_demo", fake_run_demo)
    (control,) = [s for s in pacing_ab.scenarios(20.0, 150.0) if s.name == "control"]
    args = argparse.Namespace(repeats=2, steps=20, skip=5, t0=0.0, fork=False)
    row = pacing_ab.run_scenario(control, args, tmp_path, [0, 4])
    assert launched == ["ddp"] * 4 and row["candidate"] == "ddp"
    assert row["throughput_ratios"] == pytest.approx([51 / 52, 54 / 53])  # the pairs alternate
    assert "in_run_ratio" not in row  # no paced run, no record: nothing measured from the inside
    assert "| control (ddp vs ddp) | 4 |" in pacing_ab.markdown([row], "", {})
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(progress) == 4 and all(" ddp " in line and "paced_ddp" not in line for line in progress)


@pytest.mark.alone
@pytest.mark.skipif(os.geteuid() != 0, reason="the test bed needs root (network namespaces)")
def test_pacing_ab_smoke_run_over_the_test_bed_uplink(tmp_path):
    """The paper's scenario: both arms run across the two-rack fabric, and the fabric is torn down."""
    _, row, table = _smoke_run(tmp_path, "uplink+transient@2")
    assert row["scenario"] == "uplink+transient@2" and row["ranks"] == 2
    assert 0.5 < row["throughput_ratio_median"] < 2.0
    assert "| uplink+transient@2 | 2 |" in table
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert "pace-ab" not in netns  # brought up for the scenario, torn down after it


def test_interleaved_benchmark_trains_all_three_arms_to_the_same_weights(tmp_path):
    """Plain DDP, torch's Python hook and paced DDP take turns in the same processes; neither the hook
    nor pacing may change a bit of the model."""
    args = ["--ranks", "2", "--steps", "40", "--skip", "5", "--blocks", "2", "--scenarios", "persistent"]
    _, row, table = _run_benchmark(tmp_path, "pacing_interleaved.py", args)
    assert row["steps_measured"] == 35 and 0.5 < row["throughput_ratio"] < 2.0
    assert 0.5 < row["hook_ratio"] < 2.0
    # The three ratios come from the same step times: paced/plain = hook/plain x paced/hook.
    assert row["throughput_ratio"] == pytest.approx(row["hook_ratio"] * row["over_hook_ratio"], rel=1e-9)
    for arm in ("plain", "hook", "candidate"):  # 20 ms emulated compute + rank 1's injected 30 ms
        assert row[f"median_step_{arm}_ms"] > 50.0
    assert row["max_weight_difference"] == 0.0
    assert "| persistent |" in table and "Python hook/plain" in table


def test_interleaved_benchmark_can_take_the_cpp_comm_hook_and_the_comm_hook_monitor(tmp_path):
    """``--hook builtin``: DDP's C++ all-reduce hook, the comm-hook path without Python, in the middle;
    ``--variant comm-hook``: the paced arm timed by the pacing comm hook. Same bits everywhere."""
    args = ["--ranks", "2", "--steps", "20", "--skip", "4", "--blocks", "2", "--scenarios", "clean"]
    args += ["--hook", "builtin", "--variant", "comm-hook"]
    _, row, table = _run_benchmark(tmp_path, "pacing_interleaved.py", args)
    assert row["hook"] == "builtin" and 0.5 < row["hook_ratio"] < 2.0
    assert row["variant"] == "comm-hook" and 0.5 < row["throughput_ratio"] < 2.0
    assert row["max_weight_difference"] == 0.0
    assert "C++ hook/plain" in table


def test_monitor_cost_benchmark_times_every_arm_on_every_rank(tmp_path):
    """Both parts: each DDP monitor's per-step cost, and one short repetition of the whole job's
    arms (real Lightning jobs of the demo: stock ddp, paced_ddp measuring, adaptive, rebalancing,
    cost-balanced batches)."""
    args = ["--steps", "30", "--skip", "6", "--blocks", "2"]
    args += ["--job-reps", "1", "--job-steps", "30", "--job-skip", "10"]
    _, result, table = _invoke(tmp_path, "monitor_cost.py", args)
    job = {row["arm"]: row for row in result["job"]}
    assert list(job) == ["ddp", "monitor", "adaptive", "rebalance", "balance"]
    assert job["ddp"]["ratios"] == [1.0] and all(0.2 < row["ratios"][0] < 5.0 for row in job.values())
    assert job["monitor"]["paced_windows"] == 0  # measuring only: never a delay
    assert "| balance |" in table
    assert result["max_weight_difference"] == 0.0  # no monitor changes a bit of the model
    assert len(result["ranks"]) == 2
    for rows in result["ranks"]:
        assert [r["arm"] for r in rows] == ["plain", "python_hook", "comm_hook", "grad_ready"]
        assert all(r["wall_us"] > 100.0 and r["cpu_us"] > 0.0 for r in rows)  # a real step, timed
        assert rows[0]["wall_over_plain_us"] == 0.0
    assert "| 1 | grad_ready |" in table


def test_balance_benchmark_trains_every_arm_and_balanced_batches_keep_the_global_mean(tmp_path):
    """Cost-balanced batches through the product's path (``attach`` + ``pace.dataloader``) on a tiny
    transformer: the ranks train unequal counts, and the global batch's mean loss and the weights stay
    those of the even split on the same batches (one sample per forward: the same shapes, so only the
    summation order differs). The cost model is given, not fitted: a fit reads timings, and the
    assignment (the counts asserted below) must not depend on how loaded the machine is."""
    args = ["--steps", "3", "--rounds", "1", "--skip", "1", "--batch", "6", "--layouts", "packed"]
    args += ["--no-calibrate"]
    _, result, table = _invoke(tmp_path, "balance.py", args)
    (row,) = result["rows"]
    assert set(row["ratio"]) == {"plain", "grouped", "balanced", "grouped+balanced"}
    assert all(0.1 < v < 20.0 for v in row["ratio"].values()) and row["bound"] >= 1.0
    counts = row["rank0_counts"]
    assert set(counts["plain"]) == {6} and set(counts["balanced"]) != {6}  # balanced: unequal counts
    assert row["max_relative_loss_gap"] < 1e-5 and row["max_weight_difference"] < 1e-5
    assert "| packed |" in table


@pytest.mark.alone
def test_balancing_s_check_keeps_balanced_batches_on_a_long_tail_of_real_attention(tmp_path):
    """The A/B check on real compute (a tiny transformer, padded batches of long-tailed lengths, 2
    ranks): the arms take turns at the same steps on both ranks and the verdict keeps balanced batches,
    whose step the check measured shorter. Timed, so alone: on this job balancing halves the padded
    step (docs/balancing.md), far beyond what a loaded machine moves."""
    _, row, table = _run_benchmark(tmp_path, "balance_check.py", ["--mixes", "long-tail"])
    assert row["verdict"] == "kept", row
    assert [balanced for _, balanced in row["switches"]] == [False, True, False, True], row
    assert row["balanced_step_ms"] < 0.9 * row["plain_step_ms"], row
    medians = row["median_step_ms"]  # the record's own steps at each arm agree with the verdict
    assert medians["balanced"] < medians["plain"], row
    assert "| long-tail |" in table and "| kept |" in table
