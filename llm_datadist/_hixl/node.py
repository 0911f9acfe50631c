"""What one HIXL engine stands on: a `Core` (an `LLMDataDist`'s parts in cache-manager mode with remote
access) named after the engine's address, and the notifies its peers sent it.

Rules: a serving engine is cluster `address_cluster_id` of its address, so the handshake checks a peer
reached that engine; a client-only engine gets a random id. Notifies are kept in arrival order, at most
`MAX_NOTIFIES_PER_PEER` per peer connection until `take_all`, as the real engine bounds a link.
"""

from __future__ import annotations

import hashlib
import secrets
import threading

from .._core import Core
from .._errors import StatusError
from .._runtime import socket_path
from .._settings import Settings
from .._stats import ROLE_HIXL
from .._wire.peer import PeerInfo
from ..configs import LLMRole
from ..status import LLMStatusCode
from .config import EngineAddress

MAX_NOTIFIES_PER_PEER = 4096
# The engine's own waits that take no timeout argument (a lock held by a stopped peer, finalize's drain).
ENGINE_TIMEOUT_MS = 1000


def address_cluster_id(address: EngineAddress) -> int:
    """The cluster id of the engine serving at `address`: the same on both sides of a link."""
    digest = hashlib.blake2b(f"hixl {address.host}:{address.port}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


class Notifies:
    """The notifies peers sent this engine, until the application takes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[tuple[str, str]] = []
        self._per_peer: dict[tuple[int, int, int], int] = {}

    def add(self, peer: tuple[int, int, int], name: str, message: str) -> bool:
        """Keep one; False when that peer already has `MAX_NOTIFIES_PER_PEER` waiting."""
        with self._lock:
            count = self._per_peer.get(peer, 0)
            if count >= MAX_NOTIFIES_PER_PEER:
                return False
            self._per_peer[peer] = count + 1
            self._kept.append((name, message))
            return True

    def take_all(self) -> list[tuple[str, str]]:
        with self._lock:
            kept, self._kept = self._kept, []
            self._per_peer.clear()
            return kept


class EngineCore(Core):
    """A `Core` that also keeps the notifies of its peers (the server thread hands them over)."""

    STATS_ROLE = ROLE_HIXL

    def __init__(self, settings: Settings, notifies: Notifies) -> None:
        self.notifies = notifies  # before the server starts: a peer may notify at once
        super().__init__(settings)

    def notified(self, peer: PeerInfo, name: str, message: str) -> None:
        if not self.notifies.add((peer.cluster_id, peer.incarnation, peer.pid), name, message):
            raise StatusError(
                LLMStatusCode.LLM_OUT_OF_MEMORY,
                f"{MAX_NOTIFIES_PER_PEER} notifies of this link wait for get_notifies",
            )


def start_core(address: EngineAddress, notifies: Notifies) -> EngineCore:
    """The parts of an engine at `address`, serving there when it has a port. StatusError(LLM_FAILED)
    when another process serves that address."""
    cluster_id = address_cluster_id(address) if address.serves else secrets.randbits(63) | 1 << 63
    settings = Settings(
        role=LLMRole.MIX,
        cluster_id=cluster_id,
        device_ids=(0,),
        sync_kv_timeout_ms=ENGINE_TIMEOUT_MS,
        # An IPv6 engine serves its Unix socket only (below): TCP to other hosts is IPv4 here.
        listen=(address.host, address.port) if address.serves and not address.ipv6 else None,
        pool_capacity_nbytes=None,
        enable_switch_role=False,
        cache_manager_mode=True,
        remote_cache_accessible=True,
    )
    core = EngineCore(settings, notifies)
    if address.serves and address.ipv6:
        try:
            core.server.listen(socket_path(address.host, address.port))
        except FileExistsError as exc:
            core.close()
            raise StatusError(LLMStatusCode.LLM_FAILED, f"{address.host}:{address.port} is taken") from exc
    return core
