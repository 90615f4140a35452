"""flux-core t/t1102-cmddriver.t: the command driver -- ``flux`` itself
before it hands over to a subcommand: its URI (connector) handling, the
environment it gives the commands it runs, its own directory in ``PATH``,
extension commands, and what it says of a command it does not know.  Here
the driver is ``kvbroker``; every case runs it as a real process (and
``kvbroker start`` for an instance).  Conventions: docs/cli.md
("Conventions"), extension commands: docs/api.md ("Adding a CLI command").

Flux case -> here:

* baseline works (``flux getattr size``, size 4) -> ``kvbroker start -s 4
  -- kvbroker getattr size`` prints 4 (``getattr`` is the documented alias
  of ``attr get``).
* prepends to FLUX_MODULE_PATH / FLUX_CONNECTOR_PATH -> do not apply:
  modules and commands are found by entry point (``kvbroker.modules``,
  ``kvbroker.commands``), connectors are built in; there is no search path
  to prepend to.
* fails for an unknown connector scheme (``noexist://``), an unknown
  connector path (``local://noexist``), a DSO that is not a connector
  (``kvs://``) -> ``KVBROKER_URI`` of each: exit 1, one line naming the URI
  and why (an unsupported scheme; no socket there).  ``kvs://`` is simply
  an unsupported scheme here.
* the ``flux env`` builtin (prints/passes FLUX_CONNECTOR_PATH, FLUX_URI,
  PYTHONPATH, output usable by ``eval``), ``flux python`` prepends to
  PYTHONPATH, LUA_PATH ``;;`` clean-up, FLUX_*_PREPEND variables and their
  order -> do not apply (no ``env`` or ``python`` command, no path
  variables: kvbroker is an installed Python package).  What does apply,
  the environment the driver gives a command it runs, is checked instead:
  ``kvbroker start -- CMD`` adds ``KVBROKER_URI`` and ``KVBROKER_RANK``
  and changes nothing else -- in particular it does not set PYTHONPATH
  ("flux does not prepend to PYTHONPATH").
* the commented-out ``-P`` dedup cases -> not cases (commented out in Flux).
* cmddriver adds its own path to PATH (a bogus ``flux`` earlier in PATH;
  the command's ``command -v flux`` must be this flux) and inserts its
  path just before the other flux, not at the front -> ``/abs/kvbroker
  start -- sh -c 'command -v kvbroker'``: this kvbroker, its directory
  put just before the other's (first when PATH has none), as Flux's
  driver does for ``flux start`` (src/cmd/flux.c, setup_path).  Until
  2026-12-05 the command got PATH unchanged and ran whichever
  ``kvbroker`` PATH found first, or none (127): found by this file.
* cmddriver does not adjust PATH if unnecessary -> passes: a PATH that
  already finds this kvbroker first is given unchanged.
* finds ``flux-*`` and ``flux-*.py`` commands in PATH -> an installed
  distribution declaring a ``kvbroker.commands`` entry point adds a
  command (docs/api.md): it runs.  Extension failures, which Flux's exec of
  a ``flux-*`` file isolates to that command: one whose ``register``
  raises is left out with a line on stderr, the rest work (documented;
  passes).  One whose module raises as it is imported (anything) is left
  out with a line on stderr saying why, and ``kvbroker NAME`` fails
  saying why it cannot be loaded (until 2026-12-05 anything but an
  ImportError took every command down with a traceback, and an
  ImportError left the command "invalid choice", as if not installed:
  found by this file).
* typoed commands get suggestions; several equally similar ones are all
  output; at most 3; prefixes favoured; really bad typos get none; PATH
  extensions are suggested -> DIFFERENCE (not documented, not a defect of
  what is printed): an unknown command is a usage error, exit 2 (Flux: 1),
  whose message names the word and lists every command there is, the
  extensions included -- so no ranking of suggestions.  Checked: the word
  is named, the list holds the built-ins and the extensions, nothing on
  stdout.  "duplicate commands are not output" -> an extension declared by
  two installed distributions is listed once.
* (the brief's) no arguments, ``-h``, ``--version`` -> no arguments: the
  usage on stderr, exit 2 (Flux: 1; our usage-error status); ``-h`` the
  help on stdout, exit 0; ``--version`` ``kvbroker 0.1.0``, exit 0 (also
  in tests/test_flux_conformance_t0001.py).  Beside it: a ``--`` ending
  the driver's own options (``kvbroker -- getattr size``, as getopt takes
  ``flux -- getattr size``) is taken, and an abbreviated ``--event-loop``
  (``--event-l asyncio getattr size``) finds an alias behind it (until
  2026-12-05 "invalid choice: '--'" and "invalid choice: 'getattr'":
  found by this file).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, install_plugin, run_cli

HERE = os.path.realpath(KVBROKER)
SYSPATH = "/bin:/usr/bin"


def plugin_env(tmp_path: Path, entry_points: str, files: dict[str, str],
               name: str = "ext") -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = install_plugin(tmp_path / name, name, entry_points, files)
    return env


MYEXT = ("def register(sub):\n"
         "    p = sub.add_parser('myext', help='an extension')\n"
         "    p.set_defaults(func=lambda args: print('myext-ok') or 0)\n")


async def kvb_start(*cmd: str, env: dict[str, str] | None = None,
                    size: int = 1) -> tuple[int, str, str]:
    """``/abs/kvbroker start -s SIZE -- CMD...`` (env as given)."""
    e = dict(os.environ if env is None else env)
    e.pop("KVBROKER_URI", None)
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "start", "-s", str(size), "--", *cmd, env=e,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


# -- baseline, URIs ------------------------------------------------------------


async def test_baseline_getattr_size() -> None:
    rc, out, err = await kvb_start(KVBROKER, "getattr", "size", size=4)
    assert (rc, out, err) == (0, "4\n", "")


@pytest.mark.parametrize("uri,why", [
    ("noexist://", "unsupported broker URI scheme: 'noexist://'"),
    ("kvs://", "unsupported broker URI scheme: 'kvs://'"),
    ("local://noexist", "No such file or directory"),
])
async def test_a_uri_that_names_no_broker_fails(uri: str, why: str) -> None:
    rc, out, err = await run_cli("getattr", "size", uri=uri)
    assert (rc, out) == (1, "")
    assert err.startswith(f"kvbroker: getattr: cannot connect to broker at "
                          f"KVBROKER_URI={uri}: {why}"), err
    assert err.count("\n") == 1 and "Traceback" not in err


# -- the environment of the command it runs ---------------------------------------


async def test_start_adds_only_its_uri_and_rank_to_the_environment(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{os.path.dirname(KVBROKER)}:{env.get('PATH', SYSPATH)}"
    rc, out, err = await kvb_start("env", "-0", env=env)
    assert rc == 0, err
    inside = dict(item.split("=", 1) for item in out.split("\0") if item)
    assert inside.pop("KVBROKER_RANK") == "0"
    assert inside.pop("KVBROKER_URI").startswith("local://")
    assert "PYTHONPATH" not in inside  # (flux does not prepend to PYTHONPATH)
    env.pop("KVBROKER_URI", None)
    env.pop("KVBROKER_RANK", None)
    assert inside == env


# -- its own directory in PATH ---------------------------------------------------


def bogus_bin(tmp_path: Path) -> str:
    """A directory holding another ``kvbroker`` (which does nothing)."""
    d = tmp_path / "bin"
    d.mkdir()
    (d / "kvbroker").write_text("#!/bin/sh\ntrue\n")
    (d / "kvbroker").chmod(0o755)
    return str(d)


def path_env(path: str) -> dict[str, str]:
    return dict(os.environ, PATH=path)


async def test_the_command_finds_this_kvbroker_before_another(tmp_path: Path) -> None:
    path = f"{bogus_bin(tmp_path)}:{SYSPATH}"
    rc, out, err = await kvb_start("sh", "-c", "command -v kvbroker", env=path_env(path))
    assert rc == 0, err
    assert os.path.realpath(out.strip()) == HERE


async def test_the_command_finds_this_kvbroker_when_path_has_none() -> None:
    rc, out, err = await kvb_start("sh", "-c", "command -v kvbroker", env=path_env(SYSPATH))
    assert rc == 0, err
    assert os.path.realpath(out.strip()) == HERE


async def test_its_directory_goes_just_before_the_other_kvbroker(tmp_path: Path) -> None:
    other = bogus_bin(tmp_path)
    path = f"/foo:{other}:{SYSPATH}"
    rc, out, err = await kvb_start("printenv", "PATH", env=path_env(path))
    assert (rc, err) == (0, "")
    assert out == f"/foo:{os.path.dirname(KVBROKER)}:{other}:{SYSPATH}\n"


async def test_broker_s_initial_program_finds_this_kvbroker_too(tmp_path: Path) -> None:
    """``kvbroker broker -c FILE -- CMD`` (Flux's ``flux broker CMD``): its
    command's ``kvbroker`` is this one as well, before another in PATH."""
    conf = tmp_path / "one.toml"
    conf.write_text("[bootstrap]\n")
    path = f"{bogus_bin(tmp_path)}:{SYSPATH}"
    rc, out, err = await run_cli("broker", "-c", str(conf), "--", "sh", "-c",
                                 "command -v kvbroker", env=path_env(path))
    assert rc == 0, err
    assert os.path.realpath(out.strip()) == HERE


async def test_a_path_that_finds_this_kvbroker_first_is_left_alone(tmp_path: Path) -> None:
    path = f"/foo:/bar:{os.path.dirname(KVBROKER)}:{bogus_bin(tmp_path)}:{SYSPATH}"
    rc, out, err = await kvb_start("printenv", "PATH", env=path_env(path))
    assert (rc, out, err) == (0, f"{path}\n", "")


# -- extension commands --------------------------------------------------------------


async def test_an_installed_extension_command_runs(tmp_path: Path) -> None:
    env = plugin_env(tmp_path, "[kvbroker.commands]\nmyext = myext_mod:register\n",
                     {"myext_mod.py": MYEXT})
    assert await run_cli("myext", env=env) == (0, "myext-ok\n", "")


async def test_an_extension_whose_register_fails_is_left_out_saying_so(
        tmp_path: Path) -> None:
    env = plugin_env(tmp_path, "[kvbroker.commands]\nmyext = myext_mod:register\n"
                               "bad = bad_mod:register\n",
                     {"myext_mod.py": MYEXT,
                      "bad_mod.py": "def register(sub):\n    raise RuntimeError('no')\n"})
    rc, out, err = await run_cli("myext", env=env)
    assert (rc, out, err) == (0, "myext-ok\n", "kvbroker: ignoring plugin command 'bad': no\n")


BROKEN = "[kvbroker.commands]\nmyext = myext_mod:register\nbroken = broken_mod:register\n"


async def test_an_extension_that_fails_to_import_takes_nothing_else_down(
        tmp_path: Path) -> None:
    env = plugin_env(tmp_path, BROKEN, {"myext_mod.py": MYEXT,
                                        "broken_mod.py": "raise RuntimeError('boom')\n"})
    runs = await asyncio.gather(run_cli("--version", env=env), run_cli("--help", env=env),
                                run_cli(env=env), run_cli("nosuch", env=env),
                                run_cli("myext", env=env))
    for _rc, _out, err in runs:
        assert "Traceback" not in err, err
        assert "broken" in err  # left out, saying so, as one whose register fails
    (v, h, none, nosuch, myext) = runs
    assert v[:2] == (0, "kvbroker 0.1.0\n")
    assert h[0] == 0 and h[1].startswith("usage: kvbroker")
    assert none[0] == 2 and "usage: kvbroker" in none[2]
    assert nosuch[0] == 2 and "invalid choice: 'nosuch'" in nosuch[2]
    assert myext[:2] == (0, "myext-ok\n")


async def test_an_extension_that_cannot_be_imported_is_named_with_why(
        tmp_path: Path) -> None:
    env = plugin_env(tmp_path, "[kvbroker.commands]\nmissing = nosuch_pkg_xyz:register\n",
                     {})
    rc, out, err = await run_cli("missing", env=env)
    assert (rc, out) != (0, "")
    assert "invalid choice" not in err, err
    assert "missing" in err and "nosuch_pkg_xyz" in err, err


# -- an unknown command, no arguments, -h, --version ----------------------------------


async def test_an_unknown_command_is_named_and_every_command_listed(tmp_path: Path) -> None:
    env = plugin_env(tmp_path, "[kvbroker.commands]\nmyext = myext_mod:register\n",
                     {"myext_mod.py": MYEXT})
    # the same command from a second distribution: listed once
    (tmp_path / "two").mkdir()
    env["PYTHONPATH"] = install_plugin(tmp_path / "two", "ext-two",
                                       "[kvbroker.commands]\nmyext = myext_mod:register\n",
                                       {}) + os.pathsep + env["PYTHONPATH"]
    for typo in ("getatr", "myextt", "resouurrccee"):
        rc, out, err = await run_cli(typo, env=env)
        assert (rc, out) == (2, ""), err
        assert f"invalid choice: '{typo}'" in err
        for name in ("'attr'", "'ping'", "'kvs'", "'myext'"):
            assert err.count(name) == 1, (name, err)


async def test_no_arguments_help_and_version() -> None:
    none, short, long_, version = await asyncio.gather(
        run_cli(), run_cli("-h"), run_cli("--help"), run_cli("--version", "ping", "junk"))
    assert (none[0], none[1]) == (2, "")
    assert none[2].startswith("usage: kvbroker")
    assert none[2].endswith("kvbroker: error: the following arguments are required: "
                            "COMMAND\n")
    assert short == long_
    assert short[0] == 0 and short[1].startswith("usage: kvbroker") and short[2] == ""
    assert "start" in short[1] and "kvs" in short[1]
    assert version == (0, "kvbroker 0.1.0\n", "")


async def test_double_dash_ends_the_drivers_options() -> None:
    for argv in (["--", "getattr", "size"], ["--event-loop", "asyncio", "--", "getattr",
                                             "size"]):
        rc, out, err = await run_cli(*argv, uri="noexist://")
        assert (rc, out) == (1, ""), err
        assert err == ("kvbroker: getattr: cannot connect to broker at KVBROKER_URI="
                       "noexist://: unsupported broker URI scheme: 'noexist://'\n")


async def test_an_abbreviated_driver_option_before_an_alias() -> None:
    full = await run_cli("--event-loop", "asyncio", "getattr", "size", uri="noexist://")
    assert full[0] == 1 and full[2].startswith("kvbroker: getattr: cannot connect")
    assert await run_cli("--event-l", "asyncio", "ping", uri="noexist://") == (
        1, "", full[2].replace("getattr", "ping"))
    assert await run_cli("--event-l", "asyncio", "getattr", "size", uri="noexist://") == full
