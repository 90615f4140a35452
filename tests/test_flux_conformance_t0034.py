"""flux-core t/t0034-broker-getenv.t (the ``broker.getenv`` and
``broker.setenv`` requests: read and change the broker's own environment)
against real kvbroker ranks.

kvbroker's broker service has neither method (docs/protocol.md, Built-in
services: ``broker.ping``, ``broker.stats-get``, ``broker.shutdown``... no
``getenv``/``setenv``), and nothing else reads or changes a rank's
environment at run time: a rank's environment is the one it was started
with (``kvbroker exec`` runs its command from the caller's side, not from
the rank's, docs/cli.md "exec").  So none of Flux's cases applies; what is
tested is the nearest: that each of the requests Flux's cases send is
refused by the rank as a method it does not have -- ENOSYS, naming the
topic -- at once, without harm to the rank.

Flux's cases, in order:

1.  'getenv is able to fetch test variable',
2.  'getenv is able to fetch multiple variables',
3.  'getenv returns an empty object when variable is not set' -> not
    applicable; ``broker.getenv`` with ``names`` is ENOSYS
    (:func:`test_getenv_and_setenv_are_methods_the_broker_does_not_have`).
4.  'malformed getenv request fails with EPROTO' -> ENOSYS, not EPROTO:
    the method is not there to look at its payload (same test).
5.  'getenv fails for simulated guest' (EPERM) -> not applicable (no
    method; a guest connection needs another uid: see
    tests/test_broker_guests.py for guests' refusals of owner methods).
6.  'setenv can set a new variable',
7.  '... overwrite an existing variable',
8.  '... set multiple variables at once',
9.  '... with null value unsets the variable',
10. '... null value is a no-op for unset variable',
11. '... mix set and unset in one call' -> not applicable;
    ``broker.setenv`` with ``env`` is ENOSYS (same test).
12. 'malformed setenv request fails with EPROTO',
13. 'setenv fails when env value is not a string or null',
14. '... variable name contains =',
15. '... empty variable name',
16. 'setenv validation failure leaves no variables set' -> ENOSYS for
    each (same test); the rank serves on (a ping and a kvs round trip
    after them).
17. 'setenv fails for simulated guest' -> not applicable, as 5.

No defect found by this file.
"""

from __future__ import annotations

import errno
import json

import pytest
from test_broker_support import run_cli

from broker.errors import RemoteError

# (topic, payload) of each request Flux's cases send
REQUESTS = [
    ("broker.getenv", {"names": ["BROKER_ENV_TEST"]}),
    ("broker.getenv", {"names": ["BROKER_ENV_TEST", "PATH"]}),
    ("broker.getenv", {}),
    ("broker.setenv", {"env": {"BROKER_ENV_TEST2": "efgh"}}),
    ("broker.setenv", {"env": {"BROKER_ENV_TEST2": None}}),
    ("broker.setenv", {}),
    ("broker.setenv", {"env": {"BROKER_ENV_BAD": 42}}),
    ("broker.setenv", {"env": {"BAD=NAME": "val"}}),
    ("broker.setenv", {"env": {"": "val"}}),
]


async def test_getenv_and_setenv_are_methods_the_broker_does_not_have(
        start_instance, connect) -> None:
    inst = await start_instance(size=2)
    for rank in (0, 1):
        h = await connect(inst, rank)
        for topic, payload in REQUESTS:
            with pytest.raises(RemoteError) as refused:
                await h.rpc(topic, payload)
            assert (refused.value.errnum, refused.value.errstr) == (
                errno.ENOSYS, f"unknown topic {topic}"), (rank, topic, payload)
        # the rank serves on
        assert (await h.rpc("broker.ping", {}))["rank"] == rank
    # from the command line, as Flux's helper sends it: exit 1, the text
    uri = inst.uri(0)
    rc, out, err = await run_cli("rpc", "broker.getenv",
                                 json.dumps({"names": ["PATH"]}), uri=uri)
    assert (rc, out, err) == (1, "", "kvbroker: broker.getenv: Function not implemented "
                                     "(unknown topic broker.getenv)\n")
    rc, out, err = await run_cli("kvs", "put", "a=1", uri=uri)
    assert rc == 0, err
    rc, out, err = await run_cli("kvs", "get", "a", uri=inst.uri(1))
    assert (rc, out) == (0, "1\n"), err
