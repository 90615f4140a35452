"""The benchmark runner runs end to end and writes well-formed records.

Runs ``benchmarks/run.py --quick`` on the smallest settings (size 1, a few
hundred iterations, both loops so the uvloop/asyncio ratio records are
exercised too) and checks the JSON record shape.  No timing is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
KEYS = {
    "workload": str,
    "variant": str,
    "loop": str,
    "size": int,
    "metric": str,
    "value": (int, float),
    "unit": str,
    "reps": list,
    "commit": str,
    "rss_mb": dict,
}


def test_quick_run_writes_records(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick", "W0", "W1", "W6",
         "--size", "1", "--n-iter", "300", "--event-loop", "both", "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json.loads(out.read_text())
    assert isinstance(records, list) and records
    for rec in records:
        for key, types in KEYS.items():
            assert key in rec, (key, rec)
            assert isinstance(rec[key], types), (key, rec)
        assert rec["size"] == 1
        assert isinstance(rec.get("loadavg"), (int, float))
        assert rec["loop"] in ("uvloop", "asyncio", "uvloop/asyncio")
        assert rec["reps"] and all(isinstance(v, (int, float)) for v in rec["reps"])
        assert all(isinstance(k, str) and isinstance(v, (int, float))
                   for k, v in rec["rss_mb"].items())
    seen = {(r["workload"], r["loop"]) for r in records}
    for wl in ("W0", "W1", "W6"):
        assert {(wl, "uvloop"), (wl, "asyncio")} <= seen, wl
    w1 = [r for r in records if r["workload"] == "W1" and r["loop"] == "uvloop"]
    assert w1 and set(w1[0]["rss_mb"]) == {"0"}
    w6 = {r["metric"]: r["value"] for r in records
          if r["workload"] == "W6" and r["loop"] == "uvloop"}
    assert w6["lost"] == 0
    assert "W6  event throughput" in proc.stdout


def test_quick_w2p_runs_every_client_mode(tmp_path: Path) -> None:
    """W2p's 8 client processes really run: the ping reference and the
    commit variant each report a rate and the clients' CPU, and no request
    failed (a failure is printed as a note)."""
    out = tmp_path / "w2p.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick", "W2p",
         "--size", "1", "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "failed" not in proc.stdout, proc.stdout
    recs = {(r["variant"], r["metric"]): r for r in json.loads(out.read_text())}
    assert recs[("8 clients ping r0", "rate")]["unit"] == "rpcs/s"
    assert recs[("8 clients all r0", "rate")]["unit"] == "commits/s"
    for variant in ("1 client r0", "8 clients ping r0", "8 clients all r0"):
        assert recs[(variant, "rate")]["value"] > 0, variant
    for variant in ("8 clients ping r0", "8 clients all r0"):
        assert recs[(variant, "user_us:clients")]["value"] > 0, variant
    assert ("8 clients all r0 / 1 client", "ratio") in recs


def test_quick_w5r_reads_on_a_far_rank_without_fetching(tmp_path: Path) -> None:
    """W5r's first reads on the far rank find the blobs the setroot it
    heard brought: no ``content.load`` from rank 0 (a latency, no assert)."""
    out = tmp_path / "w5r.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick", "W5r",
         "--size", "2", "--n-iter", "20", "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = {(r["variant"], r["metric"]): r for r in json.loads(out.read_text())}
    assert recs[("read r1", "p50")]["unit"] == "ms" and recs[("read r1", "p50")]["value"] > 0
    assert recs[("read r1", "fetches")]["value"] == 0


def test_w2_blocks_are_500_commits_or_tenths_and_never_empty(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """W2's blocks: of 500 commits when the run has two or more (the last
    takes the remainder), else tenths; below 10 commits there were empty
    tenths, and ``b10/b01`` divided by zero."""
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.workloads.commits import block_sizes, describe_blocks

    assert block_sizes(5_000) == [500] * 10
    assert block_sizes(5_200) == [500] * 9 + [700]
    assert block_sizes(1_000) == [500, 500]
    assert block_sizes(999) == [99] + [100] * 9
    assert block_sizes(25) == [2, 3, 2, 3, 2, 3, 2, 3, 2, 3]
    assert block_sizes(5) == [1] * 5
    assert block_sizes(1) == [1]
    for n in range(1, 2_100):
        sizes = block_sizes(n)
        assert sum(sizes) == n and min(sizes) >= 1, n
    assert "of 500 commits" in describe_blocks(5_000)
    assert "tenths" in describe_blocks(999)


@pytest.mark.parametrize(("args", "says"), [
    (["--timeout", "0"], "--timeout must be a positive number of seconds"),
    (["--timeout", "-1"], "--timeout must be a positive number of seconds"),
    # (PATH is an empty directory: no py-spy there)
    (["--py-spy", "prof"], "--py-spy needs py-spy on PATH"),
    (["--json", "/nonexistent/x.json"], "--json /nonexistent/x.json: no directory"),
])
def test_bad_options_are_refused_before_anything_runs(tmp_path: Path, args: list[str],
                                                      says: str) -> None:
    """Refused by the argument parser (status 2, one message), not found
    out after a workload or every workload failed."""
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), "W0", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PATH": str(empty)},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_plot_takes_several_runs_and_says_what_is_wrong(tmp_path: Path) -> None:
    """docs/performance.png is drawn from two runs (the main one and W5x):
    plot.py takes both files; a missing one is an error message, not a
    traceback."""
    pytest.importorskip("matplotlib")
    records = json.loads((REPO / "docs" / "bench-latest.json").read_text())
    main = [r for r in records if r["workload"] != "W5x"]
    w5x = [r for r in records if r["workload"] == "W5x"]
    assert main and w5x
    (tmp_path / "run.json").write_text(json.dumps(main))
    (tmp_path / "w5x.json").write_text(json.dumps(w5x))
    plot = [sys.executable, str(REPO / "benchmarks" / "plot.py")]
    done = subprocess.run([*plot, "run.json", "w5x.json", "out.png"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out.png").read_bytes().startswith(b"\x89PNG")
    missing = subprocess.run([*plot, "missing.json", "out2.png"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1
    assert "missing.json: No such file or directory" in missing.stderr
    assert "Traceback" not in missing.stderr and not (tmp_path / "out2.png").exists()
