"""Where each rank runs: host, node rank, local rank, device, CPU/NUMA affinity and CPU threads."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pace_strategy.core.evidence import process_start

if TYPE_CHECKING:  # only a rank that is training places itself; readers of the record need no torch
    import torch

__all__ = [
    "MESH_DIMS",
    "MESH_KEYS",
    "LoaderWorkers",
    "RankPlacement",
    "cpu_ranges",
    "elastic_restart_count",
    "group_numbers",
    "local_placement",
    "mesh_caveats",
    "mesh_coordinates",
    "parse_cpu_ranges",
]

#: the mesh dimensions a rank's coordinates are recorded by: data parallel replicated (HSDP's
#: replicas) and sharded, tensor, pipeline and context parallel (torchtitan's and Accelerate's names)
MESH_DIMS = ("dp_replicate", "dp_shard", "tp", "pp", "cp")
#: every mesh coordinate a record's topology may give a rank: the dimensions above, and ``dp`` (an
#: imported table's plain data-parallel index); absent dimensions are omitted
MESH_KEYS = ("dp_replicate", "dp_shard", "dp", "tp", "pp", "cp")
#: other frameworks' names of those dimensions (Lightning's ModelParallelStrategy, spelled out)
MESH_ALIASES = {
    "data_parallel": "dp_shard",
    "dp": "dp_shard",
    "tensor_parallel": "tp",
    "pipeline_parallel": "pp",
    "context_parallel": "cp",
}


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
    #: CUDA: the GPU's UUID (the same physical GPU whatever ``CUDA_VISIBLE_DEVICES`` calls it)
    gpu_uuid: str | None = None
    pci_bus_id: str | None = None  #: CUDA: ``domain:bus:device.0`` of the GPU
    #: CUDA: whether the rank's CPU affinity lies within the GPU's NUMA node (``None``: unknown); a rank
    #: pinned to the far socket pays every host-device copy across the interconnect
    affinity_on_gpu_numa: bool | None = None
    pid: int | None = None  #: the rank's process id on its host
    #: Linux: the process's start time (clock ticks since boot, ``/proc/PID/stat`` field 22): with
    #: ``pid``, an identity no later process on the host has (a pid may be reused, this pair is not)
    pid_start: int | None = None
    #: the rank's coordinate along each dimension of its device mesh (``None``: no such dimension, or
    #: not told): ``pace diagnose`` names a slow pipeline stage, one coordinate slow in every replica,
    #: and a slow tensor-parallel group by them
    dp_replicate: int | None = None
    dp_shard: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def mesh_coordinates(mesh: Any = None, pipeline_stage: int | None = None) -> dict[str, int]:
    """This rank's coordinates by mesh dimension (:data:`MESH_DIMS`), from a ``DeviceMesh`` with named
    dimensions (other frameworks' names, :data:`MESH_ALIASES`, are read as ours) and the pipeline
    stage of a loop whose schedule pace_strategy does not see. Raises ``ValueError`` naming what is
    wrong: a mesh without names, a name that is none of these, a rank outside the mesh, a negative
    stage, a stage the mesh gives too."""
    out: dict[str, int] = {}
    if mesh is not None:
        names = getattr(mesh, "mesh_dim_names", None)
        if not names:
            raise ValueError(
                "mesh=: the DeviceMesh has no dimension names; build it with mesh_dim_names=(...) from "
                f"{', '.join(MESH_DIMS)}"
            )
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError("mesh=: this rank is not in the DeviceMesh given; pass the mesh it trains on")
        for name, value in zip(names, coordinate, strict=True):
            dim = MESH_ALIASES.get(name, name)
            if dim not in MESH_DIMS:
                accepted = ", ".join((*MESH_DIMS, *MESH_ALIASES))
                raise ValueError(f"mesh=: dimension {name!r} is none of {accepted}; rename it")
            out[dim] = int(value)
    if pipeline_stage is not None:
        if isinstance(pipeline_stage, bool) or not isinstance(pipeline_stage, int) or pipeline_stage < 0:
            raise ValueError(
                f"pipeline_stage={pipeline_stage!r}: expected this rank's stage, an integer >= 0"
            )
        if "pp" in out and out["pp"] != pipeline_stage:
            raise ValueError(
                f"pipeline_stage={pipeline_stage} but the mesh's pp coordinate is {out['pp']}: give one"
            )
        out["pp"] = pipeline_stage
    return out


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


SYSFS = Path("/sys")


def _cuda_identity(device: torch.device) -> tuple[str | None, str | None, int | None]:
    """The GPU's UUID, PCI bus id and NUMA node (each ``None`` where not known)."""
    import torch

    try:
        props = torch.cuda.get_device_properties(device)
    except (RuntimeError, AssertionError):
        return None, None, None
    uuid = getattr(props, "uuid", None)
    ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(i is None for i in ids):
        return (str(uuid) if uuid is not None else None), None, None
    domain, bus, dev = (int(i) for i in ids)  # type: ignore[arg-type]
    pci = f"{domain:04x}:{bus:02x}:{dev:02x}.0"
    return (str(uuid) if uuid is not None else None), pci, pci_numa_node(pci)


def pci_numa_node(pci: str, sysfs: Path = SYSFS) -> int | None:
    """The NUMA node of PCI device ``pci`` from sysfs (``None``: unknown or none)."""
    try:
        node = int((sysfs / "bus/pci/devices" / pci / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def affinity_within_numa(cpus: set[int], node: int, sysfs: Path = SYSFS) -> bool | None:
    """Whether every CPU of ``cpus`` belongs to NUMA node ``node`` (``None``: unknown)."""
    try:
        node_cpus = parse_cpu_ranges((sysfs / f"devices/system/node/node{node}/cpulist").read_text().strip())
    except (OSError, ValueError):
        return None
    return bool(cpus) and cpus <= node_cpus


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
    coordinates: Mapping[str, int] | None = None,
) -> RankPlacement:
    """This rank's placement; node and local rank default to the launcher's environment variables
    (torchrun's ``NODE_RANK``/``GROUP_RANK`` and ``LOCAL_RANK``, else SLURM's ``SLURM_NODEID`` and
    ``SLURM_LOCALID`` for a job started by ``srun`` without torchrun);
    ``coordinates``: its mesh coordinates (:func:`mesh_coordinates`).

    Call it after the process has set its thread count (``torch.set_num_threads``): the intra-op
    threads are read now.
    """
    import torch

    try:
        cpus = os.sched_getaffinity(0)
        affinity: str | None = cpu_ranges(cpus)
        usable: int | None = len(cpus)
    except (AttributeError, OSError):
        cpus, affinity, usable = set(), None, None
    uuid = pci = numa = near = None
    if device.type == "cuda":
        uuid, pci, numa = _cuda_identity(device)
        near = affinity_within_numa(cpus, numa) if numa is not None and cpus else None
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    return RankPlacement(
        rank=rank,
        host=os.environ.get("PACE_HOSTNAME") or socket.gethostname(),
        node_rank=node_rank if node_rank is not None else _env_int("NODE_RANK", "GROUP_RANK", "SLURM_NODEID"),
        local_rank=local_rank if local_rank is not None else _env_int("LOCAL_RANK", "SLURM_LOCALID"),
        device=str(device),
        numa_node=numa,
        cpu_affinity=affinity,
        usable_cores=usable,
        host_cores=os.cpu_count(),
        intra_op_threads=torch.get_num_threads(),
        omp_num_threads=int(omp) if omp.isdigit() else None,
        dataloader_workers=dataloader_workers,
        gpu_uuid=uuid,
        pci_bus_id=pci,
        affinity_on_gpu_numa=near,
        pid=os.getpid(),
        pid_start=process_start(os.getpid()),
        **dict(coordinates or {}),
    )


#: a rank's data-parallel coordinates: the ranks of one tensor-parallel group share all of them
DATA_PARALLEL_KEYS = ("dp_replicate", "dp_shard", "pp", "cp")


def group_numbers(keys: Sequence[Any]) -> tuple[int, ...]:
    """Each key's group number, dense from 0 in order of first appearance (ranks by their key)."""
    numbers: dict[Any, int] = {}
    return tuple(numbers.setdefault(key, len(numbers)) for key in keys)


def tensor_parallel_groups(topology: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]] | None:
    """Each rank's tensor-parallel group (by rank order) as its data-parallel coordinates (the keys
    of :data:`DATA_PARALLEL_KEYS` the record gives), or ``None`` on a mesh without two tensor-parallel
    coordinates. A group arrives at the data-parallel sync point with its last member."""
    places = sorted(topology, key=lambda p: int(p.get("rank", 0)))
    if len({p.get("tp") for p in places if isinstance(p.get("tp"), int)}) < 2:
        return None
    return [{k: p[k] for k in DATA_PARALLEL_KEYS if isinstance(p.get(k), int)} for p in places]


def _size(topology: Sequence[Mapping[str, Any]], key: str) -> int:
    """How many coordinates along ``key`` the ranks have (0: not recorded)."""
    return len({p.get(key) for p in topology if isinstance(p.get(key), int)})


def mesh_caveats(topology: Sequence[Mapping[str, Any]]) -> list[str]:
    """What a record of a mesh cannot say, per parallelism that runs collectives of its own inside a
    step (tensor, context) or between its ranks (pipeline): said once at start and by ``pace
    diagnose``, so that no finding on such a layout is read as more than it is."""
    out = []
    tp, cp, pp = _size(topology, "tp"), _size(topology, "cp"), _size(topology, "pp")
    if tp > 1:
        out.append(
            f"a tensor-parallel mesh ({tp} ranks per tensor-parallel group): the tensor-parallel "
            "collectives inside forward and backward are not timed apart, so a rank's wait in them counts "
            "as its compute and a slow member's lateness spreads to its group's other ranks and through "
            "them to the data-parallel peers; which rank is slow is not reliable on this mesh (the step's "
            "total waiting, pacing and each rank's mesh coordinates are; docs/pytorch.md)"
        )
    if cp > 1:
        out.append(
            f"a context-parallel mesh ({cp} ranks per context-parallel group): the context-parallel "
            "collectives of attention (its ring or all-to-all exchanges of keys and values) are not timed "
            "apart, so a rank's wait in them counts as its compute and a slow member's lateness spreads to "
            "its group; which rank is slow is not reliable on this mesh (the step's total waiting, pacing "
            "and each rank's coordinates are; docs/pytorch.md)"
        )
    if pp > 1:
        out.append(
            f"a pipeline of {pp} stages: the schedule's sends and receives between stages are not timed, so "
            "a stage's wait for its neighbours counts as its compute and a slow stage's lateness spreads "
            "to the others; which stage is slow is not reliable from a live record (an op table with the "
            "receives is: pace import ops, docs/import.md); the data-parallel sync point and pacing are "
            "unaffected (docs/pytorch.md)"
        )
    return out


class LoaderWorkers:
    """The worker processes of this rank's training DataLoaders, noted locally and shared once.

    Adapters learn of their loaders after the session starts; the largest count noted before the
    first step ends goes into every rank's placement (the run record's header), where ``pace
    diagnose`` counts busy threads per host."""

    def __init__(self) -> None:
        self.count: int | None = None  #: the largest count noted (``None``: no DataLoader noted)
        self.shared = False

    def note(self, workers: int | None) -> None:
        """Local: a training DataLoader of this rank runs ``workers`` worker processes."""
        if workers is not None and not self.shared:
            self.count = max(self.count or 0, workers)

    def share(
        self, gather: Callable[[torch.Tensor], torch.Tensor], topology: Sequence[dict[str, Any]]
    ) -> None:
        """Collective: every rank's count into ``topology``'s placements. ``gather`` takes this rank's
        ``(1, 1)`` float64 tensor and returns the ``(world, 1, 1)`` of every rank (the exchange's own
        path: no collective of its own)."""
        import torch

        self.shared = True
        local = torch.tensor([[float(-1 if self.count is None else self.count)]], dtype=torch.float64)
        counts = gather(local)[:, 0, 0].tolist()
        for placement, workers in zip(topology, counts, strict=True):
            placement["dataloader_workers"] = None if workers < 0 else int(workers)
