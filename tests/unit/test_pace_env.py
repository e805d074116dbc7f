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
