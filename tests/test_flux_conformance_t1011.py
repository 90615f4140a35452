"""flux-core t/t1011-kvs-checkpoint-period.t: the periodic checkpoint.

Flux sets ``[kvs] checkpoint-period`` in a config file, loads its kvs module
(4 brokers) and changes the period with ``flux config reload``; it reads
the checkpoint back with ``content.checkpoint-get`` (key ``kvs-primary``).
Here ``kvs.checkpoint-period`` is a broker attribute, set at start with
``-S`` and changed on a running rank with ``kvbroker attr set`` (docs/cli.md),
which is what Flux's reloads become.  Flux's cases, in order:

* "bad checkpoint-period timer" (``1Z``) fails the module load: ``kvbroker
  start -S kvs.checkpoint-period=1Z`` exits 2 naming the attribute and the
  value, and starts no rank (the statedir is not even made).
* "place initial value" (``put --blobref --sync a=1``) and "checkpoint of
  kvs-primary should change in time" (1), (2): with a 200 ms period the
  checkpoint is the ``--sync`` put's root at once, then each plain put's
  root within 5 s (Flux's bound), from rank 0 and from rank 3.
* "put some data to non-primary namespace" / "should not change (1)": a
  commit to another namespace writes no checkpoint -- the checkpoint and
  the count of checkpoints written (``kvbroker stats kvs``) stay as they
  were over 1 s (five periods; Flux watches 2 s: a thing that must not
  happen has no event to wait for).
* "bad checkpoint-period timer on reload" fails, and changes nothing:
  ``attr set kvs.checkpoint-period 1Z`` is refused (EINVAL) with the
  reason, and the period in effect stays 0.2 s.
* "set large period" (60m) / "should not change (2)": a put leaves the
  checkpoint where it was.
* "set small period" / "should change in time (3)": back at 200 ms, the
  root the 60m period left unwritten is checkpointed within 5 s, and so
  is a new put's.
* "disable it" (``0s``) / "should not change (3)", then "re-enable it" /
  "should change in time (4)": the same with ``0s`` (no periodic
  checkpoint; the period shows as 0 in the stats) and ``200ms`` again.
* A restart on the statedir has every put (the stop checkpoints).
* "no pending requests at end": ``rpcs-pending`` of the kvs stats is 0.
* "remove modules": does not apply (modules are loaded at start and go
  with their rank); the instance stops cleanly instead.
"""

from __future__ import annotations

import asyncio

from test_broker_support import run_cli, wait_until
from test_flux_conformance_t1010 import checkpoint
from test_kvs_cli import kvs

T = 30
IN_TIME = 5.0  # Flux's checkpoint_changed bound
WINDOW = 1.0  # five 200 ms periods


async def rootref(h) -> str | None:
    cp = await checkpoint(h)
    return None if cp is None else cp["rootref"]


async def kvs_stats(h) -> dict:
    return await asyncio.wait_for(h.rpc("kvs.stats-get", {}, nodeid=0), T)


async def put(inst, kv: str, *flags: str, rank: int = 0) -> str:
    """``kvs put --blobref [FLAGS] KV``; the new root's blobref."""
    res = await kvs(inst, "put", "--blobref", *flags, kv, rank=rank)
    assert res.rc == 0, res.err
    ref = res.text.strip()
    assert ref.startswith("sha256-"), res.text
    return ref


async def changes_to(h, ref: str) -> None:
    """Flux's ``checkpoint_changed``: the checkpoint names ``ref`` in time."""
    async def named() -> bool:
        return await rootref(h) == ref

    await wait_until(named, f"the checkpoint to name {ref}", IN_TIME)


async def stays(h, ref: str | None) -> None:
    """Flux's ``test_must_fail checkpoint_changed``: over ``WINDOW`` seconds
    the checkpoint keeps naming ``ref``, and no checkpoint is written."""
    written = (await kvs_stats(h))["checkpoint"]["written"]
    loop = asyncio.get_running_loop()
    end = loop.time() + WINDOW
    while loop.time() < end:
        assert await rootref(h) == ref
        await asyncio.sleep(0.05)  # (polling interval)
    assert await rootref(h) == ref
    assert (await kvs_stats(h))["checkpoint"]["written"] == written


async def test_t1011_a_bad_period_is_refused_at_start(tmp_path) -> None:
    statedir = tmp_path / "state"
    rc, out, err = await run_cli("start", "--size", "4", "--statedir", str(statedir),
                                 "-S", "kvs.checkpoint-period=1Z", "--", "true")
    assert (rc, out) == (2, ""), err
    assert "kvs.checkpoint-period: '1Z' is not a duration" in err, err
    assert not statedir.exists()  # no rank started


async def test_t1011_the_period_checkpoints_primary_in_time(start_instance, connect,
                                                            tmp_path) -> None:
    statedir = str(tmp_path / "state")

    async def start(period: str):
        inst = await start_instance(size=4, statedir=statedir,
                                    attrs={"kvs.checkpoint-period": period})
        return inst, await connect(inst, 0)

    inst, h = await start("200ms")
    assert (await kvs_stats(h))["checkpoint"]["period"] == 0.2
    blob1 = await put(inst, "a=1", "--sync")  # "place initial value"
    assert await rootref(h) == blob1  # (a sync commit checkpoints before its answer)
    blob2 = await put(inst, "b=1")
    await changes_to(h, blob2)  # (1)
    blob3 = await put(inst, "c=1", rank=3)
    await changes_to(h, blob3)  # (2)

    # a commit to another namespace: no checkpoint
    assert (await kvs(inst, "namespace", "create", "test-ns")).rc == 0
    res = await kvs(inst, "put", "--namespace=test-ns", "d=1")
    assert res.rc == 0, res.err
    await stays(h, blob3)  # "should not change (1)"

    async def reload(value: str) -> None:  # (Flux's flux config reload)
        rc, out, err = await run_cli("attr", "set", "kvs.checkpoint-period", value,
                                     uri=inst.uri(0), timeout=T)
        assert (rc, out, err) == (0, "", ""), err

    # "bad checkpoint-period timer on reload": refused, nothing changed
    rc, out, err = await run_cli("attr", "set", "kvs.checkpoint-period", "1Z",
                                 uri=inst.uri(0), timeout=T)
    assert (rc, out) == (1, "") and "'1Z' is not a duration" in err, err
    assert await h.attr_get("kvs.checkpoint-period") == "200ms"
    assert (await kvs_stats(h))["checkpoint"]["period"] == 0.2

    await reload("60m")  # "set large period"
    assert (await kvs_stats(h))["checkpoint"]["period"] == 3600.0
    blob4 = await put(inst, "d=1")
    await stays(h, blob3)  # (2)

    await reload("200ms")  # "set small period"
    await changes_to(h, blob4)  # (what the long period left unwritten)
    blob4b = await put(inst, "d2=1", rank=3)
    await changes_to(h, blob4b)  # (3)

    await reload("0s")  # "disable it"
    assert (await kvs_stats(h))["checkpoint"]["period"] == 0.0
    blob5 = await put(inst, "e=1")
    await stays(h, blob4b)  # (3)

    await reload("200ms")  # "re-enable it"
    await changes_to(h, blob5)
    blob6 = await put(inst, "f=1")
    await changes_to(h, blob6)  # (4)

    # "no pending requests at end of tests before module removal"
    assert (await kvs_stats(h))["rpcs-pending"] == 0
    await inst.stop()
    inst, h = await start("0s")  # a restart has every put
    assert (await kvs(inst, "get", "a", "b", "c", "d", "d2", "e", "f", rank=3)).text \
        == "1\n" * 7
