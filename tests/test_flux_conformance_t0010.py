"""flux-core t/t0010-generic-utils.t and t/t2802-uri-cmd.t, as kvbroker has
them: ``event pub``/``event sub`` (docs/cli.md, event), the version a
command and an instance report (docs/cli.md, Conventions, "Version"), and
what stands for ``flux uri``: the URIs themselves (docs/cli.md,
Conventions, "Which broker" and "From another host"; broker/handle.py
``parse_uri``, broker/ssh.py ``parse``).  Real instances, real sockets;
ssh is tests/bin/ssh-standin (as Flux's tests use tssh), so the relay and
the rank are real.

t0010, Flux case -> here:

1. *event: can publish* (a tracer sees ``flux event pub testcase.foo``) ->
   ``event pub`` with a JSON payload on rank 1, seen by ``event sub`` on
   rank 0 with its payload; several prefixes with ``--count`` (only the
   matching topics, in order, then exit 0; and on rank 1, published on
   rank 0, a 100 KB payload); overlapping prefixes deliver an
   event once; no prefix means every event; a payload that is not an object
   (a number, a string, an array) is carried as given.
2. *event: can subscribe* (``heartbeat.pulse``) -> the same, with the
   ``heartbeat`` module loaded (docs/guide.md, "A heartbeat"): ``event sub
   --count=1 heartbeat.pulse`` prints one ``heartbeat.pulse`` line and exits.
   And the flags docs/cli.md documents: ``-v`` prints the sequence number
   the subscribers see, ``-s`` is accepted and changes nothing, ``-l`` has
   the event back at the attached rank's subscribers when it returns, ``-p``
   reaches the owner and the publisher, not another guest (and a guest may
   not publish under ``kvs.`` and the other owner's prefixes: EPERM);
   without ``-c`` (or ``-c 0``) ``sub`` runs until Ctrl-C, which ends it
   quietly, status 130.  Refused, with the exit status and a message saying
   what is wrong: an empty topic, a topic that is not UTF-8, a payload that
   is not JSON (``{bad``, ``NaN``, trailing data), an extra argument, a
   missing topic, a bad ``--count``; Flux's ``-r`` (raw payload) has no
   counterpart (docs/cli.md) and is a usage error.
3.-6. *flux version / flux -V under an instance and not* (Flux prints
   libflux-core, commands, and -- under an instance -- broker and
   FLUX_URI) -> documented difference: ``kvbroker --version`` prints this
   command's version, the same inside an instance or out of one (it does
   not connect: a bad ``KVBROKER_URI`` does not matter); a rank's is its
   ``version`` attribute (docs/cli.md, Conventions), the same on every rank
   and equal to the command's here; without an instance ``attr get version``
   says ``KVBROKER_URI is not set``.  ``kvbroker version`` (Flux's ``flux
   version``) is not built: a usage error naming it.  ``kvbroker -V``
   (Flux's ``flux -V``) prints the version (until 2026-12-05: the whole
   help and "arguments are required: COMMAND").
7.-9. *heaptrace start/dump/stop, EPROTO on empty payloads* -> not
   applicable: no heaptrace (tcmalloc) in kvbroker; Flux accepts ENOSYS, and
   ``kvbroker rpc heaptrace.start`` gets just that: exit 1, ``Function not
   implemented (no service matching heaptrace.start)``.

t2802 (``flux uri``): ``kvbroker uri`` is built (2026-12-06) and its cases
are mapped in tests/test_flux_conformance_t2802.py.  What stays here is the
URIs as ``KVBROKER_URI`` takes them, which ``kvbroker uri`` prints:
``kvbroker start`` gives ``local://RUNDIR/local-R``, which the rank's
``local-uri`` attribute repeats; its ``--remote`` form,
``ssh://HOST/RUNDIR/local-R`` (also ``ssh://user@host:port/...``: ssh gets
``-p PORT -l USER HOST``), reaches the same rank through the relay; a
rank's ``broker.pid`` attribute is that rank's process, and its
``local-uri`` the URI to reach it; each rank says its own.  ``bar``,
``bar:foo`` and ``pid:N`` *as* ``KVBROKER_URI`` have no ``://`` and are bare
socket paths: refused as paths that do not exist, naming the URI, exit 1.

And bad ``KVBROKER_URI`` values said clearly, exit 1, nothing sent: an
unknown scheme (``tcp://``, ``foo://``, ``LOCAL://``), empty (as unset),
``local://`` without a path, a malformed ``ssh://``.  A path that exists
but is not a socket (a regular file, a directory) is said so (until
2026-12-05: ``Connection refused (no broker listens there: has the
instance stopped ...)``).  A JSON payload that is not UTF-8 is said so
(until then: Python's ``'\\udcff' ... surrogates not allowed``).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import socket
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import (
    KVBROKER,
    OTHER_GUEST_UID,
    GuestProc,
    client_subscriptions,
    run_cli,
    stats,
    wait_until,
)

from broker.handle import Handle

STANDIN = str(Path(__file__).parent / "bin" / "ssh-standin")
VERSION = dist_version("kvbroker")
ALLOW = {"access.allow-guest-user": "true"}
NO_URI_ERR = ("cannot connect to broker: KVBROKER_URI is not set (kvbroker start prints it "
              "and sets it for the command it runs)")


def events(out: str) -> list[tuple[str, Any]]:
    """``event sub``'s ``TOPIC<TAB>PAYLOAD-JSON`` lines, parsed."""
    lines = []
    for line in out.splitlines():
        topic, _, payload = line.partition("\t")
        lines.append((topic, json.loads(payload)))
    return lines


async def subscriber(h: Handle, rank: int, *args: str, uri: str,
                     prefixes: int) -> asyncio.Future[tuple[int, str, str]]:
    """``kvbroker event sub ARGS`` attached to ``uri`` (rank ``rank``),
    started and waited for until its ``prefixes`` subscriptions are in
    place (seen from ``h``)."""
    before = client_subscriptions(await stats(h, rank))
    sub = asyncio.ensure_future(run_cli("event", "sub", *args, uri=uri, timeout=30))

    async def subscribed() -> bool:
        if sub.done():
            raise AssertionError(f"event sub ended early: {sub.result()}")
        return client_subscriptions(await stats(h, rank)) >= before + prefixes

    await wait_until(subscribed, "event sub to subscribe")
    return sub


# ---------------------------------------------------------------- t0010: events


async def test_pub_with_payload_reaches_sub_by_several_prefixes_with_count(
        start_instance, connect) -> None:
    """Case 1: published on rank 1, seen on rank 0 by topic prefix: only
    the matching events, in order, their payloads as given, and ``--count
    3`` exits 0 after the third.  Overlapping prefixes deliver once; no
    prefix sees everything."""
    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    u0, u1 = inst.uri(0), inst.uri(1)
    sub = await subscriber(h0, 0, "--count", "3", "job.", "node.", uri=u0, prefixes=2)
    every = await subscriber(h0, 0, "-c", "5", uri=u0, prefixes=1)
    overlap = await subscriber(h0, 0, "-c", "2", "job", "job.1", uri=u0, prefixes=2)
    h1 = await connect(inst, 1)
    on1 = await subscriber(h1, 1, "-c", "2", "node.", "big", uri=u1, prefixes=2)
    published = [("job.1.start", '{"t": 0, "who": "me"}'), ("other.x", "[1, 2]"),
                 ("node.up", "3"), ("job.1.done", None), ("job.2.start", '"s"')]
    for topic, payload in published:
        rc, out, err = await run_cli("event", "pub", topic,
                                     *([payload] if payload is not None else []), uri=u1)
        assert (rc, out, err) == (0, "", ""), topic
    rc, out, err = await sub
    assert rc == 0, err
    assert events(out) == [("job.1.start", {"t": 0, "who": "me"}), ("node.up", 3),
                           ("job.1.done", None)]
    assert out.splitlines()[2] == "job.1.done\tnull"
    rc, out, err = await every
    assert rc == 0, err
    assert events(out) == [("job.1.start", {"t": 0, "who": "me"}), ("other.x", [1, 2]),
                           ("node.up", 3), ("job.1.done", None), ("job.2.start", "s")]
    rc, out, err = await overlap  # job.1.start matches both prefixes: once
    assert rc == 0, err
    assert [t for t, _ in events(out)] == ["job.1.start", "job.1.done"]
    big = {"blob": "x" * 100_000}  # (one argument: at most 128 KiB on Linux)
    rc, out, err = await run_cli("event", "pub", "big", json.dumps(big), uri=u0)
    assert (rc, out, err) == (0, "", "")
    rc, out, err = await on1  # published on rank 0, seen on rank 1
    assert rc == 0, err
    assert events(out) == [("node.up", 3), ("big", big)]


async def test_sub_heartbeat_pulse(start_instance) -> None:
    """Case 2 as Flux has it: ``event sub --count=1 heartbeat.pulse`` with
    the heartbeat module publishing."""
    inst = await start_instance(size=2, attrs={
        "broker.modules": "content,kvs,kvs-watch,heartbeat", "heartbeat.period": "100ms"})
    rc, out, err = await run_cli("event", "sub", "--count=1", "heartbeat.pulse",
                                 uri=inst.uri(1), timeout=20)
    assert rc == 0, err
    assert [t for t, _ in events(out)] == ["heartbeat.pulse"]


async def test_pub_verbose_synchronous_loopback(start_instance, connect) -> None:
    """``-v`` prints the sequence number the subscribers get; ``-s`` is
    taken and changes nothing; ``-l`` returns once the event is back at the
    attached rank (1), which has passed it to its subscribers there."""
    inst = await start_instance(size=2)
    h1 = await connect(inst, 1)
    await h1.subscribe("lb.")
    seqs = []
    for flags in (["-v"], ["-s", "-v"], ["--loopback", "--synchronous", "--verbose"]):
        rc, out, err = await run_cli("event", "pub", *flags, "lb.x", json.dumps({"f": flags[0]}),
                                     uri=inst.uri(1))
        assert rc == 0 and err == "", (flags, err)
        seq = int(out)
        ev = await asyncio.wait_for(h1.recv_event(), 10)
        assert (ev.topic, ev.seq, ev.payload) == ("lb.x", seq, {"f": flags[0]})
        seqs.append(seq)
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    rc, out, err = await run_cli("event", "pub", "-l", "lb.quiet", uri=inst.uri(1))
    assert (rc, out, err) == (0, "", "")  # without -v, nothing printed
    ev = await asyncio.wait_for(h1.recv_event(), 10)
    assert (ev.topic, ev.payload) == ("lb.quiet", None)


async def test_private_event_reaches_owner_and_publisher_only(start_instance, connect) -> None:
    """``-p``: the owner's subscriber sees a private event, a guest
    subscribed to the same prefix does not (it sees the public one after);
    a guest's own private event reaches that guest and the owner, not
    another guest.  A guest may not publish under ``kvs.``, ``broker.``,
    ``overlay.``, ``content.``, ``heartbeat.`` (EPERM)."""
    inst = await start_instance(size=2, attrs=ALLOW)
    h0 = await connect(inst, 0)
    publisher = """
        async def main():
            h = await Handle.connect(uri)
            await h.subscribe("t.")
            out(subscribed=True)
            ev = await asyncio.wait_for(h.recv_event(), 10)
            out(topic=ev.topic, payload=ev.payload)
            out(denied={p: await outcome(h.publish(p + "x"))
                        for p in ("kvs.", "broker.", "overlay.", "content.", "heartbeat.")})
            await h.publish("t.mine", {"g": 1}, private=True)
            ev = await asyncio.wait_for(h.recv_event(), 10)
            out(topic=ev.topic, payload=ev.payload)
    """
    other = """
        async def main():
            h = await Handle.connect(uri)
            await h.subscribe("t.")
            out(subscribed=True)
            for _ in range(2):
                ev = await asyncio.wait_for(h.recv_event(), 10)
                out(topic=ev.topic, payload=ev.payload)
    """
    guest = await GuestProc.start(inst.uri(1), publisher)
    guest2 = await GuestProc.start(inst.uri(0), other, uid=OTHER_GUEST_UID)
    try:
        assert (await guest.line())["subscribed"] and (await guest2.line())["subscribed"]
        owner = await subscriber(h0, 0, "-c", "4", "t.", uri=inst.uri(0), prefixes=1)
        rc, out, err = await run_cli("event", "pub", "-p", "t.secret", '{"k": 1}',
                                     uri=inst.uri(1))
        assert (rc, out, err) == (0, "", "")
        rc, out, err = await run_cli("event", "pub", "t.public", uri=inst.uri(0))
        assert (rc, out, err) == (0, "", "")
        assert await guest.line() == {"topic": "t.public", "payload": None}
        denied = (await guest.line())["denied"]
        assert {p: r[0] for p, r in denied.items()} == dict.fromkeys(
            ("kvs.", "broker.", "overlay.", "content.", "heartbeat."), errno.EPERM), denied
        assert await guest.line() == {"topic": "t.mine", "payload": {"g": 1}}
        rc, out, err = await run_cli("event", "pub", "t.end", uri=inst.uri(1))
        assert (rc, out, err) == (0, "", "")
        assert await guest2.line() == {"topic": "t.public", "payload": None}
        assert await guest2.line() == {"topic": "t.end", "payload": None}
        rc, out, err = await owner
        assert rc == 0, err
        assert events(out) == [("t.secret", {"k": 1}), ("t.public", None),
                               ("t.mine", {"g": 1}), ("t.end", None)]
        await guest.finish()
        await guest2.finish()
    finally:
        guest.kill()
        guest2.kill()


async def test_sub_until_interrupted(start_instance, connect) -> None:
    """``event sub`` without ``-c`` (or ``-c 0``) runs until interrupted:
    Ctrl-C ends it quietly, status 130, as a shell reports it."""
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    for count in ([], ["-c", "0"]):
        before = client_subscriptions(await stats(h, 0))
        proc = await asyncio.create_subprocess_exec(
            KVBROKER, "event", "sub", *count, "x.", env={**os.environ,
                                                        "KVBROKER_URI": inst.uri(0)},
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        try:
            async def subscribed(before: int = before) -> bool:
                return client_subscriptions(await stats(h, 0)) > before

            await wait_until(subscribed, "event sub to subscribe")
            for i in range(3):
                rc, out, err = await run_cli("event", "pub", f"x.{i}", uri=inst.uri(0))
                assert rc == 0, err
            assert proc.stdout is not None
            lines = [await asyncio.wait_for(proc.stdout.readline(), 10) for _ in range(3)]
            assert lines == [f"x.{i}\tnull\n".encode() for i in range(3)]
            proc.send_signal(signal.SIGINT)
            out, err = await asyncio.wait_for(proc.communicate(), 10)
            assert (proc.returncode, out, err) == (130, b"", b""), count
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


REFUSED = [
    (["pub", ""], 1, "kvbroker: event pub: Protocol error (event.pub needs a topic)\n"),
    (["pub", os.fsdecode(b"a\xff")], 1,
     "kvbroker: event pub: Invalid argument ('a\\xff' is not UTF-8 text)\n"),
    (["sub", "-c", "1", os.fsdecode(b"a\xff")], 1,
     "kvbroker: event sub: Invalid argument ('a\\xff' is not UTF-8 text)\n"),
    (["pub", "a.b", "{bad"], 2, "argument PAYLOAD-JSON: not valid JSON: Expecting property name"),
    (["pub", "a.b", "NaN"], 2, "argument PAYLOAD-JSON: not valid JSON: NaN: not a finite "
     "number (JSON has no nan or infinity)"),
    (["pub", "a.b", '{"a": 1} x'], 2, "argument PAYLOAD-JSON: not valid JSON: Extra data"),
    (["pub", "a.b", ""], 2, "argument PAYLOAD-JSON: not valid JSON: Expecting value"),
    (["pub", "a.b", "{}", "extra"], 2, "unrecognized arguments: extra"),
    (["pub", "-r", "a.b", "{}"], 2, "unrecognized arguments: -r"),
    (["pub"], 2, "the following arguments are required: TOPIC"),
    (["sub", "-c", "-1"], 2, "argument --count/-c: must not be negative: -1"),
    (["sub", "-c", "x"], 2, "argument --count/-c: invalid int value: 'x'"),
]


async def test_bad_topics_payloads_and_options_refused(start_instance, connect) -> None:
    """Refused with the status and a message that says what is wrong, and
    nothing reaches a subscriber: a usage error (2) prints the subcommand's
    usage line; a topic the rank or the client refuses is exit 1."""
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    await h.subscribe("")
    for argv, rc, message in REFUSED:
        got = await run_cli("event", *argv, uri=inst.uri(0), timeout=20)
        assert got[0] == rc and got[1] == "", got
        if rc == 2:
            assert got[2].startswith(f"usage: kvbroker event {argv[0]} "), got
            assert f"kvbroker event {argv[0]}: error: {message}" in got[2], got
        else:
            assert got[2] == message
        rc, out, err = await run_cli("event", "pub", "fence", uri=inst.uri(0))
        assert rc == 0, err
        ev = await asyncio.wait_for(h.recv_event(), 10)
        assert ev.topic == "fence", argv  # the refused one never came


async def test_payload_not_utf8_said_so() -> None:
    """JSON is UTF-8 text: a payload with a byte that is not is refused
    before anything is sent, saying so in the docs' words (``... is not
    UTF-8 text``), not as an encoder's complaint about a surrogate the user
    never wrote."""
    rc, out, err = await run_cli("event", "pub", "a.b", os.fsdecode(b'"\xff"'),
                                 env={**os.environ, "KVBROKER_URI": "local:///nonexistent"})
    assert rc in (1, 2) and out == "", err
    assert "not UTF-8" in err and "surrogate" not in err and "udcff" not in err, err


# ---------------------------------------------------------------- t0010: version


def without_uri() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("KVBROKER_URI", None)
    return env


async def test_version_inside_and_outside_an_instance(start_instance) -> None:
    """Cases 3-6: ``--version`` is this command's, with or without an
    instance, and never connects (a bad URI does not matter); the ranks'
    ``version`` attribute is the same on each and equals it; outside an
    instance ``attr get version`` says KVBROKER_URI is not set."""
    expected = (0, f"kvbroker {VERSION}\n", "")
    assert await run_cli("--version", env=without_uri()) == expected
    assert await run_cli("--version", uri="tcp://nowhere:1") == expected
    inst = await start_instance(size=2)
    assert await run_cli("--version", uri=inst.uri(1)) == expected
    for rank in (0, 1):
        assert await run_cli("attr", "get", "version", uri=inst.uri(rank)) == \
            (0, f"{VERSION}\n", "")
    # under kvbroker start, as Flux's "under an instance"
    rc, out, err = await run_cli(
        "start", "-s", "1", "--", "sh", "-c",
        'echo "$KVBROKER_URI"; kvbroker --version; kvbroker attr get version',
        env=without_uri())
    assert rc == 0, err
    uri, line1, line2 = out.splitlines()
    assert uri.startswith("local://") and (line1, line2) == (f"kvbroker {VERSION}", VERSION)
    assert await run_cli("attr", "get", "version", env=without_uri()) == \
        (1, "", f"kvbroker: attr get: {NO_URI_ERR}\n")


async def test_flux_version_command_not_built() -> None:
    """``flux version`` -> ``--version`` (docs): ``kvbroker version`` is an
    unknown command, exit 2."""
    rc, out, err = await run_cli("version", env=without_uri())
    assert (rc, out) == (2, "")
    assert "argument COMMAND: invalid choice: 'version'" in err


async def test_dash_V_prints_version() -> None:
    """Flux's ``flux -V``: the version, as ``--version``."""
    assert await run_cli("-V", env=without_uri()) == (0, f"kvbroker {VERSION}\n", "")


async def test_heaptrace_not_implemented(start_instance) -> None:
    """Cases 7-9: no heaptrace service; a request for one gets ENOSYS, the
    answer Flux's test accepts without tcmalloc."""
    inst = await start_instance(size=1)
    for topic in ("heaptrace.start", "heaptrace.dump", "heaptrace.stop"):
        assert await run_cli("rpc", topic, "{}", uri=inst.uri(0)) == (
            1, "", f"kvbroker: {topic}: Function not implemented "
                   f"(no service matching {topic})\n")


# ------------------------------------- t2802: the URIs KVBROKER_URI takes


async def test_local_and_ssh_uris_reach_the_rank_unchanged(
        start_instance, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """t2802 case 3 and 7-9: the URI is what the user has; the rank's
    ``local-uri`` attribute repeats it and ``broker.pid`` is that rank's
    process; the same socket path as ``ssh://HOST/PATH`` (Flux's
    ``--remote``) and ``ssh://user@host:port/PATH`` reach the same rank."""
    log = tmp_path / "ssh-args"
    monkeypatch.setenv("KVBROKER_SSH", STANDIN)
    monkeypatch.setenv("SSH_STANDIN_LOG", str(log))
    monkeypatch.delenv("KVBROKER_SSH_RCMD", raising=False)
    inst = await start_instance(size=2)
    host = socket.gethostname()
    for rank in (0, 1):
        uri = inst.uri(rank)
        assert uri.startswith("local://") and uri.endswith(f"/local-{rank}")
        rc, out, err = await run_cli("attr", "get", "local-uri", uri=uri)
        assert (rc, out) == (0, f"{uri}\n"), err
        rc, out, err = await run_cli("attr", "get", "broker.pid", uri=uri)
        assert (rc, out) == (0, f"{inst.procs[rank].pid}\n"), err
        path = uri.removeprefix("local://")
        rc, out, err = await run_cli("attr", "get", "rank", uri=f"ssh://{host}{path}")
        assert (rc, out) == (0, f"{rank}\n"), err
    path = inst.uri(1).removeprefix("local://")
    rc, out, err = await run_cli("attr", "get", "rank", uri=f"ssh://bongo@node9:123{path}")
    assert (rc, out) == (0, "1\n"), err
    assert log.read_text().splitlines()[-1].startswith("-p 123 -l bongo node9 ")


async def test_uri_in_environment_of_commands_under_an_instance(start_instance) -> None:
    """t2802 cases 4-6 (``pid:$$``): what a process under an instance has
    is its ``KVBROKER_URI``; ``exec -r 1`` gives rank 1's."""
    inst = await start_instance(size=2)
    rc, out, err = await run_cli("exec", "-r", "0-1", "--", "sh", "-c",
                                 'echo "$KVBROKER_URI"', uri=inst.uri(0))
    assert rc == 0, err
    assert sorted(out.splitlines()) == sorted([inst.uri(0), inst.uri(1)])


@pytest.mark.parametrize("uri, message", [
    ("tcp://host:1", "unsupported broker URI scheme: 'tcp://host:1'"),
    ("foo://", "unsupported broker URI scheme: 'foo://'"),
    ("LOCAL:///tmp/x", "unsupported broker URI scheme: 'LOCAL:///tmp/x'"),
    ("local://", "local:// needs the socket's path: local:///path/to/socket"),
    ("ssh://node1", "bad ssh URI 'ssh://node1': expected ssh://[user@]host[:port]/socket-path"),
    ("ssh://node1/tmp/x?local", "bad ssh URI 'ssh://node1/tmp/x?local': expected"),
    ("bar", "No such file or directory (no broker there"),
    ("bar:foo", "No such file or directory (no broker there"),
    ("pid:123456", "No such file or directory (no broker there"),
])
async def test_bad_uri_said_clearly(uri: str, message: str) -> None:
    """t2802 cases 2, 10-12, and the brief: each command names the URI it
    could not use and why, exit 1 (``event pub``, ``event sub``, ``attr
    get``); ``--version`` does not care."""
    for argv in (["event", "pub", "a.b"], ["event", "sub", "-c", "1"],
                 ["attr", "get", "version"]):
        rc, out, err = await run_cli(*argv, uri=uri, timeout=20)
        what = " ".join(argv[:2])
        assert (rc, out) == (1, ""), (argv, err)
        assert err.startswith(f"kvbroker: {what}: cannot connect to broker at "
                              f"KVBROKER_URI={uri}: {message}"), err


async def test_empty_uri_is_as_unset() -> None:
    for argv in (["event", "pub", "a.b"], ["event", "sub"]):
        rc, out, err = await run_cli(*argv, uri="")
        assert (rc, out, err) == (1, "", f"kvbroker: {' '.join(argv[:2])}: {NO_URI_ERR}\n")


async def test_path_not_a_socket_said_so(tmp_path: Path) -> None:
    """A path that exists but is not a socket is a mistake in the URI, not
    a stopped instance: said so (``is not a socket``), exit 1."""
    plain = tmp_path / "local-0"
    plain.write_text("")
    for path in (plain, tmp_path):
        for uri in (f"local://{path}", str(path)):
            rc, out, err = await run_cli("event", "pub", "a.b", uri=uri)
            assert (rc, out) == (1, ""), err
            assert "not a socket" in err and "has the instance stopped" not in err, err
