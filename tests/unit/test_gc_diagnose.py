"""``gc_pauses`` on a real GC-heavy 2-rank record, and only where the collector explains the lateness.

The fixture is a real run on this machine: ``pace demo --devices 2 --steps 200 --compute-ms 20
--straggler '' --gc-heap-objects 1500000 --gc-garbage-objects 20000`` (paced_ddp, no gc_sync).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from pace_strategy.diagnose import DiagnosisConfig, Mode, diagnose, load_arrays
from pace_strategy.diagnose.gc_checks import gc_pauses
from pace_strategy.diagnose.run_stats import RunStats

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gc_pauses_2ranks.jsonl"


@pytest.fixture(scope="module")
def arrays():
    return load_arrays(FIXTURE)


def test_the_record_carries_per_rank_gc_time(arrays):
    assert arrays.gc_ms is not None and arrays.gc_ms.shape == (arrays.steps, 2)
    assert arrays.gc_collections is not None and arrays.gc_collections.sum() > 0
    assert arrays.gc_ms.max() > 100.0  # full collections of a 1.5M-object heap


def test_gc_heavy_run_is_named_gc_pauses_with_its_numbers(arrays):
    result = diagnose(arrays, project_ranks=None)
    top = result.findings[0]
    assert top.mode is Mode.GC_PAUSES and top.ranks == [0, 1], result.summary
    assert top.details["explained_share"] > 0.8 and top.confidence > 0.8
    assert top.details["pauses_per_1000_steps_per_rank"] > 10 and top.details["pause_ms_p99"] > 100
    assert top.lost_step_fraction > 0.1
    assert "gc_sync=True" in top.action and "gc.freeze()" in top.action
    # the source is named, so amplification is not reported beside it
    assert Mode.SYNC_AMPLIFICATION not in {f.mode for f in result.findings}


def test_without_gc_time_the_same_waiting_is_not_blamed_on_the_collector(arrays):
    quiet = dataclasses.replace(arrays, gc_ms=np.zeros_like(arrays.gc_ms))
    assert Mode.GC_PAUSES not in {f.mode for f in diagnose(quiet, project_ranks=None).findings}
    absent = dataclasses.replace(arrays, gc_ms=None, gc_collections=None)  # an older record
    assert gc_pauses(RunStats(absent, DiagnosisConfig()), set()) == []


def test_gc_time_on_the_early_rank_explains_nothing(arrays):
    # the same pauses moved onto the rank that was *not* late: the late rank's own GC time is zero
    swapped = dataclasses.replace(arrays, gc_ms=arrays.gc_ms[:, ::-1].copy())
    assert gc_pauses(RunStats(swapped, DiagnosisConfig()), set()) == []


def test_a_pause_every_rank_takes_at_the_same_step_is_not_the_late_ranks_own(arrays):
    # the pauses synchronized (gc_sync's aim): in every step both ranks pause as long as the longer
    # one did, so the late rank collected no more than the other and its lateness is not its GC time
    both = np.repeat(arrays.gc_ms.max(axis=1, keepdims=True), 2, axis=1)
    assert gc_pauses(RunStats(dataclasses.replace(arrays, gc_ms=both), DiagnosisConfig()), set()) == []
    # (the same record with each rank pausing at its own steps, as it ran, names the collector:
    # test_gc_heavy_run_is_named_gc_pauses_with_its_numbers)


def test_the_thresholds_decide(arrays):
    assert gc_pauses(RunStats(arrays, DiagnosisConfig(gc_min_steps=10_000)), set()) == []
    explained: set[int] = set()
    (finding,) = gc_pauses(RunStats(arrays, DiagnosisConfig(gc_explained_share=0.6)), explained)
    assert explained == {0, 1} and finding.mode is Mode.GC_PAUSES


def test_with_gc_sync_on_the_action_is_short_pauses_not_gc_sync(arrays):
    header = {**arrays.header, "config": {**arrays.header["config"], "gc_sync": {"enabled": True}}}
    (finding,) = gc_pauses(RunStats(dataclasses.replace(arrays, header=header), DiagnosisConfig()), set())
    assert "gc_sync is on" in finding.action and "gc_sync.freeze=True" in finding.action


def test_a_pause_the_device_hid_is_not_blamed_on_the_collector(arrays):
    # The same record as if it ran on a GPU whose device was still behind its host in every step: the
    # collector paused the host, but the run-ahead hid the pause, so it explains no lateness
    hidden = dataclasses.replace(arrays, host_bound=np.zeros_like(arrays.host_bound))
    assert gc_pauses(RunStats(hidden, DiagnosisConfig()), set()) == []
    # host-bound in the costly steps (every step of this CPU run is): named, nothing hidden
    assert arrays.host_bound is not None and arrays.host_bound.all()
    (finding,) = gc_pauses(RunStats(arrays, DiagnosisConfig()), set())
    assert finding.details["hidden_steps"] == 0 and "hidden by the run-ahead" not in finding.evidence
    # hidden on rank 1 only: its steps stop counting (about half the lateness is left explained, so
    # the default share of 0.8 no longer names the collector), and the evidence says how many
    one = arrays.host_bound.copy()
    one[:, 1] = False
    with_one = dataclasses.replace(arrays, host_bound=one)
    assert gc_pauses(RunStats(with_one, DiagnosisConfig()), set()) == []
    (finding,) = gc_pauses(RunStats(with_one, DiagnosisConfig(gc_explained_share=0.3)), set())
    assert finding.ranks == [0] and 0.3 < finding.details["explained_share"] < 0.6
    assert finding.details["hidden_steps"] > 10 and "hidden by the run-ahead" in finding.evidence
