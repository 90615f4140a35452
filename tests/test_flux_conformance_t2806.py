"""flux-core t/t2806-config-cmd.t (``flux config get|set|unset|load|reload|
builtin``) against real kvbroker ranks; every ``flux config`` is the real
``kvbroker config`` command run as a process.  docs/cli.md "config".

Flux's instance starts with ``--config-path=DIR`` holding one file of
free-form tables (``[foo] a = 42 ...``).  kvbroker's configuration is its
attributes: a rank's one file (``start --config FILE``, never a directory)
holds ``[attrs]`` (and a bootstrap file ``[bootstrap]``), and a load,
reload or set applies the ``[attrs]`` that changed, refusing an object
that holds any other table.  So here:

* the ``get`` cases run twice: on a rank started from Flux's tables moved
  under ``[attrs]`` (``attrs.foo.a``; unknown attribute names are kept,
  unchecked), and on Flux's file itself through ``get --config-path FILE``
  (read by the command, any TOML).  The array ``foo.f`` is only in the
  second: ``[attrs]`` takes no arrays.
* the ``reload``/``load``/``set``/``unset`` cases run on a second rank
  whose file holds attributes a running rank may change (``log.ring-level``,
  the torpid pair, ``kvs.checkpoint-period``): Flux's ``test.y.z``,
  ``bar`` and ``a.b.*`` become those.  ``foo.*`` could not be reloaded
  away: an attribute without a default may not be taken out.

Flux case -> here:

1.  no args fails "missing subcommand" -> exit 2 with that, and the usage.
2.  ``get --help`` "query broker configuration values" -> exit 0, the
    description "Query a rank's configuration values".
3.-16. dumps the object, a table, an integer (untyped, ``--type=integer``),
    ``string``, ``fsd``, ``fsd-integer`` (50), ``fsd-real`` (50.0),
    ``fsd`` of a non-duration fails, ``real``, ``boolean``, ``array``,
    ``object``, a subtable's value -> :func:`test_get`, both sources
    (``array`` from the file only).  Flux's boolean case compares the
    ``real`` files by mistake; the value is checked here.
17.-21. wrong ``--type`` fails "does not have the requested type",
    unknown ``--type`` "Unknown type: oops" (exit 2 here: a usage error),
    ``--default`` on a set / missing key, a missing key "is not set" ->
    the same test.
22.-23. reload after ``rm config/config.toml`` (an empty directory) ->
    DIFFERENCE: the file emptied (the empty directory's equivalent) and
    reloaded gives ``{}``, the attributes it held back at their defaults;
    a removed file fails the reload naming it, and nothing changes (a
    file missing midway through a rewrite resets nothing)
    (:func:`test_reload_and_load`).
24.-29. load TOML on stdin, empty stdin (-> ``{}``), JSON on stdin (the
    object ``get`` printed) -> the same test, with ``attrs.log.ring-level``
    for ``test.y.z``; Flux's ``test.y.z = 42`` itself is refused naming
    ``test`` (DIFFERENCE: not a table a rank's configuration holds).
30.-31. load a ``conf.d`` directory -> DIFFERENCE: refused, "is a
    directory"; the file in it loads.
32.-33. load of bad TOML (a file, stdin) fails -> it does, naming where.
34.-39. ``builtin``: requires a key (exit 2), an unknown key fails naming
    it, a known key works (``python_path``: kvbroker has no ``confdir``);
    ``--intree``/``--installed`` -> not applicable (no source-tree
    heuristic), refused as unknown options (:func:`test_builtin`; the RPC
    itself: t0041).
40.-43. as a guest: get works, load and reload fail, builtin works ->
    :func:`test_guests` (``Operation not permitted``).
44.-50. ``get --config-path`` a directory -> DIFFERENCE: refused, "is a
    directory"; a file works; a wrong path and an invalid file fail;
    ``system``/``security``/``imp`` -> not applicable (no system
    configuration): a file of that name, missing, fails
    (:func:`test_get_config_path`).
51.-70. ``set``: no broker fails, a value is required (exit 2), a type is
    required for a new name, ``fsd-integer``/``fsd-real`` refused, typed
    and type-reusing sets, bad ``real``/``integer``/``string``/``fsd``/
    ``array``/``object`` values refused before anything is asked, set by
    path (string, integer, real, object, fsd) -> :func:`test_set_unset`.
    DIFFERENCE: a boolean or an array by path is refused by the rank --
    no attribute a running rank may change is a boolean, ``[attrs]``
    takes no arrays.  A boolean VALUE is ``true``/``false``/``1``/``0``
    (Flux takes any word, false if it starts ``0``/``f``/``F``).
71.-74. ``unset``: no broker fails, a key is required, an unknown key is
    no error, unset works -> the same test.
75.-79. (Flux issue 7264) a failed set leaves nothing behind -> the same
    test, with the heartbeat module loaded, on ``heartbeat.period``.
80.-81. load / reload fail on a follower -> DIFFERENCE: each rank has its
    own configuration (kvbroker ranks need not share a file): they work
    on rank 1, for rank 1 alone (:func:`test_each_rank_its_own`).
82. set on the leader reaches every TBON level -> DIFFERENCE, the same
    test: ``set -r all`` sets it on every rank (4, fanout 2); without
    ``-r`` only the rank attached to.
83. ``reload --follower-noop`` -> not applicable (a follower's reload
    reads its own file): refused as an unknown option, exit 2.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from test_broker_guests import run_guest_cli
from test_broker_support import run_cli

from broker import bootstrap
from broker import config as bconfig
from broker.launch import Instance

T = 30.0
FLUX_TOML = """\
[foo]
a = 42
b = "meep"
c = "50s"
d = 3.14
e = false
f = [ "fubar", "barfu" ]
[foo.bar]
a = true
"""
ATTRS_TOML = """\
[attrs]
foo.a = 42
foo.b = "meep"
foo.c = "50s"
foo.d = 3.14
foo.e = false
foo.bar.a = true
"""
"""Flux's tables under ``[attrs]`` (without the array)."""
CHANGING = """\
[attrs]
log.ring-level = "warning"
"tbon.torpid_min" = "5s"
"""
"""Attributes a running rank may change (guests are let in by ``-S``: an
attribute fixed at start could not be loaded or reloaded out of the file)."""


async def start(tmp_path: Path, text: str, size: int = 1, fanout: int = 2,
                name: str = "inst.toml") -> tuple[Instance, Path]:
    """A ``size``-rank instance started from a file holding ``text``, as
    ``start --config FILE -S access.allow-guest-user=true`` starts one:
    its attributes from the file."""
    path = tmp_path / name
    path.write_text(text)
    attrs = {k: bconfig.text(v) for k, v in bootstrap.load_attrs(str(path)).items()}
    attrs["access.allow-guest-user"] = "true"
    inst = Instance(size, fanout, config_file=str(path), attrs=attrs,
                    stderr_path=str(tmp_path / f"{name}.log"))
    await asyncio.wait_for(inst.start(), 60)
    return inst, path


@pytest.fixture
async def flux_like(tmp_path: Path):
    inst, path = await start(tmp_path, ATTRS_TOML)
    try:
        yield inst
    finally:
        await inst.stop()


@pytest.fixture
async def changing(tmp_path: Path):
    inst, path = await start(tmp_path, CHANGING)
    try:
        yield inst, path
    finally:
        await inst.stop()


async def cli(uri: str, *args: str, rc: int = 0, input: bytes | None = None) -> str:
    code, out, err = await run_cli(*args, uri=uri, input=input, timeout=T)
    assert code == rc, (args, code, out, err)
    return out if rc == 0 else err


async def test_usage() -> None:
    """Flux 1-2, and 34, 37-39, 52, 72, 83's usage errors (no rank asked)."""
    runs = await asyncio.gather(
        run_cli("config"), run_cli("config", "get", "--help"),
        run_cli("config", "builtin"), run_cli("config", "builtin", "--intree", "python"),
        run_cli("config", "builtin", "--installed", "python"),
        run_cli("config", "set", "--type=string", "attrs.foo"),
        run_cli("config", "unset"), run_cli("config", "reload", "--follower-noop"))
    rc, out, err = runs[0]
    assert rc == 2 and "missing subcommand" in err and "usage: kvbroker config" in err, err
    rc, out, err = runs[1]
    assert rc == 0 and "query a rank's configuration values" in out.lower(), out
    assert [r[0] for r in runs[2:]] == [2] * 6, runs[2:]
    assert "required: KEY" in runs[2][2] and "required: VALUE" in runs[5][2], runs
    assert "unrecognized arguments: --intree" in runs[3][2], runs[3]
    assert "unrecognized arguments: --follower-noop" in runs[7][2], runs[7]


async def test_get(flux_like: Instance, tmp_path: Path) -> None:
    """Flux 3-21, on the rank (``attrs.foo``) and on Flux's own file
    (``--config-path``)."""
    flux_file = tmp_path / "config.toml"
    flux_file.write_text(FLUX_TOML)
    sources = {"attrs.foo": (), "foo": ("--config-path", str(flux_file))}
    for foo, via in sources.items():
        async def get(*args: str, rc: int = 0) -> str:
            return await cli(flux_like.uri(0), "config", "get", *via, *args, rc=rc)  # noqa: B023

        whole, table, *values = await asyncio.gather(
            get(), get(foo), get(f"{foo}.a"), get("--type=integer", f"{foo}.a"),
            get("--type=string", f"{foo}.b"), get("--type=fsd", f"{foo}.c"),
            get("--type=fsd-integer", f"{foo}.c"), get("--type=fsd-real", f"{foo}.c"),
            get("--type=real", f"{foo}.d"), get("--type=boolean", f"{foo}.e"),
            get("--type=object", f"{foo}.bar"), get("--type=boolean", f"{foo}.bar.a"),
            get("--default=2", f"{foo}.a"), get("--default=42", "nokey"))
        doc = json.loads(whole)
        assert (doc["attrs"]["foo"] if via == () else doc["foo"])["a"] == 42
        assert json.loads(table)["a"] == 42
        assert values == ["42\n", "42\n", "meep\n", "50s\n", "50\n", "50.0\n", "3.14\n",
                          "false\n", '{"a":true}\n', "true\n", "42\n", "42\n"], (foo, values)
        errs = await asyncio.gather(
            get("--type=fsd", f"{foo}.b", rc=1), get("--type=string", f"{foo}.a", rc=1),
            get("--type=oops", f"{foo}.a", rc=2), get("nokey", rc=1))
        assert "does not have the requested type" in errs[0], errs
        assert "does not have the requested type" in errs[1], errs
        assert "Unknown type: oops" in errs[2], errs
        assert "nokey is not set" in errs[3], errs
    assert await cli(flux_like.uri(0), "config", "get", "-c", str(flux_file),
                     "--type=array", "foo.f") == '["fubar","barfu"]\n'


async def test_reload_and_load(changing: tuple[Instance, Path], tmp_path: Path) -> None:
    """Flux 22-33."""
    inst, path = changing
    uri = inst.uri(0)
    path.unlink()
    err = await cli(uri, "config", "reload", rc=1)
    assert str(path) in err and "No such file" in err, err
    assert await cli(uri, "attr", "get", "tbon.torpid_min") == "5s\n"
    path.write_text("")
    await cli(uri, "config", "reload")
    assert await cli(uri, "config", "get") == "{}\n"
    assert await cli(uri, "attr", "get", "log.ring-level") == "info\n"  # (its default)
    await cli(uri, "config", "load", input=b'attrs.log.ring-level = "debug"\n')
    loaded = await cli(uri, "config", "get")
    assert json.loads(loaded) == {"attrs": {"log": {"ring-level": "debug"}}}
    assert await cli(uri, "attr", "get", "log.ring-level") == "debug\n"
    err = await cli(uri, "config", "load", input=b"test.y.z=42\n", rc=1)
    assert "unknown table(s) or key(s): test" in err, err
    await cli(uri, "config", "load")  # (standard input: /dev/null)
    assert await cli(uri, "config", "get") == "{}\n"
    await cli(uri, "config", "load", input=loaded.encode())
    assert await cli(uri, "config", "get") == loaded
    conf_d = tmp_path / "conf.d"
    conf_d.mkdir()
    (conf_d / "test.toml").write_text('"tbon.torpid_min" = "7s"\n[attrs]\n')
    err = await cli(uri, "config", "load", str(conf_d), rc=1)
    assert "is a directory" in err, err
    err = await cli(uri, "config", "load", str(conf_d / "test.toml"), rc=1)
    assert "unknown table(s) or key(s): tbon.torpid_min" in err, err
    (conf_d / "test.toml").write_text('[attrs]\n"tbon.torpid_min" = "7s"\n')
    await cli(uri, "config", "load", str(conf_d / "test.toml"))
    assert json.loads(await cli(uri, "config", "get")) == {"attrs": {"tbon.torpid_min": "7s"}}
    assert await cli(uri, "attr", "get", "tbon.torpid_min") == "7s\n"
    (conf_d / "test.toml").write_text("this is not toml\n")
    err = await cli(uri, "config", "load", str(conf_d / "test.toml"), rc=1)
    assert "test.toml: not JSON, nor TOML" in err, err
    err = await cli(uri, "config", "load", input=b"[whoops\n", rc=1)
    assert "standard input: not JSON, nor TOML" in err, err
    assert await cli(uri, "attr", "get", "tbon.torpid_min") == "7s\n"
    # the file is not changed by a load: a reload reads it again
    path.write_text(CHANGING)
    await cli(uri, "config", "reload")
    assert await cli(uri, "attr", "get", "tbon.torpid_min") == "5s\n"


async def test_builtin(start_instance) -> None:
    """Flux 34-36 (the RPC's own cases: t0041)."""
    inst = await start_instance(size=1)
    python_path = await cli(inst.uri(0), "config", "builtin", "python_path")
    assert os.path.isfile(os.path.join(python_path.strip(), "broker", "config.py"))
    err = await cli(inst.uri(0), "config", "builtin", "unknown", rc=1)
    assert "unknown: invalid key" in err and "python_path" in err, err


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run as another uid")
async def test_guests(changing: tuple[Instance, Path]) -> None:
    """Flux 40-43."""
    inst, _ = changing
    rc, obj, err = await run_guest_cli(inst.uri(0), "config", "get")
    assert rc == 0 and json.loads(obj)["attrs"]["log"]["ring-level"] == "warning", err
    for args in (("load", "/dev/null"), ("reload",), ("set", "attrs.log.ring-level", "debug"),
                 ("unset", "attrs.log.ring-level")):
        # (a load's TOML parser and broker.config, with what it imports,
        # come when used: from the owner's Python library and checkout, which
        # a root-run guest may not read -- CI's clone is in a private tmp)
        rc, out, err = await run_guest_cli(inst.uri(0), "config", *args,
                                           preload="import tomllib, sysconfig, broker.config")
        assert rc == 1 and "Operation not permitted" in err, (args, err)
        assert "is for the instance owner" in err, err
    rc, out, err = await run_guest_cli(inst.uri(0), "config", "builtin", "python")
    assert rc == 0 and os.path.isfile(out.strip()), (out, err)
    assert await cli(inst.uri(0), "attr", "get", "log.ring-level") == "warning\n"


async def test_get_config_path(tmp_path: Path) -> None:
    """Flux 44-50 (no rank asked)."""
    alt = tmp_path / "altconfig"
    alt.mkdir()
    (alt / "foo.toml").write_text("flag = 99\n")
    (tmp_path / "foo.json").write_text('{"flag": 98}')
    (tmp_path / "badconf.toml").write_text("x x x\n")
    runs = await asyncio.gather(*(run_cli("config", "get", "--config-path", p, "flag")
                                  for p in (str(alt), str(alt / "foo.toml"),
                                            str(tmp_path / "foo.json"), "/not/a/file",
                                            str(tmp_path / "badconf.toml"), "system")))
    assert runs[0][0] == 1 and "is a directory" in runs[0][2], runs[0]
    assert runs[1][:2] == (0, "99\n") and runs[2][:2] == (0, "98\n"), runs
    assert runs[3][0] == 1 and "/not/a/file: No such file" in runs[3][2], runs[3]
    assert runs[4][0] == 1 and "badconf.toml: not JSON, nor TOML" in runs[4][2], runs[4]
    assert runs[5][0] == 1 and "system: No such file" in runs[5][2], runs[5]


async def test_set_unset(changing: tuple[Instance, Path]) -> None:
    """Flux 51-79."""
    inst, _ = changing
    uri = inst.uri(0)
    nope = {**os.environ, "KVBROKER_URI": "local:///nope"}
    for args in (("set", "--type=string", "z", "a"), ("unset", "a.b.fsd")):
        rc, out, err = await run_cli("config", *args, env=nope)
        assert rc == 1 and "cannot connect" in err, err
    err = await cli(uri, "config", "set", "attrs.bar", "42", rc=1)
    assert "attrs.bar is not set: give its --type" in err, err
    for kind in ("fsd-integer", "fsd-real"):
        err = await cli(uri, "config", "set", f"--type={kind}", "attrs.bar", "42", rc=2)
        assert f"--type {kind} is not a type a value is set as" in err, err
    for kind, bad in (("real", "hello"), ("integer", "hello"), ("string", '"hello'),
                      ("fsd", "hello"), ("array", "[1 2]"), ("object", "{foo}"),
                      ("boolean", "hello")):
        err = await cli(uri, "config", "set", f"--type={kind}", "attrs.foo", bad, rc=1)
        assert f"{bad!r} is not a" in err, (kind, err)
    # set works with a type, reuses the type there, and by path
    torpid = "attrs.tbon.torpid_min"
    await cli(uri, "config", "set", "--type=integer", torpid, "6")
    assert await cli(uri, "config", "get", "--type=integer", torpid) == "6\n"
    await cli(uri, "config", "set", torpid, "7")
    assert await cli(uri, "config", "get", "--type=integer", torpid) == "7\n"
    assert await cli(uri, "attr", "get", "tbon.torpid_min") == "7\n"
    await cli(uri, "config", "set", "--type=real", torpid, "6.5")
    assert await cli(uri, "config", "get", "--type=real", torpid) == "6.5\n"
    await cli(uri, "config", "set", "--type=string", "attrs.log.ring-level", "debug")
    assert await cli(uri, "config", "get", "--type=string", "attrs.log.ring-level") == "debug\n"
    await cli(uri, "config", "set", "--type=object", "attrs.kvs", '{"checkpoint-period":"3s"}')
    assert await cli(uri, "attr", "get", "kvs.checkpoint-period") == "3s\n"
    await cli(uri, "config", "set", "--type=object", "attrs.kvs", "{}")
    assert await cli(uri, "config", "get", "--type=object", "attrs.kvs") == "{}\n"
    await cli(uri, "config", "set", "--type=fsd", "attrs.tbon.torpid_max", "45m")
    assert await cli(uri, "config", "get", "--type=fsd-integer",
                     "attrs.tbon.torpid_max") == "2700\n"
    # a boolean and an array by path: no attribute takes them at runtime
    err = await cli(uri, "config", "set", "--type=boolean", "attrs.access.allow-guest-user",
                    "false", rc=1)
    assert "access.allow-guest-user may not be changed on a running rank" in err, err
    err = await cli(uri, "config", "set", "--type=array", "attrs.a.b.array", "[1,2,3]", rc=1)
    assert "a.b.array: an array is not an attribute value" in err, err
    # unset
    await cli(uri, "config", "unset", "attrs.not.a.key")
    await cli(uri, "config", "unset", "attrs.log.ring-level")
    err = await cli(uri, "config", "get", "--type=string", "attrs.log.ring-level", rc=1)
    assert "is not set" in err, err
    # (7264) a failed set leaves nothing behind
    await cli(uri, "config", "load")
    await cli(uri, "module", "load", "heartbeat")
    err = await cli(uri, "config", "set", "--type=string", "attrs.heartbeat.period", "42XYZ",
                    rc=1)
    assert "heartbeat.period" in err, err
    assert await cli(uri, "config", "get") == "{}\n"
    await cli(uri, "module", "remove", "heartbeat")


async def test_each_rank_its_own(tmp_path: Path) -> None:
    """Flux 80-82: load, reload and set on a follower are for that rank."""
    inst, path = await start(tmp_path, CHANGING, size=4, fanout=2)
    try:
        await cli(inst.uri(1), "config", "load", input=b"")
        assert await cli(inst.uri(1), "config", "get") == "{}\n"
        assert await cli(inst.uri(0), "config", "get", "attrs.log.ring-level") == "warning\n"
        path.write_text(CHANGING.replace('"warning"', '"debug"'))
        await cli(inst.uri(1), "config", "reload")
        assert await cli(inst.uri(1), "attr", "get", "log.ring-level") == "debug\n"
        assert await cli(inst.uri(0), "attr", "get", "log.ring-level") == "warning\n"
        await cli(inst.uri(0), "config", "set", "--type=string", "attrs.log.ring-level",
                  "error", "-r", "all")
        got = await asyncio.gather(*(cli(inst.uri(0), "config", "get", "-r", str(rank),
                                         "attrs.log.ring-level") for rank in (1, 3)))
        assert got == ["error\n", "error\n"], got
        await cli(inst.uri(0), "config", "set", "attrs.log.ring-level", "info")
        assert await cli(inst.uri(3), "config", "get", "attrs.log.ring-level") == "error\n"
    finally:
        await inst.stop()
