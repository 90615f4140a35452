"""KVS snapshots as tar archives: ``kvbroker kvs dump`` and ``kvs restore``.

The format is Flux's (``flux dump`` / ``flux restore``), so an archive moves
between the two systems and opens with ``tar``:

* a value is a regular file whose path is its key with ``.`` turned into
  ``/`` (``a.b.c`` -> ``a/b/c``), mode 0644, owned by whoever dumped it,
  its modification time the dump's (or the checkpoint's);
* a symlink is a symlink whose target names the other namespace, if any,
  as ``NS::key``;
* directories are implied by the paths.  Flux leaves out empty
  directories; here an empty directory is a directory entry, so a dump
  restores exactly (Flux's restore skips such entries: nothing is lost
  there either).

A dump reads *one* version, whatever commits meanwhile.  Online it reads
through ``kvs.lookup`` pinned to one tree: the directory's own for the
instance owner (even through a link into another namespace), its
namespace's root for a guest (who may read only there, and can so dump a
namespace of its own).  Offline (``--checkpoint``) it reads a stopped
instance's content store.  A named archive appears only when whole.

Reading is strict where :mod:`tarfile` is lenient: a damaged header or a
missing end-of-archive marker is an error, not the end of the archive, and
a path that is both a value and a directory is refused -- a restore never
replaces a key with part of what was dumped.

A restore builds the tree on the client with the commit engine
(:func:`kvs.txn.apply` on an empty root, so directories, big directories
and values come out exactly as the KVS itself would store them), then:

* online, as the instance owner: stores the blobs (``content.store``,
  batched, a bounded window; each value's as soon as it is read, so the
  client holds the archive's structure, not its data) and commits one op
  putting a ``dirref`` to the new tree at the key -- atomic whatever the
  size, and rank 0 only stores blobs.  A value over the instance's
  ``content.blob-size-limit`` is read and stored a blob at a time, and
  becomes a ``valref`` of those blobs (:mod:`kvs.valuesplit`): the shape
  appends give a value that grew past the limit, which Flux's restore
  cannot store;
* online, as a guest (``content.store`` is the owner's): one transaction
  writing every key below the key -- atomic too, but bounded by the
  commit's limits;
* offline (``--checkpoint``): writes the blobs into a stopped instance's
  ``content.sqlite`` and makes the new tree the KVS checkpoint, the primary
  namespace of the next start.
"""

from __future__ import annotations

import asyncio
import bz2
import contextlib
import errno
import getpass
import gzip
import io
import lzma
import os
import secrets
import sqlite3
import sys
import tarfile
import time
import zlib
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from contextlib import aclosing, contextmanager, suppress
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Literal, Self

import msgpack

from broker.content import blobref, locks, storefile
from broker.content.module import DEFAULT_BLOB_LIMIT
from broker.content.sqlite import STORE_FILE, SqliteStore, StoreLocked, open_to_read
from broker.content.sqlite import lasting as store_lasting
from broker.errors import ErrnoError, RemoteError
from broker.launch import StartError, private_dir
from kvs import shards, treeobj, txn
from kvs.client import READ_WINDOW, Link, pin_dir, read_tree
from kvs.keys import (
    MAX_DEPTH,
    check_length,
    check_target_length,
    join,
    normalize,
    parse_ns_target,
    split,
)
from kvs.namespaces import CHECKPOINT_KEY
from kvs.treeobj import BlobCache, NeedBlobs, TreeObj
from kvs.txn import APPEND, MAX_OPS
from kvs.valuesplit import split_value

if TYPE_CHECKING:
    from kvs.client import KVS, Dir, RootSpec

__all__ = ["ArchiveError", "BlobUploader", "CheckedStore", "Item", "Report", "build", "dump",
           "dump_checkpoint", "read_items", "restore", "restore_checkpoint"]


SUFFIXES = {".tar": "", ".tgz": "gz", ".tar.gz": "gz", ".tar.bz2": "bz2", ".tar.xz": "xz"}
"""Archive name endings and their compression (``-`` is a plain tar stream)."""

STORE_BATCH_BYTES = 4 << 20
STORE_BATCH_BLOBS = 1024
STORE_WINDOW = 4
"""A restore's ``content.store`` requests: at most this many batches in flight."""


class ArchiveError(Exception):
    """A dump or restore that cannot go on; the message says why (one line).
    ``errnum``: the errno a service answers it with (a start's
    ``content.restore`` refused): ``EIO`` unless the cause says otherwise
    (a store in use ``EBUSY``, a read-only one ``EROFS``, ...).
    ``lasting``: a store that every start would find so (a newer format, a
    damaged file: :func:`broker.content.sqlite.lasting`)."""

    def __init__(self, message: str, errnum: int = errno.EIO, *,
                 lasting: bool = False) -> None:
        super().__init__(message)
        self.errnum = errnum
        self.lasting = lasting


@dataclass(frozen=True, slots=True)
class Item:
    """One archive entry: a value, a symlink, or an empty directory."""

    key: str
    """Normalised, relative to the dumped (or restored) directory."""
    kind: Literal["value", "symlink", "dir"]
    data: bytes = b""
    """A value's bytes (empty when it comes in :attr:`parts`)."""
    target: str = ""
    """A symlink's target, ``NS::key`` when it names a namespace."""
    parts: Iterator[bytes] | None = field(default=None, compare=False, repr=False)
    """A value over the blob limit a restore was given: its bytes as the
    blobs it is to be stored in (:mod:`kvs.valuesplit`), read from the
    archive as they are taken -- all of them, and before the next entry is
    read (:func:`read_items` refuses them after that)."""
    size: int = field(default=-1, compare=False)
    """A value's length in bytes (given with :attr:`parts`, else of :attr:`data`)."""

    def __post_init__(self) -> None:
        if self.size < 0:
            object.__setattr__(self, "size", len(self.data))  # (frozen)


@dataclass
class Report:
    """What a dump or restore did."""

    keys: int = 0
    """Values and symlinks written."""
    dirs: int = 0
    """Empty directories written (a restore: the directory entries nothing
    else in the archive lies below)."""
    bytes: int = 0
    """Bytes of values (a path the archive gives twice counts once, as its
    last entry)."""
    blobs: int = 0
    """Blobs stored (a restore)."""
    rootref: str = ""
    """A restore: the restored tree's blobref.  A dump: the blobref it read
    at -- the dumped directory's own (the instance owner), else its
    namespace's root (a guest)."""
    skipped: list[str] = field(default_factory=list)
    """Why entries were left out, one line each: of an archive (a restore),
    or of a damaged tree (a checkpoint dump that ignores failed reads)."""


# ---------------------------------------------------------------- paths


def key_to_path(key: str) -> str | None:
    """The archive path of ``key`` (``a.b`` -> ``a/b``); None when a name in
    it holds a ``/``, which a path cannot tell from a separator."""
    parts = split(key)
    if any("/" in p for p in parts):
        return None
    return "/".join(parts)


def path_to_key(path: str) -> str | None:
    """The key of archive ``path`` (``./a/b`` -> ``a.b``); None for a path
    with ``..`` (it cannot mean a key) or none at all (the top directory).
    A name holding ``.`` becomes several levels, as a key would read."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    return normalize(".".join(parts))


# ---------------------------------------------------------------- writing


def _mode(name: str) -> str:
    for suffix, comp in SUFFIXES.items():
        if name.endswith(suffix):
            return f"w:{comp}" if comp else "w"
    raise ArchiveError(f"{name}: unknown archive type (name it {', '.join(SUFFIXES)}, "
                       "or - for a tar stream on stdout)")


class _Writer:
    """A tar archive being written: one entry per :class:`Item`.

    A named archive is written under a temporary name beside it and renamed
    when complete (:meth:`close`), so a dump that fails half way leaves no
    archive that looks whole -- and an older archive of that name intact."""

    def __init__(self, out: str | IO[bytes], mtime: float) -> None:
        self.final: str | None = None
        self.tmp: str | None = None
        self.stream = out == "-"
        if out == "-":
            if sys.stdout.isatty():
                raise ArchiveError("- writes the archive to stdout, which is a terminal: "
                                   "redirect it, or name a file")
            self.tar = tarfile.open(fileobj=sys.stdout.buffer, mode="w|")
        elif isinstance(out, str):
            mode = _mode(out)
            if os.path.isdir(out):
                raise ArchiveError(f"{out}: is a directory")
            tmp = f"{out}.{os.getpid()}-{secrets.token_hex(4)}.part"
            try:  # (mode 0666 less the umask, as any new file)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except OSError as exc:
                raise ArchiveError(f"{out}: {exc.strerror or exc}") from None
            self.file = os.fdopen(fd, "wb")
            self.final, self.tmp = out, tmp
            # gzip at its usual level 6, as gzip(1) and libarchive: tarfile's
            # 9 compressed a 100 MB tar of 100,000 keys 4.4x slower (3.2 s
            # vs 0.7 s) for a 21% smaller file
            extra = {"compresslevel": 6} if mode == "w:gz" else {}
            # (mode is one of _mode's: mypy wants it literal)
            self.tar = tarfile.open(fileobj=self.file, mode=mode,  # type: ignore[call-overload]
                                    **extra)
        else:
            self.tar = tarfile.open(fileobj=out, mode="w|")
        self.mtime = int(mtime)
        self.uid, self.gid = os.getuid(), os.getgid()
        self.uname = _user()

    def add(self, item: Item, report: Report) -> None:
        path = key_to_path(item.key)
        if path is None:  # (an archive without it would look whole: none at all)
            raise ArchiveError(f"{item.key}: a name holds '/', which an archive path "
                               "cannot: " + ("the archive on stdout is incomplete (no "
                                             "end-of-archive blocks)" if self.stream
                                             else "no archive was written"))
        info = tarfile.TarInfo(path)
        info.mtime, info.mode = self.mtime, 0o644
        info.uid, info.gid, info.uname, info.gname = self.uid, self.gid, self.uname, ""
        data = None
        if item.kind == "value":
            info.size = len(item.data)
            data = io.BytesIO(item.data)
            report.keys += 1
            report.bytes += len(item.data)
        elif item.kind == "symlink":
            info.type, info.linkname = tarfile.SYMTYPE, item.target
            report.keys += 1
        else:
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            report.dirs += 1
        self.tar.addfile(info, data)

    def close(self, complete: bool = True) -> None:
        """Finish the archive (``complete``), or drop what was written: a
        named one is removed; on stdout the end-of-archive blocks are left
        out, so a reader (``restore -``) sees it was cut short."""
        try:
            if complete:
                self.tar.close()
            else:
                self.tar.closed = True  # type: ignore[attr-defined]  # (never write them)
                self.tar.fileobj.close()  # what is buffered, without them
            if self.tmp is not None:
                self.file.close()
        except OSError:
            if self.tmp is not None:
                with suppress(OSError):
                    self.file.close()
                os.unlink(self.tmp)
            if complete:
                raise
            return  # (dropping it: the error that stopped the dump is the one to tell)
        if self.tmp is not None and self.final is not None:
            if complete:
                os.replace(self.tmp, self.final)
            else:
                os.unlink(self.tmp)

    def write(self, items: Iterable[Item], report: Report,
              on_item: Callable[[Item], None] | None) -> None:
        """Add ``items`` and close; on any error drop the archive."""
        with self._complete():
            for item in items:
                self.add(item, report)
                if on_item is not None:
                    on_item(item)

    async def write_async(self, items: AsyncGenerator[Item, None], report: Report,
                          on_item: Callable[[Item], None] | None) -> None:
        """:meth:`write` from an async iterator."""
        with self._complete():
            async with aclosing(items):  # (its reads in flight are cancelled)
                async for item in items:
                    self.add(item, report)
                    if on_item is not None:
                        on_item(item)

    @contextmanager
    def _complete(self) -> Iterator[None]:
        try:
            yield
        except BaseException as exc:
            self.close(complete=False)
            if isinstance(exc, OSError) and not self._reader_left(exc):
                # writing: a full disk, a broken socket
                raise ArchiveError(f"{self.final or 'archive'}: {exc.strerror or exc}"
                                   ) from None
            raise
        try:
            self.close()
        except OSError as exc:
            if self._reader_left(exc):
                raise
            raise ArchiveError(f"{self.final or 'archive'}: {exc.strerror or exc}") from None

    def _reader_left(self, exc: OSError) -> bool:
        """A closed pipe on standard output (``dump - | head``): raised as
        it is, so that the command ends quietly with status 141 as every
        other command does (docs/cli.md, "A closed output"), rather than
        report ``archive: Broken pipe`` and exit 1."""
        return self.final is None and isinstance(exc, BrokenPipeError)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""


def _value(key: str, entry: TreeObj, read: Callable[[TreeObj], bytes]) -> Item:
    """The :class:`Item` of a stored non-directory entry (``read`` joins a
    valref's or vtree's blobs)."""
    t = entry["type"]
    if t == "symlink":
        return Item(key, "symlink", target=str(Link.from_treeobj(entry)))
    if t == "val":
        return Item(key, "value", bytes(entry["data"]))
    return Item(key, "value", read(entry))


# ---------------------------------------------------------------- dump


async def dump(kvs: KVS, out: str | IO[bytes], *, key: str = ".", at: RootSpec | None = None,
               on_item: Callable[[Item], None] | None = None) -> Report:
    """Write the directory ``key`` of ``kvs``'s namespace (its current root,
    or root ``at``) to the archive ``out``: a file name (its ending picks the
    compression), ``"-"`` for stdout, or a binary file object (plain tar).

    ``kvs`` is a :class:`kvs.client.KVS`.  Reads go through ``kvs.lookup``
    at one root, so the archive is one version, whatever commits meanwhile.
    Raises ``RemoteError`` (``ENOENT``, ``ENOTDIR``, ``EPERM`` ...) and
    :class:`ArchiveError`."""
    top = await pin_dir(kvs, key, at)
    report = Report(rootref=top.rootref)
    await _Writer(out, time.time()).write_async(_snapshot(top), report, on_item)
    return report


async def _snapshot(top: Dir) -> AsyncGenerator[Item, None]:
    """Every entry below ``top`` (a :class:`kvs.client.Dir`), depth first in
    name order, with up to :data:`READ_WINDOW` value reads in flight."""
    async with aclosing(read_tree(top, READ_WINDOW)) as entries:
        async for k, entry, data in entries:
            if entry["type"] in ("dir", "dirref"):
                yield Item(k, "dir")
            elif data is None:
                yield Item(k, "symlink", target=str(Link.from_treeobj(entry)))
            else:
                yield Item(k, "value", data)


def dump_checkpoint(statedir: str, out: str | IO[bytes], *,
                    on_item: Callable[[Item], None] | None = None,
                    ignore_failed_read: bool = False, index: int = 0) -> Report:
    """Write the KVS checkpoint of the *stopped* instance whose statedir is
    ``statedir`` (the primary namespace its next start brings back) to
    ``out``, as :func:`dump`.  Entries carry the checkpoint's time.
    ``index``: an older checkpoint the store keeps instead (1 the one
    before, ..., as ``kvbroker content checkpoint list`` numbers them).

    A blob the tree names that the store lacks (or holds damaged) is an
    :class:`ArchiveError`; with ``ignore_failed_read`` (Flux's ``flux dump
    --ignore-failed-read``: salvaging what a damaged store still holds) the
    value, or the directory's subtree, is left out and said in
    :attr:`Report.skipped`; of a big (sharded) directory, only the entries
    of the shards that cannot be read (:func:`kvs.shards.salvage`)."""
    with open_stopped_store(statedir, create=False, read_only=True) as store:
        kept = store.checkpoint_list(CHECKPOINT_KEY)
        if not kept:
            raise ArchiveError(f"statedir {statedir} has no KVS checkpoint "
                               f"({CHECKPOINT_KEY!r}): nothing to dump")
        if index >= len(kept):
            raise ArchiveError(f"statedir {statedir} keeps {len(kept)} KVS checkpoint"
                               f"{'' if len(kept) == 1 else 's'}: no index {index} (kvbroker "
                               "content checkpoint list --statedir DIR shows them)")
        cp = _decode_checkpoint(kept[index])
        rootref = cp["rootref"]
        stamp = cp.get("timestamp")
        report = Report(rootref=rootref)
        writer = _Writer(out, stamp if isinstance(stamp, (int, float)) else time.time())
        skipped = report.skipped if ignore_failed_read else None
        writer.write(_tree_items(BlobCache(CheckedStore(store)), rootref, skipped), report,
                     on_item)
    return report


class CheckedStore:
    """A stopped store read for a dump (or ``kvs fsck --repair``'s salvage of
    a big directory): each blob checked against its hash
    (:func:`blobref.damaged` if it does not match), as rank 0 checks what it
    reads from the file.  The dump wrote a value's damaged bytes into the
    archive as the value, without a word."""

    def __init__(self, store: SqliteStore) -> None:
        self.store = store

    def get(self, ref: str) -> bytes | None:
        data = self.store.get(ref)
        if data is not None and not blobref.matches(ref, data):
            raise blobref.damaged(ref)
        return data


def _tree_items(cache: BlobCache, rootref: str,
                skipped: list[str] | None = None) -> Iterator[Item]:
    """The entries of the tree at ``rootref``, read from ``cache``'s store.
    A missing or damaged blob raises :class:`ArchiveError`, or with
    ``skipped`` (a list) leaves its value or subtree out and says so there."""

    def entries_of(key: list[str], ref: str) -> list[tuple[str, TreeObj]] | None:
        name = join(key) if key else "."
        try:
            ents, lost = shards.salvage(cache, cache.need_obj(ref))
        except (NeedBlobs, ErrnoError) as exc:
            why = (f"directory blob {ref} is missing" if isinstance(exc, NeedBlobs)
                   else f"directory blob {ref}: {exc}")
            if skipped is None:
                raise ArchiveError(f"the tree is damaged: {why}") from None
            skipped.append(f"{name} (and what is below it): {why}")
            return None
        for part in lost:
            why = "; ".join(_shard_why(shard, err) for shard, err in part.refs)
            if skipped is None:
                raise ArchiveError(f"the tree is damaged: {why} (of directory {name})")
            skipped.append(f"{part.count} entr{'y' if part.count == 1 else 'ies'} of {name}: "
                           f"{why}")
        return sorted(ents.items())

    def read(entry: TreeObj) -> bytes:
        try:
            refs = treeobj.value_refs(entry, cache.get_obj)
        except NeedBlobs as exc:
            raise _Unreadable(f"value blob list {min(exc.refs)} is missing") from None
        except ErrnoError as exc:
            raise _Unreadable(f"value blob list: {exc}") from None
        parts = []
        for ref in refs:
            try:
                data = cache.get(ref)
            except ErrnoError as exc:
                raise _Unreadable(f"value blob {ref}: {exc.errstr}") from None
            if data is None:
                raise _Unreadable(f"value blob {ref} is missing")
            parts.append(data)
        return b"".join(parts)

    stack: list[tuple[list[str], Iterator[tuple[str, TreeObj]]]] = [
        ([], iter(entries_of([], rootref) or ()))]
    while stack:
        path, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            stack.pop()
            continue
        name, entry = nxt
        key = [*path, name]
        if entry["type"] in ("dir", "dirref"):
            sub = (sorted(entry["data"].items()) if entry["type"] == "dir"
                   else entries_of(key, entry["data"][0]))
            if sub is None:
                continue
            if not sub:
                yield Item(join(key), "dir")
            stack.append((key, iter(sub)))
        else:
            try:
                item = _value(join(key), entry, read)
            except _Unreadable as exc:
                if skipped is None:
                    raise ArchiveError(f"the tree is damaged: {exc}") from None
                skipped.append(f"{join(key)}: {exc}")
                continue
            yield item


class _Unreadable(Exception):
    """A value blob the store lacks (:func:`_tree_items`)."""


def _shard_why(ref: str, err: str | None) -> str:
    """Why a big directory's shard cannot be read, in the words
    :func:`_tree_items` uses for a directory's blob."""
    return f"shard blob {ref} is missing" if err is None else f"shard blob {ref}: {err}"


# ---------------------------------------------------------------- reading


class _CheckedInfo(tarfile.TarInfo):
    """Headers read strictly: :mod:`tarfile` takes a bad or cut header after
    the first member, or an archive that stops without its end-of-archive
    blocks, for the end of the archive -- a restore would then replace a key
    with part of it, and ``dump - | restore -`` would take a failed dump for
    a whole one.  Those are errors here (GNU tar also says so)."""

    @classmethod
    def fromtarfile(cls, tarfile_: tarfile.TarFile) -> Self:
        try:
            return super().fromtarfile(tarfile_)
        except tarfile.InvalidHeaderError as exc:  # type: ignore[attr-defined]
            raise tarfile.SubsequentHeaderError(  # type: ignore[attr-defined]
                f"a damaged header at byte {tarfile_.offset} ({exc})") from None
        except (tarfile.TruncatedHeaderError,  # type: ignore[attr-defined]
                tarfile.EmptyHeaderError):  # type: ignore[attr-defined]
            if tarfile_.offset == 0:
                raise
            raise tarfile.SubsequentHeaderError(  # type: ignore[attr-defined]
                f"it stops at byte {tarfile_.offset} without its end-of-archive "
                "blocks: cut short") from None


def read_items(source: str | IO[bytes], *, size_limit: int | None = None,
               blob_limit: int | None = None, report: Report | None = None
               ) -> Iterator[Item]:
    """The entries of archive ``source`` (a file name, ``"-"`` for stdin, or a
    binary file object), any tar format or compression, in archive order.

    Regular files are values, symlinks symlinks, directories empty
    directories.  Left out, with a line in ``report.skipped``: values over
    ``size_limit`` bytes, paths with ``..``, and other kinds of entry.  A
    value over ``blob_limit`` bytes (an instance's ``content.blob-size-limit``)
    comes in :attr:`Item.parts`, each at most that, read as they are taken
    (:mod:`kvs.valuesplit`): only one blob of it is held at a time."""
    report = report if report is not None else Report()
    what = source if isinstance(source, str) else "archive"
    with contextlib.ExitStack() as stack:
        try:
            if source == "-":
                raw: IO[bytes] = sys.stdin.buffer
            elif isinstance(source, str):
                raw = stack.enter_context(open(source, "rb"))
            else:
                raw = source
        except OSError as exc:
            raise ArchiveError(f"{exc.filename or source}: {exc.strerror or exc}") from None
        try:
            data = stack.enter_context(_decompressed(raw))
            tar = stack.enter_context(tarfile.open(fileobj=data, mode="r|",
                                                   tarinfo=_CheckedInfo))
        except (*_DAMAGE, ValueError) as exc:
            first = str(exc).splitlines()[0].rstrip(":") if str(exc) else type(exc).__name__
            raise ArchiveError(f"{what}: not a readable archive: tar, plain or compressed "
                               f"with gzip, bzip2 or xz ({first})") from None
        try:
            for info in tar:
                item = _item(tar, info, size_limit, blob_limit, report, what)
                if item is not None:
                    yield item
                    if isinstance(item.parts, _Parts):
                        item.parts.close()  # (the archive moves past its bytes)
            # Read the compressed stream to its end: its checksum (gzip's
            # CRC and length, bzip2's, xz's) is checked only there, and tar
            # stops at its end-of-archive blocks -- damaged data restored
            # without a word before.
            while data.read(1 << 20):
                pass
        except (*_DAMAGE, ValueError) as exc:
            raise _damaged(what, exc) from None


def _damaged(what: str, exc: BaseException) -> ArchiveError:
    return ArchiveError(f"{what}: the archive is damaged or cut short "
                        f"({str(exc) or type(exc).__name__})")


class _Parts(Iterator[bytes]):
    """The blobs of a value over the blob limit, read from the archive
    member as they are taken.  The archive is read as a stream: once
    :func:`read_items` has moved on to the next entry (:meth:`close`), the
    member's bytes are gone, and taking a blob is an error rather than
    the next entry's bytes."""

    def __init__(self, read: Callable[[int], bytes], limit: int, key: str, what: str) -> None:
        self._blobs = split_value(read, limit)
        self._key, self._what = key, what
        self._open = True
        self._done = False

    def __next__(self) -> bytes:
        if self._done:
            raise StopIteration
        if not self._open:
            raise ArchiveError(f"{self._key}: its value was read after the archive "
                               "moved past it")
        try:
            return next(self._blobs)
        except StopIteration:
            self._done = True
            raise
        except _DAMAGE as exc:  # (read here, outside read_items' own reads)
            raise _damaged(self._what, exc) from None

    def close(self) -> None:
        self._open = False
        self._blobs.close()


_DAMAGE = (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError)
"""What reading a damaged archive raises (gzip's BadGzipFile is an OSError)."""
_MAGIC: tuple[tuple[bytes, Callable[[Any], Any]], ...] = (
    (b"\x1f\x8b", lambda f: gzip.GzipFile(fileobj=f, mode="rb")),
    (b"BZh", lambda f: bz2.BZ2File(f, mode="rb")),
    (b"\xfd7zXZ\x00", lambda f: lzma.LZMAFile(f, mode="rb")),
)


@contextmanager
def _decompressed(raw: IO[bytes]) -> Iterator[Any]:
    """``raw``'s bytes, decompressed by its magic number (gzip, bzip2, xz;
    else as they are), by readers that check the stream's checksum at its
    end (tarfile's own stream mode does not check gzip's)."""
    ours = not isinstance(raw, io.BufferedReader)
    buffered: Any = io.BufferedReader(raw) if ours else raw
    try:
        head = buffered.peek(6)[:6]
        for magic, reader in _MAGIC:
            if head.startswith(magic):
                with reader(buffered) as data:
                    yield data
                return
        yield buffered
    finally:
        if ours:  # (a wrapper closes what it wraps when collected: the caller's file)
            with suppress(ValueError):
                buffered.detach()


def _item(tar: tarfile.TarFile, info: tarfile.TarInfo, size_limit: int | None,
          blob_limit: int | None, report: Report, what: str) -> Item | None:
    try:
        info.name.encode()
        info.linkname.encode()
    except UnicodeEncodeError:  # (tarfile decoded bytes that are not UTF-8)
        # (tarfile kept the bytes as surrogates: shown as bytes, caf\xe9)
        shown = info.name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        report.skipped.append(f"{shown}: a name that is not UTF-8 names no key")
        return None
    key = path_to_key(info.name)
    if key is None:
        if ".." in info.name.split("/"):
            report.skipped.append(f"{info.name}: a path with '..' names no key")
        return None  # (the top directory itself: nothing to do)
    if info.isreg():
        if size_limit is not None and info.size > size_limit:
            report.skipped.append(f"{info.name}: {info.size} bytes, over the size "
                                  f"limit of {size_limit}")
            return None
        f = tar.extractfile(info)
        assert f is not None  # (a regular file always has data)
        if blob_limit is not None and info.size > blob_limit:
            return Item(key, "value", size=info.size,
                        parts=_Parts(f.read, blob_limit, key, what))
        return Item(key, "value", f.read())
    if info.issym():
        if not info.linkname:
            report.skipped.append(f"{info.name}: a symlink to nothing")
            return None
        return Item(key, "symlink", target=info.linkname)
    if info.isdir():
        return Item(key, "dir")
    report.skipped.append(f"{info.name}: not a file, symlink or directory")
    return None


# ---------------------------------------------------------------- restore


class _Tree:
    """The tree a restore builds, as ops for the commit engine.

    A value over :data:`~kvs.treeobj.INLINE_MAX` bytes becomes a ``valref``
    as soon as it is read -- exactly what a commit would make of it -- and
    :meth:`add` hands its blob back to be stored, so a restore holds the
    archive's structure, not its data.  A value over the blob limit (one
    with :attr:`Item.parts`) becomes a ``valref`` of its parts, the shape
    appends give it.  With ``inline`` (a guest's restore, one transaction
    of values) values stay ``val`` dirents, a value in parts a ``val`` of
    the first and an ``APPEND`` of each other: the kvs module makes the
    same ``valref`` of them."""

    def __init__(self, hash_name: str, report: Report, *, inline: bool = False) -> None:
        self.hash_name = hash_name
        self.report = report
        self.inline = inline
        self.dirs: list[tuple[str, TreeObj]] = []
        self.rest: list[tuple[str, TreeObj, int]] = []
        """Values and symlinks, in archive order: key, dirent, op flags."""
        self.seen: set[str] = set()
        self.kinds: dict[str, str] = {}
        """Every path named so far: ``dir`` (an entry, or above one), or the
        kind of the value or symlink it is."""
        self.sizes: dict[str, int] = {}
        """The size of each value's last entry."""
        self.unread = 0
        """Values in parts whose parts :meth:`add` has not been taken all."""

    def _check(self, item: Item) -> None:
        """A path may not be a value (or symlink) and a directory both:
        ``a`` then ``a/b``, or a directory entry ``a`` and a file ``a``,
        would leave one of them out whatever the order (GNU tar refuses to
        extract such an archive too).  The same path twice keeps the last."""
        kinds = self.kinds
        path = ".".join(split(item.key))
        # From the parent up, until a directory named before: every path
        # above one is a directory already.  (Each prefix built from the
        # top cost O(depth**2) an entry: a restore of a tree 4,000 deep
        # took 100 s before it was refused.)  At most one can be a value.
        end = path.rfind(".")
        while end > 0:
            above = path[:end]
            kind = kinds.get(above)
            if kind == "dir":
                break
            if kind is not None:
                raise ArchiveError(f"{above} is a {kind} and a directory above "
                                   f"{item.key} in the archive")
            kinds[above] = "dir"
            end = path.rfind(".", 0, end)
        kind = "dir" if item.kind == "dir" else item.kind
        if kinds.setdefault(item.key, kind) != kind and "dir" in (kind, kinds[item.key]):
            raise ArchiveError(f"{item.key} is a {kinds[item.key]} and a {kind} in the "
                               "archive")
        kinds[item.key] = kind

    def add(self, item: Item) -> Iterable[tuple[str, bytes]]:
        """Record ``item``; return its value blobs not handed back before,
        to be stored.  A value in parts is read, and recorded, as its blobs
        are taken: iterate what is returned to its end (:meth:`ops` refuses
        a tree with a value not read whole)."""
        self._check(item)
        if item.kind == "dir":
            self.dirs.append((item.key, treeobj.dir_()))
            return ()
        if item.kind == "symlink":
            self.sizes.pop(item.key, None)
            ns, target = parse_ns_target(item.target)
            self.rest.append((item.key, treeobj.symlink(target, ns), 0))
            return ()
        self.sizes[item.key] = item.size
        if item.parts is not None:
            self.unread += 1
            return self._add_parts(item.key, item.parts)
        if self.inline or len(item.data) <= treeobj.INLINE_MAX:
            self.rest.append((item.key, treeobj.val(item.data), 0))
            return ()
        ref = blobref.hash_blob(item.data, self.hash_name)
        self.rest.append((item.key, treeobj.valref([ref]), 0))
        return self._new(ref, item.data)

    def _add_parts(self, key: str, parts: Iterator[bytes]) -> Iterator[tuple[str, bytes]]:
        if self.inline:
            for i, part in enumerate(parts):
                self.rest.append((key, treeobj.val(part), APPEND if i else 0))
        else:
            refs = []
            for part in parts:
                ref = blobref.hash_blob(part, self.hash_name)
                refs.append(ref)
                yield from self._new(ref, part)
            self.rest.append((key, treeobj.valref(refs), 0))
        self.unread -= 1

    def _new(self, ref: str, data: bytes) -> list[tuple[str, bytes]]:
        """``[(ref, data)]`` for a blob not handed back before, else none."""
        if ref in self.seen:
            return []
        self.seen.add(ref)
        return [(ref, data)]

    def finish(self) -> None:
        """Every entry is in: count what the tree holds into the report
        (:meth:`tally`), and refuse an archive whose every entry was left out
        (it would replace the key with nothing).  Each restore calls it."""
        self.tally()
        _something_left(self.report)

    def tally(self) -> None:
        """Count into the report what the tree holds: a path given twice
        once, and as empty directories only the directory entries nothing
        lies below (GNU tar lists every directory it archives, and an empty
        one only is an entry here)."""
        # (a path's parent alone: every directory above a path is a path too)
        parents = {".".join(split(path)[:-1]) for path in self.kinds}
        r = self.report
        r.keys = sum(1 for kind in self.kinds.values() if kind != "dir")
        r.dirs = sum(1 for path, kind in self.kinds.items()
                     if kind == "dir" and path not in parents)
        r.bytes = sum(self.sizes.values())

    def ops(self, prefix: str = "") -> list[dict[str, Any]]:
        """Commit ops writing the tree below ``prefix``: the directories
        first (an empty directory entry after files below it must not
        replace them), then values and symlinks in archive order, so a path
        written twice keeps its last entry, as ``tar`` would."""
        if self.unread:
            raise RuntimeError("a value in parts was not read whole (Tree.add)")
        dirs = [(k, dirent, 0) for k, dirent in sorted(self.dirs, key=lambda d: len(split(d[0])))]
        return [{"key": f"{prefix}.{k}" if prefix else k, "flags": flags, "dirent": dirent}
                for k, dirent, flags in dirs + self.rest]

    def build(self) -> tuple[str, dict[str, bytes]]:
        """``(rootref, {blobref: blob})``: the tree's directory blobs (the
        values' were handed back by :meth:`add`)."""
        empty, data = txn.empty_root(self.hash_name)
        # A tree deeper than a commit writes (MAX_DEPTH) is built too: a
        # directory copied below a deep key makes one, which reads, dumps
        # and collections walk, and its dump was refused here ("writes more
        # than 256 levels deep") -- an instance's own dump could not be put
        # back.  The engine recurses about twice a level.
        deepest = max((len(split(path)) for path in self.kinds), default=0)
        # (process-wide, put back after: a restore is its command's, or
        # rank 0's at its start, and nothing else sets it meanwhile)
        limit = sys.getrecursionlimit()
        if deepest > MAX_DEPTH:
            sys.setrecursionlimit(max(limit, 2 * deepest + 1000))
        # (the valrefs name blobs this in-memory store lacks: the engine
        # checks their form only, and never reads a value it does not change)
        try:
            result = txn.apply({empty: data}, empty, self.ops(), hash_name=self.hash_name,
                               max_depth=max(deepest, MAX_DEPTH))
        except ErrnoError as exc:
            raise ArchiveError(f"the archive cannot be a KVS tree: {exc.errstr or exc}"
                               ) from None
        finally:
            sys.setrecursionlimit(limit)
        blobs = dict(result.new_blobs)
        blobs.setdefault(empty, data)  # (an empty archive: the root is the empty directory)
        return result.rootref, blobs


def build(items: Iterable[Item], hash_name: str = blobref.DEFAULT_HASH
          ) -> tuple[str, dict[str, bytes]]:
    """The tree holding ``items``, built as a commit would build it:
    ``(rootref, {blobref: blob})`` with every blob it needs."""
    tree = _Tree(hash_name, Report())
    values = {ref: data for it in items for ref, data in tree.add(it)}
    rootref, blobs = tree.build()
    return rootref, {**values, **blobs}


def _check_limits(prefix: str, item: Item) -> None:
    """``ENAMETOOLONG`` for an item a commit could not write below
    ``prefix`` (:func:`kvs.txn.check_limits`: its key, a symlink's target).
    The owner's restore stores the tree's blobs and commits one ``dirref``,
    which names none of the keys, so the kvs module never saw them: an
    archive entry of any length became a key online.  (An offline restore
    into a stopped instance's statedir is not held to them.)"""
    check_length(f"{prefix}.{item.key}")
    if item.kind == "symlink":
        check_target_length(item.target, None)


async def restore(kvs: KVS, source: str | IO[bytes], key: str, *,
                  size_limit: int | None = None,
                  on_item: Callable[[Item], None] | None = None) -> Report:
    """Make ``key`` of ``kvs``'s namespace the directory archive ``source``
    holds (whatever ``key`` was before), in one commit.

    The instance owner stores the values' blobs as it reads them, then the
    directories', and commits one ``dirref``; a guest, who may not store
    blobs, commits every key in one transaction.  A value over the
    instance's ``content.blob-size-limit`` is stored as several blobs,
    each at most the limit and ending at a line end where one falls in it
    (:mod:`kvs.valuesplit`), as appends would have stored it: so whatever
    an instance dumps restores into an instance of the same limit.  A key
    or symlink target over the limits of a commit (``ENAMETOOLONG``,
    :data:`kvs.keys.MAX_NAME`) stops it before anything is committed.
    Raises :class:`ArchiveError`, ``ErrnoError`` and ``RemoteError``."""
    if not split(key):
        raise ArchiveError("the key to restore to cannot be the root directory (restore "
                           "to a key, then namespace create -r with the root it prints)")
    h = kvs.handle
    limit = int(await h.attr_get("content.blob-size-limit"))
    hash_name = str(await h.attr_get("content.hash"))
    try:
        await h.rpc("content.store", {"blobs": []})  # may we? (the owner's service)
        owner = True
    except RemoteError as exc:
        if exc.errnum != errno.EPERM:
            raise
        owner = False
    report = Report()
    prefix = normalize(key)
    tree = _Tree(hash_name, report, inline=not owner)
    items = read_items(source, size_limit=size_limit, blob_limit=limit, report=report)
    if not owner:
        budget = int(await h.attr_get("broker.max-message"))
        for item in await asyncio.to_thread(_one_transaction, items, budget):
            _check_limits(prefix, item)
            for _ in tree.add(item):  # (inline: no blobs)
                pass
            if on_item is not None:
                on_item(item)
        tree.finish()
        result = await kvs.commit([{"key": key, "flags": 0, "dirent": treeobj.dir_()},
                                   *tree.ops(prefix)])
        report.rootref = (await kvs.get_treeobj(key, at=result))["data"][0]
        return report
    uploader = BlobUploader(h)
    try:
        for item in items:
            _check_limits(prefix, item)
            for blob in tree.add(item):
                await uploader.put(*blob)
            if on_item is not None:
                on_item(item)
        tree.finish()
        report.rootref, blobs = tree.build()
        for ref, data in blobs.items():
            await uploader.put(ref, data)
        await uploader.flush()
        report.blobs = uploader.stored
        await kvs.put_treeobj(key, treeobj.dirref(report.rootref))
    finally:
        uploader.cancel()
        await uploader.release()
    return report


def _one_transaction(items: Iterable[Item], budget: int) -> list[Item]:
    """A guest's items, all read (a value's parts too): they must fit one
    commit (at most ``MAX_OPS`` ops with the one that empties the key, a
    value in parts one per part, and ``budget`` bytes:
    ``broker.max-message``), which is said as soon as they do not."""
    out: list[Item] = []
    ops = 1
    size = 0

    def check() -> None:
        if ops + 1 > MAX_OPS or size > budget:
            raise ArchiveError(f"the archive does not fit one commit (at most {MAX_OPS - 1} "
                               f"entries, a value over content.blob-size-limit one per blob "
                               f"of it, and {budget} bytes), which is how a guest restores: "
                               "ask the instance owner, or split it")

    for it in items:
        ops += 1
        size += it.size + len(it.key) + len(it.target) + 64
        check()  # (by its size, before a value in parts is read)
        if it.parts is not None:
            parts = list(it.parts)
            ops += len(parts) - 1
            size += (len(parts) - 1) * (len(it.key) + 64)
            check()
            it = Item(it.key, "value", size=it.size, parts=iter(parts))
        out.append(it)
    return out


def _something_left(report: Report) -> None:
    """An archive whose every entry was left out replaces nothing."""
    if not (report.keys or report.dirs) and report.skipped:
        # (each named: they were said only when something was restored)
        lines = [f"  {line}" for line in report.skipped[:20]]
        if len(report.skipped) > 20:
            lines.append(f"  ... and {len(report.skipped) - 20} more")
        raise ArchiveError("nothing to restore: every entry of the archive was left "
                           "out:\n" + "\n".join(lines))


class BlobUploader:
    """``content.store`` in batches (:data:`STORE_BATCH_BYTES`,
    :data:`STORE_BATCH_BLOBS`), at most :data:`STORE_WINDOW` in flight;
    checks that the instance names each blob as we did (``put(ref, data)``
    with the blobref the client computed).  Used by a restore and by
    ``kvbroker archive create`` (``purpose``: the hold's name starts so).

    The blobs are stored under a hold of their own, released
    (:meth:`release`) once the commit naming them is answered: a garbage
    collection keeps a blob no longer than ``kvs.gc-grace`` after its store
    unless a root names it, and a restore that runs longer would lose its
    first blobs to a collection before its commit (which then failed
    ``ENOENT``)."""

    def __init__(self, h: Any, purpose: str = "restore") -> None:
        self.h = h
        self.hold = f"{purpose}-{os.getpid()}-{secrets.token_hex(8)}"
        self.batch: list[tuple[str, bytes]] = []
        self.size = 0
        self.pending: deque[tuple[list[str], asyncio.Future[Any]]] = deque()
        self.stored = 0

    async def put(self, ref: str, data: bytes) -> None:
        self.batch.append((ref, data))
        self.size += len(data)
        if self.size >= STORE_BATCH_BYTES or len(self.batch) >= STORE_BATCH_BLOBS:
            await self._send()

    async def flush(self) -> None:
        await self._send()
        while self.pending:
            await self._settle()

    def cancel(self) -> None:
        for _, answer in self.pending:
            answer.cancel()

    async def release(self) -> None:
        """Let the collector have the blobs (the commit is answered: they
        are in a root, or the restore failed).  Best effort: a hold not
        released lapses on its own (``HOLD_LEASE`` after its last store)."""
        if not self.stored:
            return
        with suppress(RemoteError, OSError):
            await self.h.rpc("content.store", {"blobs": [], "hold": self.hold,
                                               "release": True})

    async def _send(self) -> None:
        if not self.batch:
            return
        while len(self.pending) >= STORE_WINDOW:
            await self._settle()
        self.pending.append(([r for r, _ in self.batch], self.h.rpc(
            "content.store", {"blobs": [d for _, d in self.batch], "hold": self.hold})))
        self.stored += len(self.batch)
        self.batch, self.size = [], 0

    async def _settle(self) -> None:
        refs, answer = self.pending.popleft()
        if list((await answer).get("blobrefs", [])) != refs:
            raise ArchiveError("the instance names blobs differently than this client "
                               "(content.hash?)")


def restore_checkpoint(statedir: str, source: str | IO[bytes], *,
                       size_limit: int | None = None,
                       on_item: Callable[[Item], None] | None = None,
                       blob_limit: int = DEFAULT_BLOB_LIMIT) -> Report:
    """Write archive ``source`` into the content store of the *stopped*
    instance whose statedir is ``statedir`` (made if missing) and make it
    the KVS checkpoint: the primary namespace of the next start, at
    version 0, as Flux's ``restore --checkpoint``.  A value over
    ``blob_limit`` (the instance's ``content.blob-size-limit``, if known:
    the instance is stopped) is stored in several blobs, as online.

    All or nothing, a kill included: into a store, the blobs go in first
    and the checkpoint last (SQLite replays its WAL as a prefix), so a run
    that stops half way leaves the old checkpoint in place, and what it
    wrote as garbage for ``kvbroker kvs gc``; into a statedir without one,
    the store is built under a temporary name (:mod:`broker.content.storefile`)
    and renamed when whole, so a run that stops half way leaves no store."""
    report = Report()
    path = os.path.join(statedir, STORE_FILE)
    _check_statedir(statedir, create=True)
    if os.path.exists(path):
        with open_stopped_store(statedir, create=False) as store:
            _restore_into(store, source, size_limit, blob_limit, on_item, report)
    else:
        replace_store(statedir, source, old=None, size_limit=size_limit, on_item=on_item,
                      blob_limit=blob_limit, report=report)
    return report


def replace_store(statedir: str, source: str | IO[bytes] | None, *,
                  old: SqliteStore | None, runs: Iterable[tuple[Any, ...]] = (),
                  size_limit: int | None = None,
                  on_item: Callable[[Item], None] | None = None,
                  blob_limit: int = DEFAULT_BLOB_LIMIT,
                  report: Report | None = None) -> Report:
    """Replace ``statedir``'s store -- ``old``, opened by the caller (and so
    locked) since before it read what it keeps, or None if there is none
    -- with a new one holding ``runs`` and archive ``source`` restored as
    the KVS checkpoint (None: empty), whole or not at all
    (:func:`broker.content.storefile.install`).  ``old`` is closed."""
    report = Report() if report is None else report
    path = os.path.join(statedir, STORE_FILE)
    try:
        new = storefile.create(path)
    except StoreLocked:
        raise ArchiveError(f"statedir {statedir} is in use: another restore is writing "
                           f"{storefile.temp_path(STORE_FILE)} there", errno.EBUSY) from None
    except (sqlite3.Error, OSError) as exc:
        raise _cannot_open(storefile.temp_path(path), exc) from None
    try:
        new.runs_put(runs)
        if source is not None:
            _restore_into(new, source, size_limit, blob_limit, on_item, report)
        storefile.install(new, path, old)
    except BaseException as exc:
        storefile.discard(new)
        if isinstance(exc, StoreLocked):
            raise ArchiveError(f"statedir {statedir} is in use by another instance "
                               f"({exc}): the old store is kept", errno.EBUSY) from None
        if isinstance(exc, sqlite3.Error):
            raise ArchiveError(f"{path}: {exc}") from None
        raise
    return report


def _restore_into(store: SqliteStore, source: str | IO[bytes], size_limit: int | None,
                  blob_limit: int, on_item: Callable[[Item], None] | None,
                  report: Report) -> None:
    old = _checkpoint(store)
    hash_name = (old["rootref"].partition("-")[0] if old is not None
                 else blobref.DEFAULT_HASH)
    tree = _Tree(hash_name, report)
    batch: list[tuple[str, bytes]] = []
    size = 0
    for item in read_items(source, size_limit=size_limit, blob_limit=blob_limit,
                           report=report):
        for blob in tree.add(item):
            batch.append(blob)
            size += len(blob[1])
            report.blobs += 1
            if size >= STORE_BATCH_BYTES or len(batch) >= STORE_BATCH_BLOBS:
                store.put_many(batch)
                batch, size = [], 0
        if on_item is not None:
            on_item(item)
    tree.finish()
    report.rootref, blobs = tree.build()
    store.put_many([*batch, *blobs.items()])
    report.blobs += len(blobs)
    store.checkpoint_put(CHECKPOINT_KEY, msgpack.packb(
        {"rootref": report.rootref, "rootseq": 0, "timestamp": time.time()},
        use_bin_type=True))
    store.sync()


def _check_statedir(statedir: str, *, create: bool) -> None:
    """A stopped instance's statedir: a directory, private (made if missing
    with ``create``), as a start checks it."""
    if not create and not os.path.isdir(statedir):
        what = "not a directory" if os.path.exists(statedir) else "no such directory"
        raise ArchiveError(f"statedir {statedir}: {what}",
                           errno.ENOTDIR if os.path.exists(statedir) else errno.ENOENT)
    try:
        private_dir(statedir, "statedir")  # the owner's, as at start
    except StartError as exc:
        raise ArchiveError(str(exc), errno.EPERM) from None


def _cannot_open(path: str, exc: BaseException) -> ArchiveError:
    """One line for a store that could not be opened (or made), with the
    errno of its cause (SQLite's own errors: ``EIO``)."""
    why = locks.write_refused(exc)
    if why is not None:
        return ArchiveError(locks.cannot_write(path, why), _refused_errno(why))
    if isinstance(exc, OSError):
        return ArchiveError(f"{exc.filename or path}: {exc.strerror or exc}",
                            exc.errno or errno.EIO)
    return ArchiveError(f"{path}: {exc}", lasting=isinstance(exc, sqlite3.DatabaseError)
                        and store_lasting(exc))


def _refused_errno(why: str) -> int:
    """The errno of :func:`broker.content.locks.unwritable`'s reason."""
    return errno.EROFS if why == "read-only file system" else errno.EACCES


@contextmanager
def open_stopped_store(statedir: str, *, create: bool,
                       instead: str = "stop it first, or work online (without --checkpoint)",
                       read_only: bool = False) -> Iterator[SqliteStore]:
    """The statedir's ``content.sqlite``, opened while no instance runs;
    one-line errors for everything else (``instead``: what to do when an
    instance has it open).  ``read_only``: for a tool that only reads, a
    store it cannot write (a read-only file system) is read without writing
    (:func:`broker.content.sqlite.open_to_read`); a tool that writes is
    refused there with one line naming the file and the cause."""
    _check_statedir(statedir, create=create)
    path = os.path.join(statedir, STORE_FILE)
    if not create and not os.path.exists(path):
        raise ArchiveError(f"statedir {statedir} has no {STORE_FILE}", errno.ENOENT)
    why = None if read_only else locks.unwritable(path)
    if why is not None:
        raise ArchiveError(locks.cannot_write(path, why), _refused_errno(why))
    try:
        store = open_to_read(path) if read_only else SqliteStore(path)
    except StoreLocked:
        raise ArchiveError(f"statedir {statedir} is in use by a running instance (its "
                           f"{STORE_FILE} is locked): {instead}", errno.EBUSY) from None
    except (sqlite3.Error, OSError) as exc:
        raise _cannot_open(path, exc) from None
    try:
        yield store
    except sqlite3.Error as exc:
        raise ArchiveError(f"{path}: {exc}") from None
    finally:
        store.close()


def _checkpoint(store: SqliteStore) -> dict[str, Any] | None:
    raw = store.checkpoint_get(CHECKPOINT_KEY)
    return None if raw is None else _decode_checkpoint(raw)


def _decode_checkpoint(raw: bytes) -> dict[str, Any]:
    """A stored KVS checkpoint, checked to name a root."""
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several kinds
        raise ArchiveError(f"the checkpoint {CHECKPOINT_KEY!r} does not decode: "
                           f"{str(exc) or type(exc).__name__}") from None
    if not (isinstance(value, dict) and blobref.is_valid(value.get("rootref"))):
        raise ArchiveError(f"the checkpoint {CHECKPOINT_KEY!r} is not a KVS root: "
                           f"{value!r:.200}")
    return value
