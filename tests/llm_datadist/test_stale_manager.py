"""A manager outlives the `LLMDataDist` it came from: after `finalize`, every operation of the old manager
raises `LLMException(LLM_ENGINE_FINALIZED)` and touches nothing (hixl 2026,
`test_cache_manager_lifecycle.py`); so it stays after the same instance is initialised again and after
another instance is made, and a second `finalize` is harmless. v2's seventeen operations, each in its cache
and blocks forms, and v1's."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    MemInfo,
    Memtype,
    Placement,
    TransferConfig,
)
from llm_datadist._shm.reaper import list_segments

SHAPE = [4, 256]


class _Go(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        raise AssertionError("a finalized manager started a transfer")


def _options(v2: bool) -> dict[str, str]:
    config = LLMConfig()
    config.device_id = 0
    options = dict(config.generate_options())
    if v2:
        options["llm.EnableCacheManager"] = "1"
        options["llm.MemPoolConfig"] = json.dumps({"memory_size": 16 << 20, "page_shift": 16})
        options["llm.HostMemPoolConfig"] = json.dumps({"memory_size": 16 << 20, "page_shift": 16})
    return options


def _v2_operations(manager: Any, memory: np.ndarray) -> dict[str, Callable[[], object]]:
    desc = CacheDesc(2, SHAPE, DataType.DT_INT8)
    host_desc = CacheDesc(2, SHAPE, DataType.DT_INT8, Placement.HOST)
    regular = Cache(7, desc, [memory.ctypes.data, memory.ctypes.data + 1024], False)
    blocks = Cache(8, desc, [memory.ctypes.data, memory.ctypes.data + 1024], True)
    host = Cache(9, host_desc, [memory.ctypes.data, memory.ctypes.data + 1024], True)
    key = CacheKeyByIdAndIndex(1, 7)
    block_key = BlocksCacheKey(1)
    addrs = [memory.ctypes.data, memory.ctypes.data + 1024]
    return {
        "allocate_cache": lambda: manager.allocate_cache(desc),
        "allocate_blocks_cache": lambda: manager.allocate_blocks_cache(desc),
        "register_cache": lambda: manager.register_cache(desc, addrs),
        "register_blocks_cache": lambda: manager.register_blocks_cache(desc, addrs),
        "deallocate_cache": lambda: manager.deallocate_cache(regular),
        "deallocate_blocks_cache": lambda: manager.deallocate_blocks_cache(blocks),
        "copy_cache": lambda: manager.copy_cache(regular, regular),
        "copy_blocks": lambda: manager.copy_blocks(blocks, {0: [1]}),
        "pull_cache": lambda: manager.pull_cache(key, regular),
        "pull_blocks": lambda: manager.pull_blocks(block_key, blocks, [0], [1]),
        "push_cache": lambda: manager.push_cache(key, regular),
        "push_blocks": lambda: manager.push_blocks(block_key, blocks, [0], [1]),
        "unregister_cache": lambda: manager.unregister_cache(7),
        "remove_cache_key": lambda: manager.remove_cache_key(CacheKey(prompt_cluster_id=1, req_id=2)),
        "remap_registered_memory": lambda: manager.remap_registered_memory(
            MemInfo(Memtype.MEM_TYPE_DEVICE, memory.ctypes.data, 8)
        ),
        "swap_blocks": lambda: manager.swap_blocks(blocks, host, {0: 1}),
        "transfer_cache_async": lambda: manager.transfer_cache_async(
            regular, _Go(), [TransferConfig(1, [memory.ctypes.data, memory.ctypes.data + 1024])]
        ),
    }


def _v1_operations(manager: Any, cache: Any) -> dict[str, Callable[[], object]]:
    desc = CacheDesc(2, SHAPE, DataType.DT_INT8)
    addrs = list(cache.per_device_tensor_addrs[0])
    return {
        "allocate_cache": lambda: manager.allocate_cache(desc),
        "allocate_blocks_cache": lambda: manager.allocate_blocks_cache(desc),
        "deallocate_cache": lambda: manager.deallocate_cache(cache),
        "remove_cache_key": lambda: manager.remove_cache_key(CacheKey(prompt_cluster_id=1, req_id=2)),
        "pull_cache": lambda: manager.pull_cache(CacheKey(1, req_id=2), cache),
        "pull_blocks": lambda: manager.pull_blocks(BlocksCacheKey(1), cache, [0], [1]),
        "copy_cache": lambda: manager.copy_cache(cache, cache, 1, 0),
        "copy_blocks": lambda: manager.copy_blocks(cache, {0: [1]}),
        "swap_blocks": lambda: manager.swap_blocks(cache, cache, {0: 1}),
        "transfer_cache_async": lambda: manager.transfer_cache_async(
            cache, _Go(), [TransferConfig(1, addrs)]
        ),
    }


def _assert_expired(operations: dict[str, Callable[[], object]], memory: np.ndarray | None) -> None:
    segments = [info.name for info in list_segments()]
    before = None if memory is None else memory.copy()
    for name, call in operations.items():
        with pytest.raises(LLMException) as caught:
            call()
        assert caught.value.status_code == LLMStatusCode.LLM_ENGINE_FINALIZED, name
    assert [info.name for info in list_segments()] == segments  # nothing allocated
    if memory is not None:
        assert np.array_equal(memory, before)  # nothing written


@pytest.mark.parametrize("v2", [True, False], ids=["v2", "v1"])
def test_every_operation_of_a_finalized_manager_is_engine_finalized(v2: bool) -> None:
    memory = np.arange(4096, dtype=np.uint8)
    datadist = LLMDataDist(LLMRole.DECODER, 1)
    datadist.init(_options(v2))
    if v2:
        old = datadist.cache_manager
        datadist.finalize()
        assert not old._initialized
        operations = _v2_operations(old, memory)
    else:
        old = datadist.kv_cache_manager
        cache = old.allocate_cache(CacheDesc(2, SHAPE, DataType.DT_INT8))
        datadist.finalize()
        assert not old._initialized and not old.is_initialized()
        operations = _v1_operations(old, cache)
    assert len(operations) == (17 if v2 else 10)
    _assert_expired(operations, memory)
    datadist.finalize()  # harmless
    _assert_expired(operations, memory)
    # The same instance initialised again: a new manager works, the old one stays expired.
    datadist.init(_options(v2))
    try:
        new = datadist.cache_manager if v2 else datadist.kv_cache_manager
        assert new is not old and new._initialized
        fresh = new.allocate_cache(CacheDesc(2, SHAPE, DataType.DT_INT8))
        _assert_expired(operations, memory)
        new.deallocate_cache(fresh)
    finally:
        datadist.finalize()
    # Another instance: the same.
    other = LLMDataDist(LLMRole.DECODER, 2)
    other.init(_options(v2))
    try:
        _assert_expired(operations, memory)
    finally:
        other.finalize()
