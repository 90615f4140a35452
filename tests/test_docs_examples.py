"""The docs' Python examples, run as written.

* The user guide's job workflow (docs/guide.md, "A job workflow, in
  Python"), under ``kvbroker start --size 4``.
* Every complete program among the fenced ``python`` blocks of README.md,
  docs/api.md, docs/kvs.md and docs/protocol.md (the last two not run
  until 2026-12-07), as ``python3 example.py`` runs it, one after the other
  (in the order a reader meets them) in one interpreter, against one
  4-rank instance (``$KVBROKER_URI``), each bounded by
  :data:`BLOCK_TIMEOUT`.

Which blocks are complete programs is decided by a rule, not a marker,
so that a new example is checked without anyone remembering to mark it:
a block is complete when it compiles as a module (a top-level ``await``
or ``async with`` makes it a fragment of some ``main()``) and uses no
name it neither imports nor assigns (the fragments' ``h``, ``kvs``,
``TxnOps``...).  A complete block that cannot end by itself (it waits for
something no other example does) is listed in :data:`NOT_RUN` with the
reason, by one of its lines; an entry that names no complete block fails
the test, so the list does not go stale.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import os
import re
import symtable
import sys
from pathlib import Path

from test_broker_support import doc_block, run_cli

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_DOCS = ("README.md", "docs/api.md", "docs/kvs.md", "docs/protocol.md")
"""(docs/guide.md's program runs in a test of its own, on a fresh instance.)"""
BLOCK_TIMEOUT = 30.0
"""Seconds one example may take (they take well under one; the one that
starts its own 8-rank instance, a couple)."""

NOT_RUN = {
    ("docs/api.md", "    for entry in w:                 # until Ctrl-C"):
        "iterates a watch until interrupted",
}
"""Complete blocks not run: (doc, a whole line of the block, of that block
alone) -> why."""


def python_blocks(doc: str) -> list[tuple[int, str]]:
    """The fenced ``python`` blocks of ``doc`` (relative to the repository):
    (the line the code starts at, the code)."""
    text = (ROOT / doc).read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def free_names(code: str) -> set[str]:
    """The names ``code`` uses but neither imports nor assigns at module
    level (nor are builtins); raises ``SyntaxError`` if it does not compile."""
    compile(code, "<doc>", "exec")  # (symtable alone accepts a top-level async with)
    top = symtable.symtable(code, "<doc>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    used: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for s in table.get_symbols():
            if s.is_referenced() and (table is top or s.is_global()):
                used.add(s.get_name())
        for child in table.get_children():
            walk(child)

    walk(top)
    return used - bound - set(dir(builtins))


def is_complete(code: str) -> bool:
    try:
        return not free_names(code)
    except SyntaxError:
        return False


def not_run(doc: str, code: str) -> str | None:
    """Why this block is not run, or None: see :data:`NOT_RUN`."""
    lines = code.splitlines()
    return next((why for (d, line), why in NOT_RUN.items() if d == doc and line in lines), None)


def complete_blocks() -> list[tuple[str, int, str]]:
    return [(doc, line, code) for doc in EXAMPLE_DOCS for line, code in python_blocks(doc)
            if is_complete(code)]


BLOCKS = complete_blocks()


def test_the_rule_tells_programs_from_fragments() -> None:
    assert is_complete("import asyncio\nasync def main():\n    pass\nasyncio.run(main())\n")
    assert is_complete("from broker.sync import connect\nwith connect() as h:\n    h.ping()\n")
    assert not is_complete("await kvs.put('a', 1)\n")                   # top-level await
    assert not is_complete("from kvs.client import KVS\nasync with KVS.connect() as k:\n"
                           "    pass\n")
    assert not is_complete("from kvs.client import KVS\nkvs = KVS(h)\n")  # h: whose?
    assert not is_complete("async def f():\n    await kvs.get('a')\n")     # kvs inside
    assert not is_complete("def f():\n    return x\n")
    assert is_complete("def f(x):\n    y = x\n    return [z for z in y]\n")


def test_every_not_run_entry_names_a_complete_block() -> None:
    for doc, line in NOT_RUN:
        # one block each: a line two blocks share left out a runnable one
        # (the SyncWatch example stopped by another thread, which ends)
        named = [w for d, w, code in BLOCKS if d == doc and line in code.splitlines()]
        assert len(named) == 1, (line, named)
    # README and api.md do have complete programs, and more than a few
    assert sum(doc == "README.md" for doc, _, _ in BLOCKS) >= 1
    assert {"docs/kvs.md", "docs/protocol.md"} <= {doc for doc, _, _ in BLOCKS}
    assert sum(doc == "docs/api.md" for doc, _, _ in BLOCKS) >= 10


RUNNER = """
import contextlib, io, json, runpy, sys, traceback
report = sys.stdout
for path in sys.argv[1:]:
    print(json.dumps({"start": path}), file=report, flush=True)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name="__main__")
    except BaseException:
        print(json.dumps({"failed": path, "output": out.getvalue() + traceback.format_exc()}),
              file=report, flush=True)
    else:
        print(json.dumps({"ok": path}), file=report, flush=True)
"""
"""Runs the example files named on its command line one after the other,
as ``python3 FILE`` would (``__name__`` is ``"__main__"``), reporting each
on stdout as a JSON line: ``start``, then ``ok`` or ``failed`` with what it
printed and its traceback."""


async def test_the_complete_examples_of_readme_and_api_md_run(start_instance,
                                                              tmp_path: Path) -> None:
    """Each complete program of README.md and docs/api.md (see the module's
    docstring) runs to its end without an error, against one 4-rank
    instance.  They run in one interpreter, one after the other, so the
    check costs one interpreter's start-up, not one per example; each
    example is bounded by BLOCK_TIMEOUT."""
    inst = await start_instance(size=4, fanout=2,  # (groups, cron: their examples)
                                attrs={"broker.modules": "content,kvs,kvs-watch,groups,cron"})
    files: dict[str, str] = {}
    for i, (doc, line, code) in enumerate(BLOCKS):
        if not_run(doc, code) is None:
            path = tmp_path / f"example{i}.py"
            path.write_text(code)
            files[str(path)] = f"{doc}:{line}"
    env = dict(os.environ, KVBROKER_URI=inst.uri(0))
    env.pop("KVBROKER_NAMESPACE", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", RUNNER, *files, cwd=tmp_path, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    failures: list[str] = []
    done: list[str] = []
    try:
        for path, where in files.items():
            for expected in ("start", "end"):
                try:
                    line = await asyncio.wait_for(proc.stdout.readline(), BLOCK_TIMEOUT)
                except TimeoutError:
                    raise AssertionError(f"{where}: still running after {BLOCK_TIMEOUT} s "
                                         f"(failed before it: {failures})") from None
                assert line, f"the runner ended at {where} (exit status {await proc.wait()})"
                report = json.loads(line)
                if expected == "start":
                    assert report == {"start": path}, report
                elif "failed" in report:
                    failures.append(f"{where} failed:\n{report['output']}")
                else:
                    done.append(where)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert not failures, "\n".join(failures)
    assert len(done) == len(files) >= 10


async def test_the_guides_job_workflow_runs_on_four_ranks(tmp_path: Path) -> None:
    script = tmp_path / "jobs.py"
    script.write_text(doc_block("guide.md", "# jobs.py"))
    rc, out, err = await run_cli("start", "--size", "4", "--", sys.executable, str(script),
                                 timeout=120)
    assert rc == 0, err
    # each job ran on the rank it was given and computed its sum
    assert out.splitlines() == ["[(1, 0), (2, 45), (3, 190), (1, 435), (2, 780), (3, 1225)]"]
