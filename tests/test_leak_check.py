"""The no-leak check of tests/conftest.py, run on inner test sessions: a segment left by a child of the test
(alive or dead) fails the test; a segment left by a process that was never the test's descendant (another
session running on the machine at the same time) does not."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llm_datadist._shm.names import process_start_ticks

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()

# A child that creates a segment and exits without unlinking it (as a SIGKILLed owner would).
LEAKER = (
    "import os, sys\n"
    "from llm_datadist._shm.segment import Segment\n"
    "segment = Segment.create(4096)\n"
    "print(segment.name, flush=True)\n"
    "os._exit(0)\n"
)


def _run(pytester: pytest.Pytester, body: str) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner=body)
    return pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=120)


def test_a_dead_child_s_segment_fails_the_test(pytester: pytest.Pytester) -> None:
    body = (
        "import subprocess, sys\n"
        f"LEAKER = {LEAKER!r}\n"
        "def test_leaks():\n"
        "    subprocess.run([sys.executable, '-c', LEAKER], check=True, timeout=60)\n"
    )
    result = _run(pytester, body)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test leaked new /dev/shm entries*"])


def test_a_grandchild_s_segment_fails_the_test(pytester: pytest.Pytester) -> None:
    body = (
        "import subprocess, sys\n"
        f"LEAKER = {LEAKER!r}\n"
        "def test_leaks():\n"
        "    outer = (\n"
        "        'import subprocess, sys; '\n"
        "        f'subprocess.run([sys.executable, \"-c\", {LEAKER!r}], check=True)'\n"
        "    )\n"
        "    subprocess.run([sys.executable, '-c', outer], check=True, timeout=60)\n"
    )
    result = _run(pytester, body)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test leaked new /dev/shm entries*"])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the file to another uid")
def test_another_session_s_dead_process_is_not_ours(pytester: pytest.Pytester) -> None:
    """While the inner test runs, a process that is not its descendant (started here, outside it) leaves a
    segment and dies: the inner test passes, and the segment is left for whoever made it. The file is given
    to another uid, so that no reaper of this uid (a soak, another session's init) removes it meanwhile."""
    go = pytester.path / "go"
    seen = pytester.path / "seen"
    body = (
        "import time\n"
        "from pathlib import Path\n"
        "def test_waits():\n"
        f"    Path({str(go)!r}).write_text('')\n"
        "    time.sleep(1.5)\n"
    )
    # Defined before the no-leak fixture, so it ends after that fixture's check: it records what the
    # check had in front of it.
    recorder = (
        "@pytest.fixture(autouse=True)\n"
        "def _record():\n"
        "    yield\n"
        f"    open({str(seen)!r}, 'w').write(' '.join(os.listdir('/dev/shm')))\n"
    )
    marker = 'SHM_DIR = Path("/dev/shm")\n'
    assert marker in CONFTEST
    pytester.makeconftest(CONFTEST.replace(marker, marker + recorder, 1))
    pytester.makepyfile(test_inner=body)
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(pytester.path)],
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    path = None
    try:
        deadline = time.monotonic() + 60
        while not go.exists():
            assert time.monotonic() < deadline and inner.poll() is None, "the inner test did not start"
            time.sleep(0.01)
        other = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        ticks = process_start_ticks(other.pid)
        path = Path("/dev/shm") / f"llmdd.{os.getuid()}.{other.pid}.{ticks}.{secrets.token_hex(8)}"
        path.write_bytes(b"x" * 4096)
        os.chown(path, 65534, 65534)
        other.communicate(b"", timeout=60)  # the owner is dead now, and was never the inner test's
        output, _ = inner.communicate(timeout=60)
        assert inner.returncode == 0, output
        assert "1 passed" in output and "leaked" not in output, output
        assert path.name in seen.read_text().split()  # the check saw it, and judged it not the test's
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait(10)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
