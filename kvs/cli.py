"""``kvbroker kvs ...``: the KVS command line, mirroring ``flux kvs``.

Registered through the ``kvbroker.commands`` entry point (``register``).
Options and output formats follow flux-core's ``flux-kvs``; see docs/cli.md.
The namespace is ``-N/--namespace``, else ``$KVBROKER_NAMESPACE``, else
``primary``.  Errors print ``kvbroker: <key or what>: <strerror>`` (plus the
service's own explanation in parentheses when it adds something) and exit 1.

Watching (``get -w/-W/-S``, ``eventlog get -w/-W/-S``, ``eventlog
wait-event``) is delegated to :mod:`kvs_watch.cli` (functions
``watch_get``, ``eventlog_get`` and ``eventlog_wait_event``, each taking the
parsed ``args`` and returning the exit status); ``args.namespace`` is
already resolved when they are called, and :func:`render_value` and
:func:`make_formatter` give them this module's output formats.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import errno
import importlib
import json
import os
import re
import shlex
import signal
import sys
import unicodedata
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from broker.cliutil import (
    COLOR_CHOICES,
    CONDITION_FAILED,
    CLIError,
    PermutingParser,
    TermCleansUp,
    UsageError,
    add_color_option,
    command_args,
    connect,
    duration_arg,
    each_rank,
    errno_detail,
    non_negative_int,
    positive_float,
    run_async,
    size_int,
    uid_int,
    use_color,
    write_out,
)
from broker.errors import ErrnoError
from broker.message import NODEID_ANY
from kvs import eventlog, treeobj
from kvs.client import (
    KVS,
    NAMESPACE_ENV,
    NO_MERGE,
    READDIR,
    SYNC,
    TREEOBJ,
    Change,
    CommitResult,
    Dir,
    TxnOps,
    default_namespace,
    kind,
)
from kvs.keys import PRIMARY, SHOWN, normalize, shown
from kvs.treeobj import TreeObj

if TYPE_CHECKING:
    from broker.handle import Handle
    from kvs.archive import Item, Report

__all__ = ["register", "render_value", "make_formatter"]

_TRIVIAL = {"no such key", "is a directory", "not a directory", "not a symlink"}


# ---------------------------------------------------------------- plumbing


def error_detail(exc: ErrnoError, key: str | None = None) -> str:
    """:func:`~broker.cliutil.errno_detail`, without the message when it only
    restates the key and the errno (``a.b: no such key``)."""
    msg = exc.errstr or ""
    if key is not None and msg.startswith(f"{key}: "):
        msg = msg[len(key) + 2:]
    if msg.lower() in _TRIVIAL or msg.lower() == os.strerror(exc.errnum).lower():
        msg = ""
    return errno_detail(ErrnoError(exc.errnum, _guest_hinted(exc.errnum, msg) or None))


def _fail(what: str, exc: ErrnoError, key: str | None = None) -> CLIError:
    """``what`` (most often the key) failed with ``exc``; a key too long for
    any commit is named by its start (:func:`kvs.keys.shown`), not printed
    whole before the message that already shows it -- nor is one refused
    as too long (``ENAMETOOLONG``: a component over 1,024 bytes), whose
    message starts with the key's first :data:`~kvs.keys.SHOWN` characters."""
    label = shown(what)
    if exc.errnum == errno.ENAMETOOLONG and len(label) > SHOWN:
        label = label[:SHOWN] + "..."
    err = CLIError(label, detail=error_detail(exc, key if key is not None else what))
    return err


GUEST_IN_PRIMARY = f"namespace {PRIMARY} belongs to another user"
"""What a guest's request to the owner's default namespace is refused with."""
GUEST_HINT = f"a guest works in the namespaces it owns: -N NS, or ${NAMESPACE_ENV}"


def _guest_hinted(errnum: int, msg: str) -> str:
    """``msg`` saying how a guest names its own namespace, if it is the
    refusal of the owner's default one (a guest that forgot ``-N``: get
    said so, ls, dir, put... only whose namespace it was)."""
    if errnum == errno.EPERM and GUEST_IN_PRIMARY in msg and GUEST_HINT not in msg:
        return f"{msg}: {GUEST_HINT}"
    return msg


def isdir_hint(err: CLIError, exc: ErrnoError, hint: str) -> CLIError:
    """``err`` saying, for ``EISDIR``, which command reads a directory: a
    user coming from etcd or Redis expects ``get`` of a prefix to print
    what is below it, and ``Is a directory`` alone does not say how."""
    if exc.errnum == errno.EISDIR and err.detail:
        if err.detail.endswith(")"):  # (one aside, not two: "(the root is a directory)")
            err.detail = f"{err.detail[:-1]}; {hint})"
        else:
            err.detail += f" ({hint})"
    return err


def _emit(text: str | bytes, end: bytes = b"\n") -> None:
    write_out(text if isinstance(text, bytes) else text.encode("utf-8", "surrogateescape"))
    write_out(end)


def _warn(text: str) -> None:
    sys.stdout.flush()
    sys.stdout.buffer.flush()
    print(f"kvbroker: {text}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace, body: Callable[[KVS], Awaitable[int | None]],
         term: TermCleansUp | None = None) -> int:
    """Connect (``$KVBROKER_URI``), run ``body(kvs)`` on the chosen loop, flush
    (``term``: SIGTERM cancels it, :class:`~broker.cliutil.TermCleansUp`)."""
    args.what = getattr(args, "what", None) or f"kvs {args.kvs_cmd}"

    async def main() -> int | None:
        # (a waiting command's -t/--timeout bounds connecting too: an ssh://
        # host that never answers kept kvs wait -t waiting for ever)
        async with await connect(timeout=getattr(args, "timeout", None)) as h:
            try:
                return await body(KVS(h, getattr(args, "namespace", None)))
            except ErrnoError as exc:
                hinted = _guest_hinted(exc.errnum, exc.errstr or "")
                if hinted != exc.errstr:  # (a refusal that comes out raw, as error_detail's)
                    raise ErrnoError(exc.errnum, hinted) from None
                raise

    try:
        return run_async(args, main, term=term)
    finally:
        sys.stdout.buffer.flush()


def _delegate(name: str, args: argparse.Namespace) -> int:
    """Hand a watching command to :mod:`kvs_watch.cli`."""
    args.namespace = default_namespace(getattr(args, "namespace", None))
    args.what = getattr(args, "what", None) or f"kvs {args.kvs_cmd}"
    try:
        fn = getattr(importlib.import_module("kvs_watch.cli"), name)
    except (ImportError, AttributeError):
        raise CLIError(args.what, errno.ENOSYS,
                       f"{os.strerror(errno.ENOSYS)} (watching needs kvs_watch.cli.{name})"
                       ) from None
    return int(fn(args) or 0)


def _dir_width(text: str) -> int:
    """argparse type for ``dir -w``: 0 (no limit) or at least 4 columns, room
    for one character and ``...`` (flux takes 1-3 as 0, so a narrower width
    printed wider lines, values and their newlines whole)."""
    n = non_negative_int(text)
    if 0 < n < 4:
        raise argparse.ArgumentTypeError(
            f"{text!r} is too narrow: use 0 (no limit) or at least 4 columns")
    return n


def _window_width(args: argparse.Namespace) -> int:
    """``-w COLS``, else the terminal's width, else ``$COLUMNS``, else 80 (0 = no limit)."""
    if args.width is not None:
        return int(args.width)
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns
    except (OSError, ValueError):
        pass
    try:
        cols = int(os.environ.get("COLUMNS", ""))
        if cols >= 0:
            return cols
    except ValueError:
        pass
    return 80


def _commit_finish(args: argparse.Namespace, result: CommitResult) -> None:
    """``-O`` root tree object, ``-b`` root blobref or ``-s`` root version."""
    if getattr(args, "treeobj_root", False):
        _emit(treeobj.to_json(result.treeobj))
    elif getattr(args, "blobref", False):
        _emit(result.rootref)
    elif getattr(args, "sequence", False):
        _emit(str(result.rootseq))


async def _commit(kvs: KVS, ops: TxnOps, what: str, flags: int = 0) -> CommitResult:
    try:
        return await kvs.commit(ops, flags)
    except ErrnoError as exc:
        raise _fail(what, exc) from None


def render_value(key: str, obj: TreeObj, *, raw: bool = False, as_treeobj: bool = False,
                 label: bool = False) -> bytes:
    """What ``kvs get`` prints for one lookup answer ``obj``.

    ``-t``: the tree object as JSON; ``-r``: the bytes as they are; else the
    value up to its first NUL byte and a newline (nothing for an empty
    value, as ``flux kvs get``).  ``-l`` puts ``key=`` first, and then an
    empty value still ends its line (flux prints ``key=`` and no newline, so
    the next key ran on).
    """
    head = f"{key}=".encode("utf-8", "surrogateescape") if label else b""
    if as_treeobj:
        return head + treeobj.to_json(obj).encode() + b"\n"
    data = bytes(obj["data"])
    if raw:
        return head + data
    data = data.split(b"\0", 1)[0]
    return head + (data + b"\n" if obj["data"] or label else b"")


def make_formatter(args: argparse.Namespace) -> eventlog.Formatter:
    """The eventlog :class:`~kvs.eventlog.Formatter` for ``-u``, ``-H``, ``-L``/``--color``."""
    when = args.color
    if when not in COLOR_CHOICES:  # argparse refuses it first; callers may not use it
        raise UsageError(f"argument --color: invalid choice: {when!r} "
                         f"(choose from {', '.join(COLOR_CHOICES)})")
    if args.unformatted and (args.human or when == "always"):
        raise UsageError("--unformatted cannot be combined with --human or --color=always")
    color = use_color(when) and not args.unformatted
    return eventlog.Formatter(unformatted=args.unformatted, human=args.human, color=color)


# ---------------------------------------------------------------- get / put


def check_watch_options(args: argparse.Namespace) -> None:
    """Refuse, as usage errors and in the options' own names, what kvs-watch
    would refuse in its flags' (``WATCH and STREAM cannot be combined``)."""
    if getattr(args, "at", None):
        raise UsageError("--at cannot be combined with --watch, --waitcreate or --stream")
    if args.watch and args.stream:
        raise UsageError("--watch and --stream cannot be combined")
    if getattr(args, "timeout", None) and not (args.watch or args.waitcreate):
        raise UsageError("--timeout needs --watch or --waitcreate")
    if getattr(args, "deletes", False) and not args.watch:
        # (not ignored as -u/-A/-f are, Flux's way: a removal would end
        # the command it was given to keep going)
        raise UsageError("--deletes needs --watch")


def cmd_get(args: argparse.Namespace) -> int:
    if args.watch or args.waitcreate or args.stream or args.timeout or args.deletes:
        check_watch_options(args)
        return _delegate("watch_get", args)

    async def body(kvs: KVS) -> int:
        flags = TREEOBJ if args.treeobj else 0
        for key in args.keys:
            try:
                obj = await kvs.lookup(key, flags, at=args.at)
            except ErrnoError as exc:
                at = f"-a {shlex.quote(args.at)} " if args.at else ""  # (the same version)
                raise isdir_hint(_fail(key, exc), exc,
                                 f"kvbroker kvs dir {at}{shlex.quote(key)} prints what is "
                                 "below it") from None
            _emit(render_value(key, obj, raw=args.raw, as_treeobj=args.treeobj,
                               label=args.label), end=b"")
        return 0

    return _run(args, body)


def _read_stdin() -> bytes:
    return sys.stdin.buffer.read()


def _failed_condition(exc: ErrnoError) -> str | None:
    """The key of the ``--expect`` condition that cancelled a commit, or
    could not be checked (``EINVAL``: through a link into another
    namespace...): the error names it, not a key written; else None."""
    if not exc.errstr:
        return None
    key, sep, _ = exc.errstr.partition(": condition failed: " if exc.errnum == errno.ECANCELED
                                       else ": condition cannot be checked: ")
    return key if sep else None


def _commit_error(exc: ErrnoError, label: str) -> CLIError:
    """A failed ``put``/``unlink`` commit: named by the condition that
    cancelled it (exit :data:`CONDITION_FAILED`) or that could not be
    checked, else by ``label``."""
    cond = _failed_condition(exc)
    err = _fail(cond or label, exc)
    if cond is not None and exc.errnum == errno.ECANCELED:
        err.status = CONDITION_FAILED
    return err


def _conditions(args: argparse.Namespace) -> TxnOps:
    """A transaction holding ``--expect`` and ``--expect-missing``'s
    conditions (first: they see the tree as it is before the changes)."""
    ops = TxnOps()
    key = ""
    try:
        for cond in args.expect:
            key, sep, value = cond.partition("=")
            if not sep or not key:  # (=1: the root's condition, blamed on the put's key)
                raise UsageError(f"--expect {cond}: give KEY=VALUE")
            ops.expect_raw(key, os.fsencode(value))
        for key in args.expect_missing:
            ops.expect_missing(key)
    except ErrnoError as exc:
        raise _fail(key, exc) from None
    return ops


def cmd_put(args: argparse.Namespace) -> int:
    args.what = "kvs put"  # (before _run: reading standard input may fail first)
    if args.treeobj and args.append:
        # (Flux drops --append here: the tree object replaced the value)
        raise UsageError("--append cannot be combined with --treeobj (a tree object "
                         "replaces the entry)")
    ops = _conditions(args)
    keys = []
    for pair in args.pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise CLIError("put", detail="you must specify a value as key=value")
        keys.append(key)
        try:
            if args.treeobj:
                ops.put_treeobj(key, _read_stdin() if value == "-" else value,
                                lease=args.lease)
                continue
            data = _read_stdin() if args.raw and value == "-" else os.fsencode(value)
            if args.append:
                ops.append(key, data, lease=args.lease)
            else:
                ops.put_raw(key, data, lease=args.lease)
        except ErrnoError as exc:
            raise _fail(key, exc) from None
    flags = (NO_MERGE if args.no_merge else 0) | (SYNC if args.sync else 0)

    async def body(kvs: KVS) -> int:
        # (an empty key named nothing: "kvbroker: : Invalid argument")
        label = keys[0] if len(keys) == 1 and keys[0] else "put"
        try:
            result = await kvs.commit(ops, flags)
        except ErrnoError as exc:
            raise _commit_error(exc, label) from None
        _commit_finish(args, result)
        return 0

    return _run(args, body)


# ---------------------------------------------------------------- dir / ls


def _kv_line(key: str, value: bytes, maxcol: int) -> str:
    """``key = value`` fitted to ``maxcol`` columns with ``...``, as ``flux kvs dir``."""
    if 0 < maxcol <= 3:  # a terminal (or $COLUMNS) this narrow: no limit, as flux
        maxcol = 0
    text = value.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
    line = f"{key} = {text}"
    overflow = False
    if maxcol:
        cut = _fit_columns(line, maxcol - 3)
        if cut < len(line):
            line, overflow = line[:cut], True
        head, nl, rest = line.partition("\n")
        if nl:
            line, overflow = head, overflow or bool(rest)
        bad = _UNPRINTABLE.search(line)
        if bad:  # (as flux: a control byte -- a tab, an escape -- reached the terminal)
            line, overflow = line[:bad.start()], True
    return line + ("..." if overflow else "")


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\udc80-\udcff]")
"""What ``kvs dir`` cuts a line at, as ``flux kvs dir`` at its first
character that is not ``isprint``: a control character (C0, DEL, C1), or a
byte that is not UTF-8.  Printable UTF-8 is kept (Flux's C locale cut it
too: its first byte is not ``isprint`` there)."""


def _fit_columns(text: str, cols: int) -> int:
    """How many characters of ``text`` fit in ``cols`` terminal columns: a
    wide (East Asian) character takes two, a combining mark none.  Counting
    characters let ``dir -w 20`` print 30 columns of Japanese."""
    if len(text) <= cols // 2:
        return len(text)  # fits however wide its characters are
    used = 0
    for i, ch in enumerate(text):
        if ch.isascii():
            w = 1
        elif unicodedata.combining(ch):
            w = 0
        else:
            w = 2 if unicodedata.east_asian_width(ch) in "WF" else 1
        if used + w > cols:
            return i
        used += w
    return len(text)


async def _walk_dir(top: Dir, recursive: bool,
                    values: bool) -> AsyncIterator[tuple[str, str, Any]]:
    """``(key, kind, what)`` for each entry under ``top`` in order: a link's
    target, a value's bytes (None unless ``values``), None for a directory
    not descended into (or empty)."""
    # Depth first with a stack, not recursion: a tree may be deeper than
    # Python's recursion limit (``kvs copy`` nests directories freely).
    stack = [(top, iter(top))]
    while stack:
        d, names = stack[-1]
        name = next(names, None)
        if name is None:
            stack.pop()
            continue
        key = d.path(name)
        try:
            k = d.kind(name)
            if k == "symlink":
                yield key, k, str(d.link(name))
            elif k == "dir":
                if not recursive:
                    yield key, k, None
                    continue
                sub = await d.subdir(name)
                if len(sub):
                    stack.append((sub, iter(sub)))
                else:
                    yield key, k, None
            else:
                yield key, k, (await d.read(name)) if values else None
        except ErrnoError as exc:
            raise _fail(key, exc) from None


def _json_entry(kind: str, what: Any) -> Any:
    """An entry of ``dir --json``: a value as its text (UTF-8), else as
    ``{"base64": ...}``; ``{"link": TARGET}``; ``{"dir": true}``."""
    if kind == "symlink":
        return {"link": what}
    if kind == "dir":
        return {"dir": True}
    if what is None:
        return None
    try:
        return what.decode()
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(what).decode()}


def cmd_dir(args: argparse.Namespace) -> int:
    maxcol = _window_width(args)

    async def body(kvs: KVS) -> int:
        try:
            d = await kvs.dir(args.key, at=args.at)
        except ErrnoError as exc:
            raise _fail(args.key, exc) from None
        values = not args.directory
        if args.json:
            doc = {key: _json_entry(k, what)
                   async for key, k, what in _walk_dir(d, args.recursive, values)}
            _emit(json.dumps(doc, ensure_ascii=False))
            return 0
        async for key, k, what in _walk_dir(d, args.recursive, values):
            if k == "symlink":
                _emit(f"{key} -> {what}")
            elif k == "dir":
                _emit(f"{key}.")
            elif what is None:
                _emit(key)
            else:
                _emit(_kv_line(key, what, maxcol))
        return 0

    return _run(args, body)


def _columns(names: list[str], col_width: int, win: int) -> list[str]:
    """Lay ``names`` out in columns ``col_width`` wide within ``win`` (0: no limit)."""
    lines: list[str] = []
    cur, col, last = "", 0, 0
    for name in names:
        if win != 0 and col + col_width > win and col > 0:
            lines.append(cur)
            cur, col = "", 0
        elif last > 0:
            cur += " " * (col_width - last)
        cur += name
        last = len(name)
        col += col_width
    if col > 0:
        lines.append(cur)
    return lines


def _decorate(d: Dir, name: str, classify: bool) -> str:
    if classify:
        k = d.kind(name)
        if k == "dir":
            return name + "."
        if k == "symlink":
            return name + "@"
    return name


class _Lister:
    """``kvs ls``: collects text lines, or a JSON document with ``--json``."""

    def __init__(self, kvs: KVS, args: argparse.Namespace) -> None:
        self.kvs = kvs
        self.args = args
        self.win = 1 if args.one else _window_width(args)
        self.doc: dict[str, Any] = {"keys": [], "dirs": {}}

    async def categorize(self, key: str, dirs: list[str], singles: list[str]) -> bool:
        args = self.args
        nkey, require_dir = key, False
        while len(nkey) > 1 and nkey.endswith("."):
            nkey, require_dir = nkey[:-1], True
        try:
            obj = await self.kvs.get_treeobj(nkey)
        except ErrnoError as exc:
            _warn(f"{nkey}: {error_detail(exc, nkey)}")
            return False
        k = kind(obj)
        if k != "dir" and require_dir:
            _warn(f"{nkey}: {os.strerror(errno.ENOTDIR)}")
            return False
        if k == "dir":
            if args.directory:
                singles.append(nkey + ("." if args.classify else ""))
                self.doc["keys"].append({"key": nkey, "kind": k})
            else:
                dirs.append(nkey)
        elif k == "value":
            singles.append(nkey)
            self.doc["keys"].append({"key": nkey, "kind": k})
        elif args.classify or args.directory:
            singles.append(nkey + ("@" if args.classify else ""))
            self.doc["keys"].append({"key": nkey, "kind": k})
        else:  # a link: list the directory it points to, else its own name
            try:
                await self.kvs.lookup(nkey, READDIR)
                dirs.append(nkey)
            except ErrnoError as exc:
                if exc.errnum not in (errno.ENOENT, errno.ENOTDIR):
                    raise _fail(nkey, exc) from None
                singles.append(nkey)
                self.doc["keys"].append({"key": nkey, "kind": k})
        return True

    async def list_dir(self, key: str, label: bool, vspace: bool) -> None:
        args = self.args
        # Pre-order with a stack, not recursion (a tree may be deeper than
        # Python's recursion limit); subdirectories are read at the same root.
        pending: list[tuple[str, Dir | None, str]] = [(key, None, "")]
        while pending:
            key, parent, name = pending.pop()
            try:
                d = await (self.kvs.dir(key) if parent is None else parent.subdir(name))
                if label and not args.json:
                    _emit(("\n" if vspace else "") + f"{key}:")
                vspace = True
                self.doc["dirs"][key] = [{"name": n, "kind": d.kind(n)} for n in d]
                if not args.json and len(d):
                    width = max(len(n) for n in d) + 4
                    for line in _columns([_decorate(d, n, args.classify) for n in d], width,
                                         self.win):
                        _emit(line)
            except ErrnoError as exc:
                raise _fail(key, exc) from None
            if args.recursive:
                pending += [(d.path(n), d, n) for n in reversed(list(d)) if d.is_dir(n)]

    async def run(self) -> int:
        args = self.args
        dirs: list[str] = []
        singles: list[str] = []
        ok = True
        for key in args.keys or ["."]:
            ok = await self.categorize(key, dirs, singles) and ok
        singles.sort()
        dirs.sort()
        label = vspace = False
        if singles:
            if not args.json:
                for line in _columns(singles, max(map(len, singles)) + 4, self.win):
                    _emit(line)
            label = vspace = True
        if args.recursive or len(dirs) > 1:
            label = True
        for key in dirs:
            await self.list_dir(key, label, vspace)
            vspace = True
        if args.json:
            _emit(json.dumps(self.doc))
        return 0 if ok else 1


def cmd_ls(args: argparse.Namespace) -> int:
    return _run(args, lambda kvs: _Lister(kvs, args).run())


# ---------------------------------------------------------------- other writes


def cmd_unlink(args: argparse.Namespace) -> int:
    ops = _conditions(args)

    async def body(kvs: KVS) -> int:
        for key in args.keys:
            try:
                if await kvs.unlinkable(key, recursive=args.recursive, force=args.force):
                    ops.unlink(key)
            except ErrnoError as exc:
                raise CLIError(f"cannot unlink '{shown(key)}'",
                               detail=error_detail(exc, key)) from None
        try:
            result = await kvs.commit(ops)
        except ErrnoError as exc:
            cond = _failed_condition(exc)
            if cond is None and len(args.keys) == 1:  # (as unlinkable's errors say it)
                key = args.keys[0]
                raise CLIError(f"cannot unlink '{shown(key)}'",
                               detail=error_detail(exc, key)) from None
            raise _commit_error(exc, "unlink") from None
        _commit_finish(args, result)
        return 0

    return _run(args, body)


def cmd_mkdir(args: argparse.Namespace) -> int:
    ops = TxnOps()
    for key in args.keys:
        try:
            ops.mkdir(key)
        except ErrnoError as exc:  # (named by the key, as put's are: not "kvs:")
            raise _fail(key, exc) from None

    async def body(kvs: KVS) -> int:
        what = args.keys[0] if len(args.keys) == 1 else "mkdir"
        _commit_finish(args, await _commit(kvs, ops, what))
        return 0

    return _run(args, body)


def cmd_link(args: argparse.Namespace) -> int:
    try:
        ops = TxnOps().symlink(args.linkname, args.target, args.target_namespace)
    except ErrnoError as exc:
        raise _fail(args.linkname, exc) from None

    async def body(kvs: KVS) -> int:
        _commit_finish(args, await _commit(kvs, ops, args.linkname))
        return 0

    return _run(args, body)


def cmd_readlink(args: argparse.Namespace) -> int:
    async def body(kvs: KVS) -> int:
        for key in args.keys:
            try:
                link = await kvs.readlink(key, at=args.at)
            except ErrnoError as exc:
                raise _fail(key, exc) from None
            if args.namespace_only and link.namespace:
                _emit(link.namespace)
            elif args.key_only:
                _emit(link.target)
            else:
                _emit(str(link))
        return 0

    return _run(args, body)


def cmd_copy(args: argparse.Namespace) -> int:
    """``copy``/``move``: ``-S``/``-D`` as Flux; ``-N`` (the connection's
    namespace, ``kvs.namespace``) stands for whichever of them is not given,
    as every other namespace-aware subcommand takes ``-N``."""
    async def body(kvs: KVS) -> int:
        op = kvs.move if args.kvs_cmd == "move" else kvs.copy
        try:
            await op(args.src, args.dst, src_namespace=args.src_namespace,
                     dst_namespace=args.dst_namespace)
        except ErrnoError as exc:
            raise CLIError(args.kvs_cmd, detail=error_detail(exc)) from None
        return 0

    return _run(args, body)


# ---------------------------------------------------------------- versions and roots


def cmd_version(args: argparse.Namespace) -> int:
    async def body(kvs: KVS) -> int:
        _emit(str(await kvs.version()))
        return 0

    return _run(args, body)


def cmd_wait(args: argparse.Namespace) -> int:
    async def body(kvs: KVS) -> int:
        try:
            await kvs.wait_version(args.version, args.timeout)
        except TimeoutError as exc:
            raise CLIError("kvs wait", detail=str(exc)) from None
        return 0

    return _run(args, body)


def cmd_sync(args: argparse.Namespace) -> int:
    """``flux kvs sync``: everything committed so far made durable (an empty
    SYNC commit); ``-b``/``-s``/``-O`` print the root it made."""
    async def body(kvs: KVS) -> int:
        try:
            result = await kvs.sync()
        except ErrnoError as exc:
            raise _fail(args.what, exc) from None
        _commit_finish(args, result)
        return 0

    return _run(args, body)


_STATUS_LETTER: dict[Change, str] = {"added": "A", "removed": "D", "changed": "M"}
"""``kvs diff --name-status``'s letters, git's."""


def cmd_diff(args: argparse.Namespace) -> int:
    """``kvs diff OLD [NEW]`` (a kvbroker extension): the keys that differ
    between two roots, one per line (docs/kvs.md, "Catching up after a gap");
    with ``--name-status``, each after a letter saying how it changed and a
    tab, as ``git diff --name-status`` prints paths.  Not the default: the
    bare keys are documented output that scripts read."""
    async def body(kvs: KVS) -> int:
        if args.name_status:
            changes = await kvs.diff(args.old, args.new, args.key, status=True)
            for key, change in changes.items():
                _emit(f"{_STATUS_LETTER[change]}\t{key}")
            return 0
        for key in await kvs.diff(args.old, args.new, args.key):
            _emit(key)
        return 0

    return _run(args, body)


def cmd_getroot(args: argparse.Namespace) -> int:
    async def body(kvs: KVS) -> int:
        root = await kvs.getroot()
        if args.json:
            _emit(json.dumps(root.as_dict()))
        elif args.owner:
            _emit(str(root.owner))
        elif args.sequence:
            _emit(str(root.rootseq))
        elif args.blobref:
            _emit(root.rootref)
        else:
            _emit(treeobj.to_json(root.treeobj))
        return 0

    return _run(args, body)


# ---------------------------------------------------------------- cache


def cmd_gc(args: argparse.Namespace) -> int:
    """``kvbroker kvs gc``: online garbage collection of the running
    instance (:mod:`kvs.collect`); with ``--statedir DIR``, offline, of a
    stopped instance's content store (:mod:`kvs.garbage`, needs no broker)."""
    from kvs.garbage import GcError, collect, describe

    if args.statedir is None:
        if args.dry_run:
            # A usage error (exit 2, the usage line), as dump's --statedir
            # without --checkpoint: an option of the other form of the command.
            raise UsageError("--dry-run is for a stopped instance (--statedir DIR)")
        args.what = "kvs gc"

        async def body(kvs: KVS) -> int:
            print(describe_online(await kvs.gc(compact=args.compact)), flush=True)
            return 0

        return _run(args, body)
    try:
        report = collect(args.statedir, dry_run=args.dry_run)
    except GcError as exc:
        raise CLIError("kvs gc", detail=str(exc)) from None
    print(describe(report), flush=True)
    return 0


def cmd_fsck(args: argparse.Namespace) -> int:
    """``kvbroker kvs fsck`` (Flux's ``flux fsck``): check that a tree is
    whole in the content store -- online, a namespace's current root (or
    ``--rootref``) through ``content.load``; with ``--statedir DIR``, the
    checkpoint of a stopped instance, read from its file (:mod:`kvs.fsck`).
    Keys (``-v``), problems, repairs and totals go to stderr, as Flux's;
    exit 1 on any problem, repaired or not."""
    from broker.content import blobref
    from kvs import fsck

    def said(key: str) -> None:
        print(key, file=sys.stderr, flush=True)

    on_key = said if args.verbose else None

    def finish(report: fsck.Report) -> int:
        for problem in report.problems:
            for line in fsck.describe(problem, args.verbose):
                print(line, file=sys.stderr)
        if args.verbose or report.problems:
            print(f"Total errors: {len(report.problems)}", file=sys.stderr)
        return 1 if report.problems else 0

    if args.repair and (args.statedir is None or args.rootref is not None):
        raise UsageError("--repair mends a stopped instance's checkpoint: --statedir DIR, "
                         "without --rootref (online, writers could race it)")
    if args.job_aware and not args.repair:
        raise UsageError("--job-aware goes with --repair")
    if args.rootref is not None and not blobref.is_valid(args.rootref):
        raise UsageError(f"--rootref {args.rootref!r}: invalid blobref specified")
    if args.statedir is not None:
        from kvs.archive import ArchiveError, open_stopped_store

        try:
            with open_stopped_store(args.statedir, create=False, instead="stop it first, or "
                                    "check online (without --statedir)",
                                    read_only=not args.repair) as store:
                point = None if args.rootref else _newest_checkpoint(store, args.statedir)
                rootref = str(args.rootref if point is None else point.rootref)
                if args.quiet:
                    pass
                elif point is None:
                    print(f"checking {rootref} in {args.statedir}", flush=True)
                else:
                    print(f"Checking integrity of checkpoint from {_when(point.timestamp)} "
                          f"(version {point.rootseq}, {rootref}) in {args.statedir}",
                          flush=True)
                report = asyncio.run(fsck.check(fsck.from_store(store), rootref, on_key))
                status = finish(report)
                if args.repair:
                    _fsck_repair(args, store, point, report, rootref)
        except ArchiveError as exc:
            raise CLIError("kvs fsck", detail=str(exc)) from None
        return status

    async def body(kvs: KVS) -> int:
        rootref = args.rootref
        if rootref is None:
            try:
                root = await kvs.getroot()
            except ErrnoError as exc:
                # no kvs module to ask (Flux's fsck with the kvs unloaded): the
                # checkpoint the content service keeps, the primary namespace's
                if exc.errnum != errno.ENOSYS or args.namespace is not None:
                    raise
                points = await kvs.checkpoints()
                if not points or points[0].rootref is None:
                    raise CLIError("kvs fsck", detail="no kvs module answers, and no KVS "
                                   "checkpoint names a root (give --rootref REF)") from None
                rootref = points[0].rootref
                header = (f"Checking integrity of checkpoint from {_when(points[0].timestamp)}"
                          f" (version {points[0].rootseq}, {rootref})")
            else:
                rootref = root.rootref
                header = (f"checking namespace {root.namespace} at version {root.rootseq} "
                          f"({rootref})")
        else:
            header = f"checking {rootref}"
        if not args.quiet:
            print(header, flush=True)
        return finish(await fsck.check(_content_loader(kvs.handle), rootref, on_key))

    return _run(args, body)


def _when(stamp: float | None) -> str:
    """A checkpoint's time as Flux's fsck prints it (local, to the second)."""
    import time

    return "?" if stamp is None else time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(stamp))


def _newest_checkpoint(store: Any, statedir: str) -> Any:
    """The stopped store's newest KVS checkpoint (a
    :class:`kvs.checkpoints.Checkpoint` naming a root), or the reason there
    is none to check (``CLIError``)."""
    from broker.content.module import checkpoint_or_none
    from kvs.checkpoints import Checkpoint
    from kvs.namespaces import CHECKPOINT_KEY

    raw = store.checkpoint_list(CHECKPOINT_KEY)
    if not raw:
        raise CLIError("kvs fsck", detail=f"statedir {statedir} has no KVS checkpoint "
                       "(give --rootref REF)")
    point = Checkpoint.from_value(checkpoint_or_none(raw[0]))
    if point.rootref is None:
        raise CLIError("kvs fsck", detail=f"statedir {statedir}: its newest KVS checkpoint "
                       "names no root (damaged: see kvs checkpoint list; give --rootref REF)")
    return point


def _fsck_repair(args: argparse.Namespace, store: Any, point: Any, report: Any,
                 rootref: str) -> None:
    """``kvs fsck --repair`` (:func:`kvs.fsck.repair`), and what it did, on
    stderr as Flux's: each key (not with ``-q``), then the totals (those
    that are 0 only with ``-v``).  Nothing to repair writes nothing."""
    from kvs import fsck
    from kvs.treeobj import NeedBlobs

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    done = None
    if report.problems:
        try:
            done = fsck.repair(store, point.value, report, job_aware=args.job_aware)
        except (ValueError, ErrnoError, NeedBlobs) as exc:
            why = (exc.errstr if isinstance(exc, ErrnoError) else
                   f"blobs missing on the way to a damaged key: {sorted(exc.refs)[:3]}"
                   if isinstance(exc, NeedBlobs) else str(exc))
            raise CLIError("kvs fsck", detail=f"cannot repair: {why}") from None
        if not args.quiet:
            for key in done.moved:
                say(f"{key} repaired and moved to {fsck.LOST_FOUND}")
            for key in done.unlinked:
                say(f"{key} unlinked due to missing blobref")
            for part in done.rebuilt:
                shards = f"{part.shards} unreadable hdir shard{'' if part.shards == 1 else 's'}"
                say(f"{part.key} rebuilt without its {shards}: {part.lost} "
                    f"entr{'y' if part.lost == 1 else 'ies'} lost")
            for job in done.jobs:
                say(f"job {job} moved to {fsck.LOST_FOUND}")
            say(f"Updated primary checkpoint to include {fsck.LOST_FOUND}: version "
                f"{done.rootseq}, {done.rootref} (the damaged root stays the checkpoint "
                f"before it: kvs checkpoint update --statedir {args.statedir} {rootref} "
                "takes it back)")
    moved = len(done.moved) if done else 0
    unlinked = len(done.unlinked) if done else 0
    if moved or args.verbose:
        say(f"Total repairs: {moved}")
    if unlinked or args.verbose:
        say(f"Total unlinked directories: {unlinked}")
    if done and done.rebuilt:  # (not with -v at 0: Flux's totals are the two above)
        say(f"Total rebuilt directories: {len(done.rebuilt)}")


def _content_loader(h: Handle) -> Callable[[list[str]], Awaitable[dict[str, bytes | int]]]:
    """``kvs fsck``'s loads through a rank's content service: ``content.load``
    of many blobrefs (an answer may stop short: asked again for the rest),
    each blob's bytes or errno."""

    async def load(refs: list[str]) -> dict[str, bytes | int]:
        out: dict[str, bytes | int] = {}
        todo = list(refs)
        while todo:
            answer = (await h.rpc("content.load", {"blobrefs": todo}))["data"]
            if not answer:
                raise ErrnoError(errno.EPROTO, "content.load answered no blob")
            for ref, got in zip(todo, answer, strict=False):
                out[ref] = bytes(got) if isinstance(got, (bytes, bytearray)) else int(got[0])
            todo = todo[len(answer):]
        return out

    return load


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """``kvbroker kvs checkpoint list|update`` (Flux's ``flux content
    checkpoint``, also ``kvbroker content checkpoint``): the primary
    namespace's checkpoints kept, and rolling a stopped instance back to one
    of them (:mod:`kvs.checkpoints`)."""
    from kvs import checkpoints

    args.what = f"{getattr(args, 'spelled', None) or 'kvs checkpoint'} {args.checkpoint_cmd}"
    if args.checkpoint_cmd == "update":
        if args.statedir is None:
            raise UsageError("checkpoint update works on a stopped instance: --statedir DIR "
                             "(a running kvs module owns its checkpoint)")
        with _archive_errors(args):
            report = checkpoints.update_offline(args.statedir, args.rootref)
        cp = report.checkpoint
        if not report.changed:
            print(f"{args.rootref} is the current checkpoint already (rootseq {cp.rootseq}): "
                  "nothing changed", flush=True)
        else:
            prev = report.previous
            was = ("" if prev is None else
                   "; the value it replaces (not a KVS root: it does not decode, or "
                   "names none) is kept as index 1" if prev.rootref is None else
                   f"; the one it replaces (rootseq {prev.rootseq}, {prev.rootref}) "
                   "is kept as index 1")
            blobs = f"{report.blobs:,} blob{'' if report.blobs == 1 else 's'}"
            print(f"the next start resumes at {cp.rootref}, rootseq {cp.rootseq} "
                  f"({blobs}, all in the store){was}", flush=True)
        return 0

    def show(found: list[checkpoints.Checkpoint]) -> int:
        if args.json:
            for cp in found:
                _emit(cp.as_json())
        else:
            for line in checkpoints.format_table(found, header=not args.no_header):
                _emit(line)
        return 0

    if args.statedir is not None:
        with _archive_errors(args):
            return show(checkpoints.list_offline(args.statedir))

    async def body(kvs: KVS) -> int:
        return show(await kvs.checkpoints())

    return _run(args, body)


def describe_online(r: dict[str, Any]) -> str:
    """``kvs.gc``'s answer as ``kvbroker kvs gc`` prints it."""
    from kvs.garbage import size_text

    free = ("compacted" if r["compacted"] else
            f"{size_text(r['free-bytes'])} of it free for new blobs")
    def n(count: int, what: str) -> str:
        return f"{count:,} {what}{'' if count == 1 else 's'}"

    dropped = ""
    if r.get("checkpoints-dropped"):
        dropped = (f"dropped {n(r['checkpoints-dropped'], 'older checkpoint')} of the KVS "
                   f"(versions older than {r['grace']:g} s, collected)\n")
    text = (f"removed {n(r['removed'], 'blob')} ({size_text(r['removed-bytes'])}) in "
            f"{r['seconds']:.2f} s\n"
            f"kept {n(r['kept'], 'blob')} reachable from {n(r['roots'], 'root')} (the current, "
            f"those of the last {r['grace']:g} s, checkpoints), and those written since\n"
            f"{dropped}content.sqlite: {size_text(r['file-bytes'])}, {free}")
    if r.get("damaged-count"):
        text += (f"\ndamaged: {n(r['damaged-count'], 'blob')} that live trees name, missing "
                 f"or unreadable (first: {r['damaged'][0]})")
    return text


# ---------------------------------------------------------------- archives


def size_arg(text: str) -> int:
    """A size in bytes (``--size-limit``): :func:`broker.cliutil.size_int`
    with no bound but what an int64 holds."""
    return size_int(text, (1 << 63) - 1)


def _archive_mode(args: argparse.Namespace) -> None:
    """``--checkpoint`` needs ``--statedir`` and excludes the online options."""
    if args.checkpoint:
        if not args.statedir:
            raise UsageError("--checkpoint needs --statedir DIR (the stopped instance's)")
        online = [o for o, v in (("-N", args.namespace), ("--key", args.key),
                                 ("--at", getattr(args, "at", None))) if v]
        if online:
            raise UsageError(f"--checkpoint works on the statedir: {', '.join(online)} "
                             "would name a running instance's KVS")
    elif args.statedir:
        raise UsageError("--statedir goes with --checkpoint")
    elif getattr(args, "ignore_failed_read", False):
        raise UsageError("--ignore-failed-read goes with --checkpoint (a running "
                         "instance's KVS refuses a tree with missing blobs)")
    elif getattr(args, "index", 0):
        raise UsageError("--index goes with --checkpoint (an older checkpoint of a "
                         "stopped instance)")


def _archive_listing(args: argparse.Namespace) -> Callable[[Item], None] | None:
    if not args.verbose:
        return None

    def show(item: Item) -> None:
        tail = {"symlink": f" -> {item.target}", "dir": "/"}.get(item.kind, "")
        print(f"{item.key}{tail}", file=sys.stderr, flush=True)

    return show


def _archive_summary(args: argparse.Namespace, where: str, report: Report) -> None:
    """The skipped entries, then (unless ``-q``) one line: what, and ``where``."""
    for line in report.skipped:
        _warn(f"{args.what}: skipped {line}")
    if args.quiet:
        return
    dirs = f", {report.dirs} empty director{'y' if report.dirs == 1 else 'ies'}" \
        if report.dirs else ""
    blobs = (f", {report.blobs} blob{'' if report.blobs == 1 else 's'} sent to the store"
             if report.blobs else "")
    keys = f"{report.keys} key{'' if report.keys == 1 else 's'}"
    size = f"{report.bytes} byte{'' if report.bytes == 1 else 's'}"
    _warn(f"{args.what}: {keys}{dirs} ({size} of values{blobs}) {where}")


@contextlib.contextmanager
def _archive_errors(args: argparse.Namespace, key: str | None = None) -> Iterator[None]:
    """``kvbroker: kvs dump: <why>`` for an ``ArchiveError``; the key's
    ``kvbroker: KEY: <strerror>`` for what the KVS refused."""
    from kvs.archive import ArchiveError

    try:
        yield
    except ArchiveError as exc:
        raise CLIError(args.what, detail=str(exc)) from None
    except ErrnoError as exc:
        if key is None:
            raise
        if key == "." or exc.errnum == errno.ECONNRESET:
            # (the whole namespace, or the connection lost: the command
            # failed, not a key -- "kvbroker: .: Connection reset" said so)
            raise _fail(args.what, exc, key) from None
        raise _fail(key, exc) from None


def cmd_dump(args: argparse.Namespace) -> int:
    """``kvbroker kvs dump OUTFILE`` (Flux's ``flux dump``): a directory of a
    namespace (or a stopped instance's checkpoint) as a tar archive
    (:mod:`kvs.archive`)."""
    from kvs import archive

    args.what = getattr(args, "spelled", None) or "kvs dump"  # ("dump": as flux dump)
    _archive_mode(args)
    listing = _archive_listing(args)

    def done(report: Report) -> int:
        _archive_summary(args, f"(tree {report.rootref})", report)
        return 0

    with TermCleansUp() as term:  # (SIGTERM leaves no .part file, as Ctrl-C)
        if args.checkpoint:
            with _archive_errors(args):
                return done(archive.dump_checkpoint(
                    args.statedir, args.outfile, on_item=listing,
                    ignore_failed_read=args.ignore_failed_read, index=args.index))

        async def body(kvs: KVS) -> int:
            key = args.key or "."
            with _archive_errors(args, key):
                return done(await archive.dump(kvs, args.outfile, key=key, at=args.at,
                                               on_item=listing))

        return _run(args, body, term)


def cmd_restore(args: argparse.Namespace) -> int:
    """``kvbroker kvs restore --key KEY INFILE`` (Flux's ``flux restore``):
    make KEY the directory a tar archive holds, in one commit; or, with
    ``--checkpoint``, make it the checkpoint of a stopped instance."""
    from kvs import archive

    args.what = getattr(args, "spelled", None) or "kvs restore"
    _archive_mode(args)
    if not args.checkpoint and not args.key:
        raise UsageError("say where: --key KEY (online) or --checkpoint --statedir DIR")
    listing = _archive_listing(args)
    if args.checkpoint:
        with _archive_errors(args):
            report = archive.restore_checkpoint(args.statedir, args.infile,
                                                size_limit=args.size_limit, on_item=listing)
        _archive_summary(args, f"to the checkpoint (version 0, root {report.rootref})",
                         report)
        return 0

    async def body(kvs: KVS) -> int:
        with _archive_errors(args, args.key):
            report = await archive.restore(kvs, args.infile, args.key,
                                           size_limit=args.size_limit, on_item=listing)
        _archive_summary(args, f"to {normalize(args.key)} (tree {report.rootref})", report)
        return 0

    return _run(args, body)


def cmd_dropcache(args: argparse.Namespace) -> int:
    """``flux kvs dropcache [--all]``: empty the kvs module's blob cache on
    this rank, or on every rank.

    Flux publishes a ``kvs.dropcache`` event for ``--all`` and cannot tell
    whether any rank obeyed; here each rank (0 to ``size`` - 1) gets its
    own ``kvs.dropcache`` request, all sent at once: when the command
    returns every cache is empty, and a rank that refused (``EPERM``: not
    the instance owner) or cannot be reached is named."""
    args.what = "kvs dropcache"

    async def body(kvs: KVS) -> int:
        h = kvs.handle
        ranks = list(range(int(await h.attr_get("size")))) if args.all else [None]
        await each_rank("kvs dropcache", ranks, lambda r: _dropcache(h, r), named=args.all)
        return 0

    return _run(args, body)


async def _dropcache(h: Any, rank: int | None) -> None:
    await h.rpc("kvs.dropcache", {}, nodeid=NODEID_ANY if rank is None else rank)


# ---------------------------------------------------------------- namespaces


def cmd_namespace(args: argparse.Namespace) -> int:
    args.what = f"kvs namespace {args.ns_cmd}"
    if args.ns_cmd == "watch":
        return _delegate("watch_namespaces", args)

    async def body(kvs: KVS) -> int:
        if args.ns_cmd == "list":
            roots = await kvs.namespace_list()
            if args.json:
                _emit(json.dumps([r.as_dict() for r in roots]))
                return 0
            _emit("NAMESPACE                                 OWNER      FLAGS")
            for r in roots:
                _emit(f"{r.namespace:<36} {r.owner & 0xFFFFFFFF:>10} 0x{r.flags:08X}")
            return 0
        for name in args.names:
            try:
                if args.ns_cmd == "create":
                    await kvs.namespace_create(name, args.owner, args.rootref)
                else:
                    await kvs.namespace_remove(name)
            except ErrnoError as exc:
                raise _fail(name, exc) from None
        return 0

    return _run(args, body)


# ---------------------------------------------------------------- leases


def cmd_lease(args: argparse.Namespace) -> int:
    args.what = f"kvs lease {args.lease_cmd}"

    async def body(kvs: KVS) -> int:
        what = "lease" if args.lease_cmd in ("grant", "list") else str(args.id)
        try:
            if args.lease_cmd == "list":
                _print_leases(await kvs.lease_list(), args.json)
            elif args.lease_cmd == "grant":
                lease = await kvs.lease(args.ttl, keepalive=False)
                _emit(str(lease.id))
            elif args.lease_cmd == "keepalive":
                _emit(f"{await kvs.lease_keepalive(args.id):g}")
            elif args.lease_cmd == "revoke":
                try:
                    await kvs.lease_revoke(args.id)
                except ErrnoError as exc:  # (-f: as rm -f, and as Lease.revoke)
                    if not (args.force and exc.errnum == errno.ENOENT):
                        raise
            else:
                _emit(json.dumps(await kvs.lease_info(args.id)))
        except ErrnoError as exc:
            raise _fail(what, exc) from None
        return 0

    return _run(args, body)


def _print_leases(leases: list[dict[str, Any]], as_json: bool) -> None:
    """``kvs lease list``: a table, id order (ttl and time left in seconds,
    the count of keys attached), or one JSON array."""
    if as_json:
        _emit(json.dumps(leases))
        return
    _emit(f"{'ID':>16} {'OWNER':>10} {'TTL':>8} {'LEFT':>8} {'KEYS':>6}")
    for lease in leases:
        _emit(f"{lease['id']:>16} {lease['owner']:>10} {lease['ttl']:>8g} "
              f"{lease['ttl_left']:>8.1f} {lease['key-count']:>6}")


LEASE_ENV = "KVBROKER_LEASE"
"""Where ``kvs lease run`` gives its command the lease's id."""


def cmd_lease_run(args: argparse.Namespace) -> int:
    """``kvbroker kvs lease run TTL [--] COMMAND...``: a lease held for as
    long as COMMAND runs (docs/cli.md, "kvs lease").  The keepalives come
    from this process, not from a loop beside the command, so that a
    SIGKILL of it (of the job it is in) ends them: the lease then expires
    within TTL, and a lock held with it cannot outlive its holder -- the
    etcd precedent is ``etcdctl lock NAME COMMAND``.  COMMAND is killed
    with it (Linux: :class:`~broker.command.Command`'s parent-death
    signal), so it does not go on as the lock's holder meanwhile."""
    command = command_args(args.cmdline)
    if not command:
        raise UsageError("no command given")
    args.what = "kvs lease run"

    async def body(kvs: KVS) -> int:
        try:
            lease = await kvs.lease(args.ttl, keepalive=False)
        except ErrnoError as exc:
            raise _fail("lease", exc) from None
        return await _run_under_lease(kvs, lease.id, lease.ttl, command)

    return _run(args, body)


def ttl_arg(text: str) -> float:
    """argparse ``type`` for a lease's TTL: a duration (``30``, ``10s``,
    ``2m``, as every other timeout here), from :data:`kvs.leases.MIN_TTL`
    to :data:`~kvs.leases.MAX_TTL` -- checked here, a usage error (exit 2,
    nothing sent), as the other bad numbers are: ``10s`` was "invalid float
    value" and ``0`` the rank's ``EINVAL`` (exit 1)."""
    from kvs.leases import MAX_TTL, MIN_TTL

    ttl = duration_arg(text)
    if not MIN_TTL <= ttl <= MAX_TTL:
        raise argparse.ArgumentTypeError(
            f"a lease's ttl must be {MIN_TTL:g} to {MAX_TTL:g} seconds, not {ttl:g}")
    return ttl


async def _run_under_lease(kvs: KVS, lease_id: int, ttl: float, command: list[str]) -> int:
    """Run ``command`` with ``$KVBROKER_LEASE``, keeping the lease alive
    until it exits, then revoke it (its keys go at once, not a ttl later);
    the command's status.  SIGINT, SIGTERM and SIGHUP are passed on to it,
    as ``exec`` and ``start`` do.  A lease found gone (or a connection that
    can no longer renew it) is said on stderr and the command is stopped:
    what it did under the lease (a lock) is no longer its own."""
    from broker.command import (
        Command,
        cannot_run_message,
        cannot_run_status,
        exit_code,
    )

    env = dict(os.environ, **{LEASE_ENV: str(lease_id)})
    try:
        cmd = Command.spawn(command, env)
    except OSError as exc:
        _warn(cannot_run_message(command[0], exc))
        await _revoke_after(kvs, lease_id, ttl)
        return cannot_run_status(exc)
    lost: str | None = None
    with cmd.forwarding_stop_signals():  # (no await since the spawn: no signal is missed)
        keeper = asyncio.ensure_future(_keep_lease(kvs, lease_id, ttl))
        exited = asyncio.ensure_future(cmd.wait())
        try:
            await asyncio.wait((exited, keeper), return_when=asyncio.FIRST_COMPLETED)
            if not exited.done():
                lost = keeper.result()
                _warn(f"kvs lease run: lease {lease_id} {lost}: stopping {command[0]} "
                      f"(pid {cmd.pid})")
                # (as Command.stop begins: at a terminal an interactive shell obeys SIGHUP)
                cmd.signal(signal.SIGTERM if cmd.own_group else signal.SIGHUP)
            code = await exited
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
    if lost is None:
        await _revoke_after(kvs, lease_id, ttl)
    return exit_code(code)


async def _keep_lease(kvs: KVS, lease_id: int, ttl: float) -> str:
    """Renew the lease every ttl/3 for as long as it can be; return why it
    cannot any more.  Not :class:`~kvs.client.Lease`'s task: that one ends
    in silence when the connection is lost, and here the command must be
    told.  A timeout (a busy rank 0) or another error is tried again at
    the next tick, as :class:`~kvs.client.Lease` does."""
    while True:
        await asyncio.sleep(ttl / 3)
        try:
            await asyncio.wait_for(kvs.lease_keepalive(lease_id), ttl / 3)
        except TimeoutError:
            continue
        except ErrnoError as exc:
            if exc.errnum == errno.ENOENT:
                return "was lost (it expired or was revoked)"
            if exc.errnum in (errno.ECONNRESET, errno.EPIPE):
                return ("can no longer be kept alive (connection to the broker lost; it "
                        f"expires within {ttl:g}s)")


async def _revoke_after(kvs: KVS, lease_id: int, ttl: float) -> None:
    """Revoke the lease once the command is done; one that ended already is
    no error.  A failure is said, not raised: the command's status is what
    the caller asked for, and the lease expires within its ttl anyway."""
    try:
        await kvs.lease_revoke(lease_id)
    except ErrnoError as exc:
        if exc.errnum != errno.ENOENT:
            _warn(f"kvs lease run: lease {lease_id} not revoked: {error_detail(exc)} "
                  f"(it expires within {ttl:g}s)")


# ---------------------------------------------------------------- eventlogs


def cmd_eventlog(args: argparse.Namespace) -> int:
    args.what = f"kvs eventlog {args.ev_cmd}"
    if args.ev_cmd == "wait-event":
        return _delegate("eventlog_wait_event", args)
    if args.ev_cmd == "get":
        if args.watch or args.waitcreate or args.stream:
            check_watch_options(args)
            return _delegate("eventlog_get", args)
        fmt = make_formatter(args)

        async def get(kvs: KVS) -> int:
            try:
                entries = await eventlog.get(kvs, args.key)
            except ErrnoError as exc:
                raise _fail(args.key, exc) from None
            count = getattr(args, "count", 0) or 0  # (at most N, as flux's, -w or not)
            for e in entries[:count] if count else entries:
                _emit(fmt.format(e))
            return 0

        return _run(args, get)

    context = " ".join(args.context) if args.context else None
    try:
        ops = TxnOps().append_event(args.key, args.name, context, timestamp=args.timestamp)
    except ErrnoError as exc:
        raise _fail(args.key, exc) from None

    async def append(kvs: KVS) -> int:
        await _commit(kvs, ops, args.key)
        return 0

    return _run(args, append)


# ---------------------------------------------------------------- parser


_NEGATIVE_NUMBER = re.compile(r"-\d+|-\d*\.\d+")


class _Parser(PermutingParser):
    """The parser of the ``kvs`` subcommands: options may sit between
    positionals (:class:`~broker.cliutil.PermutingParser`), and a negative
    number right after an option that takes a value is that value.

    argparse reads ``-1`` in ``kvs ls -w -1`` as ls's own ``-1`` flag, since
    a parser with such a flag takes every negative number for an option, and
    says only "-w/--width: expected one argument".  Given to ``-w`` (as
    ``-w=-1``), it is refused by the option's type, which says why: "must
    not be negative".  ``-w`` followed by a flag was an error anyway, so no
    command line that worked changes meaning.  (``--color``/``-L`` are
    :class:`~broker.cliutil.PermutingParser`'s.)"""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if args is not None:
            args = self._attach_negative_values(list(args))
        return super().parse_known_args(args, namespace)

    def _attach_negative_values(self, args: list[str]) -> list[str]:
        actions = self._option_string_actions  # noqa: SLF001 (no public lookup)
        out: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            if arg == "--":
                return out + args[i:]
            action = actions.get(arg)
            nxt = args[i + 1] if i + 1 < len(args) else ""
            if action is not None and action.nargs is None and _NEGATIVE_NUMBER.fullmatch(nxt):
                out.append(f"{arg}={nxt}")
                i += 2
                continue
            out.append(arg)
            i += 1
        return out


def _namespace(text: str) -> str:
    """argparse type of ``-N``/``-S``/``-D``/``-T`` and of ``namespace
    create``/``remove``'s names: an empty name is a
    usage error (it is no namespace; taken as the default, ``-N "$UNSET"``
    wrote to ``primary``), as ``KVS(h, "")`` is a ``ValueError``."""
    if not text:
        raise argparse.ArgumentTypeError(
            "must not be empty (leave the option out for the default namespace)")
    return text


def _ns(p: argparse.ArgumentParser) -> None:
    p.add_argument("-N", "--namespace", metavar="NS", type=_namespace,
                   help="KVS namespace (default: $KVBROKER_NAMESPACE or primary)")


def _reconnect(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reconnect", action="store_true",
                   help="if the rank restarts, connect again and go on watching, without "
                        "a repeat (a kvbroker extension)")


def _archive_chatter(p: argparse.ArgumentParser, done: str) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("-v", "--verbose", action="store_true",
                   help=f"list the keys {done} on stderr")
    g.add_argument("-q", "--quiet", action="store_true",
                   help="do not print the summary line")
    # Flux's tuning options, so its command lines run as written; here they
    # change nothing (reads and writes are windowed, there is no cache to
    # bypass, and no systemd to tell).
    p.add_argument("--maxreqs", type=non_negative_int, metavar="N",
                   help="accepted as flux's; no effect (requests are windowed here)")
    p.add_argument("--no-cache", action="store_true",
                   help="accepted as flux's; no effect")
    p.add_argument("--sd-notify", action="store_true",
                   help="accepted as flux's; no effect")


def _root_out(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("-O", "--treeobj-root", action="store_true",
                   help=f"print the resulting root (a dirref tree object) containing {what}")
    p.add_argument("-b", "--blobref", action="store_true",
                   help=f"print the blobref of the root containing {what}")
    p.add_argument("-s", "--sequence", action="store_true",
                   help=f"print the version (root sequence) containing {what}")


def _eventlog_format(p: argparse.ArgumentParser) -> None:
    p.add_argument("-u", "--unformatted", action="store_true",
                   help="print events in RFC 18 form (one JSON object a line)")
    p.add_argument("-H", "--human", action="store_true", help="human-readable timestamps")
    add_color_option(p)


def _conditions_args(p: argparse.ArgumentParser) -> None:
    """``--expect`` and ``--expect-missing`` (put, unlink)."""
    p.add_argument("--expect", action="append", default=[], metavar="KEY=VALUE",
                   help="commit only if KEY holds VALUE now, else fail and change "
                        "nothing (compare-and-swap; repeatable)")
    p.add_argument("--expect-missing", action="append", default=[], metavar="KEY",
                   help="commit only if KEY does not exist (repeatable)")


def register(subparsers: Any) -> None:
    """Add ``kvs`` and its subcommands to the ``kvbroker`` parser."""
    top = subparsers.add_parser("kvs", help="the key-value store (as flux kvs)",
                                description="Read and write the KVS (mirrors flux kvs).")
    sub = top.add_subparsers(dest="kvs_cmd", metavar="SUBCOMMAND", required=True,
                             parser_class=_Parser)

    p = sub.add_parser("get", help="print the value(s) stored under KEY(s)")
    _ns(p)
    p.add_argument("-r", "--raw", action="store_true", help="print value(s) as raw bytes")
    p.add_argument("-t", "--treeobj", action="store_true", help="print the RFC 11 tree object")
    p.add_argument("-a", "--at", metavar="TREEOBJ", help="look up relative to this root: "
                   "a blobref (getroot -b, put -b) or a dirref tree object (getroot, "
                   "get -t); not a version number")
    p.add_argument("-l", "--label", action="store_true", help="print KEY= before the value")
    p.add_argument("-w", "--watch", action="store_true", help="print the value and its changes")
    p.add_argument("-W", "--waitcreate", action="store_true", help="wait for KEY to be created")
    p.add_argument("-c", "--count", type=non_negative_int, default=0, metavar="COUNT",
                   help="with --watch, stop after COUNT values of each KEY")
    p.add_argument("-u", "--uniq", action="store_true",
                   help="with --watch, print only values that changed")
    p.add_argument("-A", "--append", action="store_true",
                   help="with --watch, print only what was appended")
    p.add_argument("-f", "--full", action="store_true",
                   help="with --watch, also notice changes of parent directories")
    p.add_argument("--deletes", action="store_true",
                   help="with --watch, print 'KEY (removed)' (with -t: null) when KEY is "
                        "removed and go on, waiting for it to come back, instead of "
                        "failing (a kvbroker extension)")
    p.add_argument("-S", "--stream", action="store_true",
                   help="return a large value in several answers")
    p.add_argument("--timeout", type=positive_float, metavar="SECONDS",
                   help="with --watch or --waitcreate, give up after SECONDS "
                        "(Connection timed out, exit 1)")
    _reconnect(p)
    p.add_argument("keys", nargs="+", metavar="KEY")
    p.set_defaults(func=cmd_get)

    p = sub.add_parser("put", help="store KEY=VALUE pairs in one transaction")
    _ns(p)
    _root_out(p, "the puts")
    p.add_argument("-r", "--raw", action="store_true",
                   help="VALUE - reads standard input (else '-' is the value)")
    p.add_argument("-t", "--treeobj", action="store_true",
                   help="VALUE is an RFC 11 tree object (- reads standard input)")
    p.add_argument("-n", "--no-merge", action="store_true",
                   help="never merge this commit with others")
    p.add_argument("-A", "--append", action="store_true", help="append to the current value(s)")
    p.add_argument("-S", "--sync", action="store_true",
                   help="return once the change is on stable storage")
    _conditions_args(p)
    p.add_argument("--lease", type=non_negative_int, metavar="ID",
                   help="attach the keys to lease ID: unlinked when it ends "
                        "(see kvs lease)")
    p.add_argument("pairs", nargs="+", metavar="KEY=VALUE")
    p.set_defaults(func=cmd_put)

    p = sub.add_parser("dir", help="print every key (and value) under a directory")
    _ns(p)
    p.add_argument("-R", "--recursive", action="store_true", help="descend into subdirectories")
    p.add_argument("-d", "--directory", action="store_true", help="print keys, not values")
    p.add_argument("-w", "--width", type=_dir_width, metavar="COLS",
                   help="cut lines to COLS columns, at least 4, and at a newline "
                        "(0: print values whole)")
    p.add_argument("-a", "--at", metavar="TREEOBJ",
                   help="read at this root (a blobref or a dirref tree object)")
    p.add_argument("--json", action="store_true",
                   help='print one JSON object, {KEY: VALUE}: values whole, as text, or '
                        '{"base64": ...} when not UTF-8; {"link": TARGET}, {"dir": true}')
    p.add_argument("key", nargs="?", default=".", metavar="KEY")
    p.set_defaults(func=cmd_dir)

    p = sub.add_parser("ls", help="list directories, like ls(1)")
    _ns(p)
    p.add_argument("-R", "--recursive", action="store_true", help="list subdirectories too")
    p.add_argument("-d", "--directory", action="store_true",
                   help="list directories themselves, not their contents")
    p.add_argument("-w", "--width", type=non_negative_int, metavar="COLS",
                   help="output width (0: no limit)")
    p.add_argument("-1", dest="one", action="store_true", help="one entry a line")
    p.add_argument("-F", "--classify", action="store_true",
                   help="mark directories with . and links with @")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    p.add_argument("keys", nargs="*", metavar="KEY")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("unlink", help="remove keys")
    _ns(p)
    _root_out(p, "the unlinks")
    p.add_argument("-R", "--recursive", action="store_true",
                   help="remove non-empty directories too")
    p.add_argument("-f", "--force", action="store_true", help="ignore missing keys")
    _conditions_args(p)
    p.add_argument("keys", nargs="+", metavar="KEY")
    p.set_defaults(func=cmd_unlink)

    p = sub.add_parser("link", help="make LINKNAME a symlink to TARGET")
    p.add_argument("-N", "--namespace", metavar="NS", type=_namespace, help="the link's namespace")
    p.add_argument("-T", "--target-namespace", metavar="NS", type=_namespace,
                   help="the target's namespace")
    _root_out(p, "the link")
    p.add_argument("target", metavar="TARGET")
    p.add_argument("linkname", metavar="LINKNAME")
    p.set_defaults(func=cmd_link)

    p = sub.add_parser("readlink", help="print the target of symlinks")
    _ns(p)
    p.add_argument("-a", "--at", metavar="TREEOBJ",
                   help="read at this root (a blobref or a dirref tree object)")
    p.add_argument("-o", "--namespace-only", action="store_true",
                   help="print only the namespace of a link that names one "
                        "(a link without one prints its target, as flux)")
    p.add_argument("-k", "--key-only", action="store_true",
                   help="print only the key of a link that names a namespace")
    p.add_argument("keys", nargs="+", metavar="KEY")
    p.set_defaults(func=cmd_readlink)

    p = sub.add_parser("mkdir", help="create empty directories")
    _ns(p)
    _root_out(p, "the new directories")
    p.add_argument("keys", nargs="+", metavar="KEY")
    p.set_defaults(func=cmd_mkdir)

    for name, text in (("copy", "copy SRC to DST (a directory by reference)"),
                       ("move", "move SRC to DST")):
        p = sub.add_parser(name, help=text)
        p.add_argument("-N", "--namespace", metavar="NS", type=_namespace,
                       help="SRC's and DST's namespace, unless -S or -D gives it "
                            "(default: $KVBROKER_NAMESPACE or primary)")
        p.add_argument("-S", "--src-namespace", metavar="NS", type=_namespace,
                       help="SRC's namespace")
        p.add_argument("-D", "--dst-namespace", metavar="NS", type=_namespace,
                       help="DST's namespace")
        p.add_argument("src", metavar="SRC")
        p.add_argument("dst", metavar="DST")
        p.set_defaults(func=cmd_copy)

    p = sub.add_parser("checkpoint", help="list the primary namespace's checkpoints, or "
                       "roll a stopped instance back to one, as flux content checkpoint",
                       description="Rank 0 with a statedir keeps the primary namespace's "
                       "checkpoint and the ones it replaced (content.max-checkpoints in all, "
                       "default 5), until kvs gc collects their versions.  Instance owner only.")
    csub = p.add_subparsers(dest="checkpoint_cmd", required=True, metavar="{list,update}")
    c = csub.add_parser("list", help="list the checkpoints kept, newest (index 0) first",
                        description="One line each: index (0: the one a restart resumes "
                        "from), sequence (the namespace's version), time (UTC), rootref.  "
                        "Online, or with --statedir DIR from a stopped instance.")
    c.add_argument("-n", "--no-header", action="store_true", help="no column headers")
    c.add_argument("-j", "--json", action="store_true",
                   help="each checkpoint's stored value, one JSON object a line")
    c.add_argument("--statedir", metavar="DIR", help="read a stopped instance's statedir")
    c.set_defaults(func=cmd_checkpoint)
    c = csub.add_parser("update", help="make ROOTREF the checkpoint a stopped instance "
                        "resumes from",
                        description="Make ROOTREF (a rootref checkpoint list printed, or "
                        "any directory's blobref) the primary namespace of the next start "
                        "of the stopped instance whose statedir is DIR, once its whole tree "
                        "is found in the store.  A kept checkpoint's root comes back at its "
                        "sequence, with its leases; any other at 0.  The checkpoint it "
                        "replaces is kept as index 1, so this can be undone.")
    c.add_argument("--statedir", metavar="DIR", help="the stopped instance's statedir "
                   "(required)")
    c.add_argument("rootref", metavar="ROOTREF")
    c.set_defaults(func=cmd_checkpoint)

    p = sub.add_parser("gc", help="remove old versions from the content store (online, "
                       "or offline with --statedir)",
                       description="Online (the default): rank 0 deletes every blob that "
                       "no namespace's current root, no root of the last kvs.gc-grace "
                       "seconds and no checkpoint reaches, while the instance runs; reads "
                       "at older roots then fail with ENOENT.  With --statedir DIR, offline: "
                       "delete every blob of a stopped instance's DIR/content.sqlite that "
                       "the KVS checkpoint (the primary namespace a restart brings back) "
                       "does not reach, then compact the file.")
    p.add_argument("--statedir", metavar="DIR",
                   help="collect the stopped instance that ran with this statedir "
                   "(kvbroker start --statedir)")
    p.add_argument("-n", "--dry-run", action="store_true",
                   help="only count what would be removed (offline only)")
    p.add_argument("--compact", action="store_true",
                   help="online: also rewrite content.sqlite to its new size (the store "
                   "waits meanwhile; refused with ENOSPC, before writing anything, "
                   "without room for a copy of what it keeps)")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("fsck", help="check that a tree is whole in the content store "
                       "(online, or offline with --statedir), as flux fsck",
                       description="Load every directory and every value's blobs of a "
                       "namespace's current root (online: -N NS, default primary) or of "
                       "--rootref REF, or with --statedir DIR of a stopped instance's KVS "
                       "checkpoint, and name each key that cannot be read whole (missing or "
                       "damaged blobs) on stderr; exit 1 if any.  Nothing is written but by "
                       "--repair.")
    p.add_argument("-N", "--namespace", metavar="NS",
                   help="online: the namespace whose root to check")
    p.add_argument("-r", "--rootref", metavar="REF", help="check this root instead")
    p.add_argument("--statedir", metavar="DIR",
                   help="check the checkpoint of the stopped instance of this statedir")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print each key as it is checked, each failing blob, and the total")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print no header line, and with --repair only the totals")
    p.add_argument("-R", "--repair", action="store_true",
                   help="with --statedir: unlink the damaged keys from the checkpoint, "
                   "keeping what can be read of a value as lost+found.KEY (a big directory "
                   "that lost shards: rebuilt from the others), and make that the "
                   "checkpoint (the damaged one kept before it)")
    p.add_argument("-j", "--job-aware", action="store_true",
                   help="with --repair: move a job's whole directory "
                   "(job.XXXX.XXXX.XXXX.XXXX) to lost+found if a key in it is damaged")
    p.set_defaults(func=cmd_fsck)

    p = sub.add_parser("dump", help="write a directory (or a stopped instance's "
                       "checkpoint) to a tar archive, as flux dump",
                       description="Write one version of a directory to a tar archive: a "
                       "value is a file (key a.b.c is a/b/c), a symlink a symlink (NS::key "
                       "for another namespace), an empty directory a directory.  The name's "
                       "ending picks the compression (.tar .tgz .tar.gz .tar.bz2 .tar.xz); "
                       "- writes a tar stream to stdout.")
    _ns(p)
    p.add_argument("--key", metavar="KEY", help="dump this directory (default: the root)")
    p.add_argument("-a", "--at", metavar="TREEOBJ",
                   help="dump at this root (a blobref or a dirref tree object)")
    p.add_argument("--checkpoint", action="store_true",
                   help="dump the KVS checkpoint of a stopped instance (offline)")
    p.add_argument("--statedir", metavar="DIR", help="that instance's statedir")
    p.add_argument("--index", type=non_negative_int, default=0, metavar="N",
                   help="with --checkpoint: the older checkpoint N as content checkpoint "
                   "list numbers them (default 0: the one the next start resumes from)")
    p.add_argument("--ignore-failed-read", action="store_true",
                   help="with --checkpoint: leave out (and name) a value or directory "
                   "whose blob the store lacks, or a big directory's shard, instead of "
                   "failing (a damaged store's salvage), as flux dump --ignore-failed-read")
    _archive_chatter(p, "dumped")
    p.add_argument("outfile", metavar="OUTFILE")
    p.set_defaults(func=cmd_dump)

    p = sub.add_parser("restore", help="make a key (or a stopped instance's checkpoint) "
                       "the directory a tar archive holds, as flux restore",
                       description="Read a tar archive (any compression; - reads stdin) "
                       "and make KEY that directory, whatever it held, in one commit.  "
                       "With --checkpoint, write it into a stopped instance's statedir as "
                       "the primary namespace of its next start (version 0).")
    _ns(p)
    p.add_argument("--key", metavar="KEY", help="the key to restore to (online)")
    p.add_argument("--checkpoint", action="store_true",
                   help="restore into the KVS checkpoint of a stopped instance (offline)")
    p.add_argument("--statedir", metavar="DIR", help="that instance's statedir (made if "
                   "missing)")
    p.add_argument("--size-limit", type=size_arg, metavar="SIZE",
                   help="leave out values over SIZE bytes (suffix k, M or G)")
    _archive_chatter(p, "restored")
    p.add_argument("infile", metavar="INFILE")
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser("watch-keys", help="print the keys each commit writes below KEY",
                       description="Print 'VERSION KEY' for every key a commit writes at or "
                       "below KEY (default: anywhere), or for a directory above it that it "
                       "replaces, as etcd's prefix watch; until interrupted, or COUNT "
                       "commits.  A kvbroker extension.")
    _ns(p)
    p.add_argument("-W", "--waitcreate", action="store_true",
                   help="wait for the namespace to exist")
    p.add_argument("-t", "--timeout", type=positive_float, metavar="SECONDS",
                   help="give up if the watch has not started in SECONDS (with -W: the "
                        "namespace was not created; or the rank did not answer): exit 1")
    p.add_argument("-c", "--count", type=non_negative_int, default=0, metavar="COUNT",
                   help="stop after COUNT commits")
    _reconnect(p)
    p.add_argument("-v", "--values", action="store_true",
                   help="print KEY=VALUE as of that version (KEY. a directory, "
                        "KEY (removed))")
    p.add_argument("-s", "--since", metavar="ROOT",
                   help="first print the keys changed since root ROOT (a blobref or "
                        "dirref, e.g. the last one seen), at the version the watch "
                        "starts at: a watcher that was away misses nothing")
    p.add_argument("key", nargs="?", default=".", metavar="KEY")
    p.set_defaults(func=lambda args: _delegate("watch_keys", args))

    p = sub.add_parser("dropcache", help="drop the KVS cache of this rank (or of every rank)")
    p.add_argument("-a", "--all", action="store_true", help="drop the cache of every rank")
    p.set_defaults(func=cmd_dropcache)

    p = sub.add_parser("version", help="print the namespace's version")
    _ns(p)
    p.set_defaults(func=cmd_version)

    p = sub.add_parser("wait", help="wait until this rank reaches VERSION")
    _ns(p)
    p.add_argument("-t", "--timeout", type=positive_float, metavar="SECONDS",
                   help="give up after this many seconds (exit 1)")
    p.add_argument("version", type=non_negative_int, metavar="VERSION")
    p.set_defaults(func=cmd_wait)

    p = sub.add_parser("sync", help="make everything committed so far durable",
                       description="Flush the content store to disk and checkpoint the "
                       "primary namespace (with a statedir), as put --sync does, without "
                       "writing anything: an empty --sync commit.")
    _ns(p)
    _root_out(p, "nothing new")
    p.set_defaults(func=cmd_sync)

    p = sub.add_parser("diff", help="print the keys that differ between two roots",
                       description="Print the keys at or below KEY whose entries differ "
                       "between root OLD and root NEW (default: the namespace's current "
                       "root), one per line, sorted: values, symlinks and empty "
                       "directories that came, went or changed, and every key below a "
                       "directory that came or went. A root is a blobref or a dirref tree "
                       "object (what getroot, put -b/-O and watch-keys print). Only what "
                       "changed between the two versions is read.")
    _ns(p)
    p.add_argument("-k", "--key", default=".", metavar="KEY",
                   help="compare at and below KEY only (default: the whole namespace)")
    p.add_argument("--name-status", action="store_true",
                   help="print how each key changed before it, and a tab: A (added), "
                   "D (removed) or M (changed), as git diff --name-status does")
    p.add_argument("old", metavar="OLD")
    p.add_argument("new", metavar="NEW", nargs="?")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("getroot", help="print the namespace's root")
    _ns(p)
    p.add_argument("-s", "--sequence", action="store_true", help="print the version")
    p.add_argument("-o", "--owner", action="store_true", help="print the owner's uid")
    p.add_argument("-b", "--blobref", action="store_true", help="print the root blobref")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.set_defaults(func=cmd_getroot)

    p = sub.add_parser("namespace", help="create, remove or list namespaces")
    nsub = p.add_subparsers(dest="ns_cmd", metavar="SUBCOMMAND", required=True)
    c = nsub.add_parser("create", help="create namespaces")
    c.add_argument("-o", "--owner", type=uid_int, metavar="UID",
                   help="owner (default: you)")
    c.add_argument("-r", "--rootref", metavar="ROOT",
                   help="start at this root: a blobref, or a dirref tree object "
                        "(what getroot prints)")
    c.add_argument("names", nargs="+", metavar="NS", type=_namespace)
    c = nsub.add_parser("remove", help="remove namespaces")
    c.add_argument("names", nargs="+", metavar="NS", type=_namespace)
    c = nsub.add_parser("list", help="list namespaces")
    c.add_argument("--json", action="store_true", help="print the list as JSON")
    c = nsub.add_parser("watch", help="print the namespaces that exist, then each one "
                        "created or removed",
                        description="Print 'exists NS' for each namespace named PREFIX... "
                        "that exists (that you own, for a guest), then 'created NS' and "
                        "'removed NS' as they happen, until interrupted or COUNT lines.  "
                        "A kvbroker extension.")
    c.add_argument("-c", "--count", type=non_negative_int, default=0, metavar="COUNT",
                   help="stop after COUNT lines")
    c.add_argument("--changes-only", action="store_true",
                   help="do not print the namespaces that exist, only changes")
    _reconnect(c)
    c.add_argument("--json", action="store_true", help="print each answer as JSON")
    c.add_argument("prefix", nargs="?", default="", metavar="PREFIX")
    p.set_defaults(func=cmd_namespace)

    p = sub.add_parser("lease", help="grant, list, keep alive, revoke or show a lease; run a "
                       "command under one")
    lsub = p.add_subparsers(dest="lease_cmd", metavar="SUBCOMMAND", required=True)
    c = lsub.add_parser("grant", help="grant a lease of TTL seconds and print its id")
    c.add_argument("ttl", type=ttl_arg, metavar="TTL")
    c = lsub.add_parser("list", help="list the live leases (yours; all for the owner)")
    c.add_argument("--json", action="store_true", help="print them as one JSON array")
    for name, text in (("keepalive", "give lease ID its full ttl again (print it)"),
                       ("revoke", "end lease ID now: its keys are unlinked"),
                       ("info", "print lease ID's ttl, time left and keys as JSON")):
        c = lsub.add_parser(name, help=text)
        c.add_argument("id", type=non_negative_int, metavar="ID")
        if name == "revoke":
            c.add_argument("-f", "--force", action="store_true",
                           help="a lease already gone (expired or revoked) is no error")
    c = lsub.add_parser(
        "run", help="run COMMAND under a lease of TTL seconds, kept alive while it runs",
        description="Grant a lease of TTL seconds, run COMMAND with its id in "
        f"${LEASE_ENV}, keep the lease alive while COMMAND runs and revoke it when "
        "COMMAND exits; exit with COMMAND's status.  If this process is killed, the "
        "lease expires within TTL and COMMAND is killed (Linux); if the lease is "
        "lost, COMMAND is sent SIGTERM.")
    c.add_argument("ttl", type=ttl_arg, metavar="TTL")
    c.add_argument("cmdline", nargs=argparse.REMAINDER, metavar="COMMAND")
    c.set_defaults(func=cmd_lease_run)
    p.set_defaults(func=cmd_lease)

    p = sub.add_parser("eventlog", help="append to, print or wait on an eventlog")
    esub = p.add_subparsers(dest="ev_cmd", metavar="SUBCOMMAND", required=True)
    e = esub.add_parser("append", help="append event NAME [CONTEXT-JSON] to KEY")
    _ns(e)
    e.add_argument("-t", "--timestamp", type=float, metavar="SECONDS",
                   help="event time in seconds since the epoch (default: now)")
    e.add_argument("key", metavar="KEY")
    e.add_argument("name", metavar="NAME")
    # (default: argparse lists a "*" positional without one among the missing)
    e.add_argument("context", nargs="*", metavar="CONTEXT", default=[],
                   help="a JSON object (words are joined with spaces)")
    e = esub.add_parser("get", help="print the events of KEY")
    _ns(e)
    e.add_argument("-W", "--waitcreate", action="store_true", help="wait for KEY to exist")
    e.add_argument("-w", "--watch", action="store_true", help="print new events as they come")
    e.add_argument("-c", "--count", type=non_negative_int, default=0, metavar="COUNT",
                   help="print at most COUNT events (with --watch: stop after them)")
    e.add_argument("-S", "--stream", action="store_true",
                   help="return a large eventlog in several answers")
    _reconnect(e)
    _eventlog_format(e)
    e.add_argument("key", metavar="KEY")
    e = esub.add_parser("wait-event", help="wait for event NAME in KEY")
    _ns(e)
    e.add_argument("-W", "--waitcreate", action="store_true", help="wait for KEY to exist")
    e.add_argument("-t", "--timeout", type=positive_float, metavar="SECONDS",
                   help="give up after this many seconds (more than 0; or a duration: "
                        "500ms, 5s, 2m)")
    e.add_argument("-q", "--quiet", action="store_true", help="do not print the event")
    e.add_argument("-v", "--verbose", action="store_true",
                   help="print every event up to the one awaited")
    _reconnect(e)
    _eventlog_format(e)
    e.add_argument("key", metavar="KEY")
    e.add_argument("event", metavar="NAME")
    p.set_defaults(func=cmd_eventlog)
