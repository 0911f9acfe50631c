"""Two-sided links (v2 `link(comm_name, cluster_rank_info)`, `unlink`, `query_register_mem_status`).

Rules: `Comms` belongs to one `Core` and keeps only the communicators' own state; the links a communicator
makes are the core's links (`Core.links`, under `Links.lock`, which also guards this state), so
`pull`, `unlink` and `close` treat them like any other. Each member serves on a rendezvous socket named
after the communicator and its rank, and, when the rank table puts it on a server ip of another host than
some member's, on TCP at that ip and `HCCL_IF_BASE_PORT` + its rank; a background thread connects to the
others (over TCP to a member on another host) until all are linked.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ._errors import StatusError
from ._rank_table import RankTable
from ._runtime import SHARED_NAMES_HINT, is_local_ip, socket_path_in_runtime
from ._signals import held
from ._wire.peer import PeerInfo
from .status import LLMStatusCode
from .utils.log import log

if TYPE_CHECKING:
    from ._core import Core

# Per process: two-sided communicators open at once.
MAX_COMMS = 512
# A member on another host serves its rendezvous over TCP at its rank table server ip and this base port
# plus its rank (HCCL's variable for the first port it listens on; HCCL's default).
ENV_BASE_PORT = "HCCL_IF_BASE_PORT"
DEFAULT_BASE_PORT = 60000

COMM_OK, COMM_PREPARING, COMM_FAILED = 0, 1, 2  # RegisterMemStatus values


@dataclass(eq=False)
class Comm:
    """One two-sided link (`link()`): its members, rendezvous socket and progress."""

    comm_id: int
    name: str
    members: dict[int, int]
    path: Path
    deadline: float
    # Each member's server ip from the rank table ("" where it is on this host) and our TCP rendezvous.
    hosts: dict[int, str] = field(default_factory=dict)
    tcp: tuple[str, int] | None = None
    status: int = COMM_PREPARING
    clusters: set[int] = field(default_factory=set)
    # Members that have connected to us (any socket) since the comm began.
    incoming: set[int] = field(default_factory=set)
    stop: threading.Event = field(default_factory=threading.Event)


class Comms:
    """The two-sided links of one `Core` (`core.comms`), by comm id."""

    def __init__(self, core: Core) -> None:
        # Weak: the core owns this, and a cycle would keep a finalized core alive until a full collection.
        self._core_ref = weakref.ref(core)
        self._comms: dict[int, Comm] = {}
        self._next_comm_id = 1
        # Set once a two-sided link() was made: memory registered later defaults to remote_accessible=False.
        self.two_sided_links_made = False

    @property
    def _core(self) -> Core:
        core = self._core_ref()
        assert core is not None, "the core of these links is gone"
        return core

    def link(self, comm_name: str, members: dict[int, int], table: RankTable | None = None) -> int:
        """Start a two-sided link: serve on this member's rendezvous socket (and TCP port, with members on
        other hosts) and, in the background, connect to every other member's until all are linked (status
        OK) or the link time runs out (FAILED)."""
        core = self._core
        core.server.check_alive()
        own = members.get(core.settings.cluster_id)
        if own is None:
            raise StatusError(
                LLMStatusCode.LLM_PARAM_INVALID, "cluster_rank_info must contain this cluster's id"
            )
        own_ip = _server_ip(table, own)
        # Across hosts only when the table puts us on an address of this host: a table of some other
        # cluster (an Ascend one, copied) describes no host here, and all members are taken to be local.
        hosts = (
            _member_hosts(members, table) if own_ip and is_local_ip(own_ip) else dict.fromkeys(members, "")
        )
        digest = hashlib.sha1(comm_name.encode()).hexdigest()[:16]
        path = socket_path_in_runtime(f"comm-{digest}-r{own}.sock")
        try:
            core.server.listen(path)
        except FileExistsError as exc:
            raise StatusError(
                LLMStatusCode.LLM_LINK_FAILED,
                f"rank {own} of {comm_name!r} is taken: {exc}; {SHARED_NAMES_HINT}",
            ) from exc
        tcp: tuple[str, int] | None = None
        if any(hosts.values()):
            # Some member is on another host: it reaches us at our server ip.
            tcp = (own_ip, _rendezvous_port(own))
            try:
                core.listen_tcp(*tcp)
            except StatusError:
                core.server.unlisten(path)
                raise
        total_s = core.settings.link_total_time_s or int(os.environ.get("HCCL_CONNECT_TIMEOUT", "120"))
        with core.links.lock:
            full = len(self._comms) >= MAX_COMMS or core.links.closed
            if not full:
                comm = Comm(
                    self._next_comm_id,
                    comm_name,
                    dict(members),
                    path,
                    time.monotonic() + total_s,
                    hosts=hosts,
                    tcp=tcp,
                )
                self._next_comm_id += 1
                self._comms[comm.comm_id] = comm
        if full:
            core.server.unlisten(path)
            if tcp is not None:
                core.server.unlisten(tcp)
            raise StatusError(LLMStatusCode.LLM_FAILED, f"{MAX_COMMS} open link() communicators is the limit")
        # Members that connected before the comm was recorded (the hook only sees later ones).
        connected = {peer.cluster_id for peer in core.server.peers()}
        with core.links.lock:
            comm.incoming |= connected & set(members)
        self.two_sided_links_made = True
        others = {cluster: rank for cluster, rank in members.items() if cluster != core.settings.cluster_id}
        thread = threading.Thread(
            target=self._connect,
            args=(comm, others, digest),
            name=f"llmdd-link-{comm.comm_id}",
            daemon=True,
        )
        with held():  # SIGTERM and SIGINT are the program's main thread's (`_signals`)
            thread.start()
        return comm.comm_id

    def peer_linked(self, peer: PeerInfo) -> None:
        """Server thread: a peer completed its handshake; two-sided links count it as linked to us."""
        with self._core.links.lock:
            for comm in self._comms.values():
                if peer.cluster_id in comm.members:
                    comm.incoming.add(peer.cluster_id)

    def _connect(self, comm: Comm, others: dict[int, int], digest: str) -> None:
        """Connect to every other member; the link is OK once that is done and every other member has
        connected to us too, as the real link is a collective that completes for all members at once
        (so no member sees OK, pulls and unlinks while another is still coming up)."""
        core = self._core
        pending = dict(others)
        while not comm.stop.is_set():
            for cluster_id, rank in list(pending.items()):
                with core.links.lock:
                    if core.links.has(cluster_id):
                        del pending[cluster_id]
                        continue
                deadline = min(comm.deadline, time.monotonic() + 5.0)
                host = comm.hosts.get(cluster_id, "")
                try:
                    if host:
                        link = core.links.connect_tcp(cluster_id, host, _rendezvous_port(rank), deadline)
                    else:
                        path = socket_path_in_runtime(f"comm-{digest}-r{rank}.sock")
                        if not path.exists():
                            continue
                        link = core.links.connect_unix(path, cluster_id, deadline)
                except StatusError as exc:
                    log.info("link %r: rank %d not reachable yet: %s", comm.name, rank, exc.detail)
                    continue
                with core.links.lock:
                    # unlink or close may have run while we connected: then the link is not wanted.
                    keep = (
                        not core.links.closed
                        and not comm.stop.is_set()
                        and self._comms.get(comm.comm_id) is comm
                        and not core.links.has(cluster_id)
                    )
                    if keep:
                        core.links.adopt(cluster_id, link)
                        comm.clusters.add(cluster_id)
                if not keep:
                    link.close(say_bye=True)
                    if comm.stop.is_set():
                        return
                del pending[cluster_id]
            with core.links.lock:
                missing = sorted(set(pending) | (set(others) - comm.incoming))
            if not missing:
                comm.status = COMM_OK
                return
            if time.monotonic() >= comm.deadline:
                comm.status = COMM_FAILED
                log.error("link %r: members %s never came up", comm.name, missing)
                return
            comm.stop.wait(0.02)

    def status(self, comm_id: int) -> int:
        with self._core.links.lock:
            comm = self._comms.get(comm_id)
        if comm is None:
            raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"no link with comm_id {comm_id}")
        return comm.status

    def unlink(self, comm_id: int) -> None:
        core = self._core
        with core.links.lock:
            comm = self._comms.get(comm_id)
            if comm is None:
                raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"no link with comm_id {comm_id}")
            links = core.links.held(sorted(comm.clusters))
        for link in links:
            with link.exclusive(0.0, busy_fails=True):
                pass
        with core.links.lock:
            del self._comms[comm_id]
            for cluster_id in comm.clusters:
                core.links.forget(cluster_id)
        comm.stop.set()
        core.server.unlisten(comm.path)
        if comm.tcp is not None:
            core.server.unlisten(comm.tcp)
        for link in links:
            link.close(say_bye=True)
        # The members' links to us belong to the same communicator: they go too.
        for cluster_id in comm.members:
            if cluster_id != core.settings.cluster_id:
                core.drop_peer(cluster_id)

    def stop_all(self) -> None:
        """`Core.close`, with `Links.lock` held: every connecting thread stops."""
        for comm in self._comms.values():
            comm.stop.set()


def _server_ip(table: RankTable | None, rank: int) -> str:
    """The rank table's server ip of `rank`, when it names one (a server_id that is an IPv4 address)."""
    device = table.device(rank) if table is not None else None
    if device is None:
        return ""
    try:
        socket.inet_aton(device.server_id)
    except OSError:
        return ""
    return device.server_id if device.server_id.count(".") == 3 else ""


def _member_hosts(members: dict[int, int], table: RankTable | None) -> dict[int, str]:
    """Each member's server ip when it is on another host (not one of our addresses), else ""."""
    hosts = {}
    for cluster_id, rank in members.items():
        ip = _server_ip(table, rank)
        hosts[cluster_id] = ip if ip and not is_local_ip(ip) else ""
    return hosts


def _rendezvous_port(rank: int) -> int:
    """Where a member on another host serves its rendezvous: `HCCL_IF_BASE_PORT` (default 60000) + rank."""
    text = os.environ.get(ENV_BASE_PORT, "")
    base = int(text) if text.isdigit() else DEFAULT_BASE_PORT
    port = base + rank
    if not 0 < port < 65536:
        raise StatusError(
            LLMStatusCode.LLM_PARAM_INVALID, f"rank {rank} has no TCP port from base {base} (over 65535)"
        )
    return port
