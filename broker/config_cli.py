"""``kvbroker config get|reload`` (Flux's ``flux config``; docs/cli.md
"config"): a rank's configuration file, as read, and reading it again."""

from __future__ import annotations

import argparse
import json
from typing import Any

from broker.cliutil import (
    CLIError,
    add_answer_timeout,
    connect,
    each_rank,
    rank_int,
    rank_set,
    run_async,
)
from broker.message import NODEID_ANY

TYPES = ("integer", "real", "string", "boolean", "array", "object", "fsd", "fsd-integer",
         "fsd-real")
"""``config get --type``'s names, as Flux's."""


def register(sub: Any) -> None:
    s = sub.add_parser("config", help="a rank's configuration file (start --config, a "
                       "bootstrap file): get a value, or reload it")
    csub = s.add_subparsers(dest="config_cmd", required=True)
    g = csub.add_parser("get", help="print the configuration (as read), or the value at NAME")
    g.add_argument("name", nargs="?", metavar="NAME", help="a dotted path: attrs.log.level")
    g.add_argument("--type", choices=TYPES, metavar="TYPE",
                   help=f"the value must be one of: {', '.join(TYPES)} (fsd: a duration, "
                   "30s; printed as seconds by fsd-integer and fsd-real)")
    g.add_argument("-d", "--default", metavar="VALUE",
                   help="print VALUE if NAME is not set (else it is an error)")
    g.add_argument("-r", "--rank", type=rank_int, metavar="N",
                   help="ask rank N (default: the rank attached to)")
    add_answer_timeout(g)
    r = csub.add_parser("reload", help="read the file again and set the attributes that "
                        "changed in its [attrs] (those a running rank may change)")
    r.add_argument("-r", "--rank", type=rank_set, metavar="IDSET",
                   help="on these ranks at once: 3, 0-3 or all (default: the rank attached to)")
    add_answer_timeout(r)
    s.set_defaults(func=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    args.what = f"config {args.config_cmd}"

    async def main() -> int:
        async with await connect() as h:
            if args.config_cmd == "reload":
                ranks: list[int] = ([NODEID_ANY] if args.rank is None
                                    else args.rank.ranks(int(await h.attr_get("size")),
                                                         args.what))
                await each_rank(args.what, ranks,
                                lambda r: h.rpc("config.reload", {}, nodeid=r),
                                named=args.rank is not None and args.rank.single() is None)
                return 0
            nodeid = NODEID_ANY if args.rank is None else args.rank
            config = (await h.rpc("config.get", {}, nodeid=nodeid))["config"]
            value = lookup(config, args.name)
            if value is not _MISSING:
                print(show(value, args.type, args.name))
            elif args.default is not None:
                print(args.default)
            else:
                raise CLIError("config get", detail=f"{args.name} is not set in the "
                               "configuration")
        return 0

    return run_async(args, main)


_MISSING = object()


def lookup(config: Any, name: str | None) -> Any:
    """The value at dotted ``name`` (the whole object for None;
    :data:`_MISSING` if unset).  A TOML key may hold dots itself
    (``"log.level" = ...``, or ``log.level = ...``, a table): both are
    found, the longest key first."""
    if not name:
        return config

    def find(node: Any, parts: list[str]) -> Any:
        if not parts:
            return node
        if not isinstance(node, dict):
            return _MISSING
        for i in range(len(parts), 0, -1):
            key = ".".join(parts[:i])
            if key in node:
                found = find(node[key], parts[i:])
                if found is not _MISSING:
                    return found
        return _MISSING

    return find(config, name.split("."))


def show(value: Any, kind: str | None, name: str | None) -> str:
    """``value`` as ``config get`` prints it: JSON, or with ``--type`` the
    plain value once it is of that type."""
    if kind is None:
        return json.dumps(value)
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
                       f"requested type ({kind}): {json.dumps(value)}")
    if kind in ("array", "object"):
        return json.dumps(value)
    if kind == "boolean":
        return "true" if value else "false"
    return str(value)

