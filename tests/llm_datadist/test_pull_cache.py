"""`pull_cache` between a real Prompt process and this (Decoder) process: every argument, every error.

Real processes, real Unix sockets, real shared memory. Each test starts its own Prompt (spawned) with
random data from a printed seed and checks every byte the Decoder receives against the same pattern.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import signal
import threading
import time

import numpy as np
import pytest

from llm_datadist import (
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMException,
    LLMStatusCode,
)
from llm_datadist.ext import tensor_views
from tests._peer import PROMPT_IP, PromptPeer, decoder

U64_MAX = 2**64 - 1
P = 1  # the Prompt's cluster id
_ports = itertools.count(26000)


def _port() -> int:
    return next(_ports)


def _desc(num_tensors: int, shape: list[int]) -> CacheDesc:
    return CacheDesc(num_tensors, shape, DataType.DT_FLOAT16)


def _raw(cache) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    return [view.view(np.uint8).reshape(-1) for view in tensor_views(cache)]


def _slot(array: np.ndarray, batch_size: int, slot: int) -> np.ndarray:
    stride = array.nbytes // batch_size
    return array[slot * stride : (slot + 1) * stride]


@pytest.fixture
def linked(seed: int):  # type: ignore[no-untyped-def]
    with PromptPeer(P, _port(), seed) as peer, decoder() as dd:
        ret, codes = dd.link_clusters([peer.cluster_info()], timeout=5000)
        assert ret == LLMStatusCode.LLM_SUCCESS and codes == [LLMStatusCode.LLM_SUCCESS]
        yield peer, dd


def _status(exc_info: pytest.ExceptionInfo[LLMException]) -> LLMStatusCode:
    return exc_info.value.status_code


# ----------------------------------------------------------------------------- happy paths


def test_pull_whole_cache_by_key_then_key_is_consumed(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    shape = [1, 33, 3, 17]  # odd sizes: 3366 bytes per tensor
    cache_id = peer.alloc(4, shape, [(P, 42)])
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(4, shape))
    kvm.pull_cache(CacheKey(P, 42), dst)
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, peer.expected(cache_id, t, raw.nbytes))
    assert peer.stats()["keys"] == 0
    with pytest.raises(LLMException) as exc_info:
        kvm.pull_cache(CacheKey(P, 42), dst)
    assert _status(exc_info) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert "LLMStatusCode.LLM_KV_CACHE_NOT_EXIST" in str(exc_info.value)
    assert str(exc_info.value).startswith("[pull_cache] failed, error code is")


def test_pull_into_batch_index_leaves_other_slots(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(2, [1, 4097], [(P, 7)])
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(2, [3, 4097]))
    for raw in _raw(dst):
        raw[:] = 0xAB
    kvm.pull_cache(CacheKey(P, 7), dst, batch_index=2)
    for t, raw in enumerate(_raw(dst)):
        expected = peer.expected(cache_id, t, 4097 * 2)
        np.testing.assert_array_equal(_slot(raw, 3, 2), expected)
        assert (raw[: 2 * 4097 * 2] == 0xAB).all()


def test_keys_bind_batch_slots_with_padding(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    keys = [(P, 10), (P, U64_MAX), (P, 12)]
    cache_id = peer.alloc(2, [3, 100], keys)
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(2, [1, 100]))
    kvm.pull_cache(CacheKey(P, 12), dst)
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, _slot(peer.expected(cache_id, t, 600), 3, 2))
    kvm.pull_cache(CacheKey(P, 10), dst)
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, _slot(peer.expected(cache_id, t, 600), 3, 0))


def test_pull_by_cache_id_and_index_consumes_bound_key(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(2, [2, 50], [(P, 1), (P, 2)])
    assert cache_id == 1  # cache ids count from 1 in allocation order
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(2, [1, 50]))
    kvm.pull_cache(CacheKeyByIdAndIndex(P, cache_id, 1), dst)
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, _slot(peer.expected(cache_id, t, 200), 2, 1))
    with pytest.raises(LLMException) as exc_info:
        kvm.pull_cache(CacheKey(P, 2), dst)
    assert _status(exc_info) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    kvm.pull_cache(CacheKey(P, 1), dst)  # the other slot's key is untouched
    # Two pulls from one segment mapped it once for this link.
    link = dd._require_core().links.get(P)
    assert len(link.mappings) == 1


def test_size_copies_only_a_prefix_of_each_slot(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(2, [1, 4096], [(P, 5)])
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(2, [1, 4096]))
    for raw in _raw(dst):
        raw[:] = 0
    kvm.pull_cache(CacheKey(P, 5), dst, size=3333)
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw[:3333], peer.expected(cache_id, t, 8192)[:3333])
        assert not raw[3333:].any()


def test_offsets_move_bytes_within_slots_and_keep_the_key(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(2, [2, 1000], [(P, 8), (P, 9)])
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(2, [2, 1000]))
    for raw in _raw(dst):
        raw[:] = 0
    kvm.pull_cache(CacheKey(P, 9), dst, 1, 777, src_cache_offset=101, dst_cache_offset=555)
    for t, raw in enumerate(_raw(dst)):
        source = _slot(peer.expected(cache_id, t, 4000), 2, 1)
        slot = _slot(raw, 2, 1)
        np.testing.assert_array_equal(slot[555 : 555 + 777], source[101 : 101 + 777])
        assert not slot[:555].any() and not slot[555 + 777 :].any() and not _slot(raw, 2, 0).any()
    # A pull with offsets never consumes the key: the same key pulls again, whole, with size -1.
    kvm.pull_cache(CacheKey(P, 9), dst, 0, dst_cache_offset=0)
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(_slot(raw, 2, 0), _slot(peer.expected(cache_id, t, 4000), 2, 1))
    assert peer.stats()["keys"] == 2


def test_size_minus_one_means_slot_minus_dst_offset(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(1, [1, 512], [(P, 3)])
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(1, [1, 512]))
    (raw,) = _raw(dst)
    raw[:] = 0
    kvm.pull_cache(CacheKey(P, 3), dst, dst_cache_offset=24)
    np.testing.assert_array_equal(raw[24:], peer.expected(cache_id, 0, 1024)[: 1024 - 24])
    assert not raw[:24].any()


def test_layer_ranges_map_source_layers_to_destination_layers(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(8, [1, 300], [(P, 11)])  # 4 layers of K,V
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(8, [1, 300]))
    for raw in _raw(dst):
        raw[:] = 0
    kvm.pull_cache(CacheKey(P, 11), dst, 0, src_layer_range=range(0, 2), dst_layer_range=range(2, 4))
    raws = _raw(dst)
    for t in range(4):
        np.testing.assert_array_equal(raws[4 + t], peer.expected(cache_id, t, 600))
        assert not raws[t].any()


def test_tensor_num_per_layer_changes_the_layer_size(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(6, [1, 64], [(P, 12)])
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(6, [1, 64]))
    for raw in _raw(dst):
        raw[:] = 0
    kvm.pull_cache(
        CacheKey(P, 12), dst, src_layer_range=range(1, 2), dst_layer_range=range(0, 1), tensor_num_per_layer=3
    )
    raws = _raw(dst)
    for j in range(3):
        np.testing.assert_array_equal(raws[j], peer.expected(cache_id, 3 + j, 128))
        assert not raws[3 + j].any()


def test_layer_by_layer_pull_consumes_the_key_after_the_last_layer(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    layers = 4
    cache_id = peer.alloc(2 * layers, [1, 256], [(P, 13)])
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(2 * layers, [1, 256]))
    for layer in range(layers):
        assert peer.stats()["keys"] == 1
        kvm.pull_cache(
            CacheKey(P, 13),
            dst,
            src_layer_range=range(layer, layer + 1),
            dst_layer_range=range(layer, layer + 1),
        )
    assert peer.stats()["keys"] == 0
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, peer.expected(cache_id, t, 512))
    with pytest.raises(LLMException) as exc_info:
        kvm.pull_cache(CacheKey(P, 13), dst, src_layer_range=range(0, 1), dst_layer_range=range(0, 1))
    assert _status(exc_info) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def test_prefix_key_is_not_consumed_until_removed(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(2, [1, 128], [(P, U64_MAX, 0, 77)])
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(2, [1, 128]))
    prefix_key = CacheKey(P, U64_MAX, 0, 77)
    kvm.pull_cache(prefix_key, dst)
    kvm.pull_cache(prefix_key, dst)
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, peer.expected(cache_id, t, 256))
    peer.call("remove_key", (P, U64_MAX, 0, 77))
    with pytest.raises(LLMException) as exc_info:
        kvm.pull_cache(prefix_key, dst)
    assert _status(exc_info) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def test_model_id_is_part_of_the_key(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    first = peer.alloc(1, [1, 64], [(P, 1, 1)])
    second = peer.alloc(1, [1, 64], [(P, 1, 2)])
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(1, [1, 64]))
    kvm.pull_cache(CacheKey(P, 1, 2), dst)
    np.testing.assert_array_equal(_raw(dst)[0], peer.expected(second, 0, 128))
    kvm.pull_cache(CacheKey(P, 1, 1), dst)
    np.testing.assert_array_equal(_raw(dst)[0], peer.expected(first, 0, 128))


def test_deallocate_is_deferred_while_keys_remain(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(2, [1, 4096], [(P, 21)])
    peer.call("dealloc", cache_id)
    assert peer.stats()["caches"] == 1  # the key still references the memory
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(2, [1, 4096]))
    kvm.pull_cache(CacheKey(P, 21), dst)
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, peer.expected(cache_id, t, 8192))
    stats = peer.stats()
    assert stats["caches"] == 0 and stats["pool_used_nbytes"] == 0


def test_remove_cache_key_then_deallocate_frees(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(1, [1, 64], [(P, 30)])
    peer.call("remove_key", (P, 30))
    peer.call("remove_key", (P, 30))  # unknown keys are ignored
    dst = dd.kv_cache_manager.allocate_cache(_desc(1, [1, 64]))
    with pytest.raises(LLMException) as exc_info:
        dd.kv_cache_manager.pull_cache(CacheKey(P, 30), dst)
    assert _status(exc_info) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    peer.call("dealloc", cache_id)
    assert peer.stats()["caches"] == 0


def test_tensor_addresses_are_real_in_both_processes(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(2, [1, 16], [(P, 40)])
    remote_addrs = peer.call("addrs", cache_id)
    assert len(remote_addrs) == 1 and len(remote_addrs[0]) == 2
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(2, [1, 16]))
    (addrs,) = dst.per_device_tensor_addrs
    payload = bytes(range(32))
    ctypes.memmove(addrs[1], payload, len(payload))
    assert bytes(_raw(dst)[1]) == payload
    kvm.pull_cache(CacheKey(P, 40), dst)
    assert ctypes.string_at(addrs[0], 32) == peer.expected(cache_id, 0, 32).tobytes()


def test_concurrent_pulls_on_one_link_from_threads(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    count = 8
    cache_id = peer.alloc(2, [count, 2048], [(P, 100 + i) for i in range(count)])
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(2, [count, 2048]))
    errors: list[BaseException] = []

    def pull(i: int) -> None:
        try:
            kvm.pull_cache(CacheKey(P, 100 + i), dst, batch_index=i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=pull, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, peer.expected(cache_id, t, raw.nbytes))
    assert peer.stats()["keys"] == 0


# ----------------------------------------------------------------------------- errors before anything is sent


def test_argument_types_are_checked(linked) -> None:  # type: ignore[no-untyped-def]
    _, dd = linked
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(2, [1, 64]))
    with pytest.raises(TypeError):
        kvm.pull_cache("key", dst)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        kvm.pull_cache(CacheKey(P, 1), "cache")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        kvm.pull_cache(CacheKey(P, 1), dst, batch_index="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        kvm.pull_cache(CacheKey(P, 1), dst, batch_index=-1)
    with pytest.raises(TypeError):
        kvm.pull_cache(CacheKey(P, 1), dst, src_layer_range=[0, 1])
    with pytest.raises(TypeError):
        kvm.pull_cache(CacheKey(P, 1), dst, src_cache_offset="0")
    with pytest.raises(ValueError):
        kvm.pull_cache(CacheKey(P, 1), dst, dst_cache_offset=2**63)
    with pytest.raises(ValueError):
        kvm.pull_cache(CacheKey(P, 1), dst, src_layer_range=range(2**32, 2**32 + 1))
    # Other keyword arguments are ignored, as the real `kwargs.get` ignores them: the pull goes ahead (and
    # finds no such key over there).
    with pytest.raises(LLMException) as exc_info:
        kvm.pull_cache(CacheKey(P, 1), dst, no_such_option=1)
    assert _status(exc_info) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


@pytest.mark.parametrize("name", ["src_cache_offset", "dst_cache_offset"])
def test_negative_offset_is_value_error(linked, name) -> None:  # type: ignore[no-untyped-def]
    # The real `check_positive_or_set_default`: a ValueError with its message, before anything is sent.
    peer, dd = linked
    peer.alloc(4, [1, 64], [(P, 1)])
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(4, [1, 64]))
    with pytest.raises(ValueError, match=f"^{name}'s value:-1 is invalid, should be >= 0$"):
        kvm.pull_cache(CacheKey(P, 1), dst, **{name: -1})
    assert peer.stats()["keys"] == 1


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"size": 0}, "size 0"),
        ({"size": -2}, "size below -1"),
        ({"size": 129}, "size beyond the slot"),
        ({"batch_index": 1}, "batch index beyond the batch"),
        ({"dst_cache_offset": 100, "size": 29}, "offset + size beyond the slot"),
        ({"dst_cache_offset": 128}, "offset leaves nothing"),
        ({"src_layer_range": range(0, 2, 2)}, "step 2"),
        ({"src_layer_range": range(0, 1), "dst_layer_range": range(0, 2)}, "ranges of different length"),
        ({"src_layer_range": range(0, 1)}, "source range smaller than the destination"),
        ({"dst_layer_range": range(1, 3)}, "destination range beyond the cache"),
        ({"tensor_num_per_layer": 0}, "zero tensors per layer"),
        ({"tensor_num_per_layer": 5}, "more tensors per layer than the cache has"),
        ({"tensor_num_per_layer": 3, "dst_layer_range": range(0, 1)}, "4 tensors not a multiple of 3"),
    ],
)
def test_invalid_arguments_raise_param_invalid(linked, kwargs, why) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    peer.alloc(4, [1, 64], [(P, 1)])
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(4, [1, 64]))
    with pytest.raises(LLMException) as exc_info:
        kvm.pull_cache(CacheKey(P, 1), dst, **kwargs)
    assert _status(exc_info) == LLMStatusCode.LLM_PARAM_INVALID, why
    assert peer.stats()["keys"] == 1  # nothing was consumed


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"src_cache_offset": 100}, "source offset + size beyond the source slot"),
        (
            {"src_layer_range": range(3, 4), "dst_layer_range": range(0, 1)},
            "source range beyond the source cache",
        ),
    ],
)
def test_owner_checks_its_own_bounds(linked, kwargs, why) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    peer.alloc(4, [1, 64], [(P, 1)])
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(4, [1, 64]))
    with pytest.raises(LLMException) as exc_info:
        kvm.pull_cache(CacheKey(P, 1), dst, **kwargs)
    assert _status(exc_info) == LLMStatusCode.LLM_PARAM_INVALID, why


def test_whole_pull_needs_the_same_tensor_count(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    peer.alloc(4, [1, 64], [(P, 1)])
    dst = dd.kv_cache_manager.allocate_cache(_desc(2, [1, 64]))
    with pytest.raises(LLMException) as exc_info:
        dd.kv_cache_manager.pull_cache(CacheKey(P, 1), dst)
    assert _status(exc_info) == LLMStatusCode.LLM_PARAM_INVALID


def test_key_needs_exactly_one_of_req_and_prefix(linked) -> None:  # type: ignore[no-untyped-def]
    _, dd = linked
    dst = dd.kv_cache_manager.allocate_cache(_desc(2, [1, 64]))
    for key in (CacheKey(P, U64_MAX), CacheKey(P, 1, 0, 5)):
        with pytest.raises(LLMException) as exc_info:
            dd.kv_cache_manager.pull_cache(key, dst)
        assert _status(exc_info) == LLMStatusCode.LLM_PARAM_INVALID


def test_unknown_key_and_unknown_cache_id(linked) -> None:  # type: ignore[no-untyped-def]
    _, dd = linked
    dst = dd.kv_cache_manager.allocate_cache(_desc(2, [1, 64]))
    for key in (CacheKey(P, 999), CacheKeyByIdAndIndex(P, 9, 0)):
        with pytest.raises(LLMException) as exc_info:
            dd.kv_cache_manager.pull_cache(key, dst)
        assert _status(exc_info) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def test_pull_without_link_is_not_yet_link(seed: int) -> None:
    with decoder() as dd:
        dst = dd.kv_cache_manager.allocate_cache(_desc(2, [1, 64]))
        with pytest.raises(LLMException) as exc_info:
            dd.kv_cache_manager.pull_cache(CacheKey(5, 1), dst)
        assert _status(exc_info) == LLMStatusCode.LLM_NOT_YET_LINK


def test_pull_into_deallocated_cache_is_param_invalid(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    peer.alloc(2, [1, 64], [(P, 1)])
    dst = dd.kv_cache_manager.allocate_cache(_desc(2, [1, 64]))
    dd.kv_cache_manager.deallocate_cache(dst)
    with pytest.raises(LLMException) as exc_info:
        dd.kv_cache_manager.pull_cache(CacheKey(P, 1), dst)
    assert _status(exc_info) == LLMStatusCode.LLM_PARAM_INVALID


# ----------------------------------------------------------------------------- deadlines and dead peers


def _wait_stopped(pid: int) -> None:
    """kill() returns before the target has stopped: on another core it may still run for a while."""
    import psutil

    deadline = time.monotonic() + 10
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, "the process did not stop"
        time.sleep(0.001)


def test_a_stopped_prompt_does_not_block_pulls(seed: int) -> None:
    """Pulls resolve and pin in the Prompt's published index: a Prompt that is stopped (not dead) is not
    asked anything, so its keys are pulled and consumed all the same."""
    with PromptPeer(P, _port(), seed) as peer, decoder(sync_kv_timeout_ms=300) as dd:
        assert dd.link_clusters([peer.cluster_info()])[0] == LLMStatusCode.LLM_SUCCESS
        cache_id = peer.alloc(2, [1, 64], [(P, 1)])
        dst = dd.kv_cache_manager.allocate_cache(_desc(2, [1, 64]))
        os.kill(peer.pid, signal.SIGSTOP)
        try:
            _wait_stopped(peer.pid)
            dd.kv_cache_manager.pull_cache(CacheKey(P, 1), dst)
            with pytest.raises(LLMException) as exc_info:
                dd.kv_cache_manager.pull_cache(CacheKey(P, 1), dst)
            assert _status(exc_info) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        finally:
            os.kill(peer.pid, signal.SIGCONT)
        for t, raw in enumerate(_raw(dst)):
            np.testing.assert_array_equal(raw, peer.expected(cache_id, t, 128))
        assert peer.stats()["keys"] == 0  # the Prompt caught up with the consumption when it resumed


def test_killed_prompt_is_noticed_at_once(seed: int) -> None:
    with PromptPeer(P, _port(), seed) as peer, decoder(sync_kv_timeout_ms=60000) as dd:
        assert dd.link_clusters([peer.cluster_info()])[0] == LLMStatusCode.LLM_SUCCESS
        peer.alloc(2, [1, 64], [(P, 1)])
        dst = dd.kv_cache_manager.allocate_cache(_desc(2, [1, 64]))
        peer.kill()
        started = time.monotonic()
        with pytest.raises(LLMException) as exc_info:
            dd.kv_cache_manager.pull_cache(CacheKey(P, 1), dst)
        assert time.monotonic() - started < 5.0  # EOF, not the 60 s timeout
        assert _status(exc_info) == LLMStatusCode.LLM_LINK_FAILED
        # The dead Prompt's segments are reaped by the next start on the host.
        from llm_datadist._shm.reaper import reap

        reap()


def test_a_decoder_killed_while_holding_a_lease_leaves_the_key_pullable(linked, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    from tests._peer import PROMPT_IP, start_lease_holder

    peer, dd = linked
    cache_id = peer.alloc(2, [1, 64], [(P, 1)])
    holder = start_lease_holder(os.fspath(_runtime_dir / f"{PROMPT_IP}_{peer.port}.sock"), P, 1)
    try:
        assert peer.call("stats")["leases"] == 1
        peer.call("dealloc", cache_id)
        os.kill(holder.pid, signal.SIGKILL)
    finally:
        holder.join(10)
    deadline = time.monotonic() + 10
    while peer.stats()["leases"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert peer.stats()["leases"] == 0
    assert peer.stats()["keys"] == 1  # the dead Decoder consumed nothing
    dst = dd.kv_cache_manager.allocate_cache(_desc(2, [1, 64]))
    dd.kv_cache_manager.pull_cache(CacheKey(P, 1), dst)
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, peer.expected(cache_id, t, 128))
    assert peer.stats() == {"caches": 0, "keys": 0, "leases": 0, "pins": 0, "pool_used_nbytes": 0}


def test_several_devices_in_one_process_pull_every_device(seed: int) -> None:
    two_devices = {"ge.exec.deviceId": "0;1", "ge.session_device_id": "0"}
    port = _port()
    # A v1 PROMPT names one listen address per device (the real check); this host serves on the first.
    listen = {"llm.listenIpInfo": f"{PROMPT_IP}:{port};{PROMPT_IP}:{_port()}"}
    with (
        PromptPeer(P, port, seed, extra={**two_devices, **listen}) as peer,
        decoder(extra=two_devices) as dd,
    ):
        assert dd.link_clusters([peer.cluster_info()])[0] == LLMStatusCode.LLM_SUCCESS
        cache_id = peer.alloc(2, [1, 100], [(P, 1)])
        assert len(peer.call("addrs", cache_id)) == 2
        kvm = dd.kv_cache_manager
        dst = kvm.allocate_cache(_desc(2, [1, 100]))
        per_device = dst.per_device_tensor_addrs
        assert (
            len(per_device) == 2 and len(per_device[0]) == 2 and not set(per_device[0]) & set(per_device[1])
        )
        with pytest.raises(LLMException) as exc_info:
            kvm.pull_cache(CacheKey(P, 1), dst, src_layer_range=range(0, 1), dst_layer_range=range(0, 1))
        assert _status(exc_info) == LLMStatusCode.LLM_PARAM_INVALID
        kvm.pull_cache(CacheKey(P, 1), dst)
        raws = _raw(dst)  # device 0's tensors, then device 1's
        assert len(raws) == 4
        for t, raw in enumerate(raws):
            np.testing.assert_array_equal(raw, peer.expected(cache_id, t, 200))
        assert peer.stats()["keys"] == 0


def test_a_prompt_killed_during_the_copy_leaves_the_bytes_readable(seed: int, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    # The Decoder's side of a pull, step by step: granted, then the Prompt dies before the copy.
    from llm_datadist._errors import PeerGone
    from llm_datadist._protocol.messages import KEY_REQ, RULES_V1, Location, Ping, PinRequest, Release
    from llm_datadist._shm.mappings import MappingCache
    from llm_datadist._wire.client import ClientLink

    with PromptPeer(P, _port(), seed) as peer:
        cache_id = peer.alloc(2, [1, 3333], [(P, 1)])
        link = ClientLink.connect(
            _runtime_dir / f"127.0.0.1_{peer.port}.sock",
            cluster_id=9,
            remote_cluster_id=P,
            role=2,
            deadline=time.monotonic() + 5,
        )
        try:
            seq = link.next_seq()
            grant = link.request(
                PinRequest(seq, KEY_REQ, 1, 0, 0, 0, 2, True, 6666, 0, True, False, RULES_V1),
                seq,
                time.monotonic() + 5,
            )
            assert isinstance(grant, Location)
            mappings = MappingCache()
            segment = mappings.get(grant.segment, min_nbytes=grant.segment_nbytes)
            peer.kill()
            # The mapping outlives its owner: the granted bytes are still there to copy.
            for t, base in enumerate(grant.tensor_bases):
                offset = base + grant.slot * grant.unit_nbytes  # the puller adds the key's slot
                np.testing.assert_array_equal(
                    segment.array[offset : offset + 6666], peer.expected(cache_id, t, 6666)
                )
            with pytest.raises(PeerGone):
                link.send_only(Release(grant.lease_id, True), time.monotonic() + 5)
                seq = link.next_seq()
                link.request(Ping(seq), seq, time.monotonic() + 5)  # the next exchange fails at once
        finally:
            link.close(say_bye=False)
        from llm_datadist._shm.reaper import reap

        reap()
