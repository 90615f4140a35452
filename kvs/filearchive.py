"""RFC 37 file archives: many files under one KVS key (``kvbroker archive``).

The stored form is Flux's (``flux archive``, RFC 37 "File archive
format"): a JSON array of *file objects*, one per file, directory or
symbolic link, each with

* ``path``: relative (a leading ``/`` is dropped at create), ``/``-separated;
* ``mode``: the whole ``st_mode`` (type bits and permission bits);
* ``mtime``, ``ctime``: seconds; ``size``: bytes (regular files);
* and for content, ``encoding`` and ``data``:

  - a regular file of at most the *small-file threshold* bytes: ``utf-8``
    (``data`` is the text, when the bytes are UTF-8 without a NUL) or
    ``base64``;
  - a larger one: ``blobvec``, ``data`` a list of ``[offset, size,
    blobref]``, each chunk (at most the *chunk size*) a blob of the content
    store; the holes of a sparse file are left out, so they stay holes
    when extracted;
  - an empty file, or one that is all hole: no ``encoding``, no ``data``
    (``size`` says how long it is);
  - a symbolic link: ``data`` is its target; a directory: no ``data``;
  - (read, never written) no ``encoding`` with ``data``: the data is JSON,
    written out as compact JSON text, as RFC 37 says.

This module holds the parts that need no broker: finding the files to
archive (:func:`walk`), making file objects (:func:`inline_object`,
:func:`blobvec_object`, ...), where a file's data lies (:func:`data_chunks`,
by ``SEEK_DATA``/``SEEK_HOLE``), reading an archive back
(:func:`file_objects`, :func:`check_object`) and writing it out safely
(:class:`Extractor`: never outside its directory).  The command is
:mod:`kvs.archive_cli`.
"""

from __future__ import annotations

import base64
import errno
import fnmatch
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from broker.content import blobref

__all__ = ["DEFAULT_CHUNKSIZE", "DEFAULT_SMALL_FILE_THRESHOLD", "ArchiveInputError",
           "BadArchive", "Extractor", "Source", "UnsafePath", "archive_path", "blobrefs_of",
           "blobvec_object", "check_object", "data_chunks", "directory_object", "empty_object",
           "file_objects", "inline_object", "kind_letter", "matches", "pretty", "safe_parts",
           "symlink_object", "walk"]

DEFAULT_CHUNKSIZE = 1 << 20
"""``--chunksize``: the largest blob a file's data is cut into (Flux's 1M)."""
DEFAULT_SMALL_FILE_THRESHOLD = 1 << 10
"""``--small-file-threshold``: files of at most this many bytes are kept in
the file object itself, not in the content store (Flux's 1K)."""

ENCODINGS = (None, "utf-8", "base64", "blobvec")


class ArchiveInputError(Exception):
    """A path given to ``archive create`` that cannot be archived (its
    type, or it cannot be read); the message names it."""


class BadArchive(ValueError):
    """A value that is not an RFC 37 archive, or a file object in it that
    is malformed; the message names the object's path where it has one."""


class UnsafePath(BadArchive):
    """A path an extraction refuses: absolute, with a ``..`` component, or
    leading through a symbolic link (out of the directory, maybe)."""


# ---------------------------------------------------------------- creating


def archive_path(given: str) -> str:
    """The path a file given as ``given`` is stored under: relative (the
    leading ``/`` dropped, as Flux and tar do), ``.`` components and
    doubled ``/`` gone.  A ``..`` component is refused
    (:class:`ArchiveInputError`): every extraction would refuse it."""
    parts = [p for p in given.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ArchiveInputError(f"{given}: a path with '..' cannot be extracted (extract "
                                "refuses it): give -C DIR and a path below DIR instead")
    return "/".join(parts) or "."


@dataclass
class Source:
    """One thing ``archive create`` found: stored as ``path``, read at ``full``."""

    path: str
    full: str
    st: os.stat_result
    target: str | None = None
    """A symbolic link's target (else None)."""


_TYPE_NAMES = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR:
               "a character device", stat.S_IFBLK: "a block device"}


def _source(given: str, full: str, path: str) -> Source:
    """What is at ``full`` (stored as ``path``), checked: a regular file that
    can be opened for reading, a directory or a symbolic link; anything else
    is an :class:`ArchiveInputError` naming ``given``."""
    _check_text(given, path)
    try:
        st = os.lstat(full)
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(full)
            _check_text(given, target, f"its target '{_shown(target)}'")
            return Source(path, full, st, target)
        if stat.S_ISREG(st.st_mode):
            # (no O_NONBLOCK needed: it is no FIFO; O_NOFOLLOW: it is not a link now)
            os.close(os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
        elif not stat.S_ISDIR(st.st_mode):
            kind = _TYPE_NAMES.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise ArchiveInputError(f"{given}: unsupported file type ({kind}: only regular "
                                    "files, directories and symbolic links are archived)")
    except OSError as exc:
        raise ArchiveInputError(f"{given}: {exc.strerror}") from None
    return Source(path, full, st)


def _check_text(given: str, text: str, what: str = "its name") -> None:
    """:class:`ArchiveInputError` unless ``text`` (a path, a link's target)
    is UTF-8: the archive is JSON, which holds text only (Flux's jansson
    refuses it too).  Checked as the files are walked, before anything is
    stored: it failed at the commit, with a traceback."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ArchiveInputError(f"{_shown(given)}: {what} is not UTF-8 text (an archive "
                                "holds names as JSON text)") from None


def _shown(text: str) -> str:
    """``text`` as it may be printed: bytes that are not UTF-8 escaped (``\\xff``)."""
    try:
        text.encode()
        return text
    except UnicodeEncodeError:
        return repr(os.fsencode(text))[2:-1]


def walk(paths: list[str], directory: str | None = None) -> Iterator[Source]:
    """Every file, directory and symbolic link ``paths`` name (relative to
    ``directory``, if given), directories with everything below them,
    each directory before its contents, names in sorted order; symbolic
    links are archived as links, never followed.  Raises
    :class:`ArchiveInputError` for the first one that cannot be archived
    (callers walk everything before storing anything)."""
    for given in paths:
        path = archive_path(given)
        full = given if directory is None else os.path.join(directory, given)
        top = _source(given, full, path)
        if path != ".":  # (``.``/``/``: its contents, as Flux skips ``.``)
            yield top
        if stat.S_ISDIR(top.st.st_mode):
            yield from _below(given, full, "" if path == "." else path + "/")


def _below(given: str, full: str, prefix: str) -> Iterator[Source]:
    try:
        names = sorted(os.listdir(full))
    except OSError as exc:
        raise ArchiveInputError(f"{given}: {exc.strerror}") from None
    for name in names:
        sub_given, sub_full = os.path.join(given, name), os.path.join(full, name)
        src = _source(sub_given, sub_full, prefix + name)
        yield src
        if stat.S_ISDIR(src.st.st_mode):
            yield from _below(sub_given, sub_full, src.path + "/")


def _common(path: str, st: os.stat_result) -> dict[str, Any]:
    return {"path": path, "mode": st.st_mode, "mtime": int(st.st_mtime),
            "ctime": int(st.st_ctime)}


def directory_object(path: str, st: os.stat_result) -> dict[str, Any]:
    return _common(path, st)


def symlink_object(path: str, st: os.stat_result, target: str) -> dict[str, Any]:
    return {**_common(path, st), "data": target}


def empty_object(path: str, st: os.stat_result) -> dict[str, Any]:
    """A regular file with no data: empty, or all hole (``size`` says how long)."""
    return {**_common(path, st), "size": st.st_size}


def inline_object(path: str, st: os.stat_result, data: bytes) -> dict[str, Any]:
    """A small file, its data in the object: ``utf-8`` text when it is UTF-8
    without a NUL byte (Flux's reader stops at a NUL), else ``base64``."""
    obj = {**_common(path, st), "size": len(data)}
    try:
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, 0, 1, "NUL")
        obj.update(encoding="utf-8", data=data.decode("utf-8"))
    except UnicodeDecodeError:
        obj.update(encoding="base64", data=base64.b64encode(data).decode("ascii"))
    return obj


def blobvec_object(path: str, st: os.stat_result, size: int,
                   vec: list[list[Any]]) -> dict[str, Any]:
    """A large file: ``vec`` is ``[offset, size, blobref]`` per chunk."""
    return {**_common(path, st), "size": size, "encoding": "blobvec", "data": vec}


def data_chunks(fd: int, size: int, chunksize: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each chunk of the file open on ``fd`` (of
    ``size`` bytes) that holds data, each at most ``chunksize`` bytes (0:
    no limit): the holes of a sparse file (``SEEK_HOLE``) are left out.
    Empty for a file of no data at all."""
    out: list[tuple[int, int]] = []
    offset = 0
    while offset < size:
        try:
            offset = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data past offset
                break
            raise
        if offset >= size:
            break
        end = min(os.lseek(fd, offset, os.SEEK_HOLE), size)
        while offset < end:
            length = end - offset if chunksize <= 0 else min(chunksize, end - offset)
            out.append((offset, length))
            offset += length
    return out


# ---------------------------------------------------------------- reading


def file_objects(archive: Any) -> list[dict[str, Any]]:
    """The file objects of an archive's value (parsed JSON): an array, or
    (RFC 37's other form) an object of path -> file object.  Each is
    checked (:func:`check_object`)."""
    if isinstance(archive, dict):
        archive = [{"path": k, **v} if isinstance(v, dict) else v for k, v in archive.items()]
    if not isinstance(archive, list):
        raise BadArchive("not an RFC 37 archive (a JSON array of file objects)")
    return [check_object(o) for o in archive]


def _int(obj: dict[str, Any], name: str, where: str, required: bool = False,
         signed: bool = False) -> None:
    v = obj.get(name)
    if v is None and not required:
        return
    if type(v) is not int:
        raise BadArchive(f"{where}: {name} must be an integer, not {v!r}")
    if v < 0 and not signed:
        raise BadArchive(f"{where}: {name} must be an integer of 0 or more, not {v!r}")


def check_object(obj: Any) -> dict[str, Any]:
    """``obj`` if it is a well-formed RFC 37 file object (a regular file,
    directory or symbolic link), else :class:`BadArchive` saying why."""
    if not isinstance(obj, dict) or not isinstance(obj.get("path"), str) or not obj["path"]:
        raise BadArchive(f"not an RFC 37 file object (no path): {json.dumps(obj)[:200]}")
    where = obj["path"]
    _int(obj, "mode", where, required=True)
    _int(obj, "size", where)
    # (times are seconds since the epoch, as Flux's: a file may predate it,
    # and one dated 1960 made its whole archive unreadable here)
    _int(obj, "mtime", where, signed=True)
    _int(obj, "ctime", where, signed=True)
    mode, enc, data = obj["mode"], obj.get("encoding"), obj.get("data")
    if stat.S_ISLNK(mode):
        if not isinstance(data, str) or not data:
            raise BadArchive(f"{where}: a symbolic link without its target")
    elif stat.S_ISREG(mode):
        if enc not in ENCODINGS:
            raise BadArchive(f"{where}: unknown RFC 37 encoding {enc!r}")
        if enc in ("utf-8", "base64") and not isinstance(data, str):
            raise BadArchive(f"{where}: {enc} data must be a string")
        if enc == "base64":
            try:
                base64.b64decode(str(data), validate=True)
            except ValueError:
                raise BadArchive(f"{where}: data is not base64") from None
        if enc == "blobvec":
            _check_blobvec(obj, where)
    elif not stat.S_ISDIR(mode):
        raise BadArchive(f"{where}: unknown file type (mode 0{mode:o})")
    return obj


def _check_blobvec(obj: dict[str, Any], where: str) -> None:
    vec, size = obj.get("data"), obj.get("size")
    if not isinstance(vec, list) or size is None:
        raise BadArchive(f"{where}: blobvec data must be a list, with size")
    for entry in vec:
        if not (isinstance(entry, list) and len(entry) == 3 and type(entry[0]) is int
                and type(entry[1]) is int and entry[0] >= 0 and entry[1] >= 0
                and blobref.is_valid(entry[2])):
            raise BadArchive(f"{where}: bad blobvec entry {json.dumps(entry)[:200]} (want "
                             "[offset, size, blobref])")
        if entry[0] + entry[1] > size:
            raise BadArchive(f"{where}: blobvec entry {entry[0]}+{entry[1]} is past the "
                             f"file's size ({size})")


def blobrefs_of(obj: dict[str, Any]) -> list[str]:
    """The blobrefs a file object's data is in (none unless ``blobvec``)."""
    if obj.get("encoding") != "blobvec":
        return []
    return [str(e[2]) for e in obj["data"]]


def inline_data(obj: dict[str, Any]) -> bytes | None:
    """A regular file's data held in the object itself (None: blobvec, or none)."""
    enc, data = obj.get("encoding"), obj.get("data")
    if enc == "utf-8":
        return str(data).encode("utf-8")
    if enc == "base64":
        return base64.b64decode(str(data))
    if enc is None and data is not None:  # RFC 37: JSON data, written as compact JSON
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return None


def kind_letter(mode: int) -> str:
    return ("f" if stat.S_ISREG(mode) else "l" if stat.S_ISLNK(mode)
            else "d" if stat.S_ISDIR(mode) else "?")


def pretty(obj: dict[str, Any], long: bool = False) -> str:
    """A file object as ``archive list`` prints it: its path, or in the
    long form (``-l``) type, permissions, size and path, as Flux's
    (``f 0644     2048 testfile2``)."""
    if not long:
        return str(obj["path"])
    mode = int(obj["mode"])
    return f"{kind_letter(mode)} 0{mode & 0o777:o} {int(obj.get('size') or 0):8d} {obj['path']}"


def matches(obj: dict[str, Any], pattern: str | None) -> bool:
    """Whether the object's path matches the glob ``pattern`` as Flux's
    ``fnmatch(3)`` without flags does (``*`` matches ``/`` too); None: all."""
    return pattern is None or fnmatch.fnmatchcase(str(obj["path"]), pattern)


# ---------------------------------------------------------------- extracting


def safe_parts(path: str) -> list[str]:
    """The components of an archived ``path`` to write below the
    extraction's directory: ``.`` and empty ones dropped; an absolute path
    or one with a ``..`` component is :class:`UnsafePath` (as tar's and
    libarchive's secure modes refuse them)."""
    if path.startswith("/"):
        raise UnsafePath(f"{path}: refusing an absolute path (it would be written outside "
                         "the directory)")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafePath(f"{path}: refusing a path with a '..' component (it could be "
                         "written outside the directory)")
    if "\0" in path:
        raise UnsafePath(f"{path!r}: refusing a path with a NUL byte")
    return parts


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Extractor:
    """Writes file objects below ``directory``, never outside it.

    Every path is opened from the directory down, one component at a time
    with ``O_NOFOLLOW`` (``openat``): a symbolic link on the way -- one the
    archive made, or one already there -- is refused, not followed, so a
    hostile archive (``a -> /etc`` then ``a/passwd``) cannot write outside.
    A file is created with ``O_EXCL``: an existing one is an error, or with
    ``overwrite`` is unlinked first (a link there is replaced, never
    written through).  Missing parent directories are made (mode 0777 less
    the umask, as ``mkdir -p``).  Permission bits (``0777``: not setuid,
    setgid nor sticky) are restored whatever the umask, and modification
    times; a directory's are set last (:meth:`finish`, deepest first), as
    its contents change its time and a read-only one could not take them."""

    def __init__(self, directory: str, overwrite: bool = False) -> None:
        self.overwrite = overwrite
        self.top = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._dirs: list[tuple[list[str], int, int | None]] = []

    def close(self) -> None:
        if self.top >= 0:
            os.close(self.top)
            self.top = -1

    def __enter__(self) -> Extractor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _parent(self, path: str, parts: list[str], make: bool = True) -> int:
        """A descriptor of the directory that holds ``parts[-1]`` (the
        caller closes it), made as needed, reached without following a link."""
        fd = os.dup(self.top)
        try:
            for i, name in enumerate(parts[:-1]):
                try:
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not make:
                        raise
                    os.mkdir(name, 0o777, dir_fd=fd)
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    where = "/".join(parts[:i + 1])
                    if stat.S_ISLNK(os.lstat(name, dir_fd=fd).st_mode):
                        raise UnsafePath(f"{path}: {where} is a symbolic link: not followed "
                                         "(it could lead outside the directory)") from None
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR),
                                             where) from None
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _clear(self, parent: int, name: str, path: str, is_dir: bool = False) -> bool:
        """Make room for ``name``: True if a directory is there already
        and ``is_dir`` (kept); an existing file or link is an error unless
        :attr:`overwrite` (then unlinked); a directory where a file goes
        is an error."""
        try:
            st = os.lstat(name, dir_fd=parent)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            if is_dir:
                return True
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not self.overwrite:
            raise FileExistsError(errno.EEXIST, f"{os.strerror(errno.EEXIST)} (give "
                                  "--overwrite to replace it)", path)
        os.unlink(name, dir_fd=parent)
        return False

    def directory(self, obj: dict[str, Any]) -> None:
        parts = safe_parts(obj["path"])
        if not parts:
            return  # (``.``: the directory itself, left as it is)
        parent = self._parent(obj["path"], parts)
        try:
            if not self._clear(parent, parts[-1], obj["path"], is_dir=True):
                os.mkdir(parts[-1], 0o700, dir_fd=parent)
        finally:
            os.close(parent)
        self._dirs.append((parts, int(obj["mode"]), obj.get("mtime")))

    def symlink(self, obj: dict[str, Any]) -> None:
        parts = self._file_parts(obj)
        parent = self._parent(obj["path"], parts)
        try:
            self._clear(parent, parts[-1], obj["path"])
            os.symlink(str(obj["data"]), parts[-1], dir_fd=parent)
            if obj.get("mtime") is not None:
                t = int(obj["mtime"])
                os.utime(parts[-1], (t, t), dir_fd=parent, follow_symlinks=False)
        finally:
            os.close(parent)

    def _file_parts(self, obj: dict[str, Any]) -> list[str]:
        parts = safe_parts(obj["path"])
        if not parts:
            raise UnsafePath(f"{obj['path']}: not a path a file can be written to")
        return parts

    def create_file(self, obj: dict[str, Any]) -> int:
        """Create the regular file (its inline data written); returns its
        descriptor, for a blobvec's chunks (:func:`os.pwrite`), then
        :meth:`finish_file` (or :meth:`abandon_file`)."""
        parts = self._file_parts(obj)
        parent = self._parent(obj["path"], parts)
        try:
            self._clear(parent, parts[-1], obj["path"])
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=parent)
        finally:
            os.close(parent)
        try:
            data = inline_data(obj)
            if data:
                write_at(fd, data, 0)
        except BaseException:
            self.abandon_file(fd, obj)
            raise
        return fd

    def finish_file(self, fd: int, obj: dict[str, Any]) -> None:
        """Size (a trailing hole), permissions and time; closes ``fd``.  A
        file whose size cannot be set (past a file-size limit) is removed,
        as one whose data cannot be written: it is short."""
        try:
            size = obj.get("size")
            if size is not None:
                os.ftruncate(fd, int(size))
            os.fchmod(fd, int(obj["mode"]) & 0o777)
            if obj.get("mtime") is not None:
                t = int(obj["mtime"])
                os.utime(fd, (t, t))
        except BaseException:
            self.abandon_file(fd, obj)
            raise
        os.close(fd)

    def abandon_file(self, fd: int, obj: dict[str, Any]) -> None:
        """Close and remove a file whose data could not all be written: a
        short file must not pass for the archived one."""
        os.close(fd)
        parts = safe_parts(obj["path"])
        try:
            parent = self._parent(obj["path"], parts, make=False)
        except OSError:
            return
        try:
            os.unlink(parts[-1], dir_fd=parent)
        except OSError:
            pass
        finally:
            os.close(parent)

    def finish(self) -> None:
        """The directories' permissions and times, deepest first."""
        for parts, mode, mtime in sorted(self._dirs, key=lambda d: -len(d[0])):
            parent = self._parent("/".join(parts), parts, make=False)
            try:
                fd = os.open(parts[-1], _DIR_FLAGS, dir_fd=parent)
            finally:
                os.close(parent)
            try:
                os.fchmod(fd, mode & 0o777)
                if mtime is not None:
                    os.utime(fd, (int(mtime), int(mtime)))
            finally:
                os.close(fd)
        self._dirs.clear()


def write_at(fd: int, data: bytes, offset: int) -> None:
    """All of ``data`` at ``offset`` (``pwrite`` may write less)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
