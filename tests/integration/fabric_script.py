"""Run by test_fabric.py: Lightning Fabric jobs, one after another on the same processes. Writes
OUT_DIR/result_RANK.json (rank 0: each job's weights, TensorBoard dir and captured warnings).

    python fabric_script.py OUT_DIR          # 2 CPU processes (Fabric starts the second):
        plain    strategy="ddp", TensorBoard; rank 1 30 ms late per micro-batch, accumulating 2
        paced    the same with strategy="paced_ddp"
        nolog    paced_ddp without a logger: no run record
        explicit PacedFabricDDPStrategy(run_dir=..., pacing=...) with PACE_RUN_DIR set: the argument
                 wins; rank 1 late, metrics_port=$METRICS_PORT: rank 0 scrapes its own Prometheus
                 endpoint over HTTP before the end
        env      paced_ddp without a logger, PACE_RUN_DIR set: the record goes there
    python fabric_script.py OUT_DIR single   # 1 process, paced_ddp with TensorBoard: no run record
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from pace_strategy.integrations.fabric import PacedFabricDDPStrategy, finish_pacing
from pace_strategy.shutdown import leave_without_finalization

SLOW_RANK, SLOW_MS, ACCUMULATE, BATCH = 1, 30, 2, 4


def scrape(port: int) -> list[str]:
    """The ``pace_`` lines of rank 0's Prometheus endpoint, read over HTTP."""
    time.sleep(1.0)  # the telemetry thread publishes the last exchanged window
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return [line for line in response.read().decode().splitlines() if line.startswith("pace_")]


def train(fabric: Fabric, steps: int, slow: bool) -> dict[str, Any]:
    """``steps`` optimizer steps of ``ACCUMULATE`` micro-batches each, the others under
    ``fabric.no_backward_sync``; logs ``loss`` at every optimizer step. Rank 0 of a session with a
    ``metrics_port`` scrapes its endpoint before finishing."""
    fabric.seed_everything(0, verbose=False)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    data = TensorDataset(torch.randn(steps * ACCUMULATE * BATCH * fabric.world_size, 8))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=BATCH))
    step = 0
    for i, (x,) in enumerate(loader):
        accumulating = (i + 1) % ACCUMULATE != 0
        if slow and fabric.global_rank == SLOW_RANK:
            time.sleep(SLOW_MS / 1000)
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = model(x).pow(2).mean()
            fabric.backward(loss)
        if not accumulating:
            optimizer.step()
            optimizer.zero_grad()
            fabric.log_dict({"loss": loss.item()}, step=step)
            step += 1
    session = getattr(fabric.strategy, "pacing_session", None)
    port = session.config.metrics_port if session is not None else 0
    scraped = scrape(port) if port and fabric.global_rank == 0 else []
    finish_pacing(fabric)  # collective; does nothing for plain ddp
    for logger in fabric.loggers:
        logger.finalize("success")
    weights = {k: v.tolist() for k, v in net.state_dict().items()}
    return {"steps": step, "weights": weights, "scraped": scraped}


def job(out: Path, name: str, strategy: Any, steps: int, logger: bool, slow: bool = False) -> dict[str, Any]:
    loggers = TensorBoardLogger(str(out / name), name="tb") if logger else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, loggers=loggers)
        fabric.launch()
        result = train(fabric, steps, slow)
    result["log_dir"] = loggers.log_dir if loggers is not None else None
    result["warnings"] = sorted({str(w.message) for w in caught})
    result["strategy"], result["rank"] = type(fabric.strategy).__name__, fabric.global_rank
    return result


def main(out: Path) -> None:
    results = {
        "plain": job(out, "plain", "ddp", 20, logger=True, slow=True),
        "paced": job(out, "paced", "paced_ddp", 20, logger=True, slow=True),
        "nolog": job(out, "nolog", "paced_ddp", 4, logger=False),
    }
    os.environ["PACE_RUN_DIR"] = str(out / "env")
    pacing = {"exchange_every_steps": 2, "metrics_port": int(os.environ["METRICS_PORT"])}
    explicit = PacedFabricDDPStrategy(run_dir=out / "explicit", pacing=pacing)
    results["explicit"] = job(out, "explicit", explicit, 4, logger=False, slow=True)
    results["env"] = job(out, "env", "paced_ddp", 4, logger=False)
    (out / f"result_{results['env']['rank']}.json").write_text(json.dumps(results))


def single(out: Path) -> None:
    loggers = TensorBoardLogger(str(out / "single"), name="tb")
    fabric = Fabric(accelerator="cpu", devices=1, strategy="paced_ddp", loggers=loggers)
    fabric.launch()
    result = train(fabric, 4, slow=False)
    assert isinstance(fabric.strategy, PacedFabricDDPStrategy)
    result["log_dir"], result["session"] = loggers.log_dir, fabric.strategy.pacing_session is not None
    (out / "result_single.json").write_text(json.dumps(result))


if __name__ == "__main__":
    torch.set_num_threads(1)
    (single if sys.argv[2:] == ["single"] else main)(Path(sys.argv[1]))
    leave_without_finalization(0)  # torch's gloo shutdown abort: docs/hazards.md
