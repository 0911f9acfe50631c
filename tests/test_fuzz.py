"""A bounded, CI-sized run of the coverage-guided protocol fuzzer (tests/fuzz/fuzz_protocol.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

FUZZER = Path(__file__).parent / "fuzz" / "fuzz_protocol.py"
RUNS = 20000


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris is not installed here")
def test_protocol_fuzzing_finds_nothing(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(FUZZER), f"-runs={RUNS}", "-seed=1", f"-artifact_prefix={tmp_path}/"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=Path(__file__).parent.parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Done {RUNS} runs" in result.stderr
    assert not list(tmp_path.iterdir()), "the fuzzer saved a crashing input"
