"""flux-core t/t0040-flux-sproc.t (``flux sproc ps|kill|wait`` and ``flux
exec --bg [--waitable] [--label]``) against real kvbroker ranks: a 2-rank
instance, as Flux's ``test_under_flux 2``; every ``flux`` command is the
real ``kvbroker`` command run as a process.

Flux's ``wait_for_state RANK STATE COUNT`` (``sproc ps`` every 0.1 s, up
to 30 s) is :func:`wait_for_state`: ``rexec.list`` -- what ``sproc ps``
prints -- asked until the labelled command is in that state, within a
deadline.  Background commands whose start is not the case's subject are
started through ``rexec.exec`` (:func:`start_bg`, what ``exec --bg``
sends) rather than one more ``kvbroker`` process each; the cases about
``exec --bg`` itself (its ``RANK: PID`` lines, labels, ``--waitable``)
run the command.  Several cases share an instance and run at once (their
labels apart): each ``kvbroker`` process costs a few tenths of a second.

Flux's cases, and where each is:

1.-2. 'with no arguments fails', 'invalid subcommand fails' and 30.-33.
    help ('supported subcommands', each subcommand's usage) ->
    :func:`test_usage_and_help` (exit 2 for the first two, as argparse).
3.-9. ps: 'works with no processes' (a heading line only), '--no-header',
    'shows background process', '--format', 'custom format with no
    header' (``{label}:{state}``), '--rank', 'invalid rank fails', 29.
    '--service rexec' -> :func:`test_ps`.  The heading of the state
    column is ``ST``, and the default format Flux's.
8. 'shows zombie state' and 19.-28. wait: 'by label', 'by pid' (the pid
    read from ``exec --bg``'s ``RANK: PID``), 'returns correct exit code'
    (1), 'returns signal exit code' (137), 'on non-waitable process
    fails' ("not waitable"), 'on nonexistent process fails' ("does not
    belong"), 'on already-reaped process fails', '--output returns
    retained stderr', '--output routes stdout to stdout', 'without
    --output suppresses retained output' -> :func:`test_zombies_and_wait`
    ('by label' and 'already-reaped' are the zombie's first and second
    wait there).
11.-18. kill: 'by pid' (rank 1, ``--wait``: 143, then gone from ps), 'by
    label', 'with invalid pid fails' ("does not belong"), '--wait with
    invalid pid fails' ("wait failed"), 'with invalid label fails',
    'already exited process fails' (a zombie: exit 1, "No such
    process"), '--wait returns exit status' (143), '--wait waits even if
    kill failed' (a zombie: collected, exit 0) -> :func:`test_kill`.

The server's side (``rexec.wait``, labels, retention, a client's
disconnect, the rank's stop) is in tests/test_rexec.py.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from test_broker_support import run_cli, wait_until

SIZE = 2
T = 20.0


async def sproc(uri: str, *args: str) -> tuple[int, str, str]:
    return await run_cli("sproc", *args, uri=uri, timeout=T)


async def exec_bg(uri: str, *args: str) -> tuple[int, str, str]:
    """``kvbroker exec ARGS`` (with ``--bg`` among them)."""
    return await run_cli("exec", *args, uri=uri, timeout=T)


def rank_pid(out: str) -> tuple[int, int]:
    """``exec --bg``'s ``RANK: PID`` line, as t0040 reads it (``IFS=": "
    read -r rank pid``)."""
    m = re.fullmatch(r"(\d+): (\d+)\n", out)
    assert m is not None, out
    return int(m.group(1)), int(m.group(2))


async def start_bg(h: Any, rank: int, cmd: list[str], label: str,
                   waitable: bool = True) -> int:
    """What ``exec -r RANK --bg [--waitable] --label=LABEL CMD`` asks of
    the rank: its pid (the stream ends after ``started``)."""
    answers = [a async for a in h.rpc_stream(
        "rexec.exec", {"cmd": cmd, "bg": True, "waitable": waitable, "label": label},
        nodeid=rank)]
    assert [a["type"] for a in answers] == ["started"], answers
    return int(answers[0]["pid"])


async def wait_for_state(h: Any, rank: int, label: str, state: str) -> None:
    """Flux's ``wait_for_state``: the command labelled ``label`` on ``rank``
    is listed in ``state`` (``R`` or ``Z``), within a deadline."""
    async def there() -> bool:
        procs = (await h.rpc("rexec.list", nodeid=rank))["procs"]
        return any(p["label"] == label and p["state"] == state for p in procs)

    await wait_until(there, f"{label} on rank {rank} to be in state {state}", timeout=T)


async def test_usage_and_help() -> None:
    """Flux 1-2, 30-33 (no instance needed: nothing is asked)."""
    runs = await asyncio.gather(
        run_cli("sproc"), run_cli("sproc", "invalid-subcommand"),
        run_cli("sproc", "--help"),
        *(run_cli("sproc", sub, "--help") for sub in ("ps", "kill", "wait")))
    assert [rc for rc, _, _ in runs[:2]] == [2, 2], runs[:2]
    assert "invalid choice: 'invalid-subcommand'" in runs[1][2]
    assert runs[2][0] == 0 and "supported subcommands" in runs[2][1], runs[2]
    for (rc, out, _), sub in zip(runs[3:], ("ps", "kill", "wait"), strict=True):
        assert rc == 0 and f"usage: kvbroker sproc {sub}" in out, out


async def test_ps(start_instance, connect) -> None:
    """Flux 3-9, 29."""
    inst = await start_instance(size=SIZE)
    uri = inst.uri(0)
    empty, no_header, bad_rank = await asyncio.gather(
        sproc(uri, "ps", "-r1"), sproc(uri, "ps", "-n", "--service", "rexec"),
        sproc(uri, "ps", "--rank", "999"))
    assert empty[0] == 0 and empty[1].splitlines() == ["      PID ST LABEL        COMMAND"]
    assert no_header == (0, "", ""), no_header  # (and --service rexec is taken)
    assert bad_rank[0] == 1 and "No route to host" in bad_rank[2], bad_rank

    started = await asyncio.gather(
        *(exec_bg(uri, "-r", "0", "--bg", "--waitable", f"--label={label}", "sleep", "inf")
          for label in ("test-ps", "format-test", "custom")),
        exec_bg(uri, "-r", "1", "--bg", "--label=rank1", "sleep", "inf"))
    assert [rc for rc, _, _ in started] == [0] * 4, started
    assert [rank_pid(out)[0] for _, out, _ in started] == [0, 0, 0, 1]
    table, formatted, custom, rank1 = await asyncio.gather(
        sproc(uri, "ps"), sproc(uri, "ps", "-o", "{pid} {label}"),
        sproc(uri, "ps", "-n", "-o", "{label}:{state}"), sproc(uri, "ps", "--rank", "1"))
    assert table[0] == 0 and re.search(r"\d+ R  test-ps +sleep inf", table[1]), table
    assert "rank1" not in table[1]
    assert "format-test" in formatted[1] and "COMMAND" not in formatted[1], formatted
    assert formatted[1].splitlines()[0] == "PID LABEL"
    assert "custom:R" in custom[1].splitlines(), custom
    assert "rank1" in rank1[1] and "test-ps" not in rank1[1], rank1
    # kvbroker's own: -r IDSET asks each rank, a RANK column first
    every, labels = await asyncio.gather(
        sproc(uri, "ps", "-r", "all"), sproc(uri, "ps", "-r", "0-1", "-n", "-o",
                                              "{rank}:{label}"))
    assert every[1].splitlines()[0] == "RANK       PID ST LABEL        COMMAND", every
    assert re.search(r"^   1 +\d+ R  rank1 +sleep inf$", every[1], re.M), every
    assert sorted(labels[1].split()) == ["0:custom", "0:format-test", "0:test-ps", "1:rank1"]

    killed = await asyncio.gather(
        *(sproc(uri, "kill", "--wait", "15", label)
          for label in ("test-ps", "format-test", "custom")),
        sproc(uri, "kill", "--rank", "1", "15", "rank1"))
    assert [rc for rc, _, _ in killed] == [143, 143, 143, 0], killed


async def test_zombies_and_wait(start_instance, connect) -> None:
    """Flux 8, 19-28."""
    inst = await start_instance(size=SIZE)
    uri = inst.uri(0)
    h = await connect(inst, 0)
    zombie, by_pid = await asyncio.gather(
        exec_bg(uri, "-r", "0", "--bg", "--waitable", "--label=zombie", "sleep", "0"),
        exec_bg(uri, "-r0", "--bg", "--waitable", "sleep", "0"))
    assert zombie[0] == 0 and by_pid[0] == 0, (zombie, by_pid)
    _, pid = rank_pid(by_pid[1])
    await asyncio.gather(
        start_bg(h, 0, ["false"], "wait-exit"),
        start_bg(h, 0, ["sleep", "inf"], "wait-signal"),
        start_bg(h, 0, ["sleep", "inf"], "not-waitable", waitable=False),
        start_bg(h, 0, ["sh", "-c", "echo hello >&2"], "wait-out"),
        start_bg(h, 0, ["sh", "-c", "echo tothestdout"], "wait-out2"),
        start_bg(h, 0, ["sh", "-c", "echo quiet >&2"], "wait-noout"))
    await wait_for_state(h, 0, "zombie", "Z")
    rc, table, _ = await sproc(uri, "ps")
    assert rc == 0 and re.search(r"Z.*zombie", table), table

    (signalled, _, _) = await sproc(uri, "kill", "9", "wait-signal")
    assert signalled == 0
    runs = await asyncio.gather(
        sproc(uri, "wait", "zombie"),  # (by label)
        sproc(uri, "wait", str(pid)), sproc(uri, "wait", "wait-exit"),
        sproc(uri, "wait", "wait-signal"), sproc(uri, "wait", "not-waitable"),
        sproc(uri, "wait", "999999"),
        sproc(uri, "wait", "-o", "wait-out"), sproc(uri, "wait", "-o", "wait-out2"),
        sproc(uri, "wait", "wait-noout"))
    assert [rc for rc, _, _ in runs] == [0, 0, 1, 137, 1, 1, 0, 0, 0], runs
    assert "not waitable" in runs[4][2], runs[4]
    assert "does not belong" in runs[5][2], runs[5]
    assert runs[6][1:] == ("", "hello\n"), runs[6]
    assert runs[7][1:] == ("tothestdout\n", ""), runs[7]
    assert runs[8][1:] == ("", ""), runs[8]
    reaped, killed = await asyncio.gather(sproc(uri, "wait", "zombie"),  # (waited above)
                                          sproc(uri, "kill", "15", "not-waitable"))
    assert reaped[0] == 1 and "does not belong" in reaped[2], reaped
    assert killed[0] == 0, killed


async def test_kill(start_instance, connect) -> None:
    """Flux 11-18."""
    inst = await start_instance(size=SIZE)
    uri = inst.uri(0)
    h = await connect(inst, 0)
    rc, out, err = await exec_bg(uri, "-r1", "--bg", "--waitable", "sleep", "30")
    assert rc == 0, err
    rank, pid = rank_pid(out)
    assert rank == 1
    await asyncio.gather(
        start_bg(h, 0, ["sleep", "30"], "kill-label"),
        start_bg(h, 1, ["sleep", "0"], "already-exited"),
        start_bg(h, 0, ["sleep", "inf"], "wait-kill"),
        start_bg(h, 1, ["sleep", "0"], "kill-fail"))
    (rc, table, _), (rc0, table0, _) = await asyncio.gather(
        sproc(uri, "ps", "--rank=1"), sproc(uri, "ps"))
    assert rc == 0 and re.search(rf"\b{pid}\b", table), table
    assert rc0 == 0 and "kill-label" in table0, table0
    await wait_for_state(h, 1, "already-exited", "Z")
    await wait_for_state(h, 1, "kill-fail", "Z")

    runs = await asyncio.gather(
        sproc(uri, "kill", "--wait", "-r", "1", "15", str(pid)),
        sproc(uri, "kill", "--wait", "15", "kill-label"),
        sproc(uri, "kill", "15", "999999"),
        sproc(uri, "kill", "-w", "15", "999999"),
        sproc(uri, "kill", "15", "nonexistent-label"),
        sproc(uri, "kill", "-r1", "15", "already-exited"),
        sproc(uri, "kill", "-w", "15", "wait-kill"),
        sproc(uri, "kill", "-wr", "1", "15", "kill-fail"))
    assert [rc for rc, _, _ in runs] == [143, 143, 1, 1, 1, 1, 143, 0], runs
    assert "does not belong" in runs[2][2], runs[2]
    assert "wait failed" in runs[3][2], runs[3]
    assert "does not belong" in runs[4][2], runs[4]
    assert "No such process" in runs[5][2], runs[5]
    # a zombie that -w collected as the kill came: its status, and no word
    # about the kill finding nothing (it said "does not belong to any command")
    assert runs[7][2] == "", runs[7]
    assert "does not belong" in runs[3][2] and "wait failed" in runs[3][2], runs[3]
    (rc, table, _), waited = await asyncio.gather(
        sproc(uri, "ps", "-r", "1"), sproc(uri, "wait", "-r1", "already-exited"))
    assert rc == 0 and not re.search(rf"\b{pid}\b", table), table
    assert waited[0] == 0, waited
