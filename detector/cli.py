"""``key=value`` command-line arguments for the small scripts (train/evaluate use Hydra)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any


def parse_args(argv: Sequence[str] | None, defaults: dict[str, Any], usage: str) -> dict[str, Any]:
    """Parse ``key=value`` pairs into a copy of ``defaults``, converting each value to the type of its
    default (bool accepts true/false/1/0). A default of None takes the string. ``-h``/``--help`` prints
    ``usage``; an unknown key, a missing '=' or a bad value exits with status 1 and one line naming it."""
    argv = sys.argv[1:] if argv is None else list(argv)
    out = dict(defaults)
    for arg in argv:
        if arg in ("-h", "--help"):
            print(usage)
            raise SystemExit(0)
        key, sep, value = arg.partition("=")
        if not sep or key not in defaults:
            known = ", ".join(defaults)
            raise SystemExit(f"error: unexpected argument {arg!r} (expected key=value, key one of: {known})")
        default = defaults[key]
        try:
            if isinstance(default, bool):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                out[key] = value.lower() in ("true", "1", "yes")
            elif default is None or isinstance(default, str):
                out[key] = value
            else:
                out[key] = type(default)(value)
        except ValueError:
            raise SystemExit(f"error: {key}={value!r}: expected {type(default).__name__} (see --help)") from None
    return out
