"""The names a tool's run holds on this host, picked per run: listen ports (a listener's socket is named
after its ip:port in the runtime directory, shared by every run of this user) and communicator names
(host-wide for a user too). Runs of the demo, bench or soak at the same time never share one.

Rules: a port is free when no socket of it (or of the ports after it that the run also needs) is in the
runtime directory now; a listener that took it since still refuses the second run at once, with a clear
error. A communicator name carries the run's pid.
"""

from __future__ import annotations

import os

from llm_datadist._runtime import socket_path

PORT_RANGE = (20000, 59999)


def free_ports(ip: str, count: int = 1, first: int | None = None) -> int:
    """The first port p from `first` (default: one derived from the pid) such that p .. p + count - 1 have
    no socket for `ip` in the runtime directory; wraps around inside PORT_RANGE."""
    low, high = PORT_RANGE
    span = high - low + 1 - (count - 1)
    start = first if first is not None else low + os.getpid() % span
    for attempt in range(span):
        port = low + (start - low + attempt) % span
        if not any(socket_path(ip, port + i).exists() for i in range(count)):
            return port
    raise RuntimeError(f"no {count} free consecutive ports for {ip} in {low}-{high}")


def run_name(prefix: str) -> str:
    """`prefix` and this process's pid: a name no other run on this host holds while this one runs."""
    return f"{prefix}_{os.getpid()}"
