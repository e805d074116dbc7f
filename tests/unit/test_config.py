import pytest

from pace_strategy import PacingConfig, PacingConfigError
from pace_strategy.integrations.lightning import PacedDDPStrategy


def test_defaults_are_valid_and_documented():
    cfg = PacingConfig()
    assert cfg.mode == "adaptive"
    docs = PacingConfig.field_docs()
    assert set(docs) == set(PacingConfig.field_names())
    assert all(len(text) > 20 for text in docs.values()), "every field needs a real docstring"


@pytest.mark.parametrize(
    ("changes", "field", "allowed"),
    [
        ({"max_delay_ms": -1.0}, "max_delay_ms", ">= 0"),
        ({"exchange_every_steps": 0}, "exchange_every_steps", ">= 1"),
        ({"exchange_every_steps": 2.5}, "exchange_every_steps", "an integer"),
        ({"gain": 1.5}, "gain", "<= 1"),
        ({"gain": 0.0}, "gain", "> 0"),
        ({"mode": "fast"}, "mode", "'adaptive'"),
        ({"ddp_monitor": "buckets"}, "ddp_monitor", "'grad_ready', 'comm_hook'"),
        ({"max_delay_ms": float("nan")}, "max_delay_ms", "finite"),
        ({"warmup_steps": True}, "warmup_steps", "an integer"),
        ({"cooldown_growth": 0.5}, "cooldown_growth", ">= 1"),
    ],
)
def test_bad_values_name_the_field_the_value_and_what_is_allowed(changes, field, allowed):
    with pytest.raises(PacingConfigError) as info:
        PacingConfig(**changes)
    message = str(info.value)
    assert f"PacingConfig.{field}=" in message
    assert repr(next(iter(changes.values()))) in message
    assert allowed in message
    assert "Fix:" in message


def test_hysteresis_order_is_checked():
    with pytest.raises(PacingConfigError, match="deactivate_skew_fraction"):
        PacingConfig(activate_skew_fraction=0.05, deactivate_skew_fraction=0.2)


def test_growing_cooldown_bound_is_checked():
    with pytest.raises(PacingConfigError, match="max_cooldown_windows"):
        PacingConfig(cooldown_windows=16, max_cooldown_windows=8)


def test_unknown_key_suggests_the_nearest_field():
    with pytest.raises(PacingConfigError) as info:
        PacingConfig.from_dict({"max_delay": 5})
    assert "'max_delay'" in str(info.value)
    assert "Did you mean 'max_delay_ms'?" in str(info.value)


def test_from_dict_round_trips():
    cfg = PacingConfig.from_dict({"mode": "monitor", "exchange_every_steps": 8})
    assert cfg.mode == "monitor" and cfg.exchange_every_steps == 8
    assert PacingConfig.from_dict(cfg.to_dict()) == cfg
    assert PacingConfig.from_dict(None) == PacingConfig()


def test_strategy_validates_at_construction_before_any_process_starts():
    with pytest.raises(PacingConfigError, match="exchange_every_steps"):
        PacedDDPStrategy(pacing={"exchange_every_steps": 0})
    with pytest.raises(PacingConfigError, match="Did you mean 'gain'"):
        PacedDDPStrategy(pacing={"gian": 0.5})
    strategy = PacedDDPStrategy(pacing=PacingConfig(max_delay_ms=5))
    assert strategy.pacing_config.max_delay_ms == 5
