"""The test bed's own errors: it is Linux tooling beside the library, not pacing configuration."""

from __future__ import annotations

__all__ = ["TestbedError", "TestbedSpecError"]


class TestbedError(RuntimeError):
    """The test bed cannot be built or used here; the message says why and what to do."""

    __test__ = False  # a "Test..." name that pytest must not collect where a test module imports it


class TestbedSpecError(TestbedError, ValueError):
    """A network spec (nodes, racks, rates, delays) is invalid; the message names the field and the fix."""
