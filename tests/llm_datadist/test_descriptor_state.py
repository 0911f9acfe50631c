"""The caller's `CacheDesc` is not ours to change: the kind of a cache follows the API that made it (hixl
2026, `test_cache_descriptor_state.py`). A descriptor used for a blocks cache and then for a regular one
gives a regular one; a failed call leaves it as it was; a legacy `_is_blocks` on it changes nothing.
Checked in both managers through the public API. Also the v2 `Cache` objects the managers hand back:
`ext.tensor_views` takes them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from llm_datadist import (
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    Placement,
)


@contextlib.contextmanager
def _manager(v2: bool) -> Iterator[Any]:
    datadist = LLMDataDist(LLMRole.DECODER, 1)
    config = LLMConfig()
    config.device_id = 0
    options = dict(config.generate_options())
    if v2:
        options["llm.EnableCacheManager"] = "1"
        options["llm.MemPoolConfig"] = json.dumps({"memory_size": 16 << 20, "page_shift": 16})
    datadist.init(options)
    try:
        yield datadist.cache_manager if v2 else datadist.kv_cache_manager
    finally:
        datadist.finalize()


def _descriptor() -> CacheDesc:
    return CacheDesc(1, [2, 4096], DataType.DT_INT8, Placement.DEVICE)


def _state(desc: CacheDesc) -> tuple[Any, ...]:
    return (desc.num_tensors, list(desc.shape), desc.data_type, desc.placement, desc._is_blocks)


def _is_blocks(cache: Any) -> bool:
    return (
        bool(cache.is_blocks_cache)
        if hasattr(cache, "is_blocks_cache")
        else bool(cache.cache_desc._is_blocks)
    )


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_a_blocks_cache_leaves_the_descriptor_and_a_regular_one_follows(v2: bool) -> None:
    with _manager(v2) as manager:
        desc = _descriptor()
        before = _state(desc)
        blocks = manager.allocate_blocks_cache(desc)
        assert _state(desc) == before
        regular = manager.allocate_cache(desc)
        assert not desc._is_blocks
        if v2:
            assert blocks.is_blocks_cache and not regular.is_blocks_cache
            # A regular cache takes a regular deallocation; a blocks one is refused there.
            manager.deallocate_cache(regular)
            with pytest.raises(LLMException):
                manager.deallocate_cache(blocks)
            manager.deallocate_blocks_cache(blocks)
        else:
            manager.deallocate_cache(regular)
            manager.deallocate_cache(blocks)


def test_register_blocks_cache_leaves_the_descriptor() -> None:
    with _manager(True) as manager:
        desc = _descriptor()
        before = _state(desc)
        memory = np.zeros(2 * 4096, dtype=np.int8)
        blocks = manager.register_blocks_cache(desc, [memory.ctypes.data])
        assert _state(desc) == before and blocks.is_blocks_cache
        manager.unregister_cache(blocks.cache_id)
        regular = manager.register_cache(desc, [memory.ctypes.data])
        assert not regular.is_blocks_cache
        manager.unregister_cache(regular.cache_id)


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_a_failed_blocks_call_leaves_the_descriptor(v2: bool) -> None:
    with _manager(v2) as manager:
        desc = CacheDesc(1, [1 << 40], DataType.DT_INT8, Placement.DEVICE)  # larger than the pool
        before = _state(desc)
        with pytest.raises(LLMException):
            manager.allocate_blocks_cache(desc)
        assert _state(desc) == before


@pytest.mark.parametrize("legacy", [False, True])
def test_the_api_not_the_legacy_flag_decides_the_kind(legacy: bool) -> None:
    with _manager(True) as manager:
        desc = _descriptor()
        desc._is_blocks = legacy
        regular = manager.allocate_cache(desc)
        blocks = manager.allocate_blocks_cache(desc)
        assert (regular.is_blocks_cache, blocks.is_blocks_cache) == (False, True)
        assert desc._is_blocks == legacy
        manager.deallocate_cache(regular)
        manager.deallocate_blocks_cache(blocks)


def test_tensor_views_work_for_v2_caches_allocated_and_registered() -> None:
    """`ext.tensor_views` (the README's way to see a cache's bytes) takes a v2 `Cache` too: one view per
    tensor, shaped as its description, sharing the memory; a cache that was freed is refused."""
    from llm_datadist import LLMStatusCode
    from llm_datadist.ext import tensor_views

    with _manager(True) as manager:
        desc = CacheDesc(2, [2, 8], DataType.DT_FLOAT16, Placement.DEVICE)
        pool = manager.allocate_cache(desc)
        views = tensor_views(pool)
        assert [v.shape for v in views] == [(2, 8), (2, 8)] and views[1].dtype == np.float16
        views[1][1, 7] = 3.0
        assert tensor_views(pool)[1][1, 7] == 3.0
        memory = np.zeros(16, dtype=np.float16)
        registered = manager.register_blocks_cache(
            CacheDesc(1, [2, 8], DataType.DT_FLOAT16, Placement.DEVICE), [memory.ctypes.data]
        )
        tensor_views(registered)[0][1, 2] = 5.0
        assert memory[10] == 5.0
        manager.unregister_cache(registered.cache_id)
        manager.deallocate_cache(pool)
        for gone in (pool, registered):
            with pytest.raises(LLMException) as caught:
                tensor_views(gone)
            assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
