"""flux-core t/t0037-content-files-checkpoint.t: the content backend's
checkpoints in Flux's request forms, for the ``content-files`` backend.

kvbroker has one backend, rank 0's SQLite store in the statedir
(docs/protocol.md, content service; docs/cli.md, "content checkpoint"):
no ``content-files``, no module reload.  So, here: an instance of the
content module alone (``-S broker.modules=content``, as Flux loads
``content`` + a backend without ``kvs``: with the kvs module, which owns
the KVS checkpoint, Flux's form of the put is ``EBUSY``), on a statedir,
with ``-S content.max-checkpoints=1`` -- content-files keeps one
checkpoint, so Flux's counts (one row after every put) hold as written;
the five kept by default are tests/test_flux_conformance_t0035.py's.
"Reload content-files" is a stop and a start on the same statedir.
Flux's ``checkpoint_put`` sends ``{value: {version: 1, rootref,
timestamp: 2.2}}`` (no ``sequence``), ``checkpoint_get`` no payload; here
they go through ``kvbroker rpc``, as Flux's test goes through its
``rpc`` tool.  Its rootrefs (``bar``, ``baz``, ...) are words, which
kvbroker refuses (``EINVAL``: the KVS's checkpoint must name a root,
tests/test_flux_conformance_t0035.py): here each is the sha1 blobref of
that word (any well-formed blobref is taken, as Flux's), and the "longer
rootref" a sha256 one.

Flux's cases, in order -> here (first test unless said):

* load content, content-files -> start the instance (content module only).
* checkpoint-get returns ENOENT if there is no checkpoint -> the same,
  ``No such file or directory`` on stderr.
* checkpoint-put w/ rootref bar; checkpoint-get returned rootref bar ->
  the same; and the value answered is the one sent, whole (Flux's
  ``version``, ``timestamp``, no ``sequence`` added).
* checkpoint list (1 default / 1 no-header / 1 json) -> the same counts
  (header + 1 row; 1 row; 1 JSON line), and the row is Flux's: index 0,
  sequence 0 (none in the value), time ``1970-01-01T00:00:02Z`` (from
  2.2), the rootref; the JSON line is the value sent.
  (Default history of 5 in the same formats: t0035.)
* checkpoint-get returned correct timestamp -> 2.2 exactly.
* checkpoint-put baz; get baz; list (2) -> the same, one row, baz.
* reload content-files; get still baz -> a restart on the statedir.
* put a longer rootref / a shorter one; get; list (3), (4) -> sha1 ->
  sha256 -> sha1: each read back whole (content-files rewrites a file in
  place; SQLite a row: the same question, the old value's tail never
  shows).
* checkpoint-backing-get / checkpoint-backing-put, get/list (5), (6) ->
  not applicable: there is no ``content-backing`` service, the backend is
  the content module's own store (docs/protocol.md); asked for, it is
  ``Function not implemented``, and ``content.checkpoint-*`` is the one
  way in (the put of ``boof`` and its list are kept).
* checkpoint-put bad request fails with EPROTO (no payload) -> the same,
  ``Protocol error`` with what is wrong, and nothing written.  (Every other
  malformed payload, from the far rank, is tests/test_content_rpc.py's
  test_bad_payloads_are_eproto; Flux's value naming no blobref is EINVAL:
  test_flux_checkpoint_requests_name_the_kvs_checkpoint.)
* reload; checkpoint-put works; get returns most recent -> a restart and
  a put after it: the newest is the one answered though every value
  carries the same timestamp (newest means last written, not timestamp).
* flux content checkpoint update works (kvs unloaded) -> ``update`` is for
  a stopped instance here (``--statedir``; online it is a usage error,
  docs/cli.md): the instance stopped, ``update --statedir`` to a root
  directory stored earlier -> listed at index 0, sequence 0 (not a kept
  checkpoint: 0, as Flux's).  Flux's own ref, ``sha1-1234...890``, names
  no blob: kvbroker refuses it (it checks the tree is in the store,
  documented), tests/test_checkpoint_history.py.
* checkpoint update fails on invalid ref (``foo1-1234``) -> the same,
  offline: exit 1, "is not a blobref", nothing written.
* load kvs; update fails if KVS loaded -> a start with the kvs module
  resumes at the updated root (version 0); ``update`` while an instance
  runs is refused "in use by a running instance" (and Flux's form of the
  put ``EBUSY``): tests/test_checkpoint_history.py,
  tests/test_content_rpc.py.
* remove kvs, remove content-files; checkpoint-put fails without backing
  -> not applicable: the content module always has its store (without a
  statedir, one in the rundir that goes at the stop).
* remove content -> the instance stops.

Beyond Flux's file:

* the value's fields: Flux's form of the put must name a root the KVS can
  resume from (docs/protocol.md: else EINVAL), so that a later start reads
  it: a value with no ``version``, or a ``sequence`` that is negative, a
  string or a fraction, is refused EINVAL (until 2026-12-05 only the
  rootref was checked: it was taken, and the next start with the kvs
  module failed "not a KVS root"; one check now serves both,
  broker/content/kvsroot.py).
* guest access: the checkpoint RPCs are the instance owner's.  A guest's
  ``content checkpoint list``, Flux-form get and well-formed put are
  refused ``Operation not permitted`` (EPERM) and change nothing (the keyed forms:
  tests/test_kvs_rpc_security.py); so is a malformed put, the role
  checked first as Flux's dispatcher does (until 2026-12-05 it was
  answered ``Protocol error`` / ``Invalid argument``).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
from test_broker_guests import run_guest_cli as guest_cli
from test_broker_support import run_cli

from broker.content.blobref import hash_blob
from kvs import treeobj as T

T_OUT = 10
ONE_KEPT = {"broker.modules": "content", "content.max-checkpoints": "1",
            "log.level": "error"}
HEADER = ["Index", "Sequence", "Time", "Rootref"]
EPOCH_2_2 = "1970-01-01T00:00:02Z"


def ref(word: str) -> str:
    """Flux's word as a well-formed (sha1) blobref."""
    return hash_blob(word.encode(), "sha1")


def flux_value(rootref: str) -> dict[str, Any]:
    """The value of Flux's ``checkpoint_put`` (content-helper.sh)."""
    return {"version": 1, "rootref": rootref, "timestamp": 2.2}


async def rpc(uri: str, topic: str, payload: Any = None) -> tuple[int, str, str]:
    args = ["rpc", topic] + ([] if payload is None else [json.dumps(payload)])
    return await run_cli(*args, uri=uri, timeout=30)


async def put(uri: str, rootref: str) -> None:
    rc, out, err = await rpc(uri, "content.checkpoint-put", {"value": flux_value(rootref)})
    assert (rc, json.loads(out) if rc == 0 else None) == (0, {}), err


async def get(uri: str) -> list[dict[str, Any]]:
    rc, out, err = await rpc(uri, "content.checkpoint-get")
    assert rc == 0, err
    values: list[dict[str, Any]] = json.loads(out)["value"]
    return values


async def listed(uri: str, *opts: str) -> list[str]:
    rc, out, err = await run_cli("content", "checkpoint", "list", *opts, uri=uri)
    assert (rc, err) == (0, ""), (rc, err)
    return out.splitlines()


def row(rootref: str) -> list[str]:
    return ["0", "0", EPOCH_2_2, rootref]


async def test_t0037_flux_checkpoints_one_kept_across_restarts(start_instance, connect,
                                                               tmp_path) -> None:
    statedir = tmp_path / "state"
    inst = await start_instance(size=1, statedir=str(statedir), attrs=ONE_KEPT)
    uri = inst.uri(0)

    # "checkpoint-get returns ENOENT if there is no checkpoint"
    rc, out, err = await rpc(uri, "content.checkpoint-get")
    assert rc == 1 and out == "" and "No such file or directory" in err, (rc, err)

    # "checkpoint-put w/ rootref bar", "returned rootref bar": the value whole
    bar = ref("bar")
    await put(uri, bar)
    assert await get(uri) == [flux_value(bar)]
    # "list (1 default / 1 no-header / 1 json)"
    lines = await listed(uri)
    assert [ln.split() for ln in lines] == [HEADER, row(bar)], lines
    assert [ln.split() for ln in await listed(uri, "--no-header")] == [row(bar)]
    lines = await listed(uri, "--json")
    assert len(lines) == 1 and json.loads(lines[0]) == flux_value(bar), lines
    # "returned correct timestamp"
    assert (await get(uri))[0]["timestamp"] == 2.2

    # "updates rootref to baz", "returned rootref baz", "list (2)"
    baz = ref("baz")
    await put(uri, baz)
    assert [v["rootref"] for v in await get(uri)] == [baz]
    assert [ln.split() for ln in await listed(uri, "-n")] == [row(baz)]

    # "reload content-files", "still returns rootref baz"
    await inst.stop()
    inst = await start_instance(size=1, statedir=str(statedir), attrs=ONE_KEPT)
    uri = inst.uri(0)
    assert await get(uri) == [flux_value(baz)]

    # a longer rootref, then a shorter one: each read back whole
    for rootref in (hash_blob(b"abcdefghijklmnopqrstuvwxyz"), ref("foobar")):
        await put(uri, rootref)
        assert await get(uri) == [flux_value(rootref)]
        assert [ln.split() for ln in await listed(uri, "-n")] == [row(rootref)]

    # "checkpoint-backing-*": no such service; the content service is the way
    boof = ref("boof")
    await put(uri, boof)
    for topic in ("content-backing.checkpoint-get", "content-backing.checkpoint-put"):
        rc, out, err = await rpc(uri, topic, {} if topic.endswith("put") else None)
        assert rc == 1 and "Function not implemented" in err, (topic, rc, err)

    # "checkpoint-put bad request fails with EPROTO": and nothing is written
    rc, out, err = await rpc(uri, "content.checkpoint-put")
    assert (rc, out) == (1, ""), (rc, out)
    assert err.startswith("kvbroker: content.checkpoint-put: Protocol error ("), err
    assert [ln.split() for ln in await listed(uri, "-n")] == [row(boof)]

    # a root directory for "checkpoint update" below
    h = await connect(inst, 0)
    empty_dir = (await asyncio.wait_for(h.rpc("content.store", {
        "data": T.encode(T.dir_({}))}), T_OUT))["blobref"]
    await asyncio.wait_for(h.rpc("content.flush", {}), T_OUT)
    await h.close()

    # "reload", "checkpoint-put works", "returns most recent checkpoint"
    await inst.stop()
    inst = await start_instance(size=1, statedir=str(statedir), attrs=ONE_KEPT)
    ref1 = ref("ref1")
    await put(inst.uri(0), ref1)
    assert await get(inst.uri(0)) == [flux_value(ref1)]
    await inst.stop()

    # "checkpoint update fails on invalid ref": offline, nothing written
    rc, out, err = await run_cli("content", "checkpoint", "update", "--statedir",
                                 str(statedir), "foo1-1234")
    assert (rc, out) == (1, "") and "is not a blobref" in err, (rc, out, err)
    rc, out, err = await run_cli("content", "checkpoint", "list", "-j", "--statedir",
                                 str(statedir))
    assert rc == 0 and [json.loads(ln) for ln in out.splitlines()] == [flux_value(ref1)]
    # "checkpoint update works": to a root stored earlier, at sequence 0
    rc, out, err = await run_cli("content", "checkpoint", "update", "--statedir",
                                 str(statedir), empty_dir)
    assert rc == 0, err
    rc, out, err = await run_cli("content", "checkpoint", "list", "-n", "--statedir",
                                 str(statedir))
    assert rc == 0 and out.splitlines()[0].split()[0:2] + out.splitlines()[0].split()[3:] \
        == ["0", "0", empty_dir], out

    # "load kvs": it resumes at the updated root, version 0
    inst = await start_instance(size=1, statedir=str(statedir))
    h = await connect(inst, 0)
    root = await asyncio.wait_for(h.rpc("kvs.getroot", {"namespace": "primary"}), T_OUT)
    assert (root["rootref"], root["rootseq"]) == (empty_dir, 0), root


async def test_t0037_a_flux_value_the_kvs_cannot_resume_from_is_einval(
        start_instance, connect, tmp_path) -> None:
    """docs/protocol.md: Flux's form of the put is the KVS's checkpoint,
    whose value must name a root (``{version, rootref, sequence,
    timestamp}``), else EINVAL -- so that a later start can read it.  A
    value the kvs module's start refuses ("not a KVS root") must be
    refused by the put, leaving the checkpoint the start resumes from."""
    statedir = tmp_path / "state"
    inst = await start_instance(size=1, statedir=str(statedir),
                                attrs={"broker.modules": "content"})
    h = await connect(inst, 0)
    root = (await asyncio.wait_for(h.rpc("content.store", {
        "data": T.encode(T.dir_({}))}), T_OUT))["blobref"]
    good = {"version": 1, "rootref": root, "sequence": 3, "timestamp": 2.2}
    await asyncio.wait_for(h.rpc("content.checkpoint-put", {"value": good}), T_OUT)
    await h.close()
    uri = inst.uri(0)
    answers = {}
    for name, bad in [("no version", {"rootref": root, "timestamp": 2.2}),
                      ("negative sequence", {**good, "sequence": -4}),
                      ("string sequence", {**good, "sequence": "x"}),
                      ("fractional sequence", {**good, "sequence": 1.5})]:
        rc, out, err = await rpc(uri, "content.checkpoint-put", {"value": bad})
        answers[name] = (rc, "Invalid argument" in err)
    assert answers == {name: (1, True) for name in answers}, answers
    assert (await get(uri))[0] == good  # the newest is still the good one
    await inst.stop()
    inst = await start_instance(size=1, statedir=str(statedir))  # with the kvs: it starts
    h = await connect(inst, 0)
    got = await asyncio.wait_for(h.rpc("kvs.getroot", {"namespace": "primary"}), T_OUT)
    assert (got["rootref"], got["rootseq"]) == (root, 3), got


async def run_guest_cli(uri: str, *args: str) -> tuple[int, str, str]:
    """``kvbroker ARGS`` as the guest, with what ``content checkpoint list``
    imports on its way imported first, as the owner: the interpreter's own
    library may be unreadable to the guest (its ``sqlite3`` was)."""
    return await guest_cli(uri, *args,
                           preload="import sqlite3, broker.content.module, kvs.checkpoints")


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to run as another uid")
GUESTS = {"broker.modules": "content", "access.allow-guest-user": "true"}


async def _with_a_checkpoint(start_instance, tmp_path: Path) -> tuple[Any, str]:
    inst = await start_instance(size=1, statedir=str(tmp_path / "state"), attrs=GUESTS)
    bar = ref("bar")
    await put(inst.uri(0), bar)
    return inst, bar


@needs_root
async def test_t0037_guests_are_refused_the_checkpoints(start_instance, tmp_path) -> None:
    inst, bar = await _with_a_checkpoint(start_instance, tmp_path)
    uri = inst.uri(0)
    rc, out, err = await run_guest_cli(uri, "content", "checkpoint", "list")
    assert rc == 1 and "Operation not permitted" in err, (rc, out, err)
    assert bar not in out
    rc, out, err = await run_guest_cli(uri, "rpc", "content.checkpoint-get")
    assert (rc, out) == (1, "") and "Operation not permitted" in err, (rc, err)
    rc, out, err = await run_guest_cli(uri, "rpc", "content.checkpoint-put",
                                       json.dumps({"value": flux_value(ref("guest"))}))
    assert (rc, out) == (1, "") and "Operation not permitted" in err, (rc, err)
    assert await get(uri) == [flux_value(bar)]  # the owner's, unchanged


@needs_root
async def test_t0037_a_guests_malformed_put_is_refused_for_the_role(start_instance,
                                                                    tmp_path) -> None:
    inst, bar = await _with_a_checkpoint(start_instance, tmp_path)
    uri = inst.uri(0)
    answers = {}
    for payload in (None, {}, {"value": {"version": 1, "rootref": "bar"}}):
        args = [] if payload is None else [json.dumps(payload)]
        rc, out, err = await run_guest_cli(uri, "rpc", "content.checkpoint-put", *args)
        answers[json.dumps(payload)] = (rc, err.split(": ", 2)[-1].split(" (")[0].strip())
    assert answers == {p: (1, "Operation not permitted") for p in answers}, answers
    assert await get(uri) == [flux_value(bar)]
