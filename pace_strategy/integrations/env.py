"""Where an adapter's configuration and run directory come from, one rule for every integration.

- :func:`as_pacing_config`: a ``pacing=`` argument (a config, a mapping of its fields, or ``None``).
- :func:`runs_alone`: the single-process rule (no session, unless a record is asked for and can be made).
- :func:`record_dir`: the run record's directory: an explicit ``run_dir`` > the framework's log
  directory > ``$PACE_RUN_DIR`` > the adapter's fallback (none for Lightning and Fabric, whose runs
  without a logger write no log files; ``./pace_runs/<date-time>`` for Accelerate and plain PyTorch).

The ``PACE_*`` environment contract: how a PacingConfig and the run directory reach the workers.

One variable per :class:`~pace_strategy.core.config.PacingConfig` field, upper-cased
(``max_delay_ms`` -> ``PACE_MAX_DELAY_MS``). A switch is ``1``/``0`` or ``true``/``false``; any other
value is read as JSON (``20``, ``7.5``, ``"monitor"``) and, when it is not JSON, as the text itself
(``monitor``); then it takes the same
type-hint conversion and validation as a YAML recipe (:func:`pace_strategy.settings.build`).
``pace launch`` writes them (:func:`config_to_env`); ``attach_pacing`` reads them
(:func:`config_from_env`); plain ``accelerate launch`` with the variables set by hand works the same.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import time
import typing
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeAlias

from pace_strategy.core.config import GROUPS, SWITCHED_GROUPS, PacingConfig, check_known_keys
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.settings import build

log = logging.getLogger(__name__)

__all__ = [
    "ENV_PREFIX",
    "NON_CONFIG_ENV",
    "RUN_DIR_ENV",
    "PacingArg",
    "as_pacing_config",
    "config_from_env",
    "config_to_env",
    "default_run_dir",
    "env_fields",
    "env_name",
    "logger_record_dir",
    "record_dir",
    "run_dir_from_env",
    "runs_alone",
]

#: What an adapter's ``pacing=`` takes: a config, a mapping of its fields, or None for the defaults.
PacingArg: TypeAlias = "PacingConfig | Mapping[str, Any] | None"

ENV_PREFIX = "PACE_"
#: The run record's directory when neither ``attach_pacing(run_dir=...)`` nor the Accelerator says one.
RUN_DIR_ENV = "PACE_RUN_DIR"
#: ``PACE_*`` variables that are not config fields (read elsewhere; allowed next to the fields).
NON_CONFIG_ENV = ("PACE_HOSTNAME", "PACE_LOG_LEVEL", RUN_DIR_ENV, "PACE_CONFIG_SOURCE")


def env_name(field: str) -> str:
    """``max_delay_ms`` -> ``PACE_MAX_DELAY_MS``; a group's field ``rebalance.quantum`` ->
    ``PACE_REBALANCE__QUANTUM`` (two underscores for the dot)."""
    return ENV_PREFIX + field.replace(".", "__").upper()


def env_fields() -> dict[str, str]:
    """Every variable the contract reads -> the field it sets (``name`` or ``group.name``)."""
    out = {env_name(name): name for name in PacingConfig.dotted_fields()}
    # a bare switch stands for the group's ``enabled`` (``PACE_REBALANCE=1``)
    out.update((env_name(group), f"{group}.enabled") for group in SWITCHED_GROUPS)
    return out


def _config(values: Mapping[str, Any]) -> PacingConfig:
    values = PacingConfig.normalize_mapping(values)
    check_known_keys(values, PacingConfig.field_names(), "pacing config field")
    return build(PacingConfig, values)


def config_to_env(values: Mapping[str, Any]) -> dict[str, str]:
    """``{"max_delay_ms": 20, "rebalance": {"quantum": 4}}`` -> ``{"PACE_MAX_DELAY_MS": "20",
    "PACE_REBALANCE__QUANTUM": "4"}``, validated first (strings as they are, everything else as
    JSON), so that :func:`config_from_env` reads back the same config."""
    nested = PacingConfig.normalize_mapping(values)
    _config(nested)
    out: dict[str, str] = {}
    for key, value in nested.items():
        if key in GROUPS and isinstance(value, Mapping):
            out.update((env_name(f"{key}.{k}"), _encode(v)) for k, v in value.items())
        else:
            out[env_name(key)] = _encode(value)
    return out


def _encode(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


#: how a switch is spelled in an environment variable (``PACE_RUN_RECORD=0``)
_SWITCH_WORDS = {"1": True, "0": False, "true": True, "false": False}


def _decode(field: str, text: str) -> Any:
    """``text`` of the variable for ``field`` (``name`` or ``group.name``) as the value it means."""
    group, _, name = field.rpartition(".")
    hints = typing.get_type_hints(GROUPS[group] if group else PacingConfig)
    if hints[name] is bool:
        return _SWITCH_WORDS.get(text.strip().lower(), text)  # another word: validation names it
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: thousands of nested brackets
        return text  # a bare word (``monitor``): the field's validation decides


def config_from_env(environ: Mapping[str, str] | None = None) -> PacingConfig | None:
    """The PacingConfig described by ``PACE_*`` variables, or ``None`` when none is set.

    An unknown ``PACE_*`` variable is ignored with a warning naming the nearest valid one (another
    tool may use the prefix); an invalid value is an error naming the variable, the text received and
    what the field allows.
    """
    environ = os.environ if environ is None else environ
    fields = env_fields()
    names = []
    for k in sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in NON_CONFIG_ENV):
        if k in fields:
            names.append(k)
            continue
        # another tool's variable may share the prefix: it must not stop training from starting
        hint = difflib.get_close_matches(k, list(fields), n=1)
        warnings.warn(
            f"pace_strategy ignores the environment variable {k}: no setting has that name."
            + (f" Did you mean {hint[0]!r}?" if hint else "")
            + " (docs/configuration.md lists every setting and its variable)",
            stacklevel=2,
        )
    if not names:
        return None
    field_of = {n: fields[n] for n in names}  # the field each variable sets
    values: dict[str, Any] = {}
    for n in names:
        field = field_of[n]
        group, _, name = field.rpartition(".")
        target = values.setdefault(group, {}) if group else values
        if name in target:
            both = [k for k in names if field_of[k] == field]
            raise PacingConfigError(
                f"environment variables {', '.join(both)} all set {field}: keep {env_name(field)} only."
            )
        target[name] = _decode(field, environ[n])
    try:
        return _config(values)
    except PacingConfigError as error:
        named = [n for n in names if re.search(rf"\b{re.escape(field_of[n])}\b", str(error))]
        where = ", ".join(f"{n}={environ[n]!r}" for n in named or names)
        raise PacingConfigError(f"environment variable {where}: {error}") from None


def run_dir_from_env(environ: Mapping[str, str] | None = None) -> Path | None:
    """``$PACE_RUN_DIR``, or ``None`` when unset or empty."""
    value = (os.environ if environ is None else environ).get(RUN_DIR_ENV)
    return Path(value) if value else None


def as_pacing_config(pacing: PacingArg) -> PacingConfig:
    """Validate an adapter's ``pacing=`` argument into a :class:`PacingConfig`."""
    if pacing is None:
        return PacingConfig()
    if isinstance(pacing, PacingConfig):
        return pacing
    if isinstance(pacing, Mapping):
        return PacingConfig.from_dict(pacing)
    raise PacingConfigError(
        f"pacing={pacing!r} is invalid: expected a PacingConfig, a mapping of its fields, or None."
    )


def runs_alone(
    world_size: int, run_dir: str | os.PathLike[str] | None, *, record_alone: bool, runs_as: str
) -> bool:
    """The one single-process rule of every adapter: one process has no skew to monitor, so no session
    is started (``True``: the adapter runs ``runs_as`` says), unless the adapter can record a single
    process (``record_alone``: a model DDP wraps on one process, as Lightning does) and a run
    directory is asked for (``run_dir`` or ``$PACE_RUN_DIR``)."""
    if world_size >= 2:
        return False
    if record_alone and (run_dir is not None or run_dir_from_env() is not None):
        return False
    hint = f" (pass run_dir= or set {RUN_DIR_ENV} for a run record anyway)" if record_alone else ""
    log.info("pace_strategy: a single process has no skew to monitor; %s%s", runs_as, hint)
    return True


def record_dir(
    explicit: str | os.PathLike[str] | None,
    framework_dir: str | os.PathLike[str] | None,
    fallback: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> Path | None:
    """The run record's directory: ``explicit`` (the adapter's ``run_dir=``) > ``framework_dir`` (where
    the framework writes its own logs) > ``$PACE_RUN_DIR`` > ``fallback``. Explicit arguments beat
    the environment; nothing is created here."""
    for value in (explicit, framework_dir):
        if value is not None and os.fspath(value):
            return Path(value)
    from_env = run_dir_from_env(environ)
    return from_env if from_env is not None else fallback


def logger_record_dir(explicit: str | os.PathLike[str] | None, logger: Any | None) -> Path | None:
    """The run record's directory for an adapter whose framework logs through a logger (Lightning,
    Fabric): ``explicit`` > the logger's ``log_dir`` > ``$PACE_RUN_DIR`` > :func:`default_run_dir`
    when the logger keeps no directory of its own (``WandbLogger``, ``MLFlowLogger``: said once, at
    warning level, with the path); no record without a logger (``logger=False``), as the framework
    then writes no files either."""
    found = record_dir(explicit, getattr(logger, "log_dir", None))
    if found is None and logger is not None:
        found = default_run_dir()
        log.warning(
            "pace_strategy: %s keeps no log directory; the run record goes to %s (run_dir= or "
            "$PACE_RUN_DIR choose another)",
            type(logger).__name__,
            found,
        )
    return found


def default_run_dir() -> Path:
    """``./pace_runs/<date-time>``: where a run record goes when nothing says where (Accelerate, plain
    PyTorch, a Lightning or Fabric logger without a directory)."""
    return Path.cwd() / "pace_runs" / time.strftime("%Y%m%d-%H%M%S")
