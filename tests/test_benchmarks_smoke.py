"""The benchmark runner runs end to end and writes well-formed records.

Runs ``benchmarks/run.py --quick`` on the smallest settings (size 1, a few
hundred iterations, both loops so the uvloop/asyncio ratio records are
exercised too) and checks the JSON record shape.  No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
