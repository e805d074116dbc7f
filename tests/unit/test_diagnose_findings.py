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
    step_ms = (arrival[:, 0] + transfer + 2.0).astype(np.float64)
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
