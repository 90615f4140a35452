"""Unit tests of broker.attrs: the parsers, AttrSpec.value, check_instance, and
that every tunable the docs list is declared with the documented default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from broker import attrs
from broker.attrs import AttrError, AttrSpec, boolean, choice, duration, integer
from broker.content.module import ContentModule
from broker.cron import CronModule
from broker.heartbeat import HeartbeatModule
from kvs.module import CHECKPOINT_PERIOD, KvsModule
from kvs_watch.module import KvsWatchModule

CLI_MD = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def documented_defaults() -> dict[str, str]:
    """``{attribute: default}`` from the tunable-attributes table of docs/cli.md."""
    rows = re.findall(r"^\| `([a-z0-9._-]+)` \| (?:`([^`]*)`|\(none\))", CLI_MD.read_text(),
                      re.M)  # ("(none)": an empty default)
    assert len(rows) >= 10, rows
    return dict(rows)


def all_specs() -> dict[str, AttrSpec]:
    specs = list(attrs.BROKER_ATTRS)
    for cls in (ContentModule, KvsModule, KvsWatchModule, HeartbeatModule, CronModule):
        specs += cls.attributes
    out = {s.name: s for s in specs}
    assert len(out) == len(specs), "an attribute is declared twice"
    return out


def test_integer() -> None:
    p = integer(10)
    assert p("4096") == 4096 and p(" 12 ") == 12 and p(10) == 10
    for bad in ("abc", "1.5", "", "0x10", "1_000", "--5", "1e3"):
        with pytest.raises(ValueError, match="is not an integer"):
            p(bad)
    with pytest.raises(ValueError, match="is not an integer"):
        p(True)
    with pytest.raises(ValueError, match="9 is below the minimum of 10$"):
        p("9")
    with pytest.raises(ValueError, match="-1 is below the minimum of 0: why not"):
        integer(0, "why not")("-1")


def test_boolean() -> None:
    for yes in ("true", "TRUE", "1", "yes", "on", True):
        assert boolean(yes) is True
    for no in ("false", "False", "0", "no", "off", False):
        assert boolean(no) is False
    for bad in ("maybe", "", "2", "t"):
        with pytest.raises(ValueError, match="is not a boolean"):
            boolean(bad)


def test_choice() -> None:
    p = choice(("unix", "tcp"), "transport")
    assert p("tcp") == "tcp"
    with pytest.raises(ValueError, match=r"unknown transport 'TCP' \(choose from unix, tcp\)"):
        p("TCP")
    assert choice(("info", "debug"), fold_case=True)("INFO") == "info"


def test_duration() -> None:
    for text, seconds in [("0", 0.0), ("2", 2.0), ("1.5", 1.5), (".5", 0.5), ("1s", 1.0),
                          ("500ms", 0.5), ("30m", 1800.0), ("2h", 7200.0), ("1d", 86400.0),
                          (" 3s ", 3.0), (4, 4.0), (0.25, 0.25)]:
        assert duration(text) == seconds, text
    for bad in ["", "-1", "1x", "s", "1 s", "inf", "nan", "1e3", True, -1, float("inf")]:
        with pytest.raises(ValueError, match="is not a duration"):
            duration(bad)
    with pytest.raises(AttrError, match="^kvs.checkpoint-period: '-1' is not a duration"):
        CHECKPOINT_PERIOD.value({"kvs.checkpoint-period": "-1"})
    # 0 is never; else at least 10ms: rank 0 wakes once a period, changed or
    # not, and a nanosecond kept it at 100% of a CPU while idle
    assert CHECKPOINT_PERIOD.value({"kvs.checkpoint-period": "0"}) == 0
    assert CHECKPOINT_PERIOD.value({"kvs.checkpoint-period": "10ms"}) == 0.01
    for tiny in ("0.000000001", "1ms", 0.001):
        with pytest.raises(AttrError, match="is under 0.01s .*a busy loop"):
            CHECKPOINT_PERIOD.value({"kvs.checkpoint-period": tiny})


def test_spec_value_names_the_attribute() -> None:
    assert attrs.MAX_MESSAGE.value({}) == 1 << 30
    assert attrs.MAX_MESSAGE.value({"broker.max-message": "4096"}) == 4096
    with pytest.raises(AttrError) as info:
        attrs.MAX_MESSAGE.value({"broker.max-message": "abc"})
    assert str(info.value) == "broker.max-message: 'abc' is not an integer"
    with pytest.raises(AttrError) as info:
        attrs.LOG_LEVEL.value({"log.level": "bogus"})
    assert str(info.value) == ("log.level: unknown level 'bogus' "
                               "(choose from debug, info, warning, error)")
    assert attrs.LOG_LEVEL.value({"log.level": "INFO"}) == "info"
    with pytest.raises(AttrError, match="^access.allow-guest-user: 'maybe' is not a boolean"):
        attrs.ALLOW_GUEST_USER.value({"access.allow-guest-user": "maybe"})


def test_every_default_parses_and_limits_keep_the_instance_usable() -> None:
    for spec in all_specs().values():
        spec.value({})  # the default itself is valid
    from kvs import txn

    _, empty_root = txn.empty_root()
    limit = all_specs()["content.blob-size-limit"]
    with pytest.raises(AttrError, match="below the minimum"):
        limit.value({limit.name: str(len(empty_root))})
    with pytest.raises(AttrError, match="below the minimum"):
        limit.value({limit.name: "10"})
    assert limit.value({limit.name: "1000"}) == 1000
    with pytest.raises(AttrError, match="below the minimum"):
        attrs.MAX_MESSAGE.value({"broker.max-message": "100"})
    kept = all_specs()["content.max-checkpoints"]
    with pytest.raises(AttrError, match="the current checkpoint is always kept"):
        kept.value({kept.name: "0"})
    with pytest.raises(AttrError, match="above the maximum of 100"):
        kept.value({kept.name: "101"})
    assert kept.value({}) == 5


def test_check_instance() -> None:
    attrs.check_instance({})
    attrs.check_instance({"my.attr": "anything", "log.level": "debug"})  # unknown: unchecked
    for name, value in [("kvs.cache-bytes", "abc"), ("content.blob-size-limit", "10"),
                        ("kvs-watch.max-backlog", "0"), ("tbon.transport", "udp"),
                        ("content.hash", "md5")]:
        with pytest.raises(AttrError, match=f"^{re.escape(name)}: "):
            attrs.check_instance({name: value})
    # a module's attributes are checked only when the module is loaded...
    attrs.check_instance({"broker.modules": "content", "kvs.cache-bytes": "abc"})
    # ...and a module this process cannot find is left to the ranks
    attrs.check_instance({"broker.modules": "content,not-here"})


def test_cron_directory_loads_cron_on_rank_0() -> None:
    """``-S cron.directory=DIR``: rank 0 loads cron (Flux's rc1), whatever
    ``broker.modules`` says; its attributes are then checked at start."""
    d = {"cron.directory": "/etc/kvbroker/cron.d"}
    assert attrs.module_names(d, 0) == ["content", "kvs", "kvs-watch", "cron"]
    assert attrs.module_names(d, 1) == ["content", "kvs", "kvs-watch"]
    assert attrs.module_names(d) == ["content", "kvs", "kvs-watch", "cron"]  # (some rank's)
    listed = {**d, "broker.modules": "content,cron,kvs"}
    assert attrs.module_names(listed, 0) == attrs.module_names(listed, 1) == [
        "content", "cron", "kvs"]
    assert attrs.module_names({"cron.directory": " "}, 0) == ["content", "kvs", "kvs-watch"]
    with pytest.raises(AttrError, match="^cron.sync_epsilon: "):
        attrs.check_instance({**d, "cron.sync_epsilon": "soon"})
    with pytest.raises(AttrError, match=r"^cron\.sync-epsilon: unknown attribute"):
        attrs.check_instance({**d, "cron.sync-epsilon": "1s"})


def test_unknown_names_in_owned_prefixes_are_typos() -> None:
    with pytest.raises(AttrError, match=r"^kvs\.cachebytes: unknown attribute \(did you "
                                        r"mean kvs\.cache-bytes\?\)$"):
        attrs.check_instance({"kvs.cachebytes": "1"})
    with pytest.raises(AttrError, match=r"^tbon\.whatever: unknown attribute$"):
        attrs.check_instance({"tbon.whatever": "1"})
    # free: names outside every owned prefix, and a module's prefix when it
    # is not loaded
    attrs.check_instance({"my.attr": "1", "kvsx.y": "1"})
    attrs.check_instance({"broker.modules": "content", "kvs.anything": "1"})


def test_what_a_rank_sets_itself_is_refused() -> None:
    # (it was taken and ignored: -S statedir=DIR ran without one, exit 0)
    for name in attrs.SET_BY_RANK:
        with pytest.raises(AttrError, match=f"^{re.escape(name)} cannot be set with -S: "):
            attrs.check_instance({name: "1"})
    assert attrs.how_to_set("statedir") == "set it at start with --statedir DIR"
    assert attrs.how_to_set("broker.pid") == "each rank sets it itself"
    assert attrs.how_to_set("tbon.transport") == "set it at start: -S tbon.transport=VALUE"


def test_with_defaults_keeps_set_values() -> None:
    a: dict[str, object] = {"kvs.cache-bytes": "1000"}
    attrs.with_defaults(a, KvsModule.attributes)
    assert a == {"kvs.cache-bytes": "1000", "kvs.cache-expire": "10s",
                 "kvs.setroot-blob-limit": str(8 << 10),
                 "kvs.checkpoint-period": "1s", "kvs.transaction-merge": "true",
                 "kvs.max-waits-per-guest": "10000",
                 "kvs.max-leases-per-user": "10000", "kvs.gc-grace": "10s", "kvs.gc-period": "0",
                 "kvs.relay-settle-timeout": "5s"}
    with pytest.raises(AttrError):
        attrs.with_defaults({"kvs.setroot-blob-limit": "x"}, KvsModule.attributes)
    with pytest.raises(AttrError, match="above the maximum of 67108864"):
        attrs.with_defaults({"kvs.setroot-blob-limit": str(1 << 30)}, KvsModule.attributes)
    with pytest.raises(AttrError, match="kvs.transaction-merge: 'sometimes' is not a boolean"):
        attrs.with_defaults({"kvs.transaction-merge": "sometimes"}, KvsModule.attributes)


def test_docs_table_matches_the_declarations() -> None:
    documented = documented_defaults()
    specs = all_specs()
    assert set(documented) == set(specs)
    for name, default in documented.items():
        assert specs[name].default == default, name


def test_protocol_md_lists_every_tunable() -> None:
    """docs/protocol.md's list of a rank's attributes names every tunable one
    (it had fallen behind the table of docs/cli.md, missing six)."""
    text = (CLI_MD.parent / "protocol.md").read_text()
    start = text.index("Attributes: `rank`")
    listing = text[start:text.index("\n\n", start)]
    named = set(re.findall(r"`([a-z][a-z0-9._-]*)`", listing))
    assert set(all_specs()) - named == set()


def test_flux_s_names_are_answered_with_kvbroker_s() -> None:
    """``-S tbon.fanout=2`` (Flux's spelling of ``--fanout``) met "unknown
    attribute (did you mean tbon.transport?)"; it names the option now, and
    so does a rank asked for the attribute by Flux's name."""
    for name in ("tbon.fanout", "tbon.topo"):
        with pytest.raises(AttrError, match=f"^{re.escape(name)} is Flux's name: kvbroker's is "
                                            "fanout, set it at start with --fanout K"):
            attrs.check_instance({name: "2"})
    assert attrs.unknown_message("tbon.fanout") == (
        "unknown attribute 'tbon.fanout': Flux's name; kvbroker's is 'fanout' "
        "(set it at start with --fanout K)")
    assert attrs.unknown_message("nope") == "unknown attribute 'nope'"
    # a running rank's names: the closest, as -S says it at start
    assert attrs.unknown_message("kvs.checkpoint_period", ["kvs.checkpoint-period", "size"]) \
        == "unknown attribute 'kvs.checkpoint_period' (did you mean kvs.checkpoint-period?)"
    assert attrs.unknown_message("nope", ["size", "rank"]) == "unknown attribute 'nope'"


def test_flux_s_own_attributes_are_put_in_kvbroker_s_terms() -> None:
    """``-Slog-stderr-level=N`` and an empty ``-Sbroker.rc1_path=`` (the
    idiom of Flux's tests) ran into "unknown attribute"."""
    got = attrs.from_flux({"log-stderr-level": "7", "log-level": 4, "broker.rc1_path": "",
                           "broker.rc3_path": "", "my.attr": "x"})
    assert got == {"log.level": "debug", "log.ring-level": "warning", "my.attr": "x"}
    assert [attrs.from_flux({"log-stderr-level": n})["log.level"] for n in range(8)] == [
        "error", "error", "error", "error", "warning", "info", "info", "debug"]
    # kvbroker's own name wins; what cannot be honoured is refused
    assert attrs.from_flux({"log-stderr-level": "7", "log.level": "error"}) == {
        "log.level": "error"}
    with pytest.raises(AttrError, match="^broker.rc1_path: kvbroker runs no rc scripts"):
        attrs.from_flux({"broker.rc1_path": "/etc/flux/rc1"})
    with pytest.raises(AttrError, match="^log-stderr-level=8: Flux's level is a number 0-7"):
        attrs.from_flux({"log-stderr-level": "8"})


def test_broker_modules_names_are_trimmed() -> None:
    """``broker.modules`` is a comma-separated list: blanks around a name
    are not part of it (``content, kvs`` stopped the start-up with ``no
    module named ' kvs'``), and an empty item is skipped."""
    assert attrs.module_names({"broker.modules": " content , kvs,\tkvs-watch ,, "}, 1) == [
        "content", "kvs", "kvs-watch"]

