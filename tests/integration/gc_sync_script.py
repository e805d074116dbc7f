"""Run by test_gc_sync.py: the example job, GC-heavy, on 2 CPU ranks with ``paced_ddp`` and
``gc_sync``, logging its loss every step to Lightning's ``MLFlowLogger`` (a file store in
OUT_DIR/mlruns; a logger without a ``log_dir``). After training each rank writes
OUT_DIR/rank_RANK.json: its collector's settings (they must be back as before training) and how many
objects it still tracks (garbage must not pile up).

    python gc_sync_script.py OUT_DIR
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

from pace_strategy.apps.recipe_schema import TrainRecipe
from pace_strategy.apps.recipes import one_thread_per_rank, run_lightning
from pace_strategy.settings import build
from pace_strategy.shutdown import leave_without_finalization

HEAP, GARBAGE, STEPS = 200_000, 20_000, 60


def main(out: Path) -> None:
    one_thread_per_rank()
    before = {
        "threshold": list(gc.get_threshold()),
        "enabled": gc.isenabled(),
        "callbacks": len(gc.callbacks),
    }
    recipe = build(
        TrainRecipe,
        {
            "trainer": {"devices": 2, "strategy": "paced_ddp", "max_steps": STEPS},
            "model": {"compute_ms": 5.0, "gc_heap_objects": HEAP, "gc_garbage_objects": GARBAGE},
            "output": {"root": str(out), "name": "gc", "logger": "mlflow", "log_loss": True},
            "pacing": {
                "gc_sync": {"enabled": True, "warmup_steps": 5},
                "exchange_every_steps": 8,
                "warmup_steps": 2,
            },
        },
    )
    trainer = run_lightning(recipe, quiet=True)
    after = {
        "threshold": list(gc.get_threshold()),
        "enabled": gc.isenabled(),
        "callbacks": len(gc.callbacks),
        "frozen": gc.get_freeze_count(),
    }
    tracked = len(gc.get_objects())
    gc.collect()  # what is left is alive: the difference is the garbage training ended with
    result = {
        "rank": trainer.global_rank,
        "before": before,
        "after": after,
        "garbage_objects_held": tracked - len(gc.get_objects()),
        "run_id": trainer.logger.run_id,
    }
    (out / f"rank_{trainer.global_rank}.json").write_text(json.dumps(result))
    leave_without_finalization(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
