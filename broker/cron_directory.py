"""The crontabs of ``cron.directory``: what rank 0's ``cron`` module
creates entries from each time it loads (docs/cli.md "cron").

Why: an instance that should always run a few commands on a schedule (a
nightly ``kvs dump``, a sweep) gets them from files an administrator
keeps, as Flux's rc1 loads ``cron.directory`` with ``flux cron tab`` --
not from a script someone has to remember to run after each start, or
after each ``module reload cron``, which forgets every entry.

Every regular file of the directory (a link to one too, as Flux's), in
the order of their names, is a crontab (:func:`broker.crontab.parse_crontab`);
subdirectories and anything else are passed over, and a directory that
is not there holds none (Flux's "non-existent cron.directory works").  A
file that is not a crontab, or cannot be read, fails the whole load --
``could not load crontab FILE: line N: why``, Flux's words -- so a typo
stops the start (or the reload) that would otherwise run without that
entry, unnoticed.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from broker.crontab import TabLine, parse_crontab
from broker.errors import ErrnoError


@dataclass(frozen=True)
class DirectoryLine:
    """A crontab line of the directory, and where it is."""

    path: str
    """The file, as the directory's name and the file's joined."""
    line: TabLine

    @property
    def source(self) -> str:
        """``FILE:LINE``, as an entry shows where it came from."""
        return f"{self.path}:{self.line.number}"


def crontab_files(directory: str) -> list[str]:
    """The paths of the regular files in ``directory``, sorted by name
    (none if it is not there).  :class:`ErrnoError` if it is not a
    directory, or cannot be read."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    except OSError as exc:
        errnum = exc.errno or errno.EIO
        raise ErrnoError(errnum, f"cron.directory {directory}: "
                         f"{exc.strerror or os.strerror(errnum)}") from None
    return [path for path in (os.path.join(directory, name) for name in names)
            if os.path.isfile(path)]


def read_directory(directory: str) -> list[DirectoryLine]:
    """Every crontab line of ``directory``'s files, in order, each
    checked; :class:`ErrnoError` (``EINVAL`` a bad line, a read's own
    errno) naming the file and the line for the first that is not."""
    out: list[DirectoryLine] = []
    for path in crontab_files(directory):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            errnum = getattr(exc, "errno", None) or errno.EINVAL
            why = (exc.strerror if isinstance(exc, OSError) and exc.strerror
                   else "not text (UTF-8)")
            raise ErrnoError(errnum, f"could not load crontab {path}: {why}") from None
        try:
            lines = parse_crontab(text)
        except ValueError as exc:
            raise ErrnoError(errno.EINVAL, f"could not load crontab {path}: {exc}") from None
        out += [DirectoryLine(path, line) for line in lines]
    return out
