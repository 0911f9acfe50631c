"""`llm-datadist exporter`: serve every live instance's figures of this user as Prometheus metrics over
HTTP (`/metrics`), read from their stats segments at every scrape (nothing is asked of the instances).

Rules: bound to a loopback address unless told otherwise (`--address`); runs until SIGINT or SIGTERM;
needs the `prometheus` extra (the official `prometheus_client`), and says so when it is missing.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import threading
from types import FrameType

from llm_datadist._prometheus import Collector
from llm_datadist._shm.stats import list_stats

from .output import say

DESCRIPTION = (
    "Serve the figures of every live llm_datadist instance of this user as Prometheus metrics at "
    "http://ADDRESS:PORT/metrics (names under llm_datadist_, labels pid, role and cluster_id; "
    "docs/metrics.md), read from the instances' stats segments at every scrape. Bound to 127.0.0.1 unless "
    "--address says otherwise. Needs the 'prometheus' extra: pip install 'llm-datadist-host[prometheus]'."
)


def _warn(line: str) -> None:
    """A segment left out of every scrape (another process wrote something unsound into it): said on
    stderr, once."""
    print(f"llm-datadist exporter: {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        print(
            "llm-datadist exporter needs prometheus_client: pip install 'llm-datadist-host[prometheus]'",
            file=sys.stderr,
        )
        return 2
    registry = CollectorRegistry()
    registry.register(Collector(functools.partial(list_stats, say=_warn)))
    try:
        server, thread = start_http_server(args.port, addr=args.address, registry=registry)
    except OSError as exc:
        print(f"llm-datadist exporter: cannot serve at {args.address}:{args.port}: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    say(f"serving Prometheus metrics at http://{args.address}:{server.server_port}/metrics")
    while not stop.wait(1.0):
        pass
    server.shutdown()
    thread.join(5.0)
    return 0


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=_port, default=9464, help="TCP port (default 9464; 0: any free one)")
    parser.add_argument(
        "--address", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
