"""The nested config groups (``hang``, ``rebalance``, ``gc_sync``) and the flat names of earlier
versions: every way in reads the same field, the old ways with a DeprecationWarning naming the new key."""

from __future__ import annotations

import contextlib
import warnings

import pytest

from pace_strategy import GcSyncConfig, HangConfig, PacingConfig, RebalanceConfig
from pace_strategy.core.config import FLAT_NAMES, recorded_switch
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.integrations.env import as_pacing_config, config_from_env, config_to_env
from pace_strategy.settings import build, load_mapping

WANT = PacingConfig(
    rebalance=RebalanceConfig(enabled=True, quantum=4),
    gc_sync=GcSyncConfig(enabled=True, freeze=True),
    hang=HangConfig(timeout_s=60.0),
)


@contextlib.contextmanager
def _warns(text):
    """Every DeprecationWarning of the block is caught; one of them says ``text``."""
    with pytest.warns(DeprecationWarning) as caught:
        yield
    assert any(text in str(w.message) for w in caught), [str(w.message) for w in caught]


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


def test_the_flat_names_of_earlier_versions_still_work_and_name_the_new_key(tmp_path):
    flat = {"rebalance": True, "rebalance_quantum": 4, "gc_sync": True, "gc_sync_freeze": True}
    flat["hang_timeout_s"] = 60.0
    with _warns("rebalance_quantum is deprecated; use rebalance.quantum"):
        assert PacingConfig(**flat) == WANT
    with _warns("gc_sync_freeze is deprecated; use gc_sync.freeze"):
        assert as_pacing_config(flat) == WANT
    with pytest.warns(DeprecationWarning) as caught:  # pace launch's writer: one warning per name
        assert config_to_env({"rebalance_quantum": 4}) == {"PACE_REBALANCE__QUANTUM": "4"}
    assert len(caught) == 1, [str(w.message) for w in caught]
    yaml = tmp_path / "old.yaml"
    yaml.write_text("rebalance: true\nrebalance_quantum: 4\ngc_sync: true\ngc_sync_freeze: true\n")
    with _warns("hang_timeout_s is deprecated; use hang.timeout_s"):
        assert build(PacingConfig, load_mapping(yaml, ["hang_timeout_s=60"])) == WANT
    env = {
        "PACE_REBALANCE": "1",
        "PACE_REBALANCE_QUANTUM": "4",
        "PACE_GC_SYNC": "1",
        "PACE_GC_SYNC_FREEZE": "1",
    }
    env["PACE_HANG_TIMEOUT_S"] = "60"
    with pytest.warns(
        DeprecationWarning, match="PACE_REBALANCE_QUANTUM is deprecated; use PACE_REBALANCE__QUANTUM"
    ):
        assert config_from_env(env) == WANT
    with _warns("PacingConfig.hang_timeout_s is deprecated"):
        assert WANT.hang_timeout_s == 60.0  # reading the old attribute
    # a record written before the nesting: read without a warning
    old_header = {"mode": "adaptive", "rebalance": True, "rebalance_quantum": 4, "gc_sync": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert PacingConfig.from_dict(old_header, warn=False).rebalance.quantum == 4
    assert recorded_switch(old_header, "rebalance") and not recorded_switch(old_header, "gc_sync")
    assert recorded_switch(WANT.to_dict(), "gc_sync") and not recorded_switch({}, "rebalance")
    assert set(FLAT_NAMES) >= {"rebalance_quantum", "gc_sync_freeze", "hang_timeout_s", "hang_action"}


def test_a_field_set_both_ways_or_misspelled_fails_naming_it():
    both = r"rebalance_quantum=4 and rebalance\.quantum=8 both set"
    with pytest.raises(PacingConfigError, match=both), pytest.warns(DeprecationWarning):
        PacingConfig(rebalance={"quantum": 8}, rebalance_quantum=4)
    with pytest.raises(PacingConfigError, match=r"rebalance\.quantm.*Did you mean 'rebalance\.quantum'"):
        PacingConfig(rebalance={"quantm": 4})
    with pytest.raises(PacingConfigError, match=r"pacing\.rebalance\.quantm"):
        build(PacingConfig, {"rebalance": {"quantm": 4}}, "pacing.")
    with pytest.raises(PacingConfigError, match=r"PACE_REBALANCE__QUANTM.*PACE_REBALANCE__QUANTUM"):
        config_from_env({"PACE_REBALANCE__QUANTM": "4"})
    with pytest.raises(
        PacingConfigError, match=r"PacingConfig\.gc_sync=3 is invalid: expected a GcSyncConfig"
    ):
        PacingConfig(gc_sync=3)
    with pytest.raises(PacingConfigError, match=r"environment variable PACE_HANG__ACTION='kill'"):
        config_from_env({"PACE_HANG__ACTION": "kill"})
