"""What a guest's small input may cost a rank (from a security audit; a
guest against real ranks): a payload's decoding, the service names a
connection addresses, the log lines its refused requests make.

The guests are real processes of another uid (GuestProc, as in
test_broker_guest_limits).  Memory is read from /proc: the rank's peak
(VmHWM, reset first through clear_refs) or its resident size (VmRSS).
Each test failed before its fix: 147 MiB grown for a 2 MiB request; 52 MiB
on ranks 0 and 1 for 200 made-up services; 300 log records for 300
oversized requests.
"""

from __future__ import annotations

import asyncio
import errno
import os

import pytest
from test_broker_support import GuestProc

from broker.errors import RemoteError
from broker.handle import Handle

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to run as another uid")

ALLOW = {"access.allow-guest-user": "true"}
MiB = 1 << 20


def _status_mib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


async def _rank_pid(h: Handle, rank: int) -> int:
    return int(await asyncio.wait_for(h.attr_get("broker.pid", nodeid=rank), 10))


# A request whose payload is N empty msgpack arrays (one byte each) inside a
# map the handler reads: each byte decodes to a Python list of ~64 bytes.
_BOMB = """
import msgpack
async def main():
    n = BOMB_ITEMS
    if NESTED:  # (n // 1024 arrays of 1,024 empty arrays: each array is small)
        inner = b"\\xdc" + (1024).to_bytes(2, "big") + b"\\x90" * 1024
        junk = b"\\xdd" + (n // 1024).to_bytes(4, "big") + inner * (n // 1024)
    else:
        junk = b"\\xdd" + n.to_bytes(4, "big") + b"\\x90" * n
    payload = (b"\\x82" + msgpack.packb("name") + msgpack.packb("rundir")
               + msgpack.packb("junk") + junk)
    header = codec.encode_request("attr.get", None, 7, NODEID_ANY, 0)[0]
    s = raw()
    s.sendall(codec.stream_prefix([header, payload]) + header + payload)
    s.settimeout(60)
    frames = read_one(s, codec.StreamDecoder())
    out(answered=list(codec.peek_response(frames)))
"""


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
async def test_a_guests_small_message_does_not_decode_to_a_huge_one(start_instance, connect,
                                                                     nested: bool) -> None:
    """A guest whose budget is 8 MiB sends one 2 MiB request of empty
    msgpack arrays (a byte each, ~64 bytes each as Python lists): the rank
    answers ``EPROTO`` (one item per 4 bytes at most, codec.decode_payload),
    refused at the array's header (flat) or as the items are built (nested),
    and its memory does not grow by many times the budget."""
    items = 2 * MiB
    inst = await start_instance(size=1, attrs={**ALLOW, "access.max-guest-bytes": str(8 * MiB)})
    h = await connect(inst, 0)
    pid = await _rank_pid(h, 0)
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from now
    before = _status_mib(pid, "VmHWM")
    body = _BOMB.replace("BOMB_ITEMS", str(items)).replace("NESTED", str(nested))
    guest = await GuestProc.start(inst.uri(0), body)
    try:
        answered = (await guest.line(60))["answered"]
        assert answered[:2] == [7, errno.EPROTO], answered
        assert answered[2].startswith("payload decodes to too many items for its size"), \
            answered
        await guest.finish()
    finally:
        guest.kill()
    assert (await h.ping(0))["rank"] == 0
    grown = _status_mib(pid, "VmHWM") - before
    assert grown < 32, f"a guest's {items // MiB} MiB request grew the rank's peak by {grown} MiB"


# Distinct made-up services with long names, each answered ENOSYS; the
# connection stays open (the names are kept while it lives).
_SERVICES = """
async def main():
    h = await Handle.connect(uri)
    errnos = set()
    for i in range(COUNT):
        try:
            await h.rpc(f"{i:06d}" + "x" * LENGTH + ".op", {})
        except RemoteError as exc:
            errnos.add(exc.errnum)
    out(errnos=sorted(errnos))
    await step()
    await h.close()
"""


async def test_a_guests_made_up_service_names_are_not_kept_whole(start_instance,
                                                                 connect) -> None:
    """A guest on rank 1 addresses 200 services with 256 KiB names: each is
    refused (``EPROTO``: request topics are at most 1,024 characters, as
    events'), and neither rank 1 nor rank 0 holds 50 MiB of names for it
    afterwards; a made-up service of a 1,024-character topic is ``ENOSYS``
    as ever."""
    count, length = 200, 256 << 10
    inst = await start_instance(size=2, fanout=2, attrs=ALLOW)
    h = await connect(inst, 0)
    pids = [await _rank_pid(h, r) for r in (0, 1)]
    before = [_status_mib(p, "VmRSS") for p in pids]
    body = _SERVICES.replace("COUNT", str(count)).replace("LENGTH", str(length))
    guest = await GuestProc.start(inst.uri(1), body)
    try:
        assert (await guest.line(60))["errnos"] == [errno.EPROTO]
        grown = [_status_mib(p, "VmRSS") - b for p, b in zip(pids, before, strict=True)]
        guest.go()
        await guest.finish()
    finally:
        guest.kill()
    assert max(grown) < 25, f"ranks 0 and 1 grew by {grown} MiB while the guest stayed"
    with pytest.raises(RemoteError) as exc:
        await h.rpc("x" * 1021 + ".op", {}, nodeid=1)
    assert exc.value.errnum == errno.ENOSYS
    with pytest.raises(RemoteError) as exc:
        await h.rpc("x" * 1022 + ".op", {}, nodeid=1)
    assert (exc.value.errnum, exc.value.errstr) == (
        errno.EPROTO, "request topics are at most 1024 characters, not 1025")


_OVERSIZED = """
async def main():
    h = await Handle.connect(uri)
    futs = [h.rpc("broker.ping", {"pad": "x" * 70000}, nodeid=1) for _ in range(COUNT)]
    got = await asyncio.gather(*futs, return_exceptions=True)
    out(errnos=sorted({getattr(r, "errnum", 0) for r in got}))
    await h.close()
"""


async def test_a_guests_oversized_requests_do_not_flood_the_log(start_instance,
                                                                connect) -> None:
    """A guest sends 300 requests bigger than tbon.max-message to rank 1:
    each is answered EMSGSIZE (as documented), and the rank's log says so a
    few times, not 300 (the owner's earlier records stay in the ring)."""
    inst = await start_instance(size=2, fanout=2,
                                attrs={**ALLOW, "tbon.max-message": "65536"})
    h = await connect(inst, 0)
    guest = await GuestProc.start(inst.uri(0), _OVERSIZED.replace("COUNT", "300"))
    try:
        assert (await guest.line(60))["errnos"] == [errno.EMSGSIZE]
        await guest.finish()
    finally:
        guest.kill()
    lines = [e async for e in h.dmesg(nodeid=0) if "not sending" in str(e["message"])]
    assert len(lines) <= 10, f"{len(lines)} log records for one guest's 300 oversized requests"
