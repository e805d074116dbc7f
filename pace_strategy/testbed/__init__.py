"""An emulated multi-rack cluster on one Linux machine (root): network namespaces, bridges, shaped
uplinks, slow paths, CPU quotas and a seeded user-space delay element (``pace testbed up|down|status``).

Tooling for experiments and tests, beside the library: nothing in ``pace_strategy`` imports it.
"""

from __future__ import annotations

from pace_strategy.testbed.cluster import (
    Fabric,
    FabricSpec,
    Node,
    check_environment,
    down,
    run_on_nodes,
    running,
    status,
    up,
)
from pace_strategy.testbed.errors import TestbedError, TestbedSpecError
from pace_strategy.testbed.link import Impairment, LinkSchedule

__all__ = [
    "Fabric",
    "FabricSpec",
    "Impairment",
    "LinkSchedule",
    "Node",
    "TestbedError",
    "TestbedSpecError",
    "check_environment",
    "down",
    "run_on_nodes",
    "running",
    "status",
    "up",
]
