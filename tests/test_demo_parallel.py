"""Runs of the tools at the same time, by one user, in one runtime directory (parallel CI jobs, xdist
workers): each picks its own port and communicator, all pass, and none leaves a segment or a socket."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from llm_datadist._shm.names import parse_segment_name

CLI = [sys.executable, "-m", "llm_datadist._tools.cli"]
RUNS = 3


class _Seen:
    """Every pid that was a descendant of this process while it watched (the demos' spawned sides)."""

    def __init__(self) -> None:
        self.pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            try:
                self.pids.update(child.pid for child in psutil.Process().children(recursive=True))
            except psutil.Error:
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_three_small_demos_at_once_all_pass_and_leave_nothing(_runtime_dir: Path) -> None:
    before = set(os.listdir("/dev/shm"))
    seen = _Seen()
    try:
        demos = [
            subprocess.Popen(
                [*CLI, "demo", "--small"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for _ in range(RUNS)
        ]
        outputs = []
        for demo in demos:
            try:
                outputs.append(demo.communicate(timeout=600))
            finally:
                demo.kill()
    finally:
        seen.stop()
    for demo, (stdout, stderr) in zip(demos, outputs, strict=True):
        assert demo.returncode == 0, f"demo {demo.pid} exited {demo.returncode}:\n{stdout}\n{stderr}"
        assert "every byte verified" in stdout
    names = [
        next(line for line in stdout.splitlines() if line.startswith("this run's names: "))
        for stdout, _ in outputs
    ]
    assert len(set(names)) == RUNS, names
    # No segment of any of the demos' processes is left in /dev/shm (a segment's name carries its owner).
    left = []
    for name in set(os.listdir("/dev/shm")) - before:
        owner = parse_segment_name(name)
        if owner is not None and owner.uid == os.getuid() and owner.pid in seen.pids | {d.pid for d in demos}:
            left.append(name)
    assert not left, f"left in /dev/shm: {sorted(left)}"
    # ... and no socket in the runtime directory they shared.
    sockets = sorted(path.name for path in _runtime_dir.iterdir()) if _runtime_dir.exists() else []
    assert not sockets, f"left in {_runtime_dir}: {sockets}"
