# ruff: noqa: E501  (expected transcripts keep the commands' long lines whole)
"""flux-core t/t0009-dmesg.t: ``kvbroker logger`` and ``kvbroker dmesg`` on the command line.

Pinned elsewhere: the ring's size and wrap, ``--clear``, ``--follow``, the
UTC time (tests/test_broker_dmesg.py).  Here: ``logger`` with no MESSAGE
logs what standard input holds, as ``flux logger`` (``seq 1 8 | flux
logger``: it was a usage error), one line of ``dmesg`` per line, blank
lines dropped as Flux's stdlog drops them (a bare prefix was printed),
trailing CR/LF dropped, bytes that are not UTF-8 logged (U+FFFD) instead
of the note lost, UTF-8 kept as it is, 3,000 characters not cut; Flux's
severity names (``err``, ``notice``, ``crit``...: usage errors before);
``dmesg -c`` printing then forgetting, ``-C`` forgetting; ``dmesg -f
--new`` printing only what is logged after it started (``--new`` was
unknown).
"""

from __future__ import annotations

import asyncio
import os
import signal

from test_broker_support import KVBROKER, stats, wait_until
from test_kvs_cli import expect, sh

STAMP = r"s/^[0-9T:.-]*Z kvbroker/TIME kvbroker/"
"""sed: a line's time, which varies, made ``TIME``."""


async def test_t0009_logger_and_dmesg(start_instance) -> None:
    inst = await start_instance(size=2)
    out = await sh(inst, rf"""
        d() {{ kvbroker dmesg "$@" | grep -v ' kvbroker[.:]' | sed -e '{STAMP}'; }}
        kvbroker dmesg -C
        t sh -c 'seq 1 8 | kvbroker logger --appname=linesplit1'
        printf 'xxx\n\r\n' | kvbroker logger --appname striptest
        printf 'foo\nbar\nbaz\n\nnerp\n' | kvbroker logger --appname=embtest
        printf '\377\376\202\000' | kvbroker logger
        t kvbroker logger ƒ Φ Ψ Ω Ö
        t kvbroker logger -s err -n sev it is an err
        t kvbroker logger --severity=notice -n sev a notice
        t kvbroker logger -s crit -n sev critical
        t d -c
        t d
        python3 -c 'print("x"*3000)' | kvbroker logger --appname=truncate
        t sh -c "kvbroker dmesg | sed -n '/truncate/s/^.*: //p' | wc -c"
        t kvbroker dmesg -C
        t d
        t on 1 sh -c 'echo from-rank-1 | kvbroker logger -s warning'
        t d --all
        """)
    assert out == expect("""
        $ sh -c seq 1 8 | kvbroker logger --appname=linesplit1
        $ kvbroker logger ƒ Φ Ψ Ω Ö
        $ kvbroker logger -s err -n sev it is an err
        $ kvbroker logger --severity=notice -n sev a notice
        $ kvbroker logger -s crit -n sev critical
        $ d -c
        TIME kvbroker[0]: INFO linesplit1: 1
        TIME kvbroker[0]: INFO linesplit1: 2
        TIME kvbroker[0]: INFO linesplit1: 3
        TIME kvbroker[0]: INFO linesplit1: 4
        TIME kvbroker[0]: INFO linesplit1: 5
        TIME kvbroker[0]: INFO linesplit1: 6
        TIME kvbroker[0]: INFO linesplit1: 7
        TIME kvbroker[0]: INFO linesplit1: 8
        TIME kvbroker[0]: INFO striptest: xxx
        TIME kvbroker[0]: INFO embtest: foo
        TIME kvbroker[0]: INFO embtest: bar
        TIME kvbroker[0]: INFO embtest: baz
        TIME kvbroker[0]: INFO embtest: nerp
        TIME kvbroker[0]: INFO logger: \ufffd\ufffd\ufffd\ufffd
        TIME kvbroker[0]: INFO logger: ƒ Φ Ψ Ω Ö
        TIME kvbroker[0]: ERROR sev: it is an err
        TIME kvbroker[0]: INFO sev: a notice
        TIME kvbroker[0]: ERROR sev: critical
        $ d
        $ sh -c kvbroker dmesg | sed -n '/truncate/s/^.*: //p' | wc -c
        3001
        $ kvbroker dmesg -C
        $ d
        $ on 1 sh -c echo from-rank-1 | kvbroker logger -s warning
        $ d --all
        TIME kvbroker[1]: WARNING logger: from-rank-1
        """)


async def test_t0009_dmesg_follow_new_prints_only_what_comes_after(
        start_instance, connect) -> None:
    """``flux dmesg -f --new``: the records kept are not printed, those
    logged once it follows are, none missed."""
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    await h.log("hello_old")
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "dmesg", "--follow", "--new", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=dict(os.environ, KVBROKER_URI=inst.uri(0)))
    assert proc.stdout is not None and proc.stderr is not None
    try:
        async with asyncio.timeout(30):
            async def following() -> bool:
                return bool((await stats(h, 0))["log"]["followers"]) or \
                    proc.returncode is not None

            await wait_until(following, "dmesg --follow --new to follow")
            for n in range(3):
                await h.log(f"hello_new{n}")
            lines = [(await proc.stdout.readline()).decode() for _ in range(3)]
            assert [line.split(": ", 2)[-1] for line in lines] == [
                f"hello_new{n}\n" for n in range(3)], (lines, await proc.stderr.read())
            proc.send_signal(signal.SIGINT)
            assert await proc.wait() == 130
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
