"""JSON and TOML text that users give or store -- arguments, files, KVS
values, eventlog lines, configuration -- parsed with one failure for
every way it can be bad.

``json.loads`` and ``tomllib.loads`` raise ``RecursionError``, not the
``ValueError`` of other malformed text, for text nested deeper than the
interpreter's recursion limit allows (about a thousand ``{"a":`` or
``[``, fewer in TOML).  Text anyone may write must not become a
traceback for whoever reads it: an eventlog line nested 5,000 deep made
every reader of that log fail so, a deep argument was exit status 1 and
a traceback instead of a usage error, and a deep configuration file
stopped ``kvbroker start`` the same way.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

TOO_DEEP = "nested too deeply"


class _JSONTooDeep(json.JSONDecodeError):
    """Says :data:`TOO_DEEP` alone: no line and column (the parse gave up
    at no one place)."""

    def __str__(self) -> str:
        return self.msg


def loads_json(text: str | bytes, **kw: Any) -> Any:
    """``json.loads(text, **kw)``; text nested too deeply raises
    :class:`json.JSONDecodeError` (a ``ValueError``) saying so, as other
    malformed text raises it."""
    try:
        return json.loads(text, **kw)
    except RecursionError:
        raise _JSONTooDeep(TOO_DEEP, "", 0) from None


def loads_toml(text: str) -> dict[str, Any]:
    """``tomllib.loads(text)``; text nested too deeply, or a ``nan`` or
    ``inf`` (:func:`_finite_real`), raises ``tomllib.TOMLDecodeError``
    saying so, as other malformed text raises it."""
    import tomllib  # (here: the commands that import this module mostly read JSON)

    try:
        return tomllib.loads(text, parse_float=_finite_real)
    except RecursionError:
        raise _decode_error(TOO_DEEP) from None


NOT_FINITE = "not a finite number (JSON has no nan or infinity)"


def _decode_error(msg: str) -> Exception:
    """``tomllib.TOMLDecodeError(msg)``, whose arguments are ``(msg, doc,
    pos)`` from Python 3.14."""
    import tomllib

    if sys.version_info >= (3, 14):
        return tomllib.TOMLDecodeError(msg, "", 0)
    return tomllib.TOMLDecodeError(msg)


def _finite_real(text: str) -> float:
    """A TOML real, refused if ``nan`` or ``inf``: what TOML reads is a
    configuration, which goes to the ranks and back as JSON's numbers.
    Accepted, ``config get`` printed ``NaN``, which no JSON reader takes
    (Flux, whose configuration is JSON, has no such value either)."""
    real = float(text)
    if not math.isfinite(real):
        raise _decode_error(f"{text}: {NOT_FINITE}")
    return real


def loads_finite_json(text: str | bytes) -> Any:
    """:func:`loads_json` of a configuration: ``NaN``, ``Infinity`` and
    ``-Infinity`` (Python's, not JSON's) and a number past a double
    (``1e999``, read as infinity) are a ``ValueError`` naming it."""
    return loads_json(text, parse_constant=_refuse_constant, parse_float=_finite_json_real)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name}: {NOT_FINITE}")


def _finite_json_real(text: str) -> float:
    real = float(text)
    if not math.isfinite(real):
        raise ValueError(f"{text}: {NOT_FINITE}")
    return real
