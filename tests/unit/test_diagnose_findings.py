"""The diagnosis rules on small synthetic arrays (the real-run checks are in tests/integration)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pace_strategy import PacingConfigError
from pace_strategy.diagnose import MODES, DiagnosisConfig, Mode, RunArrays, diagnose
from pace_strategy.diagnose.command import main


def arrays(compute, data=None, gap=None, transfer=5.0, hosts=None, local=None, nodes=None):
    compute = np.asarray(compute, dtype=np.float64)
    steps, world = compute.shape
    arrival = compute.max(axis=1, keepdims=True)
    transfer = np.broadcast_to(np.asarray(transfer, dtype=np.float64).reshape(-1, 1), (steps, 1))
    wait = arrival - compute + transfer
    zeros = np.zeros_like(compute)
    hosts = hosts or ["h0"] * world
    topo = [
        {
            "rank": r,
            "host": hosts[r],
            "node_rank": (nodes or [0] * world)[r],
            "local_rank": (local or list(range(world)))[r],
        }
        for r in range(world)
    ]
    step_ms = (arrival[:, 0] + transfer[:, 0] + 2.0).astype(np.float64)
    return RunArrays(
        path=Path("synthetic"),
        header={"world_size": world, "topology": topo},
        end={"status": "completed"},
        truncated=False,
        total_steps=steps,
        step=np.arange(steps),
        wait=wait,
        compute=compute,
        delay=zeros,
        data=zeros if data is None else np.asarray(data, dtype=np.float64),
        gap=zeros if gap is None else gap,
        rank_step=np.repeat(step_ms[:, None], world, axis=1),
        step_ms=step_ms,
        pacing_active=np.zeros(steps, dtype=bool),
        decisions=[],
    )


rng = np.random.default_rng(0)


def test_healthy_says_so_with_numbers():
    d = diagnose(arrays(40.0 + rng.normal(0, 0.3, (200, 4))))
    assert [f.mode for f in d.findings] == ["healthy"]
    assert "lost to waiting" in d.findings[0].evidence and d.summary.startswith("healthy")


def test_persistent_straggler_names_the_rank():
    c = 40.0 + rng.normal(0, 0.3, (200, 4))
    c[:, 3] += 15.0
    (f,) = diagnose(arrays(c)).findings
    assert f.mode == "persistent_straggler" and f.ranks == [3]
    assert "rank 3" in f.evidence and "100% of 200 steps" in f.evidence
    # three ranks idle 15 ms each per 62 ms step: mean lead 11.25 ms
    assert abs(f.lost_step_fraction - 11.25 / 62.0) < 0.01


def test_locality_by_local_index_across_nodes():
    c = 40.0 + rng.normal(0, 0.5, (200, 4))
    c[:, [1, 3]] += 10.0
    a = arrays(c, hosts=["a", "a", "b", "b"], local=[0, 1, 0, 1], nodes=[0, 0, 1, 1])
    top = diagnose(a).findings[0]
    assert top.mode == "locality" and top.ranks == [1, 3] and top.hosts == ["a", "b"]


def test_one_rank_per_node_is_not_locality_by_local_index():
    # four single-rank nodes (local rank 0 everywhere), the straggler moving between them
    c = 40.0 + rng.normal(0, 0.5, (200, 4))
    c[np.arange(200), rng.integers(0, 4, 200)] += 12.0
    a = arrays(c, hosts=["a", "b", "c", "d"], local=[0, 0, 0, 0], nodes=[0, 1, 2, 3])
    modes = [f.mode for f in diagnose(a).findings]
    assert "locality" not in modes and modes[0] == "sync_amplification"


def test_minor_problems_become_notes_not_findings():
    c = 40.0 + rng.normal(0, 0.3, (200, 4))
    c[:, 3] += 1.5  # a straggler, but only ~3% of the step
    d = diagnose(arrays(c), DiagnosisConfig(slow_ms_floor=1.0, slow_step_fraction=0.0))
    assert [f.mode for f in d.findings] == ["healthy"]
    assert any("persistent_straggler" in n for n in d.notes)


def test_thresholds_are_validated():
    with pytest.raises(PacingConfigError, match="persistent_share"):
        DiagnosisConfig(persistent_share=1.5)
    with pytest.raises(PacingConfigError, match="Did you mean 'data_share'"):
        DiagnosisConfig.from_dict({"data_shar": 0.3})


def test_a_truncated_record_is_diagnosed_and_reported(tmp_path):
    from pace_strategy.diagnose import load_arrays
    from pace_strategy.telemetry.run_record import RunRecordWriter
    from tests.unit.test_schema import summary

    path = tmp_path / "pace_run.jsonl"
    writer = RunRecordWriter(
        path, world_size=3, config={}, topology=[{"rank": r} for r in range(3)], framework="t"
    )
    writer.write_window([summary(3) for _ in range(12)], None)  # never closed: the run crashed
    with path.open("a") as f:
        f.write('{"record": "step", "st')
    a = load_arrays(tmp_path)
    assert a.truncated and a.steps == 12
    notes = diagnose(a).notes
    assert any("cut off" in n for n in notes) and any("did not finish" in n for n in notes)


def test_modes_are_an_enum_that_serializes_as_plain_strings():
    assert tuple(m.value for m in Mode) == MODES and "healthy" in MODES
    (f,) = diagnose(arrays(40.0 + rng.normal(0, 0.3, (200, 4)))).findings
    assert f.mode is Mode.HEALTHY and f.mode == "healthy" and f"{f.mode}" == "healthy"
    as_dict = f.to_dict()
    assert type(as_dict["mode"]) is str and json.loads(json.dumps(as_dict))["mode"] == "healthy"


def test_a_new_threshold_is_overridable_from_the_command_line(tmp_path, capsys):
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "run4_transient.jsonl"
    shutil.copy(fixture, tmp_path / "pace_run.jsonl")
    assert main([str(tmp_path), "--json", "--no-report", "--set", "min_steps=100000"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["thresholds"]["min_steps"] == 100000
    assert result["findings"] == [] and result["summary"].startswith("not enough data")
    assert main([str(tmp_path), "--no-report", "--set", "min_step=3"]) == 2
    assert "Did you mean 'min_steps'" in capsys.readouterr().err


def test_new_thresholds_are_validated():
    with pytest.raises(PacingConfigError, match="compute_late_fraction"):
        DiagnosisConfig(compute_late_fraction=0.0)
    with pytest.raises(PacingConfigError, match="min_steps"):
        DiagnosisConfig(min_steps=0)


# --- noise floor, crowded hosts, projection to scale, --compare (issue 18) ---


def crowded_topology(world, threads=None, affinity="0-1", host_cores=2, host="vm"):
    """One host, every rank on the same cores; ``threads=None`` is an old record without thread fields."""
    topo = []
    for r in range(world):
        t = {
            "rank": r,
            "host": host,
            "node_rank": 0,
            "local_rank": r,
            "device": "cpu",
            "cpu_affinity": affinity,
        }
        if threads is not None:
            t.update(intra_op_threads=threads, omp_num_threads=None, host_cores=host_cores, usable_cores=2)
        topo.append(t)
    return topo


def with_topology(a, topo):
    a.header["topology"] = topo
    return a


def test_ordinary_jitter_above_five_percent_is_healthy_with_its_cost_as_a_note():
    # two ranks, 5 ms compute, normal jitter sd 1.2 ms: waiting is ~5% of the step, all of it what this
    # jitter gives at 2 ranks (sd x E[max of 2 normals] = 0.56 sd)
    c = 5.0 + np.random.default_rng(3).normal(0, 1.2, (400, 2))
    d = diagnose(arrays(c), project_ranks=(8, 512))
    assert d.stats["lost_step_fraction"] > 0.05
    assert abs(d.stats["noise_floor_fraction"] - d.stats["lost_step_fraction"]) < 0.015
    (f,) = d.findings
    assert f.mode == "healthy" and "explains" in f.evidence
    note = next(n for n in d.notes if n.startswith("waiting costs"))
    assert "at 2 ranks" in note and "at 512 ranks" in note
    # the same jitter costs more at more ranks: the slowest of more ranks is later
    lost = [p["lost_fraction"] for p in f.projection]
    assert [p["ranks"] for p in f.projection] == [8, 512] and lost[1] > lost[0] > f.lost_step_fraction


def test_without_the_jitter_floor_the_same_run_is_a_false_alarm():
    c = 5.0 + np.random.default_rng(3).normal(0, 1.2, (400, 2))
    d = diagnose(arrays(c), DiagnosisConfig(jitter_floor_factor=0.0), project_ranks=None)
    assert d.findings[0].mode != "healthy"


def test_rotating_transient_stragglers_on_two_ranks_are_sync_amplification():
    g = np.random.default_rng(4)
    c = 12.0 + g.normal(0, 0.3, (300, 2)) + 30.0 * (g.random((300, 2)) < 0.1)
    (f,) = diagnose(arrays(c), project_ranks=None).findings
    assert f.mode == "sync_amplification" and f.ranks == [0, 1]


def test_more_busy_threads_than_cores_is_host_oversubscription():
    c = 12.0 + np.random.default_rng(5).normal(0, 0.3, (300, 2))
    a = with_topology(arrays(c), crowded_topology(2, threads=2))
    d = diagnose(a, project_ranks=None)
    assert [f.mode for f in d.findings] == ["host_oversubscription"], d.findings
    (f,) = d.findings
    assert f.hosts == ["vm"] and f.ranks == [0, 1] and d.stats["oversubscribed_hosts"] == ["vm"]
    assert (
        "2 ranks x 2 intra-op threads each" in f.evidence and "4 busy threads on 2 usable cores" in f.evidence
    )
    assert "torch.set_num_threads(1)" in f.action and "affinity" in f.action
    assert f.details["busy_threads"] == 4 and f.details["suggested_threads_per_rank"] == 1


def test_a_crowded_host_does_not_hide_rotating_stragglers_each_cause_gets_its_share():
    # 3 ranks on 2 cores, and a random rank 30 ms late in ~27% of steps: the host accounts for the
    # waiting its ranks' bulk scatter gives, the transient stragglers for the rest, the larger share
    g = np.random.default_rng(5)
    c = 12.0 + g.normal(0, 0.8, (400, 3)) + 30.0 * (g.random((400, 3)) < 0.1)
    a = with_topology(arrays(c), crowded_topology(3, threads=1))
    d = diagnose(a, project_ranks=(8, 512))
    assert [f.mode for f in d.findings] == ["sync_amplification", "host_oversubscription"], d.findings
    amp, host = d.findings
    total = d.stats["lost_step_fraction"]
    # the shares split the run's waiting: the host's is its jitter floor, amplification's the rest
    assert host.lost_step_fraction == pytest.approx(d.stats["noise_floor_fraction"])
    assert amp.lost_step_fraction + host.lost_step_fraction == pytest.approx(total)
    assert amp.lost_step_fraction > 3 * host.lost_step_fraction and amp.ranks == [0, 1, 2]
    assert f"the crowded host's share, {host.lost_step_fraction:.1%}" in amp.evidence, amp.evidence
    assert "more is waiting for ranks late by far more than that scatter" in host.evidence, host.evidence
    assert host.details["waiting_fraction"] == pytest.approx(total)
    # projected to scale, each gets its share of the job's waiting, never the whole of it twice
    for n, (p_amp, p_host, waiting) in enumerate(
        zip(amp.projection, host.projection, d.projection["waiting"], strict=True)
    ):
        assert p_amp["lost_fraction"] + p_host["lost_fraction"] == pytest.approx(waiting["lost_fraction"]), n
        assert p_amp["lost_fraction"] > p_host["lost_fraction"]


def test_a_real_crowded_run_with_transient_stragglers_names_both_causes_with_their_shares():
    # tests/fixtures/run4_transient.jsonl: a real recorded run, 4 single-threaded ranks on 2 cores,
    # transient stragglers moving between the ranks
    from pace_strategy.telemetry.arrays import load_arrays

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "run4_transient.jsonl"
    d = diagnose(load_arrays(fixture), project_ranks=None)
    assert [f.mode for f in d.findings] == ["sync_amplification", "host_oversubscription"], d.findings
    amp, host = d.findings
    assert amp.lost_step_fraction + host.lost_step_fraction == pytest.approx(d.stats["lost_step_fraction"])
    assert host.lost_step_fraction == pytest.approx(d.stats["noise_floor_fraction"])
    assert amp.lost_step_fraction - amp.noise_floor_fraction >= 0.05  # worth acting on by itself
    assert host.details["busy_threads"] == 4 and amp.ranks == host.ranks == [0, 1, 2, 3]


def test_an_old_record_counts_one_thread_per_rank():
    c = 30.0 + rng.normal(0, 0.3, (100, 3))
    (f,) = diagnose(with_topology(arrays(c), crowded_topology(3)), project_ranks=None).findings
    assert f.mode == "host_oversubscription" and "not recorded" in f.evidence
    assert "at most 2" in f.action  # 3 ranks on 2 cores: fewer ranks per host, not fewer threads
    # two single-threaded ranks on two cores fit
    two = diagnose(with_topology(arrays(c[:, :2]), crowded_topology(2)), project_ranks=None)
    assert [f.mode for f in two.findings] == ["healthy"]


def test_dataloader_workers_count_as_busy_threads():
    topo = crowded_topology(2, threads=1, affinity="0-3", host_cores=4)
    for t in topo:
        t["dataloader_workers"] = 2
    (f,) = diagnose(
        with_topology(arrays(12.0 + rng.normal(0, 0.3, (100, 2))), topo), project_ranks=None
    ).findings
    assert f.mode == "host_oversubscription" and "+ 4 DataLoader workers" in f.evidence


def test_a_slow_rank_on_a_crowded_host_is_still_named_first():
    c = 12.0 + rng.normal(0, 0.3, (200, 3))
    c[:, 2] += 30.0
    d = diagnose(with_topology(arrays(c), crowded_topology(3, threads=1)), project_ranks=None)
    assert [f.mode for f in d.findings] == ["persistent_straggler", "host_oversubscription"]
    assert d.findings[0].ranks == [2]


def test_an_unstable_collective_on_one_cpu_host_is_a_note_not_fabric_contention():
    g = np.random.default_rng(6)
    c = 30.0 + g.normal(0, 0.2, (300, 2))
    transfer = 3.0 + g.exponential(3.0, 300)  # CV ~0.5, heavy tail, not inflated
    one_host = arrays(c, transfer=transfer)
    d = diagnose(
        with_topology(one_host, crowded_topology(2, threads=1, affinity="0-3", host_cores=4)),
        project_ranks=None,
    )
    assert "fabric_contention" not in [f.mode for f in d.findings]
    assert any("one CPU host" in n for n in d.notes)
    two_hosts = arrays(c, transfer=transfer, hosts=["a", "b"], nodes=[0, 1], local=[0, 0])
    assert "fabric_contention" in [f.mode for f in diagnose(two_hosts, project_ranks=None).findings]


def test_every_finding_is_projected_to_scale():
    c = 40.0 + rng.normal(0, 0.3, (300, 4))
    c[:, 3] += 15.0
    d = diagnose(arrays(c))
    (f,) = d.findings
    assert [p["ranks"] for p in f.projection] == [8, 64, 512, 1024]
    assert f.projection_basis == "ranks" and all(p["lost_fraction"] > 0.05 for p in f.projection)
    assert (
        d.projection["ranks"] == [8, 64, 512, 1024]
        and "same per-rank behaviour" in d.projection["assumption"]
    )
    # the simulator reproduces the run at its own size
    assert abs(d.projection["simulated_lost_fraction"] - d.projection["measured_lost_fraction"]) < 0.02
    assert json.loads(json.dumps(d.to_dict()))["findings"][0]["projection"][0]["ranks"] == 8
    assert diagnose(arrays(c), project_ranks=None).findings[0].projection == []


def test_expected_max_normal_matches_known_values():
    from pace_strategy.diagnose.noise import expected_max_normal

    assert expected_max_normal(1) == 0.0
    assert abs(expected_max_normal(2) - 1 / np.sqrt(np.pi)) < 1e-6
    assert abs(expected_max_normal(3) - 1.5 / np.sqrt(np.pi)) < 1e-6
    assert abs(expected_max_normal(64) - 2.3437) < 1e-3


def test_cpu_ranges_round_trip():
    from pace_strategy.telemetry.topology import cpu_ranges, parse_cpu_ranges

    assert parse_cpu_ranges("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert cpu_ranges({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"


def test_a_rank_records_its_threads_and_cores(monkeypatch):
    import torch

    from pace_strategy.telemetry.topology import local_placement

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    p = local_placement(0, torch.device("cpu"), dataloader_workers=2).to_dict()
    assert p["intra_op_threads"] == torch.get_num_threads() and p["omp_num_threads"] == 3
    assert p["dataloader_workers"] == 2 and p["host_cores"] >= 1 and p["usable_cores"] >= 1


def fixture_run(tmp_path, name):
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "run4_transient.jsonl"
    (tmp_path / name).mkdir()
    shutil.copy(fixture, tmp_path / name / "pace_run.jsonl")
    return str(tmp_path / name)


def test_compare_prints_two_runs_side_by_side(tmp_path, capsys):
    a, b = fixture_run(tmp_path, "before"), fixture_run(tmp_path, "after")
    assert main(["--compare", a, b, "--project-ranks", "8,64"]) == 0
    out = capsys.readouterr().out
    assert "A: " in out and "B: " in out and "B vs A" in out and "mean step" in out
    assert "64 ranks" in out and "lost to waiting" in out
    assert main(["--compare", a, b, "--json", "--project-ranks", ""]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["change"]["mean_step_ms"]["ratio"] == 1.0 and result["a"]["findings"]
    assert result["a"]["projection"] == {}


def test_project_ranks_are_validated(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([fixture_run(tmp_path, "run"), "--project-ranks", "8,zero"])
    assert "--project-ranks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])  # neither RUN_DIR nor --compare


def test_the_text_report_shows_the_projection(tmp_path, capsys):
    assert main([fixture_run(tmp_path, "run"), "--no-report", "--project-ranks", "16,128"]) == 0
    out = capsys.readouterr().out
    assert "at scale: " in out and "at 128 ranks" in out and "projection: simulated" in out


def test_new_config_fields_are_validated():
    with pytest.raises(PacingConfigError, match="projection_steps"):
        DiagnosisConfig(projection_steps=0)
    with pytest.raises(PacingConfigError, match="busy_threads_per_core"):
        DiagnosisConfig(busy_threads_per_core=0.0)


def arrays_with_gaps(compute, gap, opt):
    """Each rank arrives at its gap (previous completion -> start) plus its compute; ``opt`` is its own
    optimizer step, the first part of the next step's gap."""
    a = arrays(compute, gap=gap)
    arrival = a.gap + a.compute
    a.wait = arrival.max(axis=1, keepdims=True) - arrival + 5.0
    a.opt = np.asarray(opt, dtype=np.float64)
    return a


def test_a_rank_slow_in_bursts_is_named_by_the_time_its_late_steps_cost():
    c = 40.0 + rng.normal(0, 0.3, (400, 4))
    bursts = rng.random(400) < 0.15
    c[bursts, 2] += 40.0  # normal at the median, 40 ms late in 15% of steps
    d = diagnose(arrays(c))
    (f,) = [f for f in d.findings if f.mode == "persistent_straggler"]
    assert f.ranks == [2] and f.details["measure"] == "weighted_mean", d.findings
    assert f.details["lost_share"] >= 0.7 and abs(f.details["late_ms"] - 40.0) < 4.0, f.details
    assert "weighted by the wait each caused" in f.evidence


def test_a_late_start_in_the_frameworks_loop_is_the_network_and_in_its_optimizer_the_rank():
    c = 40.0 + rng.normal(0, 0.3, (200, 2))
    gap = 2.0 + rng.normal(0, 0.1, (200, 2))
    opt = np.full((200, 2), 1.0)
    loop = gap.copy()
    loop[:, 1] += 20.0  # rank 1 starts 20 ms late between steps, its optimizer step normal
    top = diagnose(arrays_with_gaps(c, loop, opt)).findings[0]
    assert top.mode == "fabric_contention" and top.ranks == [1], top
    assert top.details["loop_late_ms"] > 15.0 and abs(top.details["own_between_steps_late_ms"]) < 1.0
    slow_opt = opt.copy()
    slow_opt[:, 1] += 20.0  # rank 1's own optimizer step is 20 ms longer: the next gap holds it
    own = gap.copy()
    own[:, 1] += 20.0
    top = diagnose(arrays_with_gaps(c, own, slow_opt)).findings[0]
    assert top.mode == "persistent_straggler" and top.ranks == [1], top
    assert "optimizer step and its input" in top.evidence and top.details["own_between_steps_late_ms"] > 15.0


def test_gpu_ranks_count_one_busy_thread_each_so_an_8_gpu_host_is_not_crowded():
    from pace_strategy.diagnose.hosts import host_loads

    # 8 ranks on a 64-core GPU host, torch's default of 32 intra-op threads each, 4 loader workers
    topo = [
        {
            "rank": r,
            "host": "gpu-node",
            "device": f"cuda:{r}",
            "intra_op_threads": 32,
            "host_cores": 64,
            "dataloader_workers": 4,
        }
        for r in range(8)
    ]
    (load,) = host_loads(topo)
    assert load.busy_threads == 8 + 32 and load.ratio <= 1.0  # 8 launching threads + 32 workers
    assert "intra-op threads idle while the device computes" in load.load_text()
    # the same ranks on CPU would keep 8 x 32 + 32 threads busy on 64 cores
    (cpu,) = host_loads([{**t, "device": "cpu"} for t in topo])
    assert cpu.busy_threads == 8 * 32 + 32 and cpu.ratio > 1.0


@pytest.mark.parametrize("bars", [2, 3, 64, 1024])
def test_the_straggler_bars_have_integer_ticks_only(bars):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pace_strategy.diagnose.report import index_bars

    fig, ax = plt.subplots()
    try:
        index_bars(ax, [1.0] * bars, "rank")
        fig.canvas.draw()
        ticks = [t for t in ax.get_xticks() if -0.6 <= t <= bars - 0.4]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        assert len(ticks) <= 17  # readable at 1,024 ranks
        assert ax.get_xlabel() == "rank"
    finally:
        plt.close(fig)
