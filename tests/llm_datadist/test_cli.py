"""The `llm-datadist` command as a user runs it: the demo end to end (on one host and across two network
namespaces, or the reason it cannot run there), `ls` and `gc`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from llm_datadist._shm.segment import Segment

CLI = [sys.executable, "-m", "llm_datadist._tools.cli"]


def test_small_demo_verifies_every_byte_and_leaves_nothing() -> None:
    # No /dev/shm entry left: the autouse fixture checks (the demo's processes are dead by then; an entry
    # of another session running at the same time is not ours to judge).
    result = subprocess.run(
        [*CLI, "demo", "--small"], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every byte verified" in result.stdout
    for row in (
        "pull_cache whole request",
        "layer by layer",
        "offsets and size",
        "numpy.copyto, 2 threads",
        "transfer_cache_async",
        "pull_blocks",
        "v2 pull_blocks, registered memory",
    ):
        assert row in result.stdout


def test_ls_and_gc_find_a_dead_processs_segment() -> None:
    # A child creates a segment and is SIGKILLed before it can unlink it.
    code = (
        "import time\n"
        "from llm_datadist._shm.segment import Segment\n"
        "s = Segment.create(3333)\n"
        "print(s.name, flush=True)\n"
        "time.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        name = child.stdout.readline().strip()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    live = Segment.create(4097)
    try:
        listing = subprocess.run([*CLI, "ls"], capture_output=True, text=True, timeout=60, check=True).stdout
        assert name in listing and live.name in listing
        dead_line = next(line for line in listing.splitlines() if line.startswith(name))
        assert "dead" in dead_line and "3333" in dead_line
        gc = subprocess.run([*CLI, "gc"], capture_output=True, text=True, timeout=60, check=True).stdout
        assert f"removed {name}" in gc
        assert not os.path.exists(f"/dev/shm{name}")
        assert os.path.exists(f"/dev/shm{live.name}")  # a live owner's segment is left alone
    finally:
        live.close()


def test_ls_and_gc_show_and_clean_sockets(seed: int, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    from tests._peer import PROMPT_IP, PromptPeer

    port = 21999
    peer = PromptPeer(1, port, seed)
    try:
        listing = subprocess.run([*CLI, "ls"], capture_output=True, text=True, timeout=60, check=True).stdout
        line = next(row for row in listing.splitlines() if row.startswith(f"{PROMPT_IP}_{port}.sock"))
        assert str(peer.pid) in line and "serving" in line
        peer.kill()
    finally:
        peer.close()
    listing = subprocess.run([*CLI, "ls"], capture_output=True, text=True, timeout=60, check=True).stdout
    line = next(row for row in listing.splitlines() if row.startswith(f"{PROMPT_IP}_{port}.sock"))
    assert "stale" in line
    gc = subprocess.run([*CLI, "gc"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert f"{PROMPT_IP}_{port}.sock" in gc
    assert not (_runtime_dir / f"{PROMPT_IP}_{port}.sock").exists()


def test_hosts_demo_runs_across_two_namespaces_and_leaves_nothing() -> None:
    from llm_datadist._tools.demo.run import HOSTS_NOTE
    from llm_datadist._tools.netns import hosts_unavailable, netns_list

    reason = hosts_unavailable()
    if reason is not None:
        pytest.skip(reason)
    # No /dev/shm entry left: the autouse fixture checks (its owners, the demo's children, are dead by then).
    with subprocess.Popen(
        [*CLI, "demo", "--hosts", "--small"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=300)
        finally:
            process.kill()
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every byte verified" in result.stdout
    for row in ("pull_cache whole request", "layer by layer", "offsets and size", "transfer_cache_async"):
        assert row in result.stdout
    assert "pull_blocks" in result.stdout
    assert "v2 pull_blocks, registered memory" in result.stdout  # the two-sided link across the namespaces
    assert HOSTS_NOTE in result.stdout
    assert "the Prompt in network namespace llmdd-" in result.stdout
    # Its namespaces are named after its pid (others may be another session's, running at the same time).
    assert not [name for name in netns_list() if name.startswith(f"llmdd-{process.pid}-")]


@pytest.mark.parametrize("command", ["demo", "bench", "soak"])
def test_hosts_without_root_says_why_and_exits_2(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from llm_datadist._tools.cli import main
    from llm_datadist._tools.netns import netns_unavailable

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    netns_unavailable.cache_clear()
    try:
        assert main([command, "--hosts"]) == 2
    finally:
        netns_unavailable.cache_clear()  # the next caller probes the real machine again
    out, err = capsys.readouterr()
    assert err == (
        f"{command} --hosts: cannot make two network namespaces here: "
        "network namespaces need root (euid is not 0)\n"
    )
    assert "Traceback" not in out + err


@pytest.mark.parametrize("command", ["demo", "bench", "soak"])
def test_hosts_without_mooncake_says_why_and_exits_2(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from llm_datadist._puller import remote as _remote
    from llm_datadist._tools import netns
    from llm_datadist._tools.cli import main

    monkeypatch.setattr(netns, "netns_unavailable", lambda: None)
    monkeypatch.setattr(_remote, "engine_available", lambda: "no Mooncake here; pip install it")
    assert main([command, "--hosts"]) == 2
    out, err = capsys.readouterr()
    assert err == f"{command} --hosts: cannot move bytes between hosts: no Mooncake here; pip install it\n"
    assert "Traceback" not in out + err
