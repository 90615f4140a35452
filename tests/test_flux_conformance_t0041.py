"""flux-core t/t0041-broker-conf-builtin.t (the ``broker.conf-builtin``
RPC) against a real kvbroker rank; Flux's ``flux python -c "...rpc(...)"``
is a :class:`~broker.handle.Handle`'s ``rpc`` here, and its guest a real
process of another uid.  docs/protocol.md "Built-in services".

Flux's keys are its compiled-in paths (``confdir``, ``libexecdir``,
``shell_path``...); kvbroker has no system configuration directory, rc
scripts or job shell, and answers what its installation is instead:
``python`` (the rank's interpreter), ``python_path`` (where its packages
are imported from), ``bindir`` (where that interpreter's commands, the
``kvbroker`` command, are) -- broker/config.py ``builtin``.  So Flux's
``confdir`` is ``python_path`` below.

Flux case -> here:

1.-3. a single key, several keys (3 values), the values non-empty
    strings -> :func:`test_values` (and that they are what they say).
4.-5. an invalid key fails naming it; in a batch, the first invalid one
    -> :func:`test_refusals` (``EINVAL``, the known keys listed).
6.-7. no ``keys``, ``keys`` not an array (42) -> ``EPROTO`` (same test).
8. works for a guest -> :func:`test_a_guest_may_ask`.
9. the seven well-known keys -> kvbroker's three (:func:`test_values`);
    Flux's are refused naming the first (:func:`test_refusals`).
10. an empty ``keys`` array -> empty ``values``.
11. an empty-string key fails "invalid key" -> the same.
12. ``keys`` a string -> ``EPROTO``.
13. non-string elements are skipped -> DIFFERENCE: refused ``EPROTO``
    (``keys must be a list of strings``), as kvbroker refuses any
    mistyped field rather than answer part of a request.
"""

from __future__ import annotations

import errno
import json
import os
import sys

import pytest
from test_broker_guests import run_guest_cli
from test_watch_helpers import errnum

from broker.errors import RemoteError

RPC = "broker.conf-builtin"


async def test_values(start_instance, connect) -> None:
    """Flux 1-3, 9-10; and every rank answers for its own installation."""
    inst = await start_instance(size=2)
    h = await connect(inst)
    one = await h.rpc(RPC, {"keys": ["python_path"]})
    assert list(one["values"]) == ["python_path"] and one["values"]["python_path"]
    values = (await h.rpc(RPC, {"keys": ["python_path", "python", "bindir"]}))["values"]
    assert len(values) == 3 and all(isinstance(v, str) and v for v in values.values())
    assert os.path.isfile(os.path.join(values["python_path"], "broker", "__init__.py"))
    assert os.path.realpath(values["python"]) == os.path.realpath(sys.executable)
    assert os.access(os.path.join(values["bindir"], "kvbroker"), os.X_OK), values
    assert (await h.rpc(RPC, {"keys": ["python_path"]}, nodeid=1))["values"] == one["values"]
    assert await h.rpc(RPC, {"keys": []}) == {"values": {}}


async def test_refusals(start_instance, connect) -> None:
    """Flux 4-7, 9, 11-13."""
    inst = await start_instance(size=1)
    h = await connect(inst)
    for keys, bad in ((["invalid_key_name"], "invalid_key_name"),
                      (["python_path", "invalid_key", "python"], "invalid_key"),
                      (["confdir", "libexecdir"], "confdir"), ([""], "")):
        with pytest.raises(RemoteError) as info:
            await h.rpc(RPC, {"keys": keys})
        assert info.value.errnum == errno.EINVAL
        assert info.value.errstr.startswith(f"{bad}: invalid key (the keys: bindir, python, "
                                            "python_path)"), info.value.errstr
    for payload in ({}, {"keys": 42}, {"keys": "string"},
                    {"keys": ["python_path", 42, None, "python"]}):
        assert await errnum(h.rpc(RPC, payload)) == errno.EPROTO, payload


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run as another uid")
async def test_a_guest_may_ask(start_instance) -> None:
    """Flux 8."""
    inst = await start_instance(size=1, attrs={"access.allow-guest-user": "true"})
    rc, out, err = await run_guest_cli(inst.uri(0), "rpc", RPC, '{"keys": ["python_path"]}')
    assert rc == 0 and json.loads(out)["values"]["python_path"], (out, err)
