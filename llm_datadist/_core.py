"""One initialised `LLMDataDist`: its options, pool and cache table, its server and its links.

Rules: `Core` owns every resource of an initialised instance and releases all of them in `close` (links
said goodbye to, server stopped and its socket unlinked, segments unlinked). The public classes validate
arguments and translate errors; `Core` does the work. A pull holds its link exclusively, pins its local
destination, pins the source in the owner's published index (`_dataplane`; or, for what the owner could
not publish there, asks it for a lease), and copies straight from the peer's mapped segment into it: one
copy, no staging, no message. Everything learnt from a peer (its index, its one-sided table, its mapped
segments, checked segment names) belongs to the link, so to that peer's incarnation: a peer restarted at
the same address is a new link with nothing reused. Writes into a peer's memory always pin it there first,
so the owner cannot free or reuse that memory under the write.
"""

from __future__ import annotations

import contextlib
import errno
import os
import platform
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar, cast

import numpy as np
import psutil

from llm_datadist._protocol.messages import (
    MAX_ADDRESS_NAMES,
    Addresses,
    AddressRequest,
    BlocksGrant,
    BlocksRequest,
    Location,
    Message,
    Ping,
    Pong,
    PullGrant,
    PullRequest,
    Release,
    ResolveRequest,
    Table,
    TableRequest,
    WriteGrant,
    WriteRequest,
)
from llm_datadist._shm.copyplan import BlockPlan, Run, StridedCopy, block_runs, plan_tensor_copy
from llm_datadist._shm.errors import ShmError
from llm_datadist._shm.generations import read_generation
from llm_datadist._shm.index import CACHE_REMOTE, CACHE_WITHDRAWN, FLAG_CACHES_UNPUBLISHED, STATE_OPEN, Index
from llm_datadist._shm.names import parse_segment_name
from llm_datadist._shm.pool import Pool
from llm_datadist._shm.reaper import reap
from llm_datadist._shm.segment import Segment

from . import _auth, _faults
from ._comm import Comms
from ._copy import Copier, address_view, vm_columns
from ._dataplane import Pin, PinRequest, peer_index, raise_index_error, settle_owed, unpin
from ._dataplane import pin as dataplane_pin
from ._errors import PeerGone, StatusError
from ._keys import KEY_BLOCKS, KEY_CACHE_ID
from ._owner.leases import Leases
from ._owner.mirror import SERVER_LOCK_TIMEOUT_S
from ._owner.records import CacheRecord
from ._owner.service import CacheService, NodeHooks
from ._owner.table import CacheTable
from ._remote import MissingExtra, RemoteEngine, engine_available, shared_engine
from ._runtime import (
    ensure_runtime_dir,
    is_local_ip,
    remove_stale_sockets,
    socket_path,
    socket_path_in_runtime,
)
from ._settings import Settings
from ._transport import ClientLink, PeerInfo, Server
from ._vm import (
    FEW_RUNS,
    PreparedRuns,
    VmBadAddress,
    VmError,
    VmNotPermitted,
    VmProcessGone,
    VmRun,
)
from .configs import LLMRole
from .status import LLMStatusCode
from .utils.log import log

PLACEMENT_HOST = 0  # Placement.HOST
PLACEMENT_DEVICE = 1  # Placement.DEVICE

GrantT = TypeVar("GrantT", PullGrant, BlocksGrant, WriteGrant, Location)

# Per process: links we made (one per remote cluster).
MAX_LINKS = 512
# A peer's one-sided table comes in pages; more pages than this is a peer describing more than it can own.
_MAX_TABLE_PAGES = 1024
# How long a peer whose connection ended but whose process still ran is watched for its exit (to reap it).
_DEPARTED_WATCH_S = 10.0


@dataclass(frozen=True)
class BlocksSpec:
    """A validated block pull: remote blocks `src_blocks[k]` into local blocks `dst_blocks[k]`."""

    remote_cluster_id: int
    model_id: int
    src_tensor_start: int
    tensor_count: int
    whole: bool
    dst_tensor_start: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]


@dataclass(frozen=True)
class PushSpan:
    """Bytes to push into [dst_addr, dst_addr + nbytes) of the peer: runs from our segment, their
    destination offsets relative to dst_addr."""

    dst_addr: int
    nbytes: int
    runs: tuple[Run, ...]


@dataclass(slots=True)
class PullSpec:
    """A validated pull, in the owner's terms (source) and ours (destination)."""

    remote_cluster_id: int
    key_kind: int
    key_id: int
    model_id: int
    batch_index: int
    src_tensor_start: int
    tensor_count: int
    whole: bool
    nbytes: int
    src_offset: int
    consume: bool
    dst_tensor_start: int
    dst_base_offset: int


class Core(NodeHooks):
    """All the state and resources of one initialised instance.

    Every instance serves on a private callback socket (`llmdd-<cluster id>-<pid>.sock` in the runtime
    directory), announced to each peer it links to, so that a peer can connect back and push into its
    memory; a side with `listen_ip_info` also serves on the socket named after that address.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.role = settings.role
        reaped = reap()
        if reaped:
            log.info("removed %d shared-memory segments left by dead processes", len(reaped))
        pools: dict[int, Pool] = {}
        if not settings.cache_manager_mode:
            pools[PLACEMENT_DEVICE] = Pool(capacity_nbytes=settings.pool_capacity_nbytes)
            oom_code = LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
        else:
            # v2 allocates only from configured pools; registered memory needs none.
            for placement, config in (
                (PLACEMENT_DEVICE, settings.device_pool),
                (PLACEMENT_HOST, settings.host_pool),
            ):
                if config is not None:
                    pools[placement] = Pool(
                        capacity_nbytes=config.memory_nbytes, alignment=max(1 << config.page_shift, 4096)
                    )
            oom_code = LLMStatusCode.LLM_OUT_OF_MEMORY
        # Drawn once per instance: peers tell a restarted process at the same address from the old one.
        self.incarnation = secrets.randbits(64) or 1
        self.table = CacheTable(
            pools,
            oom_code=oom_code,
            incarnation=self.incarnation,
            lock_timeout_s=max(settings.sync_kv_timeout_ms / 1000.0, 0.1),
        )
        self.leases = Leases(self.table)
        # Across hosts: the shared secret (or why there is none), the transfer engine once started, the
        # memory this instance registered with it (address -> nbytes), our TCP listeners.
        self._secret: bytes | None = None
        self._secret_problem = (
            f"no shared secret: set {_auth.ENV_SECRET} (or {_auth.ENV_SECRET_FILE}, a file of mode 0600) "
            "to the same value on both hosts"
        )
        self._secret_unusable = False  # one is configured, but cannot be used (said at every use)
        try:
            self._secret = _auth.load_secret()
        except _auth.SecretError as exc:
            self._secret_problem = str(exc)
            self._secret_unusable = True
        self._engine: RemoteEngine | None = None
        self._exposed: dict[int, int] = {}
        self._remote_lock = threading.Lock()
        self._tcp_callbacks: dict[str, int] = {}  # our ip -> the port we serve TCP callbacks on
        self.public_tcp: tuple[str, int] | None = None
        for pool in pools.values():
            pool.on_release = self._segment_released
        self.table.on_unregistered = self._registered_released
        self.copier = Copier()
        self.copier.start()
        self._closed = False
        self._links: dict[int, ClientLink] = {}
        self._links_lock = threading.Lock()
        # Links back to peers that linked to us, used to push into their memory; keyed by cluster id.
        self._push_links: dict[int, ClientLink] = {}
        self._push_connect_lock = threading.Lock()
        self.last_pull_breakdown: dict[str, float] = {}
        self.comms = Comms(self)
        self._pushing: dict[int, int] = {}
        self.pull_gate = threading.Lock()
        # Peers whose connection ended while their process was still alive: pid -> until when to look.
        self._departed: dict[int, float] = {}
        self._departed_lock = threading.Lock()
        self.server = Server(
            cluster_id=settings.cluster_id,
            role=int(self.role),
            service=CacheService(self.leases, self),
            incarnation=self.incarnation,
            secret=self._secret,
        )
        self.public_path: Path | None = None
        try:
            ensure_runtime_dir()
            stale = remove_stale_sockets()
            if stale:
                log.info("removed %d sockets left by dead processes", len(stale))
            self.callback_name = f"llmdd-{settings.cluster_id}-{os.getpid()}.sock"
            self.server.start()
            self.server.listen(socket_path_in_runtime(self.callback_name))
            if settings.listen is not None:
                self.listen_public(settings.listen)
        except BaseException:
            self.server.close()
            self.table.close()
            raise

    @property
    def sync_kv_timeout_s(self) -> float:
        return self.settings.sync_kv_timeout_ms / 1000.0

    # ------------------------------------------------------------------ server

    def listen_public(self, listen: tuple[str, int]) -> None:
        """Serve on the Unix socket derived from `ip:port`, and, for peers on other hosts, on TCP at
        `ip:port` itself when `ip` is not a loopback address and a shared secret is configured."""
        path = socket_path(*listen)
        try:
            self.server.listen(path)
        except FileExistsError as exc:
            raise StatusError(LLMStatusCode.LLM_FAILED, f"{listen[0]}:{listen[1]} is taken: {exc}") from exc
        self.public_path = path
        ip, port = listen
        if ip.startswith("127."):
            return
        if self._secret is None:
            # No secret is how one host runs; a secret that is set but unusable is a mistake to shout about.
            say = log.error if self._secret_unusable else log.info
            say("not serving other hosts at %s:%d: %s", ip, port, self._secret_problem)
            return
        try:
            self.server.listen_tcp(ip, port)
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                # An address of no interface here (a device ip copied from an Ascend config): one host only.
                log.info("not serving other hosts at %s:%d: no interface has that address", ip, port)
                return
            self.server.unlisten(path)
            self.public_path = None
            raise StatusError(LLMStatusCode.LLM_FAILED, f"TCP {ip}:{port} cannot be served: {exc}") from exc
        self.public_tcp = (ip, port)
        log.info("serving other hosts at %s:%d", ip, port)

    def set_role(self, role: LLMRole) -> None:
        self.role = role
        self.server.role = int(role)

    def stop_public(self) -> None:
        if self.public_path is not None:
            self.server.unlisten(self.public_path)
            self.public_path = None
        if self.public_tcp is not None:
            self.server.unlisten(self.public_tcp)
            self.public_tcp = None

    def _link_broken(self, link: ClientLink) -> None:
        if not link.peer.remote:  # a pid on another host says nothing about this one
            self._clean_up_after(link.peer.pid)

    def _clean_up_after(self, pid: int, watch_until: float | None = None) -> None:
        """When a peer's connection ends and the peer is dead, remove what it left: its segments (the
        reaper checks every owner's pid and start time itself) and sockets nobody serves any more. A peer
        still exiting (its sockets close before it is gone) is looked at again at housekeeping, for a
        while."""
        if _process_alive(pid):
            with self._departed_lock:
                self._departed[pid] = watch_until or time.monotonic() + _DEPARTED_WATCH_S
            return
        reaped = reap()
        stale = remove_stale_sockets()
        if reaped or stale:
            log.info("peer %d died: removed %d segments and %d sockets it left", pid, len(reaped), len(stale))

    def is_pushing_to(self, cluster_id: int) -> bool:
        with self._links_lock:
            return self._pushing.get(cluster_id, 0) > 0

    def housekeeping(self) -> None:
        """Server thread, about twice a second: unmap the segments peers have retired (a growing pool
        unlinks a segment that fell empty), so that no freed memory stays alive through our mappings."""
        with self._links_lock:
            links = list(self._links.values()) + list(self._push_links.values())
        for link in links:
            for name in link.mappings.drop_unlinked():
                link.owned_segments.discard(name.lstrip("/"))
                link.owned_segments.discard(name)
        # What pullers did in our index meanwhile (caches they let go of are freed now, not at our next call).
        self.table.sync()
        # Our unpins in peers' indexes that could not get their lock in time.
        settle_owed(SERVER_LOCK_TIMEOUT_S)
        if self._departed:
            now = time.monotonic()
            with self._departed_lock:
                departed, self._departed = self._departed, {}
            for pid, until in departed.items():
                if now < until:
                    self._clean_up_after(pid, until)  # looks again later if it still lives

    def peer_gone(self, peer: PeerInfo) -> None:
        if not peer.remote:
            self._clean_up_after(peer.pid)
        if any(other.cluster_id == peer.cluster_id for other in self.server.peers()):
            return
        with self._links_lock:
            link = self._push_links.pop(peer.cluster_id, None)
        if link is not None:
            link.close(say_bye=True)

    # ------------------------------------------------------------------ links

    def link(
        self, remote_cluster_id: int, ip: str, port: int, deadline: float, local_ip: str = ""
    ) -> LLMStatusCode:
        """Link to the side listening at `ip:port`: through its Unix socket when `ip` is this host's, over
        TCP otherwise (from `local_ip` when that is one of ours). MissingExtra (raised) when the link
        needs the transfer engine and it is not installed; every other failure is a returned code."""
        self.server.check_alive()
        with self._links_lock:
            if remote_cluster_id in self._links:
                return LLMStatusCode.LLM_ALREADY_LINK
            if len(self._links) >= MAX_LINKS:
                log.error("link to cluster %d refused: %d links is the limit", remote_cluster_id, MAX_LINKS)
                return LLMStatusCode.LLM_LINK_FAILED
        try:
            if is_local_ip(ip):
                link = self.connect_unix(socket_path(ip, port), remote_cluster_id, deadline)
            else:
                link = self.connect_tcp(remote_cluster_id, ip, port, deadline, local_ip)
        except MissingExtra:
            raise
        except StatusError as exc:
            log.error("link to cluster %d at %s:%d failed: %s", remote_cluster_id, ip, port, exc.detail)
            return exc.code
        except Exception as exc:
            log.error("link to cluster %d at %s:%d failed: %s", remote_cluster_id, ip, port, exc)
            return LLMStatusCode.LLM_LINK_FAILED
        with self._links_lock:
            refused = (
                LLMStatusCode.LLM_ALREADY_LINK
                if remote_cluster_id in self._links
                else LLMStatusCode.LLM_FAILED
                if self._closed
                else None
            )
            if refused is None:
                self._links[remote_cluster_id] = link
                link.on_broken = self._link_broken
        if refused is not None:
            link.close(say_bye=True)
            return refused
        return LLMStatusCode.LLM_SUCCESS

    # ------------------------------------------------------------------ across hosts

    def _require_other_hosts(self, why: str) -> bytes:
        """The shared secret, when this process can reach other hosts; else StatusError(LLM_LINK_FAILED):
        MissingExtra, naming the extra, without the transfer engine; `why` + what is wrong without a usable
        secret."""
        problem = engine_available()
        if problem is not None:
            raise MissingExtra(LLMStatusCode.LLM_LINK_FAILED, problem)
        if self._secret is None:
            raise StatusError(LLMStatusCode.LLM_LINK_FAILED, why + self._secret_problem)
        return self._secret

    def listen_tcp(self, ip: str, port: int) -> None:
        """Serve peers on other hosts at `ip:port` too (a two-sided link's rendezvous); StatusError
        (LLM_LINK_FAILED) without a usable secret or transfer engine, or when the port is taken."""
        self._require_other_hosts("members on other hosts: ")
        try:
            self.server.listen_tcp(ip, port)
        except OSError as exc:
            raise StatusError(
                LLMStatusCode.LLM_LINK_FAILED, f"TCP {ip}:{port} cannot be served: {exc}"
            ) from exc

    def connect_tcp(
        self,
        remote_cluster_id: int,
        ip: str,
        port: int,
        deadline: float,
        local_ip: str = "",
        *,
        serve_callback: bool = True,
    ) -> ClientLink:
        """A link over TCP to a peer on another host (see `ClientLink.connect_tcp`), from `local_ip` when
        that is one of ours. `serve_callback`: announce a TCP port of ours the peer may push through (not
        on a link that is itself the way back)."""
        secret = self._require_other_hosts(f"{ip} is on another host and ")
        return ClientLink.connect_tcp(
            ip,
            port,
            secret=secret,
            local_ip=local_ip if local_ip and is_local_ip(local_ip) and local_ip != "0.0.0.0" else "",
            engine=lambda our_ip: self.engine(our_ip).address,
            callback_port=self._tcp_callback_port if serve_callback else lambda our_ip: 0,
            cluster_id=self.settings.cluster_id,
            remote_cluster_id=remote_cluster_id,
            role=int(self.role),
            deadline=deadline,
            incarnation=self.incarnation,
        )

    def connect_unix(
        self, path: Path, remote_cluster_id: int, deadline: float, *, announce_callback: bool = True
    ) -> ClientLink:
        """A link through the Unix socket at `path` (see `ClientLink.connect`); `announce_callback`: tell
        the peer our callback socket (not on a link that is itself the way back)."""
        return ClientLink.connect(
            path,
            cluster_id=self.settings.cluster_id,
            remote_cluster_id=remote_cluster_id,
            role=int(self.role),
            deadline=deadline,
            callback=self.callback_name if announce_callback else "",
            incarnation=self.incarnation,
        )

    def engine(self, local_ip: str) -> RemoteEngine:
        """This process's transfer engine (started on `local_ip` on first use)."""
        with self._remote_lock:
            if self._engine is None:
                self._engine = shared_engine(local_ip)
            return self._engine

    def _tcp_callback_port(self, local_ip: str) -> int:
        """The port where we serve TCP on `local_ip` for peers on other hosts we linked to (their way back
        to push into our memory); started on first use."""
        with self._remote_lock:
            port = self._tcp_callbacks.get(local_ip)
            if port is None:
                port = self.server.listen_tcp(local_ip, 0)
                self._tcp_callbacks[local_ip] = port
            return port

    def serve_remote(self, local_ip: str) -> str:
        """Server thread: a peer on another host linked to us at `local_ip`; our engine's address."""
        problem = engine_available()
        if problem is not None:
            raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"the serving side cannot: {problem}")
        return self.engine(local_ip).address

    def segment_addresses(self, names: tuple[str, ...]) -> tuple[int, ...]:
        """Server thread: where our segments `names` are, registered with our engine for a remote peer."""
        engine = self._engine
        if engine is None:
            raise StatusError(LLMStatusCode.LLM_FAILED, "no transfer engine runs here")
        addrs = []
        for name in names:
            found = self.table.segment_address(name)
            if found is None:
                raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"no segment {name} here")
            self._expose(engine, *found)
            addrs.append(found[0])
        return tuple(addrs)

    def expose_ranges(self, addrs: tuple[int, ...], nbytes: int) -> None:
        """Server thread: registered memory a remote peer was granted, made transferable."""
        engine = self._engine
        if engine is None:
            raise StatusError(LLMStatusCode.LLM_FAILED, "no transfer engine runs here")
        for addr in addrs:
            self._expose(engine, addr, nbytes)

    def _expose(self, engine: RemoteEngine, addr: int, nbytes: int) -> None:
        with self._remote_lock:
            if self._exposed.get(addr, 0) >= nbytes:
                return
            engine.register(addr, nbytes)
            self._exposed[addr] = nbytes

    def _withdraw(self, addr: int) -> None:
        with self._remote_lock:
            exposed = self._exposed.pop(addr, None)
            engine = self._engine
        if exposed is not None and engine is not None:
            engine.unregister(addr)

    def _segment_released(self, segment: Segment) -> None:
        """A pool segment is about to be unmapped: no engine may reach it afterwards."""
        if self._exposed:
            self._withdraw(segment.address)

    def _registered_released(self, record: CacheRecord) -> None:
        """A registered cache is forgotten: its memory goes back to the user, out of every engine's reach."""
        if self._exposed:
            for addr in record.addrs:
                self._withdraw(addr)

    def _segment_bases(self, link: ClientLink, names: list[str], deadline: float) -> list[int]:
        """Where the remote peer has its segments `names` (asked once per segment and link)."""
        missing = list(dict.fromkeys(name for name in names if name not in link.segment_addrs))
        for start in range(0, len(missing), MAX_ADDRESS_NAMES):
            chunk = tuple(missing[start : start + MAX_ADDRESS_NAMES])
            seq = link.next_seq()
            reply = link.request(AddressRequest(seq, chunk), seq, deadline)
            if not isinstance(reply, Addresses) or len(reply.addrs) != len(chunk):
                raise PeerGone(f"expected {len(chunk)} Addresses, got {type(reply).__name__}")
            if len(link.segment_addrs) > 4096:
                link.segment_addrs.clear()  # a long-lived peer's pools come and go: forget old names
            link.segment_addrs.update(zip(chunk, reply.addrs, strict=True))
        return [link.segment_addrs[name] for name in names]

    def _remote_copy(
        self,
        link: ClientLink,
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
        engine = self.engine(link.local_ip)
        if engine.protocol != "tcp":
            # RDMA reads and writes only registered local memory; over TCP the engine copies to and from
            # the local side itself, and registering it would only open it to the engine's port.
            if local.block is not None:
                segment = local.block.segment
                self._expose(engine, segment.address, segment.nbytes)
            else:
                for addr in local.addrs:
                    self._expose(engine, addr, local.tensor_nbytes)
        try:
            engine.transfer(
                link.peer.engine,
                local_addrs,
                remote_addrs,
                lengths,
                write=write,
                deadline=deadline,
                timeout_code=self.settings.timeout_code,
                check_peer=link.check_peer_alive,
                hold=lambda: self.table.hold(local),
            )
        except PeerGone:
            raise
        except StatusError as exc:
            link.fail(exc.detail)
            raise

    def unlink(self, remote_cluster_id: int, *, force: bool) -> LLMStatusCode:
        with self._links_lock:
            link = self._links.get(remote_cluster_id)
            if link is None:
                return LLMStatusCode.LLM_NOT_YET_LINK
            try:
                with link.exclusive(0.0, busy_fails=True):
                    pass
            except StatusError as exc:
                if exc.code == LLMStatusCode.LLM_LINK_BUSY:
                    return exc.code
            del self._links[remote_cluster_id]
        link.close(say_bye=not force)
        return LLMStatusCode.LLM_SUCCESS

    def get_link(self, remote_cluster_id: int) -> ClientLink:
        self.server.check_alive()
        with self._links_lock:
            link = self._links.get(remote_cluster_id)
        if link is None:
            raise StatusError(LLMStatusCode.LLM_NOT_YET_LINK, f"no link to cluster {remote_cluster_id}")
        return link

    def linked_clusters(self) -> list[int]:
        with self._links_lock:
            return list(self._links)

    def check_link(self, remote_cluster_id: int) -> None:
        link = self.get_link(remote_cluster_id)
        deadline = time.monotonic() + self.sync_kv_timeout_s
        with link.exclusive(deadline, busy_fails=True):
            seq = link.next_seq()
            reply = link.request(Ping(seq), seq, deadline)
            if not isinstance(reply, Pong):
                raise PeerGone(f"expected Pong, got {type(reply).__name__}")

    # ------------------------------------------------------------------ transfers

    def pull(self, spec: PullSpec, dst: CacheRecord) -> None:
        """Pin the source in the owner's published index (or, for what it could not publish, ask it), copy
        from its segment into `dst`, unpin (consuming the key if asked)."""
        deadline = time.monotonic() + self.sync_kv_timeout_s
        link = self.get_link(spec.remote_cluster_id)
        marks = [time.perf_counter()]
        # The same fields name the source in the owner's index and in a request to the owner.
        fields: PinRequest = (
            spec.key_kind,
            spec.key_id,
            spec.model_id,
            spec.batch_index,
            spec.src_tensor_start,
            spec.tensor_count,
            spec.whole,
            spec.nbytes,
            spec.src_offset,
            spec.consume,
        )
        with link.exclusive(deadline):
            index, pinned = self._pin(link, deadline, fields)
            if index is not None and pinned is not None:
                cache = pinned.cache
                shift = pinned.batch_slot * cache.slot_nbytes + spec.src_offset
                offsets = tuple(
                    base + shift for base in cache.tensor_bases(spec.src_tensor_start, spec.tensor_count)
                )
                marks.append(time.perf_counter())
                ok = False
                try:  # `_pinned_in` written out: a generator context manager costs a microsecond a pull
                    if _faults.hook is not None:
                        _faults.at("pinned")
                    self._copy_pull(
                        link, spec, dst, cache.segment, cache.segment_nbytes, offsets, marks, deadline
                    )
                    if _faults.hook is not None:
                        _faults.at("copied")
                    ok = True
                finally:
                    unpin(link, index, ok=ok)
                if _faults.hook is not None:
                    _faults.at("released")
            else:

                def copy(grant: PullGrant) -> None:
                    marks.append(time.perf_counter())
                    if len(grant.tensor_offsets) != spec.tensor_count or grant.nbytes != spec.nbytes:
                        raise StatusError(
                            LLMStatusCode.LLM_FAILED, "peer granted a different range than requested"
                        )
                    self._copy_pull(
                        link,
                        spec,
                        dst,
                        grant.segment,
                        grant.segment_nbytes,
                        grant.tensor_offsets,
                        marks,
                        deadline,
                    )

                seq = link.next_seq()
                self._leased(link, PullRequest(seq, *fields), seq, PullGrant, deadline, copy)
        marks.append(time.perf_counter())
        # Where the last pull's time went (bench reads it): resolve and pin, planning, copy, unpin.
        if len(marks) == 5:
            start, pinned_at, planned, copied, done = marks
            self.last_pull_breakdown = {
                "resolve": pinned_at - start,
                "plan": planned - pinned_at,
                "copy": copied - planned,
                "release": done - copied,
            }

    def _copy_pull(
        self,
        link: ClientLink,
        spec: PullSpec,
        dst: CacheRecord,
        segment: str,
        segment_nbytes: int,
        src_offsets: tuple[int, ...],
        marks: list[float],
        deadline: float,
    ) -> None:
        dst_offsets = [
            dst.tensor_offset(spec.dst_tensor_start + i) + spec.dst_base_offset
            for i in range(spec.tensor_count)
        ]
        if link.peer.remote:
            runs = plan_tensor_copy(src_offsets, dst_offsets, spec.nbytes)
            marks.append(time.perf_counter())
            (src_base,) = self._segment_bases(link, [segment], deadline)
            dst_base = dst.pool_block.segment.address
            self._remote_copy(
                link,
                dst,
                [dst_base + run.dst_offset for run in runs],
                [src_base + run.src_offset for run in runs],
                [run.nbytes for run in runs],
                write=False,
                deadline=deadline,
            )
            marks.append(time.perf_counter())
            return
        src = self._peer_segment(link, segment, segment_nbytes, writable=False)
        # Tensors are a constant pitch apart on each side: one strided copy, else a list of runs.
        strided = StridedCopy.from_offsets(src_offsets, dst_offsets, spec.nbytes)
        marks.append(time.perf_counter())
        if strided is not None:
            self.copier.run_strided(strided, src.array, dst.pool_block.segment.array)
        else:
            runs = plan_tensor_copy(src_offsets, dst_offsets, spec.nbytes)
            self.copier.run(runs, src.array, dst.pool_block.segment.array)
        marks.append(time.perf_counter())

    def _pin(
        self,
        link: ClientLink,
        deadline: float,
        request: PinRequest,
        *,
        v2: bool = False,
        for_write: bool = False,
    ) -> tuple[Index | None, Pin | None]:
        """Pin what a pull names through the link's row of the owner's index: (index, pin), or (index or
        None, None) when the owner must be asked. The link's socket says first whether the owner is alive:
        a dead owner's index is never read."""
        link.check_usable()
        link.check_peer_alive()
        index = peer_index(link, self.incarnation, deadline, self.settings.timeout_code)
        if index is None:
            return None, None
        pinned = dataplane_pin(
            link,
            index,
            request,
            cluster_id=self.settings.cluster_id,
            deadline=deadline,
            timeout_code=self.settings.timeout_code,
            v2=v2,
            for_write=for_write,
        )
        return index, pinned

    @contextlib.contextmanager
    def _pinned_in(self, link: ClientLink, index: Index) -> Iterator[None]:
        ok = False
        try:
            _faults.at("pinned")
            yield
            _faults.at("copied")
            ok = True
        finally:
            unpin(link, index, ok=ok)
        _faults.at("released")

    def pull_blocks(self, spec: BlocksSpec, dst: CacheRecord) -> None:
        """Pin the owner's paged cache, copy block src_blocks[k] to dst_blocks[k] of every tensor, unpin."""
        deadline = time.monotonic() + self.sync_kv_timeout_s
        link = self.get_link(spec.remote_cluster_id)
        with link.exclusive(deadline):
            fields = (KEY_BLOCKS, 0, spec.model_id, 0, spec.src_tensor_start, spec.tensor_count, spec.whole)
            index, pinned = self._pin(link, deadline, (*fields, 1, 0, False))
            if index is not None and pinned is not None:
                cache = pinned.cache
                offsets = cache.tensor_bases(spec.src_tensor_start, spec.tensor_count)
                with self._pinned_in(link, index):
                    self._copy_blocks(
                        link,
                        spec,
                        dst,
                        cache.segment,
                        cache.segment_nbytes,
                        offsets,
                        cache.slot_nbytes,
                        cache.batch_size,
                        deadline,
                    )
                return

            def copy(grant: BlocksGrant) -> None:
                if len(grant.tensor_offsets) != spec.tensor_count:
                    raise StatusError(
                        LLMStatusCode.LLM_FAILED, "peer granted a different range than requested"
                    )
                self._copy_blocks(
                    link,
                    spec,
                    dst,
                    grant.segment,
                    grant.segment_nbytes,
                    grant.tensor_offsets,
                    grant.block_nbytes,
                    grant.num_blocks,
                    deadline,
                )

            seq = link.next_seq()
            request = BlocksRequest(seq, spec.model_id, spec.src_tensor_start, spec.tensor_count, spec.whole)
            self._leased(link, request, seq, BlocksGrant, deadline, copy)

    def _copy_blocks(
        self,
        link: ClientLink,
        spec: BlocksSpec,
        dst: CacheRecord,
        segment: str,
        segment_nbytes: int,
        src_offsets: tuple[int, ...],
        block_nbytes: int,
        num_blocks: int,
        deadline: float,
    ) -> None:
        if block_nbytes != dst.slot_nbytes:
            raise StatusError(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"remote blocks are {block_nbytes} bytes, local blocks {dst.slot_nbytes}",
            )
        if max(spec.src_blocks) >= num_blocks:
            raise StatusError(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"prompt block {max(spec.src_blocks)} >= the remote block count {num_blocks}",
            )
        dst_offsets = [dst.tensor_offset(spec.dst_tensor_start + i) for i in range(spec.tensor_count)]
        plan = BlockPlan.make(
            src_offsets,
            dst_offsets,
            spec.src_blocks,
            spec.dst_blocks,
            block_nbytes,
            dst.slot_nbytes,
            dst.slot_nbytes,
        )
        if link.peer.remote:
            # The grant's blocks must lie in its segment and ours in our segment, as the local copy checks.
            try:
                plan.check(segment_nbytes, dst.pool_block.segment.nbytes)
            except ShmError as exc:
                raise StatusError(
                    LLMStatusCode.LLM_FAILED, f"peer granted blocks out of range: {exc}"
                ) from exc
            (src_base,) = self._segment_bases(link, [segment], deadline)
            dst_base = dst.pool_block.segment.address
            src_starts, dst_starts, lengths = block_runs(plan)
            count = len(plan.src_tensor_offsets)
            # Every tensor's runs at once: (tensor, run) grids of addresses, flattened in tensor order.
            remote = src_base + np.add.outer(np.array(plan.src_tensor_offsets, dtype=np.int64), src_starts)
            local = dst_base + np.add.outer(np.array(plan.dst_tensor_offsets, dtype=np.int64), dst_starts)
            self._remote_copy(
                link,
                dst,
                local.ravel().tolist(),
                remote.ravel().tolist(),
                np.tile(lengths, count).tolist(),
                write=False,
                deadline=deadline,
            )
            return
        src = self._peer_segment(link, segment, segment_nbytes, writable=False)
        self.copier.run_blocks(plan, src.array, dst.pool_block.segment.array)

    def push(self, remote_cluster_id: int, src: CacheRecord, spans: list[PushSpan]) -> None:
        """Pin the peer's memory at the spans' addresses, copy into it from `src`'s segment, release.

        Goes over the link back to a peer that linked to us (its callback socket).
        """
        deadline = time.monotonic() + self.sync_kv_timeout_s
        link = self.link_to(remote_cluster_id, deadline)

        def copy(grant: WriteGrant) -> None:
            if len(grant.range_offsets) != len(spans):
                raise StatusError(LLMStatusCode.LLM_FAILED, "peer granted a different range than requested")
            if link.peer.remote:
                self._push_remote(link, src, spans, grant, deadline)
                return
            targets = [
                self._peer_segment(link, name, nbytes, writable=True)
                for name, nbytes in zip(grant.segments, grant.segment_nbytes, strict=True)
            ]
            by_target: dict[int, list[Run]] = {}
            for span, index, offset in zip(spans, grant.range_segments, grant.range_offsets, strict=True):
                if offset + span.nbytes > targets[index].nbytes:
                    raise StatusError(LLMStatusCode.LLM_FAILED, "peer granted memory outside its segment")
                by_target.setdefault(index, []).extend(
                    Run(run.src_offset, offset + run.dst_offset, run.nbytes) for run in span.runs
                )
            for index, runs in by_target.items():
                self.copier.run(runs, src.pool_block.segment.array, targets[index].array)

        with link.exclusive(deadline):
            seq = link.next_seq()
            request = WriteRequest(
                seq, tuple(span.dst_addr for span in spans), tuple(span.nbytes for span in spans)
            )
            self._leased(link, request, seq, WriteGrant, deadline, copy)

    def _push_remote(
        self, link: ClientLink, src: CacheRecord, spans: list[PushSpan], grant: WriteGrant, deadline: float
    ) -> None:
        """`push`'s copy to a peer on another host: every run in one batch write."""
        bases = self._segment_bases(link, list(grant.segments), deadline)
        src_base = src.pool_block.segment.address
        local: list[int] = []
        remote: list[int] = []
        lengths: list[int] = []
        for span, index, offset in zip(spans, grant.range_segments, grant.range_offsets, strict=True):
            if offset + span.nbytes > grant.segment_nbytes[index]:
                raise StatusError(LLMStatusCode.LLM_FAILED, "peer granted memory outside its segment")
            for run in span.runs:
                local.append(src_base + run.src_offset)
                remote.append(bases[index] + offset + run.dst_offset)
                lengths.append(run.nbytes)
        self._remote_copy(link, src, local, remote, lengths, write=True, deadline=deadline)

    def push_link(self, remote_cluster_id: int, deadline: float) -> ClientLink:
        """The link back to `remote_cluster_id` (a peer linked to us), connected on first use."""
        # One connector at a time: two transfers must not each connect and close the other's link.
        self.server.check_alive()
        with self._push_connect_lock:
            return self._push_link(remote_cluster_id, deadline)

    def _push_link(self, remote_cluster_id: int, deadline: float) -> ClientLink:
        # The most recent connection from that cluster that announced a callback socket: after a restart,
        # the new incarnation's (a connection without one, such as a probe, is no way back).
        peers = [p for p in self.server.peers() if p.cluster_id == remote_cluster_id]
        peer = next((p for p in reversed(peers) if p.callback), peers[-1] if peers else None)
        with self._links_lock:
            link = self._push_links.get(remote_cluster_id)
        if (
            link is not None
            and link.broken is None
            and (peer is None or link.peer.incarnation == peer.incarnation)
        ):
            return link
        if peer is None:
            raise StatusError(
                LLMStatusCode.LLM_NOT_YET_LINK, f"cluster {remote_cluster_id} is not linked to us"
            )
        # The way back: a TCP port a peer on another host serves (it proved our secret, so we have one), or
        # the callback socket a peer on this host announced.
        if not (peer.callback_port if peer.remote else peer.callback):
            raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"cluster {remote_cluster_id} accepts no pushes")
        if peer.remote:
            link = self.connect_tcp(
                remote_cluster_id, peer.host, peer.callback_port, deadline, serve_callback=False
            )
        else:
            link = self.connect_unix(
                socket_path_in_runtime(peer.callback), remote_cluster_id, deadline, announce_callback=False
            )
        if link.peer.incarnation != peer.incarnation or (not peer.remote and link.peer.pid != peer.pid):
            link.close(say_bye=True)
            raise StatusError(
                LLMStatusCode.LLM_LINK_FAILED, "the callback socket is served by another process"
            )
        link.on_broken = self._link_broken
        with self._links_lock:
            old = self._push_links.pop(remote_cluster_id, None)
            self._push_links[remote_cluster_id] = link
        if old is not None:
            old.close(say_bye=False)
        return link

    def start_pushing(self, cluster_ids: set[int]) -> int | None:
        """Mark a layer-wise transfer into these clusters: their pulls from us (asked or through our
        index) get LLM_LINK_BUSY until the matching `stop_pushing`. Refused, with the cluster that is
        pulling from us now, when one is: checked and marked under the index lock, so no pin slips in."""
        busy = self.leases.start_push(cluster_ids, self.server.conns_of)
        if busy is not None:
            return busy
        with self._links_lock:
            for cluster_id in cluster_ids:
                self._pushing[cluster_id] = self._pushing.get(cluster_id, 0) + 1
        return None

    def stop_pushing(self, cluster_ids: set[int]) -> None:
        self.leases.end_push(cluster_ids)
        with self._links_lock:
            for cluster_id in cluster_ids:
                self._pushing[cluster_id] -= 1
                if not self._pushing[cluster_id]:
                    del self._pushing[cluster_id]

    def _leased(
        self,
        link: ClientLink,
        request: Message,
        seq: int,
        grant_type: type[GrantT],
        deadline: float,
        work: Callable[[GrantT], None],
    ) -> None:
        """Send a request that pins memory at the peer, run `work` on the grant, then release the lease."""
        grant = link.request(request, seq, deadline)
        if not isinstance(grant, grant_type):
            raise PeerGone(f"expected {grant_type.__name__}, got {type(grant).__name__}")
        ok = False
        try:
            _faults.at("pinned")
            work(grant)
            _faults.at("copied")
            ok = True
        finally:
            # One way: the owner releases (or, after a failure, gives the key back) in order with this
            # link's next messages; waiting for it would cost a round trip per transfer.
            if ok:
                link.send_only(Release(grant.lease_id, True), deadline)
            elif link.broken is None:
                # Best effort: the original error is the one to report.
                with contextlib.suppress(StatusError):
                    link.send_only(Release(grant.lease_id, False), deadline)
        _faults.at("released")

    @staticmethod
    def _peer_segment(link: ClientLink, name: str, nbytes: int, *, writable: bool) -> Segment:
        """Map a segment a peer granted. Never trust a peer's description of memory: the segment must be
        the peer's own (its pid and our uid in the name) and hold what the grant says. A segment that
        cannot be mapped because its owner died is a link failure, not a shared-memory one."""
        if name not in link.owned_segments:
            owner = parse_segment_name(name)
            if owner is None or owner.pid != link.peer.pid or owner.uid != os.getuid():
                raise StatusError(LLMStatusCode.LLM_FAILED, f"peer granted a segment it does not own: {name}")
            link.owned_segments.add(name)  # a name carries its owner: once checked, it stays the peer's
        try:
            return link.mappings.get(name, min_nbytes=nbytes, writable=writable)
        except ShmError as exc:
            # An owner unlinks a segment with something granted in it only when it finalizes or dies,
            # and it closes its connections first: the link tells which.
            link.check_peer_alive()
            if _process_alive(link.peer.pid):
                raise
            raise _peer_ended(link, exc) from exc

    # ------------------------------------------------------------------ cache-manager (v2) transfers

    def link_to(self, remote_cluster_id: int, deadline: float) -> ClientLink:
        """A link to `remote_cluster_id`: ours if we linked to it, else the link back to its callback socket
        when it linked to us (in v2 either side may pull and push)."""
        self.server.check_alive()
        with self._links_lock:
            link = self._links.get(remote_cluster_id)
        return link if link is not None else self.push_link(remote_cluster_id, deadline)

    def remote_table(self, remote_cluster_id: int, *, refresh: bool = False) -> RemoteTable:
        """The peer's table of remote-accessible caches, read from its index (or, when the peer could not
        publish every cache there, fetched page by page) on first use and kept on the link: a new link, to
        a restarted peer, starts with no table."""
        deadline = time.monotonic() + self.sync_kv_timeout_s
        link = self.link_to(remote_cluster_id, deadline)
        table = None if refresh else link.remote_table
        if isinstance(table, RemoteTable):
            return table
        caches: dict[int, RemoteCache] = {}
        blocks: dict[int, int] = {}
        start_cache_id = 1
        versions: set[int] = set()
        generations = ""
        with link.exclusive(deadline):
            table = self._index_table(link, deadline)
            if table is not None:
                link.remote_table = table
                return table
            for _ in range(_MAX_TABLE_PAGES):
                seq = link.next_seq()
                reply = link.request(TableRequest(seq, start_cache_id), seq, deadline)
                if not isinstance(reply, Table):
                    raise PeerGone(f"expected Table, got {type(reply).__name__}")
                if reply.pid != link.peer.pid:
                    raise StatusError(
                        LLMStatusCode.LLM_FAILED, f"peer {link.peer.pid} sent the table of pid {reply.pid}"
                    )
                _add_table_page(reply, caches, blocks)
                versions.add(reply.version)
                generations = reply.generations
                if reply.next_cache_id == 0:
                    break
                if reply.next_cache_id <= start_cache_id:
                    raise StatusError(LLMStatusCode.LLM_FAILED, "peer's table pages go backwards")
                start_cache_id = reply.next_cache_id
            else:
                raise StatusError(LLMStatusCode.LLM_FAILED, f"peer's table has over {_MAX_TABLE_PAGES} pages")
            # Pages taken at different versions: keep the table for this call, refetch at the next.
            version = versions.pop() if len(versions) == 1 else 0
            table = RemoteTable(caches, blocks, generations, version)
            link.remote_table = table
        return table

    def _index_table(self, link: ClientLink, deadline: float) -> RemoteTable | None:
        """The peer's one-sided table as its index holds it, with no message; None when the peer has no
        index or could not publish every cache in it."""
        link.check_usable()
        link.check_peer_alive()
        index = peer_index(link, self.incarnation, deadline, self.settings.timeout_code)
        if index is None:
            return None
        try:
            generations = index.generations
            if not generations:
                return None
            # The version word before the entries: a change in between makes the reader refetch once more.
            words = self._peer_segment(link, generations, 8, writable=False)
            version = read_generation(words, 0)
            _order_loads()
            index.lock(max(deadline - time.monotonic(), 0.0))
            try:
                state, flags = index.header()
                if state != STATE_OPEN:
                    raise StatusError(LLMStatusCode.LLM_LINK_FAILED, "the peer closed its cache table")
                if flags & FLAG_CACHES_UNPUBLISHED:
                    return None
                entries = index.live_caches()
                names = index.blocks_names()
            finally:
                index.unlock()
        except ShmError as exc:
            raise_index_error(link, exc, self.settings.timeout_code)
        pid = link.peer.pid
        caches: dict[int, RemoteCache] = {}
        by_slot: dict[tuple[int, int], int] = {}
        for entry in entries:
            if entry.flags & CACHE_WITHDRAWN or not entry.flags & CACHE_REMOTE:
                continue
            caches[entry.cache_id] = RemoteCache(
                entry.cache_id,
                entry.is_blocks,
                pid,
                entry.segment,
                entry.segment_nbytes,
                entry.tensor_bases(0, entry.num_tensors),
                entry.slot_nbytes,
                entry.batch_size,
                generations,
                entry.slot,
                entry.generation,
            )
            by_slot[(entry.slot, entry.generation)] = entry.cache_id
        blocks: dict[int, int] = {}
        for name in names:
            cache_id = by_slot.get((name.cache_slot, name.generation))
            if cache_id is not None:
                blocks[name.model_id] = cache_id
        return RemoteTable(caches, blocks, generations, version)

    def remote_table_current(self, remote_cluster_id: int, table: RemoteTable) -> bool:
        """Whether what `table`'s model ids name is still what the peer's keys name (its version word)."""
        deadline = time.monotonic() + self.sync_kv_timeout_s
        link = self.link_to(remote_cluster_id, deadline)
        if link.peer.remote or not table.version or not table.generations:
            return False
        words = self._peer_segment(link, table.generations, 8, writable=False)
        _order_loads()
        return read_generation(words, 0) == table.version

    def check_peer(self, remote_cluster_id: int) -> ClientLink:
        """LLM_LINK_FAILED at once if the link to `remote_cluster_id` is broken or its peer has ended: a
        one-sided transfer checks this before it trusts anything it learnt from that peer. Returns the
        link (`link_to`)."""
        deadline = time.monotonic() + self.sync_kv_timeout_s
        link = self.link_to(remote_cluster_id, deadline)
        link.check_usable()
        link.check_peer_alive()
        return link

    def transfer_one_sided(
        self,
        remote_cluster_id: int,
        remote: RemoteCache,
        remote_tensor_start: int,
        local: CacheRecord,
        local_tensor_start: int,
        tensor_count: int,
        runs: list[UnitRun],
        *,
        link: ClientLink | None = None,
        prepared: PreparedRuns | None = None,
        words: Segment | None = None,
    ) -> tuple[PreparedRuns | None, Segment | None]:
        """Read from a peer's cache (from its table) into ours with no round trip to the peer.

        The cache's generation word is checked after the copy: if the owner freed or reused the cache
        meanwhile, the bytes cannot be trusted and the read fails with LLM_KV_CACHE_NOT_EXIST instead of
        returning stale data. No check is needed before: callers take `remote` from a table entry they just
        found current, and a change since then fails the check after. Writes never go this way (a write
        cannot be taken back once it landed in reused memory): see `transfer_pinned`.

        `link`: the link `link_to` just gave (spares looking it up again). Returns what a caller that
        repeats this very read (same link, entry, local record and runs) may pass back to skip building it
        again: the prepared copy (`_copy_units`) and the entry's generation segment as mapped
        (`remote_cache_current`'s `words`).
        """
        deadline = time.monotonic() + self.sync_kv_timeout_s
        if link is None:
            link = self.link_to(remote_cluster_id, deadline)
        if link.peer.remote:
            # Nothing of a peer on another host is mapped here to check a generation in: it pins the cache
            # for the read instead (one round trip, then the engine's read).
            self.transfer_pinned(
                remote_cluster_id,
                remote,
                remote_tensor_start,
                local,
                local_tensor_start,
                tensor_count,
                runs,
                write=False,
            )
            return None, None
        bases = remote.tensor_bases[remote_tensor_start : remote_tensor_start + tensor_count]
        with link.exclusive(deadline):
            try:
                prepared = self._copy_units(
                    link,
                    remote.pid,
                    remote.segment,
                    remote.segment_nbytes,
                    bases,
                    local,
                    local_tensor_start,
                    runs,
                    to_remote=False,
                    prepared=prepared,
                )
            except RangeUnmapped as exc:
                # The owner unregistered and freed that memory during the read (nothing pins it): the
                # generation check tells that from a bad local range.
                if not self.remote_cache_current(link, remote, words=words):
                    raise StatusError(
                        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                        f"remote cache {remote.cache_id} was unregistered during the transfer",
                    ) from exc
                raise
            link.check_peer_alive()
            if words is None or words.closed:
                words = self._peer_segment(
                    link, remote.generations, (remote.gen_slot + 1) * 8, writable=False
                )
            if not self.remote_cache_current(link, remote, words=words):
                raise StatusError(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                    f"remote cache {remote.cache_id} was freed or reused during the transfer",
                )
        return prepared, words

    def remote_cache_current(
        self,
        link: ClientLink,
        remote: RemoteCache,
        table: RemoteTable | None = None,
        *,
        words: Segment | None = None,
    ) -> bool:
        """Whether the owner still holds the cache this table entry describes (its generation word). A
        generation segment that is gone because its owner ended is a link failure (see `_peer_segment`).

        With `table` (the entry's), also whether what its model ids name is still current, as
        `remote_table_current` says, in the same look at the segment: False for a table whose version
        word is unknown or lives in another segment than the entry's. `words`: the entry's generation
        segment as an earlier call on this link mapped it, used while it is open (the link's mapping cache
        closes what it drops)."""
        if link.peer.remote:
            return False  # nothing of it is mapped here: the caller looks the cache up again
        if table is not None and (
            not table.version or not table.generations or table.generations != remote.generations
        ):
            return False
        if words is None or words.closed:
            words = self._peer_segment(link, remote.generations, (remote.gen_slot + 1) * 8, writable=False)
        _order_loads()
        if table is not None and read_generation(words, 0) != table.version:
            return False
        return read_generation(words, remote.gen_slot) == remote.generation

    def transfer_pinned(
        self,
        remote_cluster_id: int,
        remote: RemoteCache,
        remote_tensor_start: int,
        local: CacheRecord,
        local_tensor_start: int,
        tensor_count: int,
        runs: list[UnitRun],
        *,
        write: bool,
    ) -> None:
        """Read (or `write`) `runs` between our tensors and a peer's cache found in its table, pinned by its
        cache id for the duration (in the peer's index, or by asking the peer): memory its owner frees or
        unregisters is never written, and LLM_KV_CACHE_NOT_EXIST comes once it freed the cache."""
        request = ResolveRequest(
            0, KEY_CACHE_ID, remote.cache_id, 0, 0, remote_tensor_start, tensor_count, False, write, False
        )

        def plan(location: Location) -> list[UnitRun]:
            if (location.unit_nbytes, location.num_units) != (remote.unit_nbytes, remote.num_units):
                raise StatusError(LLMStatusCode.LLM_FAILED, "peer resolved a cache of another shape")
            return runs

        self.transfer_resolved(remote_cluster_id, request, local, local_tensor_start, plan)

    def remote_is_current(self, remote_cluster_id: int, remote: RemoteCache) -> bool:
        deadline = time.monotonic() + self.sync_kv_timeout_s
        link = self.link_to(remote_cluster_id, deadline)
        if link.peer.remote:
            return True  # the transfer pins it by id at the peer, which says if it is gone
        return self.remote_cache_current(link, remote)

    def transfer_resolved(
        self,
        remote_cluster_id: int,
        request: ResolveRequest,
        local: CacheRecord,
        local_tensor_start: int,
        plan: Callable[[Location], list[UnitRun]],
    ) -> None:
        """Ask the peer to pin the cache a key names, copy (a push when `request.for_write`), release."""
        deadline = time.monotonic() + self.sync_kv_timeout_s
        link = self.link_to(remote_cluster_id, deadline)

        def copy(location: Location) -> None:
            if len(location.tensor_bases) != request.tensor_count:
                raise StatusError(LLMStatusCode.LLM_FAILED, "peer resolved a different tensor range")
            runs = plan(location)
            self._copy_units(
                link,
                location.pid,
                location.segment,
                location.segment_nbytes,
                location.tensor_bases,
                local,
                local_tensor_start,
                runs,
                to_remote=request.for_write,
                deadline=deadline,
            )

        with link.exclusive(deadline):
            # In the owner's index when it holds the cache; a write pins it too, consuming nothing.
            fields = (request.key_kind, request.key_id, request.model_id, request.batch_index)
            consume = request.consume and not request.for_write
            index, pinned = self._pin(
                link,
                deadline,
                (*fields, request.tensor_start, request.tensor_count, request.whole, 0, 0, consume),
                v2=True,
                for_write=request.for_write,
            )
            if index is not None and pinned is not None:
                cache = pinned.cache
                location = Location(
                    0,
                    0,
                    link.peer.pid,
                    cache.segment,
                    cache.segment_nbytes,
                    cache.tensor_bases(request.tensor_start, request.tensor_count),
                    cache.slot_nbytes,
                    cache.batch_size,
                    pinned.batch_slot,
                )
                with self._pinned_in(link, index):
                    copy(location)
                return
            seq = link.next_seq()
            self._leased(link, replace(request, seq=seq), seq, Location, deadline, copy)

    def _copy_units(
        self,
        link: ClientLink,
        pid: int,
        segment: str,
        segment_nbytes: int,
        remote_bases: tuple[int, ...],
        local: CacheRecord,
        local_tensor_start: int,
        runs: list[UnitRun],
        *,
        to_remote: bool,
        prepared: PreparedRuns | None = None,
        deadline: float | None = None,
    ) -> PreparedRuns | None:
        """Copy `runs` of each remote tensor (segment offsets, or addresses in `pid` for registered memory
        when `segment` is "") from or to the matching local tensor.

        Returns the `PreparedRuns` a cross-memory copy of a few runs ran (None for any other copy). A
        caller that repeats the same copy (same link, remote tensors, local record and runs) may pass it
        back as `prepared`: the copy then skips the checks and building it did the first time."""
        if not segment and prepared is not None:
            local_addrs: list[int] = []
        else:
            local_addrs = local.tensor_addrs()[local_tensor_start : local_tensor_start + len(remote_bases)]
            for run in runs:
                if run.local_offset + run.nbytes > local.tensor_nbytes:
                    raise StatusError(
                        LLMStatusCode.LLM_PARAM_INVALID, "the transfer does not fit the local tensors"
                    )
        if link.peer.remote:
            # Another host: segment offsets (or registered addresses) become addresses there, for its engine.
            assert deadline is not None, "a transfer with a remote peer is always resolved, with a deadline"
            (segment_base,) = self._segment_bases(link, [segment], deadline) if segment else (0,)
            self._remote_copy(
                link,
                local,
                [addr + run.local_offset for addr in local_addrs for run in runs],
                [segment_base + base + run.remote_offset for base in remote_bases for run in runs],
                [run.nbytes for _ in remote_bases for run in runs],
                write=to_remote,
                deadline=deadline,
            )
            return None
        if not segment:
            # The peer's registered memory: one kernel copy between the two address spaces.
            if pid != link.peer.pid:
                raise StatusError(
                    LLMStatusCode.LLM_FAILED, f"peer {link.peer.pid} named memory of process {pid}"
                )
            try:
                if prepared is not None:
                    prepared()
                elif len(runs) * len(remote_bases) <= FEW_RUNS:  # `_vm`'s ctypes fast path
                    vm_runs = [
                        VmRun(addr + run.local_offset, base + run.remote_offset, run.nbytes)
                        for addr, base in zip(local_addrs, remote_bases, strict=True)
                        for run in runs
                    ]
                    prepared = PreparedRuns(pid, vm_runs, write=to_remote)
                    prepared()
                else:
                    # Many runs (a block table): numpy columns, split over the copy threads by bytes.
                    columns = vm_columns(
                        local_addrs,
                        [run.local_offset for run in runs],
                        remote_bases,
                        [run.remote_offset for run in runs],
                        [run.nbytes for run in runs],
                    )
                    self.copier.run_vm(pid, *columns, write=to_remote)
            except VmNotPermitted as exc:
                raise StatusError(
                    LLMStatusCode.LLM_FAILED, f"cross-memory attach to pid {pid} refused: {exc}"
                ) from exc
            except VmError as exc:
                # The peer died (or is exiting, its memory already unmapped): a link failure, noticed
                # here before the socket said so.
                if isinstance(exc, VmProcessGone) or not _process_alive(pid):
                    raise _peer_ended(link, exc) from exc
                error = RangeUnmapped if isinstance(exc, VmBadAddress) else StatusError
                raise error(
                    LLMStatusCode.LLM_PARAM_INVALID, f"cross-memory copy with pid {pid} failed: {exc}"
                ) from exc
            return prepared
        mapped = self._peer_segment(link, segment, segment_nbytes, writable=to_remote)
        if local.block is not None:
            local_array = local.block.segment.array
            local_bases = [local.tensor_offset(local_tensor_start + i) for i in range(len(remote_bases))]
        else:
            low = min(local_addrs)
            local_array = address_view(low, max(local_addrs) + local.tensor_nbytes - low)
            local_bases = [addr - low for addr in local_addrs]
        copy_runs = [
            Run(base + run.remote_offset, local_base + run.local_offset, run.nbytes)
            if not to_remote
            else Run(local_base + run.local_offset, base + run.remote_offset, run.nbytes)
            for base, local_base in zip(remote_bases, local_bases, strict=True)
            for run in runs
        ]
        if to_remote:
            self.copier.run(copy_runs, local_array, mapped.array)
        else:
            self.copier.run(copy_runs, mapped.array, local_array)
        return None

    # ------------------------------------------------------------------ two-sided links (v2 `link`)

    def peer_linked(self, peer: PeerInfo) -> None:
        """Server thread: a peer completed its handshake (see `Comms.peer_linked`)."""
        self.comms.peer_linked(peer)

    def drop_peer(self, remote_cluster_id: int) -> bool:
        """Server side of an unlink: close every connection from `remote_cluster_id` and our link back."""
        dropped = self.server.drop_cluster(remote_cluster_id)
        with self._links_lock:
            link = self._push_links.pop(remote_cluster_id, None)
        if link is not None:
            link.close(say_bye=True)
        return dropped or link is not None

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Release everything, in an order that lets every transfer in flight end as it would: ours (on
        other threads: they hold local pins) before our links close and our pools go, and peers' (their
        leases and pins on our memory) before our memory goes; each wait bounded by `drain_s`. A peer's pin
        that outlives it is revoked: its transfer fails."""
        deadline = time.monotonic() + self.drain_s
        with self._links_lock:
            self._closed = True
            self.comms.stop_all()
            links = list(self._links.values())
            self._links.clear()
            links += list(self._push_links.values())
            self._push_links.clear()
        if not self.table.wait_for_local_pins(self.drain_s):
            log.warning("finalizing while transfers of this process still run on other threads")
        for link in links:
            link.close(say_bye=True)  # a link a transfer still holds closes when that transfer ends
        self.server.close(drain_s=max(deadline - time.monotonic(), 0.0))
        if not self.table.wait_for_pins(max(deadline - time.monotonic(), 0.0)):
            log.warning("finalizing while peers still pin caches of this process: their transfers fail")
        self.copier.close()
        if self._engine is not None:
            # A transfer that outlived its call may still write into our pool: not before it ended.
            self._engine.drain()
        self.leases.close()
        self.table.close()
        with self._remote_lock:
            exposed, self._exposed = self._exposed, {}
        if self._engine is not None:
            for addr in exposed:  # registered memory goes back to the user out of the engine's reach
                self._engine.unregister(addr)
        # The hooks are bound methods of this Core: without them no cycle keeps a finalized Core (and what
        # it held) alive until the next full garbage collection.
        self.table.on_unregistered = None
        for pool in self.table.pools():
            pool.on_release = None

    @property
    def drain_s(self) -> float:
        """How long `close` waits, in all, for transfers in flight (ours and peers') to end."""
        return self.sync_kv_timeout_s + 1.0


# ====================================================================== cache-manager (v2) transfers


@dataclass(frozen=True)
class RemoteCache:
    """Where a peer's cache is: tensor bases as segment offsets, or as addresses in process `pid` when
    `segment` is "" (memory the peer registered)."""

    cache_id: int
    is_blocks: bool
    pid: int
    segment: str
    segment_nbytes: int
    tensor_bases: tuple[int, ...]
    unit_nbytes: int
    num_units: int
    generations: str
    gen_slot: int
    generation: int


@dataclass
class RemoteTable:
    """A peer's remote-accessible caches, fetched once per link (as the real library caches it), with the
    version word it was fetched at (0: unknown, refetch before trusting its model ids)."""

    caches: dict[int, RemoteCache]
    blocks: dict[int, int]
    generations: str = ""
    version: int = 0


@dataclass(frozen=True)
class UnitRun:
    """`nbytes` between byte `remote_offset` of a remote tensor and byte `local_offset` of the matching
    local tensor; the same runs apply to every tensor of a transfer."""

    remote_offset: int
    local_offset: int
    nbytes: int


# x86-64 never reorders a load with an earlier load, so the copy's loads are done before the generation
# word is read. Weakly ordered CPUs (aarch64) may read the word first: there a lock's release followed by
# an acquire sits between them (a store-release is never reordered with a later load-acquire, and neither
# with the loads on its side), which is the barrier CPython can place without compiled code.
_STRONGLY_ORDERED = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}
_FENCE = threading.Lock()


def _order_loads() -> None:
    if _STRONGLY_ORDERED:
        return
    with _FENCE:
        pass
    with _FENCE:
        pass


def _peer_ended(link: ClientLink, cause: Exception) -> PeerGone:
    """Break `link` because its peer's process ended; the error to raise (from `cause`)."""
    link.fail(f"process {link.peer.pid} is gone")
    return PeerGone(f"cluster {link.peer.cluster_id} (pid {link.peer.pid}) is gone: {cause}")


class RangeUnmapped(StatusError):
    """A cross-memory copy met an address range that is not mapped (on either side)."""


def _add_table_page(reply: Table, caches: dict[int, RemoteCache], blocks: dict[int, int]) -> None:
    for entry in reply.entries:
        # The protocol validated every entry's shape and ranges; this only restores the types.
        cache_id, is_blocks, model_ids, segment, segment_nbytes, bases, unit, units, slot, gen = cast(
            tuple[int, bool, tuple[int, ...], str, int, tuple[int, ...], int, int, int, int], entry
        )
        caches[cache_id] = RemoteCache(
            cache_id,
            is_blocks,
            reply.pid,
            segment,
            segment_nbytes,
            bases,
            unit,
            units,
            reply.generations,
            slot,
            gen,
        )
        for model_id in model_ids:
            blocks[model_id] = cache_id


def _process_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
