"""The ``kvbroker`` console script's entry point.

A Ctrl-C while Python imports the command line (~50-180 ms, before
:func:`broker.cli.main` runs and turns a ``KeyboardInterrupt`` into exit
status 130) printed a traceback of wherever the import had got to.  This
module imports nothing itself, so the whole import, and the parsing before
``main``'s own handling, are inside the ``try``: a Ctrl-C at any point of
the command ends it quietly, status 130.

With ``$KVBROKER_FORKSERVER`` set, a command is first offered to that fork
server, which runs it in a fork of a process that has imported the command
line already, this process standing in for it
(:func:`broker.forkclient.run_served_command`).
"""

from __future__ import annotations

import os  # (both imported by the interpreter's start already)
import sys


def main() -> int:
    try:
        if "KVBROKER_FORKSERVER" in os.environ:  # (:data:`broker.forkclient.FORKSERVER_ENV`)
            from broker.forkclient import run_served_command

            status = run_served_command(sys.argv)
            if status is not None:
                return status
        from broker.cli import main as run

        return run()
    except KeyboardInterrupt:
        return 130
