"""Other users ("guests"): refused unless the instance allows them, then role USER.

The guest clients are real processes whose uid is not ours: they start as
root (to import the package) and drop to the guest uid before connecting,
so the broker's SO_PEERCRED check sees the guest (see GUEST_SCRIPT).
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import sys

import pytest
from test_broker_support import (
    GUEST_CLI_PRELOAD,
    GUEST_IMPORT_GUARD,
    GUEST_UID,
    OTHER_GUEST_UID,
    GuestProc,
    run_cli,
    run_guest,
    stats,
    wait_until,
)

from broker.loops import loop_name
from broker.message import MsgFlags, Role

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to run as another uid")

ALLOW = {"access.allow-guest-user": "true"}


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


async def test_guests_refused_by_default(start_instance, connect) -> None:
    inst = await start_instance(size=2, fanout=2)
    async with asyncio.timeout(20):
        rundir = inst.rundir
        assert mode(rundir) == 0o700
        for name in ("local-0", "local-1", "tbon-0"):
            assert mode(os.path.join(rundir, name)) == 0o700
        assert mode(os.path.join(rundir, "content.sqlite")) == 0o600
        # the file system keeps the guest out...
        guest = await run_guest(inst.uri(1), "identity")
        assert await guest.lines() == [{"connect": errno.EACCES}]

        # ...and so does the broker itself, were the permissions opened
        h = await connect(inst, 1)
        os.chmod(rundir, 0o755)
        os.chmod(os.path.join(rundir, "local-1"), 0o777)
        guest = await run_guest(inst.uri(1), "identity")
        # told why (broker.closing), as Flux's EPERM: it read "connection reset"
        assert await guest.lines() == [{"error": errno.EPERM}]
        rc, out, err = await run_guest_cli(inst.uri(1), "ping")
        assert (rc, out) == (1, "") and "Operation not permitted" in err, err
        assert f"admits only its owner (uid {os.getuid()})" in err, err
        assert "-S access.allow-guest-user=true" in err, err
        assert (await stats(h))["clients"] == 1
        assert (await h.ping(0))["rank"] == 0


_GUEST_CLI = GUEST_CLI_PRELOAD + """
import os, sys
import broker.cli as cli
cli.build_parser()  # entry points read as root, as the other guest scripts do
os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[1]))
""" + GUEST_IMPORT_GUARD + """
sys.exit(cli.main(sys.argv[2:] or ["ping"]))
"""


async def run_guest_cli(uri: str, *args: str, preload: str = "") -> tuple[int, str, str]:
    """``kvbroker ARGS`` run as the guest (``_GUEST_CLI``); ``preload``:
    Python run first, as the owner (imports the interpreter's own library
    may not let the guest read: its ``sqlite3``)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", preload + "\n" + _GUEST_CLI, str(GUEST_UID), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=dict(os.environ, KVBROKER_URI=uri))
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_refused_guest_cli_says_how_guests_are_admitted(start_instance) -> None:
    inst = await start_instance(size=1)
    rc, out, err = await run_guest_cli(inst.uri(0))
    assert rc == 1 and out == ""
    assert err.strip() == (
        f"kvbroker: ping: cannot connect to broker at KVBROKER_URI={inst.uri(0)}: Permission "
        "denied (this instance admits other users only if started with "
        "-S access.allow-guest-user=true)")


async def test_guest_module_list_names_the_modules_without_counts(start_instance) -> None:
    """A guest's ``module.list`` carries no request counts (they move with
    what other users do: see test_kvs_rpc_security), and ``kvbroker module
    list`` run by a guest prints ``-`` for them rather than failing."""
    inst = await start_instance(size=1, attrs=ALLOW)
    rc, out, err = await run_guest_cli(inst.uri(0), "module", "list")
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split() == ["Module", "Requests", "Services"]
    assert [line.split()[:2] for line in lines[1:]] == [
        ["broker", "-"], ["content", "-"], ["kvs", "-"], ["kvs-watch", "-"]]
    rc, out, err = await run_cli("module", "list", uri=inst.uri(0))  # the owner's
    assert rc == 0 and all(line.split()[1].isdigit() for line in out.splitlines()[1:]), out


async def test_ping_userid_prints_the_credentials_the_rank_saw(start_instance) -> None:
    """``ping -u`` (Flux's ``--userid``): the userid and rolemask stamped from
    the OS by the rank the client is attached to, carried to the rank that
    answered: the owner's ``0x1``, a guest's own uid and ``0x2``."""
    inst = await start_instance(size=2, attrs=ALLOW)
    rc, out, err = await run_cli("ping", "-u", "0", uri=inst.uri(1))
    assert (rc, err) == (0, "")
    assert f" seq=0 userid={os.getuid()} rolemask=0x1 time=" in out, out
    rc, out, err = await run_guest_cli(inst.uri(1), "ping", "--userid", "0")
    assert (rc, err) == (0, "")
    assert out.startswith("rank=0 route=c"), out
    assert f" seq=0 userid={GUEST_UID} rolemask=0x2 time=" in out, out
    rc, out, err = await run_cli("ping", "1", uri=inst.uri(1))  # (without it: as before)
    assert rc == 0 and "userid=" not in out and " seq=0 time=" in out, out



async def test_a_guest_may_not_clear_stats_nor_read_rusage(start_instance) -> None:
    """The counters are instance-wide, and the rank's rusage moves with what
    other users do: ``stats --clear``/``-R`` are the owner's (``EPERM``)."""
    inst = await start_instance(size=1, attrs=ALLOW)
    for args in (["-c", "kvs"], ["--clear-all", "kvs-watch"], ["-R", "kvs"], ["-c", "broker"]):
        rc, out, err = await run_guest_cli(inst.uri(0), "module", "stats", *args)
        assert rc == 1 and out == "" and "Operation not permitted" in err, (args, err)
        assert "is for the instance owner" in err, err


@pytest.mark.both_loops
async def test_allowed_guest_is_a_user(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2, attrs=ALLOW)
    loop = loop_name(asyncio.get_running_loop())
    async with asyncio.timeout(20):
        assert mode(inst.rundir) == 0o755
        assert mode(os.path.join(inst.rundir, "local-3")) == 0o777
        assert mode(os.path.join(inst.rundir, "tbon-0")) == 0o700
        assert mode(os.path.join(inst.rundir, "content.sqlite")) == 0o600
        guest = await run_guest(inst.uri(3), "identity", loop=loop)
        lines = await guest.lines()
        assert lines[0] == {"userid": GUEST_UID, "rolemask": Role.USER, "rank": 3}
        # guests may not publish what only the owner's services should say
        assert lines[1] == {"topic": "kvs.namespace-primary-setroot", "errnum": errno.EPERM}
        assert lines[2] == {"topic": "broker.fake", "errnum": errno.EPERM}
        assert lines[3]["topic"] == "guest.hello" and lines[3]["seq"] > 0
        # the content store is the owner's (as in Flux)
        assert lines[4] == {"content": errno.EPERM}
        # nor may they stop a rank or the instance
        assert lines[5:7] == [{"shutdown": errno.EPERM}] * 2
        # nor change an attribute (the log level stays the owner's), nor read
        # or write the log, nor cut a rank off the tree
        assert lines[7:11] == [{"attr_set": errno.EPERM}, {"dmesg": errno.EPERM},
                               {"logger": errno.EPERM}, {"disconnect": errno.EPERM}]
        # and the overlay socket is out of reach
        assert lines[11] == {"tbon": errno.EACCES}
        # the owner is still the owner, and every rank still serves
        h = await connect(inst, 3)
        assert (await h.ping(0))["rank"] == 0
        resp = await h.ping()
        assert (resp["userid"], resp["rolemask"]) == (os.getuid(), Role.OWNER)
        assert await h.attr_get("log.level") == "warning"


async def test_a_uid_past_2_31_is_read_unsigned(start_instance) -> None:
    """SO_PEERCRED's uid is unsigned: read as a signed int, uid 3000000000
    was userid -1294967296, and could not use a namespace made for it."""
    inst = await start_instance(size=1, attrs=ALLOW)
    guest = await run_guest(inst.uri(0), "identity", uid=3_000_000_000)
    lines = await guest.lines()
    assert lines[0] == {"userid": 3_000_000_000, "rolemask": Role.USER, "rank": 0}


async def test_private_events_reach_owner_and_their_user_only(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2, attrs=ALLOW)
    async with asyncio.timeout(30):
        owner = await connect(inst, 3)
        await owner.subscribe("priv.")
        a = await run_guest(inst.uri(1), "private", "publish", uid=GUEST_UID)
        b = await run_guest(inst.uri(2), "private", "quiet", uid=OTHER_GUEST_UID)
        assert await a.line() == {"subscribed": True}
        assert await b.line() == {"subscribed": True}

        async def pub(topic: str, userid: int | None = None) -> None:
            body: dict[str, object] = {"topic": topic}
            if userid is not None:
                body.update(flags=MsgFlags.PRIVATE, userid=userid)
            await owner.rpc("event.pub", body)

        await pub("priv.a", GUEST_UID)
        await pub("priv.b", OTHER_GUEST_UID)
        await pub("priv.owner", os.getuid())
        await pub("priv.public")
        await pub("priv.go")  # guest A then publishes a private event of its own
        seen = []
        while not seen or seen[-1] != "priv.from-guest":
            seen.append((await owner.recv_event()).topic)
        await pub("priv.end")

        a_topics = [x["topic"] for x in await a.lines()]
        b_topics = [x["topic"] for x in await b.lines()]
        assert a_topics == ["priv.a", "priv.public", "priv.go", "priv.from-guest", "priv.end"]
        assert b_topics == ["priv.b", "priv.public", "priv.go", "priv.end"]
        assert seen == [
            "priv.a",
            "priv.b",
            "priv.owner",
            "priv.public",
            "priv.go",
            "priv.from-guest",
        ]

        async def guests_gone() -> bool:
            return (await stats(owner, 1))["clients"] == 0

        await wait_until(guests_gone, "the guests to disconnect")


async def test_a_guests_topic_reaches_the_owners_log_escaped(start_instance) -> None:
    """A request the rank cannot decode (or too big to) is logged with its
    topic, which the client chose: a guest's topic carrying terminal
    control sequences reached ``kvbroker dmesg`` (and stderr at
    ``log.level`` info) raw, so it could retitle, clear or rewrite the
    instance owner's terminal.  Topics are now logged escaped (``repr``),
    as a message's are everywhere else."""
    inst = await start_instance(size=1, attrs={**ALLOW, "log.level": "info"})
    assert inst.stderr_path is not None
    evil = "x.y\x1b]0;owned\x07\x1b[2J\rFAKE"
    guest = await GuestProc.start(inst.uri(0), f"""
        import msgpack
        async def main():
            s = raw()
            # a header that does not decode (route of the wrong type) but
            # whose matchtag, topic and flags can be read; NORESPONSE: logged
            h = [1, {evil!r}, 0, 0, 2, 0, 0, "bad", 0, None, 0]
            frames = [msgpack.packb(h)]
            s.sendall(b"".join([codec.stream_prefix(frames), *frames]))
            # then a ping on the same connection: its answer comes after the log line
            s.sendall(request("broker.ping", {{}}, 5))
            out(ping=codec.peek_response(read_one(s, codec.StreamDecoder())))
        """)
    try:
        assert (await guest.line())["ping"][:2] == [5, 0]
        await guest.finish()
    finally:
        guest.kill()
    rc, out, err = await run_cli("dmesg", uri=inst.uri(0))
    assert rc == 0, err
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out, repr(out)
    line = next(x for x in out.splitlines() if "malformed request" in x)
    # one record, on one line, the topic as Python writes it
    assert "kvbroker.connector: c1: 'x.y\\x1b]0;owned\\x07\\x1b[2J\\rFAKE': dropping " \
        "malformed request" in line, line
    with open(inst.stderr_path) as f:
        log = f.read()
    assert "malformed request" in log and "\x1b" not in log, repr(log[-2000:])


async def test_a_guest_is_refused_before_its_payload_is_read(start_instance) -> None:
    """An owner-only service answers a guest ``EPERM`` whatever it sent, as
    Flux's dispatch refuses a role before the handler runs: a malformed
    payload is not judged first (``EPROTO``/``EINVAL`` told a guest what
    the owner's request looks like, and made it look allowed)."""
    inst = await start_instance(size=2, attrs=ALLOW)
    bad = [("attr.set", "{}"), ("overlay.disconnect-subtree", '{"rank": "x"}'),
           ("log.append", '{"message": 5}'), ("log.append", '{"message": "m", "level": 7}'),
           ("overlay.trace", "[]"), ("kvs.gc", "[]"), ("kvs.namespace-create", "{}"),
           ("content.checkpoint-get", "[]"), ("module.load", "{}"),
           ("log.dmesg", "{}"), ("log.dmesg", '{"follow": "yes"}'), ("log.clear", "[]")]
    for topic, payload in bad:
        rc, out, err = await run_guest_cli(inst.uri(1), "rpc", "--rank", "1", topic, payload)
        assert rc == 1 and out == "", (topic, out, err)
        assert "Operation not permitted" in err, (topic, err)
        # the owner sending the same is told what is wrong with it instead
        rc, out, err = await run_cli("rpc", "--rank", "1", topic, payload, uri=inst.uri(1))
        assert rc == 1 and "Operation not permitted" not in err, (topic, err)
