"""`CacheManager`'s copies inside this process: `copy_cache`, `copy_blocks` and `swap_blocks`.

Rules: both sides are pinned for the copy (a cpu cache of `swap_blocks` is memory the caller owns and
pins nothing); ranges are checked against both caches before any byte moves; the copy itself is the
library's (`_puller.local.copy_units_at`: through address views, one plan per pair of tensors).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._core import PLACEMENT_DEVICE, PLACEMENT_HOST
from .._puller.local import TensorAddrs, copy_units_at
from .._validate import (
    check_int64,
    check_isinstance,
    check_uint32,
    check_uint64,
)
from .cache import Cache
from .llm_types import (
    Placement,
)

if TYPE_CHECKING:
    from .._core import Core
from ._base import ManagerBase, _invalid


class Copies(ManagerBase):
    """The local copies of `CacheManager`."""

    def copy_cache(
        self,
        dst: Cache,
        src: Cache,
        dst_batch_index: int = 0,
        src_batch_index: int = 0,
        offset: int = 0,
        size: int = -1,
        req_id: int | None = None,
    ) -> None:
        """Copy one slot of every tensor between two non-blocks caches of this process (pool or registered);
        `offset` < slot; `size` -1 means slot - offset. `req_id` is only logged."""
        api = "copy_cache"
        core = self._require_core(api)
        check_uint32("dst_batch_index", dst_batch_index)
        check_uint32("src_batch_index", src_batch_index)
        check_uint64("offset", offset)
        check_int64("size", size)
        if req_id is not None:
            check_uint64("req_id", req_id)
        dst_record = self._record_of(api, core, dst, "dst")
        src_record = self._record_of(api, core, src, "src")
        if dst_record.is_blocks or src_record.is_blocks:
            _invalid(api, "copy_cache does not take blocks caches")
        if (
            dst_record.num_tensors != src_record.num_tensors
            or dst_record.slot_nbytes != src_record.slot_nbytes
        ):
            _invalid(api, "the caches differ in tensor count or slot size")
        slot = src_record.slot_nbytes
        if dst_batch_index >= dst_record.batch_size or src_batch_index >= src_record.batch_size:
            _invalid(api, "batch index out of range")
        if offset >= slot:
            _invalid(api, f"offset {offset} must be smaller than the slot ({slot} bytes)")
        nbytes = slot - offset if size == -1 else size
        if nbytes <= 0 or offset + nbytes > slot:
            _invalid(api, f"size {size} does not fit the slot after offset {offset}")
        with (
            self._timeout_errors(api),
            core.pins.pinned(src_record.cache_id),
            core.pins.pinned(dst_record.cache_id),
        ):
            copy_units_at(
                core.copier,
                TensorAddrs(src_record.tensor_addrs(), src_record.tensor_nbytes, slot),
                TensorAddrs(dst_record.tensor_addrs(), dst_record.tensor_nbytes, slot),
                [src_batch_index],
                [dst_batch_index],
                nbytes,
                offset,
            )

    def copy_blocks(self, cache: Cache, copy_block_info: dict[int, list[int]]) -> None:
        """Within one blocks cache, copy block `src` to each listed destination block, in every tensor."""
        api = "copy_blocks"
        core = self._require_core(api)
        check_isinstance("copy_block_info", copy_block_info, dict)
        pairs: list[tuple[int, int]] = []
        for src_block, dst_blocks in copy_block_info.items():
            check_uint64("copy_block_info", src_block)
            check_isinstance("copy_block_info", dst_blocks, list)
            for dst_block in dst_blocks:
                check_uint64("copy_block_info", dst_block)
                pairs.append((src_block, dst_block))
        record = self._record_of(api, core, cache)
        if not record.is_blocks:
            _invalid(api, "copy_blocks takes a blocks cache")
        if any(max(pair) >= record.batch_size for pair in pairs):
            _invalid(api, f"block index out of range ({record.batch_size} blocks)")
        destinations = [d for _, d in pairs]
        if len(set(destinations)) != len(destinations) or set(destinations) & set(copy_block_info):
            _invalid(api, "a destination block is listed twice or is also a source")
        if not pairs:
            return
        block = record.slot_nbytes
        with self._timeout_errors(api), core.pins.pinned(record.cache_id):
            tensors = TensorAddrs(record.tensor_addrs(), record.tensor_nbytes, block)
            copy_units_at(core.copier, tensors, tensors, [s for s, _ in pairs], destinations, block)

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: dict[int, int]) -> None:
        """Copy blocks `src -> dst` between two blocks caches, HOST -> DEVICE or DEVICE -> HOST by their
        placements, as the real `swap_blocks`: pool, registered or cpu caches (`Cache.create_cpu_cache`,
        memory the caller owns). Checked in the real order: both blocks caches, the same block size and
        tensor count, indices in `[0, blocks)`, then the placements (all LLM_PARAM_INVALID)."""
        api = "swap_blocks"
        core = self._require_core(api)
        check_isinstance("src", src_cache, Cache)
        check_isinstance("dst", dst_cache, Cache)
        if not src_cache.is_blocks_cache:
            _invalid(api, "param check failed, src cache should be blocks cache.")
        if not dst_cache.is_blocks_cache:
            _invalid(api, "param check failed, dst cache should be blocks cache.")
        check_isinstance("src_to_dst", src_to_dst, dict)
        for src_block, dst_block in src_to_dst.items():
            check_isinstance("src_to_dst", src_block, int)
            check_isinstance("src_to_dst", dst_block, int)
        src = self._swap_side(api, core, src_cache, "src")
        dst = self._swap_side(api, core, dst_cache, "dst")
        if src.block_nbytes != dst.block_nbytes:
            _invalid(
                api, f"src block size:{src.block_nbytes} and dst block size:{dst.block_nbytes} must be equal"
            )
        if src.num_tensors != dst.num_tensors:
            _invalid(
                api, f"src num_tensors:{src.num_tensors} and dst num_tensors:{dst.num_tensors} must be equal"
            )
        for src_block, dst_block in src_to_dst.items():
            if not 0 <= src_block < src.num_blocks:
                _invalid(api, f"src_block_index:{src_block} must be in [0, {src.num_blocks})")
            if not 0 <= dst_block < dst.num_blocks:
                _invalid(api, f"dst_block_index:{dst_block} must be in [0, {dst.num_blocks})")
        if {src.placement, dst.placement} != {PLACEMENT_HOST, PLACEMENT_DEVICE}:
            _invalid(
                api,
                f"swap src placement:{Placement(src.placement)} to dst placement:{Placement(dst.placement)} "
                "is not support",
            )
        src_units, dst_units = list(src_to_dst), list(src_to_dst.values())
        if len(set(dst_units)) != len(dst_units):
            _invalid(api, "a destination block is named twice")
        if not src_units:
            return
        with self._timeout_errors(api), contextlib.ExitStack() as pins:
            for side in (src, dst):
                if side.cache_id is not None:
                    pins.enter_context(core.pins.pinned(side.cache_id))
            copy_units_at(core.copier, src.tensors(), dst.tensors(), src_units, dst_units, src.block_nbytes)

    def _swap_side(self, api: str, core: Core, cache: Cache, name: str) -> _SwapSide:
        """One side of swap_blocks: a cpu cache (cache_id -1: the caller's memory, as its descriptor says)
        or a live cache of this process (its record)."""
        if cache.cache_id == -1:
            desc = cache.cache_desc
            addrs = list(cache.tensor_addrs)
            if len(addrs) != desc.num_tensors:
                _invalid(api, f"{name}: {len(addrs)} addresses for {desc.num_tensors} tensors")
            blocks = desc.shape[0]
            return _SwapSide(
                None, addrs, desc.size // blocks, blocks, desc.num_tensors, desc.size, int(desc.placement)
            )
        record = self._record_of(api, core, cache, name)
        return _SwapSide(
            record.cache_id,
            record.tensor_addrs(),
            record.slot_nbytes,
            record.batch_size,
            record.num_tensors,
            record.tensor_nbytes,
            record.placement,
        )


@dataclass(frozen=True, slots=True)
class _SwapSide:
    """One cache of a swap_blocks call: its tensors' addresses and block layout; `cache_id` None for a cpu
    cache (memory the caller owns, nothing to pin)."""

    cache_id: int | None
    addrs: list[int]
    block_nbytes: int
    num_blocks: int
    num_tensors: int
    span_nbytes: int
    placement: int

    def tensors(self) -> TensorAddrs:
        """The side's tensors as `_puller.local` copies them: by address, a block a unit."""
        return TensorAddrs(self.addrs, self.span_nbytes, self.block_nbytes)
