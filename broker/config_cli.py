"""``kvbroker config get|set|unset|load|reload|builtin`` (Flux's ``flux
config``; docs/cli.md "config"): a rank's configuration -- the file it
started from, as read -- and changing it."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from broker import jsontoml
from broker.cliutil import (
    CLIError,
    UsageError,
    add_answer_timeout,
    connect,
    each_rank,
    rank_int,
    rank_set,
    run_async,
)
from broker.message import NODEID_ANY

TYPES = ("any", "integer", "real", "string", "boolean", "array", "object", "fsd",
         "fsd-integer", "fsd-real")
"""``config get --type``'s names, as Flux's."""

SET_TYPES = ("integer", "real", "string", "boolean", "array", "object", "fsd")
"""``config set --type``'s: a value is stored as one of these (``fsd`` a
string that is a duration); the seconds of ``fsd-integer``/``fsd-real``
are only a way of printing one."""

SUBCOMMANDS = "get, set, unset, load, reload or builtin"


def type_name(text: str) -> str:
    """argparse ``type`` for ``--type``: one of :data:`TYPES`, any case
    (Flux's message for another)."""
    if text.lower() not in TYPES:
        raise argparse.ArgumentTypeError(f"Unknown type: {text} (one of: {', '.join(TYPES)})")
    return text.lower()


def register(sub: Any) -> None:
    s = sub.add_parser("config", help="a rank's configuration (start --config, a bootstrap "
                       "file): get or set a value, load or reload it",
                       description="A rank's configuration: the file it started from "
                       "(start --config FILE, or a bootstrap file), as read.")
    csub = s.add_subparsers(dest="config_cmd", metavar="COMMAND",
                            title="supported subcommands")
    _register_get(csub)
    _register_changes(csub)
    b = csub.add_parser("builtin", help="print what the rank's installation is: KEY is "
                        "python, python_path or bindir",
                        description="Print a value of the rank's installation (python, "
                        "python_path, bindir), as Flux's compiled-in paths.")
    b.add_argument("key", metavar="KEY")
    b.add_argument("-r", "--rank", type=rank_int, metavar="N",
                   help="ask rank N (default: the rank attached to)")
    add_answer_timeout(b)
    s.set_defaults(func=cmd_config)


def _register_get(csub: Any) -> None:
    g = csub.add_parser("get", help="print the configuration, or the value at NAME",
                        description="Query a rank's configuration values: the whole object "
                        "as JSON, or the value at the dotted NAME (a string plain).")
    g.add_argument("name", nargs="?", metavar="NAME", help="a dotted path: attrs.log.level")
    g.add_argument("--type", type=type_name, metavar="TYPE",
                   help=f"the value must be one of: {', '.join(TYPES)} (fsd: a duration, "
                   "30s; printed as seconds by fsd-integer and fsd-real)")
    g.add_argument("-d", "--default", metavar="VALUE",
                   help="print VALUE if NAME is not set (else it is an error)")
    g.add_argument("-q", "--quiet", action="store_true",
                   help="NAME not set: exit 1 without saying so (Flux's -q)")
    g.add_argument("-c", "--config-path", metavar="FILE",
                   help="read FILE (TOML, or JSON if it ends .json) instead of asking a rank")
    g.add_argument("-r", "--rank", type=rank_int, metavar="N",
                   help="ask rank N (default: the rank attached to)")
    add_answer_timeout(g)


def _register_changes(csub: Any) -> None:
    st = csub.add_parser("set", help="set the value at NAME and load the result",
                         description="Set the value at the dotted NAME in a rank's "
                         "configuration, applied as config load applies an object.")
    st.add_argument("name", metavar="NAME")
    st.add_argument("value", metavar="VALUE")
    st.add_argument("--type", type=type_name, metavar="TYPE",
                    help=f"VALUE is one of: {', '.join(SET_TYPES)} (default: the type of "
                    "the value NAME has)")
    u = csub.add_parser("unset", help="take NAME out and load the result (not set: nothing "
                        "to do)")
    u.add_argument("name", metavar="NAME")
    ld = csub.add_parser("load", help="replace the configuration with the object in PATH "
                         "or on standard input (TOML or JSON)",
                         description="Replace a rank's configuration with an object (TOML, "
                         "or JSON) and set the [attrs] that changed, as reload does; the "
                         "file is not changed, and the next reload reads it again.")
    ld.add_argument("path", nargs="?", metavar="PATH",
                    help="a file (JSON if it ends .json; default: standard input)")
    r = csub.add_parser("reload", help="read the file again and set the attributes that "
                        "changed in its [attrs] (those a running rank may change)")
    for p in (st, u, ld, r):
        p.add_argument("-r", "--rank", type=rank_set, metavar="IDSET",
                       help="on these ranks at once: 3, 0-3 or all (default: the rank "
                       "attached to)")
        add_answer_timeout(p)


def cmd_config(args: argparse.Namespace) -> int:
    if args.config_cmd is None:
        raise UsageError(f"missing subcommand ({SUBCOMMANDS})")
    args.what = f"config {args.config_cmd}"
    if getattr(args, "name", None) is not None:
        # (a name that is not UTF-8 is no name a file can hold: said so, as
        # every command says it, not "a\udcff is not set")
        args.name.encode()
    if args.config_cmd == "get" and args.config_path is not None:
        if args.rank is not None:
            raise UsageError("--config-path reads a file: it asks no rank (-r)")
        return print_value(read_path(args.config_path, args.what), args)
    if args.config_cmd == "set" and args.type in ("fsd-integer", "fsd-real", "any"):
        raise UsageError(f"--type {args.type} is not a type a value is set as (one of: "
                         f"{', '.join(SET_TYPES)})")
    if args.config_cmd == "set" and args.type is not None:  # (checked before any request)
        check_integers(parse_value(args.value, args.type, args.what), "", args.what, args.name)
    loaded = None
    if args.config_cmd == "load":
        loaded = (read_path(args.path, args.what) if args.path is not None
                  else read_stdin(args.what))
        check_integers(loaded, args.path or "standard input", args.what)

    async def main() -> int:
        async with await connect() as h:
            if args.config_cmd in ("reload", "load", "set", "unset"):
                ranks: list[int] = ([NODEID_ANY] if args.rank is None
                                    else args.rank.ranks(int(await h.attr_get("size")),
                                                         args.what))
                await each_rank(args.what, ranks, change(h, args, loaded),
                                named=args.rank is not None and args.rank.single() is None)
                return 0
            nodeid = NODEID_ANY if args.rank is None else args.rank
            if args.config_cmd == "builtin":
                answer = await h.rpc("broker.conf-builtin", {"keys": [args.key]},
                                     nodeid=nodeid)
                print(answer["values"][args.key])
                return 0
            return print_value((await h.rpc("config.get", {}, nodeid=nodeid))["config"], args)

    return run_async(args, main)


def change(h: Any, args: argparse.Namespace,
           loaded: dict[str, Any] | None) -> Callable[[int], Awaitable[Any]]:
    """The request(s) that make ``args``' change on one rank: ``set`` and
    ``unset`` take that rank's object and load it changed, as Flux's."""
    async def one(rank: int) -> Any:
        if args.config_cmd == "reload":
            return await h.rpc("config.reload", {}, nodeid=rank)
        doc = loaded
        if doc is None:
            doc = (await h.rpc("config.get", {}, nodeid=rank))["config"]
            if args.config_cmd == "set":
                set_value(doc, args.name, args.value, args.type, args.what)
            elif not unset_value(doc, args.name):
                return {"changed": {}}
        return await h.rpc("config.load", {"config": doc}, nodeid=rank)

    return one


def print_value(config: Any, args: argparse.Namespace) -> int:
    """``config get``'s output for ``config``: the value at ``args.name``,
    its ``--default``, or the error saying it is not set (exit 1 alone
    with ``--quiet``)."""
    value = lookup(config, args.name)
    if value is not _MISSING:
        print(show(value, args.type, args.name))
    elif args.default is not None:
        print(args.default)
    elif args.quiet:
        return 1  # (a script's test of whether NAME is set, as Flux's -q)
    else:
        raise CLIError("config get", detail=f"{args.name} is not set in the configuration")
    return 0


def read_path(path: str, what: str) -> dict[str, Any]:
    """The object in the file ``path``: JSON if it ends ``.json``, else
    TOML.  A directory is refused: a rank's configuration is one file
    (Flux's ``conf.d`` directories of ``*.toml`` are not read)."""
    if os.path.isdir(path):
        raise CLIError(what, detail=f"{path}: is a directory: a rank's configuration is one "
                       "file (TOML, or JSON ending .json)")
    try:
        with open(path, "rb") as f:
            data = _bounded(f, path, what)
    except OSError as exc:
        raise CLIError(what, detail=f"{path}: {exc.strerror}") from None
    return parse_object(data, path, what, json_only=path.endswith(".json"))


def read_stdin(what: str) -> dict[str, Any]:
    """The object on standard input: JSON, or else TOML (nothing: ``{}``)."""
    return parse_object(_bounded(sys.stdin.buffer, "standard input", what),
                        "standard input", what)


def _bounded(f: Any, where: str, what: str) -> bytes:
    """All of ``f``, refused past :data:`broker.bootstrap.MAX_FILE_BYTES`
    (a rank's file is read so: ``/dev/zero`` is no configuration)."""
    from broker.bootstrap import MAX_FILE_BYTES, read_limited

    data = read_limited(f)
    if data is None:
        raise CLIError(what, detail=f"{where}: larger than {MAX_FILE_BYTES >> 20} MiB: not "
                       "a configuration")
    return data


def parse_object(data: bytes, where: str, what: str,
                 json_only: bool = False) -> dict[str, Any]:
    """``data`` as a configuration object: a JSON object, or (unless
    ``json_only``) a TOML document, JSON-safe (TOML dates as ISO text)."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise CLIError(what, detail=f"{where}: not UTF-8 text") from None
    try:
        doc = jsontoml.loads_finite_json(text)
    except json.JSONDecodeError as exc:
        if json_only:
            raise CLIError(what, detail=f"{where}: not JSON: {exc}") from None
        doc = _toml(text, where, what)
    except ValueError as exc:  # (an integer of more digits than int() reads)
        raise CLIError(what, detail=f"{where}: {exc}") from None
    if not isinstance(doc, dict):
        raise CLIError(what, detail=f"{where}: not an object (a table): {text.strip()[:40]}")
    return doc


def _toml(text: str, where: str, what: str) -> dict[str, Any]:
    """``text`` as a TOML document, JSON-safe (its dates as ISO text)."""
    import tomllib  # (here: every kvbroker command imports this module)

    from broker.config import json_safe

    try:
        return dict(json_safe(jsontoml.loads_toml(text)))
    except tomllib.TOMLDecodeError as exc:
        raise CLIError(what, detail=f"{where}: not JSON, nor TOML: {exc}") from None
    except ValueError as exc:  # (as json's: too many digits)
        raise CLIError(what, detail=f"{where}: {exc}") from None


INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1
"""The integers a request carries (msgpack's); JSON and TOML read larger."""


def check_integers(value: Any, where: str, what: str, name: str = "") -> None:
    """Refuse an integer in ``value`` outside :data:`INT_MIN`..:data:`INT_MAX`,
    naming its dotted place: the request could not be encoded, and the
    command ended in a traceback."""
    if isinstance(value, dict):
        for key, item in value.items():
            check_integers(item, where, what, f"{name}.{key}" if name else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_integers(item, where, what, f"{name}[{i}]")
    elif isinstance(value, int) and not INT_MIN <= value <= INT_MAX:
        digits = str(value)
        shown = digits if len(digits) <= 24 else f"{digits[:20]}... ({len(digits)} digits)"
        raise CLIError(what, detail=": ".join(filter(None, (where, name)))
                       + f": {shown} is out of range (a 64-bit integer)")


_MISSING = object()


def _place(config: Any, name: str) -> tuple[Any, str] | None:
    """The table holding dotted ``name`` in ``config`` and its key there,
    found as :func:`lookup` finds it; None if unset."""
    def find(node: Any, parts: list[str]) -> tuple[Any, str] | None:
        if not isinstance(node, dict):
            return None
        for i in range(len(parts), 0, -1):
            key = ".".join(parts[:i])
            if key not in node:
                continue
            if i == len(parts):
                return node, key
            found = find(node[key], parts[i:])
            if found is not None:
                return found
        return None

    return find(config, name.split("."))


def lookup(config: Any, name: str | None) -> Any:
    """The value at dotted ``name`` (the whole object for None;
    :data:`_MISSING` if unset).  A TOML key may hold dots itself
    (``"log.level" = ...``, or ``log.level = ...``, a table): both are
    found, the longest key first."""
    if not name:
        return config
    place = _place(config, name)
    return _MISSING if place is None else place[0][place[1]]


def set_value(config: dict[str, Any], name: str, text: str, kind: str | None,
              what: str) -> None:
    """``config set``: ``text`` as a ``kind`` (default: the type of the
    value there) at dotted ``name`` -- where :func:`lookup` finds it (a
    quoted dotted key stays one), else in tables made along the way."""
    place = _place(config, name)
    if kind is None:
        if place is None:
            raise CLIError(what, detail=f"{name} is not set: give its --type")
        kind = _kind_of(place[0][place[1]])
    value = parse_value(text, kind, what)
    check_integers(value, "", what, name)
    if place is not None:
        place[0][place[1]] = value
        return
    node = config
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise CLIError(what, detail=f"{'.'.join(parts[:i + 1])} is not a table: "
                           f"{name} cannot be set in it")
    node[parts[-1]] = value


def unset_value(config: dict[str, Any], name: str) -> bool:
    """``config unset``: take dotted ``name`` out; whether it was set."""
    place = _place(config, name)
    if place is not None:
        del place[0][place[1]]
    return place is not None


def _kind_of(value: Any) -> str:
    """The ``--type`` name of a value there (a string stays a string)."""
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "real", list: "array", dict: "object"}.get(
        type(value), "string")


def parse_value(text: str, kind: str, what: str) -> Any:
    """``config set``'s VALUE as a ``kind``, or :class:`CLIError` saying it
    is not one (Flux's ``Error parsing ...``)."""
    def bad(detail: str) -> CLIError:
        shown = text if len(text) <= 80 else f"{text[:60]}...({len(text)} characters)"
        return CLIError(what, detail=f"{shown!r} is not {detail}")

    if kind == "boolean":
        if text.lower() not in ("true", "false", "1", "0"):
            raise bad("a boolean (true, false, 1 or 0)")
        return text.lower() in ("true", "1")
    if kind == "integer":
        try:
            return int(text, 0)
        except ValueError:
            raise bad("an integer") from None
    if kind == "real":
        try:
            real = float(text)
        except ValueError:
            raise bad("a real number") from None
        if not math.isfinite(real):
            raise bad("a finite real number")
        return real
    if kind in ("array", "object"):
        try:
            value = jsontoml.loads_finite_json(text)
        except ValueError as exc:  # (not JSON, or an integer of too many digits)
            if str(exc) == jsontoml.TOO_DEEP or jsontoml.NOT_FINITE in str(exc):
                raise bad(f"a JSON {kind}: {exc}") from None
            value = None
        if not isinstance(value, list if kind == "array" else dict):
            raise bad(f"a JSON {kind}")
        return value
    if kind == "fsd":
        from broker.attrs import duration

        try:
            duration(text)
        except ValueError:
            raise bad("a duration (30s, 5m, 1.5h)") from None
        return text
    if text.startswith('"'):
        try:
            value = jsontoml.loads_json(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, str):
            raise bad("a string (one starting with a quote is read as a JSON string)")
        return value
    return text


def _dump(value: Any) -> str:
    """JSON as Flux prints it: compact."""
    return json.dumps(value, separators=(",", ":"))


def show(value: Any, kind: str | None, name: str | None) -> str:
    """``value`` as ``config get`` prints it: a string plain, anything
    else as compact JSON (as Flux's); with ``--type`` once it is of that
    type (``fsd-*``: its seconds)."""
    if kind in (None, "any"):
        return value if isinstance(value, str) else _dump(value)
    ok = {"integer": type(value) is int, "real": isinstance(value, (int, float))
          and not isinstance(value, bool), "string": isinstance(value, str),
          "boolean": isinstance(value, bool), "array": isinstance(value, list),
          "object": isinstance(value, dict)}.get(kind)
    if kind.startswith("fsd"):
        from broker.attrs import duration

        try:
            seconds = duration(value) if isinstance(value, str) else None
        except ValueError:
            seconds = None
        ok = seconds is not None
        if ok and kind == "fsd-integer":
            return str(int(seconds or 0))
        if ok and kind == "fsd-real":
            return str(float(seconds or 0))
    if not ok:
        raise CLIError("config get", detail=f"{name or 'the configuration'} does not have the "
                       f"requested type ({kind}): {_dump(value)}")
    if kind in ("array", "object"):
        return _dump(value)
    if kind == "boolean":
        return "true" if value else "false"
    return str(value)
