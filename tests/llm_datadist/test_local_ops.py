"""v1 local copies (`copy_cache`, `copy_blocks`, `swap_blocks`) on real shared memory, checked byte for
byte against a numpy reference computed from a snapshot taken before the call.

Every failing call is also checked to have copied nothing and to have left no pin on the cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_datadist import CacheDesc, DataType, KvCache, LLMDataDist, LLMException, LLMStatusCode, Placement
from llm_datadist.ext import tensor_views
from tests._peer import decoder

PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID


# ---------------------------------------------------------------------------------------------- helpers


@pytest.fixture
def dd() -> Iterator[LLMDataDist]:
    with decoder() as datadist:
        yield datadist


def _desc(num_tensors: int, shape: list[int], data_type: DataType = DataType.DT_UINT8) -> CacheDesc:
    return CacheDesc(num_tensors, shape, data_type)


def _raw(cache: KvCache) -> list[np.ndarray]:
    """Flat uint8 views of a manager cache's tensors (aliasing its shared memory)."""
    return [view.view(np.uint8).reshape(-1) for view in tensor_views(cache)]


def _fill(cache: KvCache, rng: np.random.Generator) -> None:
    for raw in _raw(cache):
        raw[:] = rng.integers(0, 256, raw.nbytes, dtype=np.uint8)


def _snapshot(cache: KvCache) -> list[np.ndarray]:
    return [raw.copy() for raw in _raw(cache)]


def _assert_equal(cache: KvCache, expected: list[np.ndarray]) -> None:
    actual = _raw(cache)
    assert len(actual) == len(expected)
    for t, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert np.array_equal(got, want), f"tensor {t} differs"


def _pins(dd: LLMDataDist, cache: KvCache) -> int:
    record = dd.kv_cache_manager._core.table.get(cache.cache_id)  # type: ignore[union-attr]
    assert record is not None
    return record.pins


def _host_cache(
    num_tensors: int, shape: list[int], rng: np.random.Generator
) -> tuple[KvCache, list[np.ndarray]]:
    """A cpu cache over numpy arrays this test owns (kept alive by the returned list)."""
    nbytes = int(np.prod(shape))
    arrays = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(num_tensors)]
    desc = CacheDesc(num_tensors, shape, DataType.DT_UINT8, placement=Placement.HOST)
    return KvCache.create_cpu_cache(desc, [array.ctypes.data for array in arrays]), arrays


def _expect_invalid(call: Any, *args: Any) -> LLMException:
    with pytest.raises(LLMException) as exc_info:
        call(*args)
    assert exc_info.value.status_code == PARAM_INVALID
    assert "LLM_PARAM_INVALID" in str(exc_info.value)
    return exc_info.value


# ---------------------------------------------------------------------------------------------- copy_cache


def test_copy_cache_whole_slot_between_caches_of_different_batch_sizes(dd: LLMDataDist) -> None:
    manager = dd.kv_cache_manager
    rng = np.random.default_rng(1)
    tmp = manager.allocate_cache(_desc(3, [1, 4097]))
    model = manager.allocate_cache(_desc(3, [4, 4097]))
    _fill(tmp, rng)
    _fill(model, rng)
    src_before, dst_before = _snapshot(tmp), _snapshot(model)
    manager.copy_cache(model, tmp, dst_batch_index=2)
    expected = [d.copy() for d in dst_before]
    for t in range(3):
        expected[t][2 * 4097 : 3 * 4097] = src_before[t]
    _assert_equal(model, expected)
    _assert_equal(tmp, src_before)
    assert _pins(dd, tmp) == 0 and _pins(dd, model) == 0


@pytest.mark.parametrize(("offset", "size"), [(5, 3333), (0, 1), (4096, 1), (0, 4097), (1, 4096)])
def test_copy_cache_offset_and_size(dd: LLMDataDist, offset: int, size: int) -> None:
    manager = dd.kv_cache_manager
    rng = np.random.default_rng(offset * 7 + size)
    src = manager.allocate_cache(_desc(2, [3, 4097]))
    dst = manager.allocate_cache(_desc(2, [2, 4097]))
    _fill(src, rng)
    _fill(dst, rng)
    src_before, dst_before = _snapshot(src), _snapshot(dst)
    manager.copy_cache(dst, src, 1, 2, offset, size, req_id=7)
    expected = [d.copy() for d in dst_before]
    for t in range(2):
        dst_start, src_start = 1 * 4097 + offset, 2 * 4097 + offset
        expected[t][dst_start : dst_start + size] = src_before[t][src_start : src_start + size]
    _assert_equal(dst, expected)
    _assert_equal(src, src_before)


def test_copy_cache_size_minus_one_with_offset_copies_the_rest_of_the_slot(dd: LLMDataDist) -> None:
    manager = dd.kv_cache_manager
    rng = np.random.default_rng(3)
    # float16, 3333 elements: 6666-byte slots; the offset is a byte offset.
    src = manager.allocate_cache(_desc(2, [2, 3333], DataType.DT_FLOAT16))
    dst = manager.allocate_cache(_desc(2, [2, 3333], DataType.DT_FLOAT16))
    _fill(src, rng)
    _fill(dst, rng)
    src_before, dst_before = _snapshot(src), _snapshot(dst)
    manager.copy_cache(dst, src, 0, 1, offset=333)
    expected = [d.copy() for d in dst_before]
    for t in range(2):
        expected[t][333:6666] = src_before[t][6666 + 333 : 2 * 6666]
    _assert_equal(dst, expected)


def test_copy_cache_within_one_cache(dd: LLMDataDist) -> None:
    manager = dd.kv_cache_manager
    rng = np.random.default_rng(4)
    cache = manager.allocate_cache(_desc(2, [4, 3333]))
    _fill(cache, rng)
    before = _snapshot(cache)
    manager.copy_cache(cache, cache, 3, 0)
    expected = [b.copy() for b in before]
    for t in range(2):
        expected[t][3 * 3333 :] = before[t][:3333]
    _assert_equal(cache, expected)
    # Same slot: a no-op copy.
    manager.copy_cache(cache, cache, 1, 1, 10, 100)
    _assert_equal(cache, expected)
    assert _pins(dd, cache) == 0


def test_copy_cache_param_invalid(dd: LLMDataDist) -> None:
    manager = dd.kv_cache_manager
    rng = np.random.default_rng(5)
    dst = manager.allocate_cache(_desc(2, [2, 100]))
    src = manager.allocate_cache(_desc(2, [3, 100]))
    other_tensors = manager.allocate_cache(_desc(3, [2, 100]))
    other_slot = manager.allocate_cache(_desc(2, [2, 101]))
    blocks = manager.allocate_blocks_cache(_desc(2, [2, 100]))
    gone = manager.allocate_cache(_desc(2, [2, 100]))
    manager.deallocate_cache(gone)
    host, _arrays = _host_cache(2, [2, 100], rng)
    _fill(dst, rng)
    _fill(src, rng)
    dst_before = _snapshot(dst)
    cases: list[tuple[Any, ...]] = [
        (host, src),
        (dst, host),
        (dst, src, 2, 0),  # dst slot out of range
        (dst, src, 0, 3),  # src slot out of range
        (dst, other_tensors),
        (dst, other_slot),
        (other_slot, src),
        (dst, blocks),
        (blocks, src),
        (dst, gone),
        (gone, src),
        (dst, src, 0, 0, 100),  # offset == slot
        (dst, src, 0, 0, 50, 51),  # offset + size > slot
        (dst, src, 0, 0, 0, 101),
        (dst, src, 0, 0, 0, 0),  # size 0
        (dst, src, 0, 0, 0, -2),
    ]
    for case in cases:
        _expect_invalid(manager.copy_cache, *case)
    _assert_equal(dst, dst_before)
    assert _pins(dd, dst) == 0 and _pins(dd, src) == 0


def test_copy_cache_rejects_a_cache_of_an_earlier_init() -> None:
    with decoder() as first:
        stale = first.kv_cache_manager.allocate_cache(_desc(1, [2, 64]))
    with decoder() as second:
        manager = second.kv_cache_manager
        fresh = manager.allocate_cache(_desc(1, [2, 64]))
        assert fresh.cache_id == stale.cache_id
        _expect_invalid(manager.copy_cache, fresh, stale)
        _expect_invalid(manager.copy_cache, stale, fresh)
    del stale


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("dst", "CACHE"), TypeError),
        (("CACHE", None), TypeError),
        (("CACHE", "CACHE", "0"), TypeError),
        (("CACHE", "CACHE", True), TypeError),
        (("CACHE", "CACHE", 0, 0.0), TypeError),
        (("CACHE", "CACHE", 0, 0, 1.5), TypeError),
        (("CACHE", "CACHE", 0, 0, 0, "1"), TypeError),
        (("CACHE", "CACHE", 0, 0, 0, -1, "req"), TypeError),
        (("CACHE", "CACHE", -1), ValueError),
        (("CACHE", "CACHE", 0, 2**32), ValueError),
        (("CACHE", "CACHE", 0, 0, -1), ValueError),
        (("CACHE", "CACHE", 0, 0, 0, 2**63), ValueError),
        (("CACHE", "CACHE", 0, 0, 0, -1, -1), ValueError),
    ],
)
def test_copy_cache_argument_types(dd: LLMDataDist, args: tuple[Any, ...], error: type[Exception]) -> None:
    manager = dd.kv_cache_manager
    cache = manager.allocate_cache(_desc(1, [2, 64]))
    with pytest.raises(error):
        call_args: list[Any] = [cache if arg == "CACHE" else arg for arg in args]
        manager.copy_cache(*call_args)


# ---------------------------------------------------------------------------------------------- copy_blocks


def test_copy_blocks_one_to_many(dd: LLMDataDist) -> None:
    manager = dd.kv_cache_manager
    rng = np.random.default_rng(6)
    cache = manager.allocate_blocks_cache(_desc(3, [8, 3, 1111]))  # 3333-byte blocks
    _fill(cache, rng)
    before = _snapshot(cache)
    info = {0: [3, 5, 6], 2: [1], 7: []}
    manager.copy_blocks(cache, info)
    expected = [b.copy().reshape(8, 3333) for b in before]
    for t in range(3):
        source = before[t].reshape(8, 3333)
        for src_block, dst_blocks in info.items():
            for dst_block in dst_blocks:
                expected[t][dst_block] = source[src_block]
    _assert_equal(cache, [e.reshape(-1) for e in expected])
    manager.copy_blocks(cache, {})  # nothing to do
    _assert_equal(cache, [e.reshape(-1) for e in expected])
    assert _pins(dd, cache) == 0


def test_copy_blocks_param_invalid(dd: LLMDataDist) -> None:
    manager = dd.kv_cache_manager
    rng = np.random.default_rng(7)
    cache = manager.allocate_blocks_cache(_desc(2, [4, 100]))
    plain = manager.allocate_cache(_desc(2, [4, 100]))
    gone = manager.allocate_blocks_cache(_desc(2, [4, 100]))
    manager.deallocate_cache(gone)
    host, _arrays = _host_cache(2, [4, 100], rng)
    _fill(cache, rng)
    before = _snapshot(cache)
    cases: list[tuple[Any, ...]] = [
        (plain, {0: [1]}),  # not a blocks cache
        (host, {0: [1]}),
        (gone, {0: [1]}),
        (cache, {0: [1], 4: [2]}),  # src out of range
        (cache, {4: []}),  # an out-of-range src is refused even with nothing to copy
        (cache, {0: [1, 4]}),  # dst out of range
        (cache, {0: [1, 1]}),  # dst twice under one src
        (cache, {0: [1], 2: [1]}),  # dst twice under two srcs
        (cache, {0: [1], 1: [2]}),  # dst 1 is also a src
        (cache, {3: [3]}),
    ]
    for case in cases:
        _expect_invalid(manager.copy_blocks, *case)
    _assert_equal(cache, before)
    assert _pins(dd, cache) == 0


@pytest.mark.parametrize(
    ("info", "error"),
    [
        ([(0, [1])], TypeError),
        ({"0": [1]}, TypeError),
        ({0: (1,)}, TypeError),
        ({0: 1}, TypeError),
        ({0: ["1"]}, TypeError),
        ({0: [True]}, TypeError),
        ({-1: [1]}, ValueError),
        ({0: [-1]}, ValueError),
    ],
)
def test_copy_blocks_argument_types(dd: LLMDataDist, info: Any, error: type[Exception]) -> None:
    manager = dd.kv_cache_manager
    cache = manager.allocate_blocks_cache(_desc(1, [4, 64]))
    with pytest.raises(error):
        manager.copy_blocks(cache, info)
    with pytest.raises(TypeError):
        manager.copy_blocks("cache", {0: [1]})  # type: ignore[arg-type]


def test_copy_blocks_matches_numpy_reference() -> None:
    num_blocks, block_nbytes, num_tensors = 8, 3 * 37, 2
    with decoder() as datadist:
        manager = datadist.kv_cache_manager
        cache = manager.allocate_blocks_cache(_desc(num_tensors, [num_blocks, 3, 37]))

        @settings(max_examples=30, deadline=None)
        @given(data=st.data(), seed=st.integers(0, 2**32 - 1))
        def check(data: st.DataObject, seed: int) -> None:
            order = data.draw(st.permutations(range(num_blocks)))
            src_count = data.draw(st.integers(1, 4))
            dst_count = data.draw(st.integers(0, num_blocks - src_count))
            sources = order[:src_count]
            info: dict[int, list[int]] = {src: [] for src in sources}
            for dst in order[src_count : src_count + dst_count]:
                info[sources[data.draw(st.integers(0, src_count - 1))]].append(dst)
            _fill(cache, np.random.default_rng(seed))
            before = [b.reshape(num_blocks, block_nbytes) for b in _snapshot(cache)]
            expected = [b.copy() for b in before]
            for t in range(num_tensors):
                for src, dsts in info.items():
                    expected[t][dsts] = before[t][src]
            manager.copy_blocks(cache, info)
            _assert_equal(cache, [e.reshape(-1) for e in expected])

        check()
        assert _pins(datadist, cache) == 0


# ---------------------------------------------------------------------------------------------- swap_blocks


@pytest.mark.parametrize("blocks_cache", [True, False])
def test_swap_out_and_in(dd: LLMDataDist, blocks_cache: bool) -> None:
    manager = dd.kv_cache_manager
    rng = np.random.default_rng(8)
    desc = _desc(3, [6, 3333])
    device = manager.allocate_blocks_cache(desc) if blocks_cache else manager.allocate_cache(desc)
    _fill(device, rng)
    host, arrays = _host_cache(3, [4, 3333], rng)
    device_before, host_before = _snapshot(device), [a.copy() for a in arrays]

    out_map = {5: 0, 1: 3, 2: 1}
    manager.swap_blocks(device, host, out_map)
    for t in range(3):
        expected = host_before[t].reshape(4, 3333).copy()
        for src, dst in out_map.items():
            expected[dst] = device_before[t].reshape(6, 3333)[src]
        assert np.array_equal(arrays[t], expected.reshape(-1))
    _assert_equal(device, device_before)

    for array in arrays:
        array[:] = rng.integers(0, 256, array.nbytes, dtype=np.uint8)
    host_now = [a.copy() for a in arrays]
    in_map = {0: 4, 3: 0}
    manager.swap_blocks(host, device, in_map)
    expected_device = [d.reshape(6, 3333).copy() for d in device_before]
    for t in range(3):
        for src, dst in in_map.items():
            expected_device[t][dst] = host_now[t].reshape(4, 3333)[src]
    _assert_equal(device, [e.reshape(-1) for e in expected_device])
    for t in range(3):
        assert np.array_equal(arrays[t], host_now[t])
    manager.swap_blocks(host, device, {})  # nothing to do
    assert _pins(dd, device) == 0


def test_swap_blocks_param_invalid(dd: LLMDataDist) -> None:
    manager = dd.kv_cache_manager
    rng = np.random.default_rng(9)
    device = manager.allocate_blocks_cache(_desc(2, [4, 100]))
    device2 = manager.allocate_blocks_cache(_desc(2, [4, 100]))
    gone = manager.allocate_blocks_cache(_desc(2, [4, 100]))
    manager.deallocate_cache(gone)
    host, arrays = _host_cache(2, [3, 100], rng)
    host2, _arrays2 = _host_cache(2, [3, 100], rng)
    wrong_block, _a3 = _host_cache(2, [3, 101], rng)
    wrong_tensors, _a4 = _host_cache(3, [3, 100], rng)
    two_devices = KvCache.create_cpu_cache(
        CacheDesc(2, [3, 100], DataType.DT_UINT8, placement=Placement.HOST),
        [[a.ctypes.data for a in arrays], [a.ctypes.data for a in arrays]],
    )
    _fill(device, rng)
    device_before, host_before = _snapshot(device), [a.copy() for a in arrays]
    cases: list[tuple[Any, ...]] = [
        (device, wrong_block, {0: 0}),
        (wrong_block, device, {0: 0}),
        (device, wrong_tensors, {0: 0}),
        (device, device2, {0: 0}),  # both device
        (host, host2, {0: 0}),  # both host
        (device, host, {4: 0}),  # src out of range (device side)
        (device, host, {0: 3}),  # dst out of range (host side)
        (host, device, {3: 0}),  # src out of range (host side)
        (host, device, {0: 4}),  # dst out of range (device side)
        (host, device, {-1: 0}),
        (host, device, {0: -1}),
        (host, device, {0: 1, 2: 1}),  # a dst named twice
        (device, host, {0: 0, 1: 0}),
        (gone, host, {0: 0}),
        (two_devices, device, {0: 0}),
    ]
    for case in cases:
        _expect_invalid(manager.swap_blocks, *case)
    _assert_equal(device, device_before)
    for array, want in zip(arrays, host_before, strict=True):
        assert np.array_equal(array, want)
    assert _pins(dd, device) == 0


def test_swap_blocks_argument_types(dd: LLMDataDist) -> None:
    manager = dd.kv_cache_manager
    device = manager.allocate_blocks_cache(_desc(1, [4, 64]))
    host, _arrays = _host_cache(1, [4, 64], np.random.default_rng(10))
    cases: list[tuple[Any, ...]] = [
        ("src", host, {0: 0}),
        (device, None, {0: 0}),
        (device, host, [(0, 0)]),
        (device, host, {"0": 0}),
        (device, host, {0: "0"}),
        (device, host, {0: 1.0}),
    ]
    for args in cases:
        with pytest.raises(TypeError):
            manager.swap_blocks(*args)


def test_swap_blocks_matches_numpy_reference() -> None:
    device_blocks, host_blocks, block_nbytes, num_tensors = 8, 6, 2 * 37, 2
    with decoder() as datadist:
        manager = datadist.kv_cache_manager
        device = manager.allocate_blocks_cache(_desc(num_tensors, [device_blocks, 37], DataType.DT_FLOAT16))
        host, arrays = _host_cache(num_tensors, [host_blocks, block_nbytes], np.random.default_rng(11))

        @settings(max_examples=30, deadline=None)
        @given(data=st.data(), seed=st.integers(0, 2**32 - 1), swap_in=st.booleans())
        def check(data: st.DataObject, seed: int, swap_in: bool) -> None:
            src_count, dst_count = (host_blocks, device_blocks) if swap_in else (device_blocks, host_blocks)
            count = data.draw(st.integers(0, host_blocks))
            sources = data.draw(st.permutations(range(src_count)))[:count]
            targets = data.draw(st.permutations(range(dst_count)))[:count]
            mapping = dict(zip(sources, targets, strict=True))
            rng = np.random.default_rng(seed)
            _fill(device, rng)
            for array in arrays:
                array[:] = rng.integers(0, 256, array.nbytes, dtype=np.uint8)
            device_before = [d.reshape(device_blocks, block_nbytes) for d in _snapshot(device)]
            host_before = [a.reshape(host_blocks, block_nbytes).copy() for a in arrays]
            src_before, dst_before = (host_before, device_before) if swap_in else (device_before, host_before)
            expected = [d.copy() for d in dst_before]
            for t in range(num_tensors):
                expected[t][targets] = src_before[t][sources]
            if swap_in:
                manager.swap_blocks(host, device, mapping)
                _assert_equal(device, [e.reshape(-1) for e in expected])
                unchanged = zip(arrays, host_before, strict=True)
            else:
                manager.swap_blocks(device, host, mapping)
                for array, want in zip(arrays, expected, strict=True):
                    assert np.array_equal(array, want.reshape(-1))
                unchanged = zip(_raw(device), device_before, strict=True)
            for got, want in unchanged:
                assert np.array_equal(got, want.reshape(-1))

        check()
        assert _pins(datadist, device) == 0
