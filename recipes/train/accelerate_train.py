"""Train a recipe with Accelerate, started by ``pace launch`` (or ``accelerate launch``):

    pace launch --config_file recipes/train/accelerate_cpu.yaml \
        recipes/train/accelerate_train.py recipes/train/accelerate_ddp.yaml [key=value ...]

The accelerate config says the processes and carries the ``pacing_config:`` section; the recipe
says the model, data and straggler; see ``docs/recipes.md``.
"""

import sys

from pace_strategy.apps.recipes import main_for

if __name__ == "__main__":
    sys.exit(main_for("accelerate", sys.argv[1:]))
