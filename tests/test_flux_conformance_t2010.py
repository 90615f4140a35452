"""flux-core t/t2010-kvs-snapshot-restore.t (the content-sqlite part): an
instance started again on its statedir has the last one's content, its
version does not start again at 0, and the restore is logged with the
date.  Run as Flux's test writes it, ``-S statedir=DIR`` (``--setattr``)
included: that is Flux's spelling of ``--statedir`` (it was refused,
and before that taken and ignored).  Flux's content-files backing has no
counterpart here (one SQLite store).
"""

from __future__ import annotations

import time
from pathlib import Path

from test_broker_support import run_cli

T = 60.0


async def start(statedir: Path, *command: str, spelling: str = "-S") -> str:
    rc, out, err = await run_cli("start", spelling, f"statedir={statedir}", "--", *command,
                                 timeout=T)
    assert rc == 0, err
    return out


async def test_snapshot_restore_with_a_statedir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = int(await start(state, "kvbroker", "kvs", "put", "--sequence", "testkey=42"))
    assert (state / "content.sqlite").is_file()  # (kept after the instance exited)
    assert await start(state, "kvbroker", "kvs", "get", "testkey",
                       spelling="--setattr") == "42\n"
    # Flux asserts the version grows over restarts: other modules commit at
    # its start.  Nothing does here, so it must not fall back (to 0).
    versions = [int(await start(state, "kvbroker", "kvs", "version")) for _ in range(2)]
    assert first <= versions[0] <= versions[1], (first, versions)
    today = time.strftime("%Y-%m-%d")  # (Flux: `date --iso-8601`)
    dmesg = await start(state, "kvbroker", "dmesg")
    assert any("checkpoint" in line and today in line for line in dmesg.splitlines()), dmesg
    root = (await start(state, "kvbroker", "kvs", "getroot", "-b")).strip()
    assert root.startswith("sha256-") and len(root) == 71, root


async def test_statedir_given_twice_must_agree(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    rc, out, err = await run_cli("start", "-S", f"statedir={a}", "--statedir", str(b), "--",
                                 "true", timeout=T)
    assert (rc, out) == (2, ""), err
    assert err.rstrip().endswith(f"error: -S statedir={a} and --statedir {b} name two "
                                 "directories: give one"), err
    assert not a.exists() and not b.exists()
    rc, _, err = await run_cli("start", "-S", f"statedir={a}", "--statedir", str(a), "--",
                               "kvbroker", "kvs", "put", "k=v", timeout=T)
    assert rc == 0 and (a / "content.sqlite").is_file(), err
