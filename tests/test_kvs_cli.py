# ruff: noqa: E501  (expected transcripts keep the commands' long lines whole)
"""``kvbroker kvs ...`` against real instances (flux-core t1000/t1001/t1004/t1008 shapes).

Most checks run a shell script of many ``kvbroker kvs`` commands in one
``sh -c`` and compare its transcript: ``t CMD...`` prints ``$ CMD``, then the
command's stdout and stderr, then ``[rc=N]`` when it failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_broker_support import (
    GUEST_CLI_PRELOAD,
    GUEST_IMPORT_GUARD,
    communicate,
    stop_process,
)

from broker.handle import Handle
from broker.loops import loop_name
from kvs import treeobj
from kvs.client import KVS

BIN = Path(sys.executable).parent
KVB = str(BIN / "kvbroker")
T = 60  # seconds: bound on one command, and on a script's first ten
PER_COMMAND = 2.0
"""Seconds more a script may take per ``kvbroker`` command past ten: a
Python CLI's start takes up to a second on a loaded 2-core machine, and
a script of 79 commands overran a flat 60 s in a -n 2 run beside others."""

PRELUDE = r"""
on() { _r=$1; shift; eval "_u=\$U$_r"; KVBROKER_URI=$_u "$@"; }
t() { printf '$ %s\n' "$*"; "$@" 2>&1; rc=$?; [ $rc -eq 0 ] || printf '[rc=%s]\n' $rc; }
"""


@dataclass
class Result:
    rc: int
    out: bytes
    err: str

    @property
    def text(self) -> str:
        return self.out.decode("utf-8", "replace")


def client_env(uri: str, **extra: str) -> dict[str, str]:
    # PYTHONPATH is kept: a worktree's tests must run its own kvbroker code,
    # not the editable install's (the venv's finder comes after PYTHONPATH)
    env = {k: v for k, v in os.environ.items() if k not in ("KVBROKER_NAMESPACE", "COLUMNS")}
    env.update(KVBROKER_URI=uri, PATH=f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}", TZ="UTC")
    env.update(extra)
    return env


async def run(argv: list[str], env: dict[str, str], stdin: bytes = b"",
              cwd: str | None = None, timeout: float = T) -> Result:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env, cwd=cwd)
    try:
        out, err = await asyncio.wait_for(communicate(proc, stdin), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return Result(proc.returncode, out, err.decode("utf-8", "replace"))


async def kvs(inst, *args: str, rank: int = 0, stdin: bytes = b"", **env: str) -> Result:
    """One ``kvbroker kvs ARGS`` attached to ``rank``."""
    return await run([KVB, "kvs", *args], client_env(inst.uri(rank), **env), stdin)


async def sh(inst, script: str, rank: int = 0, **env: str) -> str:
    """Run ``script`` and return its transcript.  ``on R CMD...`` runs CMD
    attached to rank R; ``t CMD...`` records CMD's output (see module docstring)."""
    env.update({f"U{r}": inst.uri(r) for r in range(inst.size)})
    bound = T + PER_COMMAND * max(0, script.count("kvbroker ") - 10)
    with tempfile.TemporaryDirectory() as cwd:  # scripts may write scratch files
        res = await run(["sh", "-c", PRELUDE + textwrap.dedent(script)],
                        client_env(inst.uri(rank), **env), cwd=cwd, timeout=bound)
    assert res.rc == 0, res.text + res.err
    return norm(res.text)


def expect(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def norm(text: str) -> str:
    """Make a transcript comparable: blobrefs vary from run to run (``REF``); the
    kvs module's own explanation after ``<strerror>`` is its business (``(...)``);
    a trailing space is shown as ``<sp>``."""
    text = re.sub(r"sha1-[0-9a-f]{40}|sha256-[0-9a-f]{64}", "REF", text)
    text = re.sub(r"^(kvbroker: .+?: [A-Z][^(]*?) \(.*\)$", r"\1 (...)", text, flags=re.M)
    return re.sub(r" $", "<sp>", text, flags=re.M)


# ================================================================ get / put


async def test_put_get_across_ranks(start_instance) -> None:
    inst = await start_instance(size=4, fanout=2)
    out = await sh(inst, """
        D=test.a.b
        t kvbroker kvs put $D.i=42 $D.d=3.14 $D.s=foo $D.t=true $D.a='[1,3,5]' $D.o='{"a":42}'
        V=$(kvbroker kvs version)
        t on 3 kvbroker kvs wait $V
        t on 3 kvbroker kvs get $D.i $D.d $D.s $D.t $D.a $D.o
        t on 2 sh -c "kvbroker kvs wait $V && kvbroker kvs get -l $D.s"
        t kvbroker kvs get ......$D...i.
        t kvbroker kvs put ..$D.....n...=7
        t kvbroker kvs get $D.n
        t kvbroker kvs get test.nope
        t kvbroker kvs get $D
        t kvbroker kvs get $D.s.x
        t kvbroker kvs put NOVALUE
        t kvbroker kvs put .=1
        t kvbroker kvs put =1
        t kvbroker kvs get $D.s test.nope $D.i
        """, rank=1)
    assert out == expect("""
        $ kvbroker kvs put test.a.b.i=42 test.a.b.d=3.14 test.a.b.s=foo test.a.b.t=true test.a.b.a=[1,3,5] test.a.b.o={"a":42}
        $ on 3 kvbroker kvs wait 1
        $ on 3 kvbroker kvs get test.a.b.i test.a.b.d test.a.b.s test.a.b.t test.a.b.a test.a.b.o
        42
        3.14
        foo
        true
        [1,3,5]
        {"a":42}
        $ on 2 sh -c kvbroker kvs wait 1 && kvbroker kvs get -l test.a.b.s
        test.a.b.s=foo
        $ kvbroker kvs get ......test.a.b...i.
        42
        $ kvbroker kvs put ..test.a.b.....n...=7
        $ kvbroker kvs get test.a.b.n
        7
        $ kvbroker kvs get test.nope
        kvbroker: test.nope: No such file or directory
        [rc=1]
        $ kvbroker kvs get test.a.b
        kvbroker: test.a.b: Is a directory (...)
        [rc=1]
        $ kvbroker kvs get test.a.b.s.x
        kvbroker: test.a.b.s.x: No such file or directory
        [rc=1]
        $ kvbroker kvs put NOVALUE
        kvbroker: put: you must specify a value as key=value
        [rc=1]
        $ kvbroker kvs put .=1
        kvbroker: .: Invalid argument (...)
        [rc=1]
        $ kvbroker kvs put =1
        kvbroker: put: Invalid argument (...)
        [rc=1]
        $ kvbroker kvs get test.a.b.s test.nope test.a.b.i
        foo
        kvbroker: test.nope: No such file or directory
        [rc=1]
        """)


async def test_an_overlong_key_is_named_by_its_start(start_instance) -> None:
    """``kvbroker: KEY: <strerror> (...)`` printed the whole key before the
    message, which already shows its start: 100 kB of one key on stderr for
    a put the limits refuse, a get or a watch of a missing key."""
    inst = await start_instance(size=2)
    huge = "k" * 100_000
    for args in (("put", f"{huge}=v"), ("get", huge), ("get", "--raw", huge),
                 ("eventlog", "get", huge), ("unlink", huge),
                 ("get", "--waitcreate", "--timeout", "0.1", huge)):
        res = await kvs(inst, *args, rank=1)
        assert res.rc == 1 and "kkkk" in res.err[:50], res.err[:200]
        assert len(res.err) < 300, (args[0], res.err[:200])
    res = await kvs(inst, "get", "q" * 1024, rank=1)  # a key a commit could write: whole
    assert res.err == f"kvbroker: {'q' * 1024}: No such file or directory\n"


async def test_options_may_sit_between_and_after_positionals(start_instance) -> None:
    """As getopt_long lets them for flux's commands: ``kvs put a=1 -N ns
    b=2`` is one transaction in ``ns``; plain argparse refused ``b=2``.
    After ``--`` everything is a positional again."""
    inst = await start_instance(size=2)
    out = await sh(inst, """
        t kvbroker kvs namespace create perm
        t kvbroker kvs put p.a=1 -N perm p.b=2 --sequence
        t kvbroker kvs get p.a p.b -N perm
        t kvbroker kvs unlink p.a -N perm -f p.b p.nope
        t kvbroker kvs ls -N perm
        t kvbroker kvs get -- -x
        t kvbroker rpc broker.ping '{}' --rank 1
        t kvbroker event pub perm.x --private '{}'
        """, rank=0)
    route = json.loads(out.split("$ kvbroker rpc broker.ping {} --rank 1\n")[1].splitlines()[0])
    assert route["rank"] == 1
    out = re.sub(r"(?m)^\{.*\}$", "{...}", out)
    assert out == expect("""
        $ kvbroker kvs namespace create perm
        $ kvbroker kvs put p.a=1 -N perm p.b=2 --sequence
        1
        $ kvbroker kvs get p.a p.b -N perm
        1
        2
        $ kvbroker kvs unlink p.a -N perm -f p.b p.nope
        $ kvbroker kvs ls -N perm
        p
        $ kvbroker kvs get -- -x
        kvbroker: -x: No such file or directory
        [rc=1]
        $ kvbroker rpc broker.ping {} --rank 1
        {...}
        $ kvbroker event pub perm.x --private {}
        """)


async def test_put_raw_stdin_append_and_flags(start_instance) -> None:
    inst = await start_instance(size=2)
    out = await sh(inst, """
        D=x
        printf abc | kvbroker kvs put -r $D.a=- $D.b=42
        t kvbroker kvs get -r $D.a $D.b; echo
        printf abc | kvbroker kvs put --raw $D.a=- $D.b=-
        t kvbroker kvs get -r $D.b; echo '|'
        t kvbroker kvs put $D.e=
        t kvbroker kvs get $D.e
        t kvbroker kvs get -r $D.e
        t kvbroker kvs put $D.z=abc
        t kvbroker kvs put -A $D.z=def
        t kvbroker kvs put --append $D.z=ghi $D.new=n
        t kvbroker kvs get $D.z $D.new
        echo abc | kvbroker kvs put -r $D.nl=-
        echo def | kvbroker kvs put -A -r $D.nl=-
        t kvbroker kvs get -r $D.nl
        t kvbroker kvs put --no-merge $D.nm=1
        t kvbroker kvs put -S $D.sync=1
        t kvbroker kvs put -n -S --sync $D.both=1
        t kvbroker kvs get $D.nm $D.sync $D.both
        V=$(kvbroker kvs version)
        S=$(kvbroker kvs put -s $D.seq=1)
        [ "$S" -eq $((V + 1)) ] && echo seq ok
        B=$(kvbroker kvs put -b $D.seq=2)
        [ "$B" = "$(kvbroker kvs getroot -b)" ] && echo blobref ok
        O=$(kvbroker kvs put -O $D.seq=3)
        [ "$O" = "$(kvbroker kvs getroot)" ] && echo treeobj-root ok
        """, rank=1)
    assert out == expect("""
        $ kvbroker kvs get -r x.a x.b
        abc42
        $ kvbroker kvs get -r x.b
        |
        $ kvbroker kvs put x.e=
        $ kvbroker kvs get x.e
        $ kvbroker kvs get -r x.e
        $ kvbroker kvs put x.z=abc
        $ kvbroker kvs put -A x.z=def
        $ kvbroker kvs put --append x.z=ghi x.new=n
        $ kvbroker kvs get x.z x.new
        abcdefghi
        n
        $ kvbroker kvs get -r x.nl
        abc
        def
        $ kvbroker kvs put --no-merge x.nm=1
        $ kvbroker kvs put -S x.sync=1
        $ kvbroker kvs put -n -S --sync x.both=1
        $ kvbroker kvs get x.nm x.sync x.both
        1
        1
        1
        seq ok
        blobref ok
        treeobj-root ok
        """)
    # binary values round-trip through stdin; big ones are stored as valrefs
    data = os.urandom(4096) + b"\0\n\xff"
    assert (await kvs(inst, "put", "-r", "bin=-", stdin=data)).rc == 0
    got = await kvs(inst, "get", "-r", "bin", rank=1)
    assert got.rc == 0 and got.out == data
    tobj = json.loads((await kvs(inst, "get", "-t", "bin")).out)
    assert tobj["type"] == "valref"
    labelled = await kvs(inst, "get", "-r", "-l", "bin")
    assert labelled.out == b"bin=" + data
    # a non-raw get prints a value up to its first NUL byte (C string), then a newline
    assert (await kvs(inst, "put", "-r", "nul=-", stdin=b"ab\0cd")).rc == 0
    assert (await kvs(inst, "get", "nul")).out == b"ab\n"


async def test_treeobj_and_at(start_instance) -> None:
    inst = await start_instance(size=2)
    out = await sh(inst, """
        D=t
        t kvbroker kvs put -t $D.val='{"data":"YgA=","type":"val","ver":1}'
        t kvbroker kvs get $D.val
        t kvbroker kvs get -t $D.val
        t kvbroker kvs put $D.v=hello
        t kvbroker kvs get --treeobj $D.v
        kvbroker kvs get --treeobj . | grep -q '"dirref"' && echo root is a dirref
        kvbroker kvs get -t . > snap
        t kvbroker kvs put --treeobj $D.snap=- < snap
        [ "$(kvbroker kvs get -t $D.snap)" = "$(cat snap)" ] && echo snapshot ok
        kvbroker kvs put $D.a.a=hello $D.a.b=goodbye
        t kvbroker kvs put --treeobj $D.b="$(kvbroker kvs get --treeobj $D.a)"
        t kvbroker kvs get $D.b.a $D.b.b
        t kvbroker kvs put --treeobj $D.bad=xyz
        t kvbroker kvs put -t $D.bad='{"data":"MQA=","type":"FOO","ver":1}'
        t kvbroker kvs put -t $D.bad='{"data":["sha1-aaa"],"type":"dirref","ver":1}'
        kvbroker kvs put $D.c.d=42
        ROOT=$(kvbroker kvs getroot)
        SUB=$(kvbroker kvs get -t $D.c)
        kvbroker kvs put $D.c.d=43
        t kvbroker kvs get --at "$ROOT" $D.c.d
        t kvbroker kvs get -a "$SUB" d
        t on 1 kvbroker kvs get --at "$ROOT" $D.c.d
        t kvbroker kvs get $D.c.d
        t kvbroker kvs get --at 42 $D.c.d
        t kvbroker kvs get --at '{"data":42,"type":"dirref","ver":1}' $D.c.d
        """)
    assert out == expect("""
        $ kvbroker kvs put -t t.val={"data":"YgA=","type":"val","ver":1}
        $ kvbroker kvs get t.val
        b
        $ kvbroker kvs get -t t.val
        {"data":"YgA=","type":"val","ver":1}
        $ kvbroker kvs put t.v=hello
        $ kvbroker kvs get --treeobj t.v
        {"data":"aGVsbG8=","type":"val","ver":1}
        root is a dirref
        $ kvbroker kvs put --treeobj t.snap=-
        snapshot ok
        $ kvbroker kvs put --treeobj t.b={"data":["REF"],"type":"dirref","ver":1}
        $ kvbroker kvs get t.b.a t.b.b
        hello
        goodbye
        $ kvbroker kvs put --treeobj t.bad=xyz
        kvbroker: t.bad: Invalid argument (...)
        [rc=1]
        $ kvbroker kvs put -t t.bad={"data":"MQA=","type":"FOO","ver":1}
        kvbroker: t.bad: Invalid argument (...)
        [rc=1]
        $ kvbroker kvs put -t t.bad={"data":["sha1-aaa"],"type":"dirref","ver":1}
        kvbroker: t.bad: Invalid argument (...)
        [rc=1]
        $ kvbroker kvs get --at {"data":["REF"],"type":"dirref","ver":1} t.c.d
        42
        $ kvbroker kvs get -a {"data":["REF"],"type":"dirref","ver":1} d
        42
        $ on 1 kvbroker kvs get --at {"data":["REF"],"type":"dirref","ver":1} t.c.d
        42
        $ kvbroker kvs get t.c.d
        43
        $ kvbroker kvs get --at 42 t.c.d
        kvbroker: t.c.d: Invalid argument (...)
        [rc=1]
        $ kvbroker kvs get --at {"data":42,"type":"dirref","ver":1} t.c.d
        kvbroker: t.c.d: Invalid argument (...)
        [rc=1]
        """)


async def test_at_a_version_number_says_what_a_root_is(start_instance) -> None:
    """--at takes a root (a blobref or a dirref); an etcd user's --rev (a
    version number) was 'invalid blobref: '22''."""
    inst = await start_instance(size=1)
    await kvs(inst, "put", "a=1")
    res = await kvs(inst, "get", "--at", "22", "a")
    assert (res.rc, res.err) == (1, "kvbroker: a: Invalid argument (a root is a blobref or "
                                    "a dirref tree object, not a version (22): getroot -b "
                                    "prints one)\n")
    root = (await kvs(inst, "getroot", "-b")).text.strip()
    assert (await kvs(inst, "get", "--at", root, "a")).text == "1\n"

async def test_dir_json_is_one_object_a_script_can_read(start_instance) -> None:
    """dir --json: {KEY: ENTRY} in dir's order; values whole (no width cut,
    newlines kept), text when UTF-8 else base64; links and directories
    marked; -d gives null values; a value is ENOTDIR as without --json."""
    inst = await start_instance(size=2)
    long = "x" * 200
    await kvs(inst, "put", "c.a=1", "c.b.c=hé", f"c.long={long}", "c.nl=two\nlines")
    await kvs(inst, "mkdir", "c.empty")
    await kvs(inst, "put", "-r", "c.bin=-", stdin=b"\xff\x00")
    await kvs(inst, "link", "c.a", "c.l")
    res = await kvs(inst, "dir", "-R", "--json", "c", rank=1)
    assert res.rc == 0, res.err
    assert json.loads(res.text) == {
        "c.a": "1", "c.b.c": "hé", "c.bin": {"base64": "/wA="}, "c.empty": {"dir": True},
        "c.l": {"link": "c.a"}, "c.long": long, "c.nl": "two\nlines"}
    assert list(json.loads(res.text)) == sorted(json.loads(res.text))
    top = json.loads((await kvs(inst, "dir", "--json", "c")).text)
    assert top["c.b"] == {"dir": True} and top["c.a"] == "1"
    keys = json.loads((await kvs(inst, "dir", "-R", "-d", "--json", "c")).text)
    assert keys["c.a"] is None and keys["c.l"] == {"link": "c.a"}
    res = await kvs(inst, "dir", "--json", "c.a")
    assert (res.rc, res.err) == (1, "kvbroker: c.a: Not a directory\n")

async def test_unlink_names_the_key_when_the_commit_refuses_it(start_instance) -> None:
    """An unlink the commit refuses (through a link into another namespace)
    names the key as unlink's other errors do, not 'unlink:' (docs audit)."""
    inst = await start_instance(size=1)
    await kvs(inst, "namespace", "create", "other")
    await kvs(inst, "put", "-N", "other", "x.y=1")
    await kvs(inst, "link", "-T", "other", "x", "l")
    res = await kvs(inst, "unlink", "l.y")
    assert (res.rc, res.err) == (1, "kvbroker: cannot unlink 'l.y': Invalid argument "
                                    "(cannot write through a link into another namespace)\n")
    # a condition that cannot be checked so is named, not the key written
    # ("z: Invalid argument (cannot expect through ...)" blamed z)
    want = ("kvbroker: l.y: Invalid argument (condition cannot be checked: cannot expect "
            "through a link into another namespace)\n")
    for args in (("put", "--expect", "l.y=1", "z=1"),
                 ("unlink", "-f", "--expect", "l.y=1", "zz")):
        res = await kvs(inst, *args)
        assert (res.rc, res.err) == (1, want), args

async def test_get_label_empty_value(start_instance) -> None:
    """-l prints ``KEY=`` and a newline even for an empty value (the next key
    ran on: ``empty=a.c=hello``); without -l an empty value prints nothing."""
    inst = await start_instance(size=1)
    await kvs(inst, "put", "empty=", "a.c=hello")
    assert (await kvs(inst, "get", "-l", "empty", "a.c")).text == "empty=\na.c=hello\n"
    assert (await kvs(inst, "get", "empty", "a.c")).text == "hello\n"


# ================================================================ dir / ls


async def test_dir(start_instance) -> None:
    inst = await start_instance(size=1)
    out = await sh(inst, """
        D=test.a.b
        t kvbroker kvs mkdir $D
        t kvbroker kvs dir $D
        t kvbroker kvs mkdir $D.d
        t kvbroker kvs dir -R $D
        kvbroker kvs put $D.a=42 $D.b=3.14 $D.c=foo $D.e='[1,3,5]' $D.f.g.h=deep
        kvbroker kvs link $D.a $D.l
        kvbroker kvs link -T other x.y $D.m
        t kvbroker kvs dir $D
        t kvbroker kvs dir -R $D.
        t kvbroker kvs dir -R -d .
        t kvbroker kvs dir -R --at "$(kvbroker kvs get -t $D)"
        t kvbroker kvs dir $D.a
        t kvbroker kvs dir test.nope
        kvbroker kvs put long.v=0123456789012345678901234567890123456789 long.n="$(printf 'one\\ntwo')"
        kvbroker kvs put long.e= long.w=値値値値値値値値値値値値
        printf 'end\\n' | kvbroker kvs put -r long.t=-
        t kvbroker kvs dir -w 20 long
        t kvbroker kvs dir long
        t kvbroker kvs dir -w 0 long
        """)
    assert out == expect("""
        $ kvbroker kvs mkdir test.a.b
        $ kvbroker kvs dir test.a.b
        $ kvbroker kvs mkdir test.a.b.d
        $ kvbroker kvs dir -R test.a.b
        test.a.b.d.
        $ kvbroker kvs dir test.a.b
        test.a.b.a = 42
        test.a.b.b = 3.14
        test.a.b.c = foo
        test.a.b.d.
        test.a.b.e = [1,3,5]
        test.a.b.f.
        test.a.b.l -> test.a.b.a
        test.a.b.m -> other::x.y
        $ kvbroker kvs dir -R test.a.b.
        test.a.b.a = 42
        test.a.b.b = 3.14
        test.a.b.c = foo
        test.a.b.d.
        test.a.b.e = [1,3,5]
        test.a.b.f.g.h = deep
        test.a.b.l -> test.a.b.a
        test.a.b.m -> other::x.y
        $ kvbroker kvs dir -R -d .
        test.a.b.a
        test.a.b.b
        test.a.b.c
        test.a.b.d.
        test.a.b.e
        test.a.b.f.g.h
        test.a.b.l -> test.a.b.a
        test.a.b.m -> other::x.y
        $ kvbroker kvs dir -R --at {"data":["REF"],"type":"dirref","ver":1}
        a = 42
        b = 3.14
        c = foo
        d.
        e = [1,3,5]
        f.g.h = deep
        l -> test.a.b.a
        m -> other::x.y
        $ kvbroker kvs dir test.a.b.a
        kvbroker: test.a.b.a: Not a directory
        [rc=1]
        $ kvbroker kvs dir test.nope
        kvbroker: test.nope: No such file or directory
        [rc=1]
        $ kvbroker kvs dir -w 20 long
        long.e =<sp>
        long.n = one...
        long.t = end
        long.v = 01234567...
        long.w = 値値値値...
        $ kvbroker kvs dir long
        long.e =<sp>
        long.n = one...
        long.t = end
        long.v = 0123456789012345678901234567890123456789
        long.w = 値値値値値値値値値値値値
        $ kvbroker kvs dir -w 0 long
        long.e =<sp>
        long.n = one
        two
        long.t = end

        long.v = 0123456789012345678901234567890123456789
        long.w = 値値値値値値値値値値値値
        """)


async def test_dir_ls_width_checks(start_instance) -> None:
    """A negative -w (was: silently 80) and a dir -w of 1-3 (was: no limit at
    all, as in flux) are usage errors; -w 4 is the narrowest cut."""
    inst = await start_instance(size=1)
    await kvs(inst, "put", "k=0123456789")
    for args in (["dir", "-w", "-3"], ["dir", "-w", "3"], ["dir", "-w", "1"],
                 ["ls", "-w", "-1"], ["dir", "-w", "x"]):
        res = await kvs(inst, *args)
        assert res.rc == 2 and "usage: kvbroker kvs" in res.err, args
        assert "argument -w/--width" in res.err, args
    # -1 is also ls's one-a-line flag: argparse said "expected one argument"
    for args, bad in ((["-w", "-1"], "-1"), (["--width", "-5"], "-5"),
                      (["-1", "-w", "-2", "k"], "-2")):
        res = await kvs(inst, "ls", *args)
        assert res.rc == 2 and res.err.startswith("usage: kvbroker kvs ls"), args
        assert res.err.rstrip().endswith(
            f"error: argument -w/--width: must not be negative: {bad}"), args
    res = await kvs(inst, "ls", "-w", "-1", "--", "-1")  # after --, -1 is a key
    assert res.rc == 2 and "must not be negative: -1" in res.err
    assert (await kvs(inst, "ls", "-1", "-w", "0")).text == "k\n"
    assert (await kvs(inst, "dir", "-w", "4")).text == "k...\n"
    assert (await kvs(inst, "dir", "-w", "9")).text == "k = 01...\n"
    assert (await kvs(inst, "ls", "-w", "0")).text == "k\n"


def test_dir_cuts_a_line_at_a_control_character() -> None:
    """As ``flux kvs dir`` at its first unprintable character: a tab, an
    escape sequence or a stray byte in a value reached the terminal whole."""
    from kvs.cli import _kv_line

    assert _kv_line("d.tab", b"ab\tcd", 80) == "d.tab = ab..."
    assert _kv_line("d.esc", b"\x1b[31mred", 80) == "d.esc = ..."
    assert _kv_line("d.bin", b"ab\xffcd", 80) == "d.bin = ab..."
    assert _kv_line("d.del", b"ab\x7f", 80) == "d.del = ab..."
    assert _kv_line("d.utf", "h\u00e9llo \u65e5\u672c".encode(), 80) == "d.utf = h\u00e9llo \u65e5\u672c"
    assert _kv_line("d.nl", b"ab\n", 80) == "d.nl = ab"  # (a trailing newline: no ...)
    assert _kv_line("d.tab", b"ab\tcd", 0) == "d.tab = ab\tcd"  # -w 0 cuts nothing


async def test_ls(start_instance) -> None:
    inst = await start_instance(size=1)
    names = " ".join(f"w.{i:04d}=x" for i in range(50))
    out = await sh(inst, f"""
        D=test.a.b
        kvbroker kvs mkdir $D
        t kvbroker kvs ls -1F
        t kvbroker kvs ls -1F .
        kvbroker kvs put $D.a=69
        kvbroker kvs mkdir $D.b
        kvbroker kvs link b $D.c
        kvbroker kvs link --target-namespace=foo c $D.d
        t kvbroker kvs ls -1F $D
        t kvbroker kvs ls -1F $D.
        t kvbroker kvs ls -1Fd $D.a $D.b $D.c $D.d
        t kvbroker kvs ls $D
        t kvbroker kvs ls -R test
        kvbroker kvs put {names}
        kvbroker kvs ls w | wc -wl | tr -s ' '
        kvbroker kvs ls -w40 w | wc -wl | tr -s ' '
        COLUMNS=20 kvbroker kvs ls w | wc -wl | tr -s ' '
        kvbroker kvs ls -w0 w | wc -wl | tr -s ' '
        kvbroker kvs ls -1 w | wc -wl | tr -s ' '
        kvbroker kvs put deep.0000.0000.0000=1
        t kvbroker kvs ls -R deep
        t kvbroker kvs ls -d $D.b.
        t kvbroker kvs ls -d $D.a.
        t kvbroker kvs ls $D.nope
        t kvbroker kvs ls $D.a $D.nope $D.b
        kvbroker kvs put L.foo=1 L.dir.b=1
        kvbroker kvs link L.foo L.tovalue
        kvbroker kvs link invalid L.dangling
        kvbroker kvs link L.dir L.todir
        t kvbroker kvs ls -d L.tovalue
        t kvbroker kvs ls -F L.tovalue
        t kvbroker kvs ls L.tovalue L.dangling
        t kvbroker kvs ls L.todir
        t kvbroker kvs ls -R L.todir
        t kvbroker kvs ls L.foo L.dir L.todir
        t kvbroker kvs ls --json L
        """)
    assert out == expect("""
        $ kvbroker kvs ls -1F
        test.
        $ kvbroker kvs ls -1F .
        test.
        $ kvbroker kvs ls -1F test.a.b
        a
        b.
        c@
        d@
        $ kvbroker kvs ls -1F test.a.b.
        a
        b.
        c@
        d@
        $ kvbroker kvs ls -1Fd test.a.b.a test.a.b.b test.a.b.c test.a.b.d
        test.a.b.a
        test.a.b.b.
        test.a.b.c@
        test.a.b.d@
        $ kvbroker kvs ls test.a.b
        a    b    c    d
        $ kvbroker kvs ls -R test
        test:
        a

        test.a:
        b

        test.a.b:
        a    b    c    d

        test.a.b.b:
         5 50
         10 50
         25 50
         1 50
         50 50
        $ kvbroker kvs ls -R deep
        deep:
        0000

        deep.0000:
        0000

        deep.0000.0000:
        0000
        $ kvbroker kvs ls -d test.a.b.b.
        test.a.b.b
        $ kvbroker kvs ls -d test.a.b.a.
        kvbroker: test.a.b.a: Not a directory
        [rc=1]
        $ kvbroker kvs ls test.a.b.nope
        kvbroker: test.a.b.nope: No such file or directory
        [rc=1]
        $ kvbroker kvs ls test.a.b.a test.a.b.nope test.a.b.b
        kvbroker: test.a.b.nope: No such file or directory
        test.a.b.a

        test.a.b.b:
        [rc=1]
        $ kvbroker kvs ls -d L.tovalue
        L.tovalue
        $ kvbroker kvs ls -F L.tovalue
        L.tovalue@
        $ kvbroker kvs ls L.tovalue L.dangling
        L.dangling    L.tovalue
        $ kvbroker kvs ls L.todir
        b
        $ kvbroker kvs ls -R L.todir
        L.todir:
        b
        $ kvbroker kvs ls L.foo L.dir L.todir
        L.foo

        L.dir:
        b

        L.todir:
        b
        $ kvbroker kvs ls --json L
        {"keys": [], "dirs": {"L": [{"name": "dangling", "kind": "symlink"}, {"name": "dir", "kind": "dir"}, {"name": "foo", "kind": "value"}, {"name": "todir", "kind": "symlink"}, {"name": "tovalue", "kind": "symlink"}]}}
        """)


# ================================================================ other writes


async def test_unlink_mkdir_link_readlink(start_instance) -> None:
    inst = await start_instance(size=1)
    out = await sh(inst, """
        D=u
        t kvbroker kvs unlink NOT.A.KEY
        t kvbroker kvs unlink -f NOT.A.KEY
        t kvbroker kvs unlink -Rf NOT.A.KEY
        t kvbroker kvs mkdir $D.d1 $D.d2
        kvbroker kvs put $D.d1.x=1
        t kvbroker kvs unlink $D
        t kvbroker kvs unlink $D.d2
        t kvbroker kvs unlink -R $D
        t kvbroker kvs dir $D
        kvbroker kvs link invalid $D.l1
        kvbroker kvs link $D.b $D.a
        kvbroker kvs link $D.a $D.b
        t kvbroker kvs get $D.a
        t kvbroker kvs unlink $D.l1 $D.a $D.b
        t kvbroker kvs dir $D
        V=$(kvbroker kvs version)
        [ "$(kvbroker kvs mkdir -s $D.m)" -eq $((V + 1)) ] && echo mkdir -s ok
        [ "$(kvbroker kvs link -s $D.m $D.ml)" -eq $((V + 2)) ] && echo link -s ok
        [ "$(kvbroker kvs unlink -s $D.ml)" -eq $((V + 3)) ] && echo unlink -s ok
        [ "$(kvbroker kvs mkdir -b $D.m2)" = "$(kvbroker kvs getroot -b)" ] && echo mkdir -b ok
        [ "$(kvbroker kvs link -O $D.m2 $D.ml)" = "$(kvbroker kvs getroot)" ] && echo link -O ok
        [ "$(kvbroker kvs unlink -O $D.ml)" = "$(kvbroker kvs getroot)" ] && echo unlink -O ok
        kvbroker kvs put $D.target=foo $D.t2=bar
        t kvbroker kvs link $D.target $D.link
        t kvbroker kvs link $D.t2 $D.link2
        t kvbroker kvs get $D.link
        t kvbroker kvs readlink $D.link $D.link2
        t kvbroker kvs link -T nsx $D.target $D.nslink
        t kvbroker kvs readlink $D.nslink
        t kvbroker kvs readlink -o $D.nslink $D.link
        t kvbroker kvs readlink -k $D.nslink
        t kvbroker kvs readlink $D.target
        t kvbroker kvs readlink $D.m.
        t kvbroker kvs get $D.nslink
        kvbroker kvs put $D.p.q.r=42
        kvbroker kvs link $D.p.q $D.Z.Y
        kvbroker kvs link $D.Z.Y $D.X.W
        t kvbroker kvs get $D.Z.Y.r $D.X.W.r
        t kvbroker kvs put $D.Z.Y.new=1
        t kvbroker kvs get $D.p.q.new
        ROOT=$(kvbroker kvs getroot)
        kvbroker kvs unlink -R $D.Z
        t kvbroker kvs readlink --at "$ROOT" $D.Z.Y
        L='loop.a={"data":"MQ==","type":"val","ver":1}'; p=a
        for i in b c d e f g h i j k l; do
            L="$L loop.$i="'{"data":{"target":"'loop.$p'"},"type":"symlink","ver":1}'; p=$i
        done
        kvbroker kvs put -t $L
        t kvbroker kvs get loop.k
        t kvbroker kvs get loop.l
        t kvbroker kvs link only-one
        """)
    assert out == expect("""
        $ kvbroker kvs unlink NOT.A.KEY
        kvbroker: cannot unlink 'NOT.A.KEY': No such file or directory
        [rc=1]
        $ kvbroker kvs unlink -f NOT.A.KEY
        $ kvbroker kvs unlink -Rf NOT.A.KEY
        $ kvbroker kvs mkdir u.d1 u.d2
        $ kvbroker kvs unlink u
        kvbroker: cannot unlink 'u': Directory not empty
        [rc=1]
        $ kvbroker kvs unlink u.d2
        $ kvbroker kvs unlink -R u
        $ kvbroker kvs dir u
        kvbroker: u: No such file or directory
        [rc=1]
        $ kvbroker kvs get u.a
        kvbroker: u.a: Too many levels of symbolic links
        [rc=1]
        $ kvbroker kvs unlink u.l1 u.a u.b
        $ kvbroker kvs dir u
        mkdir -s ok
        link -s ok
        unlink -s ok
        mkdir -b ok
        link -O ok
        unlink -O ok
        $ kvbroker kvs link u.target u.link
        $ kvbroker kvs link u.t2 u.link2
        $ kvbroker kvs get u.link
        foo
        $ kvbroker kvs readlink u.link u.link2
        u.target
        u.t2
        $ kvbroker kvs link -T nsx u.target u.nslink
        $ kvbroker kvs readlink u.nslink
        nsx::u.target
        $ kvbroker kvs readlink -o u.nslink u.link
        nsx
        u.target
        $ kvbroker kvs readlink -k u.nslink
        u.target
        $ kvbroker kvs readlink u.target
        kvbroker: u.target: Invalid argument
        [rc=1]
        $ kvbroker kvs readlink u.m.
        kvbroker: u.m.: Invalid argument
        [rc=1]
        $ kvbroker kvs get u.nslink
        kvbroker: u.nslink: Operation not supported (...)
        [rc=1]
        $ kvbroker kvs get u.Z.Y.r u.X.W.r
        42
        42
        $ kvbroker kvs put u.Z.Y.new=1
        $ kvbroker kvs get u.p.q.new
        1
        $ kvbroker kvs readlink --at {"data":["REF"],"type":"dirref","ver":1} u.Z.Y
        u.p.q
        $ kvbroker kvs get loop.k
        1
        $ kvbroker kvs get loop.l
        kvbroker: loop.l: Too many levels of symbolic links
        [rc=1]
        $ kvbroker kvs link only-one
        """) + _usage_tail(out)


async def test_unlink_root_is_einval(start_instance) -> None:
    """``unlink .`` said Directory not empty, ``unlink -R .`` Invalid argument:
    both are EINVAL now, with one message, and nothing is removed."""
    inst = await start_instance(size=1)
    await kvs(inst, "put", "a=1")
    msg = "kvbroker: cannot unlink '{}': Invalid argument (cannot unlink the root directory)\n"
    for args in ([], ["-R"], ["-f"], ["-Rf"]):
        for key in (".", "..", ""):
            res = await kvs(inst, "unlink", *args, key)
            assert (res.rc, res.err) == (1, msg.format(key)), (args, key)
    res = await kvs(inst, "unlink", "a", ".")  # one transaction: a stays
    assert res.rc == 1 and (await kvs(inst, "get", "a")).text == "1\n"


def _usage_tail(out: str) -> str:
    """argparse's usage error for ``link only-one`` (exit status 2)."""
    tail = out.split("$ kvbroker kvs link only-one\n", 1)[1]
    assert "usage: kvbroker kvs link" in tail and tail.endswith("[rc=2]\n"), tail
    return tail


async def test_copy_move(start_instance) -> None:
    inst = await start_instance(size=1)
    out = await sh(inst, """
        D=c
        kvbroker kvs mkdir $D.a
        kvbroker kvs link $D.a $D.link
        kvbroker kvs put $D.a.X=42
        t kvbroker kvs copy $D.a $D.link
        t kvbroker kvs readlink $D.link
        t kvbroker kvs get $D.link.X
        t kvbroker kvs unlink -R $D.link
        kvbroker kvs link $D.a $D.link
        t kvbroker kvs move $D.a $D.link
        t kvbroker kvs get $D.link.X
        t kvbroker kvs dir $D.a
        kvbroker kvs put $D.b.X=1
        kvbroker kvs link $D.b $D.bl
        t kvbroker kvs copy $D.bl $D.copy
        t kvbroker kvs readlink $D.copy
        t kvbroker kvs namespace create other
        t kvbroker kvs copy -D other $D.b in.other
        t kvbroker kvs get -N other in.other.X
        t kvbroker kvs move -S other -D primary in.other $D.back
        t kvbroker kvs get $D.back.X
        t kvbroker kvs get -N other in.other
        t kvbroker kvs copy $D.nope $D.x
        t kvbroker kvs move $D.b $D.b
        """)
    assert out == expect("""
        $ kvbroker kvs copy c.a c.link
        $ kvbroker kvs readlink c.link
        kvbroker: c.link: Invalid argument
        [rc=1]
        $ kvbroker kvs get c.link.X
        42
        $ kvbroker kvs unlink -R c.link
        $ kvbroker kvs move c.a c.link
        $ kvbroker kvs get c.link.X
        42
        $ kvbroker kvs dir c.a
        kvbroker: c.a: No such file or directory
        [rc=1]
        $ kvbroker kvs copy c.bl c.copy
        $ kvbroker kvs readlink c.copy
        c.b
        $ kvbroker kvs namespace create other
        $ kvbroker kvs copy -D other c.b in.other
        $ kvbroker kvs get -N other in.other.X
        1
        $ kvbroker kvs move -S other -D primary in.other c.back
        $ kvbroker kvs get c.back.X
        1
        $ kvbroker kvs get -N other in.other
        kvbroker: in.other: No such file or directory
        [rc=1]
        $ kvbroker kvs copy c.nope c.x
        kvbroker: copy: No such file or directory (...)
        [rc=1]
        $ kvbroker kvs move c.b c.b
        kvbroker: move: Invalid argument (...)
        [rc=1]
        """)



async def test_copy_move_take_namespace_for_both(start_instance) -> None:
    """-N NS is SRC's and DST's namespace (was: "unrecognized arguments");
    an explicit -S or -D wins; $KVBROKER_NAMESPACE as for every subcommand."""
    inst = await start_instance(size=1)
    out = await sh(inst, """
        kvbroker kvs namespace create one two
        kvbroker kvs put -N one a=1
        t kvbroker kvs copy -N one a b
        t kvbroker kvs get -N one b
        t kvbroker kvs move -N one -D two b c
        t kvbroker kvs get -N two c
        t kvbroker kvs copy -N two -S one a d
        t kvbroker kvs get -N two d
        t kvbroker kvs get -N one b
        KVBROKER_NAMESPACE=two t kvbroker kvs move c e
        t kvbroker kvs get -N two e
        """)
    assert out == expect("""
        $ kvbroker kvs copy -N one a b
        $ kvbroker kvs get -N one b
        1
        $ kvbroker kvs move -N one -D two b c
        $ kvbroker kvs get -N two c
        1
        $ kvbroker kvs copy -N two -S one a d
        $ kvbroker kvs get -N two d
        1
        $ kvbroker kvs get -N one b
        kvbroker: b: No such file or directory
        [rc=1]
        $ kvbroker kvs move c e
        $ kvbroker kvs get -N two e
        1
        """)

async def test_move_into_own_subtree_is_refused(start_instance) -> None:
    """``move a a.sub`` used to exit 0 with both a and a.sub gone."""
    inst = await start_instance(size=1)
    await kvs(inst, "put", "a.b=1", "a.c=hello")
    res = await kvs(inst, "move", "a", "a.sub")
    assert (res.rc, res.err) == (1, "kvbroker: move: Invalid argument (cannot move 'a' to "
                                    "a subdirectory of itself, 'a.sub')\n")
    res = await kvs(inst, "move", "a", "a")
    assert res.rc == 1 and res.err.startswith("kvbroker: move: Invalid argument (")
    res = await kvs(inst, "copy", "a", "a.snap")  # a snapshot: harmless
    assert res.rc == 0
    res = await kvs(inst, "dir", "-R", "a")
    assert res.text == "a.b = 1\na.c = hello\na.snap.b = 1\na.snap.c = hello\n"


@pytest.mark.both_loops
async def test_run_reads_a_command_that_ended_before_its_input_was_written() -> None:
    """The helper every command here goes through: a command that ends
    before its (empty) input is written still gives its status and output.
    CI once failed ``kvs put`` this way: uvloop closes the stdin transport
    when it sees the command go, and the stdlib's ``communicate`` then
    raised RuntimeError writing ``b""`` to it."""
    proc = await asyncio.create_subprocess_exec(
        "sh", "-c", "echo done; exit 3", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdin is not None
    await proc.wait()
    if loop_name(asyncio.get_running_loop()) == "uvloop":
        async with asyncio.timeout(T):  # the state CI met
            while not proc.stdin.transport.is_closing():
                await asyncio.sleep(0.01)
    out, err = await asyncio.wait_for(communicate(proc, b""), T)
    assert (proc.returncode, out, err) == (3, b"done\n", b"")


# ================================================================ versions, roots, namespaces


async def test_version_wait_getroot(start_instance) -> None:
    inst = await start_instance(size=4, fanout=2)
    v0 = int((await kvs(inst, "version")).out)
    waiter = asyncio.ensure_future(kvs(inst, "wait", str(v0 + 2), rank=3))
    assert (await kvs(inst, "put", "w.a=1", rank=2)).rc == 0
    assert not waiter.done()  # still one version short (never a false failure)
    assert (await kvs(inst, "put", "w.a=2", rank=1)).rc == 0
    assert (await waiter).rc == 0
    out = await sh(inst, f"""
        for r in 1 2 3; do on $r kvbroker kvs wait {v0 + 2} && on $r kvbroker kvs get w.a; done
        ROOT=$(kvbroker kvs getroot)
        kvbroker kvs put w.a=3
        t kvbroker kvs get --at "$ROOT" w.a
        S1=$(kvbroker kvs getroot --sequence); B1=$(kvbroker kvs getroot -b)
        kvbroker kvs put w.b=1
        S2=$(kvbroker kvs getroot -s); B2=$(kvbroker kvs getroot --blobref)
        [ $S1 -lt $S2 ] && [ $B1 != $B2 ] && echo getroot changes
        [ "$(kvbroker kvs getroot -o)" -eq "$(id -u)" ] && echo owner ok
        [ "$(kvbroker kvs getroot)" = '{{"data":["'$B2'"],"type":"dirref","ver":1}}' ] &&
            echo treeobj ok
        [ "$(kvbroker kvs getroot -b)" = "$(kvbroker kvs get -t . | cut -d'"' -f4)" ] &&
            echo get -t . ok
        t kvbroker kvs namespace create ns1
        t kvbroker kvs getroot -N ns1 -s
        t kvbroker kvs version -N ns1
        t kvbroker kvs put -N ns1 k=v
        t kvbroker kvs getroot --namespace=ns1 --sequence
        t kvbroker kvs version -N nsbad
        t kvbroker kvs wait -N nsbad 1
        t kvbroker kvs getroot -N nsbad
        """)
    assert out.startswith("2\n2\n2\n")
    assert out[6:] == expect("""
        $ kvbroker kvs get --at {"data":["REF"],"type":"dirref","ver":1} w.a
        2
        getroot changes
        owner ok
        treeobj ok
        get -t . ok
        $ kvbroker kvs namespace create ns1
        $ kvbroker kvs getroot -N ns1 -s
        0
        $ kvbroker kvs version -N ns1
        0
        $ kvbroker kvs put -N ns1 k=v
        $ kvbroker kvs getroot --namespace=ns1 --sequence
        1
        $ kvbroker kvs version -N nsbad
        kvbroker: kvs version: Operation not supported (...)
        [rc=1]
        $ kvbroker kvs wait -N nsbad 1
        kvbroker: kvs wait: Operation not supported (...)
        [rc=1]
        $ kvbroker kvs getroot -N nsbad
        kvbroker: kvs getroot: Operation not supported (...)
        [rc=1]
        """)
    js = json.loads((await kvs(inst, "getroot", "--json", rank=2)).out)
    assert set(js) == {"namespace", "owner", "rootseq", "rootref", "flags"}
    assert js["namespace"] == "primary" and js["rootseq"] == v0 + 4
    assert treeobj.dirref(js["rootref"])  # a well-formed blobref


async def test_wait_negative_version_is_a_usage_error(start_instance) -> None:
    inst = await start_instance(size=1)
    for v in ("-5", "-1", "x"):
        res = await kvs(inst, "wait", v)
        assert res.rc == 2 and "usage: kvbroker kvs wait" in res.err, v
        assert "argument VERSION" in res.err, v
    assert (await kvs(inst, "wait", "0")).rc == 0



async def test_dropcache_this_rank_or_all(start_instance, connect) -> None:
    """``kvs dropcache`` empties this rank's kvs cache; ``--all`` every rank's
    (as flux kvs dropcache [--all]); reads then fetch what they need again."""
    inst = await start_instance(size=3)
    h = await connect(inst, 0)

    async def cached(rank: int) -> int:
        st = await asyncio.wait_for(h.rpc("kvs.stats-get", {}, nodeid=rank), T)
        return int(st["cache"]["blobs"])

    assert (await kvs(inst, "put", "a.b=1", "a.c=2")).rc == 0
    for rank in (0, 2):
        assert (await kvs(inst, "get", "a.b", rank=rank)).text == "1\n"
    assert [await cached(r) > 0 for r in (0, 2)] == [True, True]
    res = await kvs(inst, "dropcache")
    assert (res.rc, res.text, res.err) == (0, "", "")
    assert (await cached(0), await cached(2) > 0) == (0, True)  # rank 0 only
    res = await kvs(inst, "dropcache", "--all", rank=2)
    assert (res.rc, res.text, res.err) == (0, "", "")
    assert [await cached(r) for r in (0, 1, 2)] == [0, 0, 0]
    assert (await kvs(inst, "get", "a.c", rank=2)).text == "2\n"
    res = await kvs(inst, "dropcache", "extra")
    assert res.rc == 2 and res.err.startswith("usage: kvbroker kvs dropcache")

def ns_row(name: str, owner: int) -> str:
    """A ``namespace list`` row, as flux's ``%-36s %10u 0x%08X``."""
    return f"{name:<36} {owner:>10} 0x00000000"


async def test_namespaces(start_instance) -> None:
    inst = await start_instance(size=4, fanout=2)
    out = await sh(inst, """
        t kvbroker kvs namespace create nsA nsB
        t on 1 kvbroker kvs namespace create nsR1
        t kvbroker kvs namespace create -o 9999 nsU
        t kvbroker kvs namespace create nsA
        t on 2 kvbroker kvs namespace create nsA
        t kvbroker kvs namespace create primary
        t kvbroker kvs namespace remove primary
        t kvbroker kvs namespace remove never-made
        t kvbroker kvs namespace create 'bad name'
        t kvbroker kvs namespace list
        kvbroker kvs put k=primary
        kvbroker kvs put -N nsA k=A
        KVBROKER_NAMESPACE=nsB kvbroker kvs put k=B
        t kvbroker kvs get k
        t kvbroker kvs get -N nsA k
        t kvbroker kvs get -N nsB k
        t env KVBROKER_NAMESPACE=nsA kvbroker kvs get k
        t env KVBROKER_NAMESPACE=nsBAD kvbroker kvs get -N nsB k
        t env KVBROKER_NAMESPACE=nsBAD kvbroker kvs get k
        t on 3 kvbroker kvs get -N nsA k
        t kvbroker kvs put -N nsBAD k=1
        t on 1 kvbroker kvs put -N nsBAD k=1
        t kvbroker kvs namespace create -r "$(kvbroker kvs getroot -b -N nsA)" nsC
        t kvbroker kvs get -N nsC k
        kvbroker kvs mkdir -N nsA L.b
        kvbroker kvs link -N nsA b L.c
        kvbroker kvs link -N nsA -T foo c L.d
        t kvbroker kvs ls -N nsA -1F L
        t kvbroker kvs namespace remove nsA nsB nsR1 nsC
        t kvbroker kvs get -N nsA k
        # rank 0 published "removed" before this setroot: once rank 3 has the
        # setroot, it has dropped nsA too
        V=$(kvbroker kvs put -s sync=1)
        on 3 kvbroker kvs wait $V
        t on 3 kvbroker kvs get -N nsA k
        t kvbroker kvs namespace list
        """)
    uid = os.getuid()
    assert out == expect(f"""
        $ kvbroker kvs namespace create nsA nsB
        $ on 1 kvbroker kvs namespace create nsR1
        $ kvbroker kvs namespace create -o 9999 nsU
        $ kvbroker kvs namespace create nsA
        kvbroker: nsA: File exists (...)
        [rc=1]
        $ on 2 kvbroker kvs namespace create nsA
        kvbroker: nsA: File exists (...)
        [rc=1]
        $ kvbroker kvs namespace create primary
        kvbroker: primary: File exists (...)
        [rc=1]
        $ kvbroker kvs namespace remove primary
        kvbroker: primary: Operation not supported (...)
        [rc=1]
        $ kvbroker kvs namespace remove never-made
        $ kvbroker kvs namespace create bad name
        kvbroker: bad name: Invalid argument (...)
        [rc=1]
        $ kvbroker kvs namespace list
        NAMESPACE                                 OWNER      FLAGS
        {ns_row("primary", uid)}
        {ns_row("nsA", uid)}
        {ns_row("nsB", uid)}
        {ns_row("nsR1", uid)}
        {ns_row("nsU", 9999)}
        $ kvbroker kvs get k
        primary
        $ kvbroker kvs get -N nsA k
        A
        $ kvbroker kvs get -N nsB k
        B
        $ env KVBROKER_NAMESPACE=nsA kvbroker kvs get k
        A
        $ env KVBROKER_NAMESPACE=nsBAD kvbroker kvs get -N nsB k
        B
        $ env KVBROKER_NAMESPACE=nsBAD kvbroker kvs get k
        kvbroker: k: Operation not supported (...)
        [rc=1]
        $ on 3 kvbroker kvs get -N nsA k
        A
        $ kvbroker kvs put -N nsBAD k=1
        kvbroker: k: Operation not supported (...)
        [rc=1]
        $ on 1 kvbroker kvs put -N nsBAD k=1
        kvbroker: k: Operation not supported (...)
        [rc=1]
        $ kvbroker kvs namespace create -r REF nsC
        $ kvbroker kvs get -N nsC k
        A
        $ kvbroker kvs ls -N nsA -1F L
        b.
        c@
        d@
        $ kvbroker kvs namespace remove nsA nsB nsR1 nsC
        $ kvbroker kvs get -N nsA k
        kvbroker: k: Operation not supported (...)
        [rc=1]
        $ on 3 kvbroker kvs get -N nsA k
        kvbroker: k: Operation not supported (...)
        [rc=1]
        $ kvbroker kvs namespace list
        NAMESPACE                                 OWNER      FLAGS
        {ns_row("primary", uid)}
        {ns_row("nsU", 9999)}
        """)
    listed = json.loads((await kvs(inst, "namespace", "list", "--json")).out)
    assert [(n["namespace"], n["owner"]) for n in listed] == [("primary", uid), ("nsU", 9999)]


# A kvbroker CLI run as uid 65534.  The interpreter and the checkout may live
# where that user cannot read (a 0700 home or temp directory), so the wrapper
# starts as root, imports the CLI and everything it loads lazily, then drops
# to the guest's uid before it connects: the broker sees a real other user.
_GUEST_WRAPPER = (
    "import os, sys, json, base64, time, signal, datetime, shutil, textwrap\n"
    "from broker import cli\n"
    + GUEST_CLI_PRELOAD +
    "import kvs.cli, kvs.client, kvs.eventlog, kvs_watch.cli, kvs_watch.client\n"
    "parser = cli.build_parser()\n"
    "cli.build_parser = lambda *_: parser  # entry points are unreadable after the drop\n"
    "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
    + GUEST_IMPORT_GUARD +
    "sys.argv[0] = 'kvbroker'\n"
    "sys.exit(cli.main(sys.argv[1:]))\n"
)
GUEST = [sys.executable, "-c", shlex.quote(_GUEST_WRAPPER)]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a guest")
async def test_guest(start_instance) -> None:
    """A client under another uid (flux-core t1005-kvs-security.t shapes)."""
    inst = await start_instance(size=2, attrs={"access.allow-guest-user": "true"})
    out = await sh(inst, f"""
        g() {{ shift; {" ".join(GUEST)} "$@"; }}
        kvbroker kvs namespace create -o 65534 gns
        kvbroker kvs namespace create ownerns
        kvbroker kvs put -N ownerns k=1
        t g kvbroker kvs namespace create x
        t g kvbroker kvs namespace remove gns
        t g kvbroker kvs namespace list
        t g kvbroker kvs put -N ownerns k=2
        t g kvbroker kvs get -N ownerns k
        t g kvbroker kvs version -N ownerns
        t g kvbroker kvs get k
        t g kvbroker kvs put -N gns k=mine
        t g kvbroker kvs get -N gns k
        t g kvbroker kvs mkdir -N gns d
        t g kvbroker kvs link -N gns k l
        t g kvbroker kvs eventlog append -N gns -t 1 log hello
        t g kvbroker kvs eventlog get -N gns log
        t g kvbroker kvs unlink -N gns d
        t g kvbroker kvs dir -N gns
        t kvbroker kvs get -N gns k
        """)
    assert out == expect("""
        $ g kvbroker kvs namespace create x
        kvbroker: x: Operation not permitted (...)
        [rc=1]
        $ g kvbroker kvs namespace remove gns
        kvbroker: gns: Operation not permitted (...)
        [rc=1]
        $ g kvbroker kvs namespace list
        kvbroker: kvs namespace list: Operation not permitted (...)
        [rc=1]
        $ g kvbroker kvs put -N ownerns k=2
        kvbroker: k: Operation not permitted (...)
        [rc=1]
        $ g kvbroker kvs get -N ownerns k
        kvbroker: k: Operation not permitted (...)
        [rc=1]
        $ g kvbroker kvs version -N ownerns
        kvbroker: kvs version: Operation not permitted (...)
        [rc=1]
        $ g kvbroker kvs get k
        kvbroker: k: Operation not permitted (...)
        [rc=1]
        $ g kvbroker kvs put -N gns k=mine
        $ g kvbroker kvs get -N gns k
        mine
        $ g kvbroker kvs mkdir -N gns d
        $ g kvbroker kvs link -N gns k l
        kvbroker: l: Operation not permitted (...)
        [rc=1]
        $ g kvbroker kvs eventlog append -N gns -t 1 log hello
        $ g kvbroker kvs eventlog get -N gns log
        1.000000 hello
        $ g kvbroker kvs unlink -N gns d
        $ g kvbroker kvs dir -N gns
        k = mine
        log = {"timestamp":1.0,"name":"hello"}
        $ kvbroker kvs get -N gns k
        mine
        """)
    guest = [sys.executable, "-c", _GUEST_WRAPPER]
    res = await run([*guest, "kvs", "get", "-N", "gns", "k"], client_env(inst.uri(1)))
    assert (res.rc, res.out) == (0, b"mine\n")
    res = await run([*guest, "kvs", "get", "-N", "ownerns", "k"], client_env(inst.uri(1)))
    assert res.rc == 1 and "Operation not permitted" in res.err
    # the default namespace is the owner's: a guest that forgot -N is told
    res = await run([*guest, "kvs", "get", "k"], client_env(inst.uri(1)))
    assert (res.rc, res.err) == (1, "kvbroker: k: Operation not permitted (namespace primary "
                                    "belongs to another user: a guest works in the namespaces "
                                    "it owns: -N NS, or $KVBROKER_NAMESPACE)\n"), res.err
    for cmd in (["ls"], ["dir"], ["put", "a=1"]):  # (only get's said so)
        res = await run([*guest, "kvs", *cmd], client_env(inst.uri(1)))
        assert res.rc == 1 and "a guest works in the namespaces it owns: -N NS" in res.err, (
            cmd, res.err)


# ================================================================ eventlogs


async def test_eventlog_color_takes_when_only_attached(start_instance) -> None:
    """As Flux's optparse (t1008 "forces color on"): ``-Lalways`` and
    ``--color`` before KEY turn color on; argparse refused the first and
    read KEY as WHEN in the second."""
    inst = await start_instance(size=1)
    out = await sh(inst, """
        kvbroker kvs eventlog append lg ev '{"a":1}'
        for opt in -Lalways --color -L --color=always; do
            kvbroker kvs eventlog get $opt lg | grep -c "$(printf '\\033')" || echo "no color: $opt"
            kvbroker kvs eventlog wait-event $opt lg ev | grep -c "$(printf '\\033')" || echo "no color: $opt"
        done
        t kvbroker kvs eventlog get -Lnever lg
        """)
    assert "no color" not in out, out
    # CONTEXT is optional: not listed among the missing arguments
    res = await run([KVB, "kvs", "eventlog", "append"], client_env(inst.uri(0)))
    assert res.rc == 2 and res.err.strip().endswith("required: KEY, NAME"), res.err
    assert out.endswith("$ kvbroker kvs eventlog get -Lnever lg\n" + out.splitlines()[-1] + "\n")
    assert "\033" not in out.splitlines()[-1] and out.splitlines()[-1].endswith("ev a=1")


async def test_mkdir_names_the_key_it_refuses(start_instance) -> None:
    """Its refusal of an overlong name said "kvs:", not which key; and the
    key is named by its start (the message says its length), not printed
    whole twice: a 2,000-byte key made a 2,130-character line."""
    inst = await start_instance(size=1)
    key = "t" * 1025
    res = await kvs(inst, "mkdir", "ok", key)
    start = "t" * 32 + "..."
    assert res.rc == 1 and res.err.startswith(f"kvbroker: {start}: File name too long ("
                                              f"{start}: key component of 1025 bytes"), res.err
    res = await kvs(inst, "put", "k" * 2000 + "=1")
    assert res.rc == 1 and len(res.err) < 200 and "2000 bytes" in res.err, res.err


async def test_eventlog_keeps_to_json_and_shows_any_timestamp(start_instance) -> None:
    """``NaN`` and ``Infinity`` were written into an eventlog (Python's json
    writes them; no RFC 18 reader takes them), and ``--human`` died with a
    traceback on a timestamp no date has."""
    inst = await start_instance(size=1)
    out = await sh(inst, """
        t kvbroker kvs eventlog append test.nan a '{"x":NaN}'
        t kvbroker kvs eventlog append test.nan a '{"x":1e400}'
        t kvbroker kvs eventlog get test.nan
        printf '{"timestamp":1e300,"name":"far"}\\n' | kvbroker kvs put -r test.far=-
        t kvbroker kvs eventlog get --human test.far
        t kvbroker kvs eventlog wait-event --human test.far far
        """)
    assert out == expect("""
        $ kvbroker kvs eventlog append test.nan a {"x":NaN}
        kvbroker: test.nan: Invalid argument (...)
        [rc=1]
        $ kvbroker kvs eventlog append test.nan a {"x":1e400}
        kvbroker: test.nan: Invalid argument (...)
        [rc=1]
        $ kvbroker kvs eventlog get test.nan
        kvbroker: test.nan: No such file or directory
        [rc=1]
        $ kvbroker kvs eventlog get --human test.far
        [1e+300] far
        $ kvbroker kvs eventlog wait-event --human test.far far
        [1e+300] far
        """)


async def test_eventlog(start_instance) -> None:
    inst = await start_instance(size=2)
    out = await sh(inst, """
        t kvbroker kvs eventlog append --timestamp=1 test.a name '{"data":"foo"}'
        t kvbroker kvs eventlog get --unformatted test.a
        t kvbroker kvs eventlog get test.a
        t kvbroker kvs get test.a
        t kvbroker kvs eventlog wait-event -u test.a name
        t kvbroker kvs get -W test.a
        t kvbroker kvs eventlog append test.b foo
        kvbroker kvs eventlog get test.b | grep -q '^[0-9]*\\.[0-9]\\{6\\} foo$' && echo now ok
        t kvbroker kvs eventlog append -t 120 test.human primus
        t kvbroker kvs eventlog append -t 121 test.human secondus '{"n":' 1 '}'
        t on 1 kvbroker kvs eventlog get --human test.human
        kvbroker kvs eventlog get -L test.human | grep -q "$(printf '\\033\\[')" && echo color ok
        kvbroker kvs eventlog get --color=never test.human | grep -q "$(printf '\\033')" ||
            echo no color ok
        t kvbroker kvs eventlog append test.bad foo not_a_object
        t kvbroker kvs eventlog append test.bad foo '[1]'
        t kvbroker kvs eventlog append test.bad ''
        t kvbroker kvs put test.noteventlog=foo
        t kvbroker kvs eventlog get test.noteventlog
        kvbroker kvs eventlog get test.noteventlog 2>&1 | grep -c 'cannot decode improperly'
        t kvbroker kvs eventlog get test.missing
        t kvbroker kvs namespace create EVNS
        t kvbroker kvs eventlog append test.ns main
        t kvbroker kvs eventlog append --namespace=EVNS test.ns guest
        kvbroker kvs eventlog get test.ns | grep -c main
        kvbroker kvs eventlog get -N EVNS test.ns | grep -c guest
        t kvbroker kvs eventlog get
        """)
    assert out == expect("""
        $ kvbroker kvs eventlog append --timestamp=1 test.a name {"data":"foo"}
        $ kvbroker kvs eventlog get --unformatted test.a
        {"timestamp":1.0,"name":"name","context":{"data":"foo"}}
        $ kvbroker kvs eventlog get test.a
        1.000000 name data="foo"
        $ kvbroker kvs get test.a
        {"timestamp":1.0,"name":"name","context":{"data":"foo"}}

        $ kvbroker kvs eventlog wait-event -u test.a name
        {"timestamp":1.0,"name":"name","context":{"data":"foo"}}
        $ kvbroker kvs get -W test.a
        {"timestamp":1.0,"name":"name","context":{"data":"foo"}}

        $ kvbroker kvs eventlog append test.b foo
        now ok
        $ kvbroker kvs eventlog append -t 120 test.human primus
        $ kvbroker kvs eventlog append -t 121 test.human secondus {"n": 1 }
        $ on 1 kvbroker kvs eventlog get --human test.human
        [Jan01 00:02] primus
        [  +1.000000] secondus n=1
        color ok
        no color ok
        $ kvbroker kvs eventlog append test.bad foo not_a_object
        kvbroker: test.bad: Invalid argument (...)
        [rc=1]
        $ kvbroker kvs eventlog append test.bad foo [1]
        kvbroker: test.bad: Invalid argument (...)
        [rc=1]
        $ kvbroker kvs eventlog append test.bad<sp>
        kvbroker: test.bad: Invalid argument (...)
        [rc=1]
        $ kvbroker kvs put test.noteventlog=foo
        $ kvbroker kvs eventlog get test.noteventlog
        kvbroker: test.noteventlog: Invalid argument (...)
        [rc=1]
        1
        $ kvbroker kvs eventlog get test.missing
        kvbroker: test.missing: No such file or directory
        [rc=1]
        $ kvbroker kvs namespace create EVNS
        $ kvbroker kvs eventlog append test.ns main
        $ kvbroker kvs eventlog append --namespace=EVNS test.ns guest
        1
        1
        $ kvbroker kvs eventlog get
        """) + _eventlog_usage(out)


def _eventlog_usage(out: str) -> str:
    tail = out.split("$ kvbroker kvs eventlog get\n", 1)[1]
    assert "usage: kvbroker kvs eventlog get" in tail and tail.endswith("[rc=2]\n"), tail
    return tail


# ================================================================ delegation and plumbing


FAKE_WATCH = '''
import json
def _show(name, args):
    print(name, json.dumps({k: v for k, v in sorted(vars(args).items())
                            if not callable(v)}, sort_keys=True))
    return 3
def watch_get(args): return _show("watch_get", args)
def eventlog_get(args): return _show("eventlog_get", args)
def eventlog_wait_event(args): return _show("eventlog_wait_event", args)
'''


async def test_watch_options_are_delegated(start_instance, tmp_path: Path) -> None:
    """get -w/-W/-S and eventlog get -w / wait-event go to kvs_watch.cli."""
    inst = await start_instance(size=1)
    fake = tmp_path / "kvs_watch"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "cli.py").write_text(FAKE_WATCH)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "KVBROKER_NAMESPACE": "envns"}

    res = await kvs(inst, "get", "-w", "-c", "2", "-u", "-A", "-f", "-l", "a", "b", **env)
    name, _, doc = res.text.partition(" ")
    args = json.loads(doc)
    assert res.rc == 3 and name == "watch_get"
    assert args["keys"] == ["a", "b"] and args["namespace"] == "envns"
    assert (args["watch"], args["count"], args["uniq"], args["append"], args["full"],
            args["label"], args["waitcreate"], args["stream"]) == \
        (True, 2, True, True, True, True, False, False)
    for opt in ("-W", "-S"):
        res = await kvs(inst, "get", opt, "-N", "x", "k", **env)
        assert res.text.startswith("watch_get ") and json.loads(res.text[10:])["namespace"] == "x"
    res = await kvs(inst, "eventlog", "get", "-w", "-c", "1", "-u", "log", **env)
    assert res.text.startswith("eventlog_get ")
    args = json.loads(res.text.split(" ", 1)[1])
    assert (args["key"], args["count"], args["unformatted"]) == ("log", 1, True)
    res = await kvs(inst, "eventlog", "wait-event", "-t", "0.5", "-W", "-v", "log", "done",
                    **env)
    args = json.loads(res.text.split(" ", 1)[1])
    assert res.text.startswith("eventlog_wait_event ")
    assert (args["key"], args["event"], args["timeout"], args["waitcreate"],
            args["verbose"], args["quiet"]) == ("log", "done", 0.5, True, True, False)


async def test_errors_without_a_broker(tmp_path: Path) -> None:
    env = client_env(str(tmp_path / "no-such-socket"))
    res = await run([KVB, "kvs", "get", "a"], env)
    assert res.rc == 1
    assert res.err.startswith("kvbroker: kvs get: cannot connect to broker at KVBROKER_URI=")
    res = await run([KVB, "kvs", "eventlog", "wait-event", "log", "x"], env)
    assert res.err.startswith("kvbroker: kvs eventlog wait-event: cannot connect"), res.err
    del env["KVBROKER_URI"]
    res = await run([KVB, "kvs", "version"], env)
    assert res.rc == 1 and res.err.startswith(
        "kvbroker: kvs version: cannot connect to broker: KVBROKER_URI is not set")
    res = await run([KVB, "kvs"], env)
    assert res.rc == 2 and "SUBCOMMAND" in res.err
    res = await run([KVB, "kvs", "--help"], env)
    assert res.rc == 0
    for sub in ("get", "put", "ls", "dir", "unlink", "mkdir", "link", "readlink", "copy",
                "move", "dropcache", "version", "wait", "getroot", "namespace", "eventlog"):
        assert sub in res.text


async def test_recursive_listings_of_a_tree_deeper_than_python_recursion(start_instance) -> None:
    """A commit writes at most 256 levels, but copies nest freely: three
    copies of a 256-deep directory into its own bottom make it 1,021 deep.
    ls -R and dir -R walk it with a stack (they died in RecursionError at
    ~980 levels), and so does the API's Dir.walk."""
    inst = await start_instance(size=1)
    deep = ".".join(f"d{i}" for i in range(256))
    assert (await kvs(inst, "put", f"{deep}=bottom")).rc == 0
    for _ in range(3):
        res = await kvs(inst, "copy", "d0", deep)
        assert res.rc == 0, res.err
    depth = 256 + 3 * 255  # each copy of d0's contents adds d1..d255 below the bottom
    res = await kvs(inst, "dir", "-R", "-w", "0", "d0")
    assert res.rc == 0, res.err[-500:]
    key, _, value = res.text.strip().partition(" = ")
    assert value == "bottom" and len(key.split(".")) == depth
    assert "\n" not in res.text.strip()
    res = await kvs(inst, "ls", "-R", "d0")
    assert res.rc == 0, res.err[-500:]
    labels = [line for line in res.text.splitlines() if line.endswith(":")]
    assert len(labels) == depth - 1 and labels[-1] == key.rpartition(".")[0] + ":"
    async with await Handle.connect(inst.uri(0)) as h:
        found = [k async for k, _ in (await asyncio.wait_for(KVS(h).dir("d0"), T)).walk()]
    assert found == [key]


async def test_namespace_create_takes_what_getroot_prints(start_instance) -> None:
    """-r took only a bare blobref ("invalid blobref" for getroot's default
    output, a dirref tree object); it now takes either, as --at does."""
    inst = await start_instance(size=1)
    out = await sh(inst, """
        kvbroker kvs put a=1
        t kvbroker kvs namespace create -r "$(kvbroker kvs getroot)" snap
        t kvbroker kvs namespace create -r "$(kvbroker kvs getroot -b)" snap2
        t kvbroker kvs get -N snap a
        t kvbroker kvs get -N snap2 a
        t kvbroker kvs namespace create -r '{"data":"x","type":"val","ver":1}' bad
        """)
    assert out == expect("""
        $ kvbroker kvs namespace create -r {"data":["REF"],"type":"dirref","ver":1} snap
        $ kvbroker kvs namespace create -r REF snap2
        $ kvbroker kvs get -N snap a
        1
        $ kvbroker kvs get -N snap2 a
        1
        $ kvbroker kvs namespace create -r {"data":"x","type":"val","ver":1} bad
        kvbroker: bad: Invalid argument (...)
        [rc=1]
        """)


async def test_words_that_are_not_utf8_are_refused_in_one_line(start_instance) -> None:
    """A key, namespace or name that is not UTF-8 (``$'\\xff'`` in a shell)
    reaches Python as surrogate escapes, which no message can carry: every
    such command died with a TypeError traceback.  It is EINVAL in one line
    now, naming the word, exit 1, as flux (jansson packs UTF-8 only).  A
    value is bytes, and is stored as it is."""
    inst = await start_instance(size=1)
    bad = os.fsdecode(b"k\xff")
    env = client_env(inst.uri(0))
    for argv, what in ((["kvs", "get", bad], "kvs get"),
                       (["kvs", "put", f"{bad}=1"], "kvs put"),
                       (["kvs", "get", "-N", bad, "a"], "kvs get"),
                       (["kvs", "ls", bad], "kvs ls"),
                       (["kvs", "get", "-W", "--timeout", "5", bad], "kvs get"),
                       (["kvs", "namespace", "create", bad], "kvs namespace create"),
                       (["attr", "get", bad], "attr get"),
                       (["event", "pub", bad], "event pub")):
        res = await run([KVB, *argv], env)
        assert (res.rc, res.err) == (
            1, f"kvbroker: {what}: Invalid argument ('k\\xff' is not UTF-8 text)\n"), argv
    res = await kvs(inst, "put", f"v={bad}")
    assert res.rc == 0, res.err
    assert (await kvs(inst, "get", "-r", "v")).out == b"k\xff"


async def test_wait_timeout_holds_when_a_rank_on_the_way_is_stopped(start_instance) -> None:
    """``kvs wait -t 1`` on rank 2 of the chain 0-1-2 waited for ever once
    rank 1 was stopped: the rank timed only the wait for the version, not
    the load of the namespace from rank 0 before it.  With rank 2 itself
    stopped, nothing answered the command's -t at all.  Each now ends in
    about a second, saying which (naming the ranks on the way: the message
    named rank 0 alone, which was answering)."""
    inst = await start_instance(size=3, fanout=1)
    pids = inst.pids()
    try:
        await stop_process(pids[1])
        res = await asyncio.wait_for(kvs(inst, "wait", "-t", "1", "5", rank=2), 15)
        assert (res.rc, res.err) == (1, "kvbroker: kvs wait: version 5 not reached in 1 s; "
                                        "this rank is still loading namespace primary from "
                                        "rank 0 by way of rank 1\n")
        await stop_process(pids[2])
        res = await asyncio.wait_for(kvs(inst, "wait", "-t", "1", "5", rank=2), 15)
        assert (res.rc, res.err) == (1, "kvbroker: kvs wait: version 5 not reached in 1 s; "
                                        "the rank did not answer (stopped?)\n")
    finally:
        for pid in pids[1:]:
            os.kill(pid, signal.SIGCONT)


async def test_commands_started_with_standard_streams_closed(start_instance) -> None:
    """Started with descriptor 0 or 1 closed (``<&-``, ``>&-``: a daemon's
    or cron's child), the connection to the broker took it: uvloop then
    aborted the process (SIGABRT, 134) on closing it, the stock loop died
    in a traceback (no ``sys.stdout``).  Output to a closed stream is now
    discarded, as Python does; input from a closed one is EBADF."""
    inst = await start_instance(size=1)
    env = client_env(inst.uri(0))
    assert (await kvs(inst, "put", "a=1")).rc == 0
    for loop in ("uvloop", "asyncio"):
        res = await run(["sh", "-c", f"kvbroker --event-loop {loop} kvs get a >&-"], env)
        assert (res.rc, res.err) == (0, ""), loop
        res = await run(["sh", "-c", f"kvbroker --event-loop {loop} kvs get nokey >&-"], env)
        assert (res.rc, res.err) == (1, "kvbroker: nokey: No such file or directory\n"), loop
        res = await run(["sh", "-c", f"kvbroker --event-loop {loop} kvs put -r b=- <&-"], env)
        assert (res.rc, res.err) == (
            1, "kvbroker: kvs put: standard input: Bad file descriptor\n"), loop
        res = await run(["sh", "-c", f"kvbroker --event-loop {loop} content store <&-"], env)
        assert (res.rc, res.err) == (
            1, "kvbroker: content store: standard input: Bad file descriptor\n"), loop
    assert (await kvs(inst, "get", "b")).rc == 1  # nothing was stored


async def test_get_of_a_directory_says_which_command_reads_one(start_instance):
    """``kvs get DIR`` (etcd's ``get --prefix`` habit) names ``kvs dir``;
    ``kvs get --watch DIR`` names ``kvs watch-keys``: ``Is a directory``
    alone left the user to find them."""
    inst = await start_instance(size=1)
    assert (await kvs(inst, "put", "cfg.db.port=1")).rc == 0
    res = await kvs(inst, "get", "cfg")
    assert (res.rc, res.err) == (1, "kvbroker: cfg: Is a directory "
                                    "(kvbroker kvs dir cfg prints what is below it)\n")
    res = await kvs(inst, "get", "--watch", "--timeout", "20", "cfg")
    assert (res.rc, res.err) == (1, "kvbroker: cfg: Is a directory "
                                    "(kvbroker kvs watch-keys cfg watches what is below it)\n")
    res = await kvs(inst, "get", "cfg.db.port")
    assert (res.rc, res.out) == (0, b"1\n")
    # At an older root the hint reads that root too, and the root's own
    # aside and the hint make one pair of brackets, not two.
    root = (await kvs(inst, "getroot", "-b")).out.decode().strip()
    assert (await kvs(inst, "put", "cfg.db.port=2")).rc == 0
    res = await kvs(inst, "get", "-a", root, "cfg")
    assert (res.rc, res.err) == (1, f"kvbroker: cfg: Is a directory (kvbroker kvs dir -a "
                                    f"{root} cfg prints what is below it)\n")
    res = await kvs(inst, "dir", "-a", root, "cfg")
    assert (res.rc, res.out) == (0, b"cfg.db.\n"), res
    res = await kvs(inst, "get", ".")
    assert (res.rc, res.err) == (1, "kvbroker: .: Is a directory (the root is a directory; "
                                    "kvbroker kvs dir . prints what is below it)\n")


async def test_lease_ids_out_of_range_are_refused_in_one_line(start_instance) -> None:
    """A lease id of 2**64 or more gave a traceback ("payload is not
    msgpack-able: Integer value out of range"); ids are bounded as the
    other integer arguments are."""
    inst = await start_instance(size=1)
    huge = str(1 << 64)
    for args in (("lease", "info", huge), ("lease", "keepalive", huge),
                 ("lease", "revoke", huge), ("put", "--lease", huge, "k=1")):
        res = await kvs(inst, *args)
        assert res.rc == 2 and "Traceback" not in res.err, (args, res.err)
        assert f"must be at most {(1 << 63) - 1}: {huge}" in res.err, (args, res.err)
    res = await kvs(inst, "lease", "revoke", "--", "-1")
    assert res.rc == 2 and "must not be negative: -1" in res.err, res.err
    assert not (await kvs(inst, "get", "k")).rc == 0  # nothing was written


async def test_lease_ttl_is_a_duration_checked_before_anything_is_sent(start_instance) -> None:
    """``lease grant 2m`` as every other timeout takes it (it was "invalid
    float value"); a ttl out of range is a usage error, exit 2, as a bad
    number elsewhere (it was the rank's ``EINVAL``, exit 1)."""
    inst = await start_instance(size=1)
    lease = (await kvs(inst, "lease", "grant", "2m")).out.decode().strip()
    info = json.loads((await kvs(inst, "lease", "info", lease)).out)
    assert info["ttl"] == 120, info
    for bad, says in (("0", "must be 1 to 86400 seconds, not 0"),
                      ("2d", "must be 1 to 86400 seconds, not 172800"),
                      ("10x", "is not a duration")):
        for cmd in (["grant", bad], ["run", bad, "true"]):
            res = await kvs(inst, "lease", *cmd)
            assert res.rc == 2 and says in res.err, (cmd, res)
    listed = json.loads((await kvs(inst, "lease", "list", "--json")).out)
    assert [entry["id"] for entry in listed] == [int(lease)]  # (nothing more granted)


async def test_lease_revoke_of_a_lease_already_gone_fails_unless_forced(start_instance) -> None:
    """``lease revoke`` of a lease that expired or was revoked says so and
    exits 1 (as etcd's); ``-f`` makes that no error, for a shell's exit trap,
    as ``Lease.revoke()`` takes it -- but a lease that is there is still
    revoked with ``-f``, its keys unlinked."""
    inst = await start_instance(size=1)
    lease = (await kvs(inst, "lease", "grant", "30")).out.decode().strip()
    assert (await kvs(inst, "put", "--lease", lease, "held=1")).rc == 0
    assert (await kvs(inst, "lease", "revoke", "-f", lease)).rc == 0
    res = await kvs(inst, "get", "held")
    assert res.rc == 1 and "No such file or directory" in res.err, res
    res = await kvs(inst, "lease", "revoke", lease)
    assert res.rc == 1 and "No such file or directory" in res.err, res
    res = await kvs(inst, "lease", "revoke", "--force", lease)
    assert (res.rc, res.out, res.err) == (0, b"", ""), res


async def test_a_namespace_name_no_namespace_can_have_says_so(start_instance) -> None:
    """``-N 'bad ns'`` read as a missing namespace; it still is one
    (``ENOTSUP``, as Flux's, the same on every rank), but the message says
    what a name may be, so a typo in a job script is not taken for a job
    that is gone.  A valid name that is missing keeps the plain message."""
    inst = await start_instance(size=2)
    for rank in (0, 1):
        res = await kvs(inst, "get", "-N", "bad ns", "a", rank=rank)
        assert res.rc == 1 and "namespace 'bad ns' does not exist: a namespace name is " \
            "1-255 of the letters, digits and _.+@=%,- (not . or ..)" in res.err, (rank, res)
        res = await kvs(inst, "get", "-N", "gone", "a", rank=rank)
        assert res.rc == 1 and res.err.rstrip().endswith("namespace 'gone' does not exist)"), \
            (rank, res)
    res = await kvs(inst, "namespace", "create", "bad/ns")
    assert res.rc == 1 and "invalid namespace name 'bad/ns': a namespace name is" in res.err, res
