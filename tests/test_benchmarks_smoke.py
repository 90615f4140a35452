"""The benchmark runner runs end to end and writes well-formed records.

One run of every workload with the smallest settings that still exercise
each (``--quick --size 2 --n-iter 5 --event-loop both``: a far rank other
than 0, W2 cut into blocks of one commit, both loops so the uvloop/asyncio
ratio records are made too), checked for the JSON record shape and for
leaving nothing behind; an interrupted run; the runner's option checks;
the plot.  No timing is asserted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
RUN = [sys.executable, str(REPO / "benchmarks" / "run.py")]
WORKLOADS = ("W0", "W1", "W1b", "W2", "W2s", "W2p", "W3", "W3c", "W4", "W5", "W5x", "W5r", "W6",
             "Wgc", "Wlog", "Wcopy", "Wsync", "Wstart")
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
    "fanout": int,
    "attrs": dict,
    "cores": int,
    "loadavg": (int, float),
}
LOOPS = ("uvloop", "asyncio")


@pytest.fixture
def tmpdir_env() -> Iterator[tuple[Path, dict[str, str]]]:
    """A TMPDIR of its own for the runner (short: sockets go in it), so the
    test can see that nothing is left in it: log directory, run
    directories, W0's socket directories."""
    tmp = Path(tempfile.mkdtemp(prefix="kvb-smoke-"))
    try:
        yield tmp, {**os.environ, "TMPDIR": str(tmp)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_record(rec: dict[str, object], reps: int) -> None:
    for key, types in KEYS.items():
        assert key in rec, (key, rec)
        assert isinstance(rec[key], types), (key, rec)
    # (Wsync runs one rank whatever --size, and says so)
    assert rec["size"] == (1 if rec["workload"] == "Wsync" else 2), rec
    assert rec["fanout"] == 2, rec
    assert isinstance(rec["cores"], int) and rec["cores"] >= 1
    assert rec["loop"] in (*LOOPS, "uvloop/asyncio")
    values = rec["reps"]
    assert isinstance(values, list) and all(isinstance(v, (int, float)) for v in values)
    # one value per rep (a ratio record: per rep pair), in rep order
    assert len(values) == reps, rec
    assert isinstance(rec["rss_mb"], dict)
    assert all(k in ("0", "1") and isinstance(v, (int, float))
               for k, v in rec["rss_mb"].items()), rec


HALVES = (WORKLOADS[:8], WORKLOADS[8:])
"""Every workload, in two runs that the suite's workers can take side by
side (one run of all took a minute: the suite's longest test)."""


@pytest.mark.parametrize("half", HALVES, ids=["W0-W3c", "W4-Wstart"])
def test_every_workload_runs_and_writes_well_formed_records(
        tmp_path: Path, tmpdir_env: tuple[Path, dict[str, str]], half: tuple[str, ...]) -> None:
    tmp, env = tmpdir_env
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [*RUN, *half, "--quick", "--size", "2", "--n-iter", "5", "--event-loop", "both",
         "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for word in ("FAILED", "SKIPPED", "failed"):  # (W2p notes failed requests)
        assert word not in proc.stdout, proc.stdout
    assert os.listdir(tmp) == []  # logs, run dirs, W0's socket dirs: all removed

    records = json.loads(out.read_text())
    for rec in records:
        check_record(rec, reps=1)  # --quick: one rep per loop
    seen = {(r["workload"], r["loop"]) for r in records}
    for wl in half:
        assert {(wl, loop) for loop in LOOPS} <= seen, wl
    assert {wl for wl, _ in seen} == set(half)
    recs = {(r["workload"], r["variant"], r["metric"], r["loop"]): r for r in records}

    def value(wl: str, variant: str, metric: str, loop: str = "uvloop") -> float:
        return float(recs[(wl, variant, metric, loop)]["value"])

    if half == HALVES[0]:
        check_first_half(recs, value, proc.stdout)
    else:
        check_second_half(value, proc.stdout)


def check_first_half(recs: dict[tuple[str, ...], dict[str, Any]],
                     value: Callable[..., float], stdout: str) -> None:
    assert recs[("W0", "zmq-blocking", "rate", "uvloop")]["rss_mb"] == {}
    assert set(recs[("W1", "rank0", "rate", "uvloop")]["rss_mb"]) == {"0", "1"}
    assert ("W1", "rank0", "rate", "uvloop/asyncio") in recs
    # W2 at 5 commits: five blocks of one (there were empty tenths: a ZeroDivisionError)
    assert value("W2", "rank0 b05/b01", "block_ratio") > 0
    assert "blocks b01-b05 of one commit each" in stdout
    # W2p's 8 client processes really ran: the ping reference and the commits
    assert recs[("W2p", "8 clients ping r0", "rate", "uvloop")]["unit"] == "rpcs/s"
    assert recs[("W2p", "8 clients all r0", "rate", "uvloop")]["unit"] == "commits/s"
    for variant in ("1 client r0", "8 clients ping r0", "8 clients all r0",
                    "8 clients spread r0-1"):
        assert value("W2p", variant, "rate") > 0, variant
    for variant in ("8 clients ping r0", "8 clients all r0"):
        assert (value("W2p", variant, "user_us:clients")
                + value("W2p", variant, "sys_us:clients")) > 0, variant
    assert ("W2p", "8 clients all r0 / 1 client", "ratio", "uvloop") in recs
    # W3c read the whole log back, cold and warm, on the far rank and rank 0
    for variant in ("rank1 cold", "rank1 warm", "rank0 cold", "rank0 warm"):
        assert value("W3c", variant, "rate") > 0, variant
    # a reduced run's targets are shown, not judged
    targets = stdout.partition("\nTargets (issue 5)")[2].partition("\ndone in")[0]
    judged = [line for line in targets.splitlines() if line.startswith("  [")]
    assert judged and all("(not judged: --quick, --n-iter 5 < " in line for line in judged)


def check_second_half(value: Callable[..., float], stdout: str) -> None:
    # W5r: the far rank's first reads find the blobs the setroot it heard
    # brought, no content.load from rank 0 (the latency is not asserted)
    assert value("W5r", "read r1", "p50") > 0
    assert value("W5r", "read r1", "fetches") == 0
    assert value("W6", "r0->r1", "lost") == 0
    # the titles name the far rank this size has
    assert "W6  event throughput, publisher on rank 0 -> subscriber on rank 1" in stdout
    assert "W4  watch latency, writer on rank 0 -> watcher on rank 1" in stdout
    # rank 3's targets are skipped at this size
    targets = stdout.partition("\nTargets (issue 5)")[2].partition("\ndone in")[0]
    assert "skipped at --size 2 (they need rank 3" in targets


@pytest.mark.parametrize("sig,first", [(signal.SIGINT, "W0"), (signal.SIGTERM, "W0"),
                                       (signal.SIGTERM, None)],
                         ids=["SIGINT", "SIGTERM", "SIGTERM-before-any-finished"])
def test_an_interrupted_run_says_so_in_one_line_and_leaves_nothing(
        tmp_path: Path, tmpdir_env: tuple[Path, dict[str, str]], sig: signal.Signals,
        first: str | None) -> None:
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) or
    SIGTERM (``timeout``) once W2p has begun, after W0 finished: one line,
    the status of the signal, W0's records kept, the temporary directory
    empty.  (The signal lands wherever W2p is then; every point must end
    this way.)  Without W0 first, the line says that no file was written,
    rather than leave the user to look for one."""
    tmp, env = tmpdir_env
    out = tmp_path / "bench.json"
    workloads = [first, "W2p"] if first else ["W2p"]
    # SIGINT at its default, even if this test runs in a background job
    default_sigint = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                      "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    proc = subprocess.Popen(
        [sys.executable, "-c", default_sigint, *RUN[1:], "--quick", "--size", "2",
         *workloads, "--json", str(out)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
        start_new_session=True,
    )
    try:
        assert proc.stderr is not None
        seen = b""
        while b"[W2p] rep 1/1" not in seen:
            byte = proc.stderr.read(1)
            assert byte, seen.decode()
            seen += byte
        os.killpg(proc.pid, sig)
        err = (seen + proc.stderr.read()).decode()
        assert proc.wait(timeout=120) == 128 + sig, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    if first is None:
        assert last == (f"interrupted ({sig.name}); no workload finished: {out} "
                        "not written"), err
        assert not out.exists()
    else:
        assert last == f"interrupted ({sig.name}); records of W0 in {out}", err
        assert {r["workload"] for r in json.loads(out.read_text())} == {"W0"}
    assert os.listdir(tmp) == []


# A rep whose workload sends the runner a stop signal from inside its event
# loop's shutdown (an async generator's finalizer runs there), or before
# its loop exists; run in a process of its own, for its signal handlers.
SIGNAL_IN_SHUTDOWN = """
import asyncio, os, signal, sys, tempfile
from pathlib import Path
from benchmarks import harness

async def ends_in_shutdown():
    try:
        yield 1
        await asyncio.sleep(3600)
    finally:
        os.kill(os.getpid(), signal.SIGTERM)  # (handled before kill returns)

async def run(ctx):
    gen = ends_in_shutdown()
    await gen.__anext__()  # left unfinished: the Runner's close finalizes it
    return [harness.Sample("v", "rate", 1.0, "x")]

harness.install_stop_handlers()
w = harness.Workload("Wt", "test", "none", run)
try:
    with tempfile.TemporaryDirectory() as tmp:
        harness.run_rep(harness.Settings(), w, sys.argv[1], 1, Path(tmp))
except KeyboardInterrupt:
    print("interrupted", harness.stop_signal() == signal.SIGTERM)
else:
    print("not interrupted")
"""


@pytest.mark.parametrize("loop", LOOPS)
def test_a_stop_signal_while_a_reps_loop_closes_waits_for_it(loop: str) -> None:
    """SIGTERM while the rep's loop shuts down, after its task ended: the
    handler raised KeyboardInterrupt right there, inside the loop's own
    shutdown, which then never finished (asyncio: "Task was destroyed but
    it is pending!" after the run's one line, as a loaded CI run showed;
    uvloop in an experiment: "Cannot close a running event loop").  Now the
    signal is kept until the loop is closed, and the rep ends interrupted."""
    proc = subprocess.run([sys.executable, "-c", SIGNAL_IN_SHUTDOWN, loop], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "interrupted True", proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr


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
    # (root may "write" in /proc by its permissions: the file is tried)
    (["--json", "/proc/x.json"], "--json /proc/x.json: cannot write /proc/x.json.tmp"),
    (["-n", "1K,2x"], "not a size: '2x'"),
    (["-S", "kvs.cache-expire"], "-S kvs.cache-expire: give NAME=VALUE"),
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


def test_ratios_and_sizes_keep_one_value_per_rep(monkeypatch: pytest.MonkeyPatch) -> None:
    """A W1b size given twice was measured twice and filed as two reps of
    one; a figure that was 0 on asyncio in one rep lost that rep pair from
    its ratio, so the ratio's reps no longer lined up with the reps."""
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks import harness, run

    assert run.parse_args(["W1b", "-n", "1K", "-n", "1024,64K"]).msg_sizes == [1024, 65536]
    series = [harness.Series("v", "rate", "x/s", "higher", "uvloop", [4.0, 6.0]),
              harness.Series("v", "rate", "x/s", "higher", "asyncio", [2.0, 3.0]),
              harness.Series("v", "sys", "us", "lower", "uvloop", [1.0, 1.0]),
              harness.Series("v", "sys", "us", "lower", "asyncio", [1.0, 0.0])]
    ratios = harness.loop_ratios(series)
    assert [(r.metric, r.values) for r in ratios] == [("rate", [2.0, 2.0])]


def test_a_figure_missing_from_a_rep_keeps_the_other_reps_in_their_columns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """W5x leaves out a level that failed in one rep: its later reps were
    shown under the wrong rep's column and paired with the other loop's
    wrong rep.  Each value keeps its rep: the table shows ``-`` for the
    missing one, and the ratio pairs rep with rep."""
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks import harness

    def rep(loop: str, n: int, value: float | None) -> harness.RepResult:
        samples = [] if value is None else [harness.Sample("v", "rate", value, "x/s")]
        return harness.RepResult(loop, n, samples, {}, 1.0, [])

    series = harness.fold([rep("uvloop", 0, 10.0), rep("asyncio", 0, 5.0),
                           rep("uvloop", 1, None), rep("asyncio", 1, 4.0),
                           rep("uvloop", 2, 30.0), rep("asyncio", 2, 10.0)])
    [ratio] = harness.loop_ratios(series)
    assert (ratio.reps, ratio.values) == ([0, 2], [2.0, 3.0])
    header, uv_row, _asyncio_row = harness._main_rows(series)
    assert header.split()[-3:] == ["rep1", "rep2", "rep3"], header
    assert uv_row.split()[-3:] == ["10.00", "-", "30.00"], uv_row


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


def test_setattr_reaches_every_instance_and_the_records(tmp_path: Path) -> None:
    """``-S NAME=VALUE`` is given to the instances (a bad value fails the
    workload, as the rank refuses it), and said in the header and the
    records: an A/B of a setting within one checkout."""
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "run.py"), "W1", "--quick",
             "--event-loop", "asyncio", *args],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
            env={**os.environ, "TMPDIR": str(tmp_path)})  # (a failed run keeps its logs)

    bad = run("-S", "kvs.cache-expire=1ms")
    assert bad.returncode == 1 and "kvs.cache-expire: '1ms' is under 0.1s" in bad.stdout, (
        bad.stdout + bad.stderr)
    out = tmp_path / "out.json"
    good = run("-S", "kvs.cache-expire=0", "--json", str(out))
    assert good.returncode == 0, good.stdout + good.stderr
    assert "kvs.cache-expire=0" in good.stdout.splitlines()[0]
    records = json.loads(out.read_text())
    assert records and all(r["attrs"] == {"kvs.cache-expire": "0"} for r in records)


def test_plot_says_what_it_needs(tmp_path: Path) -> None:
    """Without matplotlib (not in the test extra) plot.py was an ImportError
    traceback; an output name that is not a PNG, matplotlib's ValueError."""
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not installed here')\n")
    (tmp_path / "run.json").write_text("[]")
    plot = [sys.executable, str(REPO / "benchmarks" / "plot.py")]
    for args, says in ((["run.json", "out.png"],
                        "plot.py: needs matplotlib: pip install -e '.[bench]'"),
                       (["run.json", "out.txt"],
                        "plot.py: the last argument is the PNG to write (NAME.png), not out.txt")):
        done = subprocess.run([*plot, *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60, env={**os.environ,
                                               "PYTHONPATH": str(tmp_path / "shadow")})
        assert (done.returncode, done.stderr) == (1, says + "\n"), done.stderr
