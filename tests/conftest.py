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


@pytest.fixture(autouse=True, scope="session")
def _tags_of_every_window():
    """In-process tests produce windows far faster than training does (thread ranks on a manual
    clock: twelve windows in milliseconds), so the telemetry thread's backlog bound, which drops the
    tags of windows a writer is truly behind on, would drop them by the load of the machine. Tests
    that check the tags get every window; the bound itself is tested with its own value."""
    import pace_strategy.telemetry.sinks

    with pytest.MonkeyPatch.context() as patch:  # session-wide: module fixtures record runs too
        patch.setattr(pace_strategy.telemetry.sinks, "MAX_TAG_BACKLOG_WINDOWS", 10**6)
        yield


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
