"""The checks that blame several ranks at once, or one for a stretch of steps: a slow group (ranks that
take turns being last) and a straggler episode (a rank or group slow for a stretch, on time around it).

Both read each rank's lateness against the step's median arrival (the median wait minus the rank's
wait, :class:`~pace_strategy.diagnose.digest.RunDigest`), not who is last: when several ranks are slow
each is last in only some steps, and a whole-run share of "last" drowns a stretch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pace_strategy.core.shares import best_split
from pace_strategy.diagnose.noise import expected_max_normal
from pace_strategy.diagnose.result import Finding, Mode, pct
from pace_strategy.diagnose.run_stats import EPSILON, MIN_RANKS, RunStats
from pace_strategy.telemetry.topology import MESH_KEYS

__all__ = [
    "SHARED_KEYS",
    "Episode",
    "episodes",
    "mesh_of",
    "shared_placement",
    "slow_group",
    "straggler_episode",
]

#: topology fields a slow group may share (a host, a node, a GPU model, one physical GPU, a NUMA
#: node, a CPU quota or affinity, a mesh coordinate); each is compared where the record has it
SHARED_KEYS = (
    "host",
    "node_rank",
    "local_rank",
    "device_name",
    "gpu_uuid",
    "numa_node",
    "cpu_affinity",
    "usable_cores",
    "cpu_quota",
    *MESH_KEYS,
)


def shared_placement(run: RunStats, ranks: list[int]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """What ``ranks`` share that the other ranks do not all share (``{field: value}``), and where
    they differ among themselves (``{field: [their values]}``), over :data:`SHARED_KEYS`."""
    shared: dict[str, Any] = {}
    differ: dict[str, list[Any]] = {}
    others = [r for r in range(run.W) if r not in ranks]
    for key in SHARED_KEYS:
        values = run.a.topology(key)
        mine = [values[r] for r in ranks]
        if any(v is None or v == -1 for v in mine):
            continue
        if len({str(v) for v in mine}) == 1:
            # shared, and telling: not every other rank has the same value
            if any(str(values[r]) != str(mine[0]) for r in others):
                shared[key] = mine[0]
        else:
            differ[key] = sorted({str(v) for v in mine})
    return shared, differ


def _placement_text(shared: dict[str, Any], differ: dict[str, list[Any]]) -> str:
    said = ", ".join(f"{k} {v}" for k, v in shared.items())
    apart = ", ".join(f"{k} ({', '.join(map(str, v))})" for k, v in differ.items())
    parts = [f"they share {said}" if said else "they share no recorded placement"]
    if apart:
        parts.append(f"they differ in {apart}")
    return "; ".join(parts)


@dataclass(frozen=True)
class _Recovery:
    """What fixing a slow group would recover, estimated on the calibration sample's steps."""

    exclude_step_fraction: float  #: step time saved if the group ran at the bulk's pace
    exclude_throughput: float  #: samples/s ratio running without the group (W - k ranks, same per-rank batch)
    rebalance_step_fraction: float  #: step time saved at the rebalancer's split of the same global batch
    rebalance_samples: list[int] | None  #: that split (per-rank samples; None: samples not recorded)


def _recovery(run: RunStats, group: list[int]) -> _Recovery:
    s = run.digest.sample
    bulk = np.ones(run.W, dtype=bool)
    bulk[group] = False
    step = s.step_ms
    total = float(step.sum())
    # Synchronous model: the step ends when the last rank arrives plus the transfer, so the latest
    # arrival moves from the group's to the bulk's: the smallest wait over the bulk minus over all
    # (read in place: a copy of the bulk's columns is 320 MB at 5,000 sampled steps x 8,192 ranks).
    saved = np.min(s.wait, axis=1, where=bulk[None, :], initial=np.inf) - s.wait.min(axis=1)
    exclude = float(saved.sum()) / total if total > 0 else 0.0
    throughput = (int(bulk.sum()) / run.W) / max(1.0 - exclude, EPSILON)
    compute = np.median(s.compute, axis=0)
    slowest = float(compute.max())
    split: list[int] | None = None
    if s.samples is not None and (s.samples > 0).all():
        samples = np.median(s.samples, axis=0)
        per_sample = np.maximum(compute / samples, EPSILON)
        global_batch = round(float(samples.sum()))
        if global_batch >= run.W:
            shares, balanced = best_split(per_sample.tolist(), global_batch, 1)
            split = list(shares)
        else:
            balanced = slowest
    else:
        # continuous shares in proportion to speed: every rank's compute W / sum(1 / c)
        balanced = run.W / float((1.0 / np.maximum(compute, EPSILON)).sum())
    median_step = float(np.median(step)) if len(step) else 0.0
    rebalance = (slowest - balanced) / median_step if median_step > 0 else 0.0
    return _Recovery(exclude, throughput, max(0.0, rebalance), split)


def mesh_of(run: RunStats) -> dict[str, list[Any]]:
    """The run's mesh coordinates per dimension (``{key: [per rank]}``), where every rank has one."""
    out = {}
    for key in MESH_KEYS:
        values = run.a.topology(key)
        if all(v is not None for v in values):
            out[key] = values
    return out


@dataclass(frozen=True)
class _Kind:
    """What a slow group is in the mesh: a pipeline stage, one tensor-parallel group, the same
    coordinate in every replica, or ranks with nothing of the mesh in common."""

    mode: Mode
    what: str  #: the evidence's opening words
    key: str | None = None  #: the mesh dimension it follows
    value: Any = None


def _kind(run: RunStats, members: list[int]) -> _Kind | None:
    """The group's kind; ``None`` for a single rank that is not a whole pipeline stage (the one-rank
    check's)."""
    mesh = mesh_of(run)
    group = set(members)

    def whole(key: str) -> Any:
        """The value of ``key`` the members share when they are every rank with it, else None."""
        values = {str(mesh[key][r]) for r in members}
        if len(values) != 1:
            return None
        value = mesh[key][members[0]]
        return value if {r for r in range(run.W) if mesh[key][r] == value} == group else None

    if "pp" in mesh and (stage := whole("pp")) is not None:
        return _Kind(Mode.STAGE_IMBALANCE, f"pipeline stage {stage} (ranks {_names(members)})", "pp", stage)
    if len(members) < 2:
        return None
    if "tp" in mesh and len(members) == len({str(v) for v in mesh["tp"]}):
        rest = [k for k in mesh if k != "tp"]
        if len({tuple(str(mesh[k][r]) for k in rest) for r in members}) == 1:
            where = ", ".join(f"{k} {mesh[k][members[0]]}" for k in rest)
            return _Kind(
                Mode.PERSISTENT_STRAGGLER,
                f"the tensor-parallel group {'at ' + where + ' ' if where else ''}(ranks {_names(members)}), "
                "which arrives as one worker,",
                "tp",
            )
    for key in ("dp_shard", "tp", "cp"):
        if key in mesh and (value := whole(key)) is not None:
            return _Kind(Mode.LOCALITY, f"{key} coordinate {value} in every replica", key, value)
    return _Kind(Mode.PERSISTENT_STRAGGLER, f"a group of {len(members)} of {run.W} ranks")


def _names(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def slow_group(run: RunStats, explained: set[int]) -> list[Finding]:
    """Two or more ranks (at most half the world) each later than the step's median arrival by at least
    the noise threshold in at least ``persistent_share`` of steps, by their own compute: one finding
    naming them all, by what they are in the mesh (:func:`_kind`): ``stage_imbalance`` for every rank
    of a pipeline stage (one rank too, where the stage has one), ``locality`` for one coordinate in
    every replica, else ``persistent_straggler`` (a tensor-parallel group said as such). One such rank
    otherwise is left to the one-rank check."""
    found = _slow_members(run, explained)
    if found is None:
        return []
    members, kind, bulk_compute = found
    cfg, a = run.cfg, run.a
    late_share = run.digest.late_count / max(run.S, 1)
    mean_late = run.digest.late_sum / max(run.S, 1)
    compute = run.digest.compute_mean
    mask = np.isin(run.straggler, members)
    recovery = _recovery(run, members)
    shared, differ = shared_placement(run, members)
    per_rank = [
        {
            "rank": r,
            "late_share": float(late_share[r]),
            "late_ms": float(mean_late[r]),
            "compute_excess_ms": float(compute[r] - bulk_compute),
            "compute_excess_fraction": float((compute[r] - bulk_compute) / max(bulk_compute, EPSILON)),
        }
        for r in members
    ]
    # What the group costs is the step time its slowness adds: the bulk waits for it, and its own
    # ranks do not (the waiting of the others understates it by the group's share of the ranks).
    # Jitter alone saves the difference between the slowest of W and of W - k ranks.
    jitter = (
        cfg.jitter_floor_factor
        * run.floor.sigma_ms
        * (expected_max_normal(run.W) - expected_max_normal(run.W - len(members)))
        / max(float(a.step_ms.mean()), EPSILON)
    )
    details: dict[str, Any] = {
        "group": per_rank,
        "shared": shared,
        "differ": differ,
        "waiting_fraction": run.lost_when(mask),
        "mesh_key": kind.key,
    }
    cost = (
        f"{'their' if len(members) > 1 else 'its'} slowness adds {pct(recovery.exclude_step_fraction)} "
        f"to the step, the others losing {pct(run.lost_when(mask))} of it waiting"
    )
    if kind.mode is Mode.STAGE_IMBALANCE:
        evidence, action = _stage_words(run, kind, cost, details)
    else:
        details.update(
            recovery_rebalance_fraction=recovery.rebalance_step_fraction,
            rebalance_samples=recovery.rebalance_samples,
            recovery_exclude_fraction=recovery.exclude_step_fraction,
            exclude_throughput_ratio=recovery.exclude_throughput,
        )
        evidence, action = _group_words(run, kind, per_rank, bulk_compute, recovery, (shared, differ), cost)
    explained.update(members)
    return [
        Finding(
            mode=kind.mode,
            ranks=members,
            hosts=run.hosts_of(members),
            confidence=float(np.mean([late_share[r] for r in members])),
            lost_step_fraction=recovery.exclude_step_fraction,
            noise_floor_fraction=jitter,
            projection_basis="step",
            evidence=evidence,
            action=action,
            details=details,
        )
    ]


def _slow_members(run: RunStats, explained: set[int]) -> tuple[list[int], _Kind, float] | None:
    """The ranks not yet explained that are late in at least ``persistent_share`` of steps by their own
    compute (1 up to W/2 of them), what they are in the mesh, and the bulk's median compute; ``None``
    where they are not a group :func:`_kind` names."""
    cfg = run.cfg
    if run.W < MIN_RANKS:
        return None
    late_share = run.digest.late_count / max(run.S, 1)
    mean_late = run.digest.late_sum / max(run.S, 1)
    compute = run.digest.compute_mean
    slow = [r for r in range(run.W) if r not in explained and late_share[r] >= cfg.persistent_share]
    if not 1 <= len(slow) <= run.W // 2:
        return None
    bulk_compute = float(np.median(np.delete(compute, slow)))
    # slow by their own compute: a rank that is late only because it started late (a slower
    # network path) is left to the one-rank check, which says so
    members = [r for r in slow if compute[r] - bulk_compute >= cfg.compute_late_fraction * mean_late[r]]
    kind = _kind(run, members) if members else None
    return None if kind is None else (members, kind, bulk_compute)


def _stage_words(run: RunStats, kind: _Kind, cost: str, details: dict[str, Any]) -> tuple[str, str]:
    """A whole pipeline stage: each stage's compute (into ``details``), the evidence and the action."""
    stages = _stage_compute(run)
    mean_stage = float(np.mean(list(stages.values())))
    repartition = (stages[kind.value] - mean_stage) / max(run.median_step, EPSILON)
    details.update(
        stage=kind.value,
        stage_compute_ms={str(k): v for k, v in stages.items()},
        recovery_repartition_fraction=max(0.0, repartition),
    )
    evidence = (
        f"{kind.what} computes {stages[kind.value]:.1f} ms per step against "
        f"{_stage_text(stages, kind.value)} for the other stages, in every replica: every other stage "
        f"waits for it (the pipeline's bubble; {cost}); waits in pipeline receives are waiting behind "
        "this stage, not the network"
    )
    action = (
        "repartition the layers across the stages: move layers off this stage (the stage with the "
        "loss and the output layer is the usual one, its vocabulary projection the usual excess); "
        f"balanced stages ({mean_stage:.1f} ms each) would recover about {pct(max(0.0, repartition))} "
        "of the step; pacing or rebalancing within the data-parallel group cannot"
    )
    return evidence, action


def _group_words(
    run: RunStats,
    kind: _Kind,
    per_rank: list[dict[str, Any]],
    bulk_compute: float,
    recovery: _Recovery,
    placement: tuple[dict[str, Any], dict[str, list[Any]]],
    cost: str,
) -> tuple[str, str]:
    """Slow ranks that are not a stage: each one's excess, what they share, what would recover it."""
    members = [p["rank"] for p in per_rank]
    compute = run.digest.compute_mean
    shared, differ = placement
    mask = np.isin(run.straggler, members)
    excess = ", ".join(
        f"rank {p['rank']} {p['compute_excess_ms']:+.1f} ms ({p['compute_excess_fraction']:+.0%}, late in "
        f"{pct(p['late_share'])})"
        for p in per_rank
    )
    split = f" (split {recovery.rebalance_samples} samples per rank)" if recovery.rebalance_samples else ""
    slowest = max(members, key=lambda r: compute[r])
    inside = (
        f"; its slowest member by compute is rank {slowest}"
        if kind.key == "tp" and compute[slowest] - float(np.median(compute[members])) >= run.noise_ms()
        else ""
    )
    evidence = (
        f"{kind.what} slower than the bulk in most steps"
        + (
            f", taking turns being last (together last in {pct(float(mask.mean()))} of {run.S:,} steps; "
            if len(members) > 1
            else " ("
        )
        + f"{cost}); compute against the others' median {bulk_compute:.1f} ms: {excess}{inside}; "
        f"{_placement_text(shared, differ)}"
    )
    action = (
        "these ranks' own work is slow; pacing cannot shorten their steps. Rebalancing "
        f"(PacingConfig(rebalance=True)) would recover about {pct(recovery.rebalance_step_fraction)} "
        f"of the step{split}; running without them (excluding their hosts at the next launch) "
        f"would shorten the step by {pct(recovery.exclude_step_fraction)}, "
        f"{recovery.exclude_throughput - 1:+.0%} samples/s with {run.W - len(members)} ranks"
        + (f"; look first at what they share ({', '.join(shared)})" if shared else "")
    )
    return evidence, action


def _stage_compute(run: RunStats) -> dict[Any, float]:
    """Each pipeline stage's compute per step, ms: the median over its ranks of their mean compute."""
    pp = mesh_of(run)["pp"]
    compute = run.digest.compute_mean
    stages: dict[Any, list[float]] = {}
    for r, stage in enumerate(pp):
        stages.setdefault(stage, []).append(float(compute[r]))
    return {k: float(np.median(v)) for k, v in sorted(stages.items(), key=lambda kv: str(kv[0]))}


def _stage_text(stages: dict[Any, float], slow: Any) -> str:
    return ", ".join(f"{v:.1f}" for k, v in stages.items() if k != slow) + " ms"


#: the chance that a rank's late bins line up into a stretch as long as an episode's by accident,
#: over every bin and column tested (a significance level, not a tuned threshold)
EPISODE_FALSE_ALARM = 0.01


@dataclass(frozen=True)
class Episode:
    """A stretch of steps in which some ranks (one column of the lateness bins) were late."""

    ranks: list[int]
    first: int  #: index of its first step among the run's steps
    last: int  #: index of its last step (inclusive)
    late_fraction: float  #: share of the stretch's bins in which the column was late


def _kl(q: float, p: float) -> float:
    """Kullback-Leibler divergence of Bernoulli(q) from Bernoulli(p) (0 < p < 1)."""
    out = q * np.log(q / p) if q > 0 else 0.0
    return float(out + ((1 - q) * np.log((1 - q) / (1 - p)) if q < 1 else 0.0))


def episodes(run: RunStats, min_steps: int) -> list[Episode]:
    """Each column's stretches of consecutive bins late by at least the noise threshold (change
    points where its binned lateness crosses it; a single on-time bin inside a stretch does not end
    it), at least ``min_steps`` steps long, not the whole run, and too long to be chance: by the
    Chernoff bound on the column's own rate of late bins, fewer than :data:`EPISODE_FALSE_ALARM`
    such stretches are expected by accident over all bins and columns. A rank late all run has a
    rate near one, so no stretch of it stands out: that is a persistent straggler."""
    d = run.digest
    noise = run.noise_ms()
    edges = d.late_edges
    bins, columns = d.late_bins.shape
    tests = max(bins * columns, 1)
    out = []
    for col, ranks in enumerate(d.late_labels):
        late = d.late_bins[:, col] >= noise
        p = float(late.mean()) if bins else 0.0
        if not 0.0 < p < 1.0:
            continue
        closed = late.copy()
        closed[1:-1] |= late[:-2] & late[2:]
        changes = np.flatnonzero(np.diff(np.concatenate([[0], closed.astype(np.int8), [0]])))
        for lo, hi in zip(changes[::2], changes[1::2], strict=True):
            first, last = int(edges[lo]), int(edges[hi]) - 1
            q = float(late[lo:hi].mean())
            if last - first + 1 < min_steps or (lo == 0 and hi == bins) or q <= p:
                continue
            if tests * np.exp(-(hi - lo) * _kl(q, p)) >= EPISODE_FALSE_ALARM:
                continue
            out.append(Episode(ranks=list(ranks), first=first, last=last, late_fraction=q))
    return out


def _grouped(found: list[Episode]) -> list[list[Episode]]:
    """Episodes of different ranks over the same stretch (each overlapping the first of its group by
    at least half of the shorter) as one group: several ranks slow together."""
    groups: list[list[Episode]] = []
    for e in sorted(found, key=lambda e: (e.first, e.ranks)):
        for g in groups:
            head = g[0]
            overlap = min(head.last, e.last) - max(head.first, e.first) + 1
            shorter = min(head.last - head.first, e.last - e.first) + 1
            if overlap >= 0.5 * shorter and not set(e.ranks) & {r for x in g for r in x.ranks}:
                g.append(e)
                break
        else:
            groups.append([e])
    return groups


def straggler_episode(run: RunStats, explained: set[int]) -> list[Finding]:
    """A rank, or ranks together (a node's ranks above ``max_heatmap_rows``), late for a stretch of
    steps and on time around it: ``straggler_episode``, with the share of that stretch and of the
    run it cost, and whether it recurred or had not ended."""
    a = run.a
    found = [e for e in episodes(run, run.cfg.min_steps) if not set(e.ranks) <= explained]
    # the same ranks' stretches in one finding (recurring), ranks slow over the same stretch together
    by_ranks: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for g in _grouped(found):
        ranks = tuple(sorted(r for e in g for r in e.ranks))
        by_ranks.setdefault(ranks, []).append((min(e.first for e in g), max(e.last for e in g)))
    step_ms = a.step_ms
    out = []
    for ranks, spans in by_ranks.items():
        members = list(ranks)
        # Late over most of the run in several stretches is a persistent straggler with pauses (the
        # one-rank check's); one stretch from a change point to either end of the record is an
        # episode however long (on time, then slow to the end).
        covered = sum(last - first + 1 for first, last in spans) / max(run.S, 1)
        one_change = len(spans) == 1 and (spans[0][0] == 0 or spans[0][1] == run.S - 1)
        if covered >= run.cfg.persistent_share and not one_change:
            continue
        run_mask = np.zeros(run.S, dtype=bool)
        scope = np.zeros(run.S, dtype=bool)
        parts: list[dict[str, Any]] = []
        for first, last in spans:
            inside = np.zeros(run.S, dtype=bool)
            inside[first : last + 1] = True
            mask = inside & np.isin(run.straggler, members)
            run_mask |= mask
            scope |= inside
            stretch_total = float(step_ms[inside].sum())
            lost = float(run.lost_per_step[mask].sum())
            parts.append(
                {
                    "steps": [int(a.step[first]), int(a.step[last])],
                    "step_count": last - first + 1,
                    "stretch_lost_fraction": lost / stretch_total if stretch_total > 0 else 0.0,
                    "run_lost_fraction": run.lost_when(mask),
                    "late_ms": float(np.median(run.late_ms(mask))) if mask.any() else 0.0,
                    "ongoing": last == run.S - 1,
                }
            )
        names = ", ".join(map(str, members))
        who = f"rank {names}" if len(members) == 1 else f"ranks {names} together"
        spans_text = "; ".join(
            f"steps {p['steps'][0]}-{p['steps'][1]}{' (to the end of the record)' if p['ongoing'] else ''}: "
            f"{p['late_ms']:.1f} ms late at the median, {pct(p['stretch_lost_fraction'])} of that stretch's "
            f"step time lost to waiting ({pct(p['run_lost_fraction'])} of the run's)"
            for p in parts
        )
        recurred, ongoing = len(parts) > 1, parts[-1]["ongoing"]
        total = float(step_ms.sum())
        explained.update(members)
        out.append(
            Finding(
                mode=Mode.STRAGGLER_EPISODE,
                ranks=members,
                hosts=run.hosts_of(members),
                confidence=float(np.mean([p["stretch_lost_fraction"] > 0 for p in parts])),
                lost_step_fraction=run.lost_when(run_mask),
                noise_floor_fraction=run.jitter_when(run_mask),
                scope_fraction=float(step_ms[scope].sum()) / total if total > 0 else 1.0,
                projection_basis="ranks",
                evidence=(
                    f"{who} late for {'stretches' if recurred else 'a stretch'} of steps and on time "
                    f"around {'them (it recurred)' if recurred else 'it'}: {spans_text}"
                    + ("; the last stretch had not ended when the record did" if ongoing else "")
                ),
                action=(
                    "something changed on that rank's host for those steps: look at its logs and metrics "
                    "over that time (thermal or power throttling, another job, a CPU quota, a failing "
                    "link or disk); a stretch that recurs is worth a health check, one that has not ended "
                    "a replacement; pacing cannot shorten its steps"
                ),
                details={"episodes": parts, "recurred": recurred, "ongoing": ongoing},
            )
        )
    return out
