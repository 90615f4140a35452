"""``kvbroker uri [--local|--remote] TARGET`` (Flux's ``flux uri``; docs/cli.md
"uri"): print the URI a target names (:mod:`broker.uri`)."""

from __future__ import annotations

import argparse
from typing import Any

from broker.cliutil import CLIError, add_answer_timeout, connect, errno_detail, run_async
from broker.errors import ErrnoError
from broker.uri import SCHEMES, resolve


def register(sub: Any) -> None:
    targets = "\n".join(f"  {text}" for text in SCHEMES.values())
    s = sub.add_parser("uri", help="print the URI of an instance: of a process in it "
                       "(pid:PID), of one of its ranks (rank:N), in local or ssh form",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=f"targets (each may end in ?local, ?remote or ?wait):\n{targets}")
    s.add_argument("target", metavar="TARGET",
                   help="pid:PID, rank:N, ., or a local:// or ssh:// URI (below)")
    form = s.add_mutually_exclusive_group()
    form.add_argument("--local", dest="form", action="store_const", const="local",
                      help="the local:// form (as ?local)")
    form.add_argument("--remote", dest="form", action="store_const", const="remote",
                      help="the ssh:// form naming this host, for a client elsewhere "
                      "(as ?remote)")
    s.add_argument("--wait", action="store_true",
                   help="pid:PID: wait until its instance is up (kvbroker start still "
                   "starting), as ?wait")
    add_answer_timeout(s, help_text="give up after SECONDS (exit 1): rank:N asks rank N "
                       "through the tree, which waits for a stopped rank on the way; "
                       "--wait waits for the instance")
    s.set_defaults(func=cmd_uri, form=None)


def cmd_uri(args: argparse.Namespace) -> int:
    args.what = "uri"
    args.target.encode()  # (not UTF-8: said so, not "a\udcff: unknown target")
    rank = args.target.partition("?")[0].removeprefix("rank:")
    if rank.isascii() and rank.isdigit():  # (named by -t's message: "rank 3 did not answer in 1s")
        args.rank = int(rank)

    async def main() -> int:
        try:
            uri = await resolve(args.target, form=args.form, wait=args.wait, connect=connect)
        except ValueError as exc:
            raise CLIError("uri", detail=str(exc)) from None
        except ErrnoError as exc:  # (rank:N: that rank's answer)
            raise CLIError("uri", exc.errnum, f"{args.target}: {errno_detail(exc)}") from None
        print(uri)
        return 0

    return run_async(args, main)
