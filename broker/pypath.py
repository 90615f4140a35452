"""How an interpreter the broker starts finds this kvbroker, and only it.

Ranks, spawners and the fork server are started as ``python -P -m
broker.X``.  ``python -m`` alone puts the working directory first on the
import path, so a ``kvs.py``, ``sqlite3.py`` or ``msgpack.py`` in the
directory ``kvbroker start`` was run in was imported in place of the
broker's own modules, and the ranks failed to start.  ``-P`` leaves the
working directory out -- and with it the one way an uninstalled checkout
(``python -m broker.cli start`` run in it) was found.  So when this
kvbroker's root is on this interpreter's path only as that first entry,
the child is given it on ``PYTHONPATH``: the package the launcher runs,
never whatever the working directory holds.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The directory the ``broker`` package (and ``kvs``, ``kvs_watch``) is in."""


def module_command(python: str, module: str) -> list[str]:
    """``[python, "-P", "-m", module]``: run ``module`` with the working
    directory off the import path."""
    return [python, "-P", "-m", module]


def child_env(env: dict[str, str], python: str = sys.executable) -> dict[str, str]:
    """``env`` for a child run by :func:`module_command`: with :data:`ROOT`
    first on ``PYTHONPATH`` when the child would not find it otherwise --
    this interpreter has it only as ``sys.path[0]`` (the working directory
    or a script's directory), not from site-packages, a ``.pth`` file or
    ``PYTHONPATH``.  Another interpreter (``python``) imports its own
    kvbroker, as before: it is left alone."""
    if python != sys.executable:
        return env
    if any(os.path.abspath(p) == ROOT for p in sys.path[1:] if p):
        return env
    given = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": ROOT + (os.pathsep + given if given else "")}
