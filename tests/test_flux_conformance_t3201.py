"""flux-core t/t3201-crontabs.t (rc1 loading the crontabs of
``cron.directory``) against real kvbroker instances: ``kvbroker start -S
cron.directory=DIR CMD`` as a process, as Flux's ``flux start``, with
DIR relative to the command's working directory as Flux's ``cron.d``.

Flux's five cases, and where each is:

1. 'empty cron.directory works', 2. 'non-existent cron.directory works',
   3. 'cron.directory with subdirectory works' ->
   :func:`test_empty_missing_and_subdirectory_start_with_no_entries`: the
   start succeeds and, kvbroker's own check, rank 0's cron is loaded
   with no entry (a crontab in the subdirectory is passed over).
4. 'cron.directory with non-crontab file fails', 5. 'cron.directory with
   good crontab files works' -> :func:`test_bad_file_fails_the_start_good_files_listed`:
   the start fails, saying "could not load crontab" with the file and the
   line, and the command is not run; ``cron list`` as the initial
   program shows the good files' entries, in the order of the files'
   names.

kvbroker's own: :func:`test_reload_makes_the_entries_again` -- rank 0's
cron reads the directory each time it loads, so ``module reload cron``
brings the directory's entries back (and drops those made by hand), a
bad file fails the reload with the same message, and rank 1 has no cron.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from test_broker_support import run_cli

from broker.handle import Handle

T = 30.0
HEADER = "  ID NAME            STATE       RUNS       LAST RUN  STATUS         TRIGGER\n"


async def start(where: Path, *command: str) -> tuple[int, str, str]:
    """``kvbroker start -S cron.directory=cron.d COMMAND`` in ``where``."""
    return await run_cli("start", "-S", "cron.directory=cron.d", "--", *command, cwd=where,
                         timeout=T)


def case(tmp_path: Path, name: str, files: dict[str, str] | None) -> Path:
    """A working directory ``name`` whose ``cron.d`` holds ``files`` (a
    name ending in ``/``: a subdirectory); no ``cron.d`` for None."""
    where = tmp_path / name
    where.mkdir()
    if files is not None:
        (where / "cron.d").mkdir()
    for rel, text in (files or {}).items():
        path = where / "cron.d" / rel
        if rel.endswith("/"):
            path.mkdir()
        else:
            path.write_text(text)
    return where


async def test_empty_missing_and_subdirectory_start_with_no_entries(tmp_path: Path) -> None:
    """Flux 1-3."""
    empty = case(tmp_path, "empty", {})
    missing = case(tmp_path, "missing", None)
    subdir = case(tmp_path, "subdir", {"subdir/": "", "subdir/tab": "10 * * * * true\n"})
    assert (empty / "cron.d").is_dir() and not (missing / "cron.d").exists()
    runs = await asyncio.gather(*(start(where, "kvbroker", "cron", "list")
                                  for where in (empty, missing, subdir)))
    for where, run in zip(("empty", "missing", "subdir"), runs, strict=True):
        assert run == (0, HEADER, ""), (where, run)


async def test_bad_file_fails_the_start_good_files_listed(tmp_path: Path) -> None:
    """Flux 4-5."""
    bad = case(tmp_path, "bad", {"badtab": "zzz\n"})
    late = case(tmp_path, "late", {"a": "# fine\n5 * * * * true\n",
                                   "b": "0 0 * * * true\n\n61 * * * * true\n"})
    good = case(tmp_path, "good", {"goodtab2": "20 * * * * hostname\n",
                                   "goodtab": "10 * * * * true\n", "sub/": "",
                                   "sub/zzz": "not a crontab: in a subdirectory\n"})
    runs = await asyncio.gather(start(bad, "touch", "ran"), start(late, "touch", "ran"),
                                start(good, "kvbroker", "cron", "list"))
    for where, (rc, out, err), file, line in ((bad, runs[0], "badtab", 1),
                                              (late, runs[1], "b", 3)):
        assert rc != 0, (rc, out, err)
        assert re.search(rf"could not load crontab cron\.d/{file}: line {line}: ", err), err
        assert not (where / "ran").exists()  # (the command never ran)
    assert "not a crontab line" in runs[0][2] and "minute field '61'" in runs[1][2]
    rc, out, err = runs[2]
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == HEADER.rstrip(), out
    assert [line.split()[:2] + line.split()[-6:] for line in lines[1:]] == [
        ["1", "true", "tab", "10", "*", "*", "*", "*"],
        ["2", "hostname", "tab", "20", "*", "*", "*", "*"]], out


async def test_reload_makes_the_entries_again(start_instance, connect, tmp_path: Path) -> None:
    """kvbroker's own: ``module reload cron`` reads the directory again."""
    cron_d = tmp_path / "cron.d"
    cron_d.mkdir()
    (cron_d / "nightly").write_text("# kept by an administrator\n30 2 * * * ./nightly\n")
    inst = await start_instance(size=2, attrs={"cron.directory": str(cron_d)})
    uri, h = inst.uri(0), await connect(inst, 0)

    async def entries(rank: int = 0) -> list[tuple[int, str, str]]:
        got = (await h.rpc("cron.list", {}, nodeid=rank))["entries"]
        return [(e["id"], e["typedata"]["schedule"], e["source"]) for e in got]

    source = f"{cron_d}/nightly:2"
    assert await entries() == [(1, "30 2 * * *", source)]
    e = (await h.rpc("cron.list", {}))["entries"][0]
    assert (e["command"], e["name"], e["stopped"]) == ("./nightly", "./nightly", False)
    assert await h.attr_get("cron.directory") == str(cron_d)
    assert "cron" not in await module_names(h, 1)  # (rank 0's, as Flux's)

    rc, out, err = await run_cli("cron", "interval", "1h", "true", uri=uri)
    assert rc == 0 and "cron-2 created" in out, (out, err)
    (cron_d / "weekly").write_text("@weekly ./weekly\n")
    rc, out, err = await run_cli("module", "reload", "cron", uri=uri)
    assert rc == 0, err
    assert await entries() == [(1, "30 2 * * *", source),
                               (2, "@weekly", f"{cron_d}/weekly:1")]

    (cron_d / "zz-bad").write_text("@daily ./ok\n* * * *\n")
    rc, out, err = await run_cli("module", "reload", "cron", uri=uri)
    assert rc == 1, (out, err)
    assert f"could not load crontab {cron_d}/zz-bad: line 2: " in err, err
    assert "cron" not in await module_names(h, 0)  # (the reload failed: none loaded)
    (cron_d / "zz-bad").unlink()
    rc, out, err = await run_cli("module", "load", "cron", uri=uri)
    assert rc == 0, err
    assert [eid for eid, _, _ in await entries()] == [1, 2]


async def module_names(h: Handle, rank: int) -> list[str]:
    return [m["name"] for m in (await h.rpc("module.list", {}, nodeid=rank))["modules"]]
