"""``kvbroker start --config FILE`` (Flux's ``--config-path``): broker
attributes from a TOML file's ``[attrs]``, as a bootstrap file gives them
to ``kvbroker broker``; ``-S`` and the options win, and a bad file stops
the start before anything runs, naming the file and the entry."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_broker_support import run_cli

READ = "kvbroker attr get kvs.checkpoint-period; kvbroker attr get log.level; " \
       "kvbroker attr get statedir"


def _file(tmp_path: Path, text: str, name: str = "kvb.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


async def test_the_file_sets_attributes_and_a_statedir_beside_it(tmp_path: Path) -> None:
    conf = _file(tmp_path, '[attrs]\nstatedir = "state"\nkvs.checkpoint-period = "5s"\n'
                           '"log.level" = "error"\n')
    rc, out, err = await run_cli("start", "--config", str(conf), "--", "sh", "-c",
                                 READ + "; kvbroker kvs put a=1", cwd="/")
    assert (rc, out) == (0, f"5s\nerror\n{tmp_path / 'state'}\n"), err
    assert (tmp_path / "state" / "content.sqlite").exists()  # (relative to the file)
    # the statedir came back: Flux's spelling of the option, and -c
    rc, out, err = await run_cli("start", "--config-path", str(conf), "--",
                                 "kvbroker", "kvs", "get", "a")
    assert (rc, out) == (0, "1\n"), err


async def test_setattr_and_the_options_win_over_the_file(tmp_path: Path) -> None:
    conf = _file(tmp_path, '[attrs]\nstatedir = "state"\nkvs.checkpoint-period = "5s"\n')
    other = tmp_path / "other"
    rc, out, err = await run_cli("start", "-c", str(conf), "-S", "kvs.checkpoint-period=2s",
                                 "--statedir", str(other), "--", "sh", "-c", READ)
    assert (rc, out) == (0, f"2s\nwarning\n{other}\n"), err
    assert not (tmp_path / "state").exists()


async def test_a_true_in_the_file_reads_back_as_setattr_gives_it(tmp_path: Path) -> None:
    """TOML's ``true`` is the attribute's text ``true``, as ``-S NAME=true``
    gives it: it read back as Python's ``True`` in ``attr get`` and ``attr list``."""
    conf = _file(tmp_path, '[attrs]\n"access.allow-guest-user" = true\n')
    read = "kvbroker attr get access.allow-guest-user; kvbroker attr list | grep guest-user"
    rc, out, err = await run_cli("start", "-c", str(conf), "--", "sh", "-c", read)
    assert (rc, out.split()) == (0, ["true", "access.allow-guest-user", "true"]), err


@pytest.mark.parametrize(("text", "says"), [
    ('[attrs]\nkvs.checkpoint-period = "zz"\n',
     "[attrs] kvs.checkpoint-period: 'zz' is not a duration"),
    ('[attrs]\nkvs.checkpoint_period = 1\n',
     "[attrs] kvs.checkpoint_period: unknown attribute (did you mean kvs.checkpoint-period?)"),
    ('[attrs]\nlog.level = "info"\n"log.level" = "debug"\n', "log.level is given twice"),
    ('[attrs]\n"my.when" = 1979-05-27\n', "my.when: a date is not an attribute value"),
    ("[bootstrap]\n", "[bootstrap] is kvbroker broker's"),
    ("[kvs]\ncheckpoint-period = 1\n",
     'unknown table(s) or key(s): kvs: the file of kvbroker start holds [attrs]; broker '
     'attributes go in [attrs] (as "kvs.checkpoint-period" = ...)'),
    ("[attrs\n", "Expected ']'"),
    ('[attrs]\nsize = 4\n', "size cannot be set with -S: use --size N"),
    # (a number was a path under the current directory, true one named "true")
    ('[attrs]\nstatedir = 5\n', "attrs.statedir must be a directory's path"),
    ('[attrs]\nrundir = true\n', "attrs.rundir must be a directory's path"),
], ids=["bad-value", "typo", "twice", "date", "bootstrap", "flux-table", "not-toml", "size",
        "statedir-number", "rundir-bool"])
async def test_a_bad_file_stops_the_start_naming_it(tmp_path: Path, text: str,
                                                    says: str) -> None:
    conf = _file(tmp_path, text)
    # (-S overriding a bad value does not hide it: the next start would fail)
    rc, out, err = await run_cli("start", "-c", str(conf), "-S", "kvs.checkpoint-period=2s",
                                 "--", "touch", str(tmp_path / "ran"))
    assert (rc, out) == (2, ""), err
    assert err.startswith(f"kvbroker: start: {conf}: ") and says in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "ran").exists()


async def test_a_missing_file_is_said(tmp_path: Path) -> None:
    rc, out, err = await run_cli("start", "-c", str(tmp_path / "nope.toml"), "--", "true")
    assert (rc, out, err) == (2, "", f"kvbroker: start: {tmp_path / 'nope.toml'}: "
                                     "No such file or directory\n")
