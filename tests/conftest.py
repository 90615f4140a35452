"""Test harness: real broker processes, real sockets, time-boxed awaits.

Fixtures
--------
``start_instance(size=1, fanout=2, **kw)``
    Start an :class:`broker.launch.Instance` (rank processes) on the same
    event loop kind as the test; stopped at teardown, and its ranks' stderr
    is shown if the test failed.
``connect(inst, rank=0)``
    An async :class:`broker.handle.Handle` attached to ``rank``; closed at
    teardown.

Async tests run on uvloop (``KVBROKER_TEST_LOOP=asyncio`` runs them on the
stock asyncio loop instead); tests marked ``both_loops`` run on both
(pytest-asyncio's ``pytest_asyncio_loop_factories`` hook -- no loop policy
is touched).  An exception left unhandled in the test's
event loop fails the test.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.forkserver import FORKSERVER_ENV, start_server
from broker.handle import Handle
from broker.launch import Instance
from broker.loops import loop_factory, loop_name

BOTH = {"uvloop": loop_factory("uvloop"), "asyncio": loop_factory("asyncio")}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "both_loops: run on uvloop and on asyncio")
    config.addinivalue_line("markers", "no_forkserver: instances start their own spawners, "
                            "as without the suite's fork server (a test of the process tree)")
    _share_bytecode(config)


def _share_bytecode(config: pytest.Config) -> None:
    """Let the processes the tests start share compiled bytecode.

    With ``PYTHONDONTWRITEBYTECODE`` set (as on this project's CI machines)
    every rank and every ``kvbroker`` command compiled this project's
    modules again: ~180 ms of a CLI command's ~340 ms, and a third of an
    instance's start.  The children write it to one cache in a temporary
    directory instead (``PYTHONPYCACHEPREFIX``), so the source tree stays
    free of ``__pycache__`` as the setting asked.  This process's own flags
    are fixed at its start; only the children see the change."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return
    prefix = tempfile.mkdtemp(prefix="kvbroker-test-pyc-")
    os.environ.pop("PYTHONDONTWRITEBYTECODE")
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    config.add_cleanup(lambda: shutil.rmtree(prefix, ignore_errors=True))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: three workers for every two cores.  A test spends much
    of its time waiting on processes it started (ranks, commands), and two
    workers on 2 cores left them ~20% idle: 456 s with three against ~510 s
    with two, on this project's 2-core machines (docs/performance.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (3 * (cores or 1) + 1) // 2)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    if item.get_closest_marker("both_loops"):
        return BOTH
    loop = os.environ.get("KVBROKER_TEST_LOOP", "uvloop")
    if loop not in BOTH:
        raise pytest.UsageError(f"KVBROKER_TEST_LOOP must be one of {sorted(BOTH)}")
    return {loop: BOTH[loop]}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(scope="session", autouse=True)
def _fork_server() -> Iterator[None]:
    """One fork server per test process (:mod:`broker.forkserver`): each
    instance's spawner is forked from it, not an interpreter started anew.
    ~1,600 instance starts each spent ~0.12 s of CPU importing the broker,
    a sixth of the suite's CPU.  The ``kvbroker`` commands the tests run
    ask it too (docs/cli.md, "Served commands"): the suite's CPU fell from
    871 to 730 seconds.  ``KVBROKER_TEST_FORKSERVER=0`` runs without it,
    every spawner and command executed as before."""
    if os.environ.get("KVBROKER_TEST_FORKSERVER") == "0" or not hasattr(os, "pidfd_open"):
        yield
        return
    where = tempfile.mkdtemp(prefix="kvb-fs-")
    server = start_server(os.path.join(where, "sock"))
    os.environ[FORKSERVER_ENV] = os.path.join(where, "sock")
    try:
        yield
    finally:
        os.environ.pop(FORKSERVER_ENV, None)
        assert server.stdin is not None
        server.stdin.close()
        server.wait(30)
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_fork_server_if_marked(request: pytest.FixtureRequest,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked ``no_forkserver`` walks the process tree from a
    launcher to its ranks (``uri pid:``, killing a start and all under
    it): a served spawner is the server's child, not the launcher's."""
    if request.node.get_closest_marker("no_forkserver"):
        monkeypatch.delenv(FORKSERVER_ENV, raising=False)


@pytest.fixture(autouse=True)
async def _fail_on_loop_exceptions() -> AsyncIterator[None]:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    yield
    loop.set_exception_handler(None)
    if errors:
        pytest.fail(f"unhandled exceptions in the event loop: {errors}")


@pytest.fixture
async def start_instance(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Callable[..., Any]]:
    instances: list[Instance] = []
    logs: list[Path] = []
    loop = loop_name(asyncio.get_running_loop())

    async def start(size: int = 1, fanout: int = 2, **kw: Any) -> Instance:
        log = tmp_path / f"broker-{len(instances)}.log"
        logs.append(log)
        kw.setdefault("event_loop", loop)
        inst = Instance(size, fanout, stderr_path=str(log), **kw)
        await asyncio.wait_for(inst.start(), 60)
        instances.append(inst)
        return inst

    yield start
    for inst in instances:
        await inst.stop()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for log in logs:
            if log.exists() and log.stat().st_size:
                print(f"--- {log.name} ---\n{log.read_text()[-20000:]}")


@pytest.fixture
async def connect() -> AsyncIterator[Callable[..., Any]]:
    handles: list[Handle] = []

    async def attach(inst: Instance, rank: int = 0) -> Handle:
        h = await asyncio.wait_for(Handle.connect(inst.uri(rank)), 10)
        handles.append(h)
        return h

    yield attach
    for h in handles:
        await h.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class CountingStore(dict):
    """A blob store (ref -> bytes) that counts reads: in front of a
    ``kvs.treeobj.BlobCache`` each read is a decode the memo did not save."""

    reads = 0

    def get(self, ref, default=None):  # type: ignore[override]
        self.reads += 1
        return super().get(ref, default)


def tmpfs(mnt: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``mnt`` (made) with ``options`` for a fixture to
    yield, unmounted after (root only; the test is skipped where mounting
    is not allowed)."""
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)],
            capture_output=True).returncode != 0:
        pytest.skip("needs root and a tmpfs mount")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 20 MB tmpfs (root only; skipped where mounting is not allowed)."""
    yield from tmpfs(tmp_path / "disk", "size=20m,mode=0700")
