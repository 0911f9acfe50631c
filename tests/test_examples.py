"""Every program in examples/ runs as a user runs it (`python examples/<name>.py` from the repository
root), finishes, and leaves nothing behind (the autouse fixture checks /dev/shm and children)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(path for path in (ROOT / "examples").glob("*.py") if not path.name.startswith("_"))


def test_there_are_examples() -> None:
    assert {path.stem for path in EXAMPLES} >= {
        "v1_pull",
        "v1_layerwise_push",
        "v2_one_sided_blocks",
        "v2_two_sided",
        "hixl_read_write",
    }


@pytest.mark.parametrize("example", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_example_runs_as_written(example: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(example.relative_to(ROOT))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "both sides finished" in result.stdout
