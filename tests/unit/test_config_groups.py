"""The nested config groups (``hang``, ``rebalance``, ``gc_sync``): every way in reads the same field,
and a name that is no field (a flat ``rebalance_quantum``) fails naming the nearest one."""

from __future__ import annotations

import warnings

import pytest

from pace_strategy import GcSyncConfig, HangConfig, PacingConfig, RebalanceConfig
from pace_strategy.core.config import recorded_switch
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.integrations.env import as_pacing_config, config_from_env, config_to_env
from pace_strategy.settings import build, load_mapping

WANT = PacingConfig(
    rebalance=RebalanceConfig(enabled=True, quantum=4),
    gc_sync=GcSyncConfig(enabled=True, freeze=True),
    hang=HangConfig(timeout_s=60.0),
)


def _quiet(make):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spellings warn about nothing
        return make()


def test_every_new_spelling_gives_the_same_config(tmp_path):
    nested = {"rebalance": {"enabled": True, "quantum": 4}, "gc_sync": {"enabled": True, "freeze": True}}
    nested["hang"] = {"timeout_s": 60.0}
    assert _quiet(lambda: PacingConfig(**nested)) == WANT  # mappings for the groups
    assert _quiet(lambda: as_pacing_config(nested)) == WANT  # pacing={...}
    yaml = tmp_path / "pacing.yaml"
    yaml.write_text("rebalance:\n  enabled: true\n  quantum: 4\n")
    overrides = ["gc_sync.enabled=true", "gc_sync.freeze=true", "hang.timeout_s=60"]
    assert _quiet(lambda: build(PacingConfig, load_mapping(yaml, overrides))) == WANT
    env = _quiet(lambda: config_to_env(nested))
    assert env["PACE_REBALANCE__QUANTUM"] == "4" and env["PACE_HANG__TIMEOUT_S"] == "60.0"
    assert _quiet(lambda: config_from_env(env)) == WANT  # what pace launch writes reads back
    assert _quiet(lambda: config_from_env({"PACE_REBALANCE": "1", "PACE_GC_SYNC": "true"})) == PacingConfig(
        rebalance=True, gc_sync=True
    )
    # the run record's header keeps the nested form, and reads back
    assert _quiet(lambda: PacingConfig.from_dict(WANT.to_dict())) == WANT
    assert WANT.to_dict()["rebalance"]["quantum"] == 4


def test_a_flat_name_is_no_field_and_fails_naming_the_nearest():
    with pytest.raises(PacingConfigError, match=r"Unknown PacingConfig argument 'rebalance_quantum'"):
        PacingConfig(rebalance_quantum=4)
    with pytest.raises(PacingConfigError, match=r"Unknown pacing config field 'gc_sync_freeze'"):
        as_pacing_config({"gc_sync_freeze": True})
    # a variable is warned about and ignored (another tool may share the prefix)
    with pytest.warns(UserWarning, match=r"PACE_HANG_TIMEOUT_S.*Did you mean 'PACE_HANG__TIMEOUT_S'"):
        config_from_env({"PACE_HANG_TIMEOUT_S": "60"})
    with pytest.raises(PacingConfigError, match=r"Unknown pacing config field 'rebalance_quantum'"):
        PacingConfig.from_dict({"rebalance": True, "rebalance_quantum": 4})
    assert recorded_switch(WANT.to_dict(), "gc_sync") and not recorded_switch({}, "rebalance")


def test_a_misspelled_field_fails_naming_it():
    with pytest.raises(PacingConfigError, match=r"rebalance\.quantm.*Did you mean 'rebalance\.quantum'"):
        PacingConfig(rebalance={"quantm": 4})
    with pytest.raises(PacingConfigError, match=r"pacing\.rebalance\.quantm"):
        build(PacingConfig, {"rebalance": {"quantm": 4}}, "pacing.")
    with pytest.warns(UserWarning, match=r"PACE_REBALANCE__QUANTM.*PACE_REBALANCE__QUANTUM"):
        config_from_env({"PACE_REBALANCE__QUANTM": "4"})
    with pytest.raises(
        PacingConfigError, match=r"PacingConfig\.gc_sync=3 is invalid: expected a GcSyncConfig"
    ):
        PacingConfig(gc_sync=3)
    with pytest.raises(PacingConfigError, match=r"environment variable PACE_HANG__ACTION='kill'"):
        config_from_env({"PACE_HANG__ACTION": "kill"})
