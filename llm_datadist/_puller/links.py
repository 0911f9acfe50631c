"""The links of one initialised instance: those it made (one per remote cluster) and those back to peers
that linked to it (to push into their memory), each held as the puller's `Peer` of it, and how bytes move
on each.

Rules: one lock guards both registries (`lock`; the two-sided links of `_comm` keep their state under it
too). A peer's mover is chosen once, when its link is made (`Peer.mover`): `HostMover` through a Unix
socket, a peer on this host; `EngineMover` over TCP, a peer on another host; no transfer asks again. A
link the registry no longer holds is closed by whoever removed it; once `closed`, no link is added.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from llm_datadist._protocol.messages import Ping, Pong

from .._errors import PeerGone, StatusError
from .._runtime import ENV_RUNTIME_DIR, is_local_ip, socket_path, socket_path_in_runtime
from .._wire.client import ClientLink
from .._wire.server import Server
from ..status import LLMStatusCode
from ..utils.log import log
from .crosshost import CrossHost
from .movers import EngineMover, HostMover
from .peer import Peer

# Per process: links we made (one per remote cluster).
MAX_LINKS = 512


class Links:
    """Our links, by remote cluster id, and the links back to peers that linked to us."""

    def __init__(
        self,
        *,
        cluster_id: int,
        incarnation: int,
        callback_name: str,
        server: Server,
        cross: CrossHost,
        host_mover: HostMover,
        engine_mover: EngineMover,
        on_broken: Callable[[ClientLink], None],
        timeout_s: float,
        on_linked: Callable[[ClientLink], None] | None = None,
    ) -> None:
        self._cluster_id = cluster_id
        self._incarnation = incarnation
        self._callback_name = callback_name
        self._server = server
        self._cross = cross
        self._host_mover = host_mover
        self._engine_mover = engine_mover
        self._on_broken = on_broken
        self._on_linked = on_linked
        self._timeout_s = timeout_s
        self.lock = threading.Lock()
        self.closed = False
        self._links: dict[int, Peer] = {}
        # Links back to peers that linked to us, used to push into their memory; keyed by cluster id.
        self._push_links: dict[int, Peer] = {}
        self._push_connect_lock = threading.Lock()

    # ----------------------------------------------------------------- making links

    def connect_unix(
        self, path: Path, remote_cluster_id: int, deadline: float, *, announce_callback: bool = True
    ) -> Peer:
        """A link through the Unix socket at `path` (see `ClientLink.connect`); `announce_callback`: tell
        the peer our callback socket (not on a link that is itself the way back)."""
        link = ClientLink.connect(
            path,
            cluster_id=self._cluster_id,
            remote_cluster_id=remote_cluster_id,
            role=self._server.role,
            deadline=deadline,
            callback=self._callback_name if announce_callback else "",
            incarnation=self._incarnation,
        )
        return Peer(link, self._host_mover)

    def connect_tcp(
        self,
        remote_cluster_id: int,
        ip: str,
        port: int,
        deadline: float,
        local_ip: str = "",
        *,
        serve_callback: bool = True,
    ) -> Peer:
        """A link over TCP to a peer on another host (see `ClientLink.connect_tcp`), from `local_ip` when
        that is one of ours. `serve_callback`: announce a TCP port of ours the peer may push through (not
        on a link that is itself the way back)."""
        secret = self._cross.require(f"{ip} is on another host and ")
        link = ClientLink.connect_tcp(
            ip,
            port,
            secret=secret,
            local_ip=local_ip if local_ip and is_local_ip(local_ip) and local_ip != "0.0.0.0" else "",
            engine=lambda our_ip: self._cross.engine(our_ip).address,
            callback_port=self._cross.tcp_callback_port if serve_callback else lambda our_ip: 0,
            cluster_id=self._cluster_id,
            remote_cluster_id=remote_cluster_id,
            role=self._server.role,
            deadline=deadline,
            incarnation=self._incarnation,
        )
        return Peer(link, self._engine_mover)

    def link(
        self, remote_cluster_id: int, ip: str, port: int, deadline: float, local_ip: str = ""
    ) -> LLMStatusCode:
        """Link to the side listening at `ip:port`; every failure is a returned code, said in the log.

        How an address is resolved: a side of this user on this host that listens at `ip:port` (its Unix
        socket in the runtime directory) is linked through that socket, whatever the ip (a device ip
        copied from a real deployment's config works on one host); an ip of this host with nobody
        listening fails there; any other ip is a peer on another host, linked over TCP from `local_ip`
        when that is one of ours (the shared secret and Mooncake Transfer Engine are needed)."""
        self._server.check_alive()
        with self.lock:
            if remote_cluster_id in self._links:
                return LLMStatusCode.LLM_ALREADY_LINK
            if len(self._links) >= MAX_LINKS:
                log.error("link to cluster %d refused: %d links is the limit", remote_cluster_id, MAX_LINKS)
                return LLMStatusCode.LLM_LINK_FAILED
        where = f"link to cluster {remote_cluster_id} at {ip}:{port} failed"
        try:
            link = self._connect(remote_cluster_id, ip, port, deadline, local_ip)
        except StatusError as exc:
            log.error("%s: %s", where, exc.detail)
            return exc.code
        except Exception as exc:
            log.error("%s: %s", where, exc)
            return LLMStatusCode.LLM_LINK_FAILED
        with self.lock:
            refused = (
                LLMStatusCode.LLM_ALREADY_LINK
                if remote_cluster_id in self._links
                else LLMStatusCode.LLM_FAILED
                if self.closed
                else None
            )
            if refused is None:
                self._adopt(remote_cluster_id, link)
        if refused is not None:
            link.close(say_bye=True)
            return refused
        return LLMStatusCode.LLM_SUCCESS

    def _connect(self, remote_cluster_id: int, ip: str, port: int, deadline: float, local_ip: str) -> Peer:
        """The link `link` resolves `ip:port` to (its docstring says how); StatusError when it fails."""
        path = socket_path(ip, port)
        here = is_local_ip(ip)
        nobody = (
            f"nobody listens at {ip}:{port} on this host yet (no socket {path}): start the listening side "
            f"first, with listen_ip_info {ip}:{port} and the same runtime directory ({ENV_RUNTIME_DIR}), "
            "then link again"
        )
        if here or path.exists():
            try:
                return self.connect_unix(path, remote_cluster_id, deadline)
            except StatusError as exc:
                gone = isinstance(exc.__cause__, ConnectionRefusedError | FileNotFoundError)
                if here and gone:
                    raise StatusError(LLMStatusCode.LLM_LINK_FAILED, nobody) from exc
                # A socket nobody serves any more, named after an address of another host: try that host.
                if here or not gone:
                    raise
        try:
            self._cross.require("")
        except StatusError as exc:  # this process cannot reach other hosts: the one-host case comes first
            raise StatusError(
                LLMStatusCode.LLM_LINK_FAILED,
                f"{nobody}. If the peer is on another host ({ip} is not an address of this one): "
                f"{exc.detail}",
            ) from exc
        return self.connect_tcp(remote_cluster_id, ip, port, deadline, local_ip)

    def adopt(self, remote_cluster_id: int, link: Peer) -> None:
        """Hold a link made elsewhere (a two-sided link of `_comm`); the caller holds `lock` and checked
        that the cluster has no link and the registry is not closed."""
        self._adopt(remote_cluster_id, link)

    def _adopt(self, remote_cluster_id: int, link: Peer) -> None:
        self._links[remote_cluster_id] = link
        link.link.on_broken = self._on_broken
        if self._on_linked is not None:
            self._on_linked(link.link)

    # ----------------------------------------------------------------- looking links up

    def has(self, remote_cluster_id: int) -> bool:
        """Whether we hold a link to `remote_cluster_id` (the caller holds `lock`)."""
        return remote_cluster_id in self._links

    def held(self, cluster_ids: list[int]) -> list[Peer]:
        """The links we hold to those of `cluster_ids` we are linked to (the caller holds `lock`)."""
        return [self._links[c] for c in cluster_ids if c in self._links]

    def forget(self, remote_cluster_id: int) -> Peer | None:
        """Stop holding our link to `remote_cluster_id` (the caller holds `lock`, and closes it)."""
        return self._links.pop(remote_cluster_id, None)

    def get(self, remote_cluster_id: int) -> Peer:
        """Our link to `remote_cluster_id`; StatusError(LLM_NOT_YET_LINK) if there is none."""
        if self._server.failure is not None:
            self._server.check_alive()
        link = self._links.get(remote_cluster_id)  # one look: writers change the registry under `lock`
        if link is None:
            raise StatusError(LLMStatusCode.LLM_NOT_YET_LINK, f"no link to cluster {remote_cluster_id}")
        return link

    def clusters(self) -> list[int]:
        with self.lock:
            return list(self._links)

    def all(self) -> list[Peer]:
        with self.lock:
            return list(self._links.values()) + list(self._push_links.values())

    def link_to(self, remote_cluster_id: int, deadline: float) -> Peer:
        """A link to `remote_cluster_id`: ours if we linked to it, else the link back to its callback socket
        when it linked to us (in v2 either side may pull and push)."""
        if self._server.failure is not None:
            self._server.check_alive()
        with self.lock:
            link = self._links.get(remote_cluster_id)
        return link if link is not None else self.push_link(remote_cluster_id, deadline)

    def unlink(self, remote_cluster_id: int, *, force: bool) -> LLMStatusCode:
        with self.lock:
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

    def check(self, remote_cluster_id: int) -> None:
        """A round trip on our link to `remote_cluster_id` (busy: LLM_LINK_BUSY at once)."""
        link = self.get(remote_cluster_id)
        deadline = time.monotonic() + self._timeout_s
        with link.exclusive(deadline, busy_fails=True):
            seq = link.next_seq()
            reply = link.request(Ping(seq), seq, deadline)
            if not isinstance(reply, Pong):
                raise PeerGone(f"expected Pong, got {type(reply).__name__}")

    # ----------------------------------------------------------------- links back

    def push_link(self, remote_cluster_id: int, deadline: float) -> Peer:
        """The link back to `remote_cluster_id` (a peer linked to us), connected on first use."""
        # One connector at a time: two transfers must not each connect and close the other's link.
        self._server.check_alive()
        with self._push_connect_lock:
            return self._push_link(remote_cluster_id, deadline)

    def _push_link(self, remote_cluster_id: int, deadline: float) -> Peer:
        # The most recent connection from that cluster that announced a callback socket: after a restart,
        # the new incarnation's (a connection without one, such as a probe, is no way back).
        peers = [p for p in self._server.peers() if p.cluster_id == remote_cluster_id]
        peer = next((p for p in reversed(peers) if p.callback), peers[-1] if peers else None)
        with self.lock:
            link = self._push_links.get(remote_cluster_id)
        if (
            link is not None
            and link.broken is None
            and (peer is None or link.info.incarnation == peer.incarnation)
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
        if link.info.incarnation != peer.incarnation or (not peer.remote and link.info.pid != peer.pid):
            link.close(say_bye=True)
            raise StatusError(
                LLMStatusCode.LLM_LINK_FAILED, "the callback socket is served by another process"
            )
        link.link.on_broken = self._on_broken
        with self.lock:
            old = self._push_links.pop(remote_cluster_id, None)
            self._push_links[remote_cluster_id] = link
        if old is not None:
            old.close(say_bye=False)
        return link

    def drop_push_link(self, remote_cluster_id: int) -> bool:
        """Close our link back to `remote_cluster_id`, if any; True if there was one."""
        with self.lock:
            link = self._push_links.pop(remote_cluster_id, None)
        if link is not None:
            link.close(say_bye=True)
        return link is not None

    # ----------------------------------------------------------------- housekeeping and teardown

    def unmap_retired(self) -> None:
        """Unmap the segments peers have retired (a growing pool unlinks a segment that fell empty), so that
        no freed memory stays alive through our mappings."""
        for peer in self.all():
            peer.unmap_retired()

    def abandon(self) -> None:
        """In a forked child: every link's copy of its socket and index closed, nothing said to a peer."""
        self.closed = True
        for link in list(self._links.values()) + list(self._push_links.values()):
            link.abandon()
        self._links.clear()
        self._push_links.clear()

    def close_all(self, before: Callable[[], None]) -> list[Peer]:
        """No more links: every link is taken out of the registries (`before` runs first, under the
        lock); the caller closes them."""
        with self.lock:
            self.closed = True
            self._on_broken = _ignore  # a bound method of our owner: no cycle outlives the close
            before()
            links = list(self._links.values()) + list(self._push_links.values())
            self._links.clear()
            self._push_links.clear()
        return links


def _ignore(link: ClientLink) -> None:
    return None
