"""The ``kvbroker`` console script's entry point.

A Ctrl-C while Python imports the command line (~50-180 ms, before
:func:`broker.cli.main` runs and turns a ``KeyboardInterrupt`` into exit
status 130) printed a traceback of wherever the import had got to.  This
module imports nothing itself, so the whole import, and the parsing before
``main``'s own handling, are inside the ``try``: a Ctrl-C at any point of
the command ends it quietly, status 130.
"""

from __future__ import annotations


def main() -> int:
    try:
        from broker.cli import main as run

        return run()
    except KeyboardInterrupt:
        return 130
