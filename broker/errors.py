"""One error tree that says whose fault it is.

* :class:`ErrnoError` -- a failure with a POSIX errno.  Services raise it to
  answer a request with an error response; clients get it back (as
  :class:`RemoteError`) when a response carries an errnum.
* :class:`ProtocolError` -- a malformed frame or payload (``EPROTO``).
* API misuse on the client side raises ordinary ``ValueError``/``TypeError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno as _errno
import os
from collections.abc import Callable, Iterator
from typing import Any


class KvbrokerError(Exception):
    """Base class of every error kvbroker raises on purpose."""


class ErrnoError(KvbrokerError):
    """An error that carries a POSIX errno and a human message.

    Raised inside a service handler, it becomes the error response
    ``{errnum, errstr}`` of the request being handled.
    """

    def __init__(self, errnum: int, errstr: str | None = None) -> None:
        self.errnum = int(errnum)
        self.errstr = errstr or os.strerror(self.errnum)
        super().__init__(self.errnum, self.errstr)

    def __str__(self) -> str:
        return self.errstr

    @property
    def errname(self) -> str:
        return _errno.errorcode.get(self.errnum, str(self.errnum))


class LastingFault(ErrnoError):
    """A start-up failure that starting again would only repeat until
    someone acts: a damaged content store, a checkpoint naming a root the
    store lacks.  A rank exits 2 for it, as for a bad file (1 is a failure
    a restart may cure), so that a supervisor that does not restart on 2
    (the guide's ``RestartPreventExitStatus=2 3``) does not loop on it."""


class RemoteError(ErrnoError):
    """An error response received from a service (client side).

    Its text leads with the errno's name (``[ENOENT] a.b: no such key``), as
    ``OSError``'s does with its number, so a traceback or a log line says
    which error it was without a debugger; ``errstr`` is the service's
    message alone, for programs that print their own line.
    """

    def __str__(self) -> str:
        return f"[{self.errname}] {self.errstr}"


class ProtocolError(ErrnoError):
    """Malformed input: bad frames, bad msgpack, fields of the wrong type."""

    def __init__(self, errstr: str = "protocol error") -> None:
        super().__init__(_errno.EPROTO, errstr)

    def __reduce__(self) -> tuple[type, tuple[str]]:  # (pickle, copy: one argument)
        return self.__class__, (self.errstr,)


NO_SERVICE = "no service matching "


def printable(text: str) -> str:
    """``text`` as it is if every character prints, else as Python writes a
    string (``'a\\nb'``): a topic or a name from a client put into a
    message must keep it one line, and tell its bytes (a newline in an RPC's
    topic made the command's one-line error three)."""
    return text if text.isprintable() else repr(text)


def no_service_message(topic: str, module: str | None = None) -> str:
    """The ``ENOSYS`` message for a request no service takes; ``module``:
    an installed module of that name serves it, not loaded on the rank
    (``groups``, ``cron`` are not by default), which the message says how
    to load: "no service matching groups.get" read as a broken instance
    to an operator."""
    hint = (f": the {module} module is not loaded on this rank (kvbroker module load "
            f"{module}; -r all for every rank)" if module else "")
    return NO_SERVICE + printable(topic) + hint
"""What the router's ``ENOSYS`` answer starts with when no module of the
rank that had to serve a request offers its service (then its topic)."""


def no_service(exc: ErrnoError) -> bool:
    """``exc`` is the router's answer that no module serves the request:
    none loaded on the rank addressed, or on rank 0 for one any rank may
    serve (``module remove``), as opposed to an ``ENOSYS`` a module gave."""
    return exc.errnum == _errno.ENOSYS and exc.errstr.startswith(NO_SERVICE)


def error_text(exc: BaseException) -> str:
    """``exc``'s message for a message of one's own: an errno error's
    ``errstr`` (a :class:`RemoteError`'s ``str`` leads with its errno's
    name, which the errno of the new message says already), else ``str``."""
    return exc.errstr if isinstance(exc, ErrnoError) else str(exc)


def describe_failure(exc: BaseException) -> str:
    """A failure where its kind matters (a module's start-up, a plugin's
    load): ``Type: words``, or ``Type`` for one without words."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def strerror(errnum: int) -> str:
    """``os.strerror`` for the CLI's ``kvbroker: <what>: <strerror>`` lines."""
    return os.strerror(errnum)


def outcome_read(fut: asyncio.Future[Any]) -> None:
    """Mark a future's failure as seen (an ``add_done_callback``), for an
    outcome nobody awaits: asyncio would otherwise log it as never
    retrieved."""
    if not fut.cancelled():
        fut.exception()


class LastFailure:
    """Why the last try of an operation failed, until one succeeds (a
    stats field: ``checkpoint-failing``, ``sync-failing``): each try runs
    in :meth:`kept`, which sets :attr:`why` from what it raised -- a
    cancellation is no failure -- or clears it; ``on_failure`` is called
    at each failure (a counter)."""

    __slots__ = ("why", "on_failure")

    def __init__(self, on_failure: Callable[[], None] | None = None) -> None:
        self.why: str | None = None
        self.on_failure = on_failure

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        try:
            yield
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self.why = str(exc) or type(exc).__name__
                if self.on_failure is not None:
                    self.on_failure()
            raise
        self.why = None
