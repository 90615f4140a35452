"""The user guide's job workflow example (docs/guide.md, "A job workflow,
in Python") run as the guide says, under ``kvbroker start --size 4``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from test_broker_support import run_cli

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide.md"


def guide_block(first_line: str) -> str:
    """The fenced Python block of docs/guide.md that starts with ``first_line``."""
    for block in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"no code block starting with {first_line!r} in {GUIDE}")


async def test_the_guides_job_workflow_runs_on_four_ranks(tmp_path: Path) -> None:
    script = tmp_path / "jobs.py"
    script.write_text(guide_block("# jobs.py"))
    rc, out, err = await run_cli("start", "--size", "4", "--", sys.executable, str(script),
                                 timeout=120)
    assert rc == 0, err
    # each job ran on the rank it was given and computed its sum
    assert out.splitlines() == ["[(1, 0), (2, 45), (3, 190), (1, 435), (2, 780), (3, 1225)]"]
