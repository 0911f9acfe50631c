"""`llm-datadist bench` as a user runs it (the quick sweep, JSON out) and its peer rows: measured when the
peer is installed, otherwise a skipped row that says how to install it. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from llm_datadist import _bench_peers
from llm_datadist._bench import Results

CLI = [sys.executable, "-m", "llm_datadist._cli"]


def test_quick_bench_reports_every_group_and_leaves_nothing(tmp_path: Path) -> None:
    before = set(os.listdir("/dev/shm"))
    out = tmp_path / "run.json"
    result = subprocess.run(
        [*CLI, "bench", "--quick", "--quiet", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows: list[dict[str, Any]] = json.loads(out.read_text())["rows"]
    groups = {row["group"] for row in rows}
    assert groups >= {"memcpy", "baseline", "peer", "pull_cache", "latency", "pull_blocks", "one-sided"}
    for row in rows:
        if "skipped" not in row:
            assert row["p50_us"] > 0 and row["p99_us"] >= row["p50_us"] and row["samples"] >= 3, row
    broken_down = [row for row in rows if row["group"] == "pull_cache" and "breakdown_us" in row]
    assert broken_down and set(broken_down[0]["breakdown_us"]) == {"resolve", "plan", "copy", "release"}
    assert "x memcpy: ratio to the largest 2-thread numpy.copyto of this run" in result.stdout
    assert set(os.listdir("/dev/shm")) <= before


def test_each_peer_is_measured_or_skipped_with_the_way_to_install_it() -> None:
    results = Results(quiet=True)
    _bench_peers.run(results, lambda nbytes: 3)
    for label, module, hint, _ in _bench_peers.PEERS:
        rows = [row for row in results.rows if row["name"].startswith(label)]
        if importlib.util.find_spec(module.split(".")[0]) is None:
            assert rows == [
                {"group": "peer", "name": label, "skipped": f"not installed (ModuleNotFoundError); {hint}"}
            ]
        elif "skipped" in rows[0]:  # installed, but cannot run on this machine: the row says why
            assert rows[0]["skipped"].startswith("installed, but failed here: ")
        else:
            assert [row["nbytes"] for row in rows] == list(_bench_peers.SIZES)
            assert all(row["samples"] == 3 for row in rows)
