"""What registration takes and what then guards it: memory that is not this process's own, readable and
writable, for every byte its description claims, is registered as the real library registers device
memory, and every transfer of ours that touches it fails (LLM_PARAM_INVALID, naming the tensor) rather
than read or write beyond it; a cache key that sets both req_id and prefix_id is refused where it is
bound, as every pull of it would be. (`test_unchecked_registration.py` has a peer's pull and memory that
goes after registration.)"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest

from llm_datadist import (
    CacheDesc,
    CacheKey,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)
from llm_datadist._errors import StatusError
from llm_datadist._procmaps import mappings, require_mapped

U64_MAX = 2**64 - 1


def _v2(role: LLMRole = LLMRole.PROMPT) -> LLMDataDist:
    dd = LLMDataDist(role, 1)
    config = LLMConfig()
    config.device_id = 0
    options = dict(config.generate_options())
    options.update({"llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "1"})
    options["llm.MemPoolConfig"] = '{"memory_size": 16777216, "page_shift": 16}'
    dd.init(options)
    return dd


def _v1() -> LLMDataDist:
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = f"127.0.0.1:{26500 + os.getpid() % 1000}"
    dd.init(config.generate_options())
    return dd


def _mapping_then_hole(nbytes: int) -> int:
    """The address of `nbytes` of fresh memory followed by 64 KiB that nothing maps."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    address = libc.mmap(None, nbytes + (64 << 10), mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    assert address not in (None, ctypes.c_void_p(-1).value)
    assert libc.munmap(address + nbytes, 64 << 10) == 0
    return int(address)


def test_a_buffer_shorter_than_its_description_is_registered_and_no_transfer_passes_its_end() -> None:
    dd = _v2()
    buffer = _mapping_then_hole(1 << 20)  # 1 MiB, then nothing
    try:
        manager = dd.cache_manager
        too_large = CacheDesc(1, [8, 136 << 10], DataType.DT_INT8)  # 8 blocks of 136 KiB: 1,088 KiB
        cache = manager.register_blocks_cache(too_large, [buffer], None, True)
        with pytest.raises(LLMException) as info:
            manager.copy_blocks(cache, {0: [7]})  # the last block lies past the mapping
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert "tensor 0" in str(info.value) and str(8 * (136 << 10)) in str(info.value)
        manager.unregister_cache(cache.cache_id)
        # As large as its description says: transfers go through.
        fits = CacheDesc(1, [8, 128 << 10], DataType.DT_INT8)
        cache = manager.register_blocks_cache(fits, [buffer], None, True)
        manager.copy_blocks(cache, {0: [7]})
        manager.unregister_cache(cache.cache_id)
    finally:
        dd.finalize()
        ctypes.CDLL(None).munmap(ctypes.c_void_p(buffer), ctypes.c_size_t(1 << 20))


def test_memory_that_cannot_be_written_is_registered_and_never_written() -> None:
    dd = _v2()
    readonly = mmap.mmap(-1, 1 << 16, prot=mmap.PROT_READ)
    try:
        manager = dd.cache_manager
        address = np.frombuffer(readonly, dtype=np.uint8).ctypes.data
        desc = CacheDesc(1, [1, 1 << 16], DataType.DT_INT8)
        cache = manager.register_cache(desc, [address])
        pool = manager.allocate_cache(desc)
        with pytest.raises(LLMException) as info:
            manager.copy_cache(cache, pool)
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert "readable and writable" in str(info.value)
        manager.unregister_cache(cache.cache_id)
        manager.deallocate_cache(pool)
    finally:
        dd.finalize()
        readonly.close()


def test_the_mapping_check_walks_adjacent_mappings_and_stops_at_a_hole() -> None:
    region = mmap.mmap(-1, 3 << 16)
    try:
        base = np.frombuffer(region, dtype=np.uint8).ctypes.data
        require_mapped([(base, 3 << 16), (base + 4097, 3333)], what="range", writable=True)
        starts = {m.start for m in mappings()}
        ends = {m.end for m in mappings()}
        hole = next(end for end in sorted(ends) if end not in starts)  # the first byte nothing maps
        with pytest.raises(StatusError) as info:
            require_mapped([(base, 16), (hole - 16, 32)], what="range", writable=False)
        assert info.value.code == LLMStatusCode.LLM_PARAM_INVALID and "range 1" in info.value.detail
        require_mapped([(hole, 0)], what="range", writable=False)  # an empty range is inside anything
    finally:
        region.close()


@pytest.mark.parametrize("generation", ["v1", "v2"])
def test_a_key_with_both_req_id_and_prefix_id_is_refused_at_allocation(generation: str) -> None:
    dd = _v1() if generation == "v1" else _v2()
    try:
        desc = CacheDesc(2, [1, 4096], DataType.DT_INT8)
        allocate = (
            dd.kv_cache_manager.allocate_cache if generation == "v1" else dd.cache_manager.allocate_cache
        )
        with pytest.raises(LLMException) as info:
            allocate(desc, [CacheKey(1, 0, prefix_id=5)])
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert "not both" in str(info.value)
        # The prefix key a pull can name, and a padding key, are bound as before.
        cache = allocate(desc, [CacheKey(1, U64_MAX, prefix_id=5)])
        padded = allocate(CacheDesc(2, [2, 4096], DataType.DT_INT8), [CacheKey(1, U64_MAX), CacheKey(1, 3)])
        if generation == "v1":
            dd.kv_cache_manager.deallocate_cache(cache)
            dd.kv_cache_manager.deallocate_cache(padded)
        else:
            dd.cache_manager.deallocate_cache(cache)
            dd.cache_manager.deallocate_cache(padded)
    finally:
        dd.finalize()
