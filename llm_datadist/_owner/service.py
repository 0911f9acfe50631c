"""What the owner answers its peers: the one place a request read off a connection becomes a call on the
table (`leases.Leases`, `table.CacheTable`) and a reply.

Rules: the server (`_wire.server.Server`) owns connections and the handshake and hands every request of a
linked peer to `CacheService.answer`; it never sees a cache. A StatusError becomes the peer's Error reply;
IndexBusy (the index lock is held elsewhere; nothing was done) makes the server park the request and
retry it. What the rest of the process must decide (is a push into that peer running, how its engine
reaches our memory) it says through `NodeHooks`, whose defaults serve a plain table.
"""

from __future__ import annotations

import contextlib
import os

from llm_datadist._protocol.messages import (
    MAX_TABLE_ENTRIES,
    RULES_V1,
    Ack,
    Addresses,
    AddressRequest,
    Message,
    Notify,
    PinRequest,
    Table,
    TableRequest,
    WriteRequest,
)

from .._errors import StatusError
from .._wire.peer import PeerInfo
from ..status import LLMStatusCode
from .leases import Leases
from .mirror import SERVER_LOCK_TIMEOUT_S
from .records import CacheRecord
from .rows import Holder

# A page of the one-sided table stays well under the frame limit.
_TABLE_PAGE_NBYTES = 512 << 10


class NodeHooks:
    """What the owner's service and server ask of the rest of the process; the defaults serve a plain
    cache table (no pushes, no peers on other hosts)."""

    # Held while a pull is checked against `is_pushing_to` and granted, so that a transfer that starts
    # pushing (under the same gate) never overlaps a pull granted in between.
    pull_gate: contextlib.AbstractContextManager[object] = contextlib.nullcontext()

    def is_pushing_to(self, cluster_id: int) -> bool:
        """True while this process pushes into `cluster_id`'s memory (a pull on that link is then busy)."""
        return False

    def peer_gone(self, peer: PeerInfo) -> None:
        """Called on the server thread after a linked peer's connection closed."""

    def housekeeping(self) -> None:
        """Called on the server thread about twice a second (and never per message)."""

    def peer_linked(self, peer: PeerInfo) -> None:
        """Called on the server thread when a peer completed its handshake."""

    def serve_remote(self, local_ip: str) -> str:
        """A peer on another host proved itself (it reached us at `local_ip`): our transfer engine's address
        for its Welcome (started on first use). StatusError when this side cannot move bytes across hosts
        (the peer is told why)."""
        raise StatusError(LLMStatusCode.LLM_LINK_FAILED, "this side serves no peers on other hosts")

    def expose_ranges(self, addrs: tuple[int, ...], nbytes: int) -> None:
        """Make [addr, addr + nbytes) of each of `addrs` (registered memory a remote peer was just granted)
        reachable by our transfer engine; StatusError if it cannot be."""
        raise StatusError(LLMStatusCode.LLM_FAILED, "no memory is served across hosts")

    def segment_addresses(self, names: tuple[str, ...]) -> tuple[int, ...]:
        """Where our segments `names` are mapped, registered with our transfer engine (a remote peer's
        AddressRequest); StatusError for a name that is not one of our live segments."""
        raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, "no segments are served across hosts")

    def notified(self, peer: PeerInfo, name: str, message: str) -> None:
        """A linked peer's notify (a HIXL engine's `send_notify`): keep it for this side's application, or
        StatusError when this side keeps none (a plain `llm_datadist` instance) or no more from the peer."""
        raise StatusError(LLMStatusCode.LLM_FEATURE_NOT_ENABLED, "this side keeps no notifies")


class CacheService:
    """Serves one process's table to its peers' connections (`conn`: the server's token for one)."""

    def __init__(self, leases: Leases, hooks: NodeHooks | None = None) -> None:
        self.leases = leases
        self.table = leases.table
        self.hooks = hooks or NodeHooks()

    # ----------------------------------------------------------------- connections

    def admit(self, conn: object, peer: PeerInfo) -> tuple[str, int, int]:
        """A peer on this host completed its handshake: the index it pins in, its row and the ticket
        naming the connection there ("" when no row is free: it asks us for everything)."""
        row, ticket = self.leases.assign_row(conn, peer.incarnation, Holder.of(peer.pid))
        return (self.table.index.name, row, ticket) if row >= 0 else ("", 0, 0)

    def holds_leases(self, conn: object) -> bool:
        return self.leases.holds(conn)

    def connection_ended(self, conn: object, released: frozenset[int]) -> None:
        self.leases.connection_ended(conn, released)

    def release(self, conn: object, lease_id: int, ok: bool) -> None:
        """A one-way Release. IndexBusy: nothing done, ask again; StatusError: not this connection's."""
        self.leases.release(lease_id, ok=ok, owner=conn)

    # ----------------------------------------------------------------- requests

    def answer(self, conn: object, peer: PeerInfo, msg: Message) -> Message:
        """The reply to one request of a linked peer."""
        leases = self.leases
        if isinstance(msg, PinRequest):
            if msg.rules == RULES_V1:
                with self.hooks.pull_gate:
                    if self.hooks.is_pushing_to(peer.cluster_id):
                        raise StatusError(
                            LLMStatusCode.LLM_LINK_BUSY, "a layer-wise transfer into this cluster is running"
                        )
                    return leases.resolve(msg, conn)
            location = leases.resolve(msg, conn)
            if peer.remote and not location.segment:
                # Registered memory: its engine reaches it only once it is registered there.
                try:
                    self.hooks.expose_ranges(location.tensor_bases, location.unit_nbytes * location.num_units)
                except StatusError:
                    leases.release_soon(location.lease_id, ok=False, owner=conn)
                    raise
            return location
        if isinstance(msg, WriteRequest):
            return leases.resolve_write(msg, conn)
        if isinstance(msg, TableRequest):
            return self._table_page(msg)
        if isinstance(msg, Notify):
            self.hooks.notified(peer, msg.name, msg.message)
            return Ack(msg.seq)
        if isinstance(msg, AddressRequest):
            if not peer.remote:
                raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, "a peer on this host maps segments itself")
            return Addresses(msg.seq, self.hooks.segment_addresses(msg.names))
        raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"unexpected {type(msg).__name__}")

    def _table_page(self, msg: TableRequest) -> Table:
        """The page of the table that starts at cache id `msg.start_cache_id`: as many entries as fit in
        `_TABLE_PAGE_NBYTES` and `MAX_TABLE_ENTRIES` (at least one), and where the next page starts."""
        entries: list[tuple[object, ...]] = []
        page_nbytes = 0
        next_cache_id = 0
        # Read before the entries: a change in between makes the reader refetch once more, never miss it.
        version = self.table.generations.version
        for record, model_ids in self._remote_caches(msg.start_cache_id):
            where = record.location(0, record.num_tensors)
            # msgpack needs at most 9 bytes an integer; the fixed fields and the segment name fit in 320.
            entry_nbytes = 320 + 9 * (len(where.tensor_bases) + len(model_ids))
            if entries and (
                len(entries) == MAX_TABLE_ENTRIES or page_nbytes + entry_nbytes > _TABLE_PAGE_NBYTES
            ):
                next_cache_id = record.cache_id
                break
            page_nbytes += entry_nbytes
            entries.append(
                (
                    record.cache_id,
                    record.is_blocks,
                    model_ids,
                    where.segment_name,
                    where.segment_nbytes,
                    where.tensor_bases,
                    where.unit_nbytes,
                    where.num_units,
                    record.gen_slot,
                    record.generation,
                )
            )
        return Table(
            msg.seq, os.getpid(), self.table.generations.name, tuple(entries), next_cache_id, version
        )

    def _remote_caches(self, start_cache_id: int = 0) -> list[tuple[CacheRecord, tuple[int, ...]]]:
        """Remote-accessible live caches with ids from `start_cache_id` on, in id order, each with the
        blocks model ids naming it (what a peer's one-sided table lists). IndexBusy when the lock is busy."""
        with self.table.lock, self.table.mirror.locked(SERVER_LOCK_TIMEOUT_S):
            self.table.catch_up()
            entries = []
            for cache_id in sorted(c for c in self.table.caches if c >= start_cache_id):
                record = self.table.caches[cache_id]
                if record.external and record.remote_accessible:
                    model_ids = tuple(m for m, c in self.table.blocks_keys.items() if c == cache_id)
                    entries.append((record, model_ids))
            return entries

    # ----------------------------------------------------------------- the rest of the process

    def serve_remote(self, local_ip: str) -> str:
        return self.hooks.serve_remote(local_ip)

    def peer_linked(self, peer: PeerInfo) -> None:
        self.hooks.peer_linked(peer)

    def peer_gone(self, peer: PeerInfo) -> None:
        self.hooks.peer_gone(peer)

    def housekeeping(self) -> None:
        self.hooks.housekeeping()
