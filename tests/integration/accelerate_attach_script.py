"""Run by test_accelerate.py under ``accelerate launch`` (2 CPU processes): attach, attach twice, train,
detach, train, attach again, finish; then the comm-hook monitor; last, attach and end with
``accelerator.end_training()`` alone. Writes OUT_DIR/result_RANK.json.

    accelerate launch ... accelerate_attach_script.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from pace_strategy.core.config import PacingConfig
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.integrations.accelerate import attach_pacing


def hooks(model: Any, optimizer: Any, loader: Any) -> dict[str, Any]:
    """What attach_pacing adds: forward pre-hooks, optimizer step post-hooks, gradient hooks, the
    loader's class."""
    return {
        "forward_pre": len(model._forward_pre_hooks),
        "step_post": len(optimizer.optimizer._optimizer_step_post_hooks),
        "grad": sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()),
        "loader": type(loader).__name__,
    }


def epoch(accelerator: Accelerator, model: Any, optimizer: Any, loader: Any) -> None:
    for (x,) in loader:
        accelerator.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()


def main(out: str) -> dict[str, Any]:
    accelerator = Accelerator(project_dir=out)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    data = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=2)  # 4 steps per rank and epoch
    model, optimizer, loader = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01), data)
    objects = (model, optimizer, loader)
    config = PacingConfig(mode="monitor", exchange_every_steps=2, warmup_steps=0)
    result: dict[str, Any] = {"rank": accelerator.process_index, "before": hooks(*objects)}

    handle = attach_pacing(accelerator, model, config)  # optimizer and loader: accelerate's lists
    result["attached"] = hooks(*objects)
    try:
        attach_pacing(accelerator, model, config)
        result["twice"] = None
    except PacingConfigError as error:
        result["twice"] = str(error)
    epoch(accelerator, *objects)
    result["steps"] = handle.steps
    handle.detach()
    result["detached"] = hooks(*objects)
    epoch(accelerator, *objects)
    result["steps_after_detach"] = handle.steps

    with attach_pacing(accelerator, model, config, run_dir=os.path.join(out, "again")) as again:
        result["reattached"] = hooks(*objects)
        epoch(accelerator, *objects)
    result["steps_again"] = again.steps
    result["finished"] = hooks(*objects)

    comm = config.replace(ddp_monitor="comm_hook")
    with attach_pacing(accelerator, model, comm, run_dir=os.path.join(out, "comm")) as paced:
        epoch(accelerator, *objects)
    epoch(accelerator, *objects)  # DDP keeps the comm hook: it only communicates now
    result["steps_comm"] = paced.steps
    result["after_comm"] = hooks(*objects)

    # No with, no finish: the script ends with end_training, as Accelerate's examples do. 4 steps
    # and a window of 3: the last step is measured after the last exchange.
    ends = config.replace(exchange_every_steps=3)
    ended = attach_pacing(accelerator, model, ends, run_dir=os.path.join(out, "ended"))
    epoch(accelerator, *objects)
    result["steps_ended"] = ended.steps
    accelerator.end_training()
    result["after_end"] = hooks(*objects)
    return result


if __name__ == "__main__":
    result = main(sys.argv[1])
    with open(os.path.join(sys.argv[1], f"result_{result['rank']}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalization (a gloo worker thread holding a tensor aborts it now and then;
    # see pace_strategy.apps.recipes.main_for).
    os._exit(0)
