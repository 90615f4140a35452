"""``kvbroker archive create|list|extract|remove`` (Flux's ``flux archive``;
docs/cli.md "archive"): many files under one KVS key, ``archive.NAME``, in
RFC 37 form (:mod:`kvs.filearchive`), so that every rank can extract them.

* ``create``: walks the PATHs (everything is checked before anything is
  stored), stores the data of files over the small-file threshold in the
  content store, chunk by chunk (holes of sparse files left out), batched
  and a bounded window of requests in flight, under a hold so that a
  garbage collection during a long create does not take the first chunks
  (:class:`kvs.archive.BlobUploader`), then commits the archive in one
  transaction (``--preserve``: with ``archive.NAME_blobs``, a directory of
  one ``valref`` per blob, which the garbage collection follows).
* ``list``, ``extract``: read the key (``extract --waitcreate``: wait for
  it) and, for ``extract``, load the chunks ahead in a bounded window,
  writing each file through :class:`kvs.filearchive.Extractor` (never
  outside ``-C DIR``).
* ``remove``: unlinks ``archive.NAME`` and ``archive.NAME_blobs``.

A plugin command, as ``kvbroker kvs`` (pyproject's ``kvbroker.commands``):
the broker's own command line never imports the KVS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import math
import os
import stat
import sys
from collections import deque
from typing import TYPE_CHECKING, Any

from broker import jsontoml
from broker.cliutil import (
    CLIError,
    PermutingParser,
    TermCleansUp,
    UsageError,
    connect,
    duration_arg,
    errno_detail,
    print_err,
    run_async,
    size_int,
)
from broker.errors import ErrnoError, RemoteError

if TYPE_CHECKING:
    from kvs.client import KVS
    from kvs.treeobj import TreeObj

DEFAULT_NAME = "main"
PRIMARY = "primary"

LOAD_BATCH_BYTES = 4 << 20
LOAD_BATCH_BLOBS = 256
LOAD_WINDOW = 4
"""``extract``'s ``content.load`` requests: batches of at most this many
bytes (as the archive says) and blobs, at most this many in flight."""

_WAIT_FOREVER = "\0"
"""What a bare ``--waitcreate`` becomes (see :class:`_ArchiveParser`): no
command line can hold a NUL byte."""


class _ArchiveParser(PermutingParser):
    """``--waitcreate`` takes its FSD only attached (``--waitcreate=10s``),
    as Flux's optional arguments do: ``extract --waitcreate PATTERN`` keeps
    PATTERN a pattern."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if args is not None and "--waitcreate" in self._option_string_actions:
            args = list(args)
            end = args.index("--") if "--" in args else len(args)
            args[:end] = [f"--waitcreate={_WAIT_FOREVER}" if a == "--waitcreate" else a
                          for a in args[:end]]
        return super().parse_known_args(args, namespace)


def _waitcreate(text: str) -> float:
    """``--waitcreate[=FSD]``: seconds to wait (``inf``: no limit), more than
    0 (``0`` was taken, and failed as a connect that timed out, with the
    rank up and the archive there)."""
    if text == _WAIT_FOREVER:
        return math.inf
    seconds = duration_arg(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive duration (a bare "
                                         "--waitcreate waits as long as it takes)")
    return seconds


def register(sub: Any) -> None:
    s = sub.add_parser("archive", help="store many files under one KVS key, for every rank "
                       "to extract (as flux archive)")
    asub = s.add_subparsers(dest="archive_cmd", required=True, parser_class=_ArchiveParser)

    def common(p: argparse.ArgumentParser, verb: str) -> None:
        p.add_argument("-n", "--name", default=DEFAULT_NAME, metavar="NAME",
                       help=f"{verb} archive NAME, KVS key archive.NAME (default main)")
        p.add_argument("--no-force-primary", action="store_true",
                       help="use the default KVS namespace ($KVBROKER_NAMESPACE, else primary) "
                       "instead of always primary")

    c = asub.add_parser("create", help="archive files, directories and symbolic links under "
                        "archive.NAME",
                        description="Archive each PATH (directories recursively) under the "
                        "KVS key archive.NAME of the primary namespace, small files in the "
                        "key, larger ones' data in the content store.")
    c.add_argument("paths", nargs="+", metavar="PATH")
    common(c, "write")
    c.add_argument("-C", "--directory", metavar="DIR",
                   help="read the PATHs relative to DIR (they are stored as given)")
    how = c.add_mutually_exclusive_group()
    how.add_argument("--overwrite", action="store_true",
                     help="replace archive NAME if it exists (else that is an error)")
    how.add_argument("--append", action="store_true",
                     help="add to archive NAME if it exists (a PATH it has is replaced)")
    c.add_argument("--preserve", action="store_true",
                   help="also write archive.NAME_blobs, so that the content store's garbage "
                   "collection (kvs gc, a restart's) keeps the data")
    c.add_argument("-v", "--verbose", action="count", default=0,
                   help="name each file on stderr as it is archived")
    c.add_argument("--chunksize", type=size_int, default=None, metavar="N",
                   help="largest blob a file's data is cut into, in bytes, with K, M or G "
                   "(default 1M; 0: no limit)")
    c.add_argument("--small-file-threshold", type=size_int, default=None, metavar="N",
                   help="files of at most N bytes are kept in the key itself (default 1K; 0: "
                   "every file with data goes to the content store)")
    c.add_argument("--mmap", action="store_true",
                   help="(Flux's; not built here: refused, see docs/cli.md)")

    li = asub.add_parser("list", help="list the files of archive NAME")
    li.add_argument("pattern", nargs="?", metavar="PATTERN",
                    help="only the paths matching this glob")
    common(li, "read")
    li.add_argument("-l", "--long", action="store_true",
                    help="with type, permissions and size: f 0644     2048 PATH")
    li.add_argument("--raw", action="store_true",
                    help="print the RFC 37 file objects, as JSON, one a line")

    e = asub.add_parser("extract", help="write out the files of archive NAME")
    e.add_argument("pattern", nargs="?", metavar="PATTERN",
                   help="only the paths matching this glob")
    common(e, "read")
    e.add_argument("-C", "--directory", metavar="DIR",
                   help="extract into DIR (default: the working directory)")
    e.add_argument("-t", "--list-only", action="store_true",
                   help="list the files instead (with -v, in the long form)")
    e.add_argument("-v", "--verbose", action="count", default=0,
                   help="name each file on stderr as it is extracted")
    e.add_argument("--overwrite", action="store_true",
                   help="replace existing files (else one is an error)")
    e.add_argument("--waitcreate", type=_waitcreate, default=None, metavar="FSD",
                   help="wait for archive.NAME to be created; written --waitcreate=FSD, give "
                   "up after FSD (a duration: 30, 10s, 1m)")

    r = asub.add_parser("remove", help="remove archive NAME (archive.NAME and archive."
                        "NAME_blobs)")
    common(r, "remove")
    r.add_argument("-f", "--force", action="store_true",
                   help="an archive that does not exist is no error")
    s.set_defaults(func=cmd_archive)


def cmd_archive(args: argparse.Namespace) -> int:
    args.what = f"archive {args.archive_cmd}"
    if not args.name:
        raise UsageError("--name must not be empty")
    if any(not part for part in args.name.split(".")):
        # ("..": the key "archive" itself, which the next create replaced;
        # "a..b": archive.a.b, another name's)
        raise UsageError(f"--name {args.name}: an empty part (a leading, trailing or "
                         "doubled '.'): the key archive.NAME would be another")
    from kvs.client import default_namespace

    args.namespace = default_namespace(None) if args.no_force_primary else PRIMARY
    args.key = f"archive.{args.name}"
    run = {"create": _create, "list": _list, "extract": _extract, "remove": _remove}
    return run[args.archive_cmd](args)


def _kvs_call(args: argparse.Namespace, body: Any, term: TermCleansUp | None = None) -> int:
    from kvs.client import KVS

    wait = getattr(args, "waitcreate", None)
    # (extract --waitcreate=FSD bounds connecting too: an ssh:// host that
    # never answers kept it waiting for ever, as kvs get --timeout did)
    limit = wait if wait is not None and math.isfinite(wait) else None

    async def main() -> int | None:
        async with await connect(timeout=limit) as h:
            return int(await body(KVS(h, args.namespace)) or 0)

    try:
        return run_async(args, main, term=term)
    finally:
        sys.stdout.flush()


def _fail(args: argparse.Namespace, detail: str) -> CLIError:
    return CLIError(args.what, detail=detail)


def _detail(exc: ErrnoError, name: str) -> str:
    """``strerror`` and the service's words, unless they only restate
    ``name`` (a key, a blobref) and the error."""
    if exc.errstr and name in exc.errstr:
        return os.strerror(exc.errnum)
    return errno_detail(exc)


async def _read_archive(args: argparse.Namespace, kvs: KVS,
                        wait: float | None = None) -> list[dict[str, Any]]:
    """The file objects of ``archive.NAME`` (waiting ``wait`` seconds for it
    to be created, if given), checked."""
    from kvs.filearchive import BadArchive, file_objects

    try:
        if wait is None:
            data = await kvs.get(args.key)
        else:
            entry = await kvs.wait_create(args.key, None if math.isinf(wait) else wait)
            data = entry.value if entry.value is not None else b""
    except TimeoutError:
        raise _fail(args, f"{args.key}: not created within {wait:g}s (namespace "
                          f"{args.namespace})") from None
    except ErrnoError as exc:
        raise _fail(args, f"{args.key}: {_detail(exc, args.key)}") from None
    try:
        return file_objects(jsontoml.loads_json(data))
    except (ValueError, BadArchive) as exc:
        raise _fail(args, f"{args.key}: {exc}" if isinstance(exc, BadArchive) else
                    f"{args.key}: not an RFC 37 archive (not JSON: {exc})") from None


def _select(args: argparse.Namespace, objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from kvs.filearchive import matches

    chosen = [o for o in objs if matches(o, args.pattern)]
    if args.pattern is not None and not chosen:
        print_err(f"{args.what}: no files matched pattern '{args.pattern}'")
    return chosen


# ---------------------------------------------------------------- create


def _create(args: argparse.Namespace) -> int:
    from kvs.filearchive import DEFAULT_CHUNKSIZE, DEFAULT_SMALL_FILE_THRESHOLD

    if args.mmap:
        raise _fail(args, "--mmap is not built in kvbroker: rank 0 would have to map this "
                    "host's files into its own process and serve their blobs from the map; "
                    "drop --mmap (the data is copied into the content store)")
    if args.chunksize is None:
        args.chunksize = DEFAULT_CHUNKSIZE
    if args.small_file_threshold is None:
        args.small_file_threshold = DEFAULT_SMALL_FILE_THRESHOLD
    if args.directory is not None and not os.path.isdir(args.directory):
        detail = "Not a directory" if os.path.exists(args.directory) else \
            os.strerror(errno.ENOENT)
        raise _fail(args, f"{args.directory}: {detail}")
    sources = _walk(args)
    return _kvs_call(args, lambda kvs: _create_in(args, kvs, sources))


def _walk(args: argparse.Namespace) -> list[Any]:
    """Everything to archive, checked before anything is stored."""
    from kvs.filearchive import ArchiveInputError, walk

    try:
        sources = list(walk(args.paths, args.directory))
    except ArchiveInputError as exc:
        raise _fail(args, str(exc)) from None
    # A path met twice (given twice, "./x" and "x", or "d d/e": d has d/e)
    # is one file: archived twice, its second entry made every extract fail
    # with "File exists".
    unique: dict[str, Any] = {}
    for src in sources:
        unique.setdefault(src.path, src)
    return list(unique.values())


async def _create_in(args: argparse.Namespace, kvs: KVS, sources: list[Any]) -> int:
    from kvs.archive import ArchiveError, BlobUploader
    from kvs.client import TxnOps

    old: list[dict[str, Any]] = []
    old_data = await kvs.get(args.key, None)
    preserve = args.preserve
    if old_data is not None and not (args.overwrite or args.append):
        raise _fail(args, f"{args.key}: key exists (give --overwrite to replace it, or "
                          "--append to add to it)")
    if old_data is not None and args.append:
        old = await _read_archive(args, kvs)
        # an archive made with --preserve stays whole: its new blobs are kept too
        preserve = preserve or await kvs.exists(f"{args.key}_blobs")
    h = kvs.handle
    hash_name = str(await h.attr_get("content.hash"))
    limit = int(await h.attr_get("content.blob-size-limit"))
    if args.chunksize > limit:
        raise _fail(args, f"--chunksize: blobs of up to {args.chunksize} bytes exceed "
                          f"content.blob-size-limit ({limit}): give a smaller --chunksize")
    big = next((s for s in sources if args.chunksize == 0 and stat.S_ISREG(s.st.st_mode)
                and s.st.st_size > limit), None)
    if big is not None:
        raise _fail(args, f"--chunksize 0: {big.path} ({big.st.st_size} bytes) would be one "
                          f"blob, over content.blob-size-limit ({limit}): give a --chunksize "
                          f"of at most {limit}")
    uploader = BlobUploader(h, purpose="archive")
    new: list[dict[str, Any]] = []
    try:
        try:
            for src in sources:
                if args.verbose:
                    print(src.path, file=sys.stderr, flush=True)
                new.append(await _file_object(args, src, uploader, hash_name))
            await uploader.flush()
        except ErrnoError as exc:  # (a batch holds several files' chunks: no one file named)
            raise _fail(args, f"storing file data in the content store: "
                              f"{errno_detail(exc)}") from None
        ops = TxnOps()
        paths = {o["path"] for o in new}
        objs = [o for o in old if o["path"] not in paths] + new
        blobs_key = f"{args.key}_blobs"
        if old_data is None:
            ops.expect_missing(args.key)  # (a create meanwhile: refused, not replaced)
        elif args.append:
            ops.expect_raw(args.key, old_data)  # (an append meanwhile: not lost)
        else:
            ops.unlink(blobs_key)
        ops.put(args.key, objs)
        if preserve:
            from kvs import treeobj

            live = {ref for o in objs for ref in _refs(o)}
            for o in old:
                for ref in _refs(o):
                    if ref not in live:
                        ops.unlink(f"{blobs_key}.{ref}")
            for ref in sorted({ref for o in new for ref in _refs(o)}):
                ops.put_treeobj(f"{blobs_key}.{ref}", treeobj.valref([ref]))
        try:
            await kvs.commit(ops)
        except ErrnoError as exc:
            if exc.errnum == errno.ECANCELED:
                raise _fail(args, f"{args.key}: changed meanwhile (another archive create?): "
                                  "nothing was committed; try again") from None
            raise _fail(args, f"{args.key}: {_detail(exc, args.key)}") from None
    except ArchiveError as exc:
        raise _fail(args, str(exc)) from None
    finally:
        uploader.cancel()
        await uploader.release()
    return 0


def _refs(obj: dict[str, Any]) -> list[str]:
    from kvs.filearchive import blobrefs_of

    return blobrefs_of(obj)


async def _file_object(args: argparse.Namespace, src: Any, uploader: Any,
                       hash_name: str) -> dict[str, Any]:
    """The file object of one :class:`~kvs.filearchive.Source`; a large
    file's chunks go to ``uploader`` as they are read."""
    from broker.content.blobref import hash_blob
    from kvs import filearchive as fa

    mode = src.st.st_mode
    if stat.S_ISDIR(mode):
        return fa.directory_object(src.path, src.st)
    if stat.S_ISLNK(mode):
        return fa.symlink_object(src.path, src.st, src.target or "")
    try:
        fd = os.open(src.full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise _fail(args, f"{src.full}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _fail(args, f"{src.full}: changed into another type of file while archived")
        size = st.st_size
        chunks = fa.data_chunks(fd, size, args.chunksize)
        if not chunks:
            return fa.empty_object(src.path, st)
        if size <= args.small_file_threshold:
            data = os.pread(fd, size, 0)
            if len(data) != size:
                raise _fail(args, f"{src.full}: changed while archived (short read)")
            return fa.inline_object(src.path, st, data)
        vec: list[list[Any]] = []
        for offset, length in chunks:
            data = os.pread(fd, length, offset)
            if len(data) != length:
                raise _fail(args, f"{src.full}: changed while archived (short read)")
            ref = hash_blob(data, hash_name)
            vec.append([offset, length, ref])
            await uploader.put(ref, data)
        return fa.blobvec_object(src.path, st, size, vec)
    except OSError as exc:
        raise _fail(args, f"{src.full}: {exc.strerror}") from None
    finally:
        os.close(fd)


# ---------------------------------------------------------------- list


def _list(args: argparse.Namespace) -> int:
    from kvs.filearchive import pretty

    async def body(kvs: KVS) -> int:
        for obj in _select(args, await _read_archive(args, kvs)):
            print(json.dumps(obj, separators=(",", ":")) if args.raw
                  else pretty(obj, args.long))
        return 0

    return _kvs_call(args, body)


# ---------------------------------------------------------------- extract


def _extract(args: argparse.Namespace) -> int:
    directory = args.directory or "."
    if not args.list_only and not os.path.isdir(directory):
        detail = "Not a directory" if os.path.exists(directory) else os.strerror(errno.ENOENT)
        raise _fail(args, f"{directory}: {detail}")
    with TermCleansUp() as term:  # (a file cut short is removed, as for Ctrl-C)
        return _kvs_call(args, lambda kvs: _extract_in(args, kvs, directory), term)


async def _extract_in(args: argparse.Namespace, kvs: KVS, directory: str) -> int:
    from kvs import filearchive as fa

    objs = _select(args, await _read_archive(args, kvs, args.waitcreate))
    if args.list_only:
        for obj in objs:
            print(fa.pretty(obj, bool(args.verbose)))
        return 0
    try:
        for obj in objs:  # every path checked before anything is written
            fa.safe_parts(obj["path"])
    except fa.UnsafePath as exc:
        raise _fail(args, f"{exc}: nothing was extracted") from None
    wanted = [(e[2], e[1], o["path"], e[0]) for o in objs if o.get("encoding") == "blobvec"
              for e in o["data"]]
    loads = _Prefetch(kvs.handle, [(ref, size) for ref, size, _, _ in wanted])
    try:
        with fa.Extractor(directory, overwrite=args.overwrite) as ex:
            for obj in objs:
                if args.verbose:
                    print(obj["path"], file=sys.stderr, flush=True)
                await _write_one(args, ex, obj, loads, kvs)
            ex.finish()
    except fa.UnsafePath as exc:
        raise _fail(args, str(exc)) from None
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        raise _fail(args, f"{where}{exc.strerror or exc}") from None
    finally:
        loads.close()
    return 0


async def _write_one(args: argparse.Namespace, ex: Any, obj: dict[str, Any],
                     loads: _Prefetch, kvs: KVS) -> None:
    """Write one file object; an error of the file system names its path
    (a ``pwrite`` or ``ftruncate`` past a size limit said only ``File too
    large``)."""
    try:
        await _write_object(args, ex, obj, loads, kvs)
    except OSError as exc:
        if exc.filename or not exc.errno:
            raise
        raise OSError(exc.errno, exc.strerror, obj["path"]) from None


async def _write_object(args: argparse.Namespace, ex: Any, obj: dict[str, Any],
                        loads: _Prefetch, kvs: KVS) -> None:
    from kvs.filearchive import write_at

    mode = int(obj["mode"])
    if stat.S_ISDIR(mode):
        ex.directory(obj)
        return
    if stat.S_ISLNK(mode):
        ex.symlink(obj)
        return
    fd = ex.create_file(obj)
    try:
        if obj.get("encoding") == "blobvec":
            for offset, size, ref in obj["data"]:
                try:
                    try:
                        data = await loads.next()
                    except ErrnoError as exc:
                        if exc.errnum != errno.ENOENT:
                            raise
                        data = await _preserved_inline(kvs, args.key, ref, exc)
                except ErrnoError as exc:
                    hint = (" (its blobs were collected? archive create --preserve keeps "
                            "them)" if exc.errnum == errno.ENOENT else "")
                    raise _fail(args, f"{obj['path']}: cannot load offset={offset} "
                                      f"size={size} from {ref}: {_detail(exc, ref)}{hint}"
                                ) from None
                if len(data) != size:
                    raise _fail(args, f"{obj['path']}: blob {ref} holds {len(data)} bytes, "
                                      f"the archive says {size}")
                write_at(fd, data, offset)
    except BaseException:
        ex.abandon_file(fd, obj)
        raise
    ex.finish_file(fd, obj)


async def _preserved_inline(kvs: KVS, key: str, ref: str, missing: ErrnoError) -> bytes:
    """Blob ``ref`` as the preserved archive keeps it in ``KEY_blobs.REF``
    when the content store has no such blob: ``kvs dump``/``kvs restore``
    carry that ``valref`` as its value and stores one of at most 64 bytes
    (a file's tail just past a chunk boundary) inside its directory, so the
    blob itself is gone while its bytes are still in the KVS.  Its hash is
    checked; without it (an archive made without ``--preserve``), ``missing``."""
    from broker.content.blobref import hash_blob

    try:
        data = await kvs.get(f"{key}_blobs.{ref}", None)
    except ErrnoError:  # (there, but a valref of the missing blob itself)
        raise missing from None
    if data is None or hash_blob(data, ref.partition("-")[0]) != ref:
        raise missing
    return data


class _Prefetch:
    """The blobs ``wants`` names (``(blobref, size)``, in the order they
    will be asked for by :meth:`next`), loaded ahead: batches of at most
    :data:`LOAD_BATCH_BYTES` and :data:`LOAD_BATCH_BLOBS`, at most
    :data:`LOAD_WINDOW` ``content.load`` requests in flight.  A blob that
    cannot be loaded raises its ``ErrnoError`` when its turn comes."""

    def __init__(self, h: Any, wants: list[tuple[str, int]]) -> None:
        self.h = h
        self.batches: deque[list[str]] = deque()
        batch: list[str] = []
        size = 0
        for ref, n in wants:
            if batch and (size + n > LOAD_BATCH_BYTES or len(batch) >= LOAD_BATCH_BLOBS):
                self.batches.append(batch)
                batch, size = [], 0
            batch.append(ref)
            size += n
        if batch:
            self.batches.append(batch)
        self.pending: deque[asyncio.Future[list[bytes | ErrnoError]]] = deque()
        self.ready: deque[bytes | ErrnoError] = deque()

    def _fill(self) -> None:
        while self.batches and len(self.pending) < LOAD_WINDOW:
            self.pending.append(asyncio.ensure_future(self._load(self.batches.popleft())))

    async def _load(self, refs: list[str]) -> list[bytes | ErrnoError]:
        out: list[bytes | ErrnoError] = []
        todo = refs
        while todo:
            answer = (await self.h.rpc("content.load", {"blobrefs": todo}))["data"]
            if not answer:
                raise ErrnoError(errno.EPROTO, "content.load answered no blob")
            for got in answer:
                out.append(bytes(got) if isinstance(got, (bytes, bytearray)) else
                           RemoteError(int(got[0]), str(got[1])))
            todo = todo[len(answer):]
        return out

    async def next(self) -> bytes:
        if not self.ready:
            self._fill()
            if not self.pending:
                raise ErrnoError(errno.EPROTO, "no more blobs to load")
            self.ready.extend(await self.pending.popleft())
            self._fill()
        got = self.ready.popleft()
        if isinstance(got, ErrnoError):
            raise got
        return got

    def close(self) -> None:
        for fut in self.pending:
            fut.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                if fut.done():
                    fut.exception()
        self.pending.clear()


# ---------------------------------------------------------------- remove


def _remove(args: argparse.Namespace) -> int:
    from kvs.client import TxnOps

    async def body(kvs: KVS) -> int:
        if not args.force:
            await _check_removable(args, kvs)
        await kvs.commit(TxnOps().unlink(args.key).unlink(f"{args.key}_blobs"))
        return 0

    return _kvs_call(args, body)


async def _check_removable(args: argparse.Namespace, kvs: KVS) -> None:
    """Refuse a remove (without ``-f``) of an archive that is not there, or
    of ``archive.NAME`` that is a directory: the archives named
    ``NAME.OTHER`` are below it, and unlinking it took them all, exit 0.
    Flux's looks the key up as a value, so a directory "does not exist",
    and neither does a symlink to nothing: links are followed here too."""
    from kvs.client import kind

    try:  # (its tree object only: an archive's index can be megabytes)
        found = await _treeobj_followed(kvs, args.key)
    except ErrnoError as exc:
        if exc.errnum == errno.ENOENT:
            raise _fail(args, f"{args.key} does not exist") from None
        raise _fail(args, f"{args.key}: {_detail(exc, args.key)}") from None
    if kind(found) == "dir":
        raise _fail(args, f"{args.key} is not an archive: a directory (the archives "
                          f"named {args.name}.* are below it; -f removes them all)")


async def _treeobj_followed(kvs: KVS, key: str) -> TreeObj:
    """The tree object ``key`` names, its symlinks followed (into their
    namespaces) as a value's lookup follows them: ``ENOENT`` for a link to
    nothing, ``ELOOP`` past :data:`kvs.lookup.SYMLINK_MAX` links.  Asked as
    tree objects, so a large value is never read whole."""
    from kvs.client import Link, kind
    from kvs.lookup import SYMLINK_MAX

    found = await kvs.get_treeobj(key)
    for _ in range(SYMLINK_MAX):
        if kind(found) != "symlink":
            return found
        link = Link.from_treeobj(found)
        if link.namespace is not None:
            kvs = kvs.with_namespace(link.namespace)
        found = await kvs.get_treeobj(link.target)
    if kind(found) == "symlink":
        raise ErrnoError(errno.ELOOP, f"more than {SYMLINK_MAX} links followed")
    return found
