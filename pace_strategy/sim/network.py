"""Collective cost model: hierarchical ring all-reduce over a leaf/spine fabric (closed forms)."""

from __future__ import annotations

import numpy as np

from pace_strategy.sim.model import NetworkModel

__all__ = ["inter_node_bandwidth_gbps", "ring_allreduce_ms", "step_collective_ms"]


def ring_allreduce_ms(size_mb: float, ranks: int, bandwidth_gbps: float, latency_us: float) -> float:
    """Ring all-reduce of ``size_mb`` over ``ranks`` members on links of ``bandwidth_gbps``.

    Reduce-scatter then all-gather: each member sends ``2 (n-1)/n`` of the buffer in ``2 (n-1)`` steps:
    ``T = 2 (n-1)/n * S / B + 2 (n-1) * alpha``.
    """
    if ranks <= 1:
        return 0.0
    bits = size_mb * 8e6
    return (
        2 * (ranks - 1) / ranks * bits / (bandwidth_gbps * 1e9) + 2 * (ranks - 1) * latency_us * 1e-6
    ) * 1e3


def inter_node_bandwidth_gbps(
    net: NetworkModel, nodes: int, background: np.ndarray | float = 0.0
) -> np.ndarray:
    """Bandwidth each node gets in the inter-node ring, per step (the slowest link sets the ring).

    Within one leaf, a node's links run at ``node_gbps``. Across leaves, a leaf's uplink has
    ``nodes_per_leaf * node_gbps / oversubscription`` of capacity, minus the background load, shared by
    the ring flows that cross it: one each way for a topology-ordered ring, one per node of the leaf
    for an interleaved one.
    """
    bg = np.asarray(background, dtype=np.float64)
    if nodes <= net.nodes_per_leaf:
        return np.full(bg.shape, net.node_gbps)
    per_leaf = min(net.nodes_per_leaf, nodes)
    uplink = per_leaf * net.node_gbps / net.oversubscription * (1.0 - bg)
    flows = 1 if net.ring_order == "topology" else per_leaf
    return np.minimum(net.node_gbps, uplink / flows)


def step_collective_ms(
    net: NetworkModel, nodes: int, gpus_per_node: int, background: np.ndarray
) -> np.ndarray:
    """Gradient all-reduce time per step: intra-node reduce-scatter/all-gather, then the node ring.

    Hierarchical all-reduce: a ring over the node's GPUs on ``intra_node_gbps`` costs
    ``ring_allreduce_ms(S, G, B_intra)``; the inter-node ring moves each node's reduced share and is
    modelled as ``ring_allreduce_ms(S, N, B_node)`` with the per-step node bandwidth.
    """
    intra = ring_allreduce_ms(net.gradient_mb, gpus_per_node, net.intra_node_gbps, 0.0)
    bw = inter_node_bandwidth_gbps(net, nodes, background)
    if nodes <= 1:
        return np.full(bw.shape, intra)
    bits = net.gradient_mb * 8e6
    inter = (2 * (nodes - 1) / nodes * bits / (bw * 1e9) + 2 * (nodes - 1) * net.latency_us * 1e-6) * 1e3
    return intra + inter
