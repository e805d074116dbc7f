"""The simulator's typed model: compute per rank, a hierarchical network, and the sweep.

Every number here is an input of the model, documented with its unit; nothing encodes a benefit of
pacing. Pacing can only help in the model through a mechanism it names (``spin_contention``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from pace_strategy.core.config import PacingConfig, check_number, doc
from pace_strategy.core.errors import PacingConfigError

__all__ = ["ComputeModel", "NetworkModel", "SimConfig"]


def _check(cond: bool, where: str, value: Any, allowed: str) -> None:
    """What is not a number range (a switch, a choice, a list of counts): numbers go through the
    typed configs' shared :func:`~pace_strategy.core.config.check_number`."""
    if not cond:
        raise PacingConfigError(f"{where}={value!r} is invalid: expected {allowed}.")


@dataclass(frozen=True, kw_only=True)
class ComputeModel:
    """Per-rank compute time of one step (forward + backward), milliseconds."""

    base_ms: float = field(default=100.0, metadata=doc("Compute time of a healthy rank, ms."))
    jitter_ms: float = field(
        default=1.0,
        metadata=doc("Standard deviation of iid normal jitter per rank per step, ms (clipped at 0)."),
    )
    common_jitter_ms: float = field(
        default=0.0, metadata=doc("Standard deviation of a per-step jitter shared by all ranks, ms.")
    )
    transient_probability: float = field(
        default=0.0, metadata=doc("Chance that a given rank is a transient straggler in a given step.")
    )
    transient_ms: float = field(
        default=50.0,
        metadata=doc("Mean extra time of a transient straggler, ms (exponential distribution)."),
    )
    slow_ranks: tuple[int, ...] = field(default=(), metadata=doc("Persistently slow global ranks."))
    slow_local_ranks: tuple[int, ...] = field(
        default=(), metadata=doc("Local rank indices that are slow on every node (locality).")
    )
    slow_factor: float = field(
        default=1.2, metadata=doc("Compute of a slow rank is this multiple of base_ms.")
    )
    data_stall_probability: float = field(
        default=0.0, metadata=doc("Chance per rank per step of waiting for input.")
    )
    data_stall_ms: float = field(default=0.0, metadata=doc("Input wait of a data stall, ms."))
    backward_overlap: float = field(
        default=0.0,
        metadata=doc(
            """Fraction of compute that runs after the first gradient bucket is ready and overlaps the
            collective (DDP bucket overlap with backward)."""
        ),
    )
    other_ms: float = field(
        default=0.0, metadata=doc("Per-step time outside compute and the collective (optimizer, loop), ms.")
    )
    gc_pause_probability: float = field(
        default=0.0,
        metadata=doc(
            """Chance per rank per step that its garbage collector runs a full collection (one every
            1/p steps on average; ``pace diagnose`` quotes the measured rate per 1,000 steps)."""
        ),
    )
    gc_pause_ms: float = field(
        default=100.0,
        metadata=doc(
            "Length of one full collection, ms (it scans the whole heap: ~110 ms for 1.5M objects)."
        ),
    )
    gc_sync: bool = field(
        default=False,
        metadata=doc(
            """Synchronized collection (``PacingConfig.gc_sync``): every rank pauses at the same steps,
            as often as one rank's collector would (the model ignores the up-to-one-window wait for the
            agreed step). Off: each rank pauses at its own steps, independently."""
        ),
    )

    def __post_init__(self) -> None:
        names = ("base_ms", "jitter_ms", "common_jitter_ms", "transient_ms", "data_stall_ms", "other_ms")
        for name in (*names, "gc_pause_ms"):
            check_number(f"compute.{name}", getattr(self, name), 0.0)
        _check(isinstance(self.gc_sync, bool), "compute.gc_sync", self.gc_sync, "true or false")
        shares = (
            "transient_probability",
            "data_stall_probability",
            "backward_overlap",
            "gc_pause_probability",
        )
        for name in shares:
            check_number(f"compute.{name}", getattr(self, name), 0.0, 1.0)
        check_number("compute.slow_factor", self.slow_factor, 1.0)

    def gc_pauses_ms(self, rng: np.random.Generator, k: int, ranks: int) -> np.ndarray:
        """``[k, ranks]`` garbage-collector pauses of ``k`` steps, ms.

        One draw per rank per step either way (common random numbers: a run with and one without
        ``gc_sync`` see the same stream). Without ``gc_sync`` a rank pauses where its own draw hits;
        with it every rank pauses where rank 0's draw hits: the job collects as often as one rank
        would, and all ranks together.
        """
        if self.gc_pause_probability <= 0:
            return np.zeros((k, ranks))
        hit = rng.random((k, ranks)) < self.gc_pause_probability
        if self.gc_sync:
            hit = np.repeat(hit[:, :1], ranks, axis=1)
        return hit * self.gc_pause_ms


@dataclass(frozen=True, kw_only=True)
class NetworkModel:
    """A two-level fabric: GPUs in a node (NVLink), nodes under leaf switches, leaves under a spine."""

    gradient_mb: float = field(default=100.0, metadata=doc("Gradient bytes all-reduced per step, MB."))
    intra_node_gbps: float = field(default=2400.0, metadata=doc("Per-GPU intra-node bandwidth, Gbit/s."))
    node_gbps: float = field(
        default=400.0, metadata=doc("Network bandwidth of one node (all its NICs), Gbit/s.")
    )
    latency_us: float = field(
        default=10.0, metadata=doc("Per-hop latency of the inter-node ring, microseconds.")
    )
    nodes_per_leaf: int = field(default=16, metadata=doc("Nodes under one leaf switch."))
    oversubscription: float = field(
        default=1.0,
        metadata=doc(
            "Leaf uplink capacity is nodes_per_leaf x node_gbps / oversubscription (1 = full bisection)."
        ),
    )
    ring_order: Literal["topology", "interleaved"] = field(
        default="topology",
        metadata=doc(
            """``topology``: the ring visits the nodes leaf by leaf (each leaf uplink carries one flow each
            way); ``interleaved``: consecutive ring neighbours sit under different leaves (every flow
            crosses the spine and shares the uplinks)."""
        ),
    )
    background_load: float = field(
        default=0.0, metadata=doc("Mean fraction of each leaf uplink used by other traffic.")
    )
    background_cv: float = field(
        default=0.0, metadata=doc("Per-step coefficient of variation of that background load.")
    )
    spin_contention: float = field(
        default=0.0,
        metadata=doc(
            """Fraction by which each node-mate that already arrived and busy-polls slows a rank's remaining
            compute (shared CPU/PCIe). A pacing delay is a sleep, not a busy-poll, so this is the one
            mechanism through which pacing can shorten steps in the model. 0 turns it off."""
        ),
    )

    def __post_init__(self) -> None:
        for name in (
            "gradient_mb",
            "intra_node_gbps",
            "node_gbps",
            "latency_us",
            "background_cv",
            "spin_contention",
        ):
            check_number(f"network.{name}", getattr(self, name), 0.0)
        for name in ("intra_node_gbps", "node_gbps"):
            check_number(f"network.{name}", getattr(self, name), 0.0, low_open=True)
        _check(self.nodes_per_leaf >= 1, "network.nodes_per_leaf", self.nodes_per_leaf, "an integer >= 1")
        check_number("network.oversubscription", self.oversubscription, 1.0)
        check_number("network.background_load", self.background_load, 0.0, 1.0, high_open=True)
        _check(
            self.ring_order in ("topology", "interleaved"),
            "network.ring_order",
            self.ring_order,
            "'topology' or 'interleaved'",
        )


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """A simulated job and the node counts to sweep."""

    name: str = field(default="simulation", metadata=doc("Label printed with the table."))
    nodes: tuple[int, ...] = field(
        default=(4, 8, 16, 32, 64, 128, 256, 512, 1024), metadata=doc("Node counts to sweep.")
    )
    gpus_per_node: int = field(default=8, metadata=doc("Ranks per node."))
    steps: int = field(default=1000, metadata=doc("Simulated steps per run."))
    warmup_steps: int = field(default=5, metadata=doc("Steps excluded from the statistics."))
    seed: int = field(default=0, metadata=doc("Seed of every random draw (runs are reproducible)."))
    compute: ComputeModel = field(default_factory=ComputeModel)
    network: NetworkModel = field(default_factory=NetworkModel)
    pacing: PacingConfig = field(default_factory=PacingConfig, metadata=doc("The real controller's config."))

    def __post_init__(self) -> None:
        _check(
            len(self.nodes) > 0 and all(n >= 1 for n in self.nodes), "nodes", self.nodes, "node counts >= 1"
        )
        _check(self.gpus_per_node >= 1, "gpus_per_node", self.gpus_per_node, "an integer >= 1")
        _check(self.steps > self.warmup_steps + 1, "steps", self.steps, "more than warmup_steps + 1")
