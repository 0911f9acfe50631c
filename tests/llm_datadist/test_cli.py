"""The `llm-datadist` command as a user runs it: the demo end to end, `ls` and `gc`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from llm_datadist._shm.segment import Segment

CLI = [sys.executable, "-m", "llm_datadist._cli"]


def test_small_demo_verifies_every_byte_and_leaves_nothing() -> None:
    before = set(os.listdir("/dev/shm"))
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
    assert set(os.listdir("/dev/shm")) <= before


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
