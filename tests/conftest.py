"""Suite-wide guards: one thread per rank, and no test may leak env vars, threads or process groups."""

from __future__ import annotations

import os
import threading

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# `import pace_strategy` loads no framework, so the first test that uses Lightning would import it and
# with it the variables torch sets on first use (TORCHINDUCTOR_CACHE_DIR, ...), which the leak guard
# below would blame on that test. Import it once here, before any test.
import lightning.pytorch  # noqa: F401


@pytest.fixture(autouse=True)
def _no_leaks():
    import torch.distributed as dist

    env_before = dict(os.environ)
    threads_before = set(threading.enumerate())
    yield
    leaked_env = {k for k in set(os.environ) ^ set(env_before) if not k.startswith("PYTEST_")}
    os.environ.clear()
    os.environ.update(env_before)
    assert not leaked_env, f"test leaked environment variables: {sorted(leaked_env)}"
    assert not (dist.is_available() and dist.is_initialized()), "test left a default process group"
    leaked = [t for t in set(threading.enumerate()) - threads_before if t.is_alive() and not t.daemon]
    assert not leaked, f"test leaked threads: {leaked}"
