"""This process's side of links across hosts: the shared secret, the transfer engine it serves and the
memory it exposes to it, the engines its own transfers go through, and where peers on other hosts keep
their segments.

Rules: the served engine starts on first use (a TCP link made or served, `remote.shared_engine`). Memory
is exposed to it only when a peer on another host was granted it (our pool segments, registered caches),
and withdrawn before it is unmapped or handed back to the user (`segment_released`,
`registered_released`); `close` withdraws the rest. Our transfers go through an engine per peer
incarnation (`peer_engine.PeerEngine`, over RDMA with our side of the transfer registered with it), which
ends when no live link uses it any more: so do its connections to that peer. A transfer that fails or
times out breaks its link: whatever the engine still does, our memory stays pinned (`pins.hold`) until it
ended, and only transfers into that memory wait for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from llm_datadist import _library as library
from llm_datadist._protocol.messages import MAX_ADDRESS_NAMES, Addresses, AddressRequest
from llm_datadist._shm.segment import Segment

from .._errors import PeerGone, StatusError
from .._owner.pins import LocalPins
from .._owner.records import CacheRecord
from .._owner.table import CacheTable
from .._wire import auth
from .._wire.client import ClientLink
from ..status import LLMStatusCode
from ..utils.log import log
from .peer_engine import ORPHANS, PeerEngine, progress_timeout_s
from .remote import MissingExtra, RemoteEngine, engine_available, shared_engine

if TYPE_CHECKING:
    from .peer import Peer


class CrossHost:
    """The secret, the engine and the exposed memory of one initialised instance."""

    def __init__(self, table: CacheTable, pins: LocalPins, timeout_code: LLMStatusCode) -> None:
        self._table = table
        self._pins = pins
        self._timeout_code = timeout_code
        self.secret: bytes | None = None
        self.secret_problem = (
            f"no shared secret: set {auth.ENV_SECRET} (or {auth.ENV_SECRET_FILE}, a file of mode 0600) "
            "to the same value on both hosts"
        )
        self.secret_unusable = False  # one is configured, but cannot be used (said at every use)
        try:
            self.secret = auth.load_secret()
        except auth.SecretError as exc:
            self.secret_problem = str(exc)
            self.secret_unusable = True
        self._engine: RemoteEngine | None = None
        self._exposed: dict[int, int] = {}  # address -> nbytes registered with the engine
        # The engines our transfers go through, by (our ip, the peer engine's address): one per peer
        # incarnation, retired when no live link uses it (`_idle`).
        self._peer_engines: dict[tuple[str, str], PeerEngine] = {}
        self._closed = False
        self._lock = threading.Lock()
        self._starting = threading.Lock()  # held while a peer engine starts (`peer_engine`)
        self._tcp_callbacks: dict[str, int] = {}  # our ip -> the port we serve TCP callbacks on
        # Serves TCP at (ip, port 0: any) and returns the port: the server's, once it runs.
        self.listen_tcp: Callable[[str, int], int] | None = None

    def require(self, why: str) -> bytes:
        """The shared secret, when this process can reach other hosts; else StatusError(LLM_LINK_FAILED):
        MissingExtra, naming the extra, without the transfer engine; `why` + what is wrong without a usable
        secret."""
        problem = engine_available()
        if problem is not None:
            raise MissingExtra(LLMStatusCode.LLM_LINK_FAILED, problem)
        if self.secret is None:
            raise StatusError(LLMStatusCode.LLM_LINK_FAILED, why + self.secret_problem)
        return self.secret

    def engine(self, local_ip: str) -> RemoteEngine:
        """This process's transfer engine (started on `local_ip` on first use)."""
        with self._lock:
            if self._engine is None:
                self._engine = shared_engine(local_ip)
            return self._engine

    def tcp_callback_port(self, local_ip: str) -> int:
        """The port where we serve TCP on `local_ip` for peers on other hosts we linked to (their way back
        to push into our memory); started on first use."""
        assert self.listen_tcp is not None, "the server serves before any link is made"
        with self._lock:
            port = self._tcp_callbacks.get(local_ip)
            if port is None:
                port = self.listen_tcp(local_ip, 0)
                self._tcp_callbacks[local_ip] = port
            return port

    # ----------------------------------------------------------------- serving (server thread)

    def serve_remote(self, local_ip: str) -> str:
        """A peer on another host linked to us at `local_ip`: our engine's address."""
        problem = engine_available()
        if problem is not None:
            raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"the serving side cannot: {problem}")
        return self.engine(local_ip).address

    def segment_addresses(self, names: tuple[str, ...]) -> tuple[int, ...]:
        """Where our segments `names` are, registered with our engine for a remote peer."""
        engine = self._engine
        if engine is None:
            raise StatusError(LLMStatusCode.LLM_FAILED, "no transfer engine runs here")
        addrs = []
        for name in names:
            found = self._segment_address(name)
            if found is None:
                raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"no segment {name} here")
            self._expose(engine, *found)
            addrs.append(found[0])
        return tuple(addrs)

    def _segment_address(self, name: str) -> tuple[int, int] | None:
        """(address, nbytes) of our live pool segment `name`, or of a segment of the library's memory
        (`ext.shared_arrays`), with or without its leading slash."""
        found = library.segment_address(name)
        if found is not None:
            return found
        name = name.lstrip("/")
        with self._table.lock:
            for pool in self._table.pools():
                for segment in pool.segments:
                    if segment.name.lstrip("/") == name and not segment.closed:
                        return segment.address, segment.nbytes
        return None

    def expose_ranges(self, addrs: tuple[int, ...], nbytes: int) -> None:
        """Registered memory a remote peer was granted, made transferable."""
        engine = self._engine
        if engine is None:
            raise StatusError(LLMStatusCode.LLM_FAILED, "no transfer engine runs here")
        for addr in addrs:
            self._expose(engine, addr, nbytes)

    def _expose(self, engine: RemoteEngine, addr: int, nbytes: int) -> None:
        with self._lock:
            if self._exposed.get(addr, 0) >= nbytes:
                return
            engine.register(addr, nbytes)
            self._exposed[addr] = nbytes

    def _withdraw(self, addr: int) -> None:
        with self._lock:
            exposed = self._exposed.pop(addr, None)
            engine = self._engine
        if exposed is not None and engine is not None:
            engine.unregister(addr)

    def segment_released(self, segment: Segment) -> None:
        """A pool segment is about to be unmapped: no engine may reach it afterwards."""
        if self._exposed:
            self._withdraw(segment.address)
        self._withdraw_local([segment.address])

    def registered_released(self, record: CacheRecord) -> None:
        """A registered cache is forgotten: its memory goes back to the user, out of every engine's reach."""
        if self._exposed:
            for addr in record.addrs:
                self._withdraw(addr)
        self._withdraw_local(record.addrs)

    def _withdraw_local(self, addrs: list[int] | tuple[int, ...]) -> None:
        """Over RDMA our side of a transfer is registered with the peer engines too."""
        if not self._peer_engines:
            return
        with self._lock:
            engines = [engine for engine in self._peer_engines.values() if engine.protocol != "tcp"]
        for engine in engines:
            for addr in addrs:
                engine.unregister(addr)

    # ----------------------------------------------------------------- transfers

    def segment_bases(self, peer: Peer, names: list[str], deadline: float) -> list[int]:
        """Where the remote peer has its segments `names` (asked once per segment and link)."""
        missing = list(dict.fromkeys(name for name in names if name not in peer.segment_addrs))
        for start in range(0, len(missing), MAX_ADDRESS_NAMES):
            chunk = tuple(missing[start : start + MAX_ADDRESS_NAMES])
            seq = peer.next_seq()
            reply = peer.request(AddressRequest(seq, chunk), seq, deadline)
            if not isinstance(reply, Addresses) or len(reply.addrs) != len(chunk):
                raise PeerGone(f"expected {len(chunk)} Addresses, got {type(reply).__name__}")
            if len(peer.segment_addrs) > 4096:
                peer.segment_addrs.clear()  # a long-lived peer's pools come and go: forget old names
            peer.segment_addrs.update(zip(chunk, reply.addrs, strict=True))
        return [peer.segment_addrs[name] for name in names]

    def copy(
        self,
        peer: Peer,
        local: CacheRecord,
        local_addrs: list[int],
        remote_addrs: list[int],
        lengths: list[int],
        *,
        write: bool,
        deadline: float,
    ) -> None:
        """Move runs between `local` and the remote peer's memory through the transfer engines. A failure
        or a timeout breaks the link (whatever the engine still does, the local memory stays pinned)."""
        # Waiting for a transfer that outlived its call, into the same memory, is not this link's failure.
        ORPHANS.wait_clear(local_addrs, lengths, deadline, self._timeout_code)
        link = peer.link
        engine = self.peer_engine(link)
        if engine.protocol != "tcp":
            # RDMA reads and writes only registered local memory; over TCP the engine copies to and from
            # the local side itself, and registering it would only open it to the engine's port.
            if local.block is not None:
                segment = local.block.segment
                engine.register(segment.address, segment.nbytes)
            else:
                for addr in local.addrs:
                    engine.register(addr, local.tensor_nbytes)
        try:
            engine.transfer(
                local_addrs,
                remote_addrs,
                lengths,
                write=write,
                deadline=deadline,
                timeout_code=self._timeout_code,
                check_peer=link.check_peer_alive,
                hold=lambda: self._pins.hold(local),
            )
        except PeerGone:
            raise
        except StatusError as exc:
            link.fail(exc.detail)
            raise

    def peer_engine(self, link: ClientLink) -> PeerEngine:
        """The engine our transfers with `link`'s peer go through (started on first use), `link` noted as
        one that uses it. An engine starts outside the table's lock (Mooncake takes milliseconds, the
        first time in a process a second): transfers to other peers go on meanwhile."""
        key = (link.local_ip, link.peer.engine)
        engine = self._serving_engine(key, link)
        if engine is not None:
            return engine
        with self._starting:  # one start at a time, and a second caller for the same peer waits for it
            engine = self._serving_engine(key, link)
            if engine is not None:
                return engine
            started = PeerEngine(link.local_ip, link.peer.engine, self._idle, link)
            with self._lock:
                if self._closed:
                    started.retire()
                    self._check_open()
                self._peer_engines[key] = started
                return started

    def _serving_engine(self, key: tuple[str, str], link: ClientLink) -> PeerEngine | None:
        """The engine at `key` that still takes transfers, `link` noted as one that uses it; None when
        there is none."""
        with self._lock:
            self._check_open()
            engine = self._peer_engines.get(key)
            if engine is None or engine.retired:
                return None
            engine.links.add(link)
            return engine

    def _check_open(self) -> None:
        if self._closed:
            raise StatusError(LLMStatusCode.LLM_LINK_FAILED, "this instance is finalizing")

    def _idle(self, engine: PeerEngine) -> None:
        """`engine`'s worker is idle: retire it when no live link uses it (its peer is gone, or we are not
        linked to it any more), so that its connections close."""
        with self._lock:
            if any(link.broken is None for link in engine.links):
                return
            key = (engine.local_ip, engine.peer)
            if self._peer_engines.get(key) is engine:
                del self._peer_engines[key]
            engine.retire()

    def peer_engines(self) -> tuple[int, int]:
        """(engines our transfers go through now, one per peer incarnation still linked; transfers queued
        or running in them)."""
        with self._lock:
            engines = list(self._peer_engines.values())
        return len(engines), sum(engine.pending for engine in engines)

    # ----------------------------------------------------------------- teardown

    def drain(self) -> None:
        """End the engines of our transfers, once the transfers that outlived their calls ended (they may
        still write into our pool); bounded by the engines' progress timeout."""
        with self._lock:
            self._closed = True
            engines, self._peer_engines = list(self._peer_engines.values()), {}
        for engine in engines:
            engine.retire()
        deadline = time.monotonic() + progress_timeout_s() + 2.0
        for engine in engines:
            if not engine.join(max(deadline - time.monotonic(), 0.0)):
                log.warning("the transfer engine for %s did not end in time", engine.peer)

    def close(self) -> None:
        """Registered memory goes back to the user out of the engine's reach."""
        with self._lock:
            exposed, self._exposed = self._exposed, {}
        if self._engine is not None:
            for addr in exposed:
                self._engine.unregister(addr)
