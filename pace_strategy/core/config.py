"""The typed pacing configuration: every constant of the monitor and the controller, validated at start."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, get_args

from pace_strategy.core.errors import PacingConfigError

__all__ = [
    "GROUPS",
    "SWITCHED_GROUPS",
    "BalanceConfig",
    "DDPMonitor",
    "GcSyncConfig",
    "HangAction",
    "HangConfig",
    "PacingConfig",
    "PacingMode",
    "RebalanceConfig",
    "check_known_keys",
    "check_number",
    "doc",
    "nest_switches",
    "recorded_switch",
]

PacingMode = Literal["adaptive", "monitor", "forced"]
_MODES: tuple[str, ...] = get_args(PacingMode)
DDPMonitor = Literal["grad_ready", "comm_hook"]
_DDP_MONITORS: tuple[str, ...] = get_args(DDPMonitor)
ExchangeTopology = Literal["flat", "node_leaders"]
_EXCHANGE_TOPOLOGIES: tuple[str, ...] = get_args(ExchangeTopology)
RecordFormat = Literal["jsonl", "arrow"]
_RECORD_FORMATS: tuple[str, ...] = get_args(RecordFormat)
HangAction = Literal["auto", "abort", "log"]
_HANG_ACTIONS: tuple[str, ...] = get_args(HangAction)


def doc(text: str) -> dict[str, str]:
    """Field metadata holding a field's documentation (whitespace folded)."""
    return {"doc": " ".join(text.split())}


def check_known_keys(keys: Iterable[str], known: Sequence[str], what: str, prefix: str = "") -> None:
    """Raise ``PacingConfigError`` for the first key not in ``known``, suggesting the nearest one."""
    for key in keys:
        if key not in known:
            hint = difflib.get_close_matches(str(key), list(known), n=1)
            suggestion = f" Did you mean {prefix + hint[0]!r}?" if hint else ""
            # an empty name under a group is named by its group ('rebalance.' would read as a typo)
            name = f"'' in {prefix.rstrip('.')!r}" if key == "" and prefix else repr(prefix + str(key))
            raise PacingConfigError(f"Unknown {what} {name}.{suggestion} Valid: {', '.join(known)}.")


class _Group:
    """What the three nested groups share: built from a mapping with unknown keys named, and checked
    with messages that name the field as ``PacingConfig.<group>.<field>``."""

    GROUP: ClassVar[str]

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Any:
        check_known_keys(values, [f.name for f in fields(cls)], "pacing config field", prefix=f"{cls.GROUP}.")  # type: ignore[arg-type]
        return cls(**values)

    def _name(self, name: str) -> str:
        return f"{self.GROUP}.{name}"


@dataclass(frozen=True, kw_only=True)
class HangConfig(_Group):
    """The hang watchdog (docs/reliability.md)."""

    GROUP: ClassVar[str] = "hang"

    timeout_s: float = field(
        default=120.0,
        metadata=doc(
            """Seconds a rank's own step may stand still before its watchdog reads every rank's progress
            from the job's c10d store and names the ranks that stopped arriving (behind the others, or
            with a stopped heartbeat), long before the process-group timeout (30 min by default) that
            DDP's stuck collective would otherwise wait out. 0 disables the watchdog. Pauses that every
            rank takes together (validation, checkpointing) never trigger it; a single rank pausing
            alone longer than this while its peers wait in a collective does (docs/reliability.md)."""
        ),
    )
    action: HangAction = field(
        default="auto",
        metadata=doc(
            """What a rank does once its watchdog has named hung ranks (after logging them and, on rank
            0, writing a ``hang`` line to the run record). ``"abort"``: close the run record with status
            ``hung`` and exit the process with code 75 so that the launcher can restart the job.
            ``"log"``: only log and record; training keeps waiting (for the process-group timeout, or
            for the rank to come back). ``"auto"``: ``"log"`` in ``mode="monitor"`` (observing ends
            no process unless asked), ``"abort"`` in the modes that pace."""
        ),
    )

    def __post_init__(self) -> None:
        _number(self, "timeout_s", low=0.0)
        _choice(self, "action", _HANG_ACTIONS)


@dataclass(frozen=True, kw_only=True)
class RebalanceConfig(_Group):
    """Rebalancing: per-rank shares of a constant global batch (docs/rebalancing.md)."""

    GROUP: ClassVar[str] = "rebalance"

    enabled: bool = field(
        default=False,
        metadata=doc(
            """Rebalancing: give a persistently slow rank fewer samples of a constant global batch (and
            the fast ranks more), from each rank's per-sample compute time in the exchanged windows
            (compute time over samples: wait, start gaps and data waits are not counted). A new split
            is kept only while an A/B check shows the step shorter by more than the run's own noise.
            Needs an integration that attaches a share schedule (docs/rebalancing.md); works beside
            pacing and with ``mode="monitor"``."""
        ),
    )
    quantum: int | Literal["auto"] = field(
        default="auto",
        metadata=doc(
            """Shares are whole multiples of this many samples (any remainder of the global batch goes to
            the fastest rank), and every rank keeps at least one quantum. Larger quanta keep batch
            shapes few (each new shape may cost a recompilation or an allocator warm-up on GPUs).
            ``"auto"``: 8 where the even share (global batch / world size) is at least 64 samples,
            else the largest power of two up to an eighth of it (at least 1): at 32 samples per rank
            a quantum of 8 leaves four splits, and the best of them stops short of the gain in reach."""
        ),
    )
    max_share: float = field(
        default=1.5,
        metadata=doc(
            """The most samples a rank may take, as a multiple of the even share (global batch / world
            size; at least 1). A fast rank's share otherwise grows without bound, up to nearly all of
            the global batch, and its activations with it: on a GPU that runs it out of memory."""
        ),
    )
    min_imbalance: float = field(
        default=0.05,
        metadata=doc(
            """A new split is proposed only if it is predicted to shorten the step by at least this
            fraction of the median step time: the slowest rank's compute now against the slowest
            predicted compute after the split (per-sample time x new share)."""
        ),
    )
    persist_windows: int = field(
        default=3,
        metadata=doc(
            """Consecutive windows the imbalance must persist before a new split is tried (hysteresis;
            the split comes from the median per-sample times of those windows)."""
        ),
    )
    min_scaling: float = field(
        default=0.5,
        metadata=doc(
            """A split is kept only if the compute of the ranks whose share fell dropped by at least
            this fraction of what their per-sample time predicted; less means the slowness is a fixed
            per-step cost that does not scale with samples, and the split is reverted."""
        ),
    )
    cooldown_windows: int = field(
        default=16,
        metadata=doc(
            """Windows at the previous split after a reverted trial before another split may be tried;
            grows by ``cooldown_growth`` for each further reverted trial in a row, up to
            ``max_cooldown_windows`` (or this start, if larger). The trial itself lasts
            ``ab_windows`` windows and is judged with pacing's A/B rule (``min_gain_fraction``,
            ``ab_noise_factor``)."""
        ),
    )

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            _fail(self._name("enabled"), self.enabled, "true or false")
        if self.quantum != "auto":
            _positive_int(self, "quantum", allowed="an integer >= 1 or 'auto'")
        _number(self, "max_share", low=1.0, high=float(2**31))
        _number(self, "min_imbalance", low=0.0, high=1.0, low_open=True)
        _positive_int(self, "persist_windows")
        _number(self, "min_scaling", low=0.0, high=1.0, low_open=True)
        _positive_int(self, "cooldown_windows", minimum=0)


@dataclass(frozen=True, kw_only=True)
class GcSyncConfig(_Group):
    """Synchronized garbage collection (docs/diagnosis.md, ``gc_pauses``)."""

    GROUP: ClassVar[str] = "gc_sync"

    enabled: bool = field(
        default=False,
        metadata=doc(
            """Synchronized garbage collection. After ``gc_sync.warmup_steps`` the collector no longer
            runs full (oldest-generation) collections by itself; all ranks run one at the same agreed
            step instead, decided from the exchanged windows when any rank's collector would have run
            one, so W ranks' pauses overlap instead of adding up. Young collections stay automatic.
            The collector's settings are restored at the end of training and on failure
            (docs/diagnosis.md, ``gc_pauses``)."""
        ),
    )
    warmup_steps: int = field(
        default=5,
        metadata=doc(
            """Steps of normal collection before synchronized collection takes over (start-up builds
            the long-lived heap: model, optimizer state, data loader)."""
        ),
    )
    due_fraction: float = field(
        default=1.0,
        metadata=doc(
            """A synchronized collection is decided when some rank's due fraction (its progress towards
            the full collection CPython's own rule would start: young collections since the last full
            one over the third threshold, and objects promoted since then over a quarter of the
            long-lived heap) reaches this value. 1.0: when the automatic collector would have run; lower
            collects earlier and more often (less garbage held), higher later."""
        ),
    )
    freeze: bool = field(
        default=False,
        metadata=doc(
            """At the take-over, run one full collection on every rank, then move the surviving heap
            to the permanent generation (``gc.freeze()``): later full collections skip it and become
            short. Trade-off:
            frozen objects are never collected, so garbage cycles among them leak until the end of
            training (when they are unfrozen)."""
        ),
    )

    def __post_init__(self) -> None:
        for name in ("enabled", "freeze"):
            if not isinstance(getattr(self, name), bool):
                _fail(self._name(name), getattr(self, name), "true or false")
        _positive_int(self, "warmup_steps", minimum=0)
        _number(self, "due_fraction", low=0.0, low_open=True)


BalanceCost = Literal["tokens", "attention"]
_BALANCE_COSTS: tuple[str, ...] = get_args(BalanceCost)
BalanceLayout = Literal["padded", "packed"]
_BALANCE_LAYOUTS: tuple[str, ...] = get_args(BalanceLayout)


@dataclass(frozen=True, kw_only=True)
class BalanceConfig(_Group):
    """Cost-balanced batches for uneven inputs (docs/balancing.md)."""

    GROUP: ClassVar[str] = "balance"

    enabled: bool = field(
        default=False,
        metadata=doc(
            """Cost-balanced batches: every global batch is split over the ranks by the predicted cost
            of its samples (from their lengths) instead of rank r taking slice r, so that the rank
            that drew the longest sequences does not set every step. The same global batches, the
            same samples each epoch; ranks may train different numbers of samples, and each rank's
            loss is scaled so that the update is the global batch's mean (as rebalancing's shares
            are). Needs the training data as a DataLoader over a map-style dataset whose samples have
            lengths (docs/balancing.md)."""
        ),
    )
    cost: BalanceCost = field(
        default="attention",
        metadata=doc(
            """The predicted cost of a sample of L tokens: ``"tokens"``: L; ``"attention"``: L +
            L**2 / ``quadratic_tokens`` (attention grows with the square of the length)."""
        ),
    )
    layout: BalanceLayout = field(
        default="padded",
        metadata=doc(
            """How a rank's samples make its batch. ``"padded"``: padded to its longest sample (a
            rank's cost is its count times the cost of its longest sample; only unequal counts can
            shorten the step). ``"packed"``: concatenated or block-diagonal (its cost is the sum of its
            samples' costs)."""
        ),
    )
    quadratic_tokens: float = field(
        default=1024.0,
        metadata=doc(
            """For ``cost="attention"``: the length, in tokens, at which a sample's attention work
            equals its linear layers' work (roughly a few times the model width)."""
        ),
    )
    per_sample: float = field(
        default=0.0,
        metadata=doc(
            """What a sample costs whatever its length, in tokens of the linear layers (the loop's and
            the loss's per-sample work, kernel launches). On a small model it can outweigh the length:
            fitted at 390-981 for the 2-layer, width-64 transformer of ``benchmarks/balance.py`` on one
            CPU thread (``pace_strategy.data.balance.fit_cost`` fits it and ``quadratic_tokens``)."""
        ),
    )
    fit: bool = field(
        default=True,
        metadata=doc(
            """Fit the cost model online: ``per_sample`` and ``quadratic_tokens`` (``attention``; only
            ``per_sample`` for ``tokens``) by least squares of each rank's measured compute time per
            step against the samples, tokens and squared tokens it was given, over the windows so far
            (decaying). The configured values split the samples until the first fit (24 rank-steps of
            three lengths at least); a fit replaces the cost in force when it moves by a quarter, at
            a window boundary, never during an A/B check's arms. ``False``: the configured values
            throughout."""
        ),
    )
    max_tokens: int | None = field(
        default=None,
        metadata=doc(
            """The most tokens a rank may take in one batch (padded: count x longest; packed: the sum
            of lengths), e.g. what its memory holds; ``None``: no limit. A global batch that cannot
            be split within it fails naming this field."""
        ),
    )
    verify: bool = field(
        default=True,
        metadata=doc(
            """The A/B check: balanced and plain slices of the same global batches run in turns
            (``ab_windows`` windows each, ``check_rounds`` rounds) and balanced batches are kept only
            if the median step is shorter by pacing's A/B rule (``min_gain_fraction``,
            ``ab_noise_factor``); pacing and rebalancing wait for the verdict. ``False``: balanced
            from the first step to the last, unchecked."""
        ),
    )
    check_rounds: int = field(
        default=2,
        metadata=doc(
            """Rounds of the A/B check, each one block of balanced windows and one of plain ones."""
        ),
    )
    recheck_windows: int = field(
        default=200,
        metadata=doc(
            """Windows after each verdict of the A/B check before it runs again (the input mix or the
            cluster may have changed); 0: never again."""
        ),
    )

    def __post_init__(self) -> None:
        for name in ("enabled", "verify"):
            if not isinstance(getattr(self, name), bool):
                _fail(self._name(name), getattr(self, name), "true or false")
        _positive_int(self, "check_rounds")
        _positive_int(self, "recheck_windows", minimum=0)
        _choice(self, "cost", _BALANCE_COSTS)
        _choice(self, "layout", _BALANCE_LAYOUTS)
        _number(self, "quadratic_tokens", low=0.0, low_open=True)
        _number(self, "per_sample", low=0.0)
        if self.max_tokens is not None:
            _positive_int(self, "max_tokens", allowed="an integer >= 1 or null")


#: the nested groups of :class:`PacingConfig`, by field name
GROUPS: dict[str, type[Any]] = {
    "hang": HangConfig,
    "rebalance": RebalanceConfig,
    "balance": BalanceConfig,
    "gc_sync": GcSyncConfig,
}
#: groups whose ``enabled`` switch a bare boolean stands for (``rebalance=True``)
SWITCHED_GROUPS = ("rebalance", "balance", "gc_sync")


def recorded_switch(config: Mapping[str, Any] | None, group: str) -> bool:
    """Whether a run record's header ``config`` had ``group`` (``rebalance``, ``gc_sync``) on:
    ``{"rebalance": {"enabled": ...}}``."""
    value = (config or {}).get(group) if isinstance(config, Mapping) else None
    return bool(value.get("enabled")) if isinstance(value, Mapping) else False


def nest_switches(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with a bare boolean for ``rebalance`` / ``gc_sync`` turned into ``{"enabled": ...}``;
    groups stay mappings (or the group objects they were)."""
    out = dict(values)
    for group in SWITCHED_GROUPS:
        if isinstance(out.get(group), bool):
            out[group] = {"enabled": out[group]}
    return out


@dataclass(frozen=True, kw_only=True)
class PacingConfig:
    """Configuration of skew monitoring and adaptive pacing.

    The paper behind the project (arXiv 2603.04424) publishes no thresholds, delay sizes or code; every
    default below is this project's own design, chosen from measurements on a 2-core CPU test bed and
    explained in ``docs/configuration.md``. Build one with keyword arguments, or from a mapping with
    :meth:`from_dict` (unknown keys are errors that suggest the nearest valid key).
    """

    mode: PacingMode = field(
        default="adaptive",
        metadata=doc(
            """``"adaptive"``: monitor always, pace only while imbalance is severe and only while A/B
            windows show that pacing helps. ``"monitor"``: measure and report, never delay a rank.
            ``"forced"``: apply the computed delays whenever there is a pacable lead, bypassing the
            activation rule and the A/B safety check (for experiments and tests)."""
        ),
    )
    ddp_monitor: DDPMonitor = field(
        default="grad_ready",
        metadata=doc(
            """How DDP's sync point is timed. Either way a rank's arrival is the end of its local
            backward and the pacing delay is applied at its first gradient, before any bucket is
            launched. ``"grad_ready"``: a hook on the parameter whose gradient comes first applies the
            delay and queues autograd-engine callbacks that mark the end of backward and, after DDP
            has waited for every bucket, completion; no Python runs on the communication path, and a
            user's comm hook is registered as it is. ``"comm_hook"``: a comm hook that wraps the
            user's (or the default all-reduce) and counts every bucket (the run record's
            ``buckets``), arrival at the last bucket's hand-off; it costs more per step
            (docs/overhead.md). FSDP ignores this field."""
        ),
    )
    exchange_every_steps: int = field(
        default=32,
        metadata=doc(
            """K, steps per window. Per-rank step records are exchanged with one small all-gather every
            K steps (not every step: one all-gather costs milliseconds of process wake-ups on CPU).
            Telemetry for a step is written when its window arrives, at the step's own global step."""
        ),
    )
    warmup_steps: int = field(
        default=5,
        metadata=doc(
            """Steps excluded from statistics and pacing at the start of training. DDP rebuilds its
            gradient buckets after the first iteration and first steps pay one-off costs."""
        ),
    )
    activate_skew_fraction: float = field(
        default=0.10,
        metadata=doc(
            """Pacing may turn on when the window's median unpaced skew is at least this fraction of the
            median step time (0.10: ranks arrive 10% of a step apart)."""
        ),
    )
    deactivate_skew_fraction: float = field(
        default=0.05,
        metadata=doc(
            """Pacing turns off when the median unpaced skew falls below this fraction of the step time
            (hysteresis: must be <= ``activate_skew_fraction``)."""
        ),
    )
    activate_windows: int = field(
        default=3, metadata=doc("Consecutive severe windows needed before pacing turns on.")
    )
    deactivate_windows: int = field(
        default=2, metadata=doc("Consecutive calm windows needed before pacing turns off.")
    )
    gain: float = field(
        default=0.5,
        metadata=doc(
            """Fraction of a rank's pacable lead (smoothed lead minus its noise margin) that is applied as
            delay. In (0, 1]: a gain above 1 would make the paced rank the last one."""
        ),
    )
    noise_margin_factor: float = field(
        default=2.0,
        metadata=doc(
            """Margin, in multiples of the rank's measured lead noise (standard deviation over the
            window), that is kept unpaced so that a noisy step does not turn the paced rank into the
            straggler."""
        ),
    )
    persist_fraction: float = field(
        default=0.8,
        metadata=doc(
            """A rank is pacable in a window only if it led by more than its margin in at least this
            fraction of the window's steps (a sustained, persistent lead)."""
        ),
    )
    lead_smoothing: float = field(
        default=0.5,
        metadata=doc("Weight of the newest window in the exponential moving average of each rank's lead."),
    )
    max_delay_ms: float = field(
        default=20.0, metadata=doc("Hard cap on the delay applied to a rank in one step, milliseconds.")
    )
    max_delay_step_fraction: float = field(
        default=0.10,
        metadata=doc("Second cap on the delay: this fraction of the window's median step time."),
    )
    min_delay_ms: float = field(
        default=0.5,
        metadata=doc("Delays below this many milliseconds are not applied (sleep granularity)."),
    )
    ab_windows: int = field(
        default=2,
        metadata=doc(
            """Windows in each arm of the A/B safety check: pacing runs this many windows and its median
            step time is compared with the same number of unpaced windows."""
        ),
    )
    min_gain_fraction: float = field(
        default=0.005,
        metadata=doc(
            """Pacing is kept only if the paced median step time is at least this fraction shorter than
            the unpaced one (0.005 = 0.5%); otherwise the controller backs off for a cool-down."""
        ),
    )
    ab_noise_factor: float = field(
        default=1.0,
        metadata=doc(
            """Pacing is kept only if its gain also exceeds this many standard deviations of the A/B
            difference that noise alone would give, estimated from the spread of the unpaced window
            medians seen before the trial (the run's own window-to-window noise). A gain within noise
            is a failed check. 0 leaves only ``min_gain_fraction``; higher values keep fewer false
            gains and fewer real ones (docs/configuration.md)."""
        ),
    )
    probe_every_windows: int = field(
        default=8,
        metadata=doc(
            """While pacing is kept, re-measure the unpaced arm after this many paced windows (conditions
            change; pacing must keep proving itself)."""
        ),
    )
    cooldown_windows: int = field(
        default=16,
        metadata=doc("Windows with pacing off after a failed A/B check before pacing may turn on again."),
    )
    cooldown_growth: float = field(
        default=2.0,
        metadata=doc(
            """Each further failed A/B check in a row multiplies the cool-down by this factor (>= 1; 1 keeps
            it fixed), up to ``max_cooldown_windows``. A check that keeps pacing resets it. Where pacing
            cannot help, the share of steps spent in trials then shrinks instead of staying constant."""
        ),
    )
    max_cooldown_windows: int = field(
        default=256,
        metadata=doc("Upper bound, in windows, of the growing cool-down (>= ``cooldown_windows``)."),
    )
    cv_window_steps: int = field(
        default=50,
        metadata=doc(
            "Rolling window, in steps, of the step-time coefficient of variation (``pace/step_cv``)."
        ),
    )
    per_rank_tag_limit: int = field(
        default=64,
        metadata=doc("``pace/lead_ms/rank_{r}`` tags are written only while world size <= this limit."),
    )
    tag_every_steps: int | None = field(
        default=None,
        metadata=doc(
            """The ``pace/`` tags go to the framework's loggers for every this-many-th step (steps whose
            number is a multiple of it); 1: every step. ``None``: as often as the job logs its own
            metrics, Lightning's ``Trainer(log_every_n_steps=...)`` (50 by default) or the HF
            Trainer's ``logging_steps`` (``logging_strategy="steps"``), else every step (Fabric,
            Accelerate, plain PyTorch). The run record keeps every step whatever this is. A tagged
            step costs rank 0 about 0.3 ms of CPU into TensorBoard (one event of 13 tags at 2 ranks),
            more into loggers that take a call per step (docs/telemetry.md, "What the tags cost")."""
        ),
    )
    metrics_port: int = field(
        default=0,
        metadata=doc(
            """Rank 0 serves live Prometheus metrics on this TCP port (on ``metrics_host``; 0: no endpoint,
            the default). Needs ``pip install 'pace-strategy[prometheus]'``; a port that cannot be bound
            fails at start. Updated once per window, off the training thread (docs/telemetry.md)."""
        ),
    )
    metrics_host: str = field(
        default="0.0.0.0",
        metadata=doc(
            """The address rank 0's metrics endpoint binds: every interface by default, as a scraper on
            another host needs; ``127.0.0.1`` keeps it on the host, an interface's address on that
            network only."""
        ),
    )
    exchange_timeout_s: float = field(
        default=300.0,
        metadata=doc(
            """Seconds a rank waits for the window exchange before raising ``PaceTimeoutError`` naming the
            step (a dead or hung peer must not hang training forever)."""
        ),
    )
    hang: HangConfig = field(
        default_factory=lambda: HangConfig(),
        metadata=doc("The hang watchdog (``hang.timeout_s``, ``hang.action``): see :class:`HangConfig`."),
    )
    straggler_warn_fraction: float = field(
        default=0.8,
        metadata=doc(
            """Warn when one rank arrived last in at least this fraction of a window's steps, for
            ``activate_windows`` windows in a row."""
        ),
    )
    straggler_warn_interval_s: float = field(
        default=300.0, metadata=doc("Minimum seconds between two persistent-straggler warnings.")
    )
    run_record: bool = field(
        default=True,
        metadata=doc(
            "Rank 0 writes the full per-rank, per-step run record (JSON lines) to the log directory."
        ),
    )
    exchange_topology: ExchangeTopology = field(
        default="flat",
        metadata=doc(
            """How each window is exchanged. ``"flat"``: one all-gather over every rank; every rank
            receives every rank's rows and decides. ``"node_leaders"``: the ranks of a node
            all-gather over a node group, the node leaders (each node's lowest rank) all-gather their
            nodes' rows and decide, and each leader broadcasts the decision to its node: the same
            decisions, a ring of N - 1 hops for N nodes instead of W - 1, and a rank that is not a
            leader receives only its node's rows. Nodes are the placements' ``node_rank`` (else
            host); a job on one node, or one rank per node, runs flat. The leaders' gather and
            decision are not overlapped with training (docs/benchmarks.md); the controllers'
            checkpoint state is the leaders' (rank 0's, what the adapters save). With
            ``record_format: "arrow"`` each leader writes its node's shard of the per-rank columns."""
        ),
    )
    record_format: RecordFormat = field(
        default="jsonl",
        metadata=doc(
            """Where the run record keeps each step's per-rank columns. ``"jsonl"``: in the step lines
            (one file). ``"arrow"``: in ``pace_run.ranks.arrow`` beside the JSON lines (an Arrow IPC
            stream, float32, zstd; pandas, polars and DuckDB read it), which then carry the global
            stream only: fewer bytes per rank-step and a faster ``pace diagnose`` on large runs.
            Needs ``pip install 'pace-strategy[arrow]'`` (docs/telemetry.md)."""
        ),
    )

    rebalance: RebalanceConfig = field(
        default_factory=lambda: RebalanceConfig(),
        metadata=doc(
            """Rebalancing (``rebalance.enabled``, ``rebalance.quantum``, ...): see :class:`RebalanceConfig`.
            ``rebalance=True`` is short for ``rebalance=RebalanceConfig(enabled=True)``."""
        ),
    )
    balance: BalanceConfig = field(
        default_factory=lambda: BalanceConfig(),
        metadata=doc(
            """Cost-balanced batches (``balance.enabled``, ``balance.cost``, ...): see
            :class:`BalanceConfig`. ``balance=True`` is short for ``balance=BalanceConfig(enabled=True)``."""
        ),
    )
    gc_sync: GcSyncConfig = field(
        default_factory=lambda: GcSyncConfig(),
        metadata=doc(
            """Synchronized garbage collection (``gc_sync.enabled``, ...): see :class:`GcSyncConfig`.
            ``gc_sync=True`` is short for ``gc_sync=GcSyncConfig(enabled=True)``."""
        ),
    )

    def __post_init__(self) -> None:
        _choice(self, "mode", _MODES)
        _choice(self, "ddp_monitor", _DDP_MONITORS)
        _positive_int(self, "exchange_every_steps")
        _positive_int(self, "activate_windows")
        _positive_int(self, "deactivate_windows")
        _positive_int(self, "ab_windows")
        _positive_int(self, "probe_every_windows")
        _positive_int(self, "cv_window_steps", minimum=2)
        _positive_int(self, "warmup_steps", minimum=0)
        _positive_int(self, "cooldown_windows", minimum=0)
        _positive_int(self, "max_cooldown_windows", minimum=0)
        _number(self, "cooldown_growth", low=1.0)
        _positive_int(self, "per_rank_tag_limit", minimum=0)
        if self.tag_every_steps is not None:
            _positive_int(self, "tag_every_steps", allowed="an integer >= 1 or null")
        _positive_int(self, "metrics_port", minimum=0)
        if not isinstance(self.metrics_host, str) or not self.metrics_host.strip():
            _fail("metrics_host", self.metrics_host, "an address to bind, e.g. '0.0.0.0' or '127.0.0.1'")
        if self.metrics_port > 65535:
            _fail("metrics_port", self.metrics_port, "a TCP port in 1..65535, or 0 for no endpoint")
        for name in ("activate_skew_fraction", "deactivate_skew_fraction", "max_delay_step_fraction"):
            _number(self, name, low=0.0, high=1.0, low_open=True)
        _number(self, "gain", low=0.0, high=1.0, low_open=True)
        _number(self, "persist_fraction", low=0.0, high=1.0, low_open=True)
        _number(self, "lead_smoothing", low=0.0, high=1.0, low_open=True)
        _number(self, "straggler_warn_fraction", low=0.0, high=1.0, low_open=True)
        _number(self, "noise_margin_factor", low=0.0)
        _number(self, "max_delay_ms", low=0.0)
        _number(self, "min_delay_ms", low=0.0)
        _number(self, "min_gain_fraction", low=0.0, high=1.0)
        _number(self, "ab_noise_factor", low=0.0)
        _number(self, "exchange_timeout_s", low=0.0, low_open=True)
        _number(self, "straggler_warn_interval_s", low=0.0)
        if not isinstance(self.run_record, bool):
            _fail("run_record", self.run_record, "true or false")
        _choice(self, "exchange_topology", _EXCHANGE_TOPOLOGIES)
        _choice(self, "record_format", _RECORD_FORMATS)
        for name, group in GROUPS.items():  # a bare switch or a mapping: the group object
            value = getattr(self, name)
            if isinstance(value, bool) and name in SWITCHED_GROUPS:
                object.__setattr__(self, name, group(enabled=value))
            elif isinstance(value, Mapping):
                object.__setattr__(self, name, group.from_dict(value))
            elif not isinstance(value, group):
                _fail(name, value, f"a {group.__name__}, or a mapping of its fields")
        if self.deactivate_skew_fraction > self.activate_skew_fraction:
            raise PacingConfigError(
                f"PacingConfig.deactivate_skew_fraction={self.deactivate_skew_fraction!r} is larger than "
                f"activate_skew_fraction={self.activate_skew_fraction!r}; the off threshold must be <= the "
                "on threshold (hysteresis). Lower deactivate_skew_fraction or raise activate_skew_fraction."
            )
        if self.max_cooldown_windows < self.cooldown_windows:
            raise PacingConfigError(
                f"PacingConfig.max_cooldown_windows={self.max_cooldown_windows!r} is smaller than "
                f"cooldown_windows={self.cooldown_windows!r}; the bound of the growing cool-down must be "
                ">= its start. Raise max_cooldown_windows or lower cooldown_windows."
            )
        if self.min_delay_ms > self.max_delay_ms:
            raise PacingConfigError(
                f"PacingConfig.min_delay_ms={self.min_delay_ms!r} is larger than max_delay_ms="
                f"{self.max_delay_ms!r}; no delay could ever be applied. Set min_delay_ms <= max_delay_ms."
            )

    @classmethod
    def normalize_mapping(cls, values: Mapping[str, Any], where: str = "") -> dict[str, Any]:
        """A mapping of fields (YAML, environment, ``pacing={...}``) with a bare switch for a group
        (``rebalance: true``) read as its ``enabled``."""
        return nest_switches(values)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names of all configuration fields, in declaration order (a group is one name)."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def dotted_fields(cls) -> dict[str, Any]:
        """Every leaf field as ``name`` or ``group.name`` -> its :class:`dataclasses.Field`."""
        out: dict[str, Any] = {}
        for f in fields(cls):
            group = GROUPS.get(f.name)
            if group is None:
                out[f.name] = f
            else:
                out.update((f"{f.name}.{g.name}", g) for g in fields(group))
        return out

    def dotted_values(self) -> dict[str, Any]:
        """Every leaf field's value, by its :meth:`dotted_fields` name (``rebalance.quantum``)."""
        values = self.to_dict()
        out: dict[str, Any] = {}
        for name in self.dotted_fields():
            group, _, leaf = name.rpartition(".")
            out[name] = values[group][leaf] if group else values[name]
        return out

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """Map of field name to its documentation (meaning, unit)."""
        return {f.name: f.metadata.get("doc", "") for f in fields(cls)}

    @property
    def hang_action(self) -> Literal["abort", "log"]:
        """``hang.action`` in force: ``"auto"`` is ``"log"`` in monitor mode, else ``"abort"``."""
        if self.hang.action == "auto":
            return "log" if self.mode == "monitor" else "abort"
        return self.hang.action

    @property
    def splits_batches(self) -> bool:
        """Whether the adapters rebuild the training loader around the share sampler: rebalancing
        (``rebalance.enabled``) or cost-balanced batches (``balance.enabled``)."""
        return bool(self.rebalance.enabled or self.balance.enabled)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> PacingConfig:
        """Build a config from a mapping (YAML section, environment, CLI, a run record's header);
        unknown keys are errors naming the nearest field. ``None`` or an empty mapping gives the
        defaults."""
        if values is not None and not isinstance(values, Mapping):
            raise PacingConfigError(
                f"PacingConfig values={values!r} are invalid: expected a mapping of field names to values "
                "(e.g. {'mode': 'monitor'})."
            )
        values = nest_switches(values or {})
        check_known_keys(values, cls.field_names(), "pacing config field")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as a plain mapping (for the run record and logs)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> PacingConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def tagging_every(self, framework_steps: int) -> PacingConfig:
        """This configuration with ``tag_every_steps`` set to the framework's own logging interval
        (``framework_steps``, at least 1) where it is ``None``."""
        if self.tag_every_steps is not None:
            return self
        return self.replace(tag_every_steps=max(1, int(framework_steps)))


def _fail(name: str, value: object, allowed: str) -> None:
    raise PacingConfigError(
        f"PacingConfig.{name}={value!r} is invalid: expected {allowed}. "
        f"Fix: set {name} to {allowed} (see docs/configuration.md)."
    )


def check_number(
    where: str,
    value: object,
    low: float,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
    fix: str = "",
) -> None:
    """``value`` a finite number (not a bool) in ``[low, high]`` (``low_open`` / ``high_open``: the
    bound excluded), else ``PacingConfigError`` naming ``where`` (``Config.field``), echoing the value,
    saying what is allowed and ``fix`` (``{allowed}`` in it: what is allowed). The one number check
    of every typed config: the pacing groups, the diagnosis thresholds, the simulator's model."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        ok = ok and math.isfinite(value)  # type: ignore[arg-type]
    except OverflowError:  # an int beyond the float range
        ok = False
    if ok:
        number = float(value)  # type: ignore[arg-type]
        ok = (number > low if low_open else number >= low) and (
            number < high if high_open else number <= high
        )
    if not ok:
        lo = f"> {low:g}" if low_open else f">= {low:g}"
        hi = "" if math.isinf(high) else (f" and < {high:g}" if high_open else f" and <= {high:g}")
        allowed = f"a finite number {lo}{hi}"
        fixed = f" Fix: {fix.format(allowed=allowed)}." if fix else ""
        raise PacingConfigError(f"{where}={value!r} is invalid: expected {allowed}.{fixed}")


def _display(cfg: Any, name: str) -> str:
    """``name``, or ``group.name`` for a field of a nested group."""
    return cfg._name(name) if isinstance(cfg, _Group) else name


def _choice(cfg: Any, name: str, allowed: Sequence[str]) -> None:
    """A field that takes one of the strings ``allowed`` (a ``Literal``'s arguments)."""
    if getattr(cfg, name) not in allowed:
        _fail(_display(cfg, name), getattr(cfg, name), f"one of {', '.join(map(repr, allowed))}")


def _positive_int(cfg: Any, name: str, minimum: int = 1, allowed: str | None = None) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(_display(cfg, name), value, allowed or f"an integer >= {minimum}")


def _number(
    cfg: Any,
    name: str,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
) -> None:
    shown = _display(cfg, name)
    fix = f"set {shown} to {{allowed}} (see docs/configuration.md)"
    check_number(f"PacingConfig.{shown}", getattr(cfg, name), low, high, low_open=low_open, fix=fix)


def _check_keywords(init: Any) -> Any:
    """``PacingConfig(unknown=...)`` fails as a misspelled key of a mapping does, naming the nearest
    field (the dataclass's own ``__init__`` would raise a bare ``TypeError``)."""

    @functools.wraps(init)
    def __init__(self: PacingConfig, **kwargs: Any) -> None:
        check_known_keys(kwargs, PacingConfig.field_names(), "PacingConfig argument")
        init(self, **kwargs)

    return __init__


PacingConfig.__init__ = _check_keywords(PacingConfig.__init__)  # type: ignore[method-assign]
