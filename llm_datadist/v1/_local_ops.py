"""The local copies of v1: `copy_cache` (slot to slot), `copy_blocks` (within one blocks cache) and
`swap_blocks` (blocks between a user-owned HOST cpu cache and a DEVICE cache of this process).

Rules: every argument is checked before a byte moves; device caches are pinned for the copy (a concurrent
deallocate cannot free them mid-copy); the copy itself is the library's (`_puller.local`: one plan of
contiguous runs, run by `core.copier`, with no Python loop per block per tensor)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NoReturn

from .._errors import api_errors
from .._owner.records import CacheRecord
from .._puller import local as _local
from .._validate import check_dict, check_int64, check_isinstance, check_items, check_uint32, check_uint64
from ..status import LLMStatusCode, make_error
from ..utils.log import log
from ..v2.cache import KvCache
from ..v2.llm_types import Placement

if TYPE_CHECKING:
    from .._core import Core


def _invalid(api: str, context: str) -> NoReturn:
    raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, context)


def _is_host(cache: KvCache) -> bool:
    return cache.cache_id == -1 or cache.cache_desc.placement == Placement.HOST


def _device_record(api: str, core: Core, name: str, cache: KvCache) -> CacheRecord:
    """The live record of a DEVICE cache that this manager (this `Core`) allocated; PARAM_INVALID otherwise.

    A handle from an earlier `init` of this process is rejected even when a new cache reuses its id."""
    if _is_host(cache):
        _invalid(api, f"{name} is a host (cpu) cache, {api} supports device caches only")
    owner_core = getattr(cache._kv_cache_manager, "_core", None)
    record: CacheRecord | None = None
    if cache._is_valid and owner_core is core:
        record = core.table.get(cache.cache_id)
    if record is None or not record.external:
        _invalid(api, f"{name} (cache {cache.cache_id}) is not a valid cache of this process")
    return record


def _first_repeat(values: list[int]) -> int | None:
    seen: set[int] = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    return None


@contextmanager
def _pinned(api: str, core: Core, *records: CacheRecord) -> Iterator[list[CacheRecord]]:
    """Pin `records` (the same one twice is fine) for the duration of a copy; always unpinned."""
    with contextlib.ExitStack() as stack:
        with api_errors(api):
            pinned = [stack.enter_context(core.pins.pinned(record.cache_id)) for record in records]
        yield pinned


def copy_cache(
    api: str,
    core: Core,
    dst: KvCache,
    src: KvCache,
    dst_batch_index: int,
    src_batch_index: int,
    offset: int,
    size: int,
    req_id: int | None,
) -> None:
    """Copy bytes [offset, offset + size) of slot `src_batch_index` to the same bytes of slot
    `dst_batch_index`, in every tensor. `size` -1 means the slot minus `offset`.

    Checks as the real v1 Python layer: `dst`/`src` KvCache (TypeError) and not HOST, batch indices uint32,
    `offset` uint64, `size` int64 (TypeError/ValueError), `size` -1 or > 0, `req_id` None or uint64. Then,
    as the engine: both are live device caches of this process, slot indices below each cache's
    `shape[0]`, the same tensor count and slot size ("compatible descs"), `offset` below the slot size and
    `offset + size` within it (PARAM_INVALID). Blocks caches are rejected (PARAM_INVALID): v1 does not
    document it, v2 does. `src` may be `dst` (same slot: a no-op copy). `req_id` is only logged.
    """
    check_isinstance("dst", dst, KvCache)
    if _is_host(dst):
        _invalid(api, "dst is a host (cpu) cache, only device caches are supported")
    check_isinstance("src", src, KvCache)
    if _is_host(src):
        _invalid(api, "src is a host (cpu) cache, only device caches are supported")
    check_uint32("dst_batch_index", dst_batch_index)
    check_uint32("src_batch_index", src_batch_index)
    check_uint64("offset", offset)
    check_int64("size", size)
    if req_id is not None:
        check_uint64("req_id", req_id)
    if size != -1 and size <= 0:
        _invalid(api, f"size ({size}) is invalid, should be = -1 or > 0")

    dst_record = _device_record(api, core, "dst", dst)
    src_record = _device_record(api, core, "src", src)
    for name, record, slot in (("dst", dst_record, dst_batch_index), ("src", src_record, src_batch_index)):
        if record.is_blocks:
            _invalid(api, f"{name} (cache {record.cache_id}) is a blocks cache, use copy_blocks")
        if slot >= record.batch_size:
            _invalid(api, f"{name}_batch_index {slot} out of range, [0, {record.batch_size})")
    if dst_record.num_tensors != src_record.num_tensors:
        _invalid(api, f"dst has {dst_record.num_tensors} tensors, src has {src_record.num_tensors}")
    slot_nbytes = src_record.slot_nbytes
    if dst_record.slot_nbytes != slot_nbytes:
        _invalid(api, f"dst slot is {dst_record.slot_nbytes} bytes, src slot is {slot_nbytes} bytes")
    if offset >= slot_nbytes:
        _invalid(api, f"offset {offset} out of range, the slot is {slot_nbytes} bytes")
    nbytes = slot_nbytes - offset if size == -1 else size
    if offset + nbytes > slot_nbytes:
        _invalid(api, f"offset {offset} + size {nbytes} exceeds the slot of {slot_nbytes} bytes")

    log.debug(
        "[%s] dst cache %d slot %d <- src cache %d slot %d, offset %d, %d bytes per tensor, req_id %s",
        api,
        dst_record.cache_id,
        dst_batch_index,
        src_record.cache_id,
        src_batch_index,
        offset,
        nbytes,
        req_id,
    )
    with _pinned(api, core, src_record, dst_record) as (src_pinned, dst_pinned):
        src_base = src_batch_index * slot_nbytes + offset
        dst_base = dst_batch_index * slot_nbytes + offset
        with api_errors(api):
            _local.copy_ranges(
                core.copier,
                src_pinned.pool_block.segment.array,
                dst_pinned.pool_block.segment.array,
                [src_pinned.tensor_offset(t) + src_base for t in range(src_pinned.num_tensors)],
                [dst_pinned.tensor_offset(t) + dst_base for t in range(dst_pinned.num_tensors)],
                nbytes,
            )


def copy_blocks(api: str, core: Core, cache: KvCache, copy_block_info: dict[int, list[int]]) -> None:
    """Within one blocks cache, copy block `src` to every block of `copy_block_info[src]`, in every tensor.

    Checks as the real v1 Python layer: `cache` a KvCache, `copy_block_info` a dict of int to list of int
    (TypeError), every index uint64 (ValueError when negative), a device cache (PARAM_INVALID). Then: a live
    blocks cache of this process (v1 does not say; the v2 rule), every index below the number of blocks,
    and (our choice, the reference is silent) no destination listed twice and no destination that is also
    a source in the same call, since the result would depend on the copy order (all PARAM_INVALID).
    An empty dict, or empty destination lists, copy nothing.
    """
    check_isinstance("cache", cache, KvCache)
    check_dict("copy_block_info", copy_block_info, int, list)
    for dst_blocks in copy_block_info.values():
        check_items("copy_block_info", dst_blocks, int)
    if _is_host(cache):
        _invalid(api, "cache is a host (cpu) cache, only device caches are supported")
    src_blocks: list[int] = []
    dst_blocks_flat: list[int] = []
    for src_block, dst_blocks in copy_block_info.items():
        check_uint64("src_block", src_block)
        for dst_block in dst_blocks:
            check_uint64("dst_block", dst_block)
        src_blocks.extend([src_block] * len(dst_blocks))
        dst_blocks_flat.extend(dst_blocks)

    record = _device_record(api, core, "cache", cache)
    if not record.is_blocks:
        _invalid(api, f"cache {record.cache_id} is not a blocks cache")
    num_blocks = record.batch_size
    for src_block in copy_block_info:
        if src_block >= num_blocks:
            _invalid(api, f"src block index {src_block} out of range, [0, {num_blocks})")
    for dst_block in dst_blocks_flat:
        if dst_block >= num_blocks:
            _invalid(api, f"dst block index {dst_block} out of range, [0, {num_blocks})")
    repeated = _first_repeat(dst_blocks_flat)
    if repeated is not None:
        _invalid(api, f"dst block {repeated} is listed more than once")
    both = set(dst_blocks_flat).intersection(copy_block_info)
    if both:
        _invalid(api, f"block {min(both)} is both a source and a destination")
    if not dst_blocks_flat:
        return

    with _pinned(api, core, record) as (pinned,):
        offsets = [pinned.tensor_offset(t) for t in range(pinned.num_tensors)]
        array = pinned.pool_block.segment.array
        with api_errors(api):
            _local.copy_blocks(
                core.copier, array, array, offsets, offsets, src_blocks, dst_blocks_flat, pinned.slot_nbytes
            )


def _host_tensors(api: str, name: str, cache: KvCache) -> tuple[list[int], int, int, int]:
    """(one address per tensor of the caller's memory, tensor nbytes, block count, block nbytes) of a cpu
    cache."""
    if cache.cache_id != -1 or cache.cache_desc.placement != Placement.HOST:
        _invalid(api, f"{name} is not a cpu cache (KvCache.create_cpu_cache, placement HOST)")
    desc = cache.cache_desc
    shape = list(desc.shape)
    if not shape or any(dim <= 0 for dim in shape):
        _invalid(api, f"{name} shape {shape} must have positive dimensions")
    addrs_per_device = cache.per_device_tensor_addrs
    if len(addrs_per_device) != 1:
        _invalid(api, f"{name} has addresses for {len(addrs_per_device)} devices, one is supported")
    addrs = addrs_per_device[0]
    if len(addrs) != desc.num_tensors or desc.num_tensors == 0:
        _invalid(api, f"{name} has {len(addrs)} addresses for {desc.num_tensors} tensors")
    tensor_nbytes = desc.size
    return list(addrs), tensor_nbytes, shape[0], tensor_nbytes // shape[0]


def swap_blocks(api: str, core: Core, src: KvCache, dst: KvCache, src_to_dst: dict[int, int]) -> None:
    """Copy block `k` of `src` to block `src_to_dst[k]` of `dst`, in every tensor, where one side is a
    HOST cpu cache (`KvCache.create_cpu_cache`: memory the caller owns in this process, addressed by raw
    pointers that must stay valid for the call) and the other a DEVICE cache of this process. Both count
    as blocks caches of `size // shape[0]` bytes per block, blocks or not: swap-out is device to host,
    swap-in host to device.

    Checks: KvCache arguments and a dict of int to int (TypeError); then (PARAM_INVALID) exactly one HOST
    and one DEVICE side, equal block sizes and tensor counts, every index in [0, shape[0]) of its side,
    a cpu cache with one address list of `num_tensors` entries, and (our choice, the reference is silent)
    no destination block named twice, since the result would depend on the copy order. The real library
    swaps out with 4 threads and stages swap-in through device buffers; here both are one plan per tensor
    run by the copier.
    """
    check_isinstance("src", src, KvCache)
    check_isinstance("dst", dst, KvCache)
    check_dict("src_to_dst", src_to_dst, int, int)
    src_is_host, dst_is_host = _is_host(src), _is_host(dst)
    if src_is_host == dst_is_host:
        side = "host" if src_is_host else "device"
        _invalid(api, f"src and dst are both {side} caches, one must be HOST and the other DEVICE")

    host_cache, device_cache = (src, dst) if src_is_host else (dst, src)
    host_name, device_name = ("src", "dst") if src_is_host else ("dst", "src")
    record = _device_record(api, core, device_name, device_cache)
    host_addrs, host_tensor_nbytes, host_num_blocks, host_block_nbytes = _host_tensors(
        api, host_name, host_cache
    )
    if host_block_nbytes != record.slot_nbytes:
        _invalid(
            api,
            f"{host_name} block size {host_block_nbytes} and {device_name} block size "
            f"{record.slot_nbytes} must be equal",
        )
    if len(host_addrs) != record.num_tensors:
        _invalid(
            api,
            f"{host_name} num_tensors {len(host_addrs)} and {device_name} num_tensors "
            f"{record.num_tensors} must be equal",
        )
    src_num_blocks, dst_num_blocks = (
        (host_num_blocks, record.batch_size) if src_is_host else (record.batch_size, host_num_blocks)
    )
    src_blocks = list(src_to_dst)
    dst_blocks = list(src_to_dst.values())
    for src_block in src_blocks:
        if not 0 <= src_block < src_num_blocks:
            _invalid(api, f"src block index {src_block} out of range, [0, {src_num_blocks})")
    for dst_block in dst_blocks:
        if not 0 <= dst_block < dst_num_blocks:
            _invalid(api, f"dst block index {dst_block} out of range, [0, {dst_num_blocks})")
    repeated = _first_repeat(dst_blocks)
    if repeated is not None:
        _invalid(api, f"dst block {repeated} is named more than once")
    if not src_blocks:
        return

    block_nbytes = record.slot_nbytes
    log.debug(
        "[%s] %s %d blocks of %d bytes", api, "in" if src_is_host else "out", len(src_blocks), block_nbytes
    )
    with _pinned(api, core, record) as (pinned,), api_errors(api):
        _local.swap_host_blocks(
            core.copier,
            pinned.pool_block.segment.array,
            [pinned.tensor_offset(t) for t in range(len(host_addrs))],
            host_addrs,
            host_tensor_nbytes,
            src_blocks,
            dst_blocks,
            block_nbytes,
            to_host=not src_is_host,
        )
