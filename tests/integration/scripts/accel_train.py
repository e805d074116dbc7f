"""A small Accelerate training script with pacing attached; rank 1 is slowed by --delay-ms per batch."""

import argparse
import time

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import pace_strategy

p = argparse.ArgumentParser()
p.add_argument("--project-dir", required=True)
p.add_argument("--steps", type=int, default=40, help="micro-batches")
p.add_argument("--accumulate", type=int, default=1)
p.add_argument("--delay-ms", type=float, default=40.0)
args = p.parse_args()

torch.set_num_threads(1)
acc = Accelerator(
    log_with="tensorboard", project_dir=args.project_dir, gradient_accumulation_steps=args.accumulate
)
acc.init_trackers("run")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
n = args.steps * 8 * acc.num_processes
data = TensorDataset(torch.randn(n, 32), torch.randn(n, 4))
model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=8))
handle = pace_strategy.attach_pacing(acc, model)
for x, y in loader:
    with acc.accumulate(model):
        time.sleep(0.01 + (args.delay_ms / 1e3 if acc.process_index == 1 else 0.0))
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
acc.end_training()
if acc.is_main_process:
    print(f"synchronized steps: {handle.steps}; run record: {handle.record_path}")
