"""How :class:`broker.command.Command` spawns a command (Linux): a signal
that reaches the child between the fork and the exec -- Ctrl-C to the
foreground job, a signal to the process group -- is the command's to
handle, by its defaults, and never the spawner's.

Each case runs a small program of its own, which registers an
``os.register_at_fork`` hook that signals the child itself at the moment
the window opens (``subprocess`` runs the hooks in a child it forks for a
``preexec_fn``); nothing of ours is replaced."""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")

PROGRAM = textwrap.dedent("""
    import asyncio, os, signal, sys
    from broker.command import Command

    SIG = signal.Signals[sys.argv[1]]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        heard = []
        if sys.argv[2] == "loop-handler":
            loop.add_signal_handler(SIG, heard.append, SIG)
        os.register_at_fork(after_in_child=lambda: os.kill(os.getpid(), SIG))
        cmd = Command.spawn(["true"], dict(os.environ))
        status = await cmd.wait()
        # A mark behind anything the child could have written to our
        # wake-up socket: once its handler runs, so have the others.
        marked = loop.create_future()
        loop.add_signal_handler(signal.SIGUSR2, marked.set_result, None)
        os.kill(os.getpid(), signal.SIGUSR2)
        await asyncio.wait_for(marked, 30)
        print(f"status {status} heard {len(heard)}", flush=True)

    if sys.argv[2] == "asyncio-run":
        asyncio.run(main())  # (which handles SIGINT itself)
    else:  # Python's own SIGINT handler: KeyboardInterrupt
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(main())
        finally:
            loop.close()
""")


async def run_program(sig: str, handler: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PROGRAM, sig, handler,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_a_signal_between_fork_and_exec_does_not_reach_the_spawner() -> None:
    """The loop handles SIGUSR1 (``add_signal_handler``).  Before, the
    child ran the loop's C handler, which wrote the signal to the wake-up
    socket it shares with the spawner: the spawner handled a SIGUSR1 that
    no one sent it.  Now the child meets the signal with its default
    action, as it would right after the exec."""
    rc, out, err = await run_program("SIGUSR1", "loop-handler")
    assert (rc, err) == (0, "")
    assert out == f"status {-signal.SIGUSR1} heard 0\n"


@pytest.mark.parametrize("handler", ["python-handler", "asyncio-run"])
async def test_ctrl_c_between_fork_and_exec_interrupts_the_command(handler: str) -> None:
    """SIGINT under Python's own handler, or ``asyncio.run``'s.  Before, the
    child ran that handler: Python's raised ``KeyboardInterrupt`` in the
    child (inside the ``preexec_fn`` that makes ``Popen`` raise
    ``SubprocessError``; here, in the hook, a traceback on stderr), and
    ``asyncio.run``'s cancelled a task of the child's copy of the
    spawner; either way the command then ran as if no signal had come.
    Now the command is interrupted by the SIGINT sent to it, as after its
    exec, and the spawn succeeds."""
    rc, out, err = await run_program("SIGINT", handler)
    assert (rc, err) == (0, "")
    assert out == f"status {-signal.SIGINT} heard 0\n"
