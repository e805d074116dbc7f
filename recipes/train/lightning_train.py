"""Train a recipe with Lightning: ``python recipes/train/lightning_train.py RECIPE.yaml [key=value ...]``.

The recipe (``lightning_ddp.yaml``, ``lightning_fsdp.yaml``) says the strategy, devices, model and
straggler; see ``docs/recipes.md``.
"""

import sys

from pace_strategy.apps.recipes import main_for

if __name__ == "__main__":
    sys.exit(main_for("lightning", sys.argv[1:]))
