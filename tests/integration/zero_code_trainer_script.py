"""An ordinary transformers.Trainer script with nothing of pace_strategy in it, for test_zero_code.py.

    accelerate launch ... zero_code_trainer_script.py OUT_DIR MAX_STEPS

A tiny BERT built from a config (nothing downloaded), TensorBoard reporting (and MLflow's, given
MLFLOW_TRACKING_URI), the loss logged at every step, gradient accumulation 2; rank 1 sleeps 20 ms
in every forward, 40 ms per optimizer step. With ZERO_CODE_TRAINER_MODE=late rank 1 sleeps 40 ms
after each optimizer step instead: it starts each step late, and since the Trainer gathers each
step's label count across ranks after loading the step's batches, rank 0 waits for it there, not
at the gradient sync. Rank 0 prints the Trainer's callbacks.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import urllib.request

import torch
import torch.distributed as dist
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

#: ``late``: rank 1 is late to start each step instead (40 ms of its own work after each optimizer
#: step), and so late to the Trainer's pre-step label-count gather, where rank 0 waits for it
LATE_START = os.environ.get("ZERO_CODE_TRAINER_MODE") == "late"


class SlowOnRank1(BertForSequenceClassification):
    def forward(self, input_ids=None, labels=None, **kwargs):  # names: the Trainer keeps these columns
        if dist.get_rank() == 1 and not LATE_START:
            time.sleep(0.02)
        return super().forward(input_ids=input_ids, labels=labels, **kwargs)


class ScrapeAtTheLastStep(TrainerCallback):
    """Rank 0 reads its Prometheus endpoint (SCRAPE_PORT; the test's pacing_config has metrics_port)
    over HTTP at the end of the last step, before pace_strategy's own callback (added after this
    one) finishes and closes it, and prints the pace_ lines."""

    def on_step_end(self, args, state, control, **kwargs):
        if dist.get_rank() != 0 or not control.should_training_stop:
            return
        time.sleep(1.0)  # the telemetry thread publishes the last exchanged window
        url = f"http://127.0.0.1:{os.environ['SCRAPE_PORT']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            lines = [line for line in response.read().decode().splitlines() if line.startswith("pace_")]
        print("\n".join(f"scraped {line}" for line in lines), flush=True)


class LateStartOnRank1(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if dist.get_rank() == 1:
            time.sleep(0.04)


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": i % 2}


def main(out: str, max_steps: int) -> None:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    args = TrainingArguments(
        output_dir=out,
        # with MLFLOW_TRACKING_URI (a file store) the Trainer reports to MLflow as well
        report_to=["tensorboard", "mlflow"] if os.environ.get("MLFLOW_TRACKING_URI") else ["tensorboard"],
        gradient_accumulation_steps=2,
        max_steps=max_steps,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    callbacks: list[TrainerCallback] = [LateStartOnRank1()] if LATE_START else []
    if os.environ.get("SCRAPE_PORT"):
        callbacks.append(ScrapeAtTheLastStep())
    trainer = Trainer(model=SlowOnRank1(config), args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train()
    if trainer.is_world_process_zero():
        names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
        print(f"callbacks: {names}; global_step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    # torch's gloo shutdown abort (docs/hazards.md): the documented workaround, inline, since this
    # script must not import pace_strategy (exit_without_finalization): the exit handlers first
    # (MLflow's flush of what the Trainer's callback logged asynchronously is one), then leave
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
