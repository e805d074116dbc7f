"""An unchanged transformers.Trainer script (nothing of pace_strategy in it) for hf_step_begin.py: a tiny
BERT from a config, logging every step, rank 1 sleeping ``SLEEP_MS`` (default 25) in an
``on_step_begin`` callback, right before its forward.

    pace launch --config_file accel.yaml benchmarks/hf_step_begin_job.py OUT_DIR MAX_STEPS
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

SLEEP_S = float(os.environ.get("SLEEP_MS", "25")) / 1e3


class LateOnRank1(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if dist.get_rank() == 1:
            time.sleep(SLEEP_S)


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": i % 2}


if __name__ == "__main__":
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16,
    )  # fmt: skip
    args = TrainingArguments(
        output_dir=sys.argv[1], report_to=[], max_steps=int(sys.argv[2]), per_device_train_batch_size=2,
        logging_steps=1, save_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    Trainer(
        model=BertForSequenceClassification(config),
        args=args,
        train_dataset=Tokens(),
        callbacks=[LateOnRank1()],
    ).train()
    sys.stdout.flush()
    os._exit(0)  # torch's gloo shutdown abort (docs/hazards.md)
