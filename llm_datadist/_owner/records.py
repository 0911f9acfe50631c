"""What the owner's table records: a cache, a key bound to one of its slots, a lease a peer holds on some
caches, and where a cache's tensors are (`LocationData`). Plain values; the table changes them under its
lock."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llm_datadist._library import SharedSpan
from llm_datadist._shm.index_layout import (
    CACHE_BLOCKS,
    CACHE_KEYS_UNPUBLISHED,
    CACHE_PENDING,
    CACHE_REGISTERED,
    CACHE_REMOTE,
    CACHE_WITHDRAWN,
)
from llm_datadist._shm.pool import Block
from llm_datadist._shm.segment import Segment

from .._keys import KeyId, registered_for_v1

# Each tensor starts on its own page: copies stay aligned and a tensor never shares a page with another.
TENSOR_ALIGN_NBYTES = 4096


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(eq=False)
class CacheRecord:
    """One cache: `num_tensors` tensors of `tensor_nbytes` each.

    A pool cache has its tensors `pitch_nbytes` apart in one pool block (offsets relative to the block)::

        0                 pitch            2*pitch                 num_tensors*pitch
        | tensor 0 | pad  | tensor 1 | pad  | ... | tensor n-1 | pad |

    so tensor t, slot b starts at block.offset + t*pitch + b*slot_nbytes within the segment. A registered
    cache (v2 `register_cache`) has no block: its tensors are at the user's `addrs`, memory this process
    owns but the library did not allocate; peers reach it by cross-memory attach, never through a segment.
    """

    cache_id: int
    num_tensors: int
    tensor_nbytes: int
    batch_size: int
    pitch_nbytes: int
    block: Block | None
    is_blocks: bool = False
    addrs: tuple[int, ...] = ()
    placement: int = 1
    remote_accessible: bool = True
    # The cache's word in the generation table (see shm.generations): one-sided readers check it.
    gen_slot: int = -1
    generation: int = 0
    external: bool = True
    keys: set[KeyId] = field(default_factory=set)
    leases: int = 0
    # One item per local pin (`LocalPins`): appended and popped without the table's lock (each is one
    # atomic step), so that a transfer's pin costs no lock in the common case.
    pin_holds: deque[None] = field(default_factory=deque)
    # In the index: the cache entry (at gen_slot) and its KIND_CACHE name; `pending` once nothing but a
    # puller's row keeps it (its free waits for that row).
    published: bool = False
    cache_name: int = -1
    pending: bool = False
    addr_words: int = -1  # registered: its first word in the index's address region
    # Each tensor's address here as native uint64 words (the C kernel's destinations), packed on first use
    # by a pull into the cache (`_puller.fresh`): a record's memory never moves.
    packed_addrs: bytes = b""
    keys_unpublished: bool = False  # a req key was bound to a slot of it that the index could not hold
    # Registered memory that was not this process's mapped memory at registration (device memory, which
    # the real library takes on trust): each local transfer checks it first (`LocalPins.pin`).
    unchecked: bool = False
    # Registered memory the library handed out (`ext.shared_arrays`), all in one of its segments: published
    # by that segment's name and offsets, so that peers map it (and it stays mapped while registered).
    shared: SharedSpan | None = None

    @property
    def slot_nbytes(self) -> int:
        return self.tensor_nbytes // self.batch_size

    @property
    def registered(self) -> bool:
        return self.block is None

    @property
    def pool_block(self) -> Block:
        """The block of a pool cache (an invariant: callers only ask pool caches)."""
        assert self.block is not None, f"cache {self.cache_id} is registered memory, not a pool block"
        return self.block

    @property
    def segment(self) -> Segment:
        """The segment of a pool cache; a registered cache has none (refused as v1 transfers refuse it)."""
        if self.block is None:
            raise registered_for_v1(self.cache_id)
        return self.block.segment

    def tensor_offset(self, tensor_index: int) -> int:
        """Offset of tensor `tensor_index` within the segment (pool caches only)."""
        return self.pool_block.offset + tensor_index * self.pitch_nbytes

    def tensor_addrs(self) -> list[int]:
        if self.block is None:
            return list(self.addrs)
        base = self.block.address
        return [base + t * self.pitch_nbytes for t in range(self.num_tensors)]

    @property
    def pins(self) -> int:
        """Local pins held now."""
        return len(self.pin_holds)

    @property
    def referenced(self) -> bool:
        return self.external or bool(self.keys) or self.leases > 0 or self.pins > 0

    @property
    def index_flags(self) -> int:
        """The index's flags for this cache (see shm.index)."""
        return (
            (CACHE_BLOCKS if self.is_blocks else 0)
            | (CACHE_PENDING if self.pending else 0)
            | (0 if self.external else CACHE_WITHDRAWN)
            | (CACHE_REGISTERED if self.registered else 0)
            | (CACHE_REMOTE if self.remote_accessible else 0)
            | (CACHE_KEYS_UNPUBLISHED if self.keys_unpublished else 0)
        )

    def location(self, tensor_start: int, tensor_count: int) -> LocationData:
        """Where tensors [tensor_start, +count) are: segment offsets (a pool's, or the library's segment of
        registered memory), or addresses in this process."""
        tensors = range(tensor_start, tensor_start + tensor_count)
        if self.block is None:
            shared = self.shared
            if shared is not None:
                return LocationData(
                    shared.name,
                    shared.nbytes,
                    tuple(shared.offsets[t] for t in tensors),
                    self.slot_nbytes,
                    self.batch_size,
                )
            return LocationData(
                "", 0, tuple(self.addrs[t] for t in tensors), self.slot_nbytes, self.batch_size
            )
        segment = self.block.segment
        return LocationData(
            segment.name,
            segment.nbytes,
            tuple(self.tensor_offset(t) for t in tensors),
            self.slot_nbytes,
            self.batch_size,
        )

    def holds(self, addr: int, nbytes: int) -> bool | None:
        """True if one tensor contains [addr, addr + nbytes); False if a tensor holds `addr` but not the
        whole range; None if no tensor holds `addr`."""
        if self.block is None:
            for base in self.addrs:
                if base <= addr < base + self.tensor_nbytes:
                    return nbytes > 0 and addr + nbytes <= base + self.tensor_nbytes
            return None
        offset = addr - self.block.address
        if offset < 0 or offset >= self.pitch_nbytes * self.num_tensors:
            return None
        return nbytes > 0 and offset % self.pitch_nbytes + nbytes <= self.tensor_nbytes


@dataclass(frozen=True)
class LocationData:
    """Where some tensors of a cache are: `segment_name` "" means addresses in the owner's process."""

    segment_name: str
    segment_nbytes: int
    tensor_bases: tuple[int, ...]
    unit_nbytes: int
    num_units: int


@dataclass(eq=False)
class KeyRecord:
    key: KeyId
    cache_id: int
    slot: int
    # A req key's tensors: unclaimed (neither reserved by a transfer in flight nor pulled) and pulled (by
    # transfers that ended well). A layer-by-layer pull consumes the key only once every tensor was
    # pulled (reference §9.4, §16). For a key in the index (`name` >= 0) the index's masks are the truth
    # and these sets are unused.
    unpulled: set[int]
    pulled: set[int] = field(default_factory=set)
    name: int = -1
    slot_name: int = -1  # req keys: the KIND_SLOT name that finds this key from (cache id, slot)
    leases: int = 0  # leases that reserved tensors of this key or will credit it: it stays bound meanwhile


@dataclass(frozen=True)
class Lease:
    """Pins `records` until released; a pull lease of a req key reserves the key's unclaimed tensors it
    pulls, and when it ends the key gains what it pulled (ended well) or gets back what it reserved."""

    lease_id: int
    records: tuple[CacheRecord, ...]
    key: KeyRecord | None  # the req key the pull consumes (the record, not its id: it may be rebound)
    owner: object
    reserved: frozenset[int] = frozenset()  # given back if the transfer fails, but for what others pulled
    pulled: frozenset[int] = frozenset()  # the tensors the transfer pulls


def mask_of(tensors: set[int] | frozenset[int]) -> int:
    mask = 0
    for tensor in tensors:
        mask |= 1 << tensor
    return mask


def tensors_of(mask: int) -> list[int]:
    return [t for t in range(mask.bit_length()) if mask >> t & 1]
