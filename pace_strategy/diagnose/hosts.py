"""CPU threads against cores per host, from the topology in a run record's header.

A rank keeps busy its intra-op threads (``torch.get_num_threads()``, which ``OMP_NUM_THREADS``
sets) and its DataLoader workers; a host whose ranks keep more threads busy than they have cores
time-slices them, and every step pays for it. Usable cores are the union of the ranks' affinity
masks (what they may run on), or the host's core count where no mask was recorded. Records written
before the thread fields existed count one thread per rank (the training thread): a lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pace_strategy.telemetry.topology import cpu_ranges, parse_cpu_ranges

__all__ = ["HostLoad", "host_loads"]


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


@dataclass(frozen=True)
class HostLoad:
    """One host's ranks, the threads they keep busy and the cores they may use."""

    host: str
    ranks: list[int]
    cores: int  #: usable cores of the host's ranks together
    cores_from: str  #: "affinity" (union of the masks) or "host" (the host's core count)
    affinity: str | None  #: the union of the masks, as ranges, where recorded
    same_mask: bool  #: every rank recorded the same mask (they all compete for the same cores)
    host_cores: int | None  #: the host's logical cores, where recorded
    threads: list[int]  #: per rank: intra-op threads (1 where not recorded)
    threads_known: bool  #: every rank recorded its intra-op threads
    omp_num_threads: list[int | None]  #: per rank, as set in its environment
    workers: list[int]  #: per rank: DataLoader workers (0 where not recorded)
    workers_known: bool
    #: ranks that train on an accelerator (a ``cuda``/``xpu``/``mps`` device): counted as one busy
    #: thread each (the one that launches its kernels), their intra-op threads idle meanwhile
    accelerator_ranks: int = 0

    @property
    def busy_threads(self) -> int:
        return sum(self.threads) + sum(self.workers)

    @property
    def ratio(self) -> float:
        """Busy threads per usable core."""
        return self.busy_threads / self.cores

    def threads_per_rank_fix(self) -> int:
        """The most intra-op threads per rank that fit the cores beside the workers (at least 1)."""
        spare = self.cores - sum(self.workers)
        return max(1, spare // max(len(self.ranks), 1))

    def load_text(self) -> str:
        """``3 ranks x 1 intra-op thread each (OMP_NUM_THREADS=1) + 2 DataLoader workers``."""
        n = len(self.ranks)
        if self.accelerator_ranks == n:
            threads = "1 busy thread each (on accelerators: intra-op threads idle while the device computes)"
        elif not self.threads_known:
            threads = "1 thread each (intra-op threads not recorded: counted as 1, a lower bound)"
        elif len(set(self.threads)) == 1:
            threads = f"{self.threads[0]} intra-op thread{'s' if self.threads[0] > 1 else ''} each"
        else:
            threads = "intra-op threads " + ", ".join(map(str, self.threads))
        omp = sorted({o for o in self.omp_num_threads if o is not None})
        if omp:
            threads += f" (OMP_NUM_THREADS={','.join(map(str, omp))})"
        elif self.threads_known:
            threads += " (OMP_NUM_THREADS unset)"
        workers = sum(self.workers)
        text = f"{n} rank{'s' if n > 1 else ''} x {threads}"
        if workers:
            text += f" + {workers} DataLoader worker{'s' if workers > 1 else ''}"
        return text

    def cores_text(self) -> str:
        """``2 usable cores of the host's 2 (CPU affinity 0-1)``."""
        if self.cores_from == "affinity":
            of = f" of the host's {self.host_cores}" if self.host_cores else ""
            return f"{self.cores} usable cores{of} (CPU affinity {self.affinity})"
        return f"the host's {self.cores} cores (no CPU affinity recorded)"

    def fix_text(self) -> str:
        """What to change: threads per rank, ranks per host, affinity."""
        n, workers = len(self.ranks), sum(self.workers)
        k = self.threads_per_rank_fix()
        fixes = []
        if n + workers <= self.cores:
            fixes.append(
                f"threads per rank: torch.set_num_threads({k}) / OMP_NUM_THREADS={k} in every rank "
                f"({n} x {k}{f' + {workers} workers' if workers else ''} <= {self.cores} cores)"
            )
        else:
            per_host = (
                max(1, (self.cores - workers) // max(1, min(self.threads))) if self.cores > workers else 1
            )
            fixes.append(
                f"ranks per host: at most {per_host} with one thread each on {self.cores} cores"
                + (f", or fewer DataLoader workers (now {workers})" if workers else "")
            )
        fixes.append(
            "affinity: give each rank its own cores (taskset/numactl, or the launcher's CPU binding)"
            + (f"; now every rank may run on the same cores ({self.affinity})" if self.same_mask else "")
        )
        return (
            "more busy threads than cores on this host: every step waits for the time-slicing. Fix it by "
            + "; or ".join(fixes)
            + ". Pacing cannot help"
        )


#: device types whose compute does not run on the rank's CPU threads
_ACCELERATORS = ("cuda", "xpu", "mps", "hpu", "npu")


def host_loads(topology: list[dict[str, Any]]) -> list[HostLoad]:
    """Per host (in order of first rank), its load; hosts whose cores are unknown are left out."""
    by_host: dict[str, list[dict[str, Any]]] = {}
    for t in sorted(topology, key=lambda t: int(t["rank"])):
        by_host.setdefault(str(t.get("host") or "?"), []).append(t)
    out = []
    for host, places in by_host.items():
        masks = [p.get("cpu_affinity") for p in places]
        host_cores = max((c for c in (_int_or_none(p.get("host_cores")) for p in places) if c), default=None)
        affinity = None
        if all(isinstance(m, str) and m for m in masks):
            union: set[int] = set()
            for m in masks:
                union |= parse_cpu_ranges(str(m))
            cores, cores_from = len(union), "affinity"
            affinity = cpu_ranges(union)
        elif host_cores:
            cores, cores_from = host_cores, "host"
        else:
            continue
        if cores <= 0:
            continue
        # A rank on an accelerator keeps one thread busy launching kernels; its intra-op threads
        # (torch's CPU pool, often as many as the cores) idle while the device computes.
        accelerator = [str(p.get("device") or "").split(":")[0] in _ACCELERATORS for p in places]
        recorded = [_int_or_none(p.get("intra_op_threads")) for p in places]
        threads = [1 if acc else t for acc, t in zip(accelerator, recorded, strict=True)]
        workers = [_int_or_none(p.get("dataloader_workers")) for p in places]
        out.append(
            HostLoad(
                host=host,
                ranks=[int(p["rank"]) for p in places],
                cores=cores,
                cores_from=cores_from,
                affinity=affinity,
                same_mask=affinity is not None and len(set(masks)) == 1 and len(places) > 1,
                host_cores=host_cores,
                threads=[t if t else 1 for t in threads],
                threads_known=all(t is not None for t in threads),
                omp_num_threads=[_int_or_none(p.get("omp_num_threads")) for p in places],
                workers=[w or 0 for w in workers],
                workers_known=all(w is not None for w in workers),
                accelerator_ranks=sum(accelerator),
            )
        )
    return out
