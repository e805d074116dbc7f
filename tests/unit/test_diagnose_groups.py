"""Slow groups and straggler episodes on synthetic per-worker timings shaped like published cluster
traces: several slow workers taking turns being last, one worker slow for a stretch of a long run.

The expected share of each finding is the truth of the injection: the waiting of the same draws with
and without the slowness (the ranks' mean lead), over the step with it."""

import numpy as np
import pytest

from pace_strategy.diagnose import diagnose
from tests.unit.test_diagnose_findings import arrays

STEP_MS = 200.0  #: a mini-batch's compute, ms


def jittered(rng, steps, world, sd=0.03):
    """Each worker's compute: a shared per-step factor (the batch) and its own jitter (log-normal)."""
    shared = rng.lognormal(0.0, sd, (steps, 1))
    return STEP_MS * shared * rng.lognormal(0.0, sd, (steps, world))


def lost(compute):
    """The ranks' mean lead over the run's step time, as the synthetic record's steps count it."""
    arrival = compute.max(axis=1, keepdims=True)
    return float((arrival - compute).mean(axis=1).sum())


def truth(slow, base):
    """The waiting the injection causes, as a share of the injected run's step time (5 ms transfer, 2 ms
    outside, as ``arrays`` builds them)."""
    total = float((slow.max(axis=1) + 7.0).sum())
    return (lost(slow) - lost(base)) / total


def added(slow, base):
    """The step time the injection adds, as a share of the injected run's step time."""
    return float((slow.max(axis=1) - base.max(axis=1)).sum() / (slow.max(axis=1) + 7.0).sum())


@pytest.mark.parametrize(
    ("world", "slow", "factor", "seed"),
    [
        (10, [2, 5, 7], (1.08, 1.10), 1),  # three of ten 8-10% slower: together last in ~90% of steps
        (10, [3, 8], (1.10, 1.10), 2),  # two of ten 10% slower
        (10, [0, 1, 4, 6, 9], (3.0, 4.0), 3),  # five of ten 3-4x slower
        (16, [11, 12, 13, 14], (1.2, 1.3), 4),  # a slow host of 4 in 16
    ],
)
def test_a_slow_group_is_one_finding_naming_every_member(world, slow, factor, seed):
    rng = np.random.default_rng(seed)
    base = jittered(rng, 300, world)
    c = base.copy()
    c[:, slow] *= rng.uniform(*factor, size=len(slow))
    d = diagnose(arrays(c), project_ranks=None)
    top = d.findings[0]
    assert top.mode == "persistent_straggler", d.summary
    assert top.ranks == slow, top.evidence
    assert abs(top.lost_step_fraction - added(c, base)) < 0.05, (top.lost_step_fraction, added(c, base))
    assert [g["rank"] for g in top.details["group"]] == slow
    assert top.details["recovery_rebalance_fraction"] > 0 and top.details["recovery_exclude_fraction"] > 0
    assert "taking turns being last" in top.evidence and "rebalanc" in top.action


def test_a_slow_group_says_what_its_members_share():
    # two ranks on two hosts at different local indices (not locality) with the slower GPU model
    rng = np.random.default_rng(5)
    c = jittered(rng, 300, 8)
    c[:, [2, 5]] *= 1.25
    a = arrays(c, hosts=["a"] * 4 + ["b"] * 4, local=[0, 1, 2, 3] * 2, nodes=[0] * 4 + [1] * 4)
    for t in a.header["topology"]:
        t["device_name"] = "GPU-B" if t["rank"] in (2, 5) else "GPU-A"
    top = diagnose(a, project_ranks=None).findings[0]
    assert top.mode == "persistent_straggler" and top.ranks == [2, 5], top.evidence
    assert top.details["shared"] == {"device_name": "GPU-B"}
    assert top.details["differ"]["host"] == ["a", "b"] and top.details["differ"]["local_rank"] == ["1", "2"]
    assert "device_name GPU-B" in top.evidence and "device_name" in top.action


def test_one_slow_rank_stays_the_one_rank_finding():
    rng = np.random.default_rng(6)
    c = jittered(rng, 300, 10)
    c[:, 4] *= 1.2
    top = diagnose(arrays(c), project_ranks=None).findings[0]
    assert top.mode == "persistent_straggler" and top.ranks == [4]
    assert "group" not in top.details


def test_a_straggler_episode_in_the_middle_of_a_long_run_is_named_with_its_stretch():
    rng = np.random.default_rng(7)
    base = jittered(rng, 3000, 8)
    c = base.copy()
    c[1400:1530, 3] *= 1.35
    d = diagnose(arrays(c), project_ranks=None)
    top = d.findings[0]
    assert top.mode == "straggler_episode" and top.ranks == [3], d.summary
    (episode,) = top.details["episodes"]
    first, last = episode["steps"]
    assert abs(first - 1400) <= 6 and abs(last - 1529) <= 6, episode
    assert not top.details["recurred"] and not top.details["ongoing"]
    stretch = slice(1400, 1530)
    in_stretch = truth(c[stretch], base[stretch])
    assert abs(episode["stretch_lost_fraction"] - in_stretch) < 0.05, (episode, in_stretch)
    assert abs(top.lost_step_fraction - truth(c, base)) < 0.05


def test_a_straggler_that_appears_and_stays_is_an_episode_that_did_not_end():
    rng = np.random.default_rng(8)
    c = jittered(rng, 2000, 8)
    c[1200:, 5] *= 1.3
    top = diagnose(arrays(c), project_ranks=None).findings[0]
    assert top.mode == "straggler_episode" and top.ranks == [5], top.evidence
    assert top.details["ongoing"] and "had not ended" in top.evidence


def test_a_recurring_episode_is_one_finding_with_each_stretch():
    rng = np.random.default_rng(9)
    c = jittered(rng, 3000, 8)
    c[500:650, 1] *= 1.4
    c[2000:2150, 1] *= 1.4
    top = diagnose(arrays(c), project_ranks=None).findings[0]
    assert top.mode == "straggler_episode" and top.ranks == [1]
    assert top.details["recurred"] and len(top.details["episodes"]) == 2


@pytest.mark.parametrize("seed", range(20))
def test_clean_runs_raise_no_group_or_episode(seed):
    rng = np.random.default_rng(100 + seed)
    world = (4, 8, 10, 16, 64)[seed % 5]
    steps = (300, 1000, 3000)[seed % 3]
    c = jittered(rng, steps, world, sd=(0.01, 0.03, 0.05)[seed % 3])
    d = diagnose(arrays(c), project_ranks=None)
    assert [f.mode for f in d.findings] == ["healthy"], d.summary
    assert not any("straggler_episode" in n or "persistent_straggler" in n for n in d.notes)


def with_mesh(a, **coords):
    """``a`` with each rank's mesh coordinates (``key=[per rank]``) in its topology."""
    for t in a.header["topology"]:
        for key, values in coords.items():
            t[key] = values[t["rank"]]
    return a


def test_a_pipeline_stage_slower_in_every_replica_is_stage_imbalance():
    # data x pipeline: 2 replicas x 4 stages, the last stage (loss and output layer) 30% more work
    rng = np.random.default_rng(11)
    base = jittered(rng, 400, 8)
    c = base.copy()
    c[:, [3, 7]] *= 1.3
    a = with_mesh(arrays(c), pp=[r % 4 for r in range(8)], dp=[r // 4 for r in range(8)])
    top = diagnose(a, project_ranks=None).findings[0]
    assert top.mode == "stage_imbalance" and top.ranks == [3, 7], top.evidence
    assert top.details["stage"] == 3 and "repartition" in top.action
    assert "not the network" in top.evidence
    assert abs(top.lost_step_fraction - added(c, base)) < 0.05
    # balanced stages: (1.3 - 1.075) x 200 ms of a ~270 ms step
    assert 0.1 < top.details["recovery_repartition_fraction"] < 0.25


def test_one_stage_of_a_pipeline_without_replicas_is_stage_imbalance():
    rng = np.random.default_rng(12)
    c = jittered(rng, 300, 4)
    c[:, 2] *= 1.25
    top = diagnose(with_mesh(arrays(c), pp=[0, 1, 2, 3]), project_ranks=None).findings[0]
    assert top.mode == "stage_imbalance" and top.ranks == [2]


def test_one_slow_worker_of_a_data_x_pipeline_job_is_named_with_its_cost():
    rng = np.random.default_rng(13)
    base = jittered(rng, 400, 16)
    c = base.copy()
    c[:, 9] *= 1.35
    a = with_mesh(arrays(c), pp=[r % 4 for r in range(16)], dp=[r // 4 for r in range(16)])
    top = diagnose(a, project_ranks=None).findings[0]
    assert top.mode == "persistent_straggler" and top.ranks == [9]
    assert abs(top.lost_step_fraction - truth(c, base)) < 0.05


def test_a_slow_tensor_parallel_group_is_named_as_one_worker():
    rng = np.random.default_rng(14)
    c = jittered(rng, 300, 8)
    c[:, [4, 5]] *= 1.2  # both members wait for each other inside forward and backward
    a = with_mesh(arrays(c), tp=[r % 2 for r in range(8)], dp=[r // 2 for r in range(8)])
    top = diagnose(a, project_ranks=None).findings[0]
    assert top.mode == "persistent_straggler" and top.ranks == [4, 5]
    assert "tensor-parallel group at dp 2" in top.evidence and top.details["mesh_key"] == "tp"


def test_the_same_shard_slow_in_every_replica_is_locality_by_mesh_coordinate():
    # HSDP: 2 replicas x 4 shards; shard 1 slow in both
    rng = np.random.default_rng(15)
    c = jittered(rng, 300, 8)
    c[:, [1, 5]] *= 1.2
    a = with_mesh(arrays(c), dp_replicate=[r // 4 for r in range(8)], dp_shard=[r % 4 for r in range(8)])
    top = diagnose(a, project_ranks=None).findings[0]
    assert top.mode == "locality" and top.ranks == [1, 5], top.evidence
    assert top.details["mesh_key"] == "dp_shard" and "dp_shard coordinate 1 in every replica" in top.evidence


def test_the_report_outlines_an_episode_on_its_rank_s_row_of_the_heat_map(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pace_strategy.diagnose import DiagnosisConfig, diagnose_run
    from pace_strategy.diagnose.report import _mark_episodes, render_report

    rng = np.random.default_rng(7)
    c = jittered(rng, 3000, 8)
    c[1400:1530, 3] *= 1.35
    a = arrays(c)
    cfg = DiagnosisConfig()
    d, digest = diagnose_run(a, cfg, project_ranks=None)
    fig, ax = plt.subplots()
    _mark_episodes(ax, a, d, digest)
    (box,) = ax.patches
    # 3,000 steps in 1,000 bins of 3: steps 1400-1529 are bins 466-509 (within one bin)
    assert abs(box.get_x() + 0.5 - 1400 / 3) <= 1 and abs(box.get_width() - 130 / 3) <= 2
    assert box.get_y() + 0.5 == digest.heat_labels.index("r3")
    plt.close(fig)
    assert (render_report(a, d, tmp_path, cfg, digest)["lead_heatmap"]).stat().st_size > 0


def test_a_persistent_straggler_with_pauses_is_not_an_episode():
    rng = np.random.default_rng(10)
    c = jittered(rng, 3000, 8)
    slow = np.ones(3000, dtype=bool)
    slow[[*range(700, 760), *range(1900, 1990)]] = False  # on time for two short stretches
    c[slow, 6] *= 1.3
    top = diagnose(arrays(c), project_ranks=None).findings[0]
    assert top.mode == "persistent_straggler" and top.ranks == [6], top.evidence
