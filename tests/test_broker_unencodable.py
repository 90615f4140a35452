"""A payload that decoded as it came but cannot be packed again for a link.

msgpack unpacks and packs about 1,024 levels of nesting.  A module that wraps
what a client sent inside its own message to another rank can push it past
that: the rank then answers ``EPROTO`` in that message's place (counted as
``unencodable``, logged at most once a second), instead of calling the
neighbour unreachable, and goes on serving.  The module here is a test
plugin installed by entry point, as tests/test_broker_modules.py does.
"""

from __future__ import annotations

import asyncio
import errno
import textwrap
from pathlib import Path

import pytest
from test_broker_support import install_plugin

from broker.errors import RemoteError

WRAP_MODULE = textwrap.dedent('''
    from typing import ClassVar

    from broker.module import Handler, Module


    def wrapped(x):
        for _ in range(32):  # deeper than the client sent it
            x = [x]
        return {"x": x}


    class WrapModule(Module):
        name: ClassVar[str] = "wrap"

        def handlers(self) -> dict[str, Handler]:
            return {"wrap.forward": self.forward, "wrap.reflect": self.reflect,
                    "wrap.sink": self.sink}

        async def forward(self, msg):  # a request to rank 0 carrying it
            self.h.respond(msg, await self.h.rpc("wrap.sink", wrapped(msg.payload["x"]),
                                                 nodeid=0))

        def reflect(self, msg):  # a response carrying it
            self.h.respond(msg, wrapped(msg.payload["x"]))

        def sink(self, msg):
            self.h.respond(msg, {"ok": True})
''')


@pytest.fixture
def wrap_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = install_plugin(tmp_path, "wrap-plugin",
                          "[kvbroker.modules]\nwrap = wrappkg.wrap:WrapModule\n",
                          {"wrappkg/__init__.py": "", "wrappkg/wrap.py": WRAP_MODULE})
    monkeypatch.setenv("PYTHONPATH", path)  # inherited by the rank processes


def nested(depth: int) -> object:
    x: object = b"v"
    for _ in range(depth):
        x = [x]
    return x


async def test_a_payload_that_cannot_be_packed_again_is_answered_eproto(
        wrap_plugin, start_instance, connect) -> None:
    inst = await start_instance(size=2, fanout=2, attrs={"broker.modules": "content,wrap"})
    async with asyncio.timeout(30):
        h0, h1 = await connect(inst, 0), await connect(inst, 1)
        deep = {"x": nested(1015)}  # what a client can send, but not 32 levels deeper
        assert await h1.rpc("wrap.forward", {"x": nested(3)}) == {"ok": True}
        for _ in range(3):
            with pytest.raises(RemoteError) as info:  # the request rank 1 would send up
                await h1.rpc("wrap.forward", deep)
            assert info.value.errnum == errno.EPROTO
            assert "cannot send the payload on to rank 0" in info.value.errstr
            with pytest.raises(RemoteError) as info:  # the response rank 1 would send up
                await h0.rpc("wrap.reflect", deep, nodeid=1)
            assert info.value.errnum == errno.EPROTO
            assert "cannot send the payload on to rank 0" in info.value.errstr
        messages = (await h1.rpc("broker.stats-get", {}))["messages"]
        assert messages["unencodable"] == 6
        assert messages["unroutable"] == 0
        # and both ranks go on serving
        assert await h1.rpc("wrap.forward", {"x": nested(3)}) == {"ok": True}
        assert await h0.rpc("wrap.reflect", {"x": b"v"}, nodeid=1) == {"x": nested(32)}
        assert (await h0.rpc("broker.ping", {}, nodeid=1))["rank"] == 1
