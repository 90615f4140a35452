"""Bad input to the command line is a usage error (status 2) or one line
naming what is wrong (status 1), never a traceback, and nothing it takes
breaks a later command (docs/cli.md "Conventions").  Each case here was
found by a sweep of every subcommand with bad input."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Iterator

import pytest
from test_broker_support import KVBROKER, started_in_background
from test_broker_support import run_cli as _run_cli

from broker.errors import RemoteError
from broker.handle import Handle

T = 20


@pytest.fixture(scope="module")
def uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with started_in_background(tmp_path_factory.mktemp("badinput") / "ranks.log", "--size",
                               "2", "-S", "broker.modules=content,kvs,kvs-watch,cron") as line:
        yield line


async def run(uri: str, *args: str, **kw: object) -> tuple[int, str, str]:
    return await _run_cli(*args, uri=uri, timeout=T, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("scale", ["inf", "nan", "1e400"])
async def test_stats_scale_must_be_finite(uri: str, scale: str) -> None:
    """``-s inf --type int`` was a 33-line traceback; ``-s nan`` printed nan."""
    rc, out, err = await run(uri, "stats", "-s", scale, "--type", "int", "-p", "pid", "kvs")
    assert rc == 2 and "not a finite number" in err and "Traceback" not in err, err


@pytest.mark.parametrize("when, says", [
    # (taken, and every cron list after failed: "timestamp out of range")
    ("+99999999999999999999", "is not a time this host can tell"),
    ("0001-01-01T00:00", "is not a time this host can tell"),  # ("year 0 is out of range")
])
async def test_cron_at_refuses_a_time_no_list_could_show(uri: str, when: str,
                                                         says: str) -> None:
    rc, out, err = await run(uri, "cron", "at", when, "true")
    assert rc == 2 and says in err, err
    rc, out, err = await run(uri, "cron", "list")
    assert rc == 0 and "Traceback" not in err, err


async def test_cron_refuses_a_nul_in_a_command_and_a_zero_timeout(uri: str) -> None:
    """A NUL byte in a tab command was taken, and its task stayed Deferred
    for good; a timeout of 0 killed every run."""
    rc, out, err = await run(uri, "cron", "tab", input=b"* * * * * a\x00b\n")
    assert rc == 2 and "line 1: its command holds a NUL byte" in err, err
    rc, out, err = await run(uri, "cron", "interval", "--timeout", "0", "10", "true")
    assert rc == 2 and "--timeout" in err, err
    async with Handle.connect(uri) as h:  # (and the module itself, for any client)
        for args, says in (({"command": "a\x00b", "args": {"interval": 10}},
                            "holds a NUL byte"),
                           ({"command": "true", "timeout": 0, "args": {"interval": 10}},
                            "timeout must be more than 0"),
                           ({"command": "true", "type": "at", "args": {"at": 1e300}},
                            "past the end of 9999")):
            with pytest.raises(RemoteError) as exc:
                await asyncio.wait_for(h.rpc("cron.create", {"type": "interval", **args}), T)
            assert exc.value.errnum == errno.EINVAL and says in exc.value.errstr
    rc, out, err = await run(uri, "cron", "list")
    assert rc == 0 and "a\x00b" not in out


async def test_cron_tab_names_standard_input(uri: str) -> None:
    """``cron tab <&-`` said ``None: Bad file descriptor``."""
    import os

    rc, out, err = await run(uri, "cron", "tab", stdin=os.open("/dev/null", os.O_RDONLY))
    assert rc == 2, err  # (an empty file: no crontab line)
    proc = await asyncio.create_subprocess_exec(
        "sh", "-c", f"exec {KVBROKER} cron tab <&-", env={**os.environ, "KVBROKER_URI": uri},
        stderr=asyncio.subprocess.PIPE)
    _, err_b = await asyncio.wait_for(proc.communicate(), T)
    assert proc.returncode == 1
    assert err_b.decode() == "kvbroker: cron tab: standard input: Bad file descriptor\n"


async def test_errors_stay_one_line_and_name_what_is_wrong(uri: str) -> None:
    """A newline in an RPC's topic made the error three lines (raw, twice);
    ``--expect =1`` was refused naming the put's key, not the condition."""
    rc, out, err = await run(uri, "rpc", "a\nb", "{}")
    assert rc == 1 and err.count("\n") == 1 and err.startswith("kvbroker: 'a\\nb': "), err
    assert "no service matching 'a\\nb'" in err, err
    rc, out, err = await run(uri, "kvs", "put", "--expect", "=1", "a.b=3")
    assert rc == 2 and "--expect =1: give KEY=VALUE" in err, err


async def test_usage_errors_say_what_is_wrong(uri: str) -> None:
    """``module load`` alone named its optional ATTR=VALUE "required" too; a
    JSON payload with half a surrogate pair was Python's codec error."""
    rc, out, err = await run(uri, "module", "load")
    assert rc == 2 and err.rstrip().endswith("the following arguments are required: NAME"), err
    rc, out, err = await run(uri, "rpc", "t", '{"\\ud800": 1}')
    assert rc == 2 and "half a surrogate pair" in err and "codec" not in err, err


@pytest.mark.parametrize("args", [["config", "get", "a\udcff"], ["config", "set", "a\udcff", "1"],
                                  ["uri", "a\udcff"],
                                  # (never sent, only compared: it waited for ever)
                                  ["kvs", "eventlog", "wait-event", "log", "a\udcff"]])
async def test_a_word_that_is_not_utf8_is_said_so(uri: str, args: list[str]) -> None:
    """``config get $'a\\xff'`` said ``a\\udcff is not set``; ``uri`` said
    ``unknown target``: the word is no name at all, as other commands say."""
    import os

    argv = [os.fsencode(a) for a in args]  # (the shell's bytes)
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, *argv, env={**os.environ, "KVBROKER_URI": uri},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), T)
    assert proc.returncode == 1
    assert err.decode().endswith("Invalid argument ('a\\xff' is not UTF-8 text)\n"), err


async def test_a_negative_rank_is_a_usage_error(uri: str) -> None:
    """``overlay disconnect -1`` looked -1 up as a host name (exit 1)."""
    rc, out, err = await run(uri, "overlay", "disconnect", "-1")
    assert rc == 2 and "TARGET: must not be negative: -1" in err, err
