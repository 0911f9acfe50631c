"""Who can read the exporter's figures. The segments behind it are this user's alone (0600); so can the
figures be: `--token-file` (a file of mode 0600) makes every request carry the token as a bearer token
(401 otherwise), `--unix-socket` serves on a socket of mode 0600. Plain TCP on loopback, which every local
user reaches, says so when it starts. Real exporter processes, real requests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from llm_datadist._shm.stats import StatsSegment

pytest.importorskip("prometheus_client")
TOKEN = "0123456789abcdef-token"


@contextlib.contextmanager
def _exporter(*args: str) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "llm_datadist._tools.cli", "exporter", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate(timeout=30)


@contextlib.contextmanager
def _instance() -> Iterator[StatsSegment]:
    stats = StatsSegment.create(("pulls",), role=1, cluster_id=4, rows=1)
    try:
        yield stats
    finally:
        stats.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, headers=headers or {}), timeout=5
            ) as response:
                return int(response.status), response.read().decode()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read().decode()
        except OSError:
            assert time.monotonic() < deadline, f"nothing answered at {url}"
            time.sleep(0.1)


def _token_file(tmp_path: Path, mode: int = 0o600) -> Path:
    path = tmp_path / "exporter.token"
    path.write_text(TOKEN + "\n")
    path.chmod(mode)
    return path


def test_with_a_token_file_only_requests_that_carry_the_token_are_served(tmp_path: Path) -> None:
    port = _free_port()
    with _instance(), _exporter("--port", str(port), "--token-file", str(_token_file(tmp_path))):
        url = f"http://127.0.0.1:{port}/metrics"
        status, _ = _get(url)
        assert status == 401
        status, _ = _get(url, {"Authorization": "Bearer not-the-token-at-all"})
        assert status == 401
        status, text = _get(url, {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and f'pid="{os.getpid()}"' in text


def test_a_token_file_others_may_read_is_refused(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "llm_datadist._tools.cli",
            "exporter",
            "--port",
            "0",
            "--token-file",
            str(_token_file(tmp_path, 0o644)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and "mode 0600" in result.stderr


def test_a_unix_socket_of_mode_0600_serves_the_figures(tmp_path: Path) -> None:
    path = tmp_path / "metrics.sock"
    with _instance(), _exporter("--unix-socket", str(path)):
        deadline = time.monotonic() + 30
        while not path.exists():
            assert time.monotonic() < deadline, "the socket never appeared"
            time.sleep(0.05)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(10)
            client.connect(str(path))
            client.sendall(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
            reply = b""
            while chunk := client.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.0 200") and f'pid="{os.getpid()}"'.encode() in reply
    assert not path.exists()  # removed when the exporter ends


def test_plain_tcp_says_every_local_user_can_read_it() -> None:
    port = _free_port()
    with _instance(), _exporter("--port", str(port)) as process:
        status, _ = _get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert "every user of this machine can read" in err
