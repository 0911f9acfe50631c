"""Who is at the other end of a connection (`PeerInfo`), and what the server hands its requests to
(`Service`): the two values the wire shares with the rest of the library.

Rules: nothing here knows what a cache is. A `Service` is the owner's side seen from the wire: the server
calls it from its one thread, with the connection as an opaque token, and never asks what it holds.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from llm_datadist._protocol.messages import Message

from .._errors import StatusError
from ..status import LLMStatusCode

__all__ = [
    "RECV_NBYTES",
    "ClosedService",
    "ListenAddr",
    "PeerInfo",
    "Service",
    "peer_credentials",
    "tune_tcp",
]

# Where a server listens: a Unix socket's path, or a TCP (ip, port).
ListenAddr = Path | tuple[str, int]

_PEERCRED = struct.Struct("3i")
# How much one recv takes off a socket, on either end of a link.
RECV_NBYTES = 256 * 1024
# TCP keepalive (idle s, interval s, probes): a vanished peer host is given up within `KEEPALIVE_S`.
_KEEPALIVE = (5, 2, 3)
KEEPALIVE_S = _KEEPALIVE[0] + _KEEPALIVE[1] * _KEEPALIVE[2]


@dataclass(frozen=True)
class PeerInfo:
    """Who is at the other end of a link: its cluster id, role, pid, incarnation (drawn once per
    initialised instance, so a restart at the same address is a new peer) and callback socket ("" if none)."""

    cluster_id: int
    role: int
    pid: int
    incarnation: int
    callback: str = ""
    # Over TCP: the peer's ip (its pid is then only what it claims, on another host), the port of its
    # TCP callback listener (0: none) and its transfer engine's address. "" / 0 on a Unix socket.
    host: str = ""
    callback_port: int = 0
    engine: str = ""

    @property
    def remote(self) -> bool:
        """On another host (linked over TCP): no shared memory, no pid to look at, bytes go by engine."""
        return bool(self.host)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def tune_tcp(sock: socket.socket) -> None:
    """No Nagle delay on requests; and keepalives, so that a peer host that vanished (powered off, cut
    off: no FIN ever comes) ends the connection within `KEEPALIVE_S`, and with it the leases it held."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle_s, interval_s, probes = _KEEPALIVE
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)
    # Unacknowledged data counts too: a peer that stopped acknowledging mid-reply is given up as well.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, KEEPALIVE_S * 1000)


class Service(Protocol):
    """What the server hands a linked peer's requests to (the owner's `_owner.service.CacheService`).
    `conn` is the server's token for one connection: the same object for all of its calls."""

    def admit(self, conn: object, peer: PeerInfo) -> tuple[str, int, int]:
        """A peer on this host linked: (index name, row, ticket) for its Welcome ("" : no index row)."""
        ...

    def serve_remote(self, local_ip: str) -> str:
        """A peer on another host proved itself at `local_ip`: our engine's address (StatusError: refused)."""
        ...

    def answer(self, conn: object, peer: PeerInfo, msg: Message) -> Message:
        """The reply to a request; StatusError becomes an Error reply, IndexBusy parks the request."""
        ...

    def release(self, conn: object, lease_id: int, ok: bool) -> None:
        """A one-way Release (IndexBusy: retried; StatusError: logged)."""
        ...

    def holds_leases(self, conn: object) -> bool: ...

    def connection_ended(self, conn: object, released: frozenset[int]) -> None:
        """The connection is gone; `released`: the leases its peer released well in messages never read."""
        ...

    def peer_linked(self, peer: PeerInfo) -> None: ...

    def peer_gone(self, peer: PeerInfo) -> None: ...

    def housekeeping(self) -> None:
        """About twice a second, on the server thread."""
        ...


class ClosedService:
    """What a closed server refers to: nothing (the service refers back to its owner)."""

    def admit(self, conn: object, peer: PeerInfo) -> tuple[str, int, int]:
        return "", 0, 0

    def serve_remote(self, local_ip: str) -> str:
        raise StatusError(LLMStatusCode.LLM_LINK_FAILED, "this side is closed")

    def answer(self, conn: object, peer: PeerInfo, msg: Message) -> Message:
        raise StatusError(LLMStatusCode.LLM_LINK_FAILED, "this side is closed")

    def release(self, conn: object, lease_id: int, ok: bool) -> None:
        return None

    def holds_leases(self, conn: object) -> bool:
        return False

    def connection_ended(self, conn: object, released: frozenset[int]) -> None:
        return None

    def peer_linked(self, peer: PeerInfo) -> None:
        return None

    def peer_gone(self, peer: PeerInfo) -> None:
        return None

    def housekeeping(self) -> None:
        return None
