"""`llm-datadist exporter`: serve every live instance's figures of this user as Prometheus metrics over
HTTP (`/metrics`), read from their stats segments at every scrape (nothing is asked of the instances).

Rules: the segments are this user's alone (0600), and so are the figures: with `--token-file` (a file of
mode 0600 holding a token) every request must carry `Authorization: Bearer <token>` (401 otherwise); with
`--unix-socket` it serves on a socket of mode 0600 instead of TCP. Without either it serves TCP on a
loopback address unless told otherwise (`--address`), which every user of the machine can reach, and says
so. Runs until SIGINT or SIGTERM; needs the `prometheus` extra (the official `prometheus_client`), and says
so when it is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hmac
import os
import signal
import socket
import socketserver
import stat
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import FrameType
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from llm_datadist._prometheus import Collector
from llm_datadist._shm.stats import list_stats

from .output import say

DESCRIPTION = (
    "Serve the figures of every live llm_datadist instance of this user as Prometheus metrics at "
    "http://ADDRESS:PORT/metrics (names under llm_datadist_, labels pid, role and cluster_id; "
    "docs/metrics.md), read from the instances' stats segments at every scrape. Keep them private with "
    "--token-file (requests need the token as a bearer token) or --unix-socket (a socket of mode 0600); "
    "otherwise bound to 127.0.0.1, which every local user can reach, unless --address says otherwise. "
    "Needs the 'prometheus' extra: pip install 'llm-datadist-host[prometheus]'."
)


def _warn(line: str) -> None:
    """A segment left out of every scrape (another process wrote something unsound into it): said on
    stderr, once."""
    print(f"llm-datadist exporter: {line}", file=sys.stderr, flush=True)


def read_token(path: Path) -> str:
    """The token in `path`, which must be a regular file of ours that no one else may read (ValueError)."""
    info = path.stat()
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ValueError(f"{path} must be a file of this user with mode 0600 (chmod 600 {path})")
    token = path.read_text().strip()
    if len(token) < 16:
        raise ValueError(f"{path} holds a token of {len(token)} characters; use at least 16")
    return token


_App = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def _guarded(app: _App, token: str | None) -> _App:
    """`app` behind a bearer token (None: open)."""
    if token is None:
        return app
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "").encode()
        if not hmac.compare_digest(given, expected):
            start_response(
                "401 Unauthorized", [("WWW-Authenticate", "Bearer"), ("Content-Type", "text/plain")]
            )
            return [b"a bearer token is required (Authorization: Bearer <token>)\n"]
        return app(environ, start_response)

    return guarded


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _UnixWSGIServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer, WSGIServer):
    """WSGI over a Unix socket (wsgiref serves TCP only)."""

    daemon_threads = True

    def server_bind(self) -> None:
        socketserver.UnixStreamServer.server_bind(self)
        self.server_name, self.server_port = "localhost", 0
        self.setup_environ()

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, _ = self.socket.accept()
        return conn, ("unix", 0)  # what HTTP handlers expect of a peer address


class _TCPWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _TCP6WSGIServer(_TCPWSGIServer):
    address_family = socket.AF_INET6


def _unix_server(path: Path, app: _App) -> WSGIServer:
    """A server at `path`, a socket of mode 0600 (made so before anyone can connect)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(path.lstat().st_mode):
            probe = socket.socket(socket.AF_UNIX)
            try:
                probe.connect(os.fspath(path))
            except ConnectionRefusedError:
                path.unlink()  # a dead exporter's
            else:
                raise OSError(f"another process serves at {path}")
            finally:
                probe.close()
    old = os.umask(0o177)
    try:
        server = _UnixWSGIServer(os.fspath(path), _QuietHandler)
    finally:
        os.umask(old)
    server.set_app(app)
    return server


def run(args: argparse.Namespace) -> int:
    try:
        from prometheus_client import CollectorRegistry, make_wsgi_app
    except ImportError:
        print(
            "llm-datadist exporter needs prometheus_client: pip install 'llm-datadist-host[prometheus]'",
            file=sys.stderr,
        )
        return 2
    token = None
    if args.token_file is not None:
        try:
            token = read_token(Path(args.token_file))
        except (OSError, ValueError) as exc:
            print(f"llm-datadist exporter: --token-file: {exc}", file=sys.stderr)
            return 2
    registry = CollectorRegistry()
    registry.register(Collector(functools.partial(list_stats, say=_warn)))
    app = _guarded(make_wsgi_app(registry), token)
    server: WSGIServer
    try:
        if args.unix_socket is not None:
            path = Path(args.unix_socket)
            server = _unix_server(path, app)
            where = f"unix:{path} (mode 0600: this user only)"
        else:
            tcp = _TCP6WSGIServer if ":" in args.address else _TCPWSGIServer
            server = make_server(args.address, args.port, app, tcp, _QuietHandler)
            where = f"http://{args.address}:{server.server_port}/metrics"
    except OSError as exc:
        target = args.unix_socket or f"{args.address}:{args.port}"
        print(f"llm-datadist exporter: cannot serve at {target}: {exc}", file=sys.stderr)
        return 1
    thread = threading.Thread(target=server.serve_forever, name="exporter", daemon=True)
    thread.start()
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    say(f"serving Prometheus metrics at {where}")
    if token is None and args.unix_socket is None:
        print(
            "llm-datadist exporter: no --token-file: every user of this machine can read these figures at "
            f"{args.address}:{server.server_port}",
            file=sys.stderr,
            flush=True,
        )
    while not stop.wait(1.0):
        pass
    server.shutdown()
    server.server_close()
    thread.join(5.0)
    if args.unix_socket is not None:
        with contextlib.suppress(FileNotFoundError):
            Path(args.unix_socket).unlink()
    return 0


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=_port, default=9464, help="TCP port (default 9464; 0: any free one)")
    parser.add_argument(
        "--address",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only, but every user of it)",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="a file of mode 0600 holding a token (16 characters or more): every request must carry "
        "'Authorization: Bearer <token>' (Prometheus: authorization: {credentials_file: FILE})",
    )
    parser.add_argument(
        "--unix-socket",
        metavar="PATH",
        help="serve on a Unix socket of mode 0600 at PATH instead of TCP (curl --unix-socket PATH "
        "http://localhost/metrics)",
    )
