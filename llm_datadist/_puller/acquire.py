"""The one home of the puller's pin and lease life cycle: `Acquirer.acquire(link, ref, deadline)`.

Rules: the caller holds the link exclusively. `acquire` pins what `ref` names through the link's row of
the owner's index when the owner gave one and published it there (no message: `dataplane`), and asks the
owner for a lease otherwise (peers on other hosts, what the owner could not publish); either way it yields
one `Location` and, however the with-block ends, ends what it began: an unpin (after a failed copy, what
the pin consumed goes back) or a one-way `Release` (ok or not). A push by address (`write_lease`, v1
`transfer_cache_async`) is a lease of the same life. The fault-injection points "pinned", "copied" and
"released" (`_faults`) are passed here and nowhere else.

    state      means                                           next
    asked      nothing held yet (the socket says the owner     pinned | leased | refused (StatusError)
               is alive; a dead owner's index is never read)
    pinned     our row of its index pins the cache             unpinned (the with-block ended)
    leased     the owner pins it for us until we release       released (the with-block ended)
"""

from __future__ import annotations

import contextlib

from llm_datadist._protocol.messages import Location as LocationMessage
from llm_datadist._protocol.messages import (
    Release,
    WriteGrant,
    WriteRequest,
)
from llm_datadist._shm.index import Index

from .. import _faults
from .._errors import PeerGone, StatusError
from ..status import LLMStatusCode
from .dataplane import peer_index, pin, unpin
from .peer import Peer
from .source import Location, SourceRef


class Acquirer:
    """Pins and leases of one process (its cluster id and incarnation name it in owners' indexes)."""

    def __init__(self, cluster_id: int, incarnation: int, timeout_code: LLMStatusCode) -> None:
        self.cluster_id = cluster_id
        self.incarnation = incarnation
        self.timeout_code = timeout_code

    def acquire(self, peer: Peer, ref: SourceRef, deadline: float) -> Held:
        """`with acquirer.acquire(link, ref, deadline) as location:` copy; ended on the way out."""
        return Held(self, peer, ref, deadline)

    def write_lease(
        self, peer: Peer, addrs: tuple[int, ...], nbytes: tuple[int, ...], deadline: float
    ) -> WriteLease:
        """`with acquirer.write_lease(link, addrs, nbytes, deadline) as grant:` write into the ranges the
        peer granted (range i is [addrs[i], +nbytes[i]) of its memory); released on the way out."""
        return WriteLease(peer, addrs, nbytes, deadline)

    def pinned_in_index(self, peer: Peer, ref: SourceRef, deadline: float) -> tuple[Index, Location] | None:
        """Pin `ref` through the link's row of the owner's index: the index and where the cache is, or None
        when the owner must be asked. The link's socket says first whether the owner is alive."""
        peer.check_usable()
        peer.check_peer_alive()
        index = peer_index(peer, self.incarnation, deadline, self.timeout_code)
        if index is None:
            return None
        pinned = pin(
            peer,
            index,
            ref,
            cluster_id=self.cluster_id,
            deadline=deadline,
            timeout_code=self.timeout_code,
        )
        if pinned is None:
            return None
        return index, Location.from_pin(peer.info.pid, pinned.cache, pinned.batch_slot, ref)


class _Holding:
    """What a pin and a lease share: the fault points, and ending what was begun however the with-block
    ends. A class, not @contextmanager, since every transfer enters one."""

    __slots__ = ()

    def _begun(self) -> None:
        if _faults.hook is not None:
            try:
                _faults.at("pinned")
            except BaseException:
                self._end(ok=False)
                raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        ok = exc_type is None
        if ok and _faults.hook is not None:
            try:
                _faults.at("copied")
            except BaseException:
                self._end(ok=False)
                raise
        self._end(ok=ok)
        if ok and _faults.hook is not None:
            _faults.at("released")

    def fail(self) -> None:
        """End what was begun, outside a with-block, as a failed transfer ends it."""
        self._end(ok=False)

    def _end(self, *, ok: bool) -> None:
        raise NotImplementedError


class Held(_Holding):
    """`Acquirer.acquire`: what a `SourceRef` names, pinned in the owner's index or leased."""

    __slots__ = ("_acquirer", "_deadline", "_index", "_location", "_peer", "_ref")

    def __init__(self, acquirer: Acquirer, peer: Peer, ref: SourceRef, deadline: float) -> None:
        self._acquirer = acquirer
        self._peer = peer
        self._ref = ref
        self._deadline = deadline
        self._index: Index | None = None
        self._location: Location | None = None

    def __enter__(self) -> Location:
        peer, ref = self._peer, self._ref
        pinned = self._acquirer.pinned_in_index(peer, ref, self._deadline)
        if pinned is not None:
            self._index, location = pinned
        else:
            seq = peer.next_seq()
            reply = peer.request(ref.to_message(seq), seq, self._deadline)
            if not isinstance(reply, LocationMessage):
                raise PeerGone(f"expected Location, got {type(reply).__name__}")
            location = _checked(peer, reply, ref, self._deadline)
        self._location = location
        self._begun()
        return location

    def _end(self, *, ok: bool) -> None:
        location, self._location = self._location, None
        if location is None:
            return
        if self._index is not None:
            index, self._index = self._index, None
            unpin(self._peer, index, ok=ok)
            return
        end_lease(self._peer, location.lease_id, ok=ok, deadline=self._deadline)


class WriteLease(_Holding):
    """`Acquirer.write_lease`: address ranges of the peer's memory, leased for a push."""

    __slots__ = ("_addrs", "_deadline", "_grant", "_nbytes", "_peer")

    def __init__(self, peer: Peer, addrs: tuple[int, ...], nbytes: tuple[int, ...], deadline: float) -> None:
        self._peer = peer
        self._addrs = addrs
        self._nbytes = nbytes
        self._deadline = deadline
        self._grant: WriteGrant | None = None

    def __enter__(self) -> WriteGrant:
        peer = self._peer
        seq = peer.next_seq()
        grant = peer.request(WriteRequest(seq, self._addrs, self._nbytes), seq, self._deadline)
        if not isinstance(grant, WriteGrant):
            raise PeerGone(f"expected WriteGrant, got {type(grant).__name__}")
        self._grant = grant
        self._begun()
        if len(grant.range_offsets) != len(self._addrs):
            self._end(ok=False)
            raise StatusError(LLMStatusCode.LLM_FAILED, "peer granted a different range than requested")
        return grant

    def release(self, *, ok: bool, deadline: float) -> None:
        """End the lease outside a with-block, as `__exit__` (ok) or `fail` would, sending by `deadline`: a
        lease kept across a layer-wise job outlives the deadline it was taken by."""
        self._deadline = deadline
        if ok:
            self.__exit__(None, None, None)
        else:
            self.fail()

    def _end(self, *, ok: bool) -> None:
        grant, self._grant = self._grant, None
        if grant is not None:
            end_lease(self._peer, grant.lease_id, ok=ok, deadline=self._deadline)


def _checked(peer: Peer, reply: LocationMessage, ref: SourceRef, deadline: float) -> Location:
    """The grant as a location; a grant that does not match what was asked is released (not ok) first."""
    try:
        return Location.from_message(peer.info.pid, reply, ref)
    except StatusError:
        end_lease(peer, reply.lease_id, ok=False, deadline=deadline)
        raise


def end_lease(peer: Peer, lease_id: int, *, ok: bool, deadline: float) -> None:
    """One way: the owner releases (or, after a failure, gives the key back) in order with this link's next
    messages; waiting for it would cost a round trip per transfer. After a failure, best effort: the
    original error is the one to report."""
    if ok:
        peer.send_only(Release(lease_id, True), deadline)
    elif peer.broken is None:
        with contextlib.suppress(StatusError):
            peer.send_only(Release(lease_id, False), deadline)
