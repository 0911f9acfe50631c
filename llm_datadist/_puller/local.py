"""Local copies: tensors or blocks of one cache into another of this process (`copy_cache`, `copy_blocks`
and `swap_blocks` of v1 and v2), each planned once with numpy (`shm.copyplan`) and run by the copier, with
no Python loop per block.

Rules: the caller has checked every index and size against both caches and holds both pinned for the
call (a cpu cache is memory the caller owns and pins nothing); everything here takes plain values (arrays
or addresses, block lists, offsets, the copier) and never looks a cache up, pins or raises a public error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from llm_datadist._shm.copyplan import plan_block_copy, plan_tensor_copy

from .._native import address_view
from .copy import Copier

Bytes = npt.NDArray[np.uint8]


def copy_ranges(
    copier: Copier,
    src: Bytes,
    dst: Bytes,
    src_offsets: Sequence[int],
    dst_offsets: Sequence[int],
    nbytes: int,
) -> None:
    """`nbytes` from each `src_offsets[t]` of `src` to `dst_offsets[t]` of `dst`, one plan for every tensor
    (v1 `copy_cache`: the same bytes of a slot, tensor by tensor)."""
    copier.run(plan_tensor_copy(src_offsets, dst_offsets, nbytes), src, dst)


def copy_blocks(
    copier: Copier,
    src: Bytes,
    dst: Bytes,
    src_tensor_offsets: Sequence[int],
    dst_tensor_offsets: Sequence[int],
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    block_nbytes: int,
) -> None:
    """Block `src_blocks[k]` of each tensor of `src` (tensor t at `src_tensor_offsets[t]`) to block
    `dst_blocks[k]` of the matching tensor of `dst`, one plan for every tensor (v1 `copy_blocks`: `src`
    and `dst` one segment)."""
    runs = plan_block_copy(
        src_tensor_offsets,
        dst_tensor_offsets,
        src_blocks,
        dst_blocks,
        block_nbytes,
        block_nbytes,
        block_nbytes,
    )
    copier.run(runs, src, dst)


def swap_host_blocks(
    copier: Copier,
    segment: Bytes,
    tensor_offsets: Sequence[int],
    host_addrs: Sequence[int],
    host_tensor_nbytes: int,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    block_nbytes: int,
    *,
    to_host: bool,
) -> None:
    """Blocks between a cache's segment (tensor t at `tensor_offsets[t]`) and the caller's memory (tensor t
    at address `host_addrs[t]`, `host_tensor_nbytes` long): block `src_blocks[k]` to `dst_blocks[k]`, out
    to the host when `to_host`, in from it otherwise; one plan per tensor (v1 `swap_blocks`)."""
    for device_offset, host_addr in zip(tensor_offsets, host_addrs, strict=True):
        host = address_view(host_addr, host_tensor_nbytes)
        if to_host:
            copy_blocks(copier, segment, host, [device_offset], [0], src_blocks, dst_blocks, block_nbytes)
        else:
            copy_blocks(copier, host, segment, [0], [device_offset], src_blocks, dst_blocks, block_nbytes)


@dataclass(frozen=True, slots=True)
class TensorAddrs:
    """The tensors of one cache by address in this process (a pool cache, registered memory or a cpu
    cache): each `span_nbytes` long, cut into units of `unit_nbytes` (a slot or a block)."""

    addrs: Sequence[int]
    span_nbytes: int
    unit_nbytes: int


def copy_units_at(
    copier: Copier,
    src: TensorAddrs,
    dst: TensorAddrs,
    src_units: Sequence[int],
    dst_units: Sequence[int],
    nbytes: int,
    offset: int = 0,
) -> None:
    """`nbytes` at `offset` of unit `src_units[k]` to the same place of unit `dst_units[k]`, in every pair of
    tensors, through address views (v2's copies: pool caches, registered memory and cpu caches alike); one
    plan per pair of tensors."""
    for src_addr, dst_addr in zip(src.addrs, dst.addrs, strict=True):
        runs = plan_block_copy(
            [offset], [offset], src_units, dst_units, src.unit_nbytes, dst.unit_nbytes, nbytes
        )
        copier.run(runs, address_view(src_addr, src.span_nbytes), address_view(dst_addr, dst.span_nbytes))
