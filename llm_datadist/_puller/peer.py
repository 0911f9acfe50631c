"""The puller's side of one link (`Peer`): the wire's link to a peer and everything this process learnt
over it and keeps for its transfers, in one object that `links` makes with the link and that dies with it.

Rules: a `Peer` holds its link (`ClientLink`, the wire's), the mover chosen for it when it was made (a peer
on this host or on another: `movers`), the peer's published index as mapped here with our row in it, the
peer's segments mapped here and the names checked to be its own, the addresses a peer on another host gave
for its segments, its one-sided table, and what the C kernel's pulls read (`FreshSource`). Nothing of it
outlives the link: when the link closes for good (`ClientLink.on_closed`), the mappings close and the index
is let go once the unpins owed through it are done. The caller of a transfer holds the link exclusively
(`exclusive`), so one transfer at a time reads and writes these fields; housekeeping's sweep of the
mappings takes their own lock.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from llm_datadist._protocol.messages import Message
from llm_datadist._shm.index import Index
from llm_datadist._shm.mappings import MappingCache
from llm_datadist._shm.segment import Segment

from .. import _unpins
from .._wire.client import ClientLink
from .._wire.peer import PeerInfo

if TYPE_CHECKING:
    from .fresh import FreshSource
    from .movers import Mover
    from .source import RemoteTable


class Peer:
    """The puller's side of one link: the link, its mover, and what was learnt and mapped over it."""

    __slots__ = (
        "__weakref__",
        "fresh",
        "index",
        "index_name",
        "index_row",
        "index_ticket",
        "info",
        "link",
        "mappings",
        "mover",
        "owned_segments",
        "segment_addrs",
        "table",
    )

    def __init__(self, link: ClientLink, mover: Mover) -> None:
        self.link = link
        self.info: PeerInfo = link.peer
        self.mover = mover
        self.index_name, self.index_row, self.index_ticket = link.index_grant
        self.index: Index | None = None  # the peer's index, mapped on first use (`dataplane.peer_index`)
        self.mappings = LockedMappings()
        self.owned_segments: set[str] = set()  # segment names already checked to be the peer's own
        # Over TCP: where the peer has its segments mapped (asked once per segment; a name is never reused).
        self.segment_addrs: dict[str, int] = {}
        self.table: RemoteTable | None = None  # its one-sided table (`oneside`), read on first use
        self.fresh: FreshSource | None = None  # what the kernel's pulls read (`fresh`)
        ref = weakref.ref(self)
        link.on_closed = lambda abandoned: _release(ref, abandoned)

    @property
    def cluster_id(self) -> int:
        return self.info.cluster_id

    # The link's own calls that every transfer makes.

    def exclusive(self, deadline: float, *, busy_fails: bool = False) -> AbstractContextManager[None]:
        """Hold the link for one transfer (`ClientLink.exclusive`)."""
        return self.link.exclusive(deadline, busy_fails=busy_fails)

    def check_usable(self) -> None:
        self.link.check_usable()

    def check_peer_alive(self) -> None:
        self.link.check_peer_alive()

    def fail(self, reason: str) -> None:
        self.link.fail(reason)

    @property
    def broken(self) -> str | None:
        return self.link.broken

    def next_seq(self) -> int:
        return self.link.next_seq()

    def request(self, msg: Message, seq: int, deadline: float) -> Message:
        return self.link.request(msg, seq, deadline)

    def send_only(self, msg: Message, deadline: float) -> None:
        self.link.send_only(msg, deadline)

    def close(self, *, say_bye: bool) -> None:
        """Close the link (at the end of the transfer holding it, if one does); what was learnt over it
        goes with it."""
        self.link.close(say_bye=say_bye)

    def abandon(self) -> None:
        """In a forked child: this process's copies of the socket, the mappings and the peer's index
        closed, nothing said to the peer and nothing written in its index (its pins are the parent's)."""
        self.link.abandon()

    def unmap_retired(self) -> None:
        """Unmap the segments the peer retired (unlinked), so that no freed memory stays alive here."""
        for name in self.mappings.drop_unlinked():
            self.owned_segments.discard(name.lstrip("/"))
            self.owned_segments.discard(name)

    def _release(self, abandoned: bool) -> None:
        self.mappings.clear()
        self.table = None
        self.fresh = None
        index, self.index = self.index, None
        if index is None:
            return
        if abandoned:
            index.close()
        else:
            _unpins.release(index)  # closed now, or once the unpins owed through it are done


def _release(ref: weakref.ref[Peer], abandoned: bool) -> None:
    peer = ref()
    if peer is not None:
        peer._release(abandoned)


class LockedMappings(MappingCache):
    """A peer's segments mapped here: used by transfers and swept by the server thread (housekeeping) at
    once."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()  # drop_unlinked calls drop

    def get(self, name: str, *, min_nbytes: int = 0, writable: bool = False) -> Segment:
        with self._lock:
            return super().get(name, min_nbytes=min_nbytes, writable=writable)

    def drop(self, name: str) -> None:
        with self._lock:
            super().drop(name)

    def drop_unlinked(self) -> list[str]:
        with self._lock:
            return super().drop_unlinked()

    def clear(self) -> None:
        with self._lock:
            super().clear()
