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
    """YAML file (optional) merged with ``key.sub=value`` overrides, as plain containers.

    A file that cannot be read or parsed, an override that omegaconf rejects and an interpolation
    that does not resolve are ``PacingConfigError`` naming the file, the override or the key.
    """
    from omegaconf import DictConfig, OmegaConf

    where = f"{os.fspath(path)}: " if path is not None else ""
    if path is None:
        merged: Any = OmegaConf.create({})
    else:
        try:
            merged = OmegaConf.load(os.fspath(path))
        except OSError as error:
            if error.errno is None:  # omegaconf's "Invalid loaded object type": a lone number or bytes
                raise PacingConfigError(
                    f"{where}expected a mapping of keys at the top level ({_reason(error)})"
                ) from error
            raise PacingConfigError(f"cannot read {os.fspath(path)}: {_reason(error)}") from error
        except _load_errors() as error:
            raise PacingConfigError(f"{where}not a valid YAML file: {_reason(error)}") from error
        if not isinstance(merged, DictConfig):
            raise PacingConfigError(f"{where}expected a mapping of keys at the top level, got a list")
    for item in overrides:
        if "=" not in item or "" in item.split("=", 1)[0].strip().split("."):
            raise PacingConfigError(
                f"override {item!r} is invalid: expected key=value (dotted keys for nested fields, "
                "e.g. compute.base_ms=90)"
            )
        try:  # one at a time, so that an error can name its override
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except _load_errors() as error:
            raise PacingConfigError(
                f"{where}override {item!r} is invalid: {_reason(error)}. Expected key=value with a YAML "
                "value (dotted keys for nested fields, e.g. compute.base_ms=90)"
            ) from error
    try:
        container = OmegaConf.to_container(merged, resolve=True)
    except _load_errors() as error:
        key = getattr(error, "full_key", None) or "a key"
        raise PacingConfigError(f"{where}{key}: cannot resolve its ${{...}}: {_reason(error)}") from error
    return typing.cast(dict[str, Any], container)


def _load_errors() -> tuple[type[Exception], ...]:
    """What omegaconf (and the YAML parser under it) raise for text it cannot take."""
    import yaml
    from omegaconf.errors import OmegaConfBaseException

    # ValueError: a non-UTF-8 file, a value YAML cannot construct; TypeError: a list merged with keys;
    # LookupError: a key omegaconf cannot parse (``[``)
    return (OmegaConfBaseException, yaml.YAMLError, ValueError, TypeError, LookupError)


def _reason(error: BaseException) -> str:
    """An exception's message on one line (YAML and omegaconf messages span several)."""
    return "; ".join(line.strip() for line in str(error).splitlines() if line.strip()) or repr(error)


def build(cls: type[T], values: Mapping[str, Any] | None, where: str = "") -> T:
    """Build dataclass ``cls`` from ``values``, recursing into nested dataclass fields.

    The class validates its fields first (its messages say what is allowed); a field it leaves
    unchecked, or one whose type breaks its checks, is checked against the field's type hint here:
    a ``PacingConfigError`` naming the dotted field.
    """
    if values is not None and not isinstance(values, Mapping):
        _wrong(where.rstrip(".") or cls.__name__, values, f"a mapping of {cls.__name__} fields")
    values = dict(values or {})
    normalize = getattr(cls, "normalize_mapping", None)
    if normalize is not None:  # e.g. PacingConfig: a bare switch for a group read as its ``enabled``
        values = normalize(values, where)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    check_known_keys(values, list(fields), "key", prefix=where)
    for key, value in values.items():
        kwargs[key] = _convert(hints[key], value, where + key)
    try:
        built = cls(**kwargs)
    except PacingConfigError:
        raise
    except (TypeError, ValueError) as error:  # e.g. "'<=' not supported between 'str' and 'int'"
        for key, value in kwargs.items():
            _check_type(hints[key], value, where + key)
        raise PacingConfigError(f"{where or cls.__name__}: {error}") from error
    for key, value in kwargs.items():
        _check_type(hints[key], value, where + key)
    return built


def _wrong(where: str, value: Any, expected: str) -> typing.NoReturn:
    raise PacingConfigError(f"{where}={value!r} is invalid: expected {expected}.")


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
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):  # before the class iterates it as one
            raise PacingConfigError(f"{where} must be a mapping of keys to values, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(members[0], value, where) if len(members) == 1 else value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            _wrong(where, value, "a finite number")
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # ``name: 2024`` in YAML, ``output.name=2024`` on the command line
    return value


def _check_type(tp: Any, value: Any, where: str) -> None:
    """Raise ``PacingConfigError`` naming ``where`` when the converted ``value`` does not fit ``tp``."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) or tp is Any:
        return  # built (and checked) by build(), or anything goes
    if origin in (tuple, Sequence) or tp is tuple:
        args = typing.get_args(tp)
        for i, v in enumerate(value):
            _check_type(args[0] if args else Any, v, f"{where}[{i}]")
    elif origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is not None and len(members) == 1:  # as _convert: ``X | None``, None allowed
            _check_type(members[0], value, where)
    elif origin is typing.Literal:
        if value not in typing.get_args(tp):
            _wrong(where, value, "one of " + ", ".join(repr(a) for a in typing.get_args(tp)))
    elif tp in _SCALARS and (not isinstance(value, tp) or (tp is not bool and isinstance(value, bool))):
        _wrong(where, value, _SCALARS[tp])


_SCALARS: dict[Any, str] = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
