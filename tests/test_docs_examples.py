"""The user guide's job workflow example (docs/guide.md, "A job workflow,
in Python") run as the guide says, under ``kvbroker start --size 4``."""

from __future__ import annotations

import sys
from pathlib import Path

from test_broker_support import doc_block, run_cli


async def test_the_guides_job_workflow_runs_on_four_ranks(tmp_path: Path) -> None:
    script = tmp_path / "jobs.py"
    script.write_text(doc_block("guide.md", "# jobs.py"))
    rc, out, err = await run_cli("start", "--size", "4", "--", sys.executable, str(script),
                                 timeout=120)
    assert rc == 0, err
    # each job ran on the rank it was given and computed its sum
    assert out.splitlines() == ["[(1, 0), (2, 45), (3, 190), (1, 435), (2, 780), (3, 1225)]"]
