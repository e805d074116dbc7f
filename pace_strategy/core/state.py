"""The checkpointable pacing state: its version, its error type and the checks every component shares.

What a checkpoint holds for pace_strategy is plain JSON-able data (dicts, lists, str, int, float,
bool, None), so that any framework's checkpoint format stores it as it is and a person can read it:

.. code-block:: text

    {"version": 1,                      # STATE_VERSION of the envelope
     "step": 20,                        # global steps completed when the state was taken
     "world_size": 2,
     "components": {                    # the extension point: one entry per named component
         "pacer": {"version": 1, "window": 5, "policy": {...}},   # Pacer.state_dict()
         # "rebalance": {...}           # e.g. a later component's shares and sampler position
     }}

A component is any object with ``state_dict() -> dict`` and ``load_state_dict(dict)``
(:class:`StatefulComponent`), registered by name in the session's :class:`StateRegistry`
(:meth:`pace_strategy.session.PacingSession.register_state`). Every component's state is identical on
every rank when it is taken, because every decision it holds is taken identically on every rank from
the same gathered data; a restore therefore needs no collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pace_strategy.core.errors import PacingConfigError

__all__ = [
    "CHECKPOINT_KEY",
    "STATE_VERSION",
    "PacingStateError",
    "Resumed",
    "StateRegistry",
    "StatefulComponent",
    "check_state",
]

log = logging.getLogger(__name__)

#: version of the state layout this pace_strategy writes and reads (the envelope and each component)
STATE_VERSION = 1
#: the key under which the adapters store the state in a framework checkpoint (Lightning's dict)
CHECKPOINT_KEY = "pace_strategy"


class PacingStateError(PacingConfigError):
    """A saved pacing state cannot be restored: a newer or unknown version, a missing or mistyped field,
    or a state taken with another world size. The message names the field and what to do."""


class StatefulComponent(Protocol):
    """What the session checkpoints: plain JSON-able data out, the same data back in."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def check_state(state: object, what: str, fields: Mapping[str, type | tuple[type, ...]]) -> Mapping[str, Any]:
    """``state`` as a mapping, once its ``version`` is one this pace_strategy reads and every field of
    ``fields`` is there with its type; else a :class:`PacingStateError` naming ``what`` and the field."""
    if not isinstance(state, Mapping):
        raise PacingStateError(f"{what} is {type(state).__name__}, not a mapping: not a pace_strategy state")
    version = state.get("version")
    if type(version) is not int:
        raise PacingStateError(
            f"{what} has no integer 'version' (got {version!r}): not a pace_strategy state"
        )
    if version > STATE_VERSION:
        raise PacingStateError(
            f"{what} has state version {version}; this pace_strategy reads up to {STATE_VERSION}. Upgrade "
            "pace_strategy to restore it (or resume without it: the controller then starts fresh)."
        )
    for key, types in fields.items():
        if key not in state:
            raise PacingStateError(
                f"{what} has no {key!r} field: the state is damaged or not pace_strategy's"
            )
        value = state[key]
        # a bool is an int to isinstance, but never a count here
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
            expected = " or ".join("null" if t is type(None) else t.__name__ for t in _as_tuple(types))
            raise PacingStateError(f"{what} field {key!r}={value!r} is not {expected}")
    return state


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


@dataclass
class Resumed:
    """What the last restore did: the step it resumed at, the components restored (a component
    registered after the restore is added when it claims its state) and those skipped, with why."""

    step: int
    source: str | None  #: the checkpoint's path, where the adapter knows it
    restored: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  #: component ("*": the whole state) -> why


class StateRegistry:
    """The named components a session checkpoints, in the envelope above (local: no collective)."""

    def __init__(
        self,
        world_size: int,
        components: Mapping[str, StatefulComponent],
        *,
        on_load: Callable[[Resumed], None] | None = None,
        announce: bool = False,
    ) -> None:
        """``on_load``: told of every restore (the run record's ``resume`` line); ``announce``: log
        what each restore did (one rank does)."""
        self.world_size = world_size
        self._on_load = on_load
        self._announce = announce
        self._components = dict(components)
        self._unclaimed: dict[str, Any] = {}  # restored states whose component is not registered yet
        self.resumed: Resumed | None = None  #: the last restore, once there was one

    def register(self, name: str, component: StatefulComponent) -> None:
        """Checkpoint ``component`` under ``name`` too. Its ``state_dict()`` must be plain JSON-able
        data, identical on every rank. A state restored before it was registered is loaded now."""
        if name in self._components:
            raise ValueError(f"a state component named {name!r} is already registered")
        self._components[name] = component
        if name in self._unclaimed:
            self._load(name, self._unclaimed.pop(name))

    def state_dict(self, step: int) -> dict[str, Any]:
        """The state after ``step`` global steps."""
        return {
            "version": STATE_VERSION,
            "step": step,
            "world_size": self.world_size,
            "components": {name: c.state_dict() for name, c in self._components.items()},
        }

    def load(
        self, state: Mapping[str, Any] | None, *, source: str | None = None, step: int | None = None
    ) -> Resumed:
        """Resume: restore what :meth:`state_dict` saved (local: every rank loads the same checkpoint).

        Never fails a resume: a state that cannot be restored (newer version, other world size,
        damaged) is skipped with a warning and the controller starts fresh; ``None`` (a checkpoint
        written without pace_strategy) restores nothing. Either way ``on_load`` is told (the run
        record gets a ``resume`` line right after its header): the step (the state's, else
        ``step``, else -1), the components restored, ``source`` (the checkpoint's path where the
        adapter knows it)."""
        saved_step = state.get("step") if isinstance(state, Mapping) else None
        self.resumed = Resumed(
            saved_step if type(saved_step) is int else (-1 if step is None else step), source
        )
        try:
            s = check_state(state, "the checkpoint's pace_strategy state", {"step": int, "components": dict})
        except PacingStateError as error:
            if state is not None:
                self.resumed.skipped["*"] = str(error)
                log.warning("pace_strategy: nothing restored from %s: %s", source or "the checkpoint", error)
        else:
            for name, component_state in s["components"].items():
                if name in self._components:
                    self._load(name, component_state)
                else:
                    self._unclaimed[name] = component_state
        if self._on_load is not None:
            self._on_load(self.resumed)
        if self._announce:
            log.info(
                "pace_strategy: resumed at step %d from %s; restored: %s",
                self.resumed.step,
                source or "a checkpoint",
                ", ".join(self.resumed.restored) or "nothing (no pace_strategy state in it)",
            )
        return self.resumed

    def _load(self, name: str, state: Any) -> None:
        resumed = self.resumed
        assert resumed is not None, "components load from a restored state"
        try:
            self._components[name].load_state_dict(state)
        except PacingStateError as error:
            resumed.skipped[name] = str(error)
            log.warning("pace_strategy: %s not restored: %s", name, error)
        else:
            resumed.restored.append(name)
