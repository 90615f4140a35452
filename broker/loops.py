"""The application's choice of event loop.

Only entry points (the CLI, the rank process, test fixtures) call
:func:`loop_factory` and hand the result to ``asyncio.Runner``; library code
only ever calls ``asyncio.get_running_loop()``.  Nothing here installs a loop
policy.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

LOOP_NAMES = ("auto", "uvloop", "asyncio")
ENV_VAR = "KVBROKER_EVENT_LOOP"


def uvloop_available() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def resolve(name: str | None = None) -> str:
    """Turn ``auto``/``None`` into the concrete loop name that will be used."""
    name = name or os.environ.get(ENV_VAR) or "auto"
    if name not in LOOP_NAMES:
        raise ValueError(f"unknown event loop {name!r} (choose from {', '.join(LOOP_NAMES)})")
    if name == "auto":
        return "uvloop" if uvloop_available() else "asyncio"
    if name == "uvloop" and not uvloop_available():
        raise ValueError("event loop 'uvloop' requested but uvloop is not installed")
    return name


def loop_factory(name: str | None = None) -> Callable[[], asyncio.AbstractEventLoop]:
    """Return a zero-argument factory for ``asyncio.Runner(loop_factory=...)``."""
    if resolve(name) == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``: what a running loop actually is."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
