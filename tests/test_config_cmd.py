"""``kvbroker config get|reload`` (Flux's ``flux config``, t2806) against real
ranks started with ``kvbroker start --config FILE``.  docs/cli.md "config".

Flux's configuration is free-form tables its modules read; kvbroker's is its
attributes, so a file holds ``[attrs]`` (and, for ``kvbroker broker``,
``[bootstrap]``), and a reload sets the attributes that changed -- those a
running rank may change.  ``config load|set|unset|builtin`` are in
tests/test_flux_conformance_t2806.py and t0041.
"""

from __future__ import annotations

import asyncio
import errno
import json
from pathlib import Path

import pytest
from test_broker_guests import run_guest_cli
from test_broker_support import run_cli
from test_watch_helpers import errnum

from broker.errors import RemoteError
from broker.handle import Handle
from broker.launch import Instance

T = 30.0
FILE = """\
[attrs]
log.ring-level = "info"
"tbon.torpid_min" = "5s"
kvs.checkpoint-period = "2s"
access.allow-guest-user = true
"""


@pytest.fixture
async def configured(tmp_path: Path):
    path = tmp_path / "inst.toml"
    path.write_text(FILE)
    inst = Instance(2, 2, config_file=str(path), stderr_path=str(tmp_path / "log"),
                    attrs={"log.ring-level": "info", "tbon.torpid_min": "5s",
                           "kvs.checkpoint-period": "2s", "access.allow-guest-user": "true"})
    await asyncio.wait_for(inst.start(), 60)
    try:
        yield inst, path
    finally:
        await inst.stop()


async def cli(uri: str, *args: str, rc: int = 0) -> str:
    code, out, err = await run_cli(*args, uri=uri)
    assert code == rc, (args, code, out, err)
    return out if rc == 0 else err


async def test_start_config_is_what_config_get_shows(tmp_path: Path) -> None:
    """``start --config``: every rank's ``config.path`` names the file and
    ``config get`` answers it: whole (JSON), one value by dotted name (a
    quoted dotted key or a table), typed, defaulted, or refused."""
    path = tmp_path / "inst.toml"
    path.write_text(FILE)
    script = tmp_path / "get.sh"
    script.write_text("""\
kvbroker attr get -r 1 config.path
kvbroker config get -r 1
kvbroker config get attrs.log.ring-level
kvbroker config get --type string attrs.tbon.torpid_min
kvbroker config get --type fsd-integer attrs.tbon.torpid_min
kvbroker config get --type fsd-real attrs.kvs.checkpoint-period
kvbroker config get --type boolean attrs.access.allow-guest-user
kvbroker config get --type object attrs.kvs
kvbroker config get --default 7 attrs.nosuch
kvbroker config get --type integer attrs.tbon.torpid_min || echo "rc=$?"
kvbroker config get attrs.nosuch || echo "rc=$?"
""")
    code, out, err = await run_cli("start", "--size", "2", "--config", str(path), "--",
                                   "sh", str(script), timeout=T)
    assert code == 0, (out, err)
    lines = out.splitlines()
    assert lines[0] == str(path)
    assert json.loads(lines[1])["attrs"]["tbon.torpid_min"] == "5s"
    assert lines[2:10] == ["info", "5s", "5", "2.0", "true", '{"checkpoint-period":"2s"}',
                           "7", "rc=1"], lines
    assert lines[10] == "rc=1", lines
    assert "attrs.tbon.torpid_min does not have the requested type (integer)" in err, err
    assert "attrs.nosuch is not set in the configuration" in err, err


async def test_reload_sets_what_changed_on_the_ranks_asked(configured) -> None:
    inst, path = configured
    path.write_text(FILE.replace('"5s"', '"3s"').replace('"info"', '"debug"'))
    await cli(inst.uri(0), "config", "reload", "-r", "all")
    for rank in (0, 1):
        assert await cli(inst.uri(rank), "attr", "get", "tbon.torpid_min") == "3s\n"
        assert await cli(inst.uri(rank), "attr", "get", "log.ring-level") == "debug\n"
    assert '"3s"' in await cli(inst.uri(1), "config", "get", "attrs")
    # a value taken out goes back to its default; a module's runtime one applies
    path.write_text(FILE.replace('kvs.checkpoint-period = "2s"\n', ""))
    await cli(inst.uri(0), "config", "reload")
    assert await cli(inst.uri(0), "attr", "get", "kvs.checkpoint-period") == "1s\n"
    assert await cli(inst.uri(0), "attr", "get", "tbon.torpid_min") == "5s\n"
    assert await cli(inst.uri(1), "attr", "get", "tbon.torpid_min") == "3s\n"  # (not asked)
    log = await cli(inst.uri(0), "dmesg")
    assert "config reloaded from" in log and "kvs.checkpoint-period=1s" in log, log


async def test_a_reload_that_cannot_apply_changes_nothing(configured) -> None:
    """A change a running rank may not make (``fanout``), a bad value, a
    file that is not TOML: the reload is refused naming the file and the
    entry, and nothing of it is applied -- the runtime change beside it
    neither; the torpid pair is checked together (min and max moved past
    each other at once is a valid change)."""
    inst, path = configured
    path.write_text(FILE.replace('"5s"', '"4s"') + "fanout = 3\n")
    err = await cli(inst.uri(0), "config", "reload", rc=1)
    assert f"{path}: [attrs]" in err and "fanout" in err, err
    assert await cli(inst.uri(0), "attr", "get", "tbon.torpid_min") == "5s\n"
    path.write_text(FILE.replace('"5s"', '"soon"'))
    err = await cli(inst.uri(0), "config", "reload", rc=1)
    assert "Invalid argument" in err and "tbon.torpid_min" in err, err
    path.write_text("[attrs\n")
    err = await cli(inst.uri(0), "config", "reload", rc=1)
    assert str(path) in err, err
    assert await cli(inst.uri(0), "attr", "get", "tbon.torpid_min") == "5s\n"
    path.write_text(FILE.replace('"5s"', '"40s"') + 'tbon.torpid_max = "100s"\n')
    await cli(inst.uri(0), "config", "reload")
    assert await cli(inst.uri(0), "attr", "get", "tbon.torpid_min") == "40s\n"
    # a fixed attribute written at the value in force is no change: not refused
    # (it was: "log.ring-size may not be changed on a running rank")
    path.write_text(path.read_text() + 'log.ring-size = 1024\n"content.cache-bytes" = 67108864\n')
    await cli(inst.uri(0), "config", "reload")


async def test_guests_read_the_owner_reloads(configured) -> None:
    inst, _ = configured
    rc, out, err = await run_guest_cli(inst.uri(0), "config", "get", "attrs.log.ring-level")
    assert (rc, out) == (0, "info\n"), (rc, out, err)
    rc, out, err = await run_guest_cli(inst.uri(0), "config", "reload")
    assert rc == 1 and "config reload is for the instance owner" in err, err


async def test_without_a_file(start_instance) -> None:
    inst = await start_instance(size=1)
    assert await cli(inst.uri(0), "config", "get") == "{}\n"
    assert await cli(inst.uri(0), "attr", "get", "config.path") == "\n"
    err = await cli(inst.uri(0), "config", "reload", rc=1)
    assert "started without a configuration file" in err, err
    rc, out, err = await run_cli("start", "-S", "config.path=x", "--", "true")
    assert rc == 2 and "--config FILE" in err, err


async def test_a_bootstrap_files_config(tmp_path: Path) -> None:
    """``kvbroker broker --config FILE``: ``config get`` shows ``[bootstrap]``
    too, and a reload of its ``[attrs]`` applies."""
    config = tmp_path / "inst.toml"
    config.write_text('[bootstrap]\n[attrs]\nlog.ring-level = "info"\n')
    script = tmp_path / "run.sh"
    script.write_text(f"""\
kvbroker attr get config.path
kvbroker config get bootstrap
printf '[bootstrap]\\n[attrs]\\nlog.ring-level = "debug"\\n' > {config}
kvbroker config reload && kvbroker attr get log.ring-level
printf '[bootstrap]\nfanout = 3\n[attrs]\nlog.ring-level = "error"\n' > {config}
kvbroker config reload || echo "rc=$?"
kvbroker attr get log.ring-level; kvbroker config get bootstrap
""")
    rc, out, err = await run_cli("broker", "--config", str(config), "-S", "hostname=solo",
                                 "--", "sh", str(script), timeout=T)
    # the shape is the start's: a changed [bootstrap] refuses the whole reload
    # (it was taken, and config get showed a fanout the ranks did not run with)
    assert (rc, out) == (0, f"{config}\n{{}}\ndebug\nrc=1\ndebug\n{{}}\n"), (rc, out, err)
    assert "[bootstrap] may not be changed on a running rank" in err, err


async def test_what_get_prints_loads_back(tmp_path: Path) -> None:
    """``config get`` then ``config load`` of it changes nothing, on a
    bootstrap rank (its ``[bootstrap]`` given back unchanged) and on a
    ``start --config`` rank whose relative ``statedir`` the file's
    directory completes (as the start did).  A changed or missing
    ``[bootstrap]`` is refused: a running instance keeps its shape."""
    config = tmp_path / "inst.toml"
    config.write_text('[bootstrap]\n[attrs]\nlog.ring-level = "info"\n')
    script = tmp_path / "run.sh"
    script.write_text(f"""\
kvbroker config get > {tmp_path}/got.json && kvbroker config load {tmp_path}/got.json && echo same
kvbroker config load < /dev/null || echo "rc=$?"
printf '[bootstrap]\\nfanout = 3\\n' | kvbroker config load || echo "rc=$?"
""")
    rc, out, err = await run_cli("broker", "--config", str(config), "-S", "hostname=solo",
                                 "--", "sh", str(script), timeout=T)
    assert (rc, out) == (0, "same\nrc=1\nrc=1\n"), (rc, out, err)
    assert err.count("[bootstrap] may not be changed on a running rank") == 2, err
    config.write_text('[attrs]\nstatedir = "state"\n')
    script.write_text(f"""\
kvbroker config get > {tmp_path}/got.json && kvbroker config load {tmp_path}/got.json && echo same
kvbroker attr get statedir
""")
    rc, out, err = await run_cli("start", "--config", str(config), "--", "sh", str(script),
                                 timeout=T)
    assert (rc, out) == (0, f"same\n{tmp_path}/state\n"), (rc, out, err)


async def test_an_integer_a_request_cannot_carry_is_refused(configured) -> None:
    """``config load`` and ``set`` of an integer past 64 bits (JSON and
    TOML read any size; a request carries msgpack's) ended in a traceback
    from the request's encoding, and one of more digits than Python reads
    in a bare ``ValueError``: each is refused naming where it is, exit 1,
    nothing asked.  ``get -c`` only reads the file: it prints it."""
    inst, path = configured
    big = "99999999999999999999999"
    for args, stdin, where in (
            (("load",), f'{{"attrs": {{"log": {{"level": {big}}}}}}}', "standard input: "
             "attrs.log.level"),
            (("load",), f"[attrs]\nx = [1, {big}]\n", "standard input: attrs.x[1]"),
            (("set", "--type", "integer", "attrs.tbon.torpid_min", big), "",
             "attrs.tbon.torpid_min"),
            (("set", "--type", "array", "attrs.x", f"[{big}]"), "", "attrs.x[0]")):
        code, out, err = await run_cli("config", *args, uri=inst.uri(0), input=stdin.encode())
        assert (code, out) == (1, ""), (args, code, out, err)
        assert err == f"kvbroker: config {args[0]}: {where}: {big} is out of range (a 64-bit " \
                      "integer)\n", err
    for stdin in (f'{{"attrs": {{"x": {"9" * 5000}}}}}', f"[attrs]\nx = {'9' * 5000}\n"):
        code, out, err = await run_cli("config", "load", uri=inst.uri(0), input=stdin.encode())
        assert (code, out) == (1, ""), (code, out, err)
        assert err.startswith("kvbroker: config load: standard input: Exceeds the limit"), err
    assert await cli(inst.uri(0), "attr", "get", "tbon.torpid_min") == "5s\n"
    path.write_text(f"[attrs]\nx = {big}\n")
    assert await cli(inst.uri(0), "config", "get", "-c", str(path), "attrs.x") == f"{big}\n"


async def test_a_real_json_cannot_carry_is_refused(configured, tmp_path: Path) -> None:
    """TOML's ``nan`` and ``inf`` (and Python's ``NaN`` in JSON) are no
    JSON numbers: ``config get -c`` printed ``NaN``, which no JSON reader
    takes, and ``load`` sent it to the ranks.  Each is refused naming the
    value, exit 1; ``start --config`` of such a file is a usage error."""
    inst, path = configured
    for text, shown in (("[attrs]\nx = nan\n", "nan"), ("[attrs]\nx = [1.0, -inf]\n", "-inf"),
                        ('{"attrs": {"x": NaN}}', "NaN"), ('{"attrs": {"x": [-1e400]}}', "-1e400"),
                        ("[attrs]\nx = 1e999\n", "1e999")):
        path.write_text(text)
        for args, stdin in ((("get", "-c", str(path)), ""), (("load",), text)):
            code, out, err = await run_cli("config", *args, uri=inst.uri(0),
                                           input=stdin.encode())
            assert (code, out) == (1, ""), (args, code, out, err)
            assert f": {shown}: not a finite number (JSON has no nan or infinity)" in err, err
    infinite = tmp_path / "infinite.toml"
    infinite.write_text("[attrs]\nx = inf\n")
    code, out, err = await run_cli("start", "--config", str(infinite), "--", "true")
    assert code == 2 and "inf: not a finite number" in err, (code, out, err)
    code, out, err = await run_cli("config", "set", "--type", "array", "attrs.x", "[NaN]",
                                   uri=inst.uri(0))
    assert (code, out) == (1, "") and "NaN: not a finite number" in err, (code, out, err)
    infinite.write_text("[attrs]\nx = 1.5e3\n")
    assert await cli(inst.uri(0), "config", "get", "-c", str(infinite), "attrs.x") == "1500.0\n"


async def test_a_load_keyed_by_other_than_strings_is_a_protocol_error(configured,
                                                                       connect) -> None:
    """``config.load`` of a map keyed by a number or nil (msgpack's maps
    may be; JSON's and TOML's may not) failed inside the rank's checks,
    ``EIO`` "internal error"; it is ``EPROTO``, and nothing is changed."""
    inst, _ = configured
    h = await connect(inst)
    for config in ({1: 2}, {None: 1, "attrs": {}}, {"attrs": {"log": {1: "x"}}},
                   {"attrs": {"log.ring-level": "debug"}, 1.5: {}}):
        assert await errnum(h.rpc("config.load", {"config": config})) == errno.EPROTO, config
    assert await cli(inst.uri(0), "attr", "get", "log.ring-level") == "info\n"


async def test_taking_out_an_attribute_without_a_default_names_the_object(
        tmp_path: Path) -> None:
    """An attribute of the rank's own naming (``foo.a``, given at start)
    has no default to go back to: ``unset`` and a ``load`` without it are
    refused naming the loaded object -- they said "taken out of the file",
    with no file involved -- and a reload names the file, as its other
    refusals do (it named none); each ``EINVAL``, a bad configuration (it
    was ``ENOENT``, "No such file or directory", attr set's errno)."""
    config = tmp_path / "inst.toml"
    config.write_text("[attrs]\nfoo.a = 1\n")
    script = tmp_path / "run.sh"
    script.write_text(f"""\
kvbroker config unset attrs.foo.a
echo '{{}}' | kvbroker config load
: > {config} && kvbroker config reload
printf '[attrs]\nfoo.a = 1\nno.such = 2\n' | kvbroker config load
kvbroker config get
""")
    rc, out, err = await run_cli("start", "--config", str(config), "--", "sh", str(script),
                                 timeout=T)
    assert (rc, out) == (0, '{"attrs":{"foo":{"a":1}}}\n'), (rc, out, err)
    taken = "[attrs] foo.a was taken out: it has no default to go back to)\n"
    assert err.splitlines(keepends=True) == [
        f"kvbroker: config unset: Invalid argument (the loaded object: {taken}",
        f"kvbroker: config load: Invalid argument (the loaded object: {taken}",
        f"kvbroker: config reload: Invalid argument ({config}: {taken}",
        "kvbroker: config load: Invalid argument (the loaded object: [attrs] unknown "
        "attribute 'no.such')\n"], err


async def test_set_checks_a_typed_value_before_asking(tmp_path: Path) -> None:
    """``config set --type T NAME VALUE``: a VALUE that is not a T is the
    error, before anything is asked (docs/cli.md) -- it was parsed only
    after each rank's object came back, so with no broker there the error
    was the connect's, and a stopped rank held a bad value's command to
    its ``-t``."""
    uri = f"local://{tmp_path}/nothing-here"
    for args, said in ((("integer", "hello"), "'hello' is not an integer"),
                       (("fsd", "soon"), "'soon' is not a duration"),
                       (("integer", "1" * 30), "is out of range (a 64-bit integer)")):
        code, out, err = await run_cli("config", "set", "--type", args[0], "attrs.x", args[1],
                                       uri=uri)
        assert (code, out) == (1, "") and said in err, (args, code, out, err)


async def test_get_quiet(configured) -> None:
    """Flux's ``config get -q``: a NAME not set exits 1 saying nothing (a
    script's test); one that is set prints, and ``-d`` still wins.  It
    was a usage error, exit 2."""
    inst, path = configured
    for args, want in ((("-q", "attrs.nosuch"), (1, "", "")),
                       (("--quiet", "-d", "x", "attrs.nosuch"), (0, "x\n", "")),
                       (("-q", "attrs.log.ring-level"), (0, "info\n", "")),
                       (("-q", "-c", str(path), "attrs.nosuch"), (1, "", ""))):
        assert await run_cli("config", "get", *args, uri=inst.uri(0)) == want, args


async def test_an_instance_from_a_config_file_takes_its_attrs(tmp_path: Path) -> None:
    """``Instance(config_file=FILE)`` gives the ranks the file's ``[attrs]``,
    as ``start --config FILE`` does (only ``config.path`` was set: the
    ranks kept their defaults, and took the file's values as in force, so
    a ``config reload`` changed nothing either); ``attrs`` win over it, and
    a bad value is refused as the instance is made, naming the file."""
    path = tmp_path / "inst.toml"
    path.write_text('[attrs]\nlog.ring-level = "debug"\nkvs.checkpoint-period = "2s"\n'
                    '"broker.recovery-mode" = 1\n')
    inst = Instance(2, 2, config_file=str(path), stderr_path=str(tmp_path / "log"),
                    attrs={"kvs.checkpoint-period": "3s"})
    await asyncio.wait_for(inst.start(), 60)
    try:
        for rank in (0, 1):
            assert await cli(inst.uri(rank), "attr", "get", "log.ring-level") == "debug\n"
            # (start's --recovery, not a rank's attribute: not taken from the file)
            assert await cli(inst.uri(rank), "attr", "get", "broker.recovery-mode") == "0\n"
        assert await cli(inst.uri(0), "attr", "get", "kvs.checkpoint-period") == "3s\n"
    finally:
        await inst.stop()
    path.write_text('[attrs]\nlog.ring-level = "loud"\n')
    with pytest.raises(ValueError, match=f"{path}: \\[attrs\\] log.ring-level"):
        Instance(1, config_file=str(path))


async def test_a_removed_modules_attribute_taken_out_goes_back_to_its_default(
        configured) -> None:
    """``kvs.checkpoint-period`` taken out of the file on a rank whose kvs
    was removed: the reload was refused whole, "it has no default to go
    back to" (the defaults came from the loaded modules only), the other
    changes with it.  It goes back to its default, kept for the module's
    next load, and the rest applies."""
    inst, path = configured
    await cli(inst.uri(0), "module", "remove", "-r", "1", "kvs-watch")
    await cli(inst.uri(0), "module", "remove", "-r", "1", "kvs")
    path.write_text(FILE.replace('kvs.checkpoint-period = "2s"\n', "")
                    .replace('"info"', '"debug"'))
    await cli(inst.uri(0), "config", "reload", "-r", "1")
    assert await cli(inst.uri(1), "attr", "get", "log.ring-level") == "debug\n"
    await cli(inst.uri(0), "module", "load", "-r", "1", "kvs")
    assert await cli(inst.uri(1), "attr", "get", "kvs.checkpoint-period") == "1s\n"


async def test_a_load_refuses_what_a_start_refuses(start_instance) -> None:
    """``config load`` of ``rank`` or ``hostlist`` (set by each rank itself,
    refused in a ``start --config`` file) was let in as "no change", and
    then no load, reload or unset could take it out again ("no default to
    go back to"): refused ``EINVAL``, as the file would be."""
    inst = await start_instance(size=1)
    h = await Handle.connect(inst.uri(0))
    try:
        for attrs in ({"rank": 0}, {"hostlist": "vm"}):
            with pytest.raises(RemoteError) as info:
                await asyncio.wait_for(h.rpc("config.load", {"config": {"attrs": attrs}}), T)
            assert info.value.errnum == errno.EINVAL, info.value
            assert "cannot be set" in info.value.errstr, info.value
        await asyncio.wait_for(h.rpc("config.load", {"config": {}}), T)  # (nothing stuck)
    finally:
        await h.close()


async def test_a_load_runs_no_module_file(tmp_path: Path) -> None:
    """A reload or load ran the module files its ``broker.modules`` names
    again, in the running rank (to check their attributes; each left a
    module behind), and an attribute named like a path was run as a module
    file (to find its defaults): neither is imported now."""
    marker = tmp_path / "ran"
    (tmp_path / "mod.py").write_text(TESTMOD_MARKING.format(marker=str(marker)))
    config = tmp_path / "inst.toml"
    config.write_text(f'[attrs]\n"broker.modules" = "content,kvs,{tmp_path}/mod.py"\n')
    evil = tmp_path / "evil"
    evil.with_suffix(".py").write_text(f"open({str(marker)!r}, 'a').write('evil\\n')\n")
    script = tmp_path / "run.sh"
    before = tmp_path / "before"
    script.write_text(f"""\
cp {marker} {before}
kvbroker config reload
kvbroker config reload
printf '[attrs]\\n"{evil}" = 1\\n' | kvbroker config load
exit 0
""")
    rc, out, err = await run_cli("start", "--config", str(config), "--", "sh", str(script),
                                 timeout=T)
    assert rc == 0, (rc, out, err)
    assert "unknown attribute" in err, err
    assert before.read_text().startswith("mod\n")  # (loaded and checked as the rank started)
    assert marker.read_text() == before.read_text()


TESTMOD_MARKING = """\
from typing import ClassVar

from broker.module import Module

open({marker!r}, "a").write("mod\\n")


class Marking(Module):
    name: ClassVar[str] = "marking"

    def handlers(self):
        return {{}}
"""
