"""Find modules and CLI subcommands by name through entry points.

The broker core never imports ``kvs`` or ``kvs_watch``: they declare
themselves in ``pyproject.toml`` under the groups ``kvbroker.modules``
(name -> Module subclass) and ``kvbroker.commands`` (name -> a
``register(subparsers)`` function), the way Flux loads modules by name.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Any

MODULES_GROUP = "kvbroker.modules"
COMMANDS_GROUP = "kvbroker.commands"
DEFAULT_MODULES = ("content", "kvs", "kvs-watch")


def _eps(group: str) -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=group)}


def available_modules() -> list[str]:
    return sorted(_eps(MODULES_GROUP))


def load_module_class(name: str) -> Any:
    eps = _eps(MODULES_GROUP)
    if name not in eps:
        raise LookupError(f"no module named {name!r} (known: {', '.join(sorted(eps))})")
    return eps[name].load()


def command_registrars() -> dict[str, Any]:
    """``{name: register}`` for every installed CLI extension that loads."""
    out = {}
    for name, ep in sorted(_eps(COMMANDS_GROUP).items()):
        try:
            out[name] = ep.load()
        except ImportError:
            continue
    return out
