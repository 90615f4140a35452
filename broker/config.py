"""A rank's configuration file: what ``kvbroker config get`` shows and
``kvbroker config reload`` applies (Flux's ``flux config``).

The file is the one the rank started from -- ``kvbroker start --config
FILE`` (``[attrs]``) or ``kvbroker broker --config FILE`` (a bootstrap
file: ``[bootstrap]`` and ``[attrs]``); the ``config.path`` attribute
names it.  kvbroker's configuration is its attributes, so a reload reads
the file again and applies the ``[attrs]`` that changed since it was read
-- those a running rank may change (``attr set``'s); another one changed
refuses the whole reload, naming it.  An attribute taken out of the file
goes back to its default.
"""

from __future__ import annotations

import datetime
import errno
import os
import sys
import sysconfig
from typing import Any

from broker import bootstrap
from broker.errors import ErrnoError


def json_safe(value: Any) -> Any:
    """TOML's dates and times as ISO 8601 text: a config answer is msgpack."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    return value


def read(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The file's whole object (for ``config get``, JSON-safe) and its
    ``[attrs]`` as the start took them (dotted names, ``statedir``/``rundir``
    from the file's directory); :class:`~broker.bootstrap.BootstrapError`
    saying what is wrong, naming the file."""
    doc, attrs = bootstrap.config_file(path)
    return json_safe(doc), dict(attrs)


def text(value: Any) -> str:
    """An attribute's value from TOML as ``-S`` would give it."""
    return str(bootstrap.attr_text(value))


def changes(old: dict[str, Any], new: dict[str, Any],
            defaults: dict[str, str]) -> dict[str, str]:
    """The ``[attrs]`` to set for the file read as ``new``, last read as
    ``old``: each one whose value changed, and each one taken out (its
    default; ``ENOENT`` for one that has none: not an attribute any more)."""
    out = {name: text(value) for name, value in new.items()
           if name not in old or text(old[name]) != text(value)}
    for name in old:
        if name not in new:
            if name not in defaults:
                raise ErrnoError(errno.ENOENT, f"{name} was taken out: it has no default "
                                                 "to go back to")
            out[name] = defaults[name]
    return out


def builtin() -> dict[str, str]:
    """``config builtin`` (``broker.conf-builtin``): where this rank's
    kvbroker is, as Flux's compiled-in paths say where Flux is installed --
    ``python`` the interpreter the rank runs on, ``python_path`` the
    directory its ``broker`` package (and ``kvs``, ``kvs_watch``) is
    imported from (what ``PYTHONPATH`` needs to import it elsewhere),
    ``bindir`` where that interpreter's installed commands are (the
    ``kvbroker`` command of this installation).  kvbroker has no system
    configuration directory, rc scripts or shell, so Flux's ``confdir``,
    ``rc1_path``, ``shell_path``... are not among them."""
    package = os.path.dirname(os.path.abspath(__file__))
    return {"python": sys.executable, "python_path": os.path.dirname(package),
            "bindir": sysconfig.get_path("scripts")}
