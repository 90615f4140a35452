"""Wstart (a kvbroker extension, not in BENCHMARKS.md): what starting costs.

A job runs ``kvbroker start``, and a script runs ``kvbroker kvs get`` as
often as a shell script runs any command, so both costs are a user's wait.
Every figure is per operation, wall and CPU (the children's, from
``getrusage``), beside the interpreter's own floor measured in the same run:

* ``python -c pass`` and ``python -c 'import asyncio'`` -- the floor every
  Python command pays here (the CLI needs asyncio);
* ``kvbroker kvs get`` -- one CLI command against a running rank;
* ``start+stop size 1`` / ``size N`` -- an instance of N rank processes,
  from nothing to every rank ready, then stopped
  (:class:`broker.launch.Instance`, what ``kvbroker start`` runs).

Compiled bytecode counts: with ``PYTHONDONTWRITEBYTECODE`` set, every
process compiles this project's modules again (the runner lets its children
share a cache instead, as an installed package has one; see ``run.py``).
"""

from __future__ import annotations

import asyncio
import os
import resource
import sys
import time

from benchmarks.harness import RepContext, Sample, Workload, child_env
from broker.launch import Instance

KVBROKER = os.path.join(os.path.dirname(sys.executable), "kvbroker")


def _children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


async def _command(argv: list[str], env: dict[str, str]) -> None:
    """Run ``argv`` to its end; a cancelled rep (Ctrl-C, ``--timeout``)
    kills and reaps it rather than leaving it running after the runner."""
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await proc.communicate()
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await asyncio.shield(proc.wait())
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} exited {proc.returncode}: {err.decode()[-500:]}")


async def _per_command(argv: list[str], env: dict[str, str], n: int) -> tuple[float, float]:
    """Wall and CPU seconds per run of ``argv`` (one after the other), after
    one run that fills the bytecode cache."""
    await _command(argv, env)
    cpu0, t0 = _children_cpu(), time.perf_counter()
    for _ in range(n):
        await _command(argv, env)
    return (time.perf_counter() - t0) / n, (_children_cpu() - cpu0) / n


async def _per_instance(ctx: RepContext, size: int, n: int) -> tuple[float, float]:
    """Wall and CPU seconds per start and stop of a ``size``-rank instance
    (the bytecode cache is warm: :func:`run_wstart` started one before)."""
    cpu0, t0 = _children_cpu(), time.perf_counter()
    for i in range(n):
        log = ctx.logdir / f"Wstart-{ctx.loop}-rep{ctx.rep}-size{size}-{i}.log"
        inst = Instance(size, ctx.fanout, event_loop=ctx.loop, stderr_path=str(log))
        await inst.start()
        await inst.stop()
    return (time.perf_counter() - t0) / n, (_children_cpu() - cpu0) / n


def _samples(variant: str, wall: float, cpu: float) -> list[Sample]:
    return [Sample(variant, "wall", wall * 1e3, "ms", "lower"),
            Sample(variant, "cpu", cpu * 1e3, "ms", "lower")]


async def run_wstart(ctx: RepContext) -> list[Sample]:
    n_cmd = ctx.n(20, 5)
    n_inst = ctx.n(10, 3)
    env = child_env()
    out: list[Sample] = []
    floor_wall = {}
    for variant, argv in (("python -c pass", [sys.executable, "-c", "pass"]),
                          ("python -c 'import asyncio'",
                           [sys.executable, "-c", "import asyncio"])):
        wall, cpu = await _per_command(argv, env, n_cmd)
        floor_wall[variant] = wall
        out += _samples(variant, wall, cpu)

    inst = await ctx.instance(size=1)
    # (the command's client on the rep's loop, as the ranks)
    env_attached = dict(env, KVBROKER_URI=inst.uri(0), KVBROKER_EVENT_LOOP=ctx.loop)
    await _command([KVBROKER, "kvs", "put", "bench.key=1"], env_attached)
    wall, cpu = await _per_command([KVBROKER, "kvs", "get", "bench.key"], env_attached, n_cmd)
    out += _samples("kvbroker kvs get", wall, cpu)
    out.append(Sample("kvs get / import asyncio", "ratio",
                      wall / floor_wall["python -c 'import asyncio'"], "x", "lower"))

    for size in sorted({1, ctx.size}):
        wall, cpu = await _per_instance(ctx, size, n_inst)
        out += _samples(f"start+stop size {size}", wall, cpu)
    return out


WORKLOADS = [
    Workload("Wstart", "instance start+stop and one CLI command, against python's floor",
             "kvbroker kvs get; Instance(size).start()/stop()", run_wstart),
]
