"""Config values checked against the signature of what they instantiate, before anything runs.

``trainer.max_epochs=abc`` would otherwise reach Lightning as a string and fail deep inside a fit with
``TypeError: '>' not supported ...``; :func:`check_types` says instead, in one line, which key holds what
and what the target expects. Only scalar annotations (bool, int, float, str, None, Literal and unions of
them) are checked; a value the checker cannot judge (a nested config, a class instance) passes.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any

from hydra.utils import get_method
from omegaconf import DictConfig, ListConfig

from detector.errors import ConfigError

_SCALARS = (bool, int, float, str, type(None))


def _accepts(tp: Any, value: Any) -> bool | None:
    """True/False when ``value`` does/does not fit the annotation ``tp``; None when it cannot tell."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        verdicts = [_accepts(a, value) for a in typing.get_args(tp)]
        if any(v is True for v in verdicts):
            return True
        return None if any(v is None for v in verdicts) else False
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin in (list, tuple, typing.Sequence) or tp in (list, tuple):
        return True if isinstance(value, (list, tuple, ListConfig)) else None
    return None


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def target_hints(target: str) -> dict[str, Any]:
    """The resolved parameter annotations of ``target`` (a class's ``__init__`` or a function), {} when
    they cannot be resolved."""
    try:
        fn = get_method(target)
        fn = fn.__init__ if inspect.isclass(fn) else fn
        return typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: nothing to check against
        return {}


def check_types(node: DictConfig, key: str, skip: tuple[str, ...] = ()) -> None:
    """Raise :class:`ConfigError` naming ``key.<param>`` when a scalar value of the config ``node`` does not
    fit the annotation of that parameter of ``node._target_`` (parameters in ``skip`` are checked elsewhere)."""
    target = node.get("_target_")
    if not target:
        return
    hints = target_hints(target)
    for name, value in node.items():
        if name.startswith("_") or name in skip or name not in hints or isinstance(value, (DictConfig, ListConfig)):
            continue
        if isinstance(value, _SCALARS) and _accepts(hints[name], value) is False:
            raise ConfigError(f"{key}.{name}={value!r}: expected {_describe(hints[name])}")
