"""Import-time plumbing: attributes loaded on first use, and hooks that run when a framework is imported.

``import pace_strategy`` must stay cheap (the CLI, ``pace diagnose`` and ``pace simulate`` need neither
Lightning nor Accelerate), yet ``Trainer(strategy="paced_ddp")`` must find our strategies in Lightning's
registry. So the package registers them the moment Lightning itself is imported (or at once, when it
already is), through a post-import hook on ``sys.meta_path`` that wraps the framework module's loader.

An optional package that is not installed is named with the pip extra that installs it
(:func:`require`, :func:`missing_extra`): the core needs only torch, numpy and omegaconf.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

__all__ = [
    "EXTRAS",
    "MissingExtraError",
    "extra_error",
    "lazy_attributes",
    "missing_extra",
    "require",
    "when_imported",
]

log = logging.getLogger("pace_strategy")


def lazy_attributes(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) that imports ``where[name]`` (a module path) on first access
    of ``name`` and caches the attribute in the package's namespace."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            value = getattr(importlib.import_module(module), name)
        except ImportError as error:
            raise (missing_extra(error, f"{package}.{name}") or error) from error
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


#: an optional package's top-level import name -> the pip extra of pace-strategy that installs it
EXTRAS = {
    "lightning": "lightning",
    "pytorch_lightning": "lightning",
    "accelerate": "accelerate",
    "transformers": "hf",
    "tensorboard": "tensorboard",
    "matplotlib": "plots",
    "prometheus_client": "prometheus",
    "pyarrow": "arrow",
}


class MissingExtraError(ImportError):
    """A feature's package is not installed; the message names the pip extra that installs it."""


def missing_extra(error: ImportError, what: str) -> MissingExtraError | None:
    """The :class:`MissingExtraError` for ``error`` when it is an optional package that is not
    installed (``None`` for any other import error, which must surface as it is). ``what``: the
    feature, as the user called it."""
    top = (getattr(error, "name", None) or "").split(".")[0]
    if not isinstance(error, ModuleNotFoundError) or top not in EXTRAS:
        return None
    return extra_error(what, [top])


def require(what: str, *packages: str) -> None:
    """Raise :class:`MissingExtraError` when one of ``packages`` (top-level import names, keys of
    :data:`EXTRAS`) is not installed, naming every extra that is missing."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise extra_error(what, missing)


def extra_error(what: str, packages: list[str]) -> MissingExtraError:
    """The error for ``what`` without ``packages`` (keys of :data:`EXTRAS`), naming their extras."""
    extras = ",".join(dict.fromkeys(EXTRAS[p] for p in packages))
    return MissingExtraError(
        f"{what} needs {', '.join(packages)}, which is not installed: pip install 'pace-strategy[{extras}]'"
    )


def _run_hook(module_name: str, hook: Callable[[], None]) -> None:
    # A failing hook must never break the user's own `import lightning`: say so once and go on.
    try:
        hook()
    except Exception:
        log.warning("pace_strategy: setting up for %s failed; its paced strategies are missing", module_name,
                    exc_info=True)  # fmt: skip


class _HookedLoader(importlib.abc.Loader):
    """The framework module's own loader, plus the module's hooks once it has executed."""

    def __init__(self, loader: Any, finder: _PostImportFinder, module_name: str) -> None:
        self._loader, self._finder, self._module_name = loader, finder, module_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for hook in self._finder.take(self._module_name):
            _run_hook(self._module_name, hook)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, get_filename, ...
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it asks the other finders for the spec and wraps the
    spec's loader so that the hooks run once the module is fully executed.

    The hooks are taken when the module executes, not when its spec is found: a mere probe
    (``importlib.util.find_spec``, as Lightning does to see which packages exist) imports nothing.
    """

    def __init__(self) -> None:
        self._hooks: dict[str, list[Callable[[], None]]] = {}
        self._searching: set[str] = set()
        self._lock = threading.Lock()

    def add(self, module_name: str, hook: Callable[[], None]) -> None:
        with self._lock:
            self._hooks.setdefault(module_name, []).append(hook)

    def take(self, module_name: str) -> list[Callable[[], None]]:
        with self._lock:
            return self._hooks.pop(module_name, [])

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        with self._lock:
            if fullname not in self._hooks or fullname in self._searching:
                return None
            self._searching.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            with self._lock:
                self._searching.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookedLoader(spec.loader, self, fullname)
        return spec


_FINDER = _PostImportFinder()


def when_imported(module_name: str, hook: Callable[[], None]) -> None:
    """Run ``hook()`` once ``module_name`` has been imported: now, if it already is, else right after
    its import finishes. A hook that raises is logged as a warning, never raised into the importer."""
    if module_name in sys.modules:
        _run_hook(module_name, hook)
        return
    _FINDER.add(module_name, hook)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
