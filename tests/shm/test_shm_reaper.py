"""The reaper against real processes: SIGKILLed owners' segments go, live ones' stay, PID reuse is death."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import posix_ipc
import psutil
import pytest

from llm_datadist._shm.names import (
    NAME_PREFIX,
    SegmentOwner,
    owner_alive,
    parse_segment_name,
    process_start_ticks,
)
from llm_datadist._shm.reaper import SHM_DIR, list_segments, reap
from llm_datadist._shm.segment import Segment

REPO_ROOT = Path(__file__).resolve().parents[2]

# Creates odd-sized segments, prints their names, then holds them until stdin closes (or it is killed).
CHILD = """
import sys
from llm_datadist._shm.segment import Segment
segments = [Segment.create(nbytes) for nbytes in (3333, 4097, 65536)]
print(" ".join(segment.name for segment in segments), flush=True)
sys.stdin.read()
for segment in segments:
    segment.close()
"""


class Child:
    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO_ROOT,
            env=env,
            text=True,
        )
        self.names = self._read_line(timeout_s=30.0).split()
        assert len(self.names) == 3, self.names

    def _read_line(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(timeout_s):
                raise TimeoutError("child did not report its segments")
        return self.proc.stdout.readline()

    def finish(self) -> None:
        """Let the child close its segments and exit."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.stop()
    # Anything a failed test left: these names belong to dead children now.
    for child in started:
        for name in child.names:
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(name)


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name[1:]))


def test_sigkilled_owner_is_reaped_live_owner_is_not(children: list[Child]) -> None:
    victim = Child()
    children.append(victim)
    survivor = Child()
    children.append(survivor)
    with Segment.create(3333) as mine:
        listed = {info.name: info for info in list_segments()}
        for name in [*victim.names, *survivor.names, mine.name]:
            assert listed[name].alive
        assert listed[victim.names[1]].nbytes == 4097
        assert listed[victim.names[0]].owner.pid == victim.proc.pid

        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=30)
        # SIGKILL cleans up nothing. Another test run on this host may reap concurrently, so the victim's
        # segments are dead-owned or already gone, never live; and after our reap they are gone for sure.
        listed = {info.name: info for info in list_segments()}
        assert not any(listed[name].alive for name in victim.names if name in listed)

        reaped = reap()
        assert not any(_exists(name) for name in victim.names)
        assert all(_exists(name) for name in [*survivor.names, mine.name])
        # Whatever else was reaped belonged to dead owners too (other runs' leftovers).
        for name in reaped:
            owner = parse_segment_name(name)
            assert owner is not None and not owner_alive(owner)
        assert not set(reap()) & set(victim.names)
        survivor.finish()
    assert not any(_exists(name) for name in survivor.names)


def test_zombie_owner_counts_as_dead(children: list[Child]) -> None:
    child = Child()
    children.append(child)
    owner = parse_segment_name(child.names[0])
    assert owner is not None and owner_alive(owner)
    child.proc.kill()
    process = psutil.Process(child.proc.pid)
    deadline = time.monotonic() + 10
    while process.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process.status() == psutil.STATUS_ZOMBIE  # not waited for yet
    assert not owner_alive(owner)
    child.proc.wait(timeout=30)
    reap()
    assert not any(_exists(name) for name in child.names)


def test_pid_reuse_is_a_dead_owner() -> None:
    # Our own pid with the wrong start ticks: what a new process that got a dead owner's pid looks like.
    ticks = process_start_ticks(os.getpid())
    impostor = f"/{NAME_PREFIX}.{os.getuid()}.{os.getpid()}.{ticks + 1}.0123456789abcdef"
    raw = posix_ipc.SharedMemory(impostor, posix_ipc.O_CREX, mode=0o600, size=3333)
    raw.close_fd()
    try:
        with Segment.create(100) as mine:
            reaped = reap()
            assert mine.name not in reaped
            assert not _exists(impostor) and _exists(mine.name)
    finally:
        with contextlib.suppress(posix_ipc.ExistentialError):
            raw.unlink()


def test_list_and_reap_in_a_directory(tmp_path: Path) -> None:
    # A private directory, so the exact result is checked without other runs' reapers in the way.
    uid = os.getuid()
    ticks = process_start_ticks(os.getpid())
    live = f"{NAME_PREFIX}.{uid}.{os.getpid()}.{ticks}.00000000000000aa"
    dead = f"{NAME_PREFIX}.{uid}.{os.getpid()}.{ticks + 7}.00000000000000bb"
    other_uid = f"{NAME_PREFIX}.{uid + 1}.{os.getpid()}.{ticks + 7}.00000000000000cc"
    for name, nbytes in ((live, 10), (dead, 3333), (other_uid, 1), ("psm_1234", 5), ("llmdd.junk", 5)):
        (tmp_path / name).write_bytes(b"x" * nbytes)
    infos = list_segments(shm_dir=str(tmp_path))
    assert [(info.name, info.nbytes, info.alive) for info in infos] == [
        ("/" + live, 10, True),
        ("/" + dead, 3333, False),
    ]
    assert infos[0].owner == SegmentOwner(uid, os.getpid(), ticks)
    assert [info.name for info in list_segments(uid=uid + 1, shm_dir=str(tmp_path))] == []  # file is ours
    assert reap(shm_dir=str(tmp_path)) == ["/" + dead]
    assert reap(shm_dir=str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == sorted([live, other_uid, "psm_1234", "llmdd.junk"])
