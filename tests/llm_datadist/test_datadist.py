"""`LLMDataDist` lifecycle and role rules in one process (v1 KvCacheManager mode)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from llm_datadist import (
    CacheDesc,
    CacheKey,
    DataType,
    KvCache,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from llm_datadist.ext import tensor_views
from tests._peer import decoder


def test_methods_before_init_raise_runtime_error() -> None:
    dd = LLMDataDist(LLMRole.DECODER, 2)
    with pytest.raises(RuntimeError, match="not initialized"):
        _ = dd.kv_cache_manager
    with pytest.raises(RuntimeError):
        dd.link_clusters([])
    dd.finalize()  # no-op


def test_constructor_checks() -> None:
    with pytest.raises(TypeError):
        LLMDataDist(1, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LLMDataDist(LLMRole.PROMPT, -1)


def test_one_initialised_instance_per_process() -> None:
    with decoder() as first:
        second = LLMDataDist(LLMRole.DECODER, 3)
        config = LLMConfig()
        config.device_id = 0
        with pytest.raises(LLMException) as exc_info:
            second.init(config.generate_options())
        assert exc_info.value.status_code == LLMStatusCode.LLM_FAILED
        first.init({})  # already initialised: a no-op
    again = LLMDataDist(LLMRole.DECODER, 3)
    again.init(config.generate_options())
    again.finalize()


def test_init_option_errors() -> None:
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(TypeError):
        dd.init("options")  # type: ignore[arg-type]
    with pytest.raises(LLMException):
        dd.init({"ge.exec.deviceId": "0"})  # a v1 PROMPT must listen
    with pytest.raises(LLMException):
        dd.init(
            {"ge.exec.deviceId": "0", "llm.listenIpInfo": "127.0.0.1:1", "ge.flowGraphMemMaxSize": "1,024"}
        )
    with pytest.raises(LLMException):
        LLMDataDist(LLMRole.DECODER, 1).init({})  # device id required
    assert LLMDataDist.llm_engine_instance is None


def test_pool_capacity_from_flow_graph_mem_max_size() -> None:
    with decoder(extra={"ge.flowGraphMemMaxSize": str(1 << 20)}) as dd:
        kvm = dd.kv_cache_manager
        first = kvm.allocate_cache(CacheDesc(2, [1, 1024, 128], DataType.DT_FLOAT16))  # 512 KiB
        with pytest.raises(LLMException) as exc_info:
            kvm.allocate_cache(CacheDesc(2, [1, 1024, 128], DataType.DT_FLOAT16))
        assert exc_info.value.status_code == LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
        kvm.deallocate_cache(first)
        kvm.allocate_cache(CacheDesc(2, [1, 1024, 128], DataType.DT_FLOAT16))


def test_roles_and_placement_checks() -> None:
    with decoder() as dd:
        kvm = dd.kv_cache_manager
        desc = CacheDesc(2, [1, 8], DataType.DT_FLOAT16)
        with pytest.raises(LLMException) as exc_info:
            kvm.allocate_cache(desc, [CacheKey(1, 1)])  # keys only on PROMPT
        assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        with pytest.raises(LLMException):
            kvm.remove_cache_key(CacheKey(1, 1))  # PROMPT only
        with pytest.raises(LLMException):
            kvm.allocate_cache(CacheDesc(2, [1, 8], DataType.DT_FLOAT16, Placement.HOST))
        with pytest.raises(LLMException):
            kvm.allocate_cache(CacheDesc(0, [1, 8], DataType.DT_FLOAT16))
        with pytest.raises(TypeError):
            kvm.allocate_cache("desc")  # type: ignore[arg-type]
        with pytest.raises(LLMException) as exc_info:
            kvm.get_cache_tensors(None)  # type: ignore[arg-type]
        assert exc_info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
        with pytest.raises(LLMException):
            _ = dd.cache_manager


def test_cache_ids_count_from_one_and_addresses_are_writable() -> None:
    with decoder() as dd:
        kvm = dd.kv_cache_manager
        caches = [kvm.allocate_cache(CacheDesc(3, [2, 5, 7], DataType.DT_FLOAT)) for _ in range(3)]
        assert [c.cache_id for c in caches] == [1, 2, 3]
        cache = caches[1]
        assert len(cache.per_device_tensor_addrs) == 1 and len(cache.per_device_tensor_addrs[0]) == 3
        views = tensor_views(cache)
        assert views[0].shape == (2, 5, 7) and views[0].dtype == np.float32
        ctypes.memmove(cache.per_device_tensor_addrs[0][2], np.arange(70, dtype=np.float32).tobytes(), 280)
        np.testing.assert_array_equal(views[2].reshape(-1), np.arange(70, dtype=np.float32))
        kvm.deallocate_cache(cache)
        assert cache.per_device_tensor_addrs == []
        kvm.deallocate_cache(cache)  # already freed: ignored
        assert kvm.allocate_cache(CacheDesc(1, [1], DataType.DT_INT8)).cache_id == 4  # ids never reused
    assert not kvm.is_initialized()


def test_kv_cache_del_frees_its_memory() -> None:
    with decoder() as dd:
        kvm = dd.kv_cache_manager
        cache = kvm.allocate_cache(CacheDesc(1, [1, 4096], DataType.DT_UINT8))
        core = dd._require_core()
        assert core.leases.stats()["caches"] == 1
        del cache
        assert core.leases.stats()["caches"] == 0


def test_create_cpu_cache() -> None:
    buffers = [np.zeros(16, dtype=np.float16) for _ in range(2)]
    addrs = [b.ctypes.data for b in buffers]
    desc = CacheDesc(2, [2, 8], DataType.DT_FLOAT16, Placement.HOST)
    cpu = KvCache.create_cpu_cache(desc, addrs)
    assert cpu.cache_id == -1 and cpu.per_device_tensor_addrs == [addrs]
    with pytest.raises(LLMException):
        KvCache.create_cpu_cache(CacheDesc(2, [2, 8], DataType.DT_FLOAT16), addrs)
    with pytest.raises(LLMException):
        KvCache.create_cpu_cache(desc, addrs[:1])
    with decoder() as dd, pytest.raises(LLMException):
        dd.kv_cache_manager.deallocate_cache(cpu)
