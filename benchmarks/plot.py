"""Plot the main figures of a benchmark run: ``python benchmarks/plot.py RUN.json... OUT.png``.

The records of several ``run.py --json`` files are plotted together (as
docs/performance.png: the main run and a W5x run made right after it).
Needs matplotlib (``pip install -e '.[bench]'``).  One PNG with four panels:
RPC round trips against the raw ZeroMQ / Unix-socket yardsticks (W0, W1),
commit rates per block as the directory grows (W2), the uvloop /
asyncio ratio per workload, and the namespace lifecycle rate as live
namespaces grow (W5x).  Panels without data in the JSON are left out.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def _index(records: list[dict[str, Any]]) -> dict[tuple[str, str, str, str], float]:
    return {(r["workload"], r["variant"], r["metric"], r["loop"]): r["value"] for r in records}


def w2_blocks(records: list[dict[str, Any]], loop: str) -> list[float]:
    """W2's rank-0 rate of each block (``rank0 b01``, ``rank0 b02``, ...), in order."""
    found = {}
    for r in records:
        head, _, block = r["variant"].partition(" b")
        if (r["workload"] == "W2" and r["loop"] == loop and r["metric"] == "rate"
                and head == "rank0" and block.isdigit()):
            found[int(block)] = r["value"]
    return [found[k] for k in sorted(found)]


def block_titles(block_size: float | None) -> tuple[str, str]:
    """The W2 panel's title and x label, saying what a block was in the
    run: 500 commits, or a tenth of a shorter run -- and a tenth of the run
    in records from before W2 reported its ``block_size`` (the old blocks)."""
    if block_size == 500:
        return ("W2 commits/s per block of 500 commits (rank 0)",
                "block (the directory grows by 500 keys in each)")
    return ("W2 commits/s per tenth of the run (rank 0)",
            "tenth of the run (the directory grows by a tenth of its keys in each)")


def plot(records: list[dict[str, Any]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    idx = _index(records)
    loops = sorted({r["loop"] for r in records if "/" not in r["loop"]})
    loop = "uvloop" if "uvloop" in loops else (loops[0] if loops else "uvloop")
    panels: list[tuple[str, Any]] = []

    rpc = [(label, idx.get(key)) for label, key in (
        ("raw zmq\n(blocking)", ("W0", "zmq-blocking", "rate", loop)),
        ("raw zmq\n(asyncio)", ("W0", "zmq-asyncio", "rate", loop)),
        ("raw unix\n(asyncio)", ("W0", "unix-asyncio", "rate", loop)),
        ("ping\nrank 0", ("W1", "rank0", "rate", loop)),
        ("ping\nrank 3", ("W1", "rank3", "rate", loop)),
    ) if idx.get(key)]
    if rpc:
        panels.append(("W0/W1 round trips per second", lambda ax: (
            ax.bar([x for x, _ in rpc], [y for _, y in rpc], color="tab:blue"))))

    blocks = w2_blocks(records, loop)
    if blocks:
        title, xlabel = block_titles(idx.get(("W2", "rank0", "block_size", loop)))
        panels.append((title, lambda ax: (
            ax.plot(range(1, len(blocks) + 1), blocks, marker="o"),
            ax.set_xlabel(xlabel),
            ax.set_ylim(bottom=0))))

    headline = {("W1", "rank0"), ("W1", "rank3"), ("W2", "rank0"), ("W2p", "8 clients all r0"),
                ("W3", "rank0"), ("W3", "rank3"), ("W4", "r0->r3"), ("W5", "watch r3"),
                ("W6", "r0->r3")}
    ratios: dict[str, float] = {}
    for r in records:
        if (r["loop"] == "uvloop/asyncio" and r["metric"] in ("rate", "p50")
                and (r["workload"], r["variant"]) in headline):
            value = r["value"] if r["metric"] == "rate" else 1 / r["value"]  # p50: lower wins
            ratios.setdefault(f"{r['workload']}\n{r['variant']}", value)
    if ratios:
        panels.append(("uvloop / asyncio, same run (>1: uvloop faster)", lambda ax: (
            ax.bar(list(ratios), list(ratios.values()), color="tab:green"),
            ax.axhline(1.0, color="grey", lw=1),
            ax.tick_params(axis="x", labelsize=7))))

    levels: dict[int, float] = defaultdict(float)
    for r in records:
        if r["workload"] == "W5x" and r["loop"] == loop and r["metric"] == "rate":
            size = r["variant"].split()[0]  # "16K live"
            if size[:-1].isdigit() and size[-1] == "K":
                levels[int(size[:-1]) * 1024] = r["value"]
            elif size.isdigit():
                levels[int(size)] = r["value"]
    if levels:
        xs = sorted(levels)
        panels.append(("W5x namespaces/s vs live namespaces", lambda ax: (
            ax.plot(xs, [levels[x] for x in xs], marker="o"), ax.set_xscale("log"),
            ax.set_ylim(bottom=0), ax.set_xlabel("live namespaces (each with a watcher)"))))

    if not panels:
        raise SystemExit("no plottable records in the JSON")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels)))
    for ax, (title, draw) in zip(axes if len(panels) > 1 else [axes], panels, strict=True):
        ax.set_title(title, fontsize=10)
        draw(ax)
    commits = ", ".join(dict.fromkeys(str(r.get("commit", "?")) for r in records))
    cores = "/".join(dict.fromkeys(str(r.get("cores", "?")) for r in records))
    fig.suptitle(f"kvbroker benchmarks ({loop}, commit {commits}, {cores} cores)",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def load(paths: list[str]) -> list[dict[str, Any]]:
    """The records of every file, in order; a clear error (not a traceback)
    for a file that is missing or is not a run's records."""
    records: list[dict[str, Any]] = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise SystemExit(f"plot.py: {path}: {exc.strerror}") from None
        except ValueError as exc:
            raise SystemExit(f"plot.py: {path}: not JSON ({exc})") from None
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise SystemExit(f"plot.py: {path}: not a list of records (run.py --json)")
        records.extend(data)
    return records


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: " + __doc__.splitlines()[0].partition(": ")[2].strip("`. "),
              file=sys.stderr)
        return 2
    *inputs, out = argv
    if out.endswith(".json"):  # (it would be overwritten with a PNG)
        raise SystemExit(f"plot.py: the last argument is the PNG to write, not {out}")
    if not out.lower().endswith(".png"):  # (matplotlib's ValueError for another suffix)
        raise SystemExit(f"plot.py: the last argument is the PNG to write (NAME.png), not {out}")
    try:
        import matplotlib  # noqa: F401  (only to say what is missing, before the work)
    except ImportError:
        raise SystemExit("plot.py: needs matplotlib: pip install -e '.[bench]'") from None
    plot(load(inputs), out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
