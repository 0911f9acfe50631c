"""`llm-datadist soak` as a user runs it, for a few seconds: owners restart (SIGKILL and `finalize()`),
pools grow and shrink, caches are registered and unregistered while three pullers verify every byte, and
every process's figures are flat. No timing is asserted; the command itself checks bytes and figures."""

from __future__ import annotations

import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "llm_datadist._cli"]
PROCESSES = (
    "driver",
    "v1-steady#1 (v1 owner)",
    "v2-steady#1 (v2 owner)",
    "puller-1 (v1 puller)",
    "puller-2 (v2 puller)",
    "puller-3 (v2-leased puller)",
    "v1-restart#1 (v1 owner)",
    "v2-restart#1 (v2 owner)",
)


def _soak_passes(seed: int, *options: str, timeout_s: float) -> str:
    """Runs `llm-datadist soak` for 8 s; its output, once it passed with every process in its table."""
    result = subprocess.run(
        [*CLI, "soak", *options, "--seconds", "8", "--seed", str(seed)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "soak: PASS" in result.stdout, output
    for process in PROCESSES:
        assert process in result.stdout, f"{process!r} missing from the table:\n{output}"
    assert "pulls verified:" in result.stdout
    assert " churned: " in result.stdout, f"no progress line:\n{output}"  # one every 5 s of the 8
    assert "NOT FLAT" not in result.stdout
    return result.stdout


def test_short_churn_soak_passes_and_reports_every_process(seed: int) -> None:
    _soak_passes(seed, timeout_s=110)


def test_short_churn_soak_across_hosts_passes(seed: int) -> None:
    """The same soak with the owners in one network namespace and the pullers in another: links over TCP,
    bytes through the transfer engine, and the same flat figures (the engine's own connections to owners
    that are gone are reported apart and bounded)."""
    from llm_datadist._demo import hosts_unavailable

    reason = hosts_unavailable()
    if reason is not None:
        pytest.skip(reason)
    out = _soak_passes(seed, "--hosts", timeout_s=150)
    assert "across hosts: owners in network namespace" in out, out
    assert "Across hosts, not in fds above" in out, out
