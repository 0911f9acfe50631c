"""Shared fixtures: every test runs in a private runtime directory and must leave no new /dev/shm entry
and no live child process behind (the project's no-leak contract, checked on every test)."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

# Imported here, not in the watcher: an import on its first look can take longer than a short-lived
# child lives (numpy on a busy machine), and the child would go unseen.
from llm_datadist._shm.errors import ProcessGone
from llm_datadist._shm.names import parse_segment_name, process_start_ticks

SHM_DIR = Path("/dev/shm")


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


def _helper_pids() -> set[int]:
    """multiprocessing's own long-lived helper (the spawn resource tracker) is not a test's child."""
    from multiprocessing import resource_tracker

    pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return {pid} if pid else set()


def _live_children() -> list[psutil.Process]:
    alive = []
    helpers = _helper_pids()
    for child in psutil.Process().children(recursive=True):
        if child.pid in helpers:
            continue
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except psutil.NoSuchProcess:
            continue
    return alive


@pytest.fixture(autouse=True)
def _runtime_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh runtime directory per test, inherited by the processes the test starts."""
    base = Path(tmp_path_factory.mktemp("rt", numbered=True))
    runtime = base / "run"
    monkeypatch.setenv("LLM_DATADIST_RUNTIME_DIR", str(runtime))
    return runtime


def _children_of(pid: int) -> list[int]:
    """The direct children of `pid`, from the kernel's per-thread lists (no walk of every process)."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        with contextlib.suppress(OSError, ValueError):
            found.extend(int(child) for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
    return found


class _Descendants:
    """Every process that was this test's descendant, as (pid, start ticks), seen by a thread that looks
    every few milliseconds while the test runs. A segment whose owner died counts as the test's only if its
    owner was seen here: another session running on the machine at the same time (pytest in another
    checkout, an xdist worker) leaves its own dead processes' segments for its own check."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="test-descendants", daemon=True)

    def __enter__(self) -> _Descendants:
        self.look()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.look()

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.look()

    def look(self) -> None:
        pending = _children_of(os.getpid())
        while pending:
            pid = pending.pop()
            with contextlib.suppress(ProcessGone, OSError, ValueError, IndexError):
                self.seen.add((pid, process_start_ticks(pid)))
            pending.extend(_children_of(pid))


def _ours(name: str, descendants: _Descendants) -> bool:
    """Whether a new /dev/shm entry is this test's: made by us or by a process seen as our descendant.
    A segment of any other process, alive or dead, belongs to another session running at the same time."""
    owner = parse_segment_name(name)
    if owner is None:
        # multiprocessing's semaphores (sem.mp-*) carry no owner: one may be another session's, alive,
        # and the library never makes any, so they are neither judged nor removed here.
        return not name.startswith("sem.")
    if owner.uid != os.getuid():
        return False
    return owner.pid == os.getpid() or (owner.pid, owner.start_ticks) in descendants.seen


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    before = _shm_entries()
    with _Descendants() as descendants:
        yield
    # Children get a short grace period to finish exiting; a test that relies on it is still reaped here.
    deadline = time.monotonic() + 5.0
    children = _live_children()
    while children and time.monotonic() < deadline:
        time.sleep(0.02)
        children = _live_children()
    for child in children:
        child.kill()
    leaked = sorted(name for name in _shm_entries() - before if _ours(name, descendants))
    for name in leaked:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR / name)
    problems = []
    if children:
        problems.append(f"live child processes: {[c.pid for c in children]}")
    if leaked:
        problems.append(f"new /dev/shm entries: {leaked}")
    if problems:
        pytest.fail("test leaked " + "; ".join(problems))


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A random seed, printed so a failing multi-process test can be replayed."""
    value = int(os.environ.get("LLM_DATADIST_TEST_SEED", random.randrange(2**32)))
    print(f"[{request.node.nodeid}] seed={value}")
    return value


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Each reason tests were skipped for, said once, with how many and where (one missing extra skips a
    score of tests across several files, all for the same reason)."""
    by_reason: dict[str, Counter[str]] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        by_reason.setdefault(reason, Counter())[report.nodeid.split("::")[0]] += 1
    if not by_reason:
        return
    terminalreporter.section("skipped, by reason")
    for reason, files in sorted(by_reason.items(), key=lambda item: -sum(item[1].values())):
        terminalreporter.write_line(f"{sum(files.values())} skipped: {reason}")
        terminalreporter.write_line(
            "    " + ", ".join(f"{name} ({count})" for name, count in sorted(files.items()))
        )
