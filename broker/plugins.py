"""Find modules and CLI subcommands by name through entry points.

The broker core never imports ``kvs`` or ``kvs_watch``: they declare
themselves in ``pyproject.toml`` under the groups ``kvbroker.modules``
(name -> Module subclass) and ``kvbroker.commands`` (name -> a
``register(subparsers)`` function), the way Flux loads modules by name.

Reading entry points imports :mod:`importlib.metadata` and scans every
installed distribution (~40 ms of a rank's ~250 ms start), so a launcher
that found the modules already hands their targets to the ranks it starts
(:func:`module_targets`, :func:`use_targets`), which then import them
directly.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from broker.errors import describe_failure

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

MODULES_GROUP = "kvbroker.modules"
COMMANDS_GROUP = "kvbroker.commands"
DEFAULT_MODULES = ("content", "kvs", "kvs-watch")

_targets: dict[str, str] = {}
"""Module name -> entry-point target (``package.module:Class``) given by the
launcher (:func:`use_targets`)."""


@functools.cache
def _eps(group: str) -> dict[str, EntryPoint]:
    """The group's entry points, read once per process: reading them scans
    every installed distribution (a rank asks for each module it loads)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=group)}


@functools.cache
def _installed() -> frozenset[str]:
    try:
        return frozenset(_eps(MODULES_GROUP))
    except Exception:  # (a broken distribution's metadata: no hint, not a failure)
        return frozenset()


def installed_modules() -> frozenset[str]:
    """The names of the modules installed (``kvbroker.modules`` entry
    points, read once -- tens of ms, the first time -- and those the
    launcher gave), for an error that names one to load."""
    return _installed() | frozenset(_targets)


def module_targets(names: Iterable[str]) -> dict[str, str]:
    """``{name: "package.module:Class"}`` for the modules among ``names``
    that are installed, for a launcher to hand to its ranks."""
    eps = _eps(MODULES_GROUP)
    return {name: eps[name].value for name in names if name in eps}


def use_targets(targets: Mapping[str, str]) -> None:
    """Load these modules from their targets, without reading entry points."""
    _targets.update(targets)


def _load_target(target: str) -> Any:
    """What ``EntryPoint.load`` does for a ``module:attr.path`` target."""
    module, _, attrs = target.partition(":")
    obj: Any = importlib.import_module(module)
    for attr in filter(None, attrs.split(".")):
        obj = getattr(obj, attr)
    return obj


class ModuleLoadError(ImportError):
    """A module named in ``broker.modules`` was found but could not be
    loaded: its message names the module, its entry point and why."""


def load_module_class(name: str) -> Any:
    """The class of module ``name`` (``broker.modules``): ``LookupError`` if
    no installed distribution provides one, :class:`ModuleLoadError` if its
    code fails to import or names no module class -- the start-up error
    names the module (it said only the import's own message, which for a
    missing package read like an unknown module).  A path is a module file
    (:func:`load_module_file`)."""
    if is_file_module(name):
        return load_module_file(name)
    if name in _targets:
        target = _targets[name]
    else:
        eps = _eps(MODULES_GROUP)
        if name not in eps:
            raise LookupError(f"no module named {name!r} (known: {', '.join(sorted(eps))})")
        target = eps[name].value
    try:
        cls = _load_target(target)
    except Exception as exc:
        why = str(exc) or type(exc).__name__
        if not isinstance(exc, ImportError):
            why = f"{type(exc).__name__}: {why}"
        raise ModuleLoadError(f"module {name!r} ({target}) cannot be loaded: {why}") from exc
    if not isinstance(cls, type) or not getattr(cls, "name", None):
        raise ModuleLoadError(f"module {name!r} ({target}) is not a module class with a "
                              "name (a Module subclass setting name)")
    return cls


def is_file_module(name: str) -> bool:
    """Whether ``name`` in ``broker.modules`` or ``module load`` is the path
    of a Python file (``./echo.py``) rather than an entry point's name:
    module names hold no ``/`` (a service name is a topic's first word)."""
    return "/" in name or name.endswith(".py")


_file_loads = itertools.count(1)
_FILE_PREFIX = "_kvbroker_file_module_"


def load_module_file(path: str) -> Any:
    """The module class the Python file at ``path`` defines: its one
    subclass of :class:`broker.module.Module` with a ``name`` (one it
    imports from elsewhere does not count).  Imported afresh at each call,
    under a name of its own, so that ``module reload`` runs the file's
    code as it is now -- a module written in a file, no package or entry
    point needed, as Flux's ``flux module load testmod.py``.
    ``LookupError`` if there is no such file, :class:`ModuleLoadError` if
    it fails to import or does not define exactly one module class."""
    import os
    import types

    from broker.module import Module

    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise LookupError(f"no module file {path} (no such file)")
    if not os.path.isfile(path):
        raise ModuleLoadError(f"module file {path} cannot be loaded: not a regular file")
    stem = "".join(c if c.isalnum() else "_" for c in os.path.basename(path).removesuffix(".py"))
    modname = f"{_FILE_PREFIX}{next(_file_loads)}_{stem}"
    # Compiled from its text each time, never from a cached .pyc: an edit
    # in the same second that kept the file's size was run as the old code
    # (a .pyc is checked against the source's whole seconds and size).
    code = types.ModuleType(modname)
    code.__file__ = path
    sys.modules[modname] = code  # (while it runs: dataclasses and typing look it up)
    try:
        with open(path, "rb") as f:
            source = f.read()
        exec(compile(source, path, "exec", dont_inherit=True), vars(code))  # noqa: S102
    except BaseException as exc:
        del sys.modules[modname]
        # (a file's ``sys.exit()`` as it is read is its failure to load: it
        # ended the rank, or the launcher checking it, without a word)
        if not isinstance(exc, Exception | SystemExit):
            raise
        why = describe_failure(exc)
        raise ModuleLoadError(f"module file {path} cannot be loaded: {why}") from exc
    found = [obj for obj in vars(code).values()
             if isinstance(obj, type) and issubclass(obj, Module) and obj.__module__ == modname
             and obj.name]
    if len(found) != 1:
        what = ("no Module subclass setting name" if not found else
                f"{len(found)} module classes ({', '.join(c.__name__ for c in found)}): "
                "one per file")
        del sys.modules[modname]
        raise ModuleLoadError(f"module file {path} defines {what}")
    if is_file_module(found[0].name):  # (a name is what reload and remove are given)
        del sys.modules[modname]
        raise ModuleLoadError(f"module file {path} defines module {found[0].name!r}, a name "
                              f"that reads as a path: module remove {found[0].name} would "
                              "look for that file")
    return found[0]


def forget_module_file(cls: Any) -> None:
    """Drop the ``sys.modules`` entry of the file ``cls`` was loaded from
    (:func:`load_module_file`), once no module runs its code: its module
    was removed, or its load failed.  Kept while it runs -- pickle, typing's
    hints and dataclasses look a class's module up by name -- and each
    import's is its own, so 50 reloads hold one."""
    name = getattr(cls, "__module__", "")
    if name.startswith(_FILE_PREFIX):
        sys.modules.pop(name, None)


BUNDLED_COMMANDS = {"kvs": "kvs.cli:register", "archive": "kvs.archive_cli:register"}
"""CLI extensions this distribution ships, also declared as entry points
(pyproject.toml; a test keeps the two in step).  ``kvbroker kvs ...`` loads
its registrar from here: reading every installed distribution's entry
points (importlib.metadata and the scan) cost ~40 ms of a ~300 ms command."""


def command_registrars(command: str | None = None) -> dict[str, Any]:
    """``{name: register}`` for every installed CLI extension that loads,
    or only for ``command`` if it is one of :data:`BUNDLED_COMMANDS`."""
    if command in BUNDLED_COMMANDS:
        return {command: _load_target(BUNDLED_COMMANDS[command])}
    out = {}
    for name, ep in sorted(_eps(COMMANDS_GROUP).items()):
        try:
            out[name] = ep.load()
        except Exception as exc:  # (any: one broken extension must not take the rest down)
            why = describe_failure(exc)
            FAILED_COMMANDS[name] = f"this plugin command ({ep.value}) cannot be loaded: {why}"
            if name != command:  # (the one named says it as its error: see cli.main)
                print(f"kvbroker: ignoring plugin command {name!r}: {FAILED_COMMANDS[name]}",
                      file=sys.stderr)
    return out


FAILED_COMMANDS: dict[str, str] = {}
"""Installed CLI extensions that could not be loaded, with why: left out
(an import error, or any exception, took ``--help`` and every other
command down with it, or the command was reported not installed)."""
