"""Where each rank runs: host, node rank, local rank, device and CPU/NUMA affinity where known."""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only a rank that is training places itself; readers of the record need no torch
    import torch

__all__ = ["RankPlacement", "local_placement"]


@dataclass(frozen=True)
class RankPlacement:
    """One rank's place in the cluster (``-1`` / ``None`` where unknown)."""

    rank: int
    host: str
    node_rank: int
    local_rank: int
    device: str
    numa_node: int | None
    cpu_affinity: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _env_int(*names: str) -> int:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.lstrip("-").isdigit():
            return int(value)
    return -1


def _cuda_numa_node(device: torch.device) -> int | None:
    import torch

    try:
        props = torch.cuda.get_device_properties(device)
        ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
        if any(i is None for i in ids):
            return None
        domain, bus, dev = (int(i) for i in ids)  # type: ignore[arg-type]
        text = Path(f"/sys/bus/pci/devices/{domain:04x}:{bus:02x}:{dev:02x}.0/numa_node").read_text().strip()
        return int(text) if int(text) >= 0 else None
    except (OSError, RuntimeError, ValueError):
        return None


def _cpu_ranges(cpus: set[int]) -> str:
    ordered, out, start = sorted(cpus), [], None
    for i, cpu in enumerate(ordered):
        if start is None:
            start = cpu
        if i + 1 == len(ordered) or ordered[i + 1] != cpu + 1:
            out.append(f"{start}" if start == cpu else f"{start}-{cpu}")
            start = None
    return ",".join(out)


def local_placement(
    rank: int, device: torch.device, node_rank: int | None = None, local_rank: int | None = None
) -> RankPlacement:
    """This rank's placement; node and local rank default to the launcher's environment variables."""
    try:
        affinity: str | None = _cpu_ranges(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return RankPlacement(
        rank=rank,
        host=os.environ.get("PACE_HOSTNAME") or socket.gethostname(),
        node_rank=node_rank if node_rank is not None else _env_int("NODE_RANK", "GROUP_RANK"),
        local_rank=local_rank if local_rank is not None else _env_int("LOCAL_RANK"),
        device=str(device),
        numa_node=_cuda_numa_node(device) if device.type == "cuda" else None,
        cpu_affinity=affinity,
    )
