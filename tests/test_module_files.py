"""Modules loaded from a Python file (``kvbroker module load ./echo.py``, a
path in ``broker.modules``), no package or entry point needed: Flux's
``flux module load testmod.py`` (flux-core t/t0028-module-python-exec.t).
docs/cli.md "module", docs/api.md "Writing a module".

Flux's cases, and what each becomes:

* ``module load testmod.py`` works; ``ping testmod``; ``module stats
  testmod``; ``module list`` shows it; ``module remove testmod`` ->
  :func:`test_load_call_list_stats_reload_and_remove` (a request to
  ``testmod.hello`` for Flux's ``ping testmod``, which kvbroker's ``ping``,
  a rank's broker service, does not do).
* load with args works -> a module file's attributes, as any module's
  (``testmod.greeting=hi``) (same test).
* ``--init-failure`` fails; an ``OSError``'s errno is propagated at init ->
  a module whose ``start()`` raises ``OSError(EEXIST)`` fails the load with
  ``File exists``, the rank unchanged (:func:`test_failures_are_named`).
* ``--name altmod``: the module answers to the new name -> does not apply
  (a module's handlers name their topics in full: ``testmod.hello``); a
  module's name is its class's ``name``.
* handler exception / early exit reported by the broker -> as for any
  module (tests/test_flux_conformance_t0003.py: logged, the rank serves on).
* ``debug_test`` bits, ``set_proctitle``, ``module-python-exec`` run on its
  own, ``modprobe`` -> do not apply (no debug flags, no separate module
  processes, no modprobe).
* (kvbroker's own) ``module reload NAME`` reads the file again, so the
  module runs its new code; ``remove PATH`` removes what that file loaded;
  a path in ``broker.modules`` at start (:func:`test_a_module_file_at_start`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path

import pytest
from test_broker_support import run_cli, wait_until

from broker.errors import RemoteError
from broker.launch import Instance

T = 30.0

TESTMOD = '''\
import errno
from typing import ClassVar

from broker.attrs import AttrSpec
from broker.message import Message
from broker.module import Handler, Module

GREETING = AttrSpec("testmod.greeting", "hello", str, "what testmod.hello says")
FAIL = AttrSpec("testmod.fail", "", str, "fail to start: os or runtime")


class TestMod(Module):
    name: ClassVar[str] = "testmod"
    attributes = (GREETING, FAIL)

    def handlers(self) -> dict[str, Handler]:
        return {"testmod.hello": self.hello}

    async def start(self) -> None:
        fail = FAIL.value(self.ctx.attrs)
        if fail == "os":
            raise OSError(errno.EEXIST, "service already registered")
        if fail == "runtime":
            raise RuntimeError("init failure per test request")

    def hello(self, msg: Message) -> None:
        self.h.respond(msg, {"name": self.name, "says": GREETING.value(self.ctx.attrs),
                             "version": VERSION, "rank": self.ctx.rank})

    def stats(self) -> dict:
        return {"version": VERSION}


VERSION = 1
'''


async def cli(uri: str, *args: str, rc: int = 0, cwd: Path | None = None) -> tuple[str, str]:
    code, out, err = await run_cli(*args, uri=uri, timeout=T, cwd=cwd)
    assert code == rc, (args, code, out, err)
    return out, err


async def hello(uri: str, rank: int = 0) -> dict:
    out, _ = await cli(uri, "rpc", "testmod.hello", "--rank", str(rank))
    return json.loads(out)


async def test_load_call_list_stats_reload_and_remove(start_instance, tmp_path: Path) -> None:
    inst = await start_instance(size=2)
    uri = inst.uri(0)
    (tmp_path / "testmod.py").write_text(TESTMOD)
    # a relative path is the command's: the ranks run elsewhere
    await cli(uri, "module", "load", "-r", "all", "./testmod.py", "testmod.greeting=hi",
              cwd=tmp_path)
    assert await hello(uri, 1) == {"name": "testmod", "says": "hi", "version": 1, "rank": 1}
    out, _ = await cli(uri, "module", "list", "--json", "-r", "1")
    [mine] = [m for m in json.loads(out)["modules"] if m["name"] == "testmod"]
    assert mine["services"] == ["testmod"] and mine["file"] == str(tmp_path / "testmod.py")
    assert json.loads((await cli(uri, "stats", "testmod"))[0])["version"] == 1
    _, err = await cli(uri, "module", "load", str(tmp_path / "testmod.py"), rc=1)
    assert "module testmod is loaded on rank 0 already" in err, err

    # a reload by name runs the file's code as it is now, on the rank asked only
    (tmp_path / "testmod.py").write_text(TESTMOD.replace("VERSION = 1", "VERSION = 2"))
    await cli(uri, "module", "reload", "testmod")
    assert (await hello(uri, 0))["version"] == 2
    assert (await hello(uri, 1))["version"] == 1
    await cli(uri, "module", "reload", "-r", "1", str(tmp_path / "testmod.py"))
    assert (await hello(uri, 1)) == {"name": "testmod", "says": "hi", "version": 2,
                                     "rank": 1}  # (the rank's attributes stay as set)

    # removed by its path or its name
    await cli(uri, "module", "remove", "testmod.py", cwd=tmp_path)
    _, err = await cli(uri, "module", "remove", "testmod.py", cwd=tmp_path, rc=1)
    assert f"no module loaded from {tmp_path / 'testmod.py'} on rank 0" in err, err
    await cli(uri, "module", "remove", "-r", "1", "testmod")
    _, err = await cli(uri, "rpc", "testmod.hello", rc=1)
    assert "Function not implemented" in err, err


@pytest.mark.parametrize(("source", "words"), [
    (None, "No such file or directory (no module file {path} (no such file))"),
    ("x = (\n", "Exec format error (module file {path} cannot be loaded: SyntaxError: "),
    ("raise RuntimeError('boom')\n",
     "Exec format error (module file {path} cannot be loaded: RuntimeError: boom)"),
    ("import sys\nsys.exit(3)\n",
     "Exec format error (module file {path} cannot be loaded: SystemExit: 3)"),
    ("import helper\n", "Exec format error (module file {path} cannot be loaded: "
                         "ModuleNotFoundError: No module named 'helper')"),
    ("import os\n", "Exec format error (module file {path} defines no Module subclass "
                    "setting name)"),
    (TESTMOD + "\nclass Other(TestMod):\n    name = 'other'\n",
     "Exec format error (module file {path} defines 2 module classes (TestMod, Other): "
     "one per file)"),
    (TESTMOD.replace('"", str, "fail', '"os", str, "fail'),
     "File exists (service already registered)"),
    (TESTMOD.replace('"", str, "fail', '"runtime", str, "fail'),
     "Input/output error (module testmod failed to start: RuntimeError: init failure per "
     "test request)"),
    (TESTMOD.replace("    def handlers", "    def __init__(self, ctx):\n"
                                           "        raise ValueError\n\n    def handlers"),
     "Input/output error (module testmod failed to start: ValueError)"),
    (TESTMOD.replace('name: ClassVar[str] = "testmod"', 'name: ClassVar[str] = "test.py"'),
     "Exec format error (module file {path} defines module 'test.py', a name that reads as "
     "a path: module remove test.py would look for that file)"),
    # (loaded, it failed every request it was sent, and module list)
    (TESTMOD.replace("    def handlers", "    def __init__(self, ctx):\n"
                                           "        self.ctx = ctx\n\n    def handlers"),
     "Input/output error (module testmod failed to start: its __init__ does not call "
     "super().__init__(ctx))"),
    # (EIO "already registered", the module's other services left registered)
    (TESTMOD.replace('    attributes = (GREETING, FAIL)',
                     '    attributes = (GREETING, FAIL)\n    services = ("kvs",)'),
     "File exists (module testmod asks for service 'kvs', which kvs provides on this rank)"),
    # (a handler under no service of the module: loaded, it was never called)
    (TESTMOD.replace('return {"testmod.hello": self.hello}',
                     'return {"testmod.hello": self.hello, "testmods.hi": self.hello}'),
     "Input/output error (module testmod has handlers no request could reach: "
     "'testmods.hi' (its services are testmod; a request goes to the service named by "
     "its topic's first word))"),
], ids=["missing", "syntax", "raises", "exits", "sibling", "no-class", "two-classes",
        "oserror", "init-failure", "init-raises", "path-name", "no-super", "service-taken",
        "stray-handler"])
async def test_failures_are_named(start_instance, tmp_path: Path, source: str | None,
                                  words: str) -> None:
    """A file that is not there, does not import (or exits as it is read:
    ``sys.exit()`` took the rank down), or defines no module class (or
    two) is refused naming the file and why; a module whose
    start (or ``__init__``: it said "failed to start: " and no more) fails,
    with its own error (an ``OSError``'s errno kept); the
    rank serves on, with nothing loaded."""
    inst = await start_instance(size=1)
    path = tmp_path / "testmod.py"
    # (a file beside it is not importable: its directory is not put on
    # sys.path, as Flux's -- it would shadow modules rank-wide, for good)
    (tmp_path / "helper.py").write_text("X = 1\n")
    if source is not None:
        path.write_text(source)
    _, err = await cli(inst.uri(0), "module", "load", str(path), rc=1)
    assert err.startswith(f"kvbroker: module load: {words.format(path=path)}"), err
    out, _ = await cli(inst.uri(0), "module", "list")
    assert "testmod" not in out
    _, err = await cli(inst.uri(0), "module", "load", str(tmp_path), rc=1)
    assert f"module file {tmp_path} cannot be loaded: not a regular file" in err, err


async def test_a_module_file_at_start(tmp_path: Path) -> None:
    """A path in ``broker.modules`` loads the file's module on every rank
    as it starts (relative: to the directory the instance started in), its
    attributes given with ``-S`` as any module's; a reload reads it again."""
    (tmp_path / "testmod.py").write_text(TESTMOD)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        inst = Instance(2, attrs={"broker.modules": "content,kvs,./testmod.py",
                                  "testmod.greeting": "hey"})
        await inst.start()
    finally:
        os.chdir(cwd)
    try:
        uri = inst.uri(0)
        assert await hello(uri, 1) == {"name": "testmod", "says": "hey", "version": 1,
                                       "rank": 1}
        (tmp_path / "testmod.py").write_text(TESTMOD.replace("VERSION = 1", "VERSION = 3"))
        await cli(uri, "module", "reload", "-r", "all", "testmod", "testmod.greeting=hey")
        assert (await hello(uri, 1))["version"] == 3
    finally:
        await inst.stop()


async def test_the_documented_module_loads_from_its_file(start_instance, tmp_path: Path) -> None:
    """docs/api.md's ``echo.py``, loaded from the file as the docs show."""
    from test_broker_support import doc_block

    (tmp_path / "echo.py").write_text(doc_block("api.md", "# mypkg/echo.py"))
    inst = await start_instance(size=2)
    uri = inst.uri(0)
    await cli(uri, "module", "load", "-r", "all", "./echo.py", cwd=tmp_path)
    out, _ = await cli(uri, "rpc", "echo.hello", '{"name": "x"}', "--rank", "1")
    assert json.loads(out) == {"hello": "x", "rank": 1, "from": os.getuid()}
    await cli(uri, "module", "reload", "-r", "all", "echo")
    out, _ = await cli(uri, "rpc", "--stream", "echo.count", '{"n": 2}')
    assert [json.loads(line) for line in out.splitlines()] == [{"i": 0}, {"i": 1}]


async def test_a_module_whose_init_raises_at_start(tmp_path: Path) -> None:
    """A module in ``broker.modules`` whose ``__init__`` raises fails the
    start-up naming the module, as one whose ``start()`` does: it said
    only ``start-up failed: ValueError``."""
    (tmp_path / "testmod.py").write_text(TESTMOD.replace(
        "    def handlers", "    def __init__(self, ctx):\n        raise ValueError\n\n"
                           "    def handlers"))
    rc, _, err = await run_cli("start", "--size", "1", "-S",
                               "broker.modules=content,./testmod.py", "--", "true",
                               timeout=T, cwd=tmp_path)
    assert rc == 2, (rc, err)
    assert "start-up failed: module testmod failed to start: ValueError\n" in err, err


async def test_a_module_file_that_exits_at_start(tmp_path: Path) -> None:
    """A file in ``broker.modules`` that calls ``sys.exit()`` as it is read
    is a start-up failure naming the file, as one that does not import:
    the launcher, which reads it to check the module's attributes, exited
    with the file's status and a traceback ("Task exception was never
    retrieved")."""
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    rc, _, err = await run_cli("start", "--size", "1", "-S",
                               "broker.modules=content,./exits.py", "--", "true",
                               timeout=T, cwd=tmp_path)
    assert rc == 2, (rc, err)  # (as for one that does not import)
    assert (f"module file {tmp_path / 'exits.py'} cannot be loaded: SystemExit: 3"
            in err), err
    assert "Traceback" not in err, err


async def test_a_module_list_written_with_blanks(tmp_path: Path) -> None:
    """``broker.modules`` is comma-separated: blanks around a name are
    dropped (``content, kvs`` stopped the start-up, ``no module named ' kvs'``),
    and a list written with spaces (one name, unknown) says so."""
    rc, out, err = await run_cli("start", "--size", "1", "-S",
                                 "broker.modules=content, kvs ,", "--", "kvbroker", "kvs",
                                 "put", "a=1", timeout=T, cwd=tmp_path)
    assert (rc, out, err) == (0, "", "")
    rc, _, err = await run_cli("start", "--size", "1", "-S", "broker.modules=content kvs",
                               "--", "true", timeout=T, cwd=tmp_path)
    assert rc == 2, (rc, err)
    assert re.search(r"start-up failed: no module named 'content kvs' \(known: .*\): "
                     r"broker\.modules is a comma-separated list\n", err), err


async def test_a_file_that_now_defines_another_module(start_instance, tmp_path: Path) -> None:
    """A module file edited to define a module of another name is not
    loaded beside the one loaded from it (``reload -f NAME`` did, the old
    one kept running; ``reload NAME`` said the new name was not loaded,
    and ``load`` loaded it too): refused naming both, the old one serving."""
    inst = await start_instance(size=1)
    uri = inst.uri(0)
    path = tmp_path / "testmod.py"
    path.write_text(TESTMOD)
    await cli(uri, "module", "load", str(path))
    path.write_text(TESTMOD.replace('name: ClassVar[str] = "testmod"',
                                    'name: ClassVar[str] = "renamed"')
                    .replace('"testmod.hello"', '"renamed.hello"'))
    words = (f"module file {path} now defines module renamed, not testmod, which was "
             "loaded from it: remove testmod first")
    for args, why in ((("reload", "testmod"), "Invalid argument"),
                      (("reload", "-f", "testmod"), "Invalid argument"),
                      (("reload", str(path)), "Invalid argument"),
                      (("load", str(path)), "File exists")):
        _, err = await cli(uri, "module", *args, rc=1)
        assert err == f"kvbroker: module {args[0]}: {why} ({words} on rank 0)\n", err
    out, _ = await cli(uri, "module", "list")
    assert "testmod" in out and "renamed" not in out
    assert (await hello(uri))["name"] == "testmod"
    await cli(uri, "module", "remove", "testmod")
    await cli(uri, "module", "load", str(path))
    out, _ = await cli(uri, "module", "list", "--json")
    assert {m["name"]: m.get("file") for m in json.loads(out)["modules"]}["renamed"] == str(path)


async def test_a_refused_load_leaves_the_loaded_module_whole(start_instance,
                                                           tmp_path: Path) -> None:
    """A load of a file refused after it was read (its module is loaded
    already, or it now defines two) leaves the loaded module's code where
    Python finds it by name (``sys.modules``): its entry was dropped, and
    what looks a class up by its module's name (pickle, typing's hints,
    dataclasses) failed in the running module."""
    inst = await start_instance(size=1)
    uri = inst.uri(0)
    path = tmp_path / "testmod.py"
    source = TESTMOD.replace("    def stats(self) -> dict:\n        return {\"version\": VERSION}",
                             "    def stats(self) -> dict:\n        import pickle\n"
                             "        return {\"pickled\": len(pickle.dumps(Point()))}") + (
        "\n\nclass Point:\n    pass\n")
    path.write_text(source)
    await cli(uri, "module", "load", str(path))
    await cli(uri, "module", "load", str(path), rc=1)  # (EEXIST)
    path.write_text(source + "\nclass Other(TestMod):\n    name = 'other'\n")
    await cli(uri, "module", "reload", "testmod", rc=1)  # (ENOEXEC: two classes)
    assert json.loads((await cli(uri, "stats", "testmod"))[0])["pickled"] > 0


async def test_a_symlinked_file_is_kept_as_named(start_instance, tmp_path: Path) -> None:
    """A path is kept as given (made absolute, not resolved): a reload
    through a symlink reads what it points to then; the module is the
    link's (``module remove`` of its target is another file)."""
    inst = await start_instance(size=1)
    uri = inst.uri(0)
    (tmp_path / "v1.py").write_text(TESTMOD)
    (tmp_path / "v2.py").write_text(TESTMOD.replace("VERSION = 1", "VERSION = 2"))
    (tmp_path / "testmod.py").symlink_to(tmp_path / "v1.py")
    await cli(uri, "module", "load", "./testmod.py", cwd=tmp_path)
    (tmp_path / "testmod.py").unlink()
    (tmp_path / "testmod.py").symlink_to(tmp_path / "v2.py")
    await cli(uri, "module", "reload", "testmod")
    assert (await hello(uri))["version"] == 2
    _, err = await cli(uri, "module", "remove", str(tmp_path / "v2.py"), rc=1)
    assert f"no module loaded from {tmp_path / 'v2.py'}" in err, err
    await cli(uri, "module", "remove", "../" + tmp_path.name + "/testmod.py", cwd=tmp_path)


EXITMOD = '''\
import sys
from typing import ClassVar

from broker.message import Message
from broker.module import Handler, Module


class ExitMod(Module):
    name: ClassVar[str] = "exitmod"

    def handlers(self) -> dict[str, Handler]:
        return {"exitmod.now": self.now, "exitmod.later": self.later,
                "exitmod.task": self.task}

    async def start(self) -> None:
        self.h.subscribe("exitmod.")

    def on_event(self, msg: Message) -> None:
        if msg.topic == "exitmod.event":
            sys.exit(7)

    def stats(self) -> dict:
        return {"events": self.event_stats()}

    def now(self, msg: Message) -> None:
        sys.exit(5)

    async def later(self, msg: Message) -> None:
        sys.exit(6)

    async def task(self, msg: Message) -> None:
        try:
            await self.spawn(self._exits())
        except RuntimeError as exc:
            self.h.respond(msg, {"error": str(exc)})

    async def _exits(self) -> None:
        sys.exit(8)

    async def stop(self) -> None:
        sys.exit(9)
'''


async def test_sys_exit_in_a_module_is_its_failure_not_the_ranks(start_instance,
                                                                  tmp_path: Path) -> None:
    """``sys.exit()`` in a module's handler, event handler, task or
    ``stop()`` is that code's failure, as an exception is -- answered
    ``EIO`` or logged -- and the rank serves on.  It ended the rank (from a handler coroutine
    or a task: the event loop stopped, the instance went down with the
    status given) or dropped the connection whose read ran the handler
    (a plain one: the client got ``ECONNRESET``, not an answer)."""
    inst = await start_instance(size=2)
    uri = inst.uri(0)
    (tmp_path / "exitmod.py").write_text(EXITMOD)
    await cli(uri, "module", "load", "./exitmod.py", cwd=tmp_path)
    for topic, status in (("exitmod.now", 5), ("exitmod.later", 6)):
        _, err = await cli(uri, "rpc", topic, rc=1)
        assert err == (f"kvbroker: {topic}: Input/output error "
                       f"(internal error: SystemExit: {status})\n"), err
    out, _ = await cli(uri, "rpc", "exitmod.task")
    assert json.loads(out) == {"error": "module exitmod's task called sys.exit(8)"}
    await cli(uri, "event", "pub", "exitmod.event")
    # (events come in order: had this one, it had the one before)
    await cli(uri, "event", "pub", "-s", "exitmod.after")
    out, _ = await cli(uri, "stats", "exitmod")
    assert json.loads(out)["events"]["received"] == 2
    log = (await cli(uri, "dmesg"))[0]
    assert "event handler failed for exitmod.event" in log and "SystemExit: 7" in log, log
    assert "SystemExit: 5" in log and "SystemExit: 6" in log, log
    await cli(uri, "module", "remove", "exitmod")  # (removed: its stop failed)
    log = (await cli(uri, "dmesg"))[0]
    assert "module exitmod failed to stop" in log, log
    assert "ModuleExit: module exitmod's stop() called sys.exit(9)" in log, log
    _, err = await cli(uri, "rpc", "exitmod.now", rc=1)
    assert "Function not implemented" in err, err
    await cli(uri, "ping", "--count", "1", "0")  # (the rank serves on)


async def test_sys_exit_in_a_modules_start_at_start_up(tmp_path: Path) -> None:
    """A module in ``broker.modules`` whose ``start()`` calls ``sys.exit()``
    fails the start-up naming the module, as one that raises: the rank
    exited with the status given and no word of why."""
    (tmp_path / "testmod.py").write_text(TESTMOD.replace(
        "        fail = FAIL", "        import sys\n        sys.exit(4)\n        fail = FAIL"))
    rc, _, err = await run_cli("start", "--size", "1", "-S",
                               "broker.modules=content,./testmod.py", "--", "true",
                               timeout=T, cwd=tmp_path)
    assert rc == 2, (rc, err)
    assert "start-up failed: module testmod failed to start: SystemExit: 4\n" in err, err


ASYNCEV = '''\
import asyncio
from typing import ClassVar

from broker.message import Message
from broker.module import Handler, Module


class AsyncEv(Module):
    name: ClassVar[str] = "asyncev"

    def handlers(self) -> dict[str, Handler]:
        return {"asyncev.seen": self.seen}

    async def start(self) -> None:
        self.heard: list[str] = []
        self.h.subscribe("asyncev.")

    async def on_event(self, msg: Message) -> None:
        await asyncio.sleep(0)
        if msg.topic == "asyncev.fail":
            raise ValueError("no good")
        self.heard.append(msg.topic)

    async def seen(self, msg: Message) -> None:
        while "asyncev.last" not in self.heard:
            await asyncio.sleep(0.01)
        self.h.respond(msg, {"heard": self.heard})
'''


PLAINMOD = TESTMOD.replace("    async def start(self)", "    def start(self)").replace(
    "    def stats(self) -> dict:", """    def stop(self) -> None:
        with open(self.ctx.attrs["testmod.greeting"], "w") as f:
            f.write("stopped")

    def stats(self) -> dict:""")


async def test_plain_start_and_stop(start_instance, tmp_path: Path) -> None:
    """A module's ``start()`` and ``stop()`` may be plain functions: they
    are called, and what they return awaited only if it is awaitable.  The
    load failed (``TypeError: object NoneType can't be used in 'await'
    expression``)."""
    inst = await start_instance(size=1)
    uri = inst.uri(0)
    (tmp_path / "testmod.py").write_text(PLAINMOD)
    stopped = tmp_path / "stopped"
    await cli(uri, "module", "load", "./testmod.py", f"testmod.greeting={stopped}",
              cwd=tmp_path)
    assert (await hello(uri))["says"] == str(stopped)
    with pytest.raises(FileNotFoundError):
        stopped.read_text()
    await cli(uri, "module", "remove", "testmod")
    assert stopped.read_text() == "stopped"


async def test_a_coroutine_on_event_runs(start_instance, tmp_path: Path) -> None:
    """A module whose ``on_event`` is a coroutine function has each event's
    run as a task, in the order the events came, its failure logged as a
    plain one's is.  It was called and dropped: no event was handled, and
    Python warned ``coroutine ... was never awaited`` on the rank's stderr."""
    inst = await start_instance(size=1)
    uri = inst.uri(0)
    (tmp_path / "asyncev.py").write_text(ASYNCEV)
    await cli(uri, "module", "load", "./asyncev.py", cwd=tmp_path)
    for topic in ("asyncev.one", "asyncev.fail", "asyncev.two", "asyncev.last"):
        await cli(uri, "event", "pub", topic)
    out, _ = await cli(uri, "rpc", "asyncev.seen", "-t", "10")
    assert json.loads(out) == {"heard": ["asyncev.one", "asyncev.two", "asyncev.last"]}
    log = (await cli(uri, "dmesg"))[0]
    assert "event handler failed for asyncev.fail" in log and "ValueError: no good" in log
    await cli(uri, "module", "remove", "asyncev")
    assert "never awaited" not in (tmp_path / "broker-0.log").read_text()


LEAKYMOD = '''\
import sys
from typing import ClassVar

from broker.message import Message
from broker.module import Handler, Module


class LeakyMod(Module):
    name: ClassVar[str] = "leakymod"

    def handlers(self) -> dict[str, Handler]:
        return {"leakymod.hold": self.hold, "leakymod.disconnect": self.gone,
                "leakymod.exit": self.exit, "leakymod.returns": self.returns}

    def hold(self, msg: Message) -> None:
        pass  # (never answered: the broker holds it)

    async def returns(self, msg: Message) -> dict:
        return {"value": 1}  # (not sent: respond() answers)

    def gone(self, msg: Message) -> None:
        raise KeyError(tuple(msg.route))  # (a client it never knew)

    def exit(self, msg: Message) -> None:
        self.kept = self.spawn(self._exits())  # (kept, as modules keep their tasks)
        self.h.respond(msg, {})

    async def _exits(self) -> None:
        sys.exit(4)
'''


async def test_a_failing_disconnect_handler_still_frees_what_its_client_held(
        start_instance, tmp_path: Path) -> None:
    """A ``.disconnect`` handler that raises: the client is gone all the
    same, and the requests the broker held for it are forgotten (they
    stayed, payloads and all, until the module went: a probe).  And a
    spawned task the module keeps that calls ``sys.exit()`` is logged as
    it ends (api.md: it was said only if the task was collected)."""
    from broker.errors import RemoteError
    from broker.handle import Handle

    inst = await start_instance(size=1)
    uri = inst.uri(0)
    (tmp_path / "leakymod.py").write_text(LEAKYMOD)
    await cli(uri, "module", "load", "./leakymod.py", cwd=tmp_path)

    async def held() -> int:
        out, _ = await cli(uri, "module", "list", "--json")
        return next(m["held"] for m in json.loads(out)["modules"] if m["name"] == "leakymod")

    async with asyncio.timeout(T):
        h = await Handle.connect(uri)
        calls = [h.rpc("leakymod.hold", {"pad": "x" * 1000}) for _ in range(3)]

        async def all_held() -> bool:
            return await held() == 3
        await wait_until(all_held, "the three requests held")
        await h.close()
        for c in calls:
            with pytest.raises(RemoteError):
                await c

        async def none_held() -> bool:
            return await held() == 0
        await wait_until(none_held, "the gone client's requests forgotten")
        await cli(uri, "rpc", "leakymod.exit")

        async def logged() -> bool:
            return "module leakymod's task called sys.exit(4)" in (await cli(uri, "dmesg"))[0]
        await wait_until(logged, "the task's sys.exit logged")
        # a handler that returns its answer: held, and said (once a topic)
        h2 = await Handle.connect(uri)
        returned = h2.rpc("leakymod.returns", {})

        async def warned() -> bool:
            log = (await cli(uri, "dmesg"))[0]
            return "handler leakymod.returns returned a dict without answering" in log
        await wait_until(warned, "the returned answer said")
        assert not returned.done()
        await h2.close()
        with pytest.raises(RemoteError):
            await returned


SLOWSTART = '''\
import asyncio
from typing import ClassVar

from broker.message import Message
from broker.module import Handler, Module


class SlowStart(Module):
    name: ClassVar[str] = "slowstart"
    ready = False

    def handlers(self) -> dict[str, Handler]:
        return {"slowstart.ready": self.answer}

    async def start(self) -> None:
        await asyncio.sleep(1.0)  # (what a start sets up takes a while)
        self.ready = True

    def answer(self, msg: Message) -> None:
        self.h.respond(msg, {"ready": self.ready})
'''


async def test_a_module_loaded_at_runtime_is_sent_nothing_before_it_has_started(
        start_instance, tmp_path: Path) -> None:
    """``module load`` of a module whose ``start()`` takes a while: a
    request that comes meanwhile waits for the start to end, as at a rank's
    start and in a reload (it reached the handler before ``start()`` had
    set up what it uses: a probe)."""
    inst = await start_instance(size=1)
    uri = inst.uri(0)
    (tmp_path / "slowstart.py").write_text(SLOWSTART)
    load = asyncio.ensure_future(cli(uri, "module", "load", "./slowstart.py", cwd=tmp_path))

    async def listed() -> bool:  # (listed as it starts)
        return "slowstart" in (await cli(uri, "module", "list"))[0]
    await wait_until(listed, "the module listed, starting")
    out, _ = await cli(uri, "rpc", "slowstart.ready")
    assert json.loads(out) == {"ready": True}
    await load


PARKER = '''\
from typing import ClassVar

from broker.module import Handler, Module


class Parker(Module):
    """Holds each ``parker.wait`` until ``parker.release`` names its id."""
    name: ClassVar[str] = "parker"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.parked = {}

    def handlers(self) -> dict[str, Handler]:
        return {"parker.wait": self.wait, "parker.release": self.release,
                "parker.count": self.count}

    def wait(self, msg):
        self.parked[msg.payload["id"]] = msg
        self.h.hold(msg)

    def release(self, msg):
        self.h.respond(self.parked.pop(msg.payload["id"]), {"id": msg.payload["id"]})
        self.h.respond(msg, {})

    def count(self, msg):
        self.h.respond(msg, {"n": len(self.parked)})
'''

ASKER = '''\
from typing import ClassVar

from broker.module import Handler, Module


class Asker(Module):
    """``asker.go {id}`` asks rank 0's parker and says what came back."""
    name: ClassVar[str] = "asker"

    def handlers(self) -> dict[str, Handler]:
        return {"asker.go": self.go}

    async def go(self, msg):
        got = await self.h.rpc("parker.wait", {"id": msg.payload["id"]}, nodeid=0)
        self.h.respond(msg, {"asked": msg.payload["id"], "got": got["id"]})
'''


async def test_an_answer_to_a_removed_module_does_not_reach_its_next_load(
        start_instance, connect, tmp_path: Path) -> None:
    """A module's route hop is its name, the same for every load: an
    answer to a request the removed module made, still on its way when
    the module was loaded again, was taken by the new one as the answer
    to its own request with the same matchtag ("asked NEW, got OLD").
    It is dropped: the new load numbers its requests on from the old."""
    inst = await start_instance(size=2)
    (tmp_path / "parker.py").write_text(PARKER)
    (tmp_path / "asker.py").write_text(ASKER)
    h = await connect(inst)
    await h.rpc("module.load", {"name": str(tmp_path / "parker.py")}, nodeid=0)
    await h.rpc("module.load", {"name": str(tmp_path / "asker.py")}, nodeid=1)

    async def parked(n: int) -> None:
        async def check() -> bool:
            return (await h.rpc("parker.count", {}, nodeid=0))["n"] == n
        await wait_until(check, f"{n} parked")

    old = asyncio.ensure_future(h.rpc("asker.go", {"id": "OLD"}, nodeid=1))
    await parked(1)
    await h.rpc("module.reload", {"name": str(tmp_path / "asker.py")}, nodeid=1)
    with pytest.raises(RemoteError, match="module asker was removed"):
        await asyncio.wait_for(old, T)
    new = asyncio.ensure_future(h.rpc("asker.go", {"id": "NEW"}, nodeid=1))
    await parked(2)
    await h.rpc("parker.release", {"id": "OLD"}, nodeid=0)
    await h.rpc("parker.release", {"id": "NEW"}, nodeid=0)
    assert await asyncio.wait_for(new, T) == {"asked": "NEW", "got": "NEW"}


async def test_a_service_named_twice_is_served_once(start_instance, connect,
                                                    tmp_path: Path) -> None:
    """``services = ("twice", "x", "x")`` failed the load with "service 'x'
    is already registered" (by itself); it is served once."""
    source = TESTMOD.replace("    attributes = (GREETING, FAIL)",
                             '    attributes = (GREETING, FAIL)\n'
                             '    services = ("testmod", "x", "x")')
    (tmp_path / "testmod.py").write_text(source)
    inst = await start_instance(size=1)
    await cli(inst.uri(0), "module", "load", str(tmp_path / "testmod.py"))
    out, _ = await cli(inst.uri(0), "module", "list", "--json")
    [mine] = [m for m in json.loads(out)["modules"] if m["name"] == "testmod"]
    assert mine["services"] == ["testmod", "x"]
