"""``pace env``: the versions, devices and backends of this environment, and the configuration the
``PACE_*`` variables put in force, each setting with where its value came from."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json

import torch

from pace_strategy.apps.environment import report
from pace_strategy.cli import main
from pace_strategy.core.config import PacingConfig

ENV = {"PACE_MODE": "monitor", "PACE_REBALANCE": "1", "PACE_REBALANCE__QUANTUM": "4", "PACE_FOO": "1"}


def test_each_setting_says_where_its_value_came_from():
    config = report(ENV)["configuration"]
    assert config["mode"] == {"value": "monitor", "from": "PACE_MODE", "variable": "PACE_MODE"}
    assert (
        config["rebalance.enabled"]["value"] is True
        and config["rebalance.enabled"]["from"] == "PACE_REBALANCE"
    )
    assert config["rebalance.quantum"] == {
        "value": 4, "from": "PACE_REBALANCE__QUANTUM", "variable": "PACE_REBALANCE__QUANTUM"
    }  # fmt: skip
    assert config["gain"] == {"value": PacingConfig().gain, "from": "default", "variable": "PACE_GAIN"}
    assert set(config) - {"(ignored)"} == set(PacingConfig.dotted_fields())
    (ignored,) = config["(ignored)"]["value"]
    assert "PACE_FOO" in ignored


def test_versions_and_backends_are_this_environment_s():
    data = report({})
    assert data["packages"]["torch"] == importlib.metadata.version("torch") == torch.__version__
    assert data["packages"]["numpy"] == importlib.metadata.version("numpy")
    assert data["devices"]["backends"]["gloo"] is True
    assert data["devices"]["cuda_available"] is torch.cuda.is_available()
    assert "(ignored)" not in data["configuration"]


def test_the_command_prints_json_and_text():
    for argv, check in ((["env", "--json"], json.loads), (["env"], str)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(argv) == 0
        assert check(out.getvalue())
    assert "configuration in force" in out.getvalue() and "torch" in out.getvalue()


def _run(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def test_pace_config_lists_every_setting_with_the_variable_the_environment_reads():
    from pace_strategy.integrations.env import config_from_env

    rows = json.loads(_run(["config", "--json"]))
    assert [r["name"] for r in rows] == list(PacingConfig.dotted_fields())
    defaults = PacingConfig().to_dict()
    for row in rows:
        group, _, leaf = row["name"].rpartition(".")
        assert row["default"] == (defaults[group][leaf] if group else defaults[row["name"]])
        assert row["doc"], row["name"]  # every setting says what it means
    # the variable named is the one that sets it: a changed value read back through the environment
    by_name = {r["name"]: r for r in rows}
    quantum = by_name["rebalance.quantum"]["variable"]
    assert config_from_env({quantum: "8"}).rebalance.quantum == 8
    switch = by_name["rebalance.enabled"]["variable"].split(" or ")[-1]
    assert switch == "PACE_REBALANCE" and config_from_env({switch: "1"}).rebalance.enabled is True
    text = _run(["config", "hang"])  # a group's name selects its settings
    assert "hang.timeout_s" in text and "PACE_HANG__TIMEOUT_S" in text and "rebalance." not in text


def test_pace_config_names_the_nearest_setting_for_a_misspelt_one(capsys):
    try:
        main(["config", "rebalanse"])
    except SystemExit as stop:
        assert stop.code == 2
    else:
        raise AssertionError("an unknown setting must fail")
    assert "Did you mean 'rebalance'" in capsys.readouterr().err
