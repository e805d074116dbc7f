"""core/ must import with only torch and the standard library."""

import subprocess
import sys

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'lightning', 'pytorch_lightning', 'accelerate', 'omegaconf', 'tensorboard'}:
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, Block())
import pace_strategy.core as core
cfg = core.PacingConfig()
core.Pacer(cfg, None, 0, 1, core.ManualClock())
print('ok')
"""


def test_core_imports_without_frameworks():
    out = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
