"""What a transfer names at its peer (`SourceRef`) and where the peer says that is (`Location`): the one
request value and the one location value of the puller, the owner and the protocol adapters.

Rules: both are frozen. A `SourceRef` is checked by the public faces before it is built; the owner and the
puller check it against the cache it names (`_keys`). `to_message` is the only place a ref is spelled as
a protocol request, `Location.from_pin`/`from_message` the only places a pin or a grant becomes a
location. `tensor_bases[i]` is where tensor i's named bytes start: the slot and source offset of
a v1 pull already added (`slot` is then 0), the tensor's first unit otherwise (`slot` is the unit a key is
bound to). With a `segment`, bases are offsets in it; with segment "", addresses in process `pid`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from llm_datadist._protocol.messages import RULES_V1, RULES_V2, PinRequest
from llm_datadist._protocol.messages import Location as LocationMessage
from llm_datadist._shm.index_layout import CacheEntry

from .._errors import StatusError
from .._keys import KEY_BLOCKS
from ..status import LLMStatusCode

# Which rules name the source: v1 (`pull_cache`/`pull_blocks`: keys on pool memory, a blocks cache only
# by its blocks key, a push into our cluster makes pulls busy) or the cache manager's (v2).
V1 = RULES_V1
V2 = RULES_V2


class SourceRef(NamedTuple):
    """What a pull (or a v2 push) names: a key (`key_kind`, `key_id`, `model_id`) or a cache id and batch
    slot (`batch_index`), tensors [tensor_start, +tensor_count) of it (`whole`: the cache has exactly
    that many), and for v1 pulls `nbytes` of each tensor's slot from `src_offset`. `consume`: a pull that
    ends well consumes what it pulled of a req key. `for_write`: a push into it (consumes nothing). A tuple:
    every pull builds one, and a tuple is the cheapest thing to build."""

    key_kind: int
    key_id: int
    model_id: int
    batch_index: int
    tensor_start: int
    tensor_count: int
    whole: bool
    nbytes: int = 0
    src_offset: int = 0
    consume: bool = False
    for_write: bool = False
    rules: int = V1

    @property
    def v1_key_pull(self) -> bool:
        """A v1 pull of a key (or a cache by id): it names `nbytes` of its slot from `src_offset`."""
        return self.rules == V1 and self.key_kind != KEY_BLOCKS

    def to_message(self, seq: int) -> PinRequest:
        """The request that asks the owner for it (when its index cannot serve it); a `Location` grants
        it."""
        v1_key_pull = self.v1_key_pull
        return PinRequest(
            seq,
            self.key_kind,
            self.key_id,
            self.model_id,
            self.batch_index,
            self.tensor_start,
            self.tensor_count,
            self.whole,
            self.nbytes if v1_key_pull else 0,
            self.src_offset if v1_key_pull else 0,
            self.consume and not self.for_write,
            self.for_write,
            self.rules,
        )


@dataclass(frozen=True, slots=True)
class Location:
    """Where the tensors a `SourceRef` names are, in the owner's memory, and what pins them there
    (`lease_id` > 0: a lease the owner granted by message; 0: a pin through our row of its index)."""

    pid: int
    segment: str
    segment_nbytes: int
    tensor_bases: tuple[int, ...]
    unit_nbytes: int
    num_units: int
    slot: int
    lease_id: int = 0

    @classmethod
    def from_pin(cls, pid: int, cache: CacheEntry, batch_slot: int, ref: SourceRef) -> Location:
        """A cache pinned through our row of the owner's index (`dataplane.pin`)."""
        bases = cache.tensor_bases(ref.tensor_start, ref.tensor_count)
        return cls._named(
            ref,
            pid,
            cache.segment,
            cache.segment_nbytes,
            bases,
            cache.slot_nbytes,
            cache.batch_size,
            batch_slot,
        )

    @classmethod
    def from_message(cls, pid: int, msg: LocationMessage, ref: SourceRef) -> Location:
        """A grant of the owner (a lease), checked against what was asked. A v1 pull of a key reads its
        `ref.nbytes` from `ref.src_offset` of the granted slot, which must hold them."""
        if len(msg.tensor_bases) != ref.tensor_count:
            raise _other_range()
        if ref.v1_key_pull and (
            msg.pid != pid or not msg.segment or ref.src_offset + ref.nbytes > msg.unit_nbytes
        ):
            raise _other_range()
        return cls._named(
            ref,
            msg.pid,
            msg.segment,
            msg.segment_nbytes,
            msg.tensor_bases,
            msg.unit_nbytes,
            msg.num_units,
            msg.slot,
            msg.lease_id,
        )

    @classmethod
    def _named(
        cls,
        ref: SourceRef,
        pid: int,
        segment: str,
        segment_nbytes: int,
        bases: tuple[int, ...],
        unit_nbytes: int,
        num_units: int,
        slot: int,
        lease_id: int = 0,
    ) -> Location:
        """Where `ref` reads in tensors at `bases` of `num_units` units, `slot` the unit its key names: for a
        v1 pull of a key, each tensor's bytes in that slot from `ref.src_offset` (`slot` then 0); else the
        tensors' first units."""
        if ref.v1_key_pull:
            shift = slot * unit_nbytes + ref.src_offset
            bases, slot = tuple(base + shift for base in bases), 0
        return cls(pid, segment, segment_nbytes, bases, unit_nbytes, num_units, slot, lease_id)


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

    def location(self, tensor_start: int, tensor_count: int) -> Location:
        return Location(
            self.pid,
            self.segment,
            self.segment_nbytes,
            self.tensor_bases[tensor_start : tensor_start + tensor_count],
            self.unit_nbytes,
            self.num_units,
            0,
        )


@dataclass
class RemoteTable:
    """A peer's remote-accessible caches, fetched once per link (as the real library caches it), with the
    version word it was fetched at (0: unknown, refetch before trusting its model ids)."""

    caches: dict[int, RemoteCache]
    blocks: dict[int, int]
    generations: str = ""
    version: int = 0


def _other_range() -> StatusError:
    return StatusError(LLMStatusCode.LLM_FAILED, "peer granted a different range than requested")
