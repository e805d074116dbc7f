"""An ordinary Accelerate training script with nothing of pace_strategy in it, for test_zero_code.py.

    accelerate launch ... zero_code_accelerate_script.py OUT_DIR STEPS

Gradient accumulation 2; rank 1 sleeps 40 ms before each synchronizing micro-batch. Rank 0 prints
which module's ``Accelerator.prepare`` ran and whether pace_strategy was loaded.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.request

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main(out: str, steps: int) -> None:
    accelerator = Accelerator(log_with="tensorboard", project_dir=out, gradient_accumulation_steps=2)
    accelerator.init_trackers("run")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    per_rank = steps * 2 * 2  # micro-batches of 2 samples, 2 per optimizer step
    data = DataLoader(TensorDataset(torch.randn(per_rank * accelerator.num_processes, 8)), batch_size=2)
    model, optimizer, loader = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01), data)
    done = 0
    for (x,) in loader:
        with accelerator.accumulate(model):
            if accelerator.sync_gradients and accelerator.process_index == 1:
                time.sleep(0.04)
            accelerator.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        done += accelerator.sync_gradients
    scrape_metrics(accelerator.is_main_process)
    accelerator.end_training()
    if accelerator.is_main_process:
        print(f"prepare wrapped: {hasattr(Accelerator.prepare, '__wrapped__')}", flush=True)
        print(f"pace_strategy loaded: {'pace_strategy' in sys.modules}; trained {done} steps", flush=True)


def scrape_metrics(main_process: bool) -> None:
    """With SCRAPE_PORT set (the test's pacing_config has metrics_port), rank 0 reads its Prometheus
    endpoint over HTTP before end_training closes it, and prints the pace_ lines."""
    port = os.environ.get("SCRAPE_PORT")
    if not port or not main_process:
        return
    time.sleep(1.0)  # the telemetry thread publishes the last exchanged window
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        lines = [line for line in response.read().decode().splitlines() if line.startswith("pace_")]
    print("\n".join(f"scraped {line}" for line in lines), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    # torch's gloo shutdown abort (docs/hazards.md) hits plain DDP too; the documented workaround,
    # inline: this script must not import pace_strategy (leave_without_finalization)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
