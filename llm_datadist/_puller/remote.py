"""Bytes between hosts: Mooncake Transfer Engine (the `multihost` extra), and the engine each process serves.

Rules: an engine starts in P2PHANDSHAKE mode, no metadata service (`start_engine`). Each process serves one
(`shared_engine`, started on first use: a TCP link made or served), whose address peers learn in the link
handshake; memory is registered with it only when a remote peer was granted it (our pool segments and
registered caches) and unregistered before it is unmapped or handed back to the user. The transfers this
process starts go through an engine per peer incarnation instead (`peer_engine.PeerEngine`).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from typing import Any

from .._errors import StatusError
from .._signals import held
from ..status import LLMStatusCode
from ..utils.log import log

ENV_PROTOCOL = "LLM_DATADIST_MOONCAKE_PROTOCOL"
ENV_DEVICES = "LLM_DATADIST_MOONCAKE_DEVICES"
EXTRA_HINT = "pip install 'llm-datadist-host[multihost]' (Mooncake also needs Debian's libibverbs1)"
# Mooncake refuses a batch of a few thousand descriptors, and a refused batch can leave the engine failing
# every later transfer to that peer: stay well below.
MAX_DESCRIPTORS = 1024
# How long the engine waits for progress on a TCP transfer before it fails it (Mooncake's default is 30 s);
# bounds how long a worker can outlive a call that timed out.
DEFAULT_PROGRESS_TIMEOUT_S = 5
# Set unless the user set them: Mooncake logs errors only (it still prints one harmless "Local segment
# descriptor not found" when it starts), and a stalled TCP transfer fails after this long.
_ENGINE_ENV_DEFAULTS = {
    "MC_LOG_LEVEL": "ERROR",
    "MC_TCP_PROGRESS_TIMEOUT_SEC": str(DEFAULT_PROGRESS_TIMEOUT_S),
}
# Mooncake's handshake listener waits in accept() up to 1 s at a time, and destroying an engine joins it
# with the GIL held: the whole process would stand still for up to that second. We shorten that wait on
# the listening socket to this (`_quick_accept`), once the accept in progress when we did has ended.
ACCEPT_WAIT_S = 0.05
MOONCAKE_ACCEPT_WAIT_S = 1.0


class MissingExtra(StatusError):
    """Mooncake Transfer Engine cannot be imported here."""


def _import_engine() -> Any:
    for name, value in _ENGINE_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)  # read when the library loads
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as exc:  # OSError: a shared library (libibverbs) is missing
        raise MissingExtra(
            LLMStatusCode.LLM_LINK_FAILED,
            f"a link to another host moves bytes with Mooncake Transfer Engine, which cannot be imported "
            f"({type(exc).__name__}: {exc}); {EXTRA_HINT}",
        ) from exc
    return TransferEngine


def engine_available() -> str | None:
    """None when an engine can be started here, else why not (naming the extra)."""
    try:
        _import_engine()
    except MissingExtra as exc:
        return exc.detail
    return None


_shared: RemoteEngine | None = None
_shared_lock = threading.Lock()


def _forget_in_child() -> None:
    """The parent's engine did not come along into a forked child (its threads stay with the parent)."""
    global _shared, _shared_lock
    _shared = None
    _shared_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def shared_engine(local_ip: str) -> RemoteEngine:
    """This process's engine, started on `local_ip` at the first call. One per process, for its whole life:
    a later instance (after `finalize` and `init`) uses the same one, as peers and the memory registered
    with it may outlive an instance."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = RemoteEngine(local_ip)
        elif _shared.local_ip != local_ip:
            log.info(
                "transfer engine: using %s for %s too (one engine per process)", _shared.address, local_ip
            )
        return _shared


def start_engine(local_ip: str, *, quick_end: bool = False) -> tuple[Any, str, str, float]:
    """A Mooncake engine started on `local_ip`: (the engine, its address "ip:port" that peers name it by,
    its protocol, the monotonic time from which ending it is quick: with `quick_end`, about a second from
    now, else never). StatusError when it cannot start."""
    engine_class = _import_engine()
    # TCP unless the user asks for RDMA (and names the NICs Mooncake may use, e.g. "mlx5_0,mlx5_1").
    protocol = os.environ.get(ENV_PROTOCOL, "tcp") or "tcp"
    devices = os.environ.get(ENV_DEVICES, "")
    if protocol not in ("tcp", "rdma"):
        raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"{ENV_PROTOCOL}={protocol!r}: tcp or rdma")
    # Its threads, made in here, leave SIGTERM and SIGINT to the program's main thread (`_signals`).
    with held():
        engine = engine_class()
        code = engine.initialize(local_ip, "P2PHANDSHAKE", protocol, devices)
    if code != 0:
        raise StatusError(
            LLMStatusCode.LLM_LINK_FAILED, f"the transfer engine did not start on {local_ip} (code {code})"
        )
    port = engine.get_rpc_port()
    quick = quick_end and _quick_accept(port)
    quick_from = time.monotonic() + MOONCAKE_ACCEPT_WAIT_S if quick else float("inf")
    return engine, f"{local_ip}:{port}", protocol, quick_from


def _quick_accept(port: int) -> bool:
    """Shorten the accept() wait of Mooncake's handshake listener at `port` (this process's listening TCP
    socket bound there) to `ACCEPT_WAIT_S`; False when it was not found (ending the engine is then slow).
    Mooncake sets the wait as SO_RCVTIMEO on that socket and offers no call for it; we set it on a
    duplicate of the descriptor, which is the same socket."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            dup = os.dup(int(name))
        except (OSError, ValueError):  # closed meanwhile
            continue
        sock = socket.socket(fileno=dup)
        try:
            if sock.gettimeout() is not None:  # a default timeout made the shared socket non-blocking
                sock.setblocking(True)
            if (
                sock.type == socket.SOCK_STREAM
                and sock.family in (socket.AF_INET, socket.AF_INET6)
                and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                and sock.getsockname()[1] == port
            ):
                wait = struct.pack("ll", 0, int(ACCEPT_WAIT_S * 1_000_000))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, wait)
                return True
        except OSError:
            continue
        finally:
            sock.close()  # the duplicate only
    log.info("transfer engine at port %d: its handshake listener was not found; ending it is slower", port)
    return False


class RemoteEngine:
    """The engine this process serves: its address ("ip:port", the Mooncake session id peers use) and the
    memory registered with it, which peers on other hosts read and write. Thread-safe."""

    def __init__(self, local_ip: str) -> None:
        self._engine, self.address, self.protocol, _ = start_engine(local_ip)
        self.local_ip = local_ip
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}  # address -> nbytes
        log.info("transfer engine at %s (%s)", self.address, self.protocol)

    def register(self, addr: int, nbytes: int) -> None:
        """Make [addr, addr + nbytes) transferable (once; the same range again is a no-op)."""
        with self._lock:
            register(self._engine, self._registered, addr, nbytes)

    def unregister(self, addr: int) -> None:
        """Withdraw what `register` made transferable at `addr` (before it is unmapped or handed back)."""
        with self._lock:
            unregister(self._engine, self._registered, addr)

    def registered(self, addr: int) -> bool:
        with self._lock:
            return addr in self._registered


def register(engine: Any, registered: dict[int, int], addr: int, nbytes: int) -> None:
    """Register [addr, addr + nbytes) with `engine` unless `registered` (address -> nbytes) has it."""
    known = registered.get(addr)
    if known is not None and known >= nbytes:
        return
    if known is not None:
        engine.unregister_memory(addr)
        del registered[addr]
    code = engine.register_memory(addr, nbytes)
    if code != 0:
        raise StatusError(
            LLMStatusCode.LLM_FAILED, f"the transfer engine refused {nbytes} bytes at {addr:#x}"
        )
    registered[addr] = nbytes


def unregister(engine: Any, registered: dict[int, int], addr: int) -> None:
    if registered.pop(addr, None) is not None:
        code = engine.unregister_memory(addr)
        if code != 0:
            log.warning("the transfer engine did not unregister %#x (code %d)", addr, code)
