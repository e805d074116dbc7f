"""Where each rank runs: host, node rank, local rank, device, CPU/NUMA affinity and CPU threads."""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only a rank that is training places itself; readers of the record need no torch
    import torch

__all__ = ["RankPlacement", "cpu_ranges", "elastic_restart_count", "local_placement", "parse_cpu_ranges"]


@dataclass(frozen=True)
class RankPlacement:
    """One rank's place in the cluster (``-1`` / ``None`` where unknown).

    The CPU fields say how many threads a rank may keep busy on how many cores: more busy threads on
    a host than it has cores slows every step (``pace diagnose`` names it ``host_oversubscription``).
    Records written before they existed lack them; readers treat a missing field as unknown.
    """

    rank: int
    host: str
    node_rank: int
    local_rank: int
    device: str
    numa_node: int | None
    cpu_affinity: str | None
    usable_cores: int | None = None  #: cores this process may run on (its affinity mask)
    host_cores: int | None = None  #: logical cores of the host (``os.cpu_count()``)
    intra_op_threads: int | None = None  #: ``torch.get_num_threads()`` when the rank placed itself
    omp_num_threads: int | None = None  #: ``OMP_NUM_THREADS`` as set (``None``: unset or not a number)
    dataloader_workers: int | None = None  #: training DataLoader workers, where the adapter knows them

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _env_int(*names: str) -> int:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.lstrip("-").isdigit():
            return int(value)
    return -1


def elastic_restart_count() -> int:
    """How many times torchrun (torch.distributed.run) has restarted this job's workers: 0 on the first
    attempt and outside torchrun (``TORCHELASTIC_RESTART_COUNT``; the same on every rank)."""
    return max(_env_int("TORCHELASTIC_RESTART_COUNT"), 0)


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


def parse_cpu_ranges(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> ``{0, 1, 2, 3, 8, 10, 11}``: the inverse of :func:`cpu_ranges`."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if lo:
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def cpu_ranges(cpus: set[int]) -> str:
    """``{0, 1, 2, 3, 8}`` -> ``"0-3,8"`` (the ``cpu_affinity`` format of the record)."""
    ordered, out, start = sorted(cpus), [], None
    for i, cpu in enumerate(ordered):
        if start is None:
            start = cpu
        if i + 1 == len(ordered) or ordered[i + 1] != cpu + 1:
            out.append(f"{start}" if start == cpu else f"{start}-{cpu}")
            start = None
    return ",".join(out)


def local_placement(
    rank: int,
    device: torch.device,
    node_rank: int | None = None,
    local_rank: int | None = None,
    dataloader_workers: int | None = None,
) -> RankPlacement:
    """This rank's placement; node and local rank default to the launcher's environment variables.

    Call it after the process has set its thread count (``torch.set_num_threads``): the intra-op
    threads are read now.
    """
    import torch

    try:
        cpus = os.sched_getaffinity(0)
        affinity: str | None = cpu_ranges(cpus)
        usable: int | None = len(cpus)
    except (AttributeError, OSError):
        affinity, usable = None, None
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    return RankPlacement(
        rank=rank,
        host=os.environ.get("PACE_HOSTNAME") or socket.gethostname(),
        node_rank=node_rank if node_rank is not None else _env_int("NODE_RANK", "GROUP_RANK"),
        local_rank=local_rank if local_rank is not None else _env_int("LOCAL_RANK"),
        device=str(device),
        numa_node=_cuda_numa_node(device) if device.type == "cuda" else None,
        cpu_affinity=affinity,
        usable_cores=usable,
        host_cores=os.cpu_count(),
        intra_op_threads=torch.get_num_threads(),
        omp_num_threads=int(omp) if omp.isdigit() else None,
        dataloader_workers=dataloader_workers,
    )
