"""The PACE_* contract: what `pace launch` writes, the workers read back, through the recipes' converter."""

from __future__ import annotations

import pytest

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.integrations.env import (
    NON_CONFIG_ENV,
    config_from_env,
    config_to_env,
    run_dir_from_env,
)

pytestmark = pytest.mark.timeout(30)


def test_config_to_env_round_trips():
    values = {"mode": "forced", "max_delay_ms": 20, "run_record": False, "exchange_every_steps": 4}
    env = config_to_env(values)
    assert env == {
        "PACE_MODE": "forced",
        "PACE_MAX_DELAY_MS": "20",
        "PACE_RUN_RECORD": "false",
        "PACE_EXCHANGE_EVERY_STEPS": "4",
    }
    assert config_from_env(env) == PacingConfig(**values)
    assert isinstance(config_from_env(env).max_delay_ms, float)  # the type hint converts int -> float


def test_values_are_json_or_the_bare_text():
    cfg = config_from_env({"PACE_MODE": '"monitor"', "PACE_MIN_DELAY_MS": "1e-3", "PACE_RUN_RECORD": "true"})
    assert cfg.mode == "monitor" and cfg.min_delay_ms == 0.001 and cfg.run_record is True
    assert config_from_env({"PACE_DDP_MONITOR": "comm_hook"}).ddp_monitor == "comm_hook"


def test_only_pace_config_variables_count():
    assert config_from_env({"PATH": "/bin"}) is None
    assert config_from_env(dict.fromkeys(NON_CONFIG_ENV, "x")) is None


@pytest.mark.parametrize(("text", "value"), [("1", True), ("0", False), ("True", True), ("false", False)])
def test_a_switch_is_one_zero_true_or_false(text, value):
    assert config_from_env({"PACE_RUN_RECORD": text}).run_record is value


def test_an_unknown_variable_is_ignored_with_a_warning_suggesting_the_nearest():
    """Another tool's ``PACE_*`` variable must not stop training from starting; a typo of ours is
    named with the setting it was probably meant for."""
    with pytest.warns(
        UserWarning, match="ignores the environment variable PACE_MAX_DELAY.*Did you mean 'PACE_MAX_DELAY_MS'"
    ):
        assert config_from_env({"PACE_MAX_DELAY": "3"}) is None
    with pytest.warns(UserWarning, match="PACE_API_TOKEN"):
        assert config_from_env({"PACE_API_TOKEN": "x", "PACE_MODE": "monitor"}).mode == "monitor"


@pytest.mark.parametrize(
    ("env", "named", "expected"),
    [
        ({"PACE_EXCHANGE_EVERY_STEPS": "x"}, "PACE_EXCHANGE_EVERY_STEPS='x'", "an integer >= 1"),
        ({"PACE_EXCHANGE_EVERY_STEPS": "2.5"}, "PACE_EXCHANGE_EVERY_STEPS='2.5'", "an integer >= 1"),
        ({"PACE_RUN_RECORD": "yes", "PACE_GAIN": "0.2"}, "PACE_RUN_RECORD='yes'", "true or false"),
        ({"PACE_MODE": "fast"}, "PACE_MODE='fast'", "one of 'adaptive', 'monitor', 'forced'"),
    ],
)
def test_a_bad_value_names_the_variable_and_what_is_allowed(env, named, expected):
    with pytest.raises(PacingConfigError) as caught:
        config_from_env(env)
    message = str(caught.value)
    assert message.startswith(f"environment variable {named}:") and expected in message
    assert "PACE_GAIN" not in message


def test_a_cross_field_error_names_both_variables():
    env = {"PACE_MIN_DELAY_MS": "9", "PACE_MAX_DELAY_MS": "3", "PACE_MODE": "monitor"}
    with pytest.raises(PacingConfigError, match="PACE_MAX_DELAY_MS='3', PACE_MIN_DELAY_MS='9'"):
        config_from_env(env)


def test_config_to_env_validates_before_writing():
    with pytest.raises(PacingConfigError, match="Did you mean 'max_delay_ms'"):
        config_to_env({"max_delay": 5})
    with pytest.raises(PacingConfigError, match=r"PacingConfig\.gain='high'"):
        config_to_env({"gain": "high"})


def test_run_dir_variable():
    assert run_dir_from_env({"PACE_RUN_DIR": "/tmp/r"}).as_posix() == "/tmp/r"
    assert run_dir_from_env({"PACE_RUN_DIR": ""}) is None and run_dir_from_env({}) is None
