# ruff: noqa: E501  (expected transcripts keep the commands' long lines whole)
"""flux-core t/t0017-security.t: who may connect, and what a guest may do.

Flux fakes a guest from the owner's own connection (``FLUX_HANDLE_ROLEMASK``,
``FLUX_HANDLE_USERID``, the connector's debug bits).  kvbroker stamps the
credentials from ``SO_PEERCRED`` and overwrites what a client claims, so here
the guests are real processes under uids 65534 (``G``) and 65533 (``W``, the
"other" guest, Flux's userid 42), dropping to their uid before they connect
(the ``GUEST`` wrapper of test_flux_conformance_t1005).  Flux's 53 cases, in
order, and what each becomes:

1.  connector-local starts with a private access policy ->
    ``access.allow-guest-user`` is ``false`` by default and a guest's
    ``kvbroker ping`` is refused (``Permission denied``).  Flux's
    ``allow-root-owner``: root is not the owner of an instance another user
    started (it is a guest, refused by default); not tested here, since the
    instance would have to run as another uid, which this machine's
    interpreter (under /root) does not allow.
2.-5. allow-root-owner / allow-guest-user added and dropped on a config
    reload -> there is no ``config reload``: the policy is fixed at start.
    ``attr set access.allow-guest-user true`` is refused (``EINVAL``) and
    changes nothing.
6.  reload fails on an unknown ``[access]`` key -> ``start -S access.foo=42``
    exits 2 naming it, and so does a bootstrap file's
    ``[attrs] "access.foo"``.  A bootstrap file's top-level ``[access]``
    table with ``foo = 42`` (Flux's spelling), or any other unknown table
    (``[attr]`` for ``[attrs]``: its guest limit dropped), exits 2 naming
    it and saying that attributes go in ``[attrs]`` (it was silently
    ignored until 2026-12-05, found by this test).
7.  reload with bad TOML fails -> ``kvbroker broker -c`` a file that is not
    TOML exits 2 with the parser's message.
8.  private policy restored -> not applicable (nothing to restore).
9.-14. ``[access.roles.admin]`` users, groups, an unknown user, an unknown
    role, an unknown key, non-array users -> kvbroker has no roles beyond
    OWNER and USER: not applicable (such a table is refused as in 6).
15. owner rolemask unaffected by roles -> ``ping -u`` as the owner shows
    ``rolemask=0x1`` (Flux: ``0x5``, OWNER|LOCAL; kvbroker has no LOCAL bit).
16. policy restored after the roles tests -> not applicable.
17. simulated connector auth failure is EPERM -> a real one: a guest on an
    instance that does not allow guests cannot connect (``Permission
    denied``: the run directory is 0700); once past it (permissions
    opened), the rank refuses it and the client reads ``EPERM``, as Flux's,
    with how to admit guests (it read ``Connection reset by peer`` until
    2026-12-05, found by this test).
18. ``ping --userid`` shows the userid -> ``ping -u`` prints the owner's
    ``userid=0 rolemask=0x1``.
19.-20. ``FLUX_HANDLE_USERID`` / ``FLUX_HANDLE_ROLEMASK`` spoof the message ->
    the opposite by design: a request whose header claims ``userid=9999``
    and ``rolemask=0xf`` (the owner's) or OWNER (a guest's) is stamped with
    the connection's real credentials; the guest's forged OWNER bit does
    not let it set an attribute.
21. ping allowed for a non-owner -> a guest's ``ping -u`` shows its own uid
    and ``rolemask=0x2``.
22. getattr allowed for a non-owner -> a guest's ``attr get rank``.
23. setattr allowed for the owner -> ``attr set log.level debug`` (Flux sets
    a made-up ``test.foo``; here every attribute but five is fixed at start).
24. setattr not allowed for a non-owner -> ``Operation not permitted``, the
    value unchanged.
25. logger not allowed for a non-owner -> the line is not logged.  A
    difference: Flux's ``flux logger`` succeeds and the line is dropped;
    ``kvbroker logger`` fails with ``Operation not permitted``.
26. dmesg not allowed for a non-owner -> ``Operation not permitted`` (Flux's
    text: ``Request requires owner credentials``); ``dmesg -C`` too.
27.-36. event delivery by the "connector" and by the "dispatcher" ->
    kvbroker's Handle has no dispatcher policy (``recv_event`` gives every
    event the rank sends), so the connector's rule is the one tested, and
    the dispatcher's where it delivers (28, 32): public events of the owner,
    of the guest itself and of another guest reach the owner and both
    guests.  Flux's dispatcher suppressing a guest's event to an owner or
    guest handle (30, 34, 36) has no counterpart: a difference.  Added, the
    rule for private events Flux's comment states: one reaches the owner
    and its user only (a guest cannot name another user for its private
    event, the owner can).
37.-39. guests may add userid-prefixed services, not others -> there is no
    ``service.add`` (services are modules loaded at start): not applicable.
40.-41. content and kvs modules loaded -> they are, from the start.
42.-44. the private ``kvs.namespace-primary-setroot`` reaches the owner's
    connection (42, 43), not a guest's (44) -- in the event test; a guest
    may not publish under ``kvs.`` either.
45. unloaded kvs module -> not applicable (modules are fixed at start).
46. content flush not allowed for a guest -> ``Operation not permitted``.
47. store a value -> the owner's ``content store`` prints its blobref.
48.-49. content load / store not allowed for a guest -> ``Operation not
    permitted`` (Flux's text: ``Request requires owner credentials``), on
    rank 0 and rank 1; nor the store's stats.
50. unloaded content module -> not applicable.
51. module list is open to guests -> yes, without the request counts.
52.-53. ``module stats --rusage`` open to guests (broker, a module) -> a
    documented difference: ``MODULE.rusage`` is for the owner only
    (protocol.md), a guest's ``stats -R`` is ``Operation not permitted``.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from test_broker_support import GUEST_UID, KVBROKER, OTHER_GUEST_UID, GuestProc, RawClient
from test_flux_conformance_t1005 import GUEST
from test_kvs_cli import client_env, expect, run, sh

from broker.message import Message, MsgFlags, MsgType, Role

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a guest")
T = 30
ALLOW = {"access.allow-guest-user": "true"}
GUESTS = f"""
        G() {{ shift; GUEST_UID={GUEST_UID} {GUEST} "$@"; }}
        W() {{ shift; GUEST_UID={OTHER_GUEST_UID} {GUEST} "$@"; }}
"""


async def test_t0017_private_policy_fixed_at_start(start_instance) -> None:
    """Cases 1-5, 8, 17: guests refused by default; the policy cannot change
    on a running instance.  Past the 0700 run directory (opened here), the
    rank itself refuses the guest: the client reads ``EPERM``, as Flux's
    (it read ``ECONNRESET``), and how to admit guests."""
    inst = await start_instance(size=1)
    out = await sh(inst, GUESTS + """
        t kvbroker attr get access.allow-guest-user
        t G kvbroker ping
        t kvbroker attr set access.allow-guest-user true
        t kvbroker attr get access.allow-guest-user
        chmod 755 "$(kvbroker attr get rundir)"
        chmod 777 "$(kvbroker attr get local-uri | sed 's,^local://,,')"
        t G kvbroker ping
        """)
    assert out == expect(f"""
        $ kvbroker attr get access.allow-guest-user
        false
        $ G kvbroker ping
        kvbroker: ping: cannot connect to broker at KVBROKER_URI={inst.uri(0)}: Permission denied (...)
        [rc=1]
        $ kvbroker attr set access.allow-guest-user true
        kvbroker: attr set: Invalid argument (...)
        [rc=1]
        $ kvbroker attr get access.allow-guest-user
        false
        $ G kvbroker ping
        kvbroker: ping: Operation not permitted (...)
        [rc=1]
        """)


async def _broker(tmp_path, text: str, *cmd: str) -> tuple[int, str, str]:
    """``kvbroker broker -c FILE -- CMD`` (one rank), FILE holding ``text``."""
    conf = tmp_path / "conf.toml"
    conf.write_text(text)
    res = await run([KVBROKER, "broker", "-c", str(conf), "--", *cmd],
                    client_env("local:///nonexistent"), cwd=str(tmp_path), timeout=T)
    return res.rc, res.text, res.err


async def test_t0017_unknown_access_key_and_bad_toml_refused(tmp_path) -> None:
    """Cases 6-7 where kvbroker has the setting: an unknown ``access.``
    attribute (``start -S``, a bootstrap file's ``[attrs]``) and a file that
    is not TOML exit 2 before anything starts."""
    res = await run([KVBROKER, "start", "-S", "access.foo=42", "--", "true"],
                    client_env("local:///nonexistent"), timeout=T)
    assert (res.rc, res.text, res.err) == (2, "", "kvbroker: start: access.foo: unknown attribute\n")
    rc, out, err = await _broker(tmp_path, '[bootstrap]\n[attrs]\n"access.foo" = 42\n', "true")
    assert (rc, out, err) == (2, "", f"kvbroker: broker: {tmp_path / 'conf.toml'}: [attrs] "
                                     "access.foo: unknown attribute\n")
    rc, out, err = await _broker(tmp_path, "[bootstrap]\n[access]\nfoo\n", "true")
    assert (rc, out) == (2, "")
    assert err.startswith("kvbroker: broker: ") and "conf.toml: Expected '=' after a key" in err, err


@pytest.mark.parametrize(("table", "attr"), [
    # case 6 in a file, as Flux writes it
    ("[access]\nfoo = 42", "access.allow-guest-user"),
    # [attrs] mistyped: the guest limit it sets is dropped without a word
    # (the rank prints 256, the default, not 4)
    ('[attr]\n"access.max-guest-connections" = 4', "access.max-guest-connections"),
])
async def test_t0017_unknown_access_table_in_bootstrap_file_refused(tmp_path, table, attr) -> None:
    """A bootstrap file's unknown top-level table exits 2, naming it (it was
    ignored: the rank started, its settings not in effect)."""
    rc, out, err = await _broker(tmp_path, f"[bootstrap]\n{table}\n",
                                 KVBROKER, "attr", "get", attr)
    assert rc == 2 and out == "" and table[1:5] in err, (rc, out, err)
    assert "broker attributes go in [attrs]" in err, err


async def test_t0017_identity_cannot_be_spoofed(start_instance) -> None:
    """Cases 15, 18-21: ``ping -u`` shows the credentials the rank stamped,
    whatever the request's header claimed."""
    inst = await start_instance(size=2, attrs=ALLOW)
    out = await sh(inst, GUESTS + """
        ID='userid=[0-9]* rolemask=0x[0-9a-f]*'
        kvbroker ping -u 0 | grep -o "$ID"
        on 1 G kvbroker ping -u 0 | grep -o "$ID"
        """)
    assert out == expect(f"""
        userid={os.getuid()} rolemask=0x1
        userid={GUEST_UID} rolemask=0x2
        """)

    # the owner claims userid 9999 and every role bit (FLUX_HANDLE_USERID,
    # FLUX_HANDLE_ROLEMASK): the rank stamps its own
    raw = await RawClient.connect(inst, 1)
    try:
        raw.send(Message(MsgType.REQUEST, "broker.ping", {}, matchtag=1, nodeid=0,
                         userid=9999, rolemask=0xF))
        msg = await raw.recv(T)
        assert msg.matchtag == 1 and msg.errnum == 0, msg
        assert (msg.payload["userid"], msg.payload["rolemask"]) == (os.getuid(), Role.OWNER)
    finally:
        await raw.close()

    # a guest claims to be the owner, with the OWNER role: still a guest,
    # refused what only the owner may do
    guest = await GuestProc.start(inst.uri(1), """
        from broker.message import Message, MsgType
        def forged(topic, payload, tag):
            m = Message(MsgType.REQUEST, topic, payload, matchtag=tag, nodeid=NODEID_ANY,
                        userid=0, rolemask=0xF)
            frames = codec.encode(m)
            return b"".join([codec.stream_prefix(frames), *frames])

        async def main():
            s, dec = raw(), codec.StreamDecoder()
            s.sendall(forged("broker.ping", {}, 1))
            r = codec.decode(read_one(s, dec))
            out(tag=r.matchtag, userid=r.payload["userid"], rolemask=r.payload["rolemask"])
            s.sendall(forged("attr.set", {"name": "log.level", "value": "debug"}, 2))
            r = codec.decode(read_one(s, dec))
            out(tag=r.matchtag, errnum=r.errnum)
            s.close()
        """)
    try:
        assert await guest.lines(T) == [
            {"tag": 1, "userid": GUEST_UID, "rolemask": int(Role.USER)},
            {"tag": 2, "errnum": 1},  # EPERM
        ]
    finally:
        guest.kill()
    res = await run([KVBROKER, "attr", "get", "log.level", "-r", "1"], client_env(inst.uri(0)))
    assert (res.rc, res.text) == (0, "warning\n"), res.err


async def test_t0017_attributes_and_log_are_the_owners(start_instance) -> None:
    """Cases 22-26: a guest reads attributes but may not set them, write to
    the log or read it."""
    inst = await start_instance(size=1, attrs=ALLOW)
    out = await sh(inst, GUESTS + """
        MSG=hello-unauthorized-world-t0017
        t G kvbroker attr get rank
        t kvbroker attr set log.level debug
        t kvbroker attr get log.level
        t G kvbroker attr set log.level error
        t kvbroker attr get log.level
        t G kvbroker logger $MSG
        kvbroker dmesg | grep -c "$MSG"
        kvbroker logger $MSG
        kvbroker dmesg | grep -c "$MSG"
        t G kvbroker dmesg
        t G kvbroker dmesg -C
        kvbroker dmesg | grep -c "$MSG"
        """)
    assert out == expect("""
        $ G kvbroker attr get rank
        0
        $ kvbroker attr set log.level debug
        $ kvbroker attr get log.level
        debug
        $ G kvbroker attr set log.level error
        kvbroker: attr set: Operation not permitted (...)
        [rc=1]
        $ kvbroker attr get log.level
        debug
        $ G kvbroker logger hello-unauthorized-world-t0017
        kvbroker: logger: Operation not permitted (...)
        [rc=1]
        0
        1
        $ G kvbroker dmesg
        kvbroker: dmesg: Operation not permitted (...)
        [rc=1]
        $ G kvbroker dmesg -C
        kvbroker: dmesg: Operation not permitted (...)
        [rc=1]
        1
        """)


# The subscriber each guest runs: subscribes to test. and kvs., says so,
# then prints each event until test.end.
SUBSCRIBER = """
    async def main():
        h = await Handle.connect(uri)
        await h.subscribe("test.")
        await h.subscribe("kvs.")
        out(subscribed=True)
        while True:
            ev = await asyncio.wait_for(h.recv_event(), 30)
            out(topic=ev.topic, userid=ev.userid)
            if ev.topic == "test.end":
                break
        await h.close()
    """


async def test_t0017_event_delivery(start_instance, connect) -> None:
    """Cases 27-36 and 42-44: who receives whose events, public and private,
    on rank 1 (published on rank 0 and rank 1)."""
    inst = await start_instance(size=2, attrs=ALLOW)
    owner = await connect(inst, 1)
    await owner.subscribe("test.")
    await owner.subscribe("kvs.")
    g = await GuestProc.start(inst.uri(1), SUBSCRIBER, uid=GUEST_UID)
    w = await GuestProc.start(inst.uri(1), SUBSCRIBER, uid=OTHER_GUEST_UID)
    try:
        assert await g.line(T) == {"subscribed": True}
        assert await w.line(T) == {"subscribed": True}
        out = await sh(inst, GUESTS + f"""
            t kvbroker event pub test.owner
            t on 1 G kvbroker event pub test.g
            t W kvbroker event pub test.w
            t kvbroker event pub -p test.owner-private
            t on 1 G kvbroker event pub -p test.g-private
            q() {{ "$@" >/dev/null; }}
            t q on 1 W kvbroker rpc event.pub '{{"topic": "test.w-private-claims-g", "flags": 8, "userid": {GUEST_UID}}}'
            t q kvbroker rpc event.pub '{{"topic": "test.owner-private-to-g", "flags": 8, "userid": {GUEST_UID}}}'
            t G kvbroker event pub kvs.namespace-primary-setroot
            t kvbroker kvs put ev9=42
            t kvbroker event pub test.end
            """)
        assert out == expect("""
            $ kvbroker event pub test.owner
            $ on 1 G kvbroker event pub test.g
            $ W kvbroker event pub test.w
            $ kvbroker event pub -p test.owner-private
            $ on 1 G kvbroker event pub -p test.g-private
            $ q on 1 W kvbroker rpc event.pub {"topic": "test.w-private-claims-g", "flags": 8, "userid": 65534}
            $ q kvbroker rpc event.pub {"topic": "test.owner-private-to-g", "flags": 8, "userid": 65534}
            $ G kvbroker event pub kvs.namespace-primary-setroot
            kvbroker: event pub: Operation not permitted (...)
            [rc=1]
            $ kvbroker kvs put ev9=42
            $ kvbroker event pub test.end
            """)
        me = os.getuid()
        seen = []
        async with asyncio.timeout(T):
            while not seen or seen[-1][0] != "test.end":
                ev = await owner.recv_event()
                seen.append((ev.topic, ev.userid, bool(ev.flags & MsgFlags.PRIVATE)))
        assert seen == [
            ("test.owner", me, False),
            ("test.g", GUEST_UID, False),
            ("test.w", OTHER_GUEST_UID, False),
            ("test.owner-private", me, True),
            ("test.g-private", GUEST_UID, True),
            ("test.w-private-claims-g", OTHER_GUEST_UID, True),
            ("test.owner-private-to-g", GUEST_UID, True),
            ("kvs.namespace-primary-setroot", me, True),
            ("test.end", me, False),
        ]
        public = [{"topic": "test.owner", "userid": me},
                  {"topic": "test.g", "userid": GUEST_UID},
                  {"topic": "test.w", "userid": OTHER_GUEST_UID}]
        end = [{"topic": "test.end", "userid": me}]
        assert await g.lines(T) == public + [
            {"topic": "test.g-private", "userid": GUEST_UID},
            {"topic": "test.owner-private-to-g", "userid": GUEST_UID}] + end
        assert await w.lines(T) == public + [
            {"topic": "test.w-private-claims-g", "userid": OTHER_GUEST_UID}] + end
    finally:
        g.kill()
        w.kill()


async def test_t0017_content_store_is_the_owners(start_instance) -> None:
    """Cases 46-49: a guest may not flush, load or store content, on rank 0
    or rank 1, nor read the store's counts."""
    inst = await start_instance(size=2, attrs=ALLOW)
    out = await sh(inst, GUESTS + """
        t G kvbroker content flush
        echo Hello >content.blob
        kvbroker content store <content.blob >content.blobref
        t kvbroker content load $(cat content.blobref)
        t G kvbroker content load $(cat content.blobref)
        t G kvbroker content store <content.blob
        t on 1 G kvbroker content load $(cat content.blobref)
        t on 1 G kvbroker content store <content.blob
        t on 1 G kvbroker content flush
        t G kvbroker stats content
        """)
    assert out == expect("""
        $ G kvbroker content flush
        kvbroker: content flush: Operation not permitted (...)
        [rc=1]
        $ kvbroker content load REF
        Hello
        $ G kvbroker content load REF
        kvbroker: content load: Operation not permitted (...)
        [rc=1]
        $ G kvbroker content store
        kvbroker: content store: Operation not permitted (...)
        [rc=1]
        $ on 1 G kvbroker content load REF
        kvbroker: content load: Operation not permitted (...)
        [rc=1]
        $ on 1 G kvbroker content store
        kvbroker: content store: Operation not permitted (...)
        [rc=1]
        $ on 1 G kvbroker content flush
        kvbroker: content flush: Operation not permitted (...)
        [rc=1]
        $ G kvbroker stats content
        kvbroker: stats content: Operation not permitted (...)
        [rc=1]
        """)


async def test_t0017_module_list_open_rusage_not(start_instance) -> None:
    """Cases 51-53: a guest lists the modules (without their request
    counts); ``stats -R`` (Flux's ``module stats --rusage``, open to guests
    there) is the owner's here, as protocol.md says."""
    inst = await start_instance(size=1, attrs=ALLOW)
    out = await sh(inst, GUESTS + """
        t G kvbroker module list
        t G kvbroker stats -R broker
        t G kvbroker stats -R kvs
        t sh -c 'kvbroker stats -R kvs | grep -c utime'
        """)
    assert out == expect("""
        $ G kvbroker module list
        Module            Requests  Services
        broker                   -  broker, attr, event, module, log, overlay, config, rexec
        content                  -  content
        kvs                      -  kvs
        kvs-watch                -  kvs-watch
        $ G kvbroker stats -R broker
        kvbroker: stats broker: Operation not permitted (...)
        [rc=1]
        $ G kvbroker stats -R kvs
        kvbroker: stats kvs: Operation not permitted (...)
        [rc=1]
        $ sh -c kvbroker stats -R kvs | grep -c utime
        1
        """)

