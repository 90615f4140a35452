"""flux-core t/t0013-config-file.t: the broker's configuration file.

Flux's ``flux broker -c PATH`` reads a TOML file, or a directory of them,
holding ``[bootstrap]`` (the instance across hosts) and any other table
(``[tbon]``, ``[access]``...).  kvbroker's equivalent is ``kvbroker broker
-c|--config FILE [--rank R]``: one TOML *bootstrap file* holding
``[bootstrap]`` and ``[attrs]`` (broker attributes, the names ``-S``
takes), and nothing else (docs/cli.md, "broker"; broker/bootstrap.py).  A
bad file exits 2 before anything starts, and the message names the file
and the entry (docs/cli.md); ``-S`` overrides the file's ``[attrs]``
(docs/cli.md, the same section).  Each case runs the real ``kvbroker
broker`` command; every refusal is checked for exit status 2, nothing on
stdout, one line on stderr (``kvbroker: broker: ...``, never a traceback)
and no run directory made.

Already covered elsewhere (not repeated here): tests/test_multihost.py --
a file without ``hosts`` or with an empty list runs one rank (Flux's "hosts
array can be missing / can be empty"), a missing file, ``--rank`` outside
the file, a 2-rank file whose key file is missing or not a key pair (two
words, swapped lines, a FIFO), the parse-level messages of every
``[bootstrap]`` check, host lists (``n[1-2]``) and a 4-rank instance at
fanout 2; tests/test_flux_conformance_t0019.py -- wrong types of
``[bootstrap]`` keys and of ``[attrs]`` values (``hosts = 42``, Flux's
"bad hosts array", among them), dotted keys in ``[attrs]``, and
``tbon.zmqdebug``, ``tbon.topo`` and ``tbon.fanout`` refused.

Flux case -> here:

1.  ``flux broker`` works with no config -> ``kvbroker broker`` needs its
    file (``-c`` is required: usage error, exit 2); the standalone
    equivalent is ``kvbroker start``, or a file holding only
    ``[bootstrap]`` (test_multihost).
2.  empty config directory works -> DIFFERENCE: ``-c`` names one file; a
    directory is refused, exit 2, ``DIR: Is a directory``.
3.  empty config file works -> it does: one rank on its own, as a file
    holding only ``[attrs]`` (a ``[bootstrap]`` table was required, and an
    empty file refused, until 2026-12-07).
4.  empty JSON object works -> not applicable (TOML only): ``{}`` is
    refused as TOML, naming the file and the line.
5.  ``FLUX_CONF_DIR`` -> not applicable (no such variable).
6.  missing config directory fails -> test_multihost (a missing file).
7.-8. invalid TOML (in a directory, in a file) fails -> it does, naming
    the file and the line.
9.  generate a curve certificate -> ``kvbroker keygen`` (test_multihost).
10. bad hosts array (``hosts = 42``) -> t0019.
11. bad hosts array element (``42``) -> refused, naming ``hosts[0]``.
12. element with an extra key -> refused, naming ``hosts[0]`` and the key.
13. element missing ``host`` -> refused, ``hosts[0]: host is required``.
14. bad hostlist (``foo[0-254}``) -> refused, naming ``hosts[0]``.
15.-16. unknown / impossible ``parent`` -> refused (``parent`` is an
    unknown key: kvbroker's trees are k-ary, by ``fanout``; t0019), and
    the refusal says so, as for Flux's other not-built names
    (``tbon.topo``, ``tbon.prefertcp``; it did not until 2026-12-05).
17. hostname not found -> refused, ``no hosts entry for this host``.
18.-19. hosts missing / empty -> test_multihost.
20. create the initial program -> the script is inline (``sh -c``).
21.-22. size=2 on ``ipc://``, and size=3 with a custom topology -> an
    ``ipc://`` endpoint is refused (``kvbroker broker``'s links are tcp,
    documented), naming ``hosts[0].bind``; the custom tree (fake2 under
    fake1) is ``fanout = 2`` on 4 ranks here (25).
23.-24. warning for an upstream host that does not resolve (and its
    clean-up) -> a rank whose parent's ``connect`` is
    ``tcp://foo.invalid:PORT`` warns at once that the name does not
    resolve, and goes on trying (until 2026-12-05 it warned only after
    ``tbon.connect_timeout``, 30 s by default, "is it running? is that
    its address?").
25. size=4 on ``tcp://`` (fake0, fake1 with endpoints, ``fake[2-3]``),
    whose initial program reads ``size`` and ``hostlist`` -> the same
    file (``fanout = 2``: fake3 is under fake1, Flux's custom topology of
    22), each rank ``-S hostname=fakeN``: ``size`` 4, ``hostlist``
    ``fake0,fake1,fake2,fake3`` (documented: comma-separated, where Flux's
    is compacted, ``fake[0-3]``), ``overlay parentof 3`` is 1.
26. ``curve_cert`` required for size > 1 -> refused, naming the key.
27. ``curve_cert`` must exist -> refused even for one rank (which needs
    no key), naming the key file.
28. ``curve_cert`` must hold a valid cert -> a secret key that is not
    Z85: refused, naming the key file; so is a *public* key that is not
    Z85 (a ``KeyError`` traceback, exit 1, until 2026-12-05).
29.-30. ``curve_cert`` must not be group/other readable -> DIFFERENCE
    (documented): used, with a warning naming the file.
31.-35. ``tbon.tcp_user_timeout`` (default, configured, ``-S`` wins, bad
    values) -> not built: refused in ``[attrs]`` or ``-S``, exit 2 (its
    dead-peer detection is the fixed ZMTP heartbeat, broker/overlay_zmq.py).
    The refusal says what is done instead (it said ``did you mean
    tbon.connect_timeout?``, another setting, until 2026-12-05).  The
    configured-vs-``-S`` cases are run on ``tbon.connect_timeout`` and the
    torpid pair instead (50, 57-61).
36.-40. ``tbon.zmqdebug`` -> t0019 (refused).  Flux's ``[tbon]`` table
    itself is refused, saying its settings go in ``[attrs]``.
41.-44. ``tbon.zmq_io_threads`` -> not built: refused (``-1`` too).
45.-49. ``tbon.child_rcvhwm`` -> not built: refused (``-1``, ``1`` too).
50.-51. ``tbon.torpid_min/max`` configured -> in ``[attrs]`` (Flux's
    dotted spelling), read back; a bare number is a duration here
    (documented), where Flux wants a string; ``-S`` wins.  Bad values
    (``torpid_max`` not above twice ``torpid_min``, ``torpid_min`` 0) are
    refused naming the attribute.
52.-56. ``tbon.topo`` -> t0019 (refused, naming ``fanout``).
57.-61. ``tbon.connect_timeout``: 30 by default, configured, ``-S`` wins,
    0 from the file or ``-S`` -> the same.
62.-69. ``--conf`` (key=value, inline TOML or JSON, a file; a bad one
    fails) -> not applicable: ``-S`` is the way, and ``--conf`` is
    refused (exit 2).  Until 2026-12-05 ``broker`` took it as an
    abbreviation of ``--config``: ``kvbroker broker --conf=tbon.zmqdebug=1
    -c FILE`` ran with the setting dropped without a word.
70.-71. ``flux start --conf`` -> not applicable.

Beyond Flux's cases, on the same promise (a bad file fails before
anything starts, naming the file): a bad value in ``[attrs]`` is refused
naming the file, even when ``-S`` overrides it (the file is checked on
its own first, as Flux's: else the same file fails on the next host); a
TOML date in ``[attrs]`` is refused naming it; an attribute given twice
in ``[attrs]`` (``log.level`` dotted and ``"log.level"`` quoted) is
refused.  Until 2026-12-05 the first was reported in ``-S``'s words
without the file, the second not at all, the third ended in a traceback
(exit 1) and the fourth kept one value, dropping the other silently.
"""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, run_cli, wait_until
from test_multihost import brokers as brokers  # noqa: F401  (the fixture)
from test_multihost import exit_codes

from broker.launch import free_tcp_ports

T = 60


def conf_file(tmp_path: Path, text: str, name: str = "conf.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


async def broker(tmp_path: Path, conf: Path, *opts: str,
                 cmd: tuple[str, ...] = ("true",)) -> tuple[int, str, str]:
    """``kvbroker broker -c CONF --rundir TMP/run OPTS -- CMD``."""
    return await run_cli("broker", "-c", str(conf), "--rundir", str(tmp_path / "run"),
                         *opts, "--", *cmd, cwd=tmp_path, timeout=T)


def refused(tmp_path: Path, result: tuple[int, str, str], *says: str) -> None:
    """Exit 2 before anything started: one line on stderr holding ``says``."""
    rc, out, err = result
    assert (rc, out) == (2, ""), result
    assert "Traceback" not in err, err
    assert err.startswith("kvbroker: broker: ") and err.count("\n") == 1, err
    for words in says:
        assert words in err, (words, err)
    assert not (tmp_path / "run").exists()


async def keygen(path: Path) -> Path:
    assert (await run_cli("keygen", str(path)))[0] == 0
    return path


# -- 1-8: the file itself ----------------------------------------------------------


async def test_t0013_broker_needs_a_file() -> None:
    """Case 1."""
    rc, out, err = await run_cli("broker", "--", "true")
    assert (rc, out) == (2, ""), err
    assert "--config" in err and "Traceback" not in err, err


@pytest.mark.parametrize("text", ["", '[attrs]\n"log.level" = "debug"\n'],
                         ids=["empty", "attrs-only"])
async def test_t0013_a_file_without_bootstrap_is_one_rank(tmp_path: Path, text: str) -> None:
    """Case 3: as Flux's empty config file, a file with no ``[bootstrap]``
    runs one rank on its own, with the file's ``[attrs]``."""
    conf = conf_file(tmp_path, text)
    rc, out, err = await broker(tmp_path, conf, cmd=("sh", "-c", "kvbroker attr get size; "
                                                     "kvbroker attr get log.level"))
    level = "debug" if text else "warning"
    assert (rc, out) == (0, f"1\n{level}\n"), err


async def test_t0013_a_directory_is_not_a_file(tmp_path: Path) -> None:
    """Case 2."""
    (tmp_path / "empty").mkdir()
    result = await broker(tmp_path, tmp_path / "empty")
    refused(tmp_path, result, f"{tmp_path / 'empty'}: Is a directory")


BAD_FILES = {
    # cases 3-4, 7-8: not a bootstrap file
    "bootstrap-not-a-table": ("bootstrap = 1\n", "bootstrap must be a table"),
    "json": ("{}\n", "(at line 1"),
    "invalid-toml": ("[bootstrap]\nbad-toml\n", "(at line 2"),
    "flux-tbon-table": ('[bootstrap]\n[tbon]\ntorpid_max = "5s"\n',
                        "unknown table(s) or key(s): tbon: a bootstrap file holds [bootstrap] "
                        'and [attrs]; broker attributes go in [attrs] (as "tbon.torpid_max"'),
    # cases 11-16: hosts entries
    "element-42": ("[bootstrap]\nhosts = [\n  42\n]\n",
                   'hosts[0]: expected a table like { host = "node0" }'),
    "extra-key": ('[bootstrap]\nhosts = [\n  { host = "xyz", extrakey = 42 },\n]\n',
                  "hosts[0]: unknown key(s): extrakey"),
    "no-host": ("[bootstrap]\nhosts = [\n  { },\n]\n", "hosts[0]: host is required"),
    "bad-hostlist": ('[bootstrap]\nhosts = [\n  { host = "foo[0-254}" },\n]\n',
                     "hosts[0]: host 'foo[0-254}' is not a host list"),
    "unknown-parent": ('[bootstrap]\nhosts = [\n  { host = "fake0", parent = "noparent" },\n]\n',
                       "hosts[0]: unknown key(s): parent"),
    "impossible-parent": ('[bootstrap]\nhosts = [\n  { host = "fake0", parent = "fake0" },\n]\n',
                          "hosts[0]: unknown key(s): parent"),
    # case 17
    "hostname-not-found": ('[bootstrap]\ndefault_bind = "ipc://@flux-testipc-1-0"\n'
                           'default_connect = "ipc://@flux-testipc-1-0"\n'
                           'hosts = [\n  { host = "matchnobody" },\n]\n',
                           f"no hosts entry for this host ({socket.gethostname()}); "
                           "give --rank"),
    # cases 21, 26
    "ipc": ('[bootstrap]\ncurve_cert = "testcert"\n[[bootstrap.hosts]]\nhost = "fake0"\n'
            'bind = "ipc:///tmp/x/test-ipc2-0"\nconnect = "ipc:///tmp/x/test-ipc2-0"\n'
            '[[bootstrap.hosts]]\nhost = "fake1"\n',
            "hosts[0].bind must be a tcp:// endpoint, not 'ipc:///tmp/x/test-ipc2-0'"),
    "no-curve-cert": ('[bootstrap]\ndefault_bind = "ipc://@flux-testipc-1-0"\n'
                      'default_connect = "ipc://@flux-testipc-1-0"\n'
                      'hosts = [\n  { host = "foo1" },\n  { host = "foo2" }\n]\n',
                      "bootstrap.curve_cert is required for more than one rank"),
}


@pytest.mark.parametrize("case", BAD_FILES)
async def test_t0013_bad_file_refused_naming_file_and_entry(tmp_path: Path, case: str) -> None:
    text, entry = BAD_FILES[case]
    conf = conf_file(tmp_path, text)
    refused(tmp_path, await broker(tmp_path, conf), f"kvbroker: broker: {conf}: ", entry)


# -- 26-30: the key file ---------------------------------------------------------------


async def bad_key(tmp_path: Path, fault: str) -> tuple[Path, Path]:
    """A file of one rank (which needs no key, but names one) and its key
    file ``conf/cert``: missing, or one key's first character made ``~``
    (not a Z85 character), as Flux's ``sed s/key/nerp/``."""
    key = tmp_path / "conf" / "cert"
    key.parent.mkdir()
    if fault != "missing":
        await keygen(key)
        lines = key.read_text().splitlines()
        which = 0 if fault == "public-not-z85" else 1
        lines[which] = "~" + lines[which][1:]
        key.write_text("\n".join(lines) + "\n")
    return conf_file(tmp_path, '[bootstrap]\ncurve_cert = "conf/cert"\n'), key


@pytest.mark.parametrize(("fault", "says"), [
    ("missing", "No such file or directory"),
    ("secret-not-z85", "not a key pair file (the keys are not Z85)"),
])
async def test_t0013_bad_key_file_refused_even_for_one_rank(tmp_path: Path, fault: str,
                                                            says: str) -> None:
    """Cases 27-28."""
    conf, key = await bad_key(tmp_path, fault)
    refused(tmp_path, await broker(tmp_path, conf), f"curve_cert {key}: {says}")


async def test_t0013_a_public_key_not_in_z85_is_refused(tmp_path: Path) -> None:
    """Case 28 with the fault in the public key's line."""
    conf, key = await bad_key(tmp_path, "public-not-z85")
    refused(tmp_path, await broker(tmp_path, conf), f"curve_cert {key}: not a key pair file")


@pytest.mark.parametrize("mode", [0o640, 0o604])
async def test_t0013_a_key_others_may_read_is_used_with_a_warning(tmp_path: Path,
                                                                  mode: int) -> None:
    """Cases 29-30: a documented difference."""
    key = await keygen(tmp_path / "cert")
    key.chmod(mode)
    conf = conf_file(tmp_path, '[bootstrap]\ncurve_cert = "cert"\n')
    rc, out, err = await broker(tmp_path, conf, cmd=(KVBROKER, "attr", "get", "size"))
    assert (rc, out) == (0, "1\n"), err
    assert f"kvbroker: broker: warning: curve_cert {key}: others may read it" in err, err


# -- 21-25: an instance from the file --------------------------------------------------


async def test_t0013_four_ranks_from_flux_s_tcp_file(tmp_path: Path, brokers) -> None:  # noqa: F811
    """Case 25 (and 22's deeper tree): Flux's file, with ``fanout = 2``."""
    await keygen(tmp_path / "testcert")
    p0, p1 = free_tcp_ports(2)
    conf = conf_file(tmp_path, f"""[bootstrap]
curve_cert = "testcert"
fanout = 2
[[bootstrap.hosts]]
host = "fake0"
bind = "tcp://127.0.0.1:{p0}"
connect = "tcp://127.0.0.1:{p0}"
[[bootstrap.hosts]]
host = "fake1"
bind = "tcp://127.0.0.1:{p1}"
connect ="tcp://127.0.0.1:{p1}"
[[bootstrap.hosts]]
host = "fake[2-3]"
""")
    ranks = [await brokers(conf, r, "-S", f"hostname=fake{r}") for r in (3, 2, 1)]
    script = ("kvbroker attr get size; kvbroker attr get hostlist; kvbroker overlay parentof 3;"
              " kvbroker uri --remote rank:3; kvbroker uri rank:3")
    rank0 = await brokers(conf, 0, "-S", "hostname=fake0", "--", "sh", "-c", script)
    assert rank0.proc.stdout is not None
    out = await asyncio.wait_for(rank0.proc.stdout.read(), T)
    assert await exit_codes([rank0, *ranks], tmp_path) == [0, 0, 0, 0]
    size, hosts, parent, remote, local = out.decode().splitlines()
    assert (size, hosts, parent) == ("4", "fake0,fake1,fake2,fake3", "1")
    # rank 3's ssh:// form names its host, where its socket is, not this one
    assert remote == f"ssh://fake3{local.removeprefix('local://')}", remote


# -- 31-61: tbon.* settings ----------------------------------------------------------

TBON = ("tbon.torpid_min", "tbon.torpid_max", "tbon.connect_timeout")
READ_TBON = "; ".join(f"kvbroker attr get {name}" for name in TBON)
CONFIGURED = ('[bootstrap]\n[attrs]\ntbon.torpid_min = 2\ntbon.torpid_max = "5s"\n'
              '"tbon.connect_timeout" = "0"\n')


@pytest.mark.parametrize(("text", "opts", "expect"), [
    ("[bootstrap]\n", (), "5\n30\n30\n"),                        # Flux's defaults
    (CONFIGURED, (), "2\n5s\n0\n"),                              # configured
    (CONFIGURED, ("-S", "tbon.torpid_max=7s", "-S", "tbon.connect_timeout=1h"),
     "2\n7s\n1h\n"),                                             # -S wins
    ("[bootstrap]\n", ("-S", "tbon.connect_timeout=0"), "5\n30\n0\n"),
], ids=["default", "configured", "setattr-wins", "setattr-zero"])
async def test_t0013_tbon_settings_configured_and_overridden(
        tmp_path: Path, text: str, opts: tuple[str, ...], expect: str) -> None:
    conf = conf_file(tmp_path, text)
    rc, out, err = await broker(tmp_path, conf, *opts, cmd=("sh", "-c", READ_TBON))
    assert (rc, out) == (0, expect), err


BAD_TBON = [
    ("tbon.connect_timeout", '"zzz"', "zzz", "tbon.connect_timeout: 'zzz' is not a duration"),
    ("tbon.torpid_max", '"2s"', "2s", "tbon.torpid_max: 2 must be 0 (never) or more than "
     "twice tbon.torpid_min (5)"),
    ("tbon.torpid_min", '"0"', "0", "tbon.torpid_min: must be at least 0.1"),
    ("tbon.tcp_user_timeout", '"30s"', "30s", "tbon.tcp_user_timeout: Flux's bound on "
     "unacknowledged TCP data is not built"),
    ("tbon.zmq_io_threads", "4", "-1", "tbon.zmq_io_threads: unknown attribute"),
    ("tbon.child_rcvhwm", "5", "-1", "tbon.child_rcvhwm: unknown attribute"),
    ("tbon.child_rcvhwm", "1", "1", "tbon.child_rcvhwm: unknown attribute"),
]


@pytest.mark.parametrize("where", ["attrs", "setattr"])
@pytest.mark.parametrize(("name", "toml", "value", "says"), BAD_TBON,
                         ids=[f"{n}={v}" for n, _, v, _ in BAD_TBON])
async def test_t0013_bad_tbon_setting_refused(tmp_path: Path, where: str, name: str,
                                              toml: str, value: str, says: str) -> None:
    """Cases 34-35, 41-49, 51: a bad value, or a setting not built."""
    if where == "attrs":
        conf, opts = conf_file(tmp_path, f'[bootstrap]\n[attrs]\n"{name}" = {toml}\n'), ()
    else:
        conf, opts = conf_file(tmp_path, "[bootstrap]\n"), ("-S", f"{name}={value}")
    refused(tmp_path, await broker(tmp_path, conf, *opts), says)


# -- defects ----------------------------------------------------------------------------


async def test_t0013_bad_attrs_value_names_the_file(tmp_path: Path) -> None:
    conf = conf_file(tmp_path, '[bootstrap]\n[attrs]\n"tbon.connect_timeout" = "zzz"\n')
    refused(tmp_path, await broker(tmp_path, conf), str(conf), "tbon.connect_timeout")


async def test_t0013_bad_attrs_value_refused_though_setattr_overrides_it(tmp_path: Path) -> None:
    conf = conf_file(tmp_path, '[bootstrap]\n[attrs]\n"tbon.connect_timeout" = "zzz"\n')
    result = await broker(tmp_path, conf, "-S", "tbon.connect_timeout=1h")
    refused(tmp_path, result, "tbon.connect_timeout")


@pytest.mark.parametrize("value", ["1979-05-27T07:32:00Z", "1979-05-27"])
async def test_t0013_a_date_in_attrs_is_refused_naming_it(tmp_path: Path, value: str) -> None:
    conf = conf_file(tmp_path, f'[bootstrap]\n[attrs]\n"my.date" = {value}\n')
    refused(tmp_path, await broker(tmp_path, conf), str(conf), "my.date")


async def test_t0013_an_attribute_given_twice_in_attrs_is_refused(tmp_path: Path) -> None:
    conf = conf_file(tmp_path, '[bootstrap]\n[attrs]\nlog.level = "info"\n'
                     '"log.level" = "debug"\n')
    refused(tmp_path, await broker(tmp_path, conf), str(conf), "log.level")


async def test_t0013_tcp_user_timeout_refusal_does_not_point_at_connect_timeout(
        tmp_path: Path) -> None:
    conf = conf_file(tmp_path, "[bootstrap]\n")
    result = await broker(tmp_path, conf, "-S", "tbon.tcp_user_timeout=30s")
    refused(tmp_path, result, "tbon.tcp_user_timeout")
    assert "tbon.connect_timeout" not in result[2], result


async def test_t0013_parent_refusal_names_fanout(tmp_path: Path) -> None:
    conf = conf_file(tmp_path, BAD_FILES["unknown-parent"][0])
    refused(tmp_path, await broker(tmp_path, conf), "hosts[0]", "parent", "fanout")


async def test_t0013_flux_s_conf_option_is_refused(tmp_path: Path) -> None:
    conf = conf_file(tmp_path, "[bootstrap]\n")
    rc, out, err = await run_cli("broker", "--conf=tbon.zmqdebug=1", "-c", str(conf),
                                 "--rundir", str(tmp_path / "run"), "--", "true", timeout=T)
    assert (rc, out) == (2, ""), (rc, out, err)
    assert "--conf" in err, err


async def test_t0013_unresolvable_parent_host_is_said(tmp_path: Path, brokers) -> None:  # noqa: F811
    """Cases 23-24: rank 1 of a file whose rank 0 is at ``foo.invalid`` (RFC
    2606: never resolves).  Its first WARNING naming the host -- at the
    latest after ``tbon.connect_timeout``, 1 s here -- says why."""
    await keygen(tmp_path / "testcert")
    [port] = free_tcp_ports(1)
    conf = conf_file(tmp_path, f'[bootstrap]\ncurve_cert = "testcert"\n[[bootstrap.hosts]]\n'
                     f'host = "fake0"\nbind = "tcp://*:{port}"\n'
                     f'connect = "tcp://foo.invalid:{port}"\n'
                     '[[bootstrap.hosts]]\nhost = "fake1"\n')
    rank1 = await brokers(conf, 1, "-S", "hostname=fake1", "-S", "tbon.connect_timeout=1s")
    log = tmp_path / "stderr1-0"

    def warning() -> str | None:
        return next((line for line in log.read_text().splitlines()
                     if "WARNING" in line and "foo.invalid" in line), None)

    async def warned() -> bool:
        return warning() is not None

    await wait_until(warned, "a WARNING naming foo.invalid", timeout=15)
    assert rank1.proc.returncode is None  # (it goes on trying)
    line = warning()
    assert line is not None and re.search(r"resolv|not known", line, re.I), line

