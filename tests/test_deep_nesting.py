"""JSON and TOML nested deeper than Python's parsers can recurse
(``broker/jsontoml.py``): every reader of such text fails as it fails
for other malformed text -- an errno error, a usage error, a one-line
``kvbroker: ...`` -- never with a ``RecursionError`` traceback, and a
rank answers such a configuration ``EINVAL`` instead of an internal
error with a traceback in its log.

Found by a probe of the CLI: an eventlog line nested 5,000 deep made
every reader of that log (``eventlog get``, ``get -w``, ``wait-event``,
the Python watchers) fail with a traceback, a deep JSON argument was
exit status 1 and a traceback instead of 2, and ``config set`` of an
object 500 deep an internal error.
"""

from __future__ import annotations

import errno
import json
import tomllib
from pathlib import Path

import pytest
from test_broker_support import run_cli

from broker import jsontoml
from broker.cliutil import CLIError
from broker.config_cli import parse_value
from kvs import eventlog
from kvs.client import KVS, encode_value
from kvs_watch.client import parse_eventlog_entry

T = 60.0


def nested(depth: int) -> str:
    """A JSON object ``depth`` maps deep."""
    return '{"a":' * depth + "1" + "}" * depth


def nested_value(depth: int) -> dict:
    value: dict = {"a": 1}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def deep_eventlog_line() -> bytes:
    return (f'{{"timestamp":1.0,"name":"deep","context":{nested(5000)}}}\n').encode()


def test_deep_json_is_malformed_json() -> None:
    with pytest.raises(json.JSONDecodeError) as exc:
        jsontoml.loads_json(nested(5000))
    assert str(exc.value) == jsontoml.TOO_DEEP
    with pytest.raises(ValueError, match=jsontoml.TOO_DEEP):
        jsontoml.loads_json(b"[" * 5000 + b"]" * 5000)
    assert jsontoml.loads_json(nested(100)) == nested_value(100)


def test_deep_toml_is_malformed_toml() -> None:
    with pytest.raises(tomllib.TOMLDecodeError, match=jsontoml.TOO_DEEP):
        jsontoml.loads_toml("x = " + "[" * 3000 + "]" * 3000)
    assert jsontoml.loads_toml("x = [[1]]") == {"x": [[1]]}


def test_readers_of_deep_text_fail_as_for_malformed_text() -> None:
    line = deep_eventlog_line().rstrip(b"\n")
    with pytest.raises(eventlog.EventlogError):
        eventlog.decode_entry(line)
    with pytest.raises(eventlog.EventlogError):
        parse_eventlog_entry(line)
    with pytest.raises(eventlog.EventlogError, match="context is not valid JSON"):
        eventlog.entry("ev", nested(5000))
    with pytest.raises(TypeError, match=f"^cannot store a dict value: {jsontoml.TOO_DEEP}$"):
        encode_value(nested_value(5000))
    with pytest.raises(CLIError) as exc:
        parse_value(nested(2000), "object", "config set")
    assert exc.value.detail.endswith(f"(12001 characters)' is not a JSON object: "
                                     f"{jsontoml.TOO_DEEP}"), exc.value.detail


async def test_a_deep_eventlog_line_is_a_malformed_log(start_instance, tmp_path: Path) -> None:
    """Anyone who may write a key made every reader of it fail with a
    traceback: now each says the log is malformed (``EINVAL``)."""
    inst = await start_instance(size=2)
    uri = inst.uri(1)
    rc, _, err = await run_cli("kvs", "put", "-r", "elog=-", uri=uri, timeout=T,
                               input=deep_eventlog_line())
    assert rc == 0, err
    bad = ("kvbroker: elog: Invalid argument (cannot decode improperly formatted eventlog: "
           "line 1: not JSON: nested too deeply)\n")
    for args in (("get",), ("get", "-u"), ("get", "-w", "-c", "1"),
                 ("wait-event", "-t", "10", "elog", "deep")):
        rc, out, err = await run_cli("kvs", "eventlog", *args,
                                     *(("elog",) if args[0] == "get" else ()),
                                     uri=uri, timeout=T)
        assert (rc, out, err) == (1, "", bad), args
    async with KVS.connect(uri) as kvs:
        with pytest.raises(eventlog.EventlogError) as exc:
            await kvs.get_eventlog("elog")
        assert exc.value.errnum == errno.EINVAL


async def test_deep_arguments_are_usage_errors(start_instance) -> None:
    inst = await start_instance(size=1)
    for args in (("rpc", "broker.ping"), ("event", "pub", "foo")):
        rc, _, err = await run_cli(*args, nested(1000), uri=inst.uri(0), timeout=T)
        assert rc == 2, (args, err)
        assert err.endswith(f"argument PAYLOAD-JSON: not valid JSON: {jsontoml.TOO_DEEP}\n")
        assert "Traceback" not in err


async def test_a_deep_configuration_is_refused_clearly(start_instance, tmp_path: Path) -> None:
    """``config set`` of an object 500 deep: ``EINVAL`` from the rank
    (it was an internal error, with a traceback of ~1,000 lines in the
    rank's log); a file too deep for TOML is refused by ``config load``
    and by ``start --config`` naming the file."""
    inst = await start_instance(size=1)
    uri = inst.uri(0)
    rc, _, err = await run_cli("config", "set", "foo", nested(500), "--type", "object",
                               uri=uri, timeout=T)
    assert (rc, err) == (1, "kvbroker: config set: Invalid argument (config is nested more "
                            "than 64 tables or arrays deep)\n")
    deep_toml = tmp_path / "deep.toml"
    deep_toml.write_text("x = " + "[" * 3000 + "]" * 3000 + "\n")
    rc, _, err = await run_cli("config", "load", str(deep_toml), uri=uri, timeout=T)
    assert (rc, err) == (1, f"kvbroker: config load: {deep_toml}: not JSON, nor TOML: "
                            f"{jsontoml.TOO_DEEP}\n")
    rc, out, _ = await run_cli("dmesg", uri=uri, timeout=T)
    assert "ERROR" not in out and "Traceback" not in out, out
    rc, _, err = await run_cli("start", "--size", "1", "--config", str(deep_toml), "--", "true",
                               timeout=T)
    assert (rc, err) == (2, f"kvbroker: start: {deep_toml}: {jsontoml.TOO_DEEP}\n")
