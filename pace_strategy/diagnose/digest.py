"""A run's per-rank numbers reduced, a block of steps at a time, to what the diagnosis reads.

Every check compares the step's late rank (its *straggler*: the rank with the smallest wait) with
the other ranks, or reads the run's per-step reductions over the ranks; none needs the whole
``[steps, ranks]`` arrays at once. So one pass over the record's blocks (:meth:`RunLines.rank_blocks`,
``[block steps, ranks]`` each) keeps, per step, the straggler's own value of each field and the
median of the others', and, per run, what a few statistics need:

- per step (``[S]``): the transfer time (smallest wait), the straggler, the skew, the median wait,
  the mean lead (what the step lost waiting); for the compute, input, own work between steps
  (optimizer step and input) and the framework's loop between steps: the straggler's value and the
  other ranks' median; the other ranks' median wait, also without the straggler's whole local-index
  group (the locality check); its GC time and host-bound flag;
- per rank (``[W]``): the mean and standard deviation of its compute over the run, and how often
  and by how much it arrived later than the step's median arrival (the slow-group check);
- each rank's (a node's, above ``max_heatmap_rows`` ranks) lateness binned over steps as the heat map
  bins them (the straggler-episode check);
- the steps a statistic samples, whole rows: the jitter floor's (up to 20,000 steps; reduced to the
  floor in place when the pass ends), the growth curve's (up to 5,000), the projection's calibration
  (``projection_calibration_steps``), which the per-sample speed reads too; for a run shorter than a
  sample, every step;
- for the report: the lead heat map, binned over steps as the plot bins it.

So the memory is a block, the ``[S]`` vectors and the sampled rows (at 100k steps x 8,192 ranks:
3.3 GB, against 6.5 GB for one whole float64 field; the diagnosis peaked 3.6 GB above its start,
``benchmarks/diagnose_scale.py``), and the same code serves a run held in
memory (:class:`RunArrays`) and one read from disk. Each number is the one the checks computed
from the whole arrays (the same numpy reductions of the same rows), but the per-rank compute
spread, which is merged over the blocks (Chan et al.'s pairwise update): equal to numpy's
two-pass ``std`` to about 1e-15 relative, exactly equal for a run of one block.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pace_strategy.diagnose.config import DiagnosisConfig
from pace_strategy.diagnose.noise import JitterFloor, jitter_floor
from pace_strategy.telemetry.arrays import RunArrays, RunLines, sample_steps

__all__ = [
    "FLOOR_SAMPLE_STEPS",
    "GROWTH_SAMPLE_STEPS",
    "GROWTH_SEED",
    "GcDigest",
    "RunDigest",
    "digest_run",
    "growth_rows",
    "noise_ms",
]

#: steps the jitter floor's robust sigma is computed on (a seeded sample; plenty for a median)
FLOOR_SAMPLE_STEPS = 20_000
FLOOR_SEED = 0
#: the amplification curve: steps sampled (a sample is plenty for a mean; the seed keeps the report
#: reproducible)
GROWTH_SAMPLE_STEPS = 5000
GROWTH_SEED = 0


def noise_ms(cfg: DiagnosisConfig, median_step_ms: float) -> float:
    """Lateness below this is noise: the larger of the floor and a fraction of the median step."""
    return max(cfg.slow_ms_floor, cfg.slow_step_fraction * median_step_ms)


def floor_rows(steps: int) -> np.ndarray:
    """The steps (ascending) the jitter floor reads: a seeded sample of a long run, else all."""
    return sample_steps(steps, FLOOR_SAMPLE_STEPS, FLOOR_SEED)


def growth_rows(rng: np.random.Generator, steps: int) -> np.ndarray:
    """The steps the growth curve reads, in the order drawn (the curve's draws go on from ``rng``)."""
    return rng.choice(steps, size=min(steps, GROWTH_SAMPLE_STEPS), replace=False)


@dataclass
class GcDigest:
    """What the GC check reads (a record with per-rank ``gc_ms``)."""

    own: np.ndarray  #: [S] the straggler's time in the collector, ms (not recorded: 0)
    #: [S] the other ranks' median time in it, ms, where the skew is at least the noise threshold
    #: (the steps the check reads; NaN elsewhere)
    others: np.ndarray
    pauses: np.ndarray  #: every rank's GC time of at least the noise threshold, any order, ms
    longest: float  #: the longest GC time of any rank, ms
    collections: float | None  #: collections over the run, every rank (None: not recorded)


@dataclass
class RunDigest:
    """What the diagnosis reads of a run's per-rank numbers (module docstring)."""

    steps: int
    world: int
    transfer: np.ndarray  #: [S] the smallest wait, ms
    straggler: np.ndarray  #: [S] the rank with the smallest wait (the first of a tie)
    skew: np.ndarray  #: [S] largest minus smallest wait, ms
    median_wait: np.ndarray  #: [S] ms
    lost: np.ndarray  #: [S] the ranks' mean lead: what the step lost waiting, ms
    #: [S] by field (``compute``, ``data``, ``between``, ``loop``): the straggler's value, ms
    own: dict[str, np.ndarray]
    #: [S] by field (those and ``wait``): the median of the other ranks' values, ms
    others: dict[str, np.ndarray]
    #: [S] the median wait of the ranks whose local index is not the straggler's (None: local
    #: indices not recorded, or all the same)
    local_others_wait: np.ndarray | None
    host_bound: np.ndarray | None  #: [S] the straggler was host-bound (None: not recorded)
    gc: GcDigest | None  #: None: not recorded in every step
    compute_mean: np.ndarray  #: [W] each rank's mean compute over the run, ms
    compute_std: np.ndarray  #: [W] its standard deviation, ms
    #: [W] the steps in which each rank arrived later than the step's median arrival by at least the
    #: noise threshold (:func:`noise_ms`): a rank slower than the bulk is late in most steps, whichever
    #: rank of a slow group is the last one
    late_count: np.ndarray
    late_sum: np.ndarray  #: [W] each rank's lateness against the step's median arrival, summed, ms
    #: the ranks' lateness against each step's median arrival (ms; early ranks negative) per
    #: :attr:`heat` row and column (a node's mean above ``max_heatmap_rows`` ranks), in rank or node
    #: order (:attr:`late_labels`): where a straggler episode starts and ends
    late_bins: np.ndarray
    late_labels: list[list[int]]  #: each column's ranks
    late_edges: np.ndarray  #: the steps' indices where each row of :attr:`late_bins` starts, then ``S``
    floor: JitterFloor  #: the run's noise floor, from the waits of the steps of :func:`floor_rows`
    growth_wait: np.ndarray  #: the waits of the growth curve's steps, in the order drawn
    #: the projection's calibration steps, whole (``sample_steps(S, projection_calibration_steps)``)
    sample: RunArrays
    sample_rows: np.ndarray  #: their indices among the steps
    heat: np.ndarray  #: the lead heat map: [steps or step bins, ranks or nodes], ms
    heat_labels: list[str]  #: its rows' names (``r3``, or ``node 1``)
    heat_binned: bool  #: its steps are bins (means over equal runs of steps)


class _Rows:
    """Whole rows of some fields, for the steps ``rows`` (any order: kept in that order)."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        order = np.argsort(rows, kind="stable")
        self.sorted, self.place = rows[order], order
        self.values: dict[str, np.ndarray] = {}
        self.complete: dict[str, bool] = {}

    def add(self, lo: int, block: dict[str, np.ndarray], names: Sequence[str]) -> None:
        a, b = np.searchsorted(self.sorted, (lo, lo + len(block["wait"])))
        for name in names:
            if name not in block:
                self.complete[name] = False
                continue
            self.complete.setdefault(name, True)
            if name not in self.values:
                values = block[name]
                self.values[name] = np.empty((len(self.rows), values.shape[1]), dtype=values.dtype)
            if b > a:
                self.values[name][self.place[a:b]] = block[name][self.sorted[a:b] - lo]


class _Bins:
    """``[steps, columns]`` rows in order, as the report plots them: the rows themselves for at most
    ``max_columns`` steps, else their means over ``max_columns`` equal bins (the edges of the
    report's ``_bin_steps``). A bin's rows are summed in order, its partial sum carried from one
    block to the next as the first row of the next block's sum, so the means do not depend on where
    the blocks end."""

    def __init__(self, steps: int, max_columns: int) -> None:
        self.binned = steps > max_columns
        self.edges = np.linspace(0, steps, max_columns + 1).astype(int) if self.binned else None
        self.parts: list[np.ndarray] = []
        self.carry: np.ndarray | None = None  #: the partial sum of the bin the last block ended in
        self.at = 0

    def add(self, rows: np.ndarray) -> None:
        lo, hi = self.at, self.at + len(rows)
        self.at = hi
        if self.edges is None:
            self.parts.append(rows)
            return
        # the block's pieces: up to each bin edge inside it, then to its end
        cuts = [lo, *self.edges[(self.edges > lo) & (self.edges < hi)].tolist(), hi]
        for a, b in itertools.pairwise(cuts):
            piece = rows[a - lo : b - lo]
            if self.carry is not None:
                piece = np.concatenate([self.carry, piece])
            total = piece.sum(axis=0, keepdims=True)  # row after row, in order
            if b in self.edges:
                self.parts.append(total)
                self.carry = None
            else:
                self.carry = total

    def result(self, columns: int) -> np.ndarray:
        out = np.concatenate(self.parts) if self.parts else np.zeros((0, columns))
        if self.edges is not None:
            out = out / np.diff(self.edges)[:, None]
        return out


def _median_without(x: np.ndarray, drop: np.ndarray) -> np.ndarray:
    """Per row of ``x`` (``[rows, ranks]``), the median of its values but the one in column
    ``drop[row]``: the multiset the whole run's median over the other ranks reads, so the same
    number."""
    rows, ranks = x.shape
    if ranks < 2:
        return np.full(rows, np.nan)
    keep = np.ones(x.shape, dtype=bool)
    keep[np.arange(rows), drop] = False
    return np.median(x[keep].reshape(rows, ranks - 1), axis=1, overwrite_input=True)


def _heat_layout(a: RunLines, cfg: DiagnosisConfig) -> tuple[list[int], list[list[int]] | None, list[str]]:
    """The heat map's ranks in order (grouped by node), its node groups when it aggregates (more
    ranks than ``max_heatmap_rows``), and its rows' labels."""
    nodes = [str(n) for n in a.topology("node_rank")]
    local = [x if x is not None else r for r, x in enumerate(a.topology("local_rank"))]
    order = sorted(range(a.world_size), key=lambda r: (nodes[r], local[r], r))
    if a.world_size <= cfg.max_heatmap_rows:
        return order, None, [f"r{r}" for r in order]
    groups: dict[str, list[int]] = {}
    for r in order:
        groups.setdefault(nodes[r], []).append(r)
    return order, list(groups.values()), [f"node {n}" for n in groups]


def digest_run(a: RunLines, cfg: DiagnosisConfig, *, use_opt: bool = True) -> RunDigest:
    """Read ``a``'s per-rank numbers once, a block of steps at a time (module docstring).

    ``use_opt``: count a recorded optimizer step as the rank's own work between steps; a run that
    lacks it in some step (a timeline of records of two versions) counts its input only, as a run
    without it (read again, then: rare, and a second reduction every step costs more)."""
    digester = _Digester(a, cfg, use_opt)
    for block in a.rank_blocks():
        if not digester.add(block):
            return digest_run(a, cfg, use_opt=False)
    return digester.result()


class _Moments:
    """Per-rank mean and sum of squared deviations, merged block by block (Chan et al.)."""

    def __init__(self, ranks: int) -> None:
        self.count, self.mean, self.m2 = 0, np.zeros(ranks), np.zeros(ranks)

    def add(self, x: np.ndarray) -> None:
        n = len(x)
        block_mean = x.mean(axis=0)
        deviation = x - block_mean
        block_m2 = (deviation * deviation).sum(axis=0)
        if self.count == 0:
            self.mean, self.m2 = block_mean, block_m2
        else:
            total = self.count + n
            delta = block_mean - self.mean
            self.mean = self.mean + delta * (n / total)
            self.m2 = self.m2 + block_m2 + delta * delta * (self.count * n / total)
        self.count += n

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.m2 / max(self.count, 1))


#: the per-step series the digester fills, one number per step
_PER_STEP = (
    "transfer", "skew", "median_wait", "lost", "wait_others",
    "compute_own", "compute_others", "data_own", "data_others",
    "between_own", "between_others", "loop_own", "loop_others",
    "gc_own", "gc_others", "local_others",
)  # fmt: skip


class _Digester:
    """The state of one pass of :func:`digest_run` over a run's blocks of steps."""

    def __init__(self, a: RunLines, cfg: DiagnosisConfig, use_opt: bool) -> None:
        S, W = a.steps, a.world_size
        self.a, self.cfg, self.use_opt = a, cfg, use_opt
        self.noise = noise_ms(cfg, float(np.median(a.step_ms))) if S else cfg.slow_ms_floor
        self.per_step: dict[str, np.ndarray] = {name: np.full(S, np.nan) for name in _PER_STEP}
        self.straggler = np.zeros(S, dtype=np.int64)
        self.bound = np.ones(S, dtype=bool)
        self.complete = {"gc_ms": True, "gc_collections": True, "host_bound": True}
        local = np.asarray([x if x is not None and x >= 0 else -1 for x in a.topology("local_rank")])
        self.local = local
        self.by_local = len(local) > 0 and local.min() >= 0 and len(set(local.tolist())) >= 2
        self.floor = _Rows(floor_rows(S))
        self.growth = _Rows(growth_rows(np.random.default_rng(GROWTH_SEED), S))
        self.sample = _Rows(sample_steps(S, cfg.projection_calibration_steps))
        self.order, self.groups, self.heat_labels = _heat_layout(a, cfg)
        self.heat = _Bins(S, cfg.max_heatmap_columns)
        self.late_bins = _Bins(S, cfg.max_heatmap_columns)
        self.late_groups = [[r] for r in range(W)] if self.groups is None else self.groups
        self.late_count, self.late_sum = np.zeros(W, dtype=np.int64), np.zeros(W)
        self.pauses: list[np.ndarray] = []
        self.longest, self.collections = 0.0, 0.0
        self.compute = _Moments(W)
        self.opt_before: np.ndarray | None = None  # the last row's optimizer step (the next row's "before")
        self.lo = 0

    def add(self, block: dict[str, np.ndarray]) -> bool:
        """One block of steps; ``False``: the optimizer step is missing from a block after others had
        it, and the run must be read again without it."""
        w = block["wait"]
        n, lo = len(w), self.lo
        at = slice(lo, lo + n)
        transfer = w.min(axis=1)
        late = w.argmin(axis=1)
        self._waits(w, at, transfer, late)
        if not self._own_work(block, at, late):
            return False
        self._gc(block, at, late)
        self._heat_and_lateness(w, at, transfer)
        self.compute.add(block["compute"])
        self.floor.add(lo, block, ("wait",))
        self.growth.add(lo, block, ("wait",))
        self.sample.add(lo, block, ("wait", "compute", "data", "gap", "samples", "tokens"))
        self.lo += n
        return True

    def _waits(self, w: np.ndarray, at: slice, transfer: np.ndarray, late: np.ndarray) -> None:
        per_step, lo = self.per_step, self.lo
        self.straggler[at] = late
        per_step["transfer"][at] = transfer
        per_step["skew"][at] = w.max(axis=1) - transfer
        per_step["median_wait"][at] = np.median(w, axis=1)
        per_step["lost"][at] = (w - transfer[:, None]).mean(axis=1)
        per_step["wait_others"][at] = _median_without(w, late)
        if self.by_local:
            out, local = per_step["local_others"], self.local
            for index in set(local[late].tolist()):
                mine = np.nonzero(local[late] == index)[0]
                out[lo + mine] = np.median(w[np.ix_(mine, np.nonzero(local != index)[0])], axis=1)

    def _own_and_others(self, name: str, x: np.ndarray, at: slice, late: np.ndarray) -> None:
        self.per_step[f"{name}_own"][at] = x[np.arange(len(late)), late]
        self.per_step[f"{name}_others"][at] = _median_without(x, late)

    def _own_work(self, block: dict[str, np.ndarray], at: slice, late: np.ndarray) -> bool:
        self._own_and_others("compute", block["compute"], at, late)
        self._own_and_others("data", block["data"], at, late)
        # the gap before a step holds the rank's optimizer step of the step before (the first
        # step's own for the first), where recorded, and its input: its own work; the rest is the
        # framework's loop between steps
        opt = block.get("opt") if self.use_opt else None
        if self.use_opt and opt is None:
            if self.lo:  # some step before had it
                return False
            self.use_opt = False
        between = block["data"]
        if opt is not None:
            before = np.concatenate([opt[:1] if self.opt_before is None else self.opt_before, opt[:-1]])
            between = before + between
            self.opt_before = opt[-1:]
        self._own_and_others("between", between, at, late)
        self._own_and_others("loop", np.clip(block["gap"] - between, 0.0, None), at, late)
        return True

    def _gc(self, block: dict[str, np.ndarray], at: slice, late: np.ndarray) -> None:
        gc = block.get("gc_ms")
        if gc is not None:
            gc = np.nan_to_num(gc)
            self.per_step["gc_own"][at] = gc[np.arange(len(late)), late]
            # the others' median only where the GC check reads it: the steps whose skew is above noise
            costly = np.nonzero(self.per_step["skew"][at] >= self.noise)[0]
            self.per_step["gc_others"][self.lo + costly] = _median_without(gc[costly], late[costly])
            self.pauses.append(gc[gc >= self.noise])
            self.longest = max(self.longest, float(gc.max())) if gc.size else self.longest
        else:
            self.complete["gc_ms"] = False
        if "gc_collections" in block:
            self.collections += float(np.nan_to_num(block["gc_collections"]).sum())
        else:
            self.complete["gc_collections"] = False
        if "host_bound" in block:
            self.bound[at] = block["host_bound"][np.arange(len(late)), late]
        else:
            self.complete["host_bound"] = False

    def _heat_and_lateness(self, w: np.ndarray, at: slice, transfer: np.ndarray) -> None:
        groups = self.groups
        # heat map rows: each rank's lead, or each node's mean lead (from its ranks' waits)
        if groups is None:
            self.heat.add((w - transfer[:, None])[:, self.order])
        else:
            self.heat.add(np.stack([(w[:, g] - transfer[:, None]).mean(axis=1) for g in groups], axis=1))
        # lateness against the step's median arrival: the median wait minus the rank's wait
        lateness = self.per_step["median_wait"][at][:, None] - w
        self.late_count += (lateness >= self.noise).sum(axis=0)
        self.late_sum += lateness.sum(axis=0)
        if groups is None:
            self.late_bins.add(lateness)
        else:
            self.late_bins.add(np.stack([lateness[:, g].mean(axis=1) for g in self.late_groups], axis=1))

    def result(self) -> RunDigest:
        a, S, W = self.a, self.a.steps, self.a.world_size
        if self.lo != S:
            raise ValueError(f"the record's per-rank numbers hold {self.lo} of its {S} steps")
        complete, per_step, sample = self.complete, self.per_step, self.sample
        complete["samples"] = sample.complete.get("samples", False)
        complete["tokens"] = sample.complete.get("tokens", False)
        for name in ("gc_ms", "gc_collections", "host_bound"):
            complete[name] = complete[name] and S > 0
        picked, values = sample.rows, sample.values

        def sampled(name: str) -> np.ndarray:
            return values.get(name, np.zeros((len(picked), W)))

        return RunDigest(
            steps=S,
            world=W,
            transfer=per_step["transfer"],
            straggler=self.straggler,
            skew=per_step["skew"],
            median_wait=per_step["median_wait"],
            lost=per_step["lost"],
            own={name: per_step[f"{name}_own"] for name in ("compute", "data", "between", "loop")},
            others={
                name: per_step[f"{name}_others"] for name in ("wait", "compute", "data", "between", "loop")
            },
            local_others_wait=per_step["local_others"] if self.by_local else None,
            host_bound=self.bound if complete["host_bound"] else None,
            gc=self._gc_digest() if complete["gc_ms"] else None,
            compute_mean=self.compute.mean,
            compute_std=self.compute.std,
            late_count=self.late_count,
            late_sum=self.late_sum,
            late_bins=self.late_bins.result(len(self.late_groups)),
            late_labels=self.late_groups,
            late_edges=self.late_bins.edges if self.late_bins.edges is not None else np.arange(S + 1),
            # the floor's sampled waits are its own: reduced in place (1.3 GB at 20,000 x 8,192)
            floor=jitter_floor(
                self.floor.values.get("wait", np.zeros((0, W))), a.step_ms, overwrite_input=True
            ),
            growth_wait=self.growth.values.get("wait", np.zeros((0, W))),
            sample=RunArrays.of(
                a.lines_only().select(picked),
                wait=sampled("wait"),
                compute=sampled("compute"),
                data=sampled("data"),
                gap=sampled("gap"),
                samples=values["samples"] if complete["samples"] else None,
                tokens=values["tokens"] if complete["tokens"] else None,
            ),
            sample_rows=picked,
            heat=self.heat.result(len(self.heat_labels)),
            heat_labels=self.heat_labels,
            heat_binned=self.heat.binned,
        )

    def _gc_digest(self) -> GcDigest:
        return GcDigest(
            own=self.per_step["gc_own"],
            others=self.per_step["gc_others"],
            pauses=np.concatenate(self.pauses) if self.pauses else np.zeros(0),
            longest=self.longest,
            collections=self.collections if self.complete["gc_collections"] else None,
        )
