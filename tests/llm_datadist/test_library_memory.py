"""`ext.shared_arrays`: memory the library hands out for the user to register. What a user sees of it
(zeroed, typed, page-aligned arrays, clear errors), its lifetime (freed with its last array, kept while
registered), and how peers reach it (tested with real peers in test_cache_manager and test_multihost)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from llm_datadist import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole
from llm_datadist import _library as library
from llm_datadist._shm.reaper import SHM_DIR
from llm_datadist._shm.segment import PAGE_NBYTES
from llm_datadist.ext import shared_arrays, tensor_views


def _name_of(array: np.ndarray) -> str:
    """The segment under `array`, as /proc/self/maps names it."""
    address = array.ctypes.data
    with open("/proc/self/maps", encoding="ascii") as maps:
        for line in maps:
            bounds, *_, path = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in bounds.split("-"))
            if low <= address < high:
                return path.strip().removeprefix("/dev/shm/")
    raise AssertionError(f"{address:#x} is not mapped")


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name.lstrip("/")))


def _v2() -> LLMDataDist:
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    config = LLMConfig()
    config.device_id = 0
    options = dict(config.generate_options())
    options.update({"llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "1"})
    dd.init(options)
    return dd


def test_arrays_are_zeroed_typed_page_aligned_and_in_one_segment() -> None:
    arrays = shared_arrays(3, (5, 7), np.float32)
    assert [a.shape for a in arrays] == [(5, 7)] * 3
    assert all(a.dtype == np.float32 and a.flags.writeable and a.flags.c_contiguous for a in arrays)
    assert all(a.ctypes.data % PAGE_NBYTES == 0 for a in arrays)
    assert not any(a.any() for a in arrays)
    names = {_name_of(a) for a in arrays}
    assert len(names) == 1 and next(iter(names)).startswith(f"llmdd.{os.getuid()}.{os.getpid()}.")
    arrays[0][:] = 1.5
    assert not arrays[1].any() and float(arrays[0].sum()) == 1.5 * 35  # no two arrays share a byte
    (single,) = shared_arrays(1, 4096)
    assert single.shape == (4096,) and single.dtype == np.float16


def test_the_segment_goes_with_the_last_array() -> None:
    arrays = shared_arrays(2, 1000, np.uint8)
    name = _name_of(arrays[0])
    first = arrays.pop(0)
    del first
    gc.collect()
    assert _exists(name)  # the other array still uses it
    view = arrays[0][10:20]
    arrays.clear()
    gc.collect()
    assert _exists(name)  # a view of it too
    del view
    gc.collect()
    assert not _exists(name)
    assert library.segment_address(name) is None


def test_a_registration_holds_the_memory_until_unregistered() -> None:
    dd = _v2()
    try:
        arrays = shared_arrays(2, (4, 512), np.float16)
        arrays[0][:], arrays[1][:] = 1, 2
        name = _name_of(arrays[0])
        desc = CacheDesc(2, [4, 512], DataType.DT_FLOAT16)
        cache = dd.cache_manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays], None, True)
        arrays.clear()
        gc.collect()
        assert _exists(name)  # the cache still holds it: its views read what was written
        assert [float(v.max()) for v in tensor_views(cache)] == [1.0, 2.0]
        dd.cache_manager.unregister_cache(cache.cache_id)
        gc.collect()
        assert not _exists(name)
    finally:
        dd.finalize()


def test_tensors_of_two_allocations_are_registered_as_private_memory_is() -> None:
    """Published by address (read through process_vm_readv): each call's arrays lie in a segment of their
    own, and one entry names one segment."""
    (a,) = shared_arrays(1, 1024, np.float16)
    (b,) = shared_arrays(1, 1024, np.float16)
    assert library.span([a.ctypes.data, b.ctypes.data], 2048) is None
    assert library.span([a.ctypes.data], 2048) is not None
    assert library.span([a.ctypes.data + PAGE_NBYTES - 4], 8) is None  # runs past the end of its segment
    dd = _v2()
    try:
        desc = CacheDesc(2, [1, 1024], DataType.DT_FLOAT16)
        cache = dd.cache_manager.register_cache(desc, [a.ctypes.data, b.ctypes.data], [], True)
        record = dd._require_core().table.get(cache.cache_id)
        assert record is not None and record.shared is None
        assert record.location(0, 2).segment_name == ""
    finally:
        dd.finalize()


@pytest.mark.parametrize(
    ("count", "shape", "dtype", "error"),
    [
        ("2", 4, np.float16, TypeError),
        (True, 4, np.float16, TypeError),
        (1, 4.0, np.float16, TypeError),
        (1, (2, "3"), np.float16, TypeError),
        (0, 4, np.float16, ValueError),
        (1, (4, 0), np.float16, ValueError),
        (1, -1, np.float16, ValueError),
        (1, 4, "no such dtype", TypeError),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_made(
    count: object, shape: object, dtype: object, error: type[Exception]
) -> None:
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(error):
        shared_arrays(count, shape, dtype)  # type: ignore[arg-type]
    assert set(os.listdir(SHM_DIR)) <= before


def test_a_late_release_of_an_older_segment_at_the_same_address_leaves_the_newer_one() -> None:
    """The mapping of a freed segment is unmapped before its release runs (with the GIL free, so another
    thread may get the same address meanwhile): that release must not drop the new segment's entry."""
    (array,) = shared_arrays(1, 4096, np.uint8)
    name = _name_of(array)
    older = f"/llmdd.{os.getuid()}.{os.getpid()}.1.{'0' * 16}"  # no such segment: its name is long gone
    library._release(array.ctypes.data, older, os.getpid())
    assert library.span([array.ctypes.data], 4096) is not None
    assert library.segment_address(name) is not None and _exists(name)
