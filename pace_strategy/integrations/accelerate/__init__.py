"""Accelerate adapter: ``attach_pacing`` on the prepared model (``attach``), the ``PACE_*`` environment
contract (``env``), and ``pace launch``, accelerate launch with a ``pacing_config:`` section (``launch``).

Names load on first use, so ``pace launch`` (``launch`` and ``env``) starts without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pace_strategy._imports import lazy_attributes

if TYPE_CHECKING:
    from pace_strategy.integrations.accelerate.attach import PacingHandle, RebalanceLoop, attach_pacing
    from pace_strategy.integrations.env import ENV_PREFIX, config_from_env, config_to_env

_WHERE = {
    "PacingHandle": "pace_strategy.integrations.accelerate.attach",
    "RebalanceLoop": "pace_strategy.integrations.accelerate.attach",
    "attach_pacing": "pace_strategy.integrations.accelerate.attach",
    **dict.fromkeys(("ENV_PREFIX", "config_from_env", "config_to_env"), "pace_strategy.integrations.env"),
}

__all__ = ["ENV_PREFIX", "PacingHandle", "RebalanceLoop", "attach_pacing", "config_from_env", "config_to_env"]

__getattr__ = lazy_attributes(__name__, _WHERE)
