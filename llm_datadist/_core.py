"""One initialised `LLMDataDist`: its options, pools and cache table, its server and its links.

Rules: `Core` owns every resource of an initialised instance, makes its parts in order and releases all of
them in `close` (links said goodbye to, server stopped and its socket unlinked, segments unlinked). The public
classes validate arguments and translate errors; the parts do the work. A pull holds its link exclusively,
pins its local destination, pins the source in the owner's published index or asks it for a lease
(`_puller.acquire`), and its link's mover copies straight from the peer's memory into it (`_puller.movers`):
one copy, no staging, no message. Everything learnt from a peer (its index, its one-sided table, its mapped
segments, checked segment names) belongs to the link, so to that peer's incarnation: a peer restarted at the
same address is a new link with nothing reused. Writes into a peer's memory always pin it there first, so the
owner cannot free or reuse that memory under the write."""

from __future__ import annotations

import errno
import os
import secrets
import threading
import time
from pathlib import Path

from llm_datadist._shm.index import lock_waits
from llm_datadist._shm.pool import Pool
from llm_datadist._shm.reaper import reap, unlink_own

from ._comm import Comms
from ._errors import StatusError
from ._owner.leases import Leases
from ._owner.mirror import SERVER_LOCK_TIMEOUT_S
from ._owner.pins import LocalPins
from ._owner.service import CacheService, NodeHooks
from ._owner.table import CacheTable
from ._puller.acquire import Acquirer
from ._puller.copy import Copier
from ._puller.crosshost import CrossHost
from ._puller.dataplane import settle_owed
from ._puller.links import Links
from ._puller.movers import EngineMover, HostMover, process_alive
from ._puller.oneside import OneSided
from ._puller.transfers import Transfers
from ._runtime import (
    SHARED_NAMES_HINT,
    ensure_runtime_dir,
    remove_stale_sockets,
    socket_path,
    socket_path_in_runtime,
)
from ._settings import Settings
from ._stats import LINKS_BROKEN, Stats
from ._wire.client import ClientLink
from ._wire.peer import PeerInfo
from ._wire.server import Server
from .configs import LLMRole
from .status import LLMStatusCode
from .utils.log import log

PLACEMENT_HOST = 0  # Placement.HOST
PLACEMENT_DEVICE = 1  # Placement.DEVICE

# How long a peer whose connection ended but whose process still ran is watched for its exit (to reap it).
_DEPARTED_WATCH_S = 10.0


class Core(NodeHooks):
    """All the state and resources of one initialised instance, and the order they are made and released
    in. Its parts: `table` and `leases` (the owner's side, served by `server`), `links` (ours, each with
    its mover), `transfers` and `oneside` (the puller's side), `cross` (other hosts), `comms` (v2
    two-sided links).

    Every instance serves on a private callback socket (`llmdd-<cluster id>-<pid>.sock` in the runtime
    directory), announced to each peer it links to, so that a peer can connect back and push into its
    memory; a side with `listen_ip_info` also serves on the socket named after that address.
    """

    # The role its stats segment records (None: the instance's LLMRole); a hixl engine's is its own.
    STATS_ROLE: int | None = None

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.role = settings.role
        self.forked_from: int | None = None  # the parent's pid, in a child forked after init (`abandon`)
        self.housekept = 0  # housekeeping passes begun on the server thread
        reaped = reap()
        if reaped:
            log.info("removed %d shared-memory segments left by dead processes", len(reaped))
        pools, oom_code = _pools(settings)
        # What this instance moves, for `llm-datadist stats` and `ext.stats()` (docs/metrics.md).
        role = self.STATS_ROLE if self.STATS_ROLE is not None else int(settings.role)
        self.stats = Stats.create(role=role, cluster_id=settings.cluster_id)
        self.stats.gauge_source = self._gauges
        # Drawn once per instance: peers tell a restarted process at the same address from the old one.
        self.incarnation = secrets.randbits(64) or 1
        timeout_s = self.sync_kv_timeout_s
        self.table = CacheTable(
            pools, oom_code=oom_code, incarnation=self.incarnation, lock_timeout_s=max(timeout_s, 0.1)
        )
        self.leases = Leases(self.table)
        self.pins = LocalPins(self.table)
        self.cross = CrossHost(self.table, self.pins, settings.timeout_code)
        self.public_tcp: tuple[str, int] | None = None
        for pool in pools.values():
            pool.on_release = self.cross.segment_released
        self.table.on_unregistered = self.cross.registered_released
        self.table.on_keys = self.stats.keys
        self.copier = Copier()
        self.copier.start()
        self.comms = Comms(self)
        self._pushing: dict[int, int] = {}  # cluster id -> layer-wise transfers into it (under links.lock)
        self.pull_gate = threading.Lock()
        # Peers whose connection ended while their process was still alive: pid -> until when to look.
        self._departed: dict[int, float] = {}
        self._departed_lock = threading.Lock()
        self.server = Server(
            cluster_id=settings.cluster_id,
            role=int(self.role),
            service=CacheService(self.leases, self),
            incarnation=self.incarnation,
            secret=self.cross.secret,
        )
        self.cross.listen_tcp = self.server.listen_tcp
        self.server.on_refused(self.stats.refused)
        self.callback_name = f"llmdd-{settings.cluster_id}-{os.getpid()}.sock"
        self.links = Links(
            cluster_id=settings.cluster_id,
            incarnation=self.incarnation,
            callback_name=self.callback_name,
            server=self.server,
            cross=self.cross,
            host_mover=HostMover(self.copier),
            engine_mover=EngineMover(self.cross),
            on_broken=self._link_broken,
            timeout_s=timeout_s,
            on_linked=self.stats.linked,
        )
        self.acquirer = Acquirer(settings.cluster_id, self.incarnation, settings.timeout_code)
        self.transfers = Transfers(self.links, self.acquirer, timeout_s, self.copier, self.stats)
        self.oneside = OneSided(self.links, self.acquirer, self.transfers, self.pins, timeout_s, self.stats)
        self.public_path: Path | None = None
        try:
            ensure_runtime_dir()
            stale = remove_stale_sockets()
            if stale:
                log.info("removed %d sockets left by dead processes", len(stale))
            self.server.start()
            self.server.listen(socket_path_in_runtime(self.callback_name))
            if settings.listen is not None:
                self.listen_public(settings.listen)
        except BaseException:
            self.server.close()
            self.table.close()
            self.stats.close()
            raise

    @property
    def sync_kv_timeout_s(self) -> float:
        return self.settings.sync_kv_timeout_ms / 1000.0

    @property
    def drain_s(self) -> float:
        """How long `close` waits, in all, for transfers in flight (ours and peers') to end."""
        return self.sync_kv_timeout_s + 1.0

    # ------------------------------------------------------------------ serving

    def listen_public(self, listen: tuple[str, int]) -> None:
        """Serve on the Unix socket derived from `ip:port`, and, for peers on other hosts, on TCP at
        `ip:port` itself when `ip` is not a loopback address and a shared secret is configured."""
        path = socket_path(*listen)
        try:
            self.server.listen(path)
        except FileExistsError as exc:
            raise StatusError(
                LLMStatusCode.LLM_FAILED, f"{listen[0]}:{listen[1]} is taken: {exc}; {SHARED_NAMES_HINT}"
            ) from exc
        self.public_path = path
        ip, port = listen
        if ip.startswith("127."):
            return
        if self.cross.secret is None:
            # No secret is how one host runs; a secret that is set but unusable is a mistake to shout about.
            say = log.error if self.cross.secret_unusable else log.info
            say("not serving other hosts at %s:%d: %s", ip, port, self.cross.secret_problem)
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

    def listen_tcp(self, ip: str, port: int) -> None:
        """Serve peers on other hosts at `ip:port` too (a two-sided link's rendezvous); StatusError
        (LLM_LINK_FAILED) without a usable secret or transfer engine, or when the port is taken."""
        self.cross.require("members on other hosts: ")
        try:
            self.server.listen_tcp(ip, port)
        except OSError as exc:
            raise StatusError(
                LLMStatusCode.LLM_LINK_FAILED, f"TCP {ip}:{port} cannot be served: {exc}"
            ) from exc

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

    # ------------------------------------------------------------------ what the server asks (NodeHooks)

    def is_pushing_to(self, cluster_id: int) -> bool:
        with self.links.lock:
            return self._pushing.get(cluster_id, 0) > 0

    def housekeeping(self) -> None:
        """Server thread, about twice a second."""
        self.housekept += 1  # passes begun (a process that waits for a whole pass waits for two more)
        self.links.unmap_retired()
        self.stats.publish_gauges()
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

    def peer_linked(self, peer: PeerInfo) -> None:
        """Server thread: a peer completed its handshake (see `Comms.peer_linked`)."""
        self.comms.peer_linked(peer)

    def peer_gone(self, peer: PeerInfo) -> None:
        if not peer.remote:
            self._clean_up_after(peer.pid)
        if any(other.cluster_id == peer.cluster_id for other in self.server.peers()):
            return
        self.links.drop_push_link(peer.cluster_id)

    def serve_remote(self, local_ip: str) -> str:
        return self.cross.serve_remote(local_ip)

    def segment_addresses(self, names: tuple[str, ...]) -> tuple[int, ...]:
        return self.cross.segment_addresses(names)

    def expose_ranges(self, addrs: tuple[int, ...], nbytes: int) -> None:
        self.cross.expose_ranges(addrs, nbytes)

    def _gauges(self) -> dict[str, int]:
        """The stats segment's gauges, from what this instance holds (no index lock: nothing here waits)."""
        table = self.table
        return {
            "caches": len(table.caches),
            "pool_used_bytes": sum(pool.used_nbytes for pool in table.pools()),
            "leases": self.leases.count,
            "pins": sum(record.pins for record in list(table.caches.values())),
            "links": len(self.links.all()),
            "index_lock_waits": lock_waits(),
        }

    def _link_broken(self, link: ClientLink) -> None:
        self.stats.event(LINKS_BROKEN)
        if not link.peer.remote:  # a pid on another host says nothing about this one
            self._clean_up_after(link.peer.pid)

    def _clean_up_after(self, pid: int, watch_until: float | None = None) -> None:
        """When a peer's connection ends and the peer is dead, remove what it left: its segments (the
        reaper checks every owner's pid and start time itself) and sockets nobody serves any more. A peer
        still exiting (its sockets close before it is gone) is looked at again at housekeeping, for a
        while."""
        if process_alive(pid):
            with self._departed_lock:
                self._departed[pid] = watch_until or time.monotonic() + _DEPARTED_WATCH_S
            return
        reaped = reap()
        stale = remove_stale_sockets()
        if reaped or stale:
            log.info("peer %d died: removed %d segments and %d sockets it left", pid, len(reaped), len(stale))

    # ------------------------------------------------------------------ pushes and unlinks

    def start_pushing(self, cluster_ids: set[int]) -> int | None:
        """Mark a layer-wise transfer into these clusters: their pulls from us (asked or through our
        index) get LLM_LINK_BUSY until the matching `stop_pushing`. Refused, with the cluster that is
        pulling from us now, when one is: checked and marked under the index lock, so no pin slips in."""
        busy = self.leases.start_push(cluster_ids, self.server.conns_of)
        if busy is not None:
            return busy
        with self.links.lock:
            for cluster_id in cluster_ids:
                self._pushing[cluster_id] = self._pushing.get(cluster_id, 0) + 1
        return None

    def stop_pushing(self, cluster_ids: set[int]) -> None:
        self.leases.end_push(cluster_ids)
        with self.links.lock:
            for cluster_id in cluster_ids:
                self._pushing[cluster_id] -= 1
                if not self._pushing[cluster_id]:
                    del self._pushing[cluster_id]

    def drop_peer(self, remote_cluster_id: int) -> bool:
        """Server side of an unlink: close every connection from `remote_cluster_id` and our link back."""
        dropped = self.server.drop_cluster(remote_cluster_id)
        return self.links.drop_push_link(remote_cluster_id) or dropped

    # ------------------------------------------------------------------ teardown

    def abandon(self, parent_pid: int) -> None:
        """In a child forked from this process after init: close the child's copies of the parent's
        sockets and index, and touch nothing the parent shares with its peers (no message, no unlink, no
        index write, no unpin: those are the parent's). Every later call through this instance fails with
        `_errors.FORK_HINT`; the child may init an instance of its own."""
        self.forked_from = parent_pid
        self.server.abandon()
        self.links.abandon()
        self.table.index.forget_in_child()

    def holds_lock_here(self) -> bool:
        """Whether the calling thread holds the table lock (finalize needs it, from another thread)."""
        is_owned = getattr(self.table.lock, "_is_owned", None)
        return bool(is_owned()) if is_owned is not None else False

    def last_resort(self) -> None:
        """The process is about to die without `close` (a SIGTERM whose finalize could not run): unlink the
        names it made, its listeners' socket files and its shared-memory segments, taking no lock, so that
        nothing is left for `llm-datadist gc`. Peers' mappings stay valid; their links see EOF when the
        process ends."""
        self.server.unlink_names()
        unlink_own()

    def close(self) -> None:
        """Release everything, in an order that lets every transfer in flight end as it would: ours (on
        other threads: they hold local pins) before our links close and our pools go, and peers' (their
        leases and pins on our memory) before our memory goes; each wait bounded by `drain_s`. A peer's pin
        that outlives it is revoked: its transfer fails."""
        deadline = time.monotonic() + self.drain_s
        links = self.links.close_all(before=self.comms.stop_all)
        if not self.pins.wait_for_local_pins(self.drain_s):
            log.warning("finalizing while transfers of this process still run on other threads")
        for link in links:
            link.close(say_bye=True)  # a link a transfer still holds closes when that transfer ends
        self.server.close(drain_s=max(deadline - time.monotonic(), 0.0))
        if not self.leases.wait_for_pins(max(deadline - time.monotonic(), 0.0)):
            log.warning("finalizing while peers still pin caches of this process: their transfers fail")
        self.copier.close()
        # A transfer that outlived its call may still write into our pool: not before it ended.
        self.cross.drain()
        self.leases.close()
        self.table.close()
        self.cross.close()
        # The hooks are bound methods of our parts: without them no cycle keeps a finalized Core (and what
        # it held) alive until the next full garbage collection.
        self.table.on_unregistered = None
        self.table.on_keys = None
        for pool in self.table.pools():
            pool.on_release = None
        self.stats.gauge_source = None
        self.stats.close()


def _pools(settings: Settings) -> tuple[dict[int, Pool], LLMStatusCode]:
    """The memory pools an instance allocates from, by placement, and the code it reports when one is
    exhausted (v1 has one device pool; v2 only the configured ones: registered memory needs none)."""
    pools: dict[int, Pool] = {}
    if not settings.cache_manager_mode:
        pools[PLACEMENT_DEVICE] = Pool(capacity_nbytes=settings.pool_capacity_nbytes)
        return pools, LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
    for placement, config in ((PLACEMENT_DEVICE, settings.device_pool), (PLACEMENT_HOST, settings.host_pool)):
        if config is not None:
            pools[placement] = Pool(
                capacity_nbytes=config.memory_nbytes, alignment=max(1 << config.page_shift, 4096)
            )
    return pools, LLMStatusCode.LLM_OUT_OF_MEMORY
