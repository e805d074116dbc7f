"""Drop-in constructors: a paced strategy takes its parent's arguments in the parent's positions.

``PacedDDPStrategy(accelerator)`` must work wherever ``DDPStrategy(accelerator)`` does (Lightning's
own tests and many user scripts pass the first arguments positionally). Rather than restating each
parent's signature (which changes between Lightning releases), the paced strategies take
``*args, **kwargs`` plus their own keyword-only arguments and name the parent's through
:func:`parent_arguments`, which binds them against the parent's real signature: a wrong argument
fails with the parent's own ``TypeError``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["parent_arguments"]


def parent_arguments(
    init: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """``args`` and ``kwargs`` as ``init`` (an ``__init__`` taking ``self`` first) would bind them, all by
    name: parameters given positionally get their names, ``**kwargs`` the parent collects stay
    separate names. Defaults are not filled in. Raises ``TypeError`` as a call of ``init`` would
    (too many positional arguments, one given twice, an unknown name where ``init`` has no
    ``**kwargs``)."""
    signature = inspect.signature(init)
    try:
        bound = signature.bind(None, *args, **kwargs)
    except TypeError as error:
        owner = getattr(init, "__qualname__", "__init__").rsplit(".", 1)[0]
        raise TypeError(f"{owner}: {error}") from None
    named: dict[str, Any] = {}
    for name, value in list(bound.arguments.items())[1:]:  # [0] is self
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:  # no strategy parent takes *args; say so rather than drop them
                raise TypeError(f"{init.__qualname__}: extra positional arguments {value!r}")
        else:
            named[name] = value
    return named
