"""The push plans of `transfer_cache_async` (v1, and v2 without remote cache access): how each pushed tensor
of our pool cache lands in the range the peer named for it, planned once per TransferConfig and turned into
`PushSpan`s (`movers`) as each layer is pushed (`Transfers.push`).

Rules: pure arithmetic on offsets the caller has checked (every index, size and count, before anything is
planned); source offsets are relative to a tensor, destination offsets to the span. Nothing here moves a
byte, pins anything or raises a public error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llm_datadist._shm.copyplan import Run, plan_block_copy

from .._owner.records import CacheRecord
from .movers import PushSpan


@dataclass(frozen=True)
class TensorPush:
    """How one tensor lands at the peer: `runs` (source offsets from the tensor's start, destination
    offsets from the span's) into a span of `span_nbytes` that starts `dst_offset` bytes past the address
    the peer named for the tensor. The same for every tensor of a TransferConfig."""

    runs: tuple[Run, ...]
    span_nbytes: int
    dst_offset: int

    def spans(self, src: CacheRecord, tensors: Sequence[int], dst_addrs: Sequence[int]) -> list[PushSpan]:
        """What pushes tensor `tensors[i]` of `src` (a pool cache) to the peer's address `dst_addrs[i]`."""
        spans = []
        for tensor, dst_addr in zip(tensors, dst_addrs, strict=True):
            base = src.tensor_offset(tensor)
            runs = tuple(Run(base + run.src_offset, run.dst_offset, run.nbytes) for run in self.runs)
            spans.append(PushSpan(dst_addr + self.dst_offset, self.span_nbytes, runs))
        return spans


def blocks_push(
    src_blocks: Sequence[int], dst_blocks: Sequence[int], block_nbytes: int, dst_block_nbytes: int
) -> TensorPush:
    """Blocks to blocks: block `src_blocks[k]` to block `dst_blocks[k]` of `dst_block_nbytes` (at least a
    block) at the peer; the span runs from the lowest destination block to the end of the highest."""
    low = min(dst_blocks)
    runs = plan_block_copy(
        [0], [0], src_blocks, [d - low for d in dst_blocks], block_nbytes, dst_block_nbytes, block_nbytes
    )
    span_nbytes = (max(dst_blocks) - low) * dst_block_nbytes + block_nbytes
    return TensorPush(tuple(runs), span_nbytes, low * dst_block_nbytes)


def slot_push(slot_offset: int, slot_nbytes: int) -> TensorPush:
    """A continuous slot (at `slot_offset` of each tensor) to the peer's continuous memory, whole."""
    return TensorPush((Run(slot_offset, 0, slot_nbytes),), slot_nbytes, 0)


def slot_to_blocks_push(
    slot_offset: int, slot_nbytes: int, dst_blocks: Sequence[int], piece_nbytes: int
) -> TensorPush:
    """A continuous slot cut into pieces of `piece_nbytes`: piece k to block `dst_blocks[k]` at the peer
    (the last piece may be short; blocks past the slot's end get nothing)."""
    low = min(dst_blocks)
    pieces = [
        Run(
            slot_offset + k * piece_nbytes,
            (d - low) * piece_nbytes,
            min(piece_nbytes, slot_nbytes - k * piece_nbytes),
        )
        for k, d in enumerate(dst_blocks)
        if k * piece_nbytes < slot_nbytes
    ]
    span_nbytes = max(run.dst_offset + run.nbytes for run in pieces)
    return TensorPush(tuple(pieces), span_nbytes, low * piece_nbytes)
