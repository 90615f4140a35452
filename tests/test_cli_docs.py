"""docs/cli.md keeps up with the ``kvbroker`` parser: every command it
accepts and every long option of each is written down there.

(23 long options of the kvs commands -- ``ls --recursive``, ``unlink
--force``, ``copy --src-namespace`` ... -- were in ``--help`` but not in
the reference until this test.)  Short options are too short to find
meaningfully in a long page, so only long ones are looked for; the
command paths are looked for as words (``kvs eventlog wait-event``).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

from broker.cli import build_parser, subparsers

CLI_MD = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


Command = tuple[tuple[str, ...], argparse.ArgumentParser]


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[Command]:
    """Every (command path, its parser) below ``parser``, depth first."""
    action = subparsers(parser)
    for name, sub in action.choices.items() if action is not None else ():
        yield (*path, name), sub
        yield from commands(sub, (*path, name))


def long_options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for a in parser._actions for o in a.option_strings
            if o.startswith("--") and o != "--help"]


def test_every_command_is_in_the_reference() -> None:
    doc = CLI_MD.read_text()
    found = list(commands(build_parser()))
    assert len(found) > 60, "the parser walk found too few commands"
    missing = [" ".join(path) for path, _ in found
               if not re.search(r"\b" + re.escape(" ".join(path)) + r"\b", doc)]
    assert missing == [], f"commands missing from docs/cli.md: {missing}"


def test_every_long_option_is_in_the_reference() -> None:
    doc = CLI_MD.read_text()
    parsers = [(("kvbroker",), build_parser())] + [
        (("kvbroker", *path), sub) for path, sub in commands(build_parser())]
    missing = [f"{' '.join(path)} {opt}" for path, p in parsers for opt in long_options(p)
               if not re.search(re.escape(opt) + r"(?![\w-])", doc)]
    assert missing == [], f"options missing from docs/cli.md: {missing}"
