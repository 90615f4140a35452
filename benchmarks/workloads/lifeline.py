"""Helper processes end with the runner that started them.

The runner (:func:`benchmarks.harness.spawn`) gives every helper process
(``w0_peer``, ``kvs_client``, ``sync_client``) a pipe as its stdin and keeps
the other end open for as long as it wants the helper.  When the runner
exits -- normally, on Ctrl-C or SIGTERM, or killed by SIGKILL, which no
handler of its own can catch -- the kernel closes that end, the helper
reads EOF here, and exits.  A pipe works wherever a pipe does (no
``prctl(PR_SET_PDEATHSIG)``, which is Linux-only and fires when the
*thread* that forked exits, not the process).

Helpers run in their own session (no terminal's Ctrl-C reaches them: the
runner ends them through this pipe); a SIGINT sent to one anyway ends it
quietly, with no traceback.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
from collections.abc import Callable

EXIT_RUNNER_GONE = 0
"""The status a helper exits with on EOF: the runner is gone or asked it
to go, which is not a failure of the helper."""


class Lifeline:
    """Watch stdin in a daemon thread; exit the process on EOF.

    The lines the runner writes before that (``go`` for a W2p client) are
    handed to :meth:`readline`.  ``on_exit`` runs before the exit, e.g. to
    remove a socket the runner can no longer remove.
    """

    def __init__(self, on_exit: Callable[[], None] | None = None) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        self._on_exit = on_exit
        # SIG_DFL, not Python's KeyboardInterrupt: a SIGINT ends the helper
        # without a traceback (and asyncio.Runner leaves SIG_DFL alone).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        threading.Thread(target=self._watch, name="lifeline", daemon=True).start()

    def _watch(self) -> None:
        # os.read on fd 0, not sys.stdin: a daemon thread blocked inside
        # sys.stdin's buffered reader holds its lock, which the interpreter
        # may need at exit ("could not acquire lock ... at interpreter
        # shutdown, possibly due to daemon threads").
        pending = b""
        with contextlib.suppress(OSError):  # (no stdin at all: as gone)
            while chunk := os.read(0, 4096):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._lines.put(line.decode(errors="replace") + "\n")
        try:
            if self._on_exit is not None:
                self._on_exit()
        finally:
            # os._exit: the main thread may be blocked in a socket call that
            # no exception raised here could interrupt.
            os._exit(EXIT_RUNNER_GONE)

    def readline(self) -> str:
        """The next line the runner wrote (blocks; EOF exits the process)."""
        return self._lines.get()


def remove_socket(address: str) -> None:
    """Remove a socket file (a path, or an ``ipc://`` endpoint) and then its
    directory if that is empty now: what the runner would have removed."""
    path = address.removeprefix("ipc://")
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))
