"""YAML recipes and dotlist overrides into typed, frozen dataclass trees (omegaconf only loads).

Unknown keys are errors that suggest the nearest valid key and give the full dotted path.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pace_strategy.core.config import check_known_keys
from pace_strategy.core.errors import PacingConfigError

__all__ = ["build", "load_mapping"]

T = TypeVar("T")


def load_mapping(path: str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """YAML file (optional) merged with ``key.sub=value`` overrides, as plain containers."""
    from omegaconf import OmegaConf

    base = OmegaConf.load(os.fspath(path)) if path is not None else OmegaConf.create({})
    for item in overrides:
        if "=" not in item:
            raise PacingConfigError(
                f"override {item!r} is invalid: expected key=value (dotted keys for nested fields, "
                "e.g. compute.base_ms=90)"
            )
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
    container = OmegaConf.to_container(merged, resolve=True)
    if not isinstance(container, dict):
        raise PacingConfigError(f"{path}: expected a mapping at the top level")
    return typing.cast(dict[str, Any], container)


def build(cls: type[T], values: Mapping[str, Any] | None, where: str = "") -> T:
    """Build dataclass ``cls`` from ``values``, recursing into nested dataclass fields."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    check_known_keys(values, list(fields), "key", prefix=where)
    for key, value in values.items():
        kwargs[key] = _convert(hints[key], value, where + key)
    try:
        return cls(**kwargs)
    except TypeError as error:
        raise PacingConfigError(f"{where or cls.__name__}: {error}") from error


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            raise PacingConfigError(f"{where} must be a mapping of {tp.__name__} fields, got {value!r}")
        return build(tp, value, where + ".")
    if origin in (tuple, Sequence) or tp is tuple:
        if isinstance(value, (int, float)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise PacingConfigError(f"{where} must be a list, got {value!r}")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        return tuple(_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(members[0], value, where) if len(members) == 1 else value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value
