"""The run record's kinds of line, one typed class each: what the writers build and what the reader checks.

Every class names its ``KIND`` (the line's ``"record"`` value) and its fields with their Python types;
:meth:`Line.to_json` writes them, and :func:`json_fields` derives from the same annotations the JSON
types the reader accepts. A field without a default must be in every line of that kind the reader
meets; a field with a default was added later (or is written only when it has a value), so older
records may lack it, and it is checked only where present. ``omit`` fields are left out of the line
while they are ``None`` (:data:`OMIT`); :data:`FLATTEN` fields (a mapping) are written as the line's own
keys.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from pace_strategy.core.watchdog import HangReport

__all__ = [
    "FLATTEN",
    "LINE_KINDS",
    "OMIT",
    "DecisionLine",
    "EndLine",
    "HangLine",
    "HeaderLine",
    "Line",
    "LocalStepLine",
    "RankColumns",
    "ResumeLine",
    "SharesLine",
    "StepLine",
    "as_mapping",
    "hang_line",
    "json_fields",
]

#: a duration in milliseconds; ``None`` (JSON null) where it was not finite
Number = float | None


#: field metadata: the field is left out of the written line while it is ``None`` (optional when read)
OMIT = {"omit": True}
#: field metadata: the field (a mapping) is written as the line's own keys
FLATTEN = {"flatten": True}


@dataclass
class Line:
    """One JSON line of the run record."""

    KIND: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        """The line as written: ``{"record": KIND, field: value, ...}``."""
        out: dict[str, Any] = {"record": self.KIND}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("flatten"):
                out.update(value)
            elif value is None and f.metadata.get("omit"):
                continue
            else:
                out[_key(f.name)] = value.to_json() if isinstance(value, RankColumns) else value
        return out


def _key(name: str) -> str:
    return "from" if name == "from_" else name  # ``from`` is a Python keyword


@dataclass
class HeaderLine(Line):
    """The first line: what the run was (``extra``: restart count, versions, arrival, ...)."""

    KIND: ClassVar[str] = "header"
    schema: str
    version: int
    created_unix: float
    framework: str
    world_size: int
    config: dict[str, Any]
    topology: list[dict[str, Any]]
    extra: dict[str, Any] = field(default_factory=dict, metadata=FLATTEN)


@dataclass
class RankColumns:
    """A step's per-rank lists (``ranks`` of a ``step`` line), one value per rank. The later columns
    are written only where the step has them (``host_bound`` only where some rank was not)."""

    lead_ms: list[Number]
    compute_ms: list[Number]
    wait_ms: list[Number]
    delay_ms: list[Number]
    step_ms: list[Number]
    data_ms: list[Number]
    gap_ms: list[Number]
    gc_ms: list[Number] | None = field(default=None, metadata=OMIT)
    gc_collections: list[int] | None = field(default=None, metadata=OMIT)
    samples: list[int] | None = field(default=None, metadata=OMIT)
    opt_ms: list[Number] | None = field(default=None, metadata=OMIT)
    host_bound: list[int] | None = field(default=None, metadata=OMIT)
    tokens: list[int] | None = field(default=None, metadata=OMIT)

    def to_json(self) -> dict[str, Any]:
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass
class StepLine(Line):
    KIND: ClassVar[str] = "step"
    step: int
    valid: bool
    warmup: bool
    skew_ms: Number
    straggler_rank: int
    compute_straggler_rank: int
    step_ms: Number
    step_cv: Number
    wait_ms_min: Number
    wait_ms_max: Number
    delay_ms_max: Number
    pacing_active: bool
    buckets: int
    #: the per-rank lists; ``None`` (left out) where the header's ``rank_columns`` names the columnar
    #: file that holds them (``record_format: arrow``)
    ranks: RankColumns | None = field(default=None, metadata=OMIT)


@dataclass
class LocalStepLine(Line):
    """A step only ``rank`` measured (the run ended before it was exchanged); ``columns``: the
    exchanged row's other columns, named after :class:`~pace_strategy.core.records.Field`."""

    KIND: ClassVar[str] = "local_step"
    rank: int
    step: int
    valid: bool
    warmup: bool
    step_ms: Number
    columns: dict[str, Number] = field(default_factory=dict, metadata=FLATTEN)


@dataclass
class DecisionLine(Line):
    KIND: ClassVar[str] = "decision"
    window: int
    after_step: int
    state: str
    pacing_active: bool
    delays_ms: list[Number]
    reason: str
    baseline_step_ms: Number
    paced_step_ms: Number
    #: ``{"after_step", "due"}`` where gc_sync decided a collection
    gc_collect: dict[str, Any] | None = field(default=None, metadata=OMIT)


@dataclass
class SharesLine(Line):
    KIND: ClassVar[str] = "shares"
    window: int
    after_step: int
    state: str
    samples: list[int]
    from_step: int | None
    reason: str
    baseline_step_ms: Number
    trial_step_ms: Number
    per_sample_ms: list[Number] = field(default_factory=list)
    #: with cost-balanced batches on: whether the split's samples are balanced by cost
    balanced: bool | None = field(default=None, metadata=OMIT)
    #: balancing's A/B check: "trial", "kept" or "dropped" (at a verdict ``baseline_step_ms`` is the
    #: plain arm's median step and ``trial_step_ms`` the balanced arm's); "fit": a new fitted cost
    #: model only
    balance: str | None = field(default=None, metadata=OMIT)
    #: the cost model fitted online that splits the samples from ``from_step``:
    #: ``[quadratic_tokens, per_sample]``
    cost: list[float] | None = field(default=None, metadata=OMIT)


@dataclass
class HangLine(Line):
    KIND: ClassVar[str] = "hang"
    ranks: list[int]
    step: int
    waited_s: Number
    hosts: list[str]
    behind: list[int] = field(default_factory=list)
    stale: list[int] = field(default_factory=list)
    action: str = ""
    #: written after the line by the session: pids, GPUs, the evidence directory, ...
    extra: dict[str, Any] = field(default_factory=dict, metadata=FLATTEN)


def hang_line(report: HangReport, topology: Sequence[Mapping[str, Any]], action: str) -> dict[str, Any]:
    """The ``hang`` line of a watchdog's verdict, with each named rank's process and GPU."""
    named = [topology[r] if 0 <= r < len(topology) else {} for r in report.ranks]
    gpus = [p.get("gpu_uuid") or (p.get("device") if p.get("device") != "cpu" else None) for p in named]
    return HangLine(
        ranks=list(report.ranks),
        step=report.step,
        waited_s=round(report.waited_s, 3),
        hosts=list(report.hosts),
        behind=list(report.behind),
        stale=list(report.stale),
        action=action,
        extra={"pids": [p.get("pid") for p in named], "gpus": gpus},
    ).to_json()


@dataclass
class ResumeLine(Line):
    """Right after the header of a resumed run: the step it resumed at and what was restored. The
    session fills ``restored`` and ``skipped`` in place until the line is written."""

    KIND: ClassVar[str] = "resume"
    step: int
    restored: list[str]
    from_: str | None
    skipped: dict[str, str] = field(default_factory=dict)


@dataclass
class EndLine(Line):
    """The last line: how the run ended (``extra``: dropped steps and tag windows, hang details)."""

    KIND: ClassVar[str] = "end"
    status: str
    steps: int
    error: str | None = None
    local_steps: int | None = field(default=None, metadata=OMIT)
    extra: dict[str, Any] = field(default_factory=dict, metadata=FLATTEN)


#: every kind of line, by its ``record`` value
LINE_KINDS: dict[str, type[Line]] = {
    cls.KIND: cls
    for cls in (HeaderLine, StepLine, LocalStepLine, DecisionLine, SharesLine, HangLine, ResumeLine, EndLine)
}


def _json_types(tp: Any) -> tuple[type, ...]:
    """The JSON value types (as ``json.loads`` gives them) a Python annotation admits."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return tuple(t for member in typing.get_args(tp) for t in _json_types(member))
    if tp is type(None):
        return (type(None),)
    if tp is float:
        return (int, float)  # JSON writes 2.0 as 2.0, but a hand-made line may say 2
    if origin is list or tp is list:
        return (list,)
    if origin is dict or tp is dict or (isinstance(tp, type) and issubclass(tp, RankColumns)):
        return (dict,)
    return (tp,)


def json_fields(cls: type[Any]) -> tuple[dict[str, tuple[type, ...]], dict[str, tuple[type, ...]]]:
    """``(required, optional)``: the JSON key -> accepted JSON types of a line class (or of
    :class:`RankColumns`); flattened fields are not keys of their own."""
    hints = typing.get_type_hints(cls)
    required: dict[str, tuple[type, ...]] = {}
    optional: dict[str, tuple[type, ...]] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("flatten"):
            continue
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        (optional if has_default else required)[_key(f.name)] = _json_types(hints[f.name])
    return required, optional


def as_mapping(line: Line | Mapping[str, Any]) -> Mapping[str, Any]:
    """A line object, or a mapping already in JSON form, as the JSON object to write."""
    return line.to_json() if isinstance(line, Line) else line
