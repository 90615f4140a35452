"""Sampling profiles of the ranks (and the client) while a workload runs.

``python benchmarks/run.py W1 --py-spy DIR`` attaches ``py-spy record``
(from PyPI) to every rank of every instance a rep starts, and to the runner
itself (``client``) -- not to the helper processes (W0's peer, the W1 and
W2p client scripts) -- writing collapsed stacks to
``DIR/<workload>-<loop>-rep<N>-<who>.txt``.  After the run, each file is
summarised: the functions with the most samples on top of the stack
(*self*) and anywhere on it (*total*).  ``python benchmarks/profiles.py FILE...``
prints the same summary for saved files.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from collections import Counter
from pathlib import Path

RATE = 1000


class Profiler:
    """``py-spy record`` processes attached to running PIDs."""

    def __init__(self, outdir: Path, stem: str) -> None:
        self.outdir = outdir
        self.stem = stem
        self.procs: list[asyncio.subprocess.Process] = []
        self.files: list[Path] = []
        if shutil.which("py-spy") is None:
            raise RuntimeError("--py-spy needs py-spy on PATH (pip install py-spy)")
        outdir.mkdir(parents=True, exist_ok=True)

    async def attach(self, pid: int, who: str) -> None:
        out = self.outdir / f"{self.stem}-{who}.txt"
        proc = await asyncio.create_subprocess_exec(
            "py-spy", "record", "--pid", str(pid), "--rate", str(RATE), "--format", "raw",
            "--output", str(out), "--nonblocking",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )
        self.procs.append(proc)
        self.files.append(out)

    async def stop(self) -> list[Path]:
        """Stop recording (the ranks may already be gone) and return the files."""
        for proc in self.procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        self.procs.clear()
        return [f for f in self.files if f.exists()]


def _frame_name(frame: str) -> str:
    # py-spy raw frames look like "handler (broker/module.py:123)"
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    path, _, _line = where.rpartition(":")
    return f"{name} ({path})" if path else name


def summarize(path: Path, top: int = 15) -> str:
    self_counts: Counter[str] = Counter()
    total_counts: Counter[str] = Counter()
    samples = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            samples += n
            frames = [_frame_name(fr) for fr in stack.split(";")]
            self_counts[frames[-1]] += n
            for name in set(frames):
                total_counts[name] += n
    if not samples:
        return f"{path.name}: no samples (idle)"
    out = [f"{path.name}: {samples} samples on CPU ({samples / RATE:.2f}s at {RATE} Hz)"]
    out.append("   self%  total%  function")
    for name, n in self_counts.most_common(top):
        out.append(f"  {100 * n / samples:5.1f}  {100 * total_counts[name] / samples:6.1f}  {name}")
    out.append("  -- most inclusive --")
    for name, n in total_counts.most_common(top):
        out.append(f"  {100 * self_counts[name] / samples:5.1f}  {100 * n / samples:6.1f}  {name}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    for arg in argv:
        print(summarize(Path(arg)))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or [os.devnull]))
