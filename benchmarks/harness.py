"""The measuring instrument: instances, timing, peak RSS, records and tables.

A *workload* is an ``async def run(ctx) -> list[Sample]`` plus a little
metadata (:class:`Workload`).  One *rep* of a workload runs in a fresh
``asyncio.Runner`` whose loop is the rep's loop (uvloop or asyncio); the
ranks it starts through :meth:`RepContext.instance` run on the same kind of
loop.  Before an instance is stopped, each rank's peak RSS (``VmHWM``) is
read from ``/proc``.

Samples of all reps are folded into records::

    {workload, variant, loop, size, metric, value, unit, reps: [...],
     commit, rss_mb: {rank: MB}, fanout, cores, loadavg}

``value`` is the median of ``reps``.  With two loops, extra records with
``loop = "uvloop/asyncio"`` hold the ratio of each rep pair (uvloop rep k /
asyncio rep k, run back to back) as their ``reps``, and so the median of
those per-rep ratios as their ``value`` -- not the ratio of the two
medians: a pair shares the moment's machine load (:func:`loop_ratios`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks.profiles import Profiler
from broker.handle import Handle
from broker.launch import Instance
from broker.loops import loop_factory

REPO = Path(__file__).resolve().parent.parent
LOOP_RATIO = "uvloop/asyncio"


class Skip(Exception):
    """The workload cannot run here (e.g. a module is not loaded yet)."""


# ---------------------------------------------------------------- settings


@dataclass
class Settings:
    size: int = 4
    fanout: int = 2
    loops: list[str] = field(default_factory=lambda: ["uvloop"])
    reps: int = 3
    quick: bool = False
    n_iter: int | None = None
    msg_sizes: list[int] | None = None
    timeout: float = 1800.0
    py_spy: Path | None = None
    attrs: dict[str, str] = field(default_factory=dict)
    """``-S NAME=VALUE``: given to every instance (a workload's own win),
    for an A/B of a setting within one checkout."""


@dataclass
class Sample:
    """One measured figure of one rep.

    ``better`` is ``"higher"`` (rates), ``"lower"`` (latencies, cost ratios)
    or ``""`` (informational).  ``rss_mb`` overrides the instance's peak RSS
    for this sample (e.g. RSS read at one level of W5x).
    """

    variant: str
    metric: str
    value: float
    unit: str
    better: str = "higher"
    rss_mb: dict[str, float] | None = None


@dataclass
class Workload:
    id: str
    title: str | Callable[[Settings], str]
    payload: str | Callable[[Settings], str]
    run: Callable[[RepContext], Awaitable[list[Sample]]]
    count: int | None = None
    """The main iteration count of a standard run (what ``--n-iter``
    overrides): below it, run.py shows the targets without judging them."""
    size: int | None = None
    """The instance's size when the workload fixes it whatever ``--size``
    (Wsync: one rank): what its header and records say."""

    def size_in(self, settings: Settings) -> int:
        return settings.size if self.size is None else self.size

    def describe_title(self, settings: Settings) -> str:
        """The title, which may depend on the settings (the rank a smaller
        instance uses instead of rank 3)."""
        return self.title if isinstance(self.title, str) else self.title(settings)

    def describe_payload(self, settings: Settings) -> str:
        return self.payload if isinstance(self.payload, str) else self.payload(settings)


# ---------------------------------------------------------------- helpers


def far_rank(size: int) -> int:
    """The rank BENCHMARKS.md puts the far client on: 3, or the highest
    rank of a smaller instance (0 alone at size 1)."""
    return min(3, size - 1)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def loadavg() -> float:
    """The host's 1-minute load average (how shared the machine was)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover
        return -1.0


def git_commit() -> str:
    """``git rev-parse --short HEAD``, with ``+dirty`` if the measured code
    (broker/, kvs/, kvs_watch/) differs from it; ``unknown`` when this tree
    is not a git checkout of its own (a copy inside another repository
    recorded that one's commit)."""
    try:
        top, head = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "--short", "HEAD"], cwd=REPO,
            capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, ValueError, subprocess.CalledProcessError):
        return "unknown"
    if Path(top).resolve() != REPO:
        return "unknown"
    try:
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "broker", "kvs", "kvs_watch", "benchmarks"],
            cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        dirty = ""
    return f"{head}+dirty" if dirty else head


def peak_rss_mb(pid: int) -> float | None:
    """Peak resident set size of ``pid`` in MB (``VmHWM``), None if gone."""
    return _proc_status_mb(pid, "VmHWM:")


def current_rss_mb(pid: int) -> float | None:
    return _proc_status_mb(pid, "VmRSS:")


def _proc_status_mb(pid: int, field_name: str) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name):
                    return round(int(line.split()[1]) / 1024, 2)
    except OSError:
        return None
    return None


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_usage(pid: int) -> tuple[float, float, int] | None:
    """(user s, system s, context switches) of ``pid`` over all its threads
    (ZeroMQ's I/O thread included), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        switches = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.endswith("ctxt_switches:", 0, line.find(":") + 1):
                        switches += int(line.split()[1])
    except OSError:
        return None
    return int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK, switches


def pin_code() -> None:
    """Put this tree first on the import path of every process the run
    starts -- ranks, helpers, commands -- as it is the runner's own: run
    from elsewhere, with an editable install of another tree, the ranks
    ran that tree's code while the records named this one's commit."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in paths
                                                               if p != str(REPO)])


def child_env() -> dict[str, str]:
    """Environment for client processes: ``benchmarks`` importable
    (:func:`pin_code`), and no instance of the user's own."""
    env = dict(os.environ)
    if not env.get("PYTHONPATH", "").startswith(str(REPO)):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH"))
                                            if p)
    env.pop("KVBROKER_URI", None)
    return env


def share_bytecode() -> None:
    """With ``PYTHONDONTWRITEBYTECODE`` set, let the ranks and clients this
    run starts write their compiled bytecode to one temporary cache
    (``PYTHONPYCACHEPREFIX``) instead of compiling this project's modules
    at every start: an installed package has its bytecode, and Wstart
    measures starts as a user has them.  The source tree stays clean."""
    if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
        prefix = tempfile.mkdtemp(prefix="kvbroker-bench-pyc-")
        os.environ["PYTHONPYCACHEPREFIX"] = prefix
        atexit.register(shutil.rmtree, prefix, True)


def count(settings: Settings, full: int, quick: int) -> int:
    """A workload's iteration count under ``settings``: ``--n-iter`` if
    given, else ``quick`` or ``full`` by mode (:meth:`RepContext.n`; also
    for what a table header says before any rep runs)."""
    if settings.n_iter:
        return settings.n_iter
    return quick if settings.quick else full


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def parse_size(text: str) -> int:
    """``1024``, ``1K``, ``1KiB``, ``64k``, ``1M``, ``16MiB`` -> bytes."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = 1
    if t and t[-1] in "kmg":
        mult = 1 << {"k": 10, "m": 20, "g": 30}[t[-1]]
        t = t[:-1]
    try:
        n = int(float(t) * mult)
    except ValueError:
        raise ValueError(f"not a size: {text!r}") from None
    if n <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return n


def fmt_size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def fmt_value(v: float) -> str:
    if v != v or v in (float("inf"), float("-inf")):
        return str(v)
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    if a == 0:
        return "0"
    return f"{v:.3g}"


# ---------------------------------------------------------------- one rep


class RepContext:
    """What a workload's ``run`` gets: settings, the loop, instance helpers."""

    def __init__(self, settings: Settings, workload: Workload, loop: str, rep: int,
                 logdir: Path) -> None:
        self.settings = settings
        self.workload = workload
        self.loop = loop
        self.rep = rep
        self.logdir = logdir
        self.size = settings.size
        self.fanout = settings.fanout
        self.quick = settings.quick
        self.instances: list[Instance] = []
        self.handles: list[Handle] = []
        self.rss_mb: dict[str, float] = {}
        self.logs: list[Path] = []
        self.notes: list[str] = []
        self.profiler: Profiler | None = None
        self.profiles: list[Path] = []

    def n(self, full: int, quick: int) -> int:
        """The iteration count: ``--n-iter`` if given, else by mode."""
        return count(self.settings, full, quick)

    def note(self, text: str) -> None:
        """A line printed under the workload's table (once per distinct text)."""
        if text not in self.notes:
            self.notes.append(text)

    async def instance(self, size: int | None = None, **kw: Any) -> Instance:
        """Start a fresh instance on this rep's loop; stopped by :meth:`close`."""
        log = self.logdir / f"{self.workload.id}-{self.loop}-rep{self.rep}-{len(self.logs)}.log"
        self.logs.append(log)
        kw.setdefault("fanout", self.fanout)
        if self.settings.attrs:
            kw["attrs"] = {**self.settings.attrs, **(kw.get("attrs") or {})}
        inst = Instance(size or self.size, event_loop=self.loop, stderr_path=str(log), **kw)
        await inst.start()
        self.instances.append(inst)
        if self.settings.py_spy is not None:
            if self.profiler is None:
                stem = f"{self.workload.id}-{self.loop}-rep{self.rep + 1}"
                self.profiler = Profiler(self.settings.py_spy, stem)
                await self.profiler.attach(os.getpid(), "client")
            n = len(self.instances) - 1
            for rank, pid in enumerate(inst.pids()):
                await self.profiler.attach(pid, f"r{rank}" if not n else f"i{n}r{rank}")
        return inst

    async def connect(self, inst: Instance, rank: int = 0) -> Handle:
        h = await Handle.connect(inst.uri(rank))
        self.handles.append(h)
        return h

    def cpu_snapshot(self, inst: Instance) -> dict[str, tuple[float, float, int]]:
        """Usage so far of each rank (``r<N>``) and of this process (``client``)."""
        out = {}
        for rank, pid in enumerate(inst.pids()):
            use = proc_usage(pid)
            if use is not None:
                out[f"r{rank}"] = use
        out["client"] = proc_usage(os.getpid()) or (0.0, 0.0, 0)
        return out

    def cpu_samples(self, inst: Instance, variant: str,
                    before: dict[str, tuple[float, float, int]], n: int) -> list[Sample]:
        """Per operation since ``before``, for each process: user and system
        CPU microseconds and context switches (``kind:who`` metrics, shown
        as a matrix under the table).  Where the time goes, without a
        profiler's distortion; CPU has 10 ms ticks, so use long runs."""
        after = self.cpu_snapshot(inst)
        out = []
        for who, (u0, s0, c0) in before.items():
            if who not in after:
                continue
            u1, s1, c1 = after[who]
            out.append(Sample(variant, f"user_us:{who}", (u1 - u0) / n * 1e6, "us/op", "lower"))
            out.append(Sample(variant, f"sys_us:{who}", (s1 - s0) / n * 1e6, "us/op", "lower"))
            out.append(Sample(variant, f"ctxsw:{who}", (c1 - c0) / n, "switches/op", "lower"))
        return out

    def rss_now(self, inst: Instance, peak: bool = True) -> dict[str, float]:
        read = peak_rss_mb if peak else current_rss_mb
        out = {}
        for rank, pid in enumerate(inst.pids()):
            mb = read(pid)
            if mb is not None:
                out[str(rank)] = mb
        return out

    async def close(self) -> None:
        """Close the handles, stop every instance, stop the profiler.

        Every instance is stopped even if stopping one failed or was
        cancelled (a second Ctrl-C while stopping): the first error is
        raised once all were tried, so no instance is left running."""
        for h in self.handles:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(h.close(), 5)
        self.handles.clear()
        instances, self.instances = self.instances, []
        errors: list[BaseException] = []
        for inst in instances:
            for rank, mb in self.rss_now(inst).items():
                self.rss_mb[rank] = max(mb, self.rss_mb.get(rank, 0.0))
            try:
                await inst.stop()
            except BaseException as exc:
                errors.append(exc)
        if self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            self.profiles = await profiler.stop()
        if errors:
            raise errors[0]

    def log_tail(self, lines: int = 30) -> str:
        out = []
        for log in self.logs:
            try:
                text = log.read_text(errors="replace").splitlines()
            except OSError:
                continue
            if text:
                out.append(f"--- {log} (last {min(lines, len(text))} lines)")
                out.extend(text[-lines:])
        return "\n".join(out)


async def require_modules(h: Handle, *names: str) -> None:
    """Raise :class:`Skip` unless ``module.list`` on h's rank shows ``names``."""
    resp = await asyncio.wait_for(h.rpc("module.list"), 10)
    loaded = [m.get("name") for m in resp.get("modules", [])]
    missing = [n for n in names if n not in loaded]
    if missing:
        raise Skip(f"module {', '.join(missing)} not loaded "
                   f"(module.list shows: {', '.join(map(str, loaded))})")


async def kvs_near_and_far(ctx: RepContext) -> tuple[Instance, Handle, Handle, int]:
    """A fresh instance with kvs and kvs-watch, a handle on rank 0 and one on
    the far rank (rank 3, or the highest of a smaller instance; rank 0's
    own handle when that is rank 0): ``(inst, h0, h_far, far_rank)``."""
    inst = await ctx.instance()
    h0 = await ctx.connect(inst, 0)
    await require_modules(h0, "kvs", "kvs-watch")
    far = far_rank(ctx.size)
    return inst, h0, (h0 if far == 0 else await ctx.connect(inst, far)), far


@dataclass
class RepResult:
    loop: str
    rep: int
    samples: list[Sample]
    rss_mb: dict[str, float]
    seconds: float
    notes: list[str]
    profiles: list[Path] = field(default_factory=list)


# ---------------------------------------------------------------- interrupts

_running_rep: tuple[asyncio.AbstractEventLoop, asyncio.Task[list[Sample]]] | None = None
_stop_signals: list[int] = []
_blocking = 0
_in_runner = False
"""A rep's event loop is being made, run or closed (see _on_stop_signal)."""


def install_stop_handlers() -> None:
    """Let Ctrl-C (SIGINT) and SIGTERM (``timeout``, a cancelled CI job)
    take one path: the running rep's task is cancelled, so its ``finally``
    stops the instances and helpers and removes their directories, and the
    rep then raises KeyboardInterrupt (:func:`run_rep`).  A signal while the
    rep's loop is being made or closed, around its task, is kept until the
    loop is closed (the task, if it has not begun, ends at once).  Outside
    a rep (or in a :func:`blocking_section`), KeyboardInterrupt is raised
    where the runner is.  A SIGINT the runner
    was started to ignore (a background job of a shell script) stays ignored.

    Installed instead of ``asyncio.Runner``'s own SIGINT handler (which
    leaves one installed here alone), because that one's second Ctrl-C
    raises KeyboardInterrupt wherever the loop is -- in uvloop, inside a
    protocol callback that swallows it, and the rep then hangs."""
    signal.signal(signal.SIGTERM, _on_stop_signal)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _on_stop_signal)


def stop_signal() -> int | None:
    """The signal (SIGINT or SIGTERM) that interrupted the run, if any."""
    return _stop_signals[0] if _stop_signals else None


@contextlib.contextmanager
def blocking_section() -> Iterator[None]:
    """Mark code that blocks the event loop for a long time (W0's blocking
    clients: 10,000 round trips without an ``await``).  A stop signal
    raises KeyboardInterrupt right there, as in a plain script: the rep's
    task would see its cancellation only once that code is done.  Only
    there: anywhere else in a rep's code an exception raised at a random
    point could skip the ``try`` that reaps helpers it has just started."""
    global _blocking
    _blocking += 1
    try:
        yield
    finally:
        _blocking -= 1


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    _stop_signals.append(signum)
    if _blocking:
        raise KeyboardInterrupt
    if _running_rep is not None:
        loop, task = _running_rep
        loop.call_soon_threadsafe(task.cancel)
    elif not _in_runner:
        raise KeyboardInterrupt
    # Else the rep's loop is being made or closed, around its task: raised
    # there, KeyboardInterrupt broke the loop's own set-up or shutdown (the
    # run ended "Task was destroyed but it is pending!" after its one line,
    # and in an experiment uvloop's "Cannot close a running event loop").
    # The rep's task looks at the start, and run_rep once the loop is closed.


def run_rep(settings: Settings, workload: Workload, loop: str, rep: int,
            logdir: Path) -> RepResult:
    """One rep on a fresh event loop of kind ``loop`` (raises Skip / errors;
    KeyboardInterrupt when SIGINT or SIGTERM stopped it)."""
    ctx = RepContext(settings, workload, loop, rep, logdir)

    async def main() -> list[Sample]:
        global _running_rep
        task = asyncio.current_task()
        assert task is not None
        _running_rep = (asyncio.get_running_loop(), task)
        try:
            if _stop_signals:  # (came while the loop was being made)
                raise asyncio.CancelledError
            async with asyncio.timeout(settings.timeout):
                return await workload.run(ctx)
        except Exception as exc:
            if not isinstance(exc, Skip):  # (not when interrupted: no failure)
                tail = ctx.log_tail()
                if tail:
                    print(tail, file=sys.stderr)
            raise
        finally:
            try:
                await ctx.close()
            finally:
                # (a signal from here on is not for this task: the loop
                # may be closed by the time it comes)
                _running_rep = None

    global _in_runner
    t0 = time.perf_counter()
    coro = main()
    try:
        _in_runner = True
        try:
            with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
                samples = runner.run(coro)
        finally:
            _in_runner = False
    except (asyncio.CancelledError, Exception):
        # Stopped by a signal: whatever the cancellation made the rep's code
        # raise (a helper's pipe closed under it, a wait that timed out as
        # it was cancelled) is the stop, not a failure of the workload --
        # the run says "interrupted", not "FAILED".
        if stop_signal() is not None:
            raise KeyboardInterrupt from None
        raise
    finally:
        # A signal just before the loop was made (KeyboardInterrupt: no rep
        # running yet) left the coroutine never started, and Python then
        # warned "coroutine ... was never awaited" after the run's one line.
        # Only then: closing one stopped at an ``await`` runs its ``finally``
        # without a loop (RuntimeError: the run then exited 1).
        if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
            coro.close()
    if stop_signal() is not None:  # (came as the loop was closed after the rep)
        raise KeyboardInterrupt
    return RepResult(loop, rep, samples, ctx.rss_mb, time.perf_counter() - t0, ctx.notes,
                     ctx.profiles)


# ---------------------------------------------------------------- records


@dataclass
class Series:
    variant: str
    metric: str
    unit: str
    better: str
    loop: str
    values: list[float] = field(default_factory=list)
    rss_mb: dict[str, float] = field(default_factory=dict)
    reps: list[int] = field(default_factory=list)
    """The rep (from 0) each of ``values`` is of: a figure a rep did not give
    (W5x's level that failed there) left the values after it under the
    wrong rep's column, and paired with the other loop's wrong rep."""

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def by_rep(self) -> dict[int, float]:
        """``values`` by rep (by position, where no rep was recorded)."""
        return dict(zip(self.reps or range(len(self.values)), self.values, strict=True))


def fold(results: Iterable[RepResult]) -> list[Series]:
    """Group samples by (loop, variant, metric), keeping first-seen order."""
    series: dict[tuple[str, str, str], Series] = {}
    for res in results:
        for s in res.samples:
            key = (res.loop, s.variant, s.metric)
            ser = series.get(key)
            if ser is None:
                ser = series[key] = Series(s.variant, s.metric, s.unit, s.better, res.loop)
            ser.values.append(s.value)
            ser.reps.append(res.rep)
            for rank, mb in (s.rss_mb if s.rss_mb is not None else res.rss_mb).items():
                ser.rss_mb[rank] = max(mb, ser.rss_mb.get(rank, 0.0))
    return list(series.values())


def loop_ratios(series: list[Series]) -> list[Series]:
    """uvloop/asyncio ratio of each figure measured on both loops (per rep
    pair).  A figure that is 0 on asyncio in some rep has no ratio at all:
    leaving that pair out shifted the reps' columns and biased the median."""
    by_key = {(s.loop, s.variant, s.metric): s for s in series}
    out = []
    for s in series:
        if s.loop != "uvloop" or not s.better:
            continue
        other = by_key.get(("asyncio", s.variant, s.metric))
        if other is None or not all(other.values):
            continue
        theirs = other.by_rep()
        pairs = {rep: u / theirs[rep] for rep, u in s.by_rep().items() if rep in theirs}
        if pairs:
            out.append(Series(s.variant, s.metric, "x", s.better, LOOP_RATIO,
                              list(pairs.values()), reps=list(pairs)))
    return out


def records(workload: Workload, series: list[Series], settings: Settings,
            commit: str) -> list[dict[str, Any]]:
    load = loadavg()
    return [
        {
            "workload": workload.id,
            "variant": s.variant,
            "loop": s.loop,
            "size": workload.size_in(settings),
            "metric": s.metric,
            "value": s.median,
            "unit": s.unit,
            "reps": list(s.values),
            "commit": commit,
            "rss_mb": dict(s.rss_mb),
            "fanout": settings.fanout,
            "attrs": dict(settings.attrs),
            "cores": cores(),
            "loadavg": load,
        }
        for s in series
    ]


# ---------------------------------------------------------------- tables


def header(workload: Workload, settings: Settings, loop: str, commit: str, n_reps: int) -> str:
    return (
        f"\n{workload.id}  {workload.describe_title(settings)}\n"
        f"  size={workload.size_in(settings)} fanout={settings.fanout} loop={loop} "
        + "".join(f"{name}={value} " for name, value in settings.attrs.items())
        + f"payload={workload.describe_payload(settings)} cores={cores()} load={loadavg()} "
        f"reps={n_reps}"
        f"{' quick' if settings.quick else ''} commit={commit} "
        f"python={platform.python_version()}"
    )


def table(series: list[Series]) -> Iterator[str]:
    """One row per figure: median/min/max, then each rep's value; then the
    per-process ``kind:who`` figures as a compact matrix of medians."""
    matrix = [s for s in series if ":" in s.metric]
    series = [s for s in series if ":" not in s.metric]
    yield from _main_rows(series)
    yield from _matrix_rows(matrix)


def _matrix_rows(series: list[Series]) -> Iterator[str]:
    if not series:
        return
    def order(who: str) -> tuple[int, str]:  # r0, r1, ..., then client
        return (int(who[1:]), "") if who[:1] == "r" and who[1:].isdigit() else (1 << 30, who)

    cols = sorted({s.metric.partition(":")[2] for s in series}, key=order)
    rows: dict[str, dict[str, float]] = {}
    units: dict[str, str] = {}
    for s in series:
        kind, _, who = s.metric.partition(":")
        label = f"{s.variant} {kind}"
        rows.setdefault(label, {})[who] = s.median
        units[label] = s.unit
    lw = max(22, *(len(k) for k in rows)) + 2
    yield (f"  {'per process, median':<{lw}}{'unit':<13}"
           + "".join(f"{c:>9}" for c in cols))
    for label, vals in rows.items():
        yield (f"  {label:<{lw}}{units[label]:<13}"
               + "".join(f"{fmt_value(vals[c]) if c in vals else '-':>9}" for c in cols))


def _main_rows(series: list[Series]) -> Iterator[str]:
    if not series:
        return
    vw = max(12, *(len(s.variant) for s in series)) + 1
    mw = max(6, *(len(s.metric) for s in series)) + 1
    uw = max(5, *(len(s.unit) for s in series)) + 1
    cols = sorted({rep for s in series for rep in s.by_rep()})
    reps_hdr = " ".join(f"{'rep' + str(i + 1):>10}" for i in cols)
    yield (f"  {'variant':<{vw}}{'metric':<{mw}}{'unit':<{uw}}"
           f"{'median':>11}{'min':>11}{'max':>11}   {reps_hdr}")
    for s in series:
        got = s.by_rep()
        reps = " ".join(f"{fmt_value(got[i]) if i in got else '-':>10}" for i in cols)
        yield (f"  {s.variant:<{vw}}{s.metric:<{mw}}{s.unit:<{uw}}"
               f"{fmt_value(s.median):>11}{fmt_value(min(s.values)):>11}"
               f"{fmt_value(max(s.values)):>11}   {reps}")


def rss_line(series: list[Series]) -> str:
    peak: dict[str, float] = {}
    for s in series:
        for rank, mb in s.rss_mb.items():
            peak[rank] = max(mb, peak.get(rank, 0.0))
    if not peak:
        return ""
    ranks = sorted(peak, key=lambda r: (len(r), r))
    return "  peak RSS MB: " + " ".join(f"r{r}={peak[r]:.1f}" for r in ranks)


def print_failure(workload: Workload, loop: str, rep: int, exc: BaseException) -> None:
    print(f"\n{workload.id}: FAILED on {loop} rep {rep + 1}: {exc!r}", file=sys.stderr)
    traceback.print_exception(exc, file=sys.stderr)


def make_logdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvb-bench-"))


# ---------------------------------------------------------------- client processes


async def spawn(module: str, *args: str,
                ready_timeout: float = 30.0) -> asyncio.subprocess.Process:
    """Start ``python -m <module> ARGS`` and wait for its ``ready`` line.

    Its stdin is a pipe held open by this process: the helper's lifeline
    (:mod:`benchmarks.workloads.lifeline`), so it exits when the runner
    does, even on SIGKILL.  It runs in its own session, so a terminal's
    Ctrl-C reaches the runner alone, which then ends its helpers itself
    (:func:`reap`) instead of each printing a traceback."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        env=child_env(), cwd=str(REPO), start_new_session=True,
    )
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), ready_timeout)
    except BaseException:
        await reap(proc)
        raise
    if not line.startswith(b"ready"):
        await reap(proc)
        raise RuntimeError(f"{module} did not start (said {line[:200]!r}, "
                           f"status {proc.returncode})")
    return proc


def _cut_lifeline(proc: asyncio.subprocess.Process) -> None:
    """Close a helper's stdin: it exits when it reads EOF (if it has not
    finished already)."""
    if proc.stdin is not None:
        proc.stdin.close()


async def reap(proc: asyncio.subprocess.Process, timeout: float = 5.0) -> int | None:
    """Wait for a helper to exit: cut its lifeline (close its stdin), then
    terminate, then kill it, if it lingers."""
    for action in (partial(_cut_lifeline, proc), proc.terminate, proc.kill):
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                action()
        try:
            return await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            continue
    return proc.returncode
