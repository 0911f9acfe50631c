"""Shared fixtures: every test runs in a private runtime directory and must leave no new /dev/shm entry
and no live child process behind (the project's no-leak contract, checked on every test)."""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

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


def _ours(name: str, descendants: set[int]) -> bool:
    """Whether a new /dev/shm entry can be this test's: made by us, by a descendant, or by a dead process.
    A segment of a live, unrelated process belongs to another session running at the same time."""
    from llm_datadist._shm.names import owner_alive, parse_segment_name

    owner = parse_segment_name(name)
    if owner is None:
        # multiprocessing's semaphores (sem.mp-*) carry no owner: one may be another session's, alive,
        # and the library never makes any, so they are neither judged nor removed here.
        return not name.startswith("sem.")
    if owner.pid == os.getpid() or owner.pid in descendants:
        return True
    return not owner_alive(owner)


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    before = _shm_entries()
    yield
    # Children get a short grace period to finish exiting; a test that relies on it is still reaped here.
    deadline = time.monotonic() + 5.0
    children = _live_children()
    while children and time.monotonic() < deadline:
        time.sleep(0.02)
        children = _live_children()
    descendants = {child.pid for child in children}
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
