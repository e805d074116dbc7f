"""``python -m pace_strategy COMMAND ...``: the ``pace`` command, for environments without its script."""

import sys

from pace_strategy.cli import main

sys.exit(main())
