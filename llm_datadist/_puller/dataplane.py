"""The puller's side of the published index: resolve, pin, consume and unpin in the owner's index with no
message to the owner (see `llm_datadist._shm.index` for the layout and `_owner` for the owner).

Rules: the caller holds its link exclusively, so one pin at a time goes through the link's row. Every
check the owner makes on a pull request is made here, with the same status codes; whatever the index says
is checked before it is used (`IndexCorrupt` becomes LLM_FAILED for that transfer; the owner repairs its
index, so the link stays). A lock not had by the deadline is the transfer's timeout. A name the index does
not hold while the owner flags keys it could not publish makes `pin` return None: the caller asks the
owner instead. A pin is ours until we clear it, whatever happens to the link: an unpin that cannot be done
now is owed, and done later (`settle_owed`); one whose row the owner took back fails the transfer. The C
kernel's pulls (`fresh`) pin through the same row with the same checks.
"""

from __future__ import annotations

import time
from typing import NamedTuple, NoReturn, Protocol

from llm_datadist._shm.errors import ShmError
from llm_datadist._shm.index import Index, IndexCorrupt, IndexLockTimeout
from llm_datadist._shm.index_layout import (
    CACHE_KEYS_UNPUBLISHED,
    CACHE_PENDING,
    CACHE_WITHDRAWN,
    FLAG_UNPUBLISHED,
    KIND_BLOCKS,
    KIND_CACHE,
    KIND_SLOT,
    STATE_OPEN,
    CacheEntry,
)

from .. import _unpins
from .._errors import StatusError
from .._keys import (
    KEY_BLOCKS,
    KEY_CACHE_ID,
    KEY_REQ,
    blocks_by_id,
    check_batch_index,
    check_source_bytes,
    check_tensors,
    not_found,
    registered_for_v1,
)
from .._wire.peer import PeerInfo
from ..status import LLMStatusCode
from .peer import Peer
from .source import V2, SourceRef

# An unpin after the copy gets at least this long for the lock, whatever the transfer's deadline left.
_UNPIN_TIMEOUT_S = 5.0


class Pin(NamedTuple):
    """A cache pinned through the link's row: where its tensors are in which segment of the owner."""

    cache: CacheEntry
    batch_slot: int


def peer_index(peer: Peer, incarnation: int, deadline: float, timeout_code: LLMStatusCode) -> Index | None:
    """The peer's index as mapped here (mapped on first use), or None when the owner gave none."""
    if peer.index is not None:
        return peer.index
    if not peer.index_name:
        return None
    try:
        peer.index = Index.attach(peer.index_name, pid=peer.info.pid, incarnation=peer.info.incarnation)
    except ShmError as exc:  # not that owner's, or gone (the owner ended: the socket says which)
        raise_index_error(peer, exc, timeout_code)
    try:
        with peer.index.locked(max(deadline - time.monotonic(), 0.0)):
            holder = peer.index.row_state(peer.index_row)[0]
            row_incarnation = peer.index.row_incarnation(peer.index_row)
    except ShmError as exc:
        raise_index_error(peer, exc, timeout_code)
    if (holder, row_incarnation) != (peer.index_ticket, incarnation):
        peer.index.close()
        peer.index = None
        raise StatusError(LLMStatusCode.LLM_FAILED, f"peer's index: {_row_taken_back(peer)}")
    return peer.index


class RowHolder(Protocol):
    """What pinning needs of a link: its row of the owner's index, the ticket naming it there, the peer,
    and a way to break the link (a `Peer` is one)."""

    index_row: int
    index_ticket: int
    info: PeerInfo

    def fail(self, reason: str) -> None: ...

    def check_peer_alive(self) -> None: ...


def _row_taken_back(peer: RowHolder) -> IndexCorrupt:
    """Our row is no longer ours. The owner takes a row back only as it ends the connection (it is
    finalizing, or it dropped us): once the socket says so, the link is over. While the socket is open,
    a stray write into the index changed the row: this transfer fails (LLM_FAILED) and the link stays (the
    owner puts its fields back at its next audit)."""
    peer.check_peer_alive()  # PeerGone (LLM_LINK_FAILED) and the link broken, if the connection ended
    return IndexCorrupt(f"row {peer.index_row} of the peer's index names another holder")


def pin(
    peer: RowHolder,
    index: Index,
    ref: SourceRef,
    *,
    cluster_id: int,
    deadline: float,
    timeout_code: LLMStatusCode,
) -> Pin | None:
    """Find what `ref` names in the owner's index, check it as the owner would and pin it through the
    link's row, consuming the pulled tensors of a req key when it asks to; None: ask the owner. The
    cache-manager rules (`ref.rules` V2): a blocks cache may be named by id, a push into our cluster does
    not stop pulls; `ref.for_write`: pin for a push, which only reaches a cache its user still holds (and
    consumes nothing)."""
    try:
        index.lock(max(deadline - time.monotonic(), 0.0))
        try:
            pinned = _pin_locked(peer, index, cluster_id, ref)
            if pinned is not None and ref.for_write and pinned.cache.flags & CACHE_WITHDRAWN:
                index.clear_row(peer.index_row, peer.index_ticket)
                raise StatusError(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache {pinned.cache.cache_id} was deallocated"
                )
            return pinned
        finally:
            index.unlock()
    except ShmError as exc:
        raise_index_error(peer, exc, timeout_code)


def index_not_open(peer: RowHolder, state: int) -> IndexCorrupt:
    """The index says it is not open. An owner closes it as it ends its connections: once the socket says
    so, the link is over (PeerGone, LLM_LINK_FAILED). While the socket is open, the owner is between the
    two, or a stray write changed the word: this transfer fails (LLM_FAILED) and the link stays."""
    peer.check_peer_alive()
    return IndexCorrupt(f"the peer's index is not open (state {state})")


def raise_index_error(peer: RowHolder, exc: ShmError, timeout_code: LLMStatusCode) -> NoReturn:
    if isinstance(exc, IndexLockTimeout):
        raise StatusError(timeout_code, str(exc)) from exc
    if isinstance(exc, IndexCorrupt):
        # A stray write into the owner's index: this transfer fails; the owner repairs the index.
        raise StatusError(LLMStatusCode.LLM_FAILED, f"peer's index: {exc}") from exc
    peer.check_peer_alive()
    raise StatusError(LLMStatusCode.LLM_FAILED, f"peer's index: {exc}") from exc


def _pin_locked(peer: RowHolder, index: Index, cluster_id: int, ref: SourceRef) -> Pin | None:
    key_kind, key_id, model_id, batch_index = ref.key_kind, ref.key_id, ref.model_id, ref.batch_index
    tensor_start, tensor_count = ref.tensor_start, ref.tensor_count
    v2 = ref.rules == V2
    consume = ref.consume and not ref.for_write
    state, flags = index.header()
    if state != STATE_OPEN:
        raise index_not_open(peer, state)
    if not v2 and index.busy(cluster_id):
        raise StatusError(LLMStatusCode.LLM_LINK_BUSY, "a layer-wise transfer into this cluster is running")
    holder = index.row_state(peer.index_row)[0]
    if holder != peer.index_ticket:
        raise _row_taken_back(peer)
    # A pin we did not leave (we hold the link and owe no unpin through it) is a stray write into our own
    # row, which the owner's repair keeps as pullers left it: the pin below writes the row whole again.
    consume_name = -1
    if key_kind == KEY_BLOCKS:
        name = index.lookup(KIND_BLOCKS, 0, model_id)
    elif key_kind == KEY_CACHE_ID:
        name = index.lookup(KIND_CACHE, key_id, 0)
    else:
        name = index.lookup(key_kind, key_id, model_id)
        if name is not None and key_kind == KEY_REQ:
            consume_name = name.number
    if name is None:
        if flags & FLAG_UNPUBLISHED:
            return None
        raise not_found(key_kind, key_id, model_id)
    cache = index.cache(name.cache_slot)
    if cache.generation != name.generation:
        raise IndexCorrupt(f"name {name.number} names a cache that is not in its slot")
    batch_slot = name.batch_slot
    if key_kind == KEY_CACHE_ID:
        check_batch_index(cache.batch_size, batch_index)
        if cache.is_blocks and not v2:
            raise blocks_by_id(key_id)
        batch_slot = batch_index
        alias = index.lookup(KIND_SLOT, key_id, batch_index)
        if alias is not None:
            consume_name = alias.target
        elif consume and cache.flags & CACHE_KEYS_UNPUBLISHED:
            return None  # the slot's req key may be one the index does not hold: the owner consumes it
    if batch_slot >= cache.batch_size:
        raise IndexCorrupt(f"name {name.number} names slot {batch_slot} of a batch of {cache.batch_size}")
    check_tensors(cache.num_tensors, tensor_start, tensor_count, ref.whole)
    if key_kind != KEY_BLOCKS:
        check_source_bytes(cache.slot_nbytes, ref.src_offset, ref.nbytes)
    if cache.registered and not v2:
        raise registered_for_v1(cache.cache_id)
    # A pull that consumes names the req key it pulls from in its row, whether or not it could reserve
    # anything of it: what it reserved is given back if it fails, and what it pulls is credited to the
    # key if it ends well, whoever had reserved those tensors (reference §9.4: a key is consumed once
    # pulls that ended well copied all of it). A row that names a key keeps the owner from unbinding it.
    pulled_name, taken = -1, 0
    if consume and consume_name >= 0 and not cache.registered:  # keys on registered memory stay
        target = index.name_entry(consume_name)
        if (target.cache_slot, target.generation) == (cache.slot, cache.generation):
            pulled_name = consume_name
            taken = index.consume(consume_name, ((1 << tensor_count) - 1) << tensor_start)
    index.set_row(
        peer.index_row,
        peer.index_ticket,
        cache.slot,
        cache.generation,
        pulled_name,
        taken,
        range(tensor_start, tensor_start + tensor_count),
    )
    return Pin(cache, batch_slot)


def unpin(peer: RowHolder, index: Index, *, ok: bool) -> None:
    """End the row's pin: after a copy that went well, what it pulled counts as pulled; after a failed one,
    what it reserved goes back. A row the owner took back (it revoked the pin: the memory may be reused)
    fails a transfer that went well with LLM_LINK_FAILED. A lock that cannot be had even now fails the
    transfer, leaves the unpin owed (done by `settle_owed` as a failed pull's: what it reserved goes back,
    so the key can be pulled again) and breaks the link."""
    try:
        index.lock(_UNPIN_TIMEOUT_S)
    except ShmError as exc:
        _unpins.owe(index, peer.index_row, peer.index_ticket)
        peer.fail(f"could not unpin in the peer's index: {exc}")
        if ok:
            raise StatusError(LLMStatusCode.LLM_FAILED, f"peer's index: {exc}") from exc
        return
    try:
        revoked = not _unpin_locked(index, peer.index_row, peer.index_ticket, ok)
    except IndexCorrupt as exc:
        # The row or the name cannot be read (a stray write, a file another process shrank): the pin
        # cannot be ended as it was taken, the bytes cannot be trusted. The owner's repair takes the row
        # back; the link stays.
        if not ok:
            return
        raise StatusError(LLMStatusCode.LLM_FAILED, f"peer's index: {exc}") from exc
    finally:
        index.unlock()
    if revoked and ok:
        # Taken back with the connection (the owner finalized, or dropped us): the link is over. With the
        # connection open, a stray write changed our row: the pin may not have held, so the transfer fails.
        try:
            peer.check_peer_alive()
        except StatusError:
            peer.fail("the peer took back our pin")
            raise StatusError(
                LLMStatusCode.LLM_LINK_FAILED,
                f"cluster {peer.info.cluster_id} took back the pin before the transfer ended (it finalized)",
            ) from None
        raise StatusError(
            LLMStatusCode.LLM_FAILED,
            f"our row of cluster {peer.info.cluster_id}'s index changed during the transfer (a stray write; "
            "the peer repairs it): the bytes cannot be trusted",
        )


def _unpin_locked(index: Index, row: int, ticket: int, ok: bool) -> bool:
    """False if the row is no longer ours or pins nothing (the owner took it back)."""
    entry = index.row(row)
    if entry.holder != ticket or not entry.state:
        return False
    cache_slot, generation, name, taken = entry.cache_slot, entry.generation, entry.name, entry.taken
    if name >= 0:
        if ok:
            index.credit(name, entry.pulled, cache_slot, generation)
        elif taken:
            index.restore(name, taken, cache_slot, generation)
    if name >= 0 or index.cache_flags(cache_slot) & CACHE_PENDING:
        # The owner unbinds a key pulled whole once no row names it, and frees what only the pin kept, at
        # its next look (its next call, or its server thread within half a second).
        index.bump_epoch()
    index.clear_row(row, ticket)
    return True


def settle_owed(timeout_s: float) -> int:
    """Do the unpins that could not get their lock in time (housekeeping); how many are still owed."""
    return _unpins.settle(timeout_s, _unpin_locked)
