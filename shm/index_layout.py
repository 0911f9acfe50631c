"""The published index's layout: its regions, its entries' fields and flags, and the entries as read.
`shm.index` has the rules; the owner's side (`shm.index_owner`) and the audit (`shm.index_audit`) write
and check the same bytes.
"""

from __future__ import annotations

import mmap
import struct
from typing import NamedTuple

LAYOUT_VERSION = 3
_MAGIC = b"LLMDDIX\x00"

# Name kinds: the three key kinds of the protocol, plus two the index adds for lookups by cache id.
KIND_REQ = 1  # (req_id, model_id) -> a batch slot; consumed by pulls
KIND_PREFIX = 2  # (prefix_id, model_id) -> a batch slot; never consumed
KIND_CACHE = 3  # (cache_id, 0) -> a cache (pulls by cache id and batch index)
KIND_BLOCKS = 4  # (0, model_id) -> a blocks cache
KIND_SLOT = 5  # (cache_id, batch slot) -> the KIND_REQ name bound to that slot (what a pull by id consumes)

# Name states.
NAME_FREE = 0
NAME_LIVE = 1
# Every tensor of the key is reserved by a live pin or pulled: lookups no longer find it. Once the pins that
# reserved tensors have ended, every tensor was pulled (a failed pull gives back only what nobody pulled),
# and the owner reclaims the name.
NAME_CONSUMED = 2

# Cache flags.
CACHE_BLOCKS = 1
CACHE_PENDING = 2  # the owner wants to free the cache: a puller that unpins it bumps the epoch
CACHE_WITHDRAWN = 4  # its user deallocated it: it is still read (keys remain), never written
# Memory the owner registered: the address region holds its tensors' addresses, or, when the entry names a
# segment (the library's memory, `ext.shared_arrays`), their offsets in that segment.
CACHE_REGISTERED = 8
CACHE_REMOTE = 16  # remote_accessible (v2): listed in the one-sided table
# A req key bound to a slot of the cache is not in the index (more tensors than a mask holds, no free name):
# a pull by cache id that consumes cannot find what it consumes here, so it asks the owner.
CACHE_KEYS_UNPUBLISHED = 32

# Header flags: some key or cache is not in the index (more tensors than a mask holds, a full index): a
# puller that does not find a name asks the owner instead; with caches missing, the one-sided table comes
# from the owner too.
FLAG_UNPUBLISHED = 1
FLAG_CACHES_UNPUBLISHED = 2

MAX_MASK_TENSORS = 512  # a key's tensors are bitmasks of this many bits
_MASK_NBYTES = MAX_MASK_TENSORS // 8
_SEGMENT_NAME_NBYTES = 64
BUSY_CAPACITY = 64  # clusters an owner pushes into at once (transfer_cache_async)

# ---------------------------------------------------------------------------------------------------- layout
#
#   offset  size                   what
#   0       _HEADER.size (60)      magic, layout version, state, pid, incarnation, capacities, epoch, flags
#   60      4                      busy entries in use
#   128     64                     the name of the owner's generation segment (shm.generations)
#   1024    BUSY_CAPACITY * 16     (cluster_id u64, count u64): clusters the owner is pushing into
#   4096    rows * 128             pin rows, one per accepted connection (see _ROW)
#   ...     caches * 128           cache entries, indexed by the cache's generation slot (see _CACHE)
#   ...     names * 192            name entries (see _NAME), stable indices
#   ...     buckets * 4            open-addressing hash of names: entry index + 1, 0 = empty; linear probing,
#                                  deletion by backward shift (no tombstones), so entries never move
#   ...     names * 4 * 8          address words: a registered cache's tensor addresses (in the owner's
#                                  process; offsets when its entry names a segment), num_tensors
#                                  consecutive words from its entry's `offset`
#
# All integers are little-endian. The header's capacities say where each region starts; a reader checks
# that they fit the file before it trusts any of them.
_HEADER = struct.Struct("<8sII QQ IIII QI")  # magic, layout, state, pid, incarnation, 4 caps, epoch, flags
_BUSY_OFFSET = 1024
_BUSY = struct.Struct("<QQ")
_BUSY_ALL = struct.Struct(f"<{2 * BUSY_CAPACITY}Q")
_BUSY_COUNT_OFFSET = 60  # u32 after the header: how many busy entries are in use
_GENERATIONS_OFFSET = 128  # the owner's generation segment's name (see shm.generations), NUL-padded
_ADDR_WORDS_PER_NAME = 4  # the address region holds 4 words per name of capacity
_ROWS_OFFSET = 4096
_ROW_NBYTES = 128
# holder (a ticket the owner draws per connection and sends in the handshake: only that connection pins
# through the row), state, cache slot, generation, name index + 1; the puller's incarnation at +32
_ROW = struct.Struct("<QIIQI")
_ROW_INCARNATION_OFFSET = 32
# The tensors the pin pulls (first, count: a req key's pulled set gains them when the pull ends well) at +40,
# and the tensors it reserved of the name it names (a 512-bit mask: given back if the pull fails) at +64.
_ROW_RANGE = struct.Struct("<II")
_ROW_RANGE_OFFSET = 40
_ROW_MASK_OFFSET = 64
_CACHE_NBYTES = 128
# generation (0 = free), cache_id, flags, batch_size, offset, pitch, tensor_nbytes, num_tensors, seg nbytes
_CACHE = struct.Struct("<QQIIQQQIxxxxQ")
_CACHE_NAME_OFFSET = 64
_NAME_NBYTES = 192
# state, kind, key_id, model_id, cache slot, batch slot, generation, target + 1 (KIND_SLOT), tensor count
# (KIND_REQ: how many bits of the masks a key has); then two 512-bit masks of a req key's tensors: at +64
# the unclaimed ones (neither reserved by a live pin nor pulled), at +128 the pulled ones (copied by a pull
# that ended well). A tensor is in at most one of the two.
_NAME = struct.Struct("<IIQQIIQII")
_NAME_MASK_OFFSET = 64
_NAME_PULLED_OFFSET = 128
_NAME_KEY = struct.Struct("<IIQQ")  # the first four fields of _NAME: state, kind, key_id, model_id
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ROW_HEAD = struct.Struct("<QI")  # the first two fields of _ROW: holder, state

STATE_OPEN = 1
STATE_CLOSED = 2


class CacheEntry(NamedTuple):
    """A cache entry as read (a tuple: a pull builds one, and a tuple is the cheapest thing to build)."""

    slot: int
    generation: int
    cache_id: int
    flags: int
    batch_size: int
    offset: int
    pitch_nbytes: int
    tensor_nbytes: int
    num_tensors: int
    segment: str
    segment_nbytes: int
    addrs: tuple[int, ...] = ()  # registered memory: tensor addresses in the owner's process

    @property
    def registered(self) -> bool:
        return bool(self.flags & CACHE_REGISTERED)

    @property
    def is_blocks(self) -> bool:
        return bool(self.flags & CACHE_BLOCKS)

    @property
    def slot_nbytes(self) -> int:
        return self.tensor_nbytes // self.batch_size

    @classmethod
    def decode(cls, slot: int, raw: bytes, segment: str, addr_words: int) -> CacheEntry | None:
        """Cache entry `slot` from its bytes, its segment's name decoded; None if its fields are not a
        cache's (its `addrs` are read by the caller, from the address region, for registered memory)."""
        (gen, cache_id, flags, batch, base, pitch, tensor_nbytes, count, seg_nbytes) = _CACHE.unpack_from(raw)
        registered = flags & CACHE_REGISTERED
        if (
            not gen
            or batch <= 0
            or count <= 0
            or tensor_nbytes <= 0
            or tensor_nbytes % batch
            or pitch < tensor_nbytes
            or (registered and base + count > addr_words)
            or (not registered and base + pitch * (count - 1) + tensor_nbytes > seg_nbytes)
        ):
            return None
        return cls(slot, gen, cache_id, flags, batch, base, pitch, tensor_nbytes, count, segment, seg_nbytes)

    def tensor_bases(self, tensor_start: int, tensor_count: int) -> tuple[int, ...]:
        """Where tensors [tensor_start, +tensor_count) start: offsets in the segment, or, for registered
        memory, the words of the address region (offsets in the segment it names, else addresses in the
        owner's process)."""
        tensors = range(tensor_start, tensor_start + tensor_count)
        if self.flags & CACHE_REGISTERED:
            return tuple(self.addrs[t] for t in tensors)
        return tuple(self.offset + t * self.pitch_nbytes for t in tensors)


class NameEntry(NamedTuple):
    """A name entry as read."""

    number: int  # its index in the name region
    state: int
    kind: int
    key_id: int
    model_id: int
    cache_slot: int
    batch_slot: int
    generation: int
    target: int  # KIND_SLOT: index of the KIND_REQ name; -1 otherwise
    mask: int  # unclaimed tensors (KIND_REQ): neither reserved by a live pin nor pulled
    pulled: int = 0  # tensors pulled by pulls that ended well (KIND_REQ)

    @classmethod
    def decode(cls, number: int, raw: bytes) -> NameEntry:
        """Name entry `number` from its bytes."""
        state, kind, key_id, model_id, cache_slot, batch_slot, gen, target, _ = _NAME.unpack_from(raw)
        return cls(
            number,
            state,
            kind,
            key_id,
            model_id,
            cache_slot,
            batch_slot,
            gen,
            target - 1,
            _read_mask(raw, _NAME_MASK_OFFSET),
            _read_mask(raw, _NAME_PULLED_OFFSET),
        )


class RowEntry(NamedTuple):
    """A pin row as read."""

    holder: int
    state: int  # 1: pins the cache below
    cache_slot: int
    generation: int
    name: int  # the req key's name the pin pulls from (its reservation and its credit), or -1
    taken: int  # the tensors the pin reserved of that name (given back if the pull fails)
    pulled: int  # the tensors the pin pulls (the name's pulled set gains them if the pull ends well)


def _hash(kind: int, key_id: int, model_id: int) -> int:
    # splitmix64 over the three fields: both sides compute it the same way.
    h = (kind * 0x9E3779B97F4A7C15 + key_id * 0xBF58476D1CE4E5B9 + model_id * 0x94D049BB133111EB) & (
        (1 << 64) - 1
    )
    h ^= h >> 31
    h = (h * 0xD6E8FEB86659FD93) & ((1 << 64) - 1)
    h ^= h >> 32
    return h


def _read_mask(raw: bytes | bytearray | mmap.mmap, offset: int) -> int:
    return int.from_bytes(raw[offset : offset + _MASK_NBYTES], "little")


def _mask_bytes(mask: int) -> bytes:
    return mask.to_bytes(_MASK_NBYTES, "little")


def _write_mask(buffer: bytearray | mmap.mmap, offset: int, mask: int) -> None:
    buffer[offset : offset + _MASK_NBYTES] = _mask_bytes(mask)


def _range_mask(first: int, count: int) -> int:
    """The bitmask of tensors [first, first + count), clamped to the masks' width."""
    first, count = min(first, MAX_MASK_TENSORS), min(count, MAX_MASK_TENSORS)
    return ((1 << count) - 1) << first & ((1 << MAX_MASK_TENSORS) - 1)


def _layout_nbytes(rows: int, caches: int, names: int, buckets: int) -> int:
    return (
        _ROWS_OFFSET
        + rows * _ROW_NBYTES
        + caches * _CACHE_NBYTES
        + names * _NAME_NBYTES
        + buckets * 4
        + names * _ADDR_WORDS_PER_NAME * 8
    )
