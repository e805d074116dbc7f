"""Model-driven runs: draws from a SimConfig, the node-count sweep and its Table-1-like rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pace_strategy.sim.engine import RunResult, WindowDraws, run_steps
from pace_strategy.sim.model import SimConfig
from pace_strategy.sim.network import step_collective_ms

__all__ = ["SweepRow", "model_draws", "simulate", "sweep"]


def model_draws(cfg: SimConfig, nodes: int) -> Callable[[int, int], WindowDraws]:
    """Seeded draws for ``nodes`` nodes; the same (window, k) always gives the same inputs."""
    g = cfg.gpus_per_node
    ranks = nodes * g
    c = cfg.compute
    base = np.full(ranks, c.base_ms)
    slow = [r for r in c.slow_ranks if r < ranks] + [
        n * g + i for n in range(nodes) for i in c.slow_local_ranks if i < g
    ]
    base[slow] *= c.slow_factor

    def draw(window: int, k: int) -> WindowDraws:
        rng = np.random.default_rng([cfg.seed, nodes, window])
        compute = (
            base + rng.normal(0.0, c.jitter_ms, (k, ranks))
            if c.jitter_ms > 0
            else np.repeat(base[None], k, 0)
        )
        if c.common_jitter_ms > 0:
            compute = compute + rng.normal(0.0, c.common_jitter_ms, (k, 1))
        if c.transient_probability > 0:
            hit = rng.random((k, ranks)) < c.transient_probability
            compute = compute + hit * rng.exponential(c.transient_ms, (k, ranks))
        if c.data_stall_probability > 0:
            compute = compute + (rng.random((k, ranks)) < c.data_stall_probability) * c.data_stall_ms
        compute = compute + c.gc_pauses_ms(rng, k, ranks)
        net = cfg.network
        if net.background_load > 0:
            sd = net.background_cv * net.background_load
            bg = np.clip(
                rng.normal(net.background_load, sd, k) if sd > 0 else np.full(k, net.background_load), 0, 0.95
            )
        else:
            bg = np.zeros(k)
        return WindowDraws(
            compute_ms=np.clip(compute, 0.0, None),
            collective_ms=step_collective_ms(net, nodes, g, bg),
            other_ms=np.full(k, c.other_ms),
        )

    return draw


def simulate(cfg: SimConfig, nodes: int, paced: bool) -> RunResult:
    """One run of ``nodes`` nodes, with the adaptive controller (``paced``) or without."""
    return run_steps(
        model_draws(cfg, nodes),
        ranks=nodes * cfg.gpus_per_node,
        steps=cfg.steps,
        warmup_steps=cfg.warmup_steps,
        gpus_per_node=cfg.gpus_per_node,
        backward_overlap=cfg.compute.backward_overlap,
        spin_contention=cfg.network.spin_contention,
        pacing=cfg.pacing if paced else None,
        window_steps=cfg.pacing.exchange_every_steps,
    )


@dataclass(frozen=True)
class SweepRow:
    nodes: int
    ranks: int
    plain: RunResult
    paced: RunResult
    efficiency_plain: float  #: throughput per rank relative to the first row (linear scaling = 1)
    efficiency_paced: float
    #: the unpaced run again with ``compute.gc_sync`` on (same draws), where the model has GC pauses
    gc_sync: RunResult | None = None

    @property
    def throughput_ratio(self) -> float:
        return self.paced.throughput / self.plain.throughput

    def to_dict(self) -> dict[str, float | int | str]:
        row: dict[str, float | int | str] = {
            "nodes": self.nodes,
            "ranks": self.ranks,
            "throughput_plain": self.plain.throughput,
            "throughput_paced": self.paced.throughput,
            "throughput_ratio": self.throughput_ratio,
            "mean_step_ms_plain": self.plain.mean_step_ms,
            "mean_step_ms_paced": self.paced.mean_step_ms,
            "cv_plain": self.plain.cv,
            "cv_paced": self.paced.cv,
            "p99_ms_plain": self.plain.p99_ms,
            "p99_ms_paced": self.paced.p99_ms,
            "scaling_efficiency_plain": self.efficiency_plain,
            "scaling_efficiency_paced": self.efficiency_paced,
            "pacing_active_share": self.paced.pacing_active_share,
            "mean_delay_ms": self.paced.mean_delay_ms,
            "controller": self.paced.last_reason,
        }
        if self.gc_sync is not None:
            row["throughput_gc_sync"] = self.gc_sync.throughput
            row["gc_sync_throughput_ratio"] = self.gc_sync.throughput / self.plain.throughput
            row["p99_ms_gc_sync"] = self.gc_sync.p99_ms
            row["lost_fraction_plain"] = self.plain.lost_fraction
            row["lost_fraction_gc_sync"] = self.gc_sync.lost_fraction
        return row


def _with_gc_sync(cfg: SimConfig) -> SimConfig:
    return dataclasses.replace(cfg, compute=dataclasses.replace(cfg.compute, gc_sync=True))


def sweep(cfg: SimConfig, progress: Callable[[str], None] | None = None) -> list[SweepRow]:
    """Every node count of ``cfg``, without and with pacing (common random numbers)."""
    rows: list[SweepRow] = []
    first: float | None = None  # per-rank unpaced throughput of the first row
    for i, nodes in enumerate(cfg.nodes):
        plain = simulate(cfg, nodes, paced=False)
        paced = simulate(cfg, nodes, paced=True)
        synced = None
        if cfg.compute.gc_pause_probability > 0 and not cfg.compute.gc_sync:
            synced = simulate(_with_gc_sync(cfg), nodes, paced=False)
        per_rank = (plain.throughput / plain.ranks, paced.throughput / paced.ranks)
        first = first or per_rank[0]
        rows.append(
            SweepRow(nodes, plain.ranks, plain, paced, per_rank[0] / first, per_rank[1] / first, synced)
        )
        if progress is not None:
            progress(f"[{i + 1}/{len(cfg.nodes)}] {nodes} nodes ({plain.ranks} ranks) done")
    return rows
