"""The strategy names resolve to the paced classes in both Lightning packages (no training here)."""

from __future__ import annotations

import pytest

import pace_strategy  # registers the strategies
from pace_strategy.integrations import lightning as adapter


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_registered_names_build_the_paced_strategies(package):
    pl = pytest.importorskip(package)
    expected = {
        "paced_ddp": "PacedDDPStrategy",
        "paced_ddp_spawn": "PacedDDPStrategy",
        "paced_fsdp": "PacedFSDPStrategy",
    }
    for name, cls in expected.items():
        trainer = pl.Trainer(
            strategy=name, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False
        )
        strategy = trainer.strategy
        assert type(strategy).__name__.endswith(cls), (name, type(strategy))
        assert strategy.pacing_config == pace_strategy.PacingConfig()
    fsdp = pl.Trainer(strategy="paced_fsdp", accelerator="cpu", devices=2, logger=False).strategy
    assert fsdp.auto_shard_min_params == 100_000 and isinstance(fsdp, pl.strategies.ModelParallelStrategy)


def test_bad_fsdp_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="auto_shard_min_params=0"):
        adapter.PacedFSDPStrategy(auto_shard_min_params=0)
    with pytest.raises(ValueError, match=r"PacingConfig\.max_delay_ms"):
        adapter.PacedFSDPStrategy(pacing={"max_delay_ms": -1})
