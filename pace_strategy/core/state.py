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
(:class:`StatefulComponent`), registered on the session by name
(:meth:`pace_strategy.session.PacingSession.register_state`). Every component's state is identical on
every rank when it is taken, because every decision it holds is taken identically on every rank from
the same gathered data; a restore therefore needs no collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from pace_strategy.core.errors import PacingConfigError

__all__ = [
    "CHECKPOINT_KEY",
    "STATE_VERSION",
    "PacingStateError",
    "StatefulComponent",
    "check_state",
]

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
