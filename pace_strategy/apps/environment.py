"""``pace env``: what a bug report needs to know about this environment, in one command.

The versions of pace_strategy, Python and every package it uses (``-`` when not installed, with the
extra that installs it), the devices and the distributed backends torch sees (CUDA and NCCL where
there are), and the pacing configuration the ``PACE_*`` variables put in force here, each setting
with where its value came from (the variable, or the default). ``--json`` for one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from pace_strategy._imports import EXTRAS
from pace_strategy._version import __version__

__all__ = ["PACKAGES", "main", "report"]

#: the distributions reported, by import name where it differs (core first, then the extras')
PACKAGES = ("torch", "numpy", "omegaconf", "lightning", "pytorch_lightning", "accelerate", "transformers",
            "tensorboard", "matplotlib", "prometheus_client", "pyarrow")  # fmt: skip

_DISTRIBUTION = {"pytorch_lightning": "pytorch-lightning", "prometheus_client": "prometheus-client"}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(_DISTRIBUTION.get(name, name))
    except importlib.metadata.PackageNotFoundError:
        return None


def _devices() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    out: dict[str, Any] = {
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
        "backends": {
            name: bool(getattr(dist, f"is_{name}_available", lambda: False)())
            for name in ("gloo", "nccl", "mpi", "ucc")
        },
        "intra_op_threads": torch.get_num_threads(),
    }
    if cuda and out["backends"]["nccl"]:
        out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def _configuration(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Every setting -> its value in force here and where it came from."""
    from pace_strategy.core.config import PacingConfig
    from pace_strategy.integrations.env import config_from_env, env_fields, env_name

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = config_from_env(environ) or PacingConfig()
    # the variable that set each field (a group's bare switch sets its ``enabled``): the contract's map
    source = {field: variable for variable, field in env_fields().items() if variable in environ}
    out: dict[str, dict[str, Any]] = {
        name: {"value": value, "from": source.get(name, "default"), "variable": env_name(name)}
        for name, value in config.dotted_values().items()
    }
    if caught:
        out["(ignored)"] = {"value": [str(w.message) for w in caught], "from": "environment", "variable": ""}
    return out


def report(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The environment as one mapping (what ``pace env --json`` prints)."""
    import os

    environ = os.environ if environ is None else environ
    return {
        "pace_strategy": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "devices": _devices(),
        "configuration": _configuration(environ),
    }


def _text(data: Mapping[str, Any]) -> str:
    lines = [f"pace_strategy {data['pace_strategy']}, Python {data['python']}, {data['platform']}", ""]
    lines.append("packages:")
    for name, version in data["packages"].items():
        hint = (
            f"  (pip install 'pace-strategy[{EXTRAS[name]}]')" if version is None and name in EXTRAS else ""
        )
        lines.append(f"  {name:<18} {version or '-'}{hint}")
    devices = data["devices"]
    lines += ["", "devices and backends:"]
    cuda = ", ".join(devices["cuda_devices"]) or "none"
    available = f"available: {devices['cuda_available']}; {cuda}"
    lines.append(f"  CUDA               {devices['cuda_version'] or '-'} ({available})")
    if "nccl_version" in devices:
        lines.append(f"  NCCL               {devices['nccl_version']}")
    lines.append("  backends           " + ", ".join(k for k, v in devices["backends"].items() if v))
    lines.append(f"  intra-op threads   {devices['intra_op_threads']}")
    lines += ["", "configuration in force (PACE_* variables, else defaults):"]
    for name, entry in data["configuration"].items():
        if name == "(ignored)":
            lines += [f"  ignored: {message}" for message in entry["value"]]
            continue
        lines.append(f"  {name:<32} {json.dumps(entry['value']):<14} {entry['from']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pace env",
        description="Versions, devices, backends and the pacing configuration in force, with where each "
        "setting came from: paste it into a bug report.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    data = report()
    print(json.dumps(data, indent=2) if args.json else _text(data))
    return 0
