"""Client commands against a rank that is stopped (SIGSTOP): a request to it
waits as long as the rank does, so each command that asks a rank and waits
takes ``-t/--timeout`` (docs/cli.md, Conventions): given one, it gives up
within it, exit 1, one line on stderr.  Real ranks, real ``kvbroker``
processes."""

from __future__ import annotations

import asyncio

from test_broker_support import run_cli, stopped


def no_answer(what: str, rank: int | None = 1) -> str:
    who = "no answer" if rank is None else f"rank {rank} did not answer"
    return f"kvbroker: {what}: Connection timed out ({who} in 0.5s: stopped or hung?)\n"


async def test_commands_given_a_timeout_end_when_the_rank_is_stopped(start_instance) -> None:
    """``exec -r 1``, ``attr get/set/list -r 1``, ``rpc -r 1``, ``ping 1``,
    ``module list``, ``stats``, ``logger`` to a stopped rank 1 waited for
    ever, and had no option to bound them: with ``-t 0.5`` each exits 1
    saying which rank did not answer.  Rank 1, running again, answers."""
    inst = await start_instance(size=2)
    uri0 = inst.uri(0)
    pid = inst.pids()[1]
    commands = {
        "exec": ["exec", "-r", "1", "-t", "0.5", "--", "true"],
        "attr get": ["attr", "get", "rank", "-r", "1", "-t", "0.5"],
        "attr set": ["attr", "set", "log.level", "info", "-r", "1", "-t", "0.5"],
        "attr list": ["attr", "list", "-r", "1", "-t", "0.5"],
        "broker.ping": ["rpc", "broker.ping", "{}", "-r", "1", "-t", "0.5"],
        "ping": ["ping", "-t", "0.5", "1"],
        "module list": ["module", "list", "-r", "1", "-t", "0.5"],
        "stats broker": ["stats", "broker", "-r", "1", "-t", "0.5"],
        "logger": ["logger", "-r", "1", "-t", "0.5", "hello"],
    }
    async with stopped(pid):
        results = await asyncio.gather(*(run_cli(*argv, uri=uri0, timeout=30)
                                          for argv in commands.values()))
    for what, (rc, out, err) in zip(commands, results, strict=True):
        assert (what, rc, out, err) == (what, 1, "", no_answer(what))
    rc, out, err = await run_cli("attr", "get", "rank", "-r", "1", "-t", "10", uri=uri0)
    assert (rc, out, err) == (0, "1\n", "")


async def test_watch_keys_timeout_holds_for_a_stopped_rank_and_a_missing_namespace(
        start_instance) -> None:
    """``kvs watch-keys -W`` waited for ever for a namespace never created,
    and any watch-keys for a stopped rank's first answer: ``-t`` bounds the
    wait for the watch to start, exit 1."""
    inst = await start_instance(size=2)
    want = ("kvbroker: .: Connection timed out (watch not started within 0.5 s)\n")
    rc, out, err = await run_cli("kvs", "watch-keys", "-W", "-N", "never", "-t", "0.5",
                                 uri=inst.uri(0), timeout=30)
    assert (rc, out, err) == (1, "", want)
    pid = inst.pids()[1]
    async with stopped(pid):
        rc, out, err = await run_cli("kvs", "watch-keys", "-t", "0.5", uri=inst.uri(1),
                                     timeout=30)
    assert (rc, out, err) == (1, "", want)


async def test_attr_set_all_names_the_ranks_that_did_not_answer(start_instance) -> None:
    """``attr set --all -t`` with stopped ranks said only ``no answer in
    0.5s``, leaving the operator to find which; it names them (the others
    keep the new value), as ``exec`` on several ranks does (which named only
    the first)."""
    inst = await start_instance(size=4, fanout=3)
    uri0 = inst.uri(0)
    argv = ["attr", "set", "--all", "log.level", "info", "-t", "0.5"]
    async with stopped(inst.pids()[2]):
        assert await run_cli(*argv, uri=uri0, timeout=30) == (
            1, "", no_answer("attr set", 2))
        async with stopped(inst.pids()[3]):
            results = await asyncio.gather(
                run_cli(*argv, uri=uri0, timeout=30),
                run_cli("exec", "-r", "all", "-t", "0.5", "--", "true", uri=uri0, timeout=30))
    for what, (rc, out, err) in zip(["attr set", "exec"], results, strict=True):
        assert (rc, out) == (1, ""), err
        assert err == no_answer(what, None).replace("no answer", "ranks 2-3 did not answer")
    rc, out, err = await run_cli("attr", "get", "log.level", "-r", "1", uri=uri0)
    assert (rc, out) == (0, "info\n"), err


async def test_a_shutdown_that_timed_out_says_it_may_still_take_effect(start_instance) -> None:
    """``shutdown -r 1 -t`` to a stopped rank gives up, but its request
    waits in the tree, and the rank stops once it runs again: it said only
    "did not answer", as if nothing would happen."""
    inst = await start_instance(size=2)
    async with stopped(inst.pids()[1]):
        rc, out, err = await run_cli("shutdown", "-r", "1", "-t", "0.5", uri=inst.uri(0),
                                     timeout=30)
    assert (rc, out) == (1, ""), err
    assert err == no_answer("shutdown").rstrip("\n") + (
        "; it may still take effect: the request waits for the rank, which stops once it "
        "runs again\n")
    assert await asyncio.wait_for(inst.procs[1].wait(), 30) == 0  # (and it did)
