"""A pull repeated with the same arguments takes the kernel's way (`_puller.fresh`: one call looks the key up
afresh), and still sees everything the owner did in between: new bytes under the key, the key gone, the
key bound to another cache, a cache its user let go, a lock holder that stopped, a push into our
cluster, a link the owner dropped. Real processes: the owner is a spawned Prompt, the puller this
process."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import numpy as np
import pytest

from llm_datadist import CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LLMException, LLMStatusCode
from llm_datadist._shm import indexkernel
from llm_datadist.ext import stats, tensor_views
from tests._peer import PROMPT_IP, PromptPeer, linked_decoder, start_index_holder

P = 1  # the Prompt's cluster id
U64 = 2**64 - 1
PREFIX = (P, U64, 0, 3)  # a prefix key: never consumed, so every pull of it may repeat


def _port() -> int:
    return 30000 + (os.getpid() * 11) % 20000


@pytest.fixture
def linked(seed: int) -> Iterator[tuple[PromptPeer, object]]:
    with linked_decoder(P, _port(), seed) as pair:
        yield pair


def _raw(cache) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    return [view.view(np.uint8).reshape(-1) for view in tensor_views(cache)]


def _pull_and_check(dd, peer: PromptPeer, key, dst, cache_id: int, **kwargs) -> None:  # type: ignore[no-untyped-def]
    for raw in _raw(dst):
        raw[:] = 0
    dd.kv_cache_manager.pull_cache(key, dst, **kwargs)
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, peer.expected(cache_id, t, raw.nbytes))


# Without the C kernel every pull takes the full way: the same outcomes, none counted here.
FAST = int(indexkernel.kernel is not None)


def _unchanged(dd) -> int:  # type: ignore[no-untyped-def]
    """Pulls that took the kernel's way rather than the full one: those that found the segments they read
    mapped here (one that finds the index lock held waits for it, as any pin does)."""
    return int(dd._require_core().transfers.fresh.done)


def _status(call) -> LLMStatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(LLMException) as exc_info:
        call()
    return exc_info.value.status_code


def test_a_repeated_pull_follows_the_owner(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    first = peer.alloc(2, [1, 32], [PREFIX])
    dst = dd.kv_cache_manager.allocate_cache(CacheDesc(2, [1, 32], DataType.DT_FLOAT16))
    key = CacheKey(*PREFIX)
    for _ in range(3):
        _pull_and_check(dd, peer, key, dst, first)
    assert _unchanged(dd) == 2 * FAST  # the first pull mapped the segment; the next two took the kernel's way

    # The key goes: the repeat finds its name gone, and the full way says so.
    peer.call("remove_key", PREFIX)
    assert _status(lambda: dd.kv_cache_manager.pull_cache(key, dst)) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST

    # The key names another cache (other bytes) in the same segment: the key is looked up afresh.
    second = peer.alloc(2, [1, 32], [PREFIX])
    repeated = _unchanged(dd)
    _pull_and_check(dd, peer, key, dst, second)
    _pull_and_check(dd, peer, key, dst, second)
    assert _unchanged(dd) == repeated + 2 * FAST

    # Its user lets it go; the key keeps it readable (v1), and the fast way still reads it.
    peer.call("dealloc", second)
    _pull_and_check(dd, peer, key, dst, second)
    assert _unchanged(dd) == repeated + 3 * FAST

    # By cache id, with a layer range, with an offset and without (it may consume a req key bound to
    # that slot): each takes the kernel's way.
    third = peer.alloc(4, [1, 32], [])
    by_id = CacheKeyByIdAndIndex(P, third, 0)
    layers = {"src_layer_range": range(1, 2), "dst_layer_range": range(0, 1), "src_cache_offset": 0}
    for offset in (0, 0, None, None):
        if offset is None:
            layers.pop("src_cache_offset", None)
        dd.kv_cache_manager.pull_cache(by_id, dst, **layers)
        for t, raw in enumerate(_raw(dst)):
            np.testing.assert_array_equal(raw, peer.expected(third, 2 + t, raw.nbytes))
    assert _unchanged(dd) == repeated + 7 * FAST

    # The owner drops the link: the repeat sees the socket closed first.
    assert peer.call("drop", 2)
    assert _status(lambda: dd.kv_cache_manager.pull_cache(key, dst)) == LLMStatusCode.LLM_LINK_FAILED


def test_a_repeated_pull_waits_for_a_stopped_lock_holder_as_any_pull(linked, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    first = peer.alloc(2, [1, 32], [PREFIX])
    dst = dd.kv_cache_manager.allocate_cache(CacheDesc(2, [1, 32], DataType.DT_FLOAT16))
    key = CacheKey(*PREFIX)
    _pull_and_check(dd, peer, key, dst, first)
    holder, pipe = start_index_holder(os.fspath(_runtime_dir / f"{PROMPT_IP}_{peer.port}.sock"), P, "lock")
    before = stats()
    try:
        assert (
            _status(lambda: dd.kv_cache_manager.pull_cache(key, dst))
            == LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT
        )
        # The stats say so: a wait for the lock, a failure by its code (docs/metrics.md).
        waited = stats().since(before)
        assert waited.gauges["index_lock_waits"] > before.gauges["index_lock_waits"]
        assert waited.counters["status.LLM_WAIT_PROCESS_TIMEOUT"] == 1
        assert waited.counters["v1.pull.failures"] == 1
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
        pipe.close()
    repeated = _unchanged(dd)
    _pull_and_check(dd, peer, key, dst, first)
    assert _unchanged(dd) == repeated + FAST


def test_a_repeated_pull_into_a_deallocated_cache_is_refused(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    first = peer.alloc(2, [1, 32], [PREFIX])
    dst = dd.kv_cache_manager.allocate_cache(CacheDesc(2, [1, 32], DataType.DT_FLOAT16))
    key = CacheKey(*PREFIX)
    _pull_and_check(dd, peer, key, dst, first)
    dd.kv_cache_manager.deallocate_cache(dst)
    assert _status(lambda: dd.kv_cache_manager.pull_cache(key, dst)) == LLMStatusCode.LLM_PARAM_INVALID


def test_a_repeated_one_sided_read_follows_the_owners_registered_memory(seed: int, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """v2 with remote cache access: a `pull_blocks` of memory the owner registered, repeated, is one call
    of the C kernel's checked read (`vm_read_checked`), which still sees new bytes, a newer cache under the
    model id, the cache unregistered, and the owner killed."""
    import json

    from llm_datadist import BlocksCacheKey, LLMClusterInfo
    from llm_datadist._puller import oneside as _oneside
    from llm_datadist._shm.reaper import reap
    from tests._peer import decoder, tensor_views_v2

    kernel = _oneside._vm_read_checked
    if kernel is None:
        pytest.skip("the C kernel's checked read is not built here (or LLM_DATADIST_NO_EXTENSION is set)")
    outcomes: list[int] = []

    def counted(*args):  # type: ignore[no-untyped-def]
        outcome = int(kernel(*args))
        outcomes.append(outcome)
        return outcome

    monkeypatch.setattr(_oneside, "_vm_read_checked", counted)
    done, stale, gone = _oneside._VM_DONE, _oneside._VM_STALE, _oneside._VM_GONE
    extra = {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.MemPoolConfig": json.dumps({"memory_size": 16 << 20, "page_shift": 16}),
    }
    port = _port() + 1
    with PromptPeer(P, port, seed, extra=extra) as peer, decoder(2, extra=extra) as dd:
        first = peer.call("v2_register_blocks", (2, [8, 96], 0, True))
        manager = dd.cache_manager
        desc = CacheDesc(2, [8, 96], DataType.DT_FLOAT16)
        local = manager.allocate_blocks_cache(desc, BlocksCacheKey(2, 0))
        views = [view.view(np.uint8).reshape(8, 192) for view in tensor_views_v2(local)]
        info = LLMClusterInfo()
        info.remote_cluster_id = P
        info.append_local_ip_info(PROMPT_IP, 0)
        info.append_remote_ip_info(PROMPT_IP, port)
        assert dd.link_clusters([info], 5000)[0] == LLMStatusCode.LLM_SUCCESS
        key = BlocksCacheKey(P, 0)

        def pull_and_check(cache_index: int) -> None:
            for view in views:
                view[:] = 0
            manager.pull_blocks(key, local, [2], [5])
            for t, view in enumerate(views):
                expected = peer.expected(cache_index, t, 8 * 192).reshape(8, 192)
                np.testing.assert_array_equal(view[5], expected[2])

        for _ in range(3):
            pull_and_check(first)
        assert outcomes == [done, done]  # the first read looked everything up; the next two were one call
        peer.call("v2_rewrite", first)  # new bytes in the same memory
        pull_and_check(first + 1000)
        assert outcomes[-1] == done
        # A newer cache takes the model id over: the table's version word changed, the read looks again.
        newer = peer.call("v2_register_blocks", (2, [8, 96], 0, True))
        pull_and_check(newer)
        assert outcomes[-1] == stale
        pull_and_check(newer)
        assert outcomes[-1] == done
        peer.call("v2_unregister", first)
        peer.call("v2_unregister", newer)
        with pytest.raises(LLMException) as exc_info:
            manager.pull_blocks(key, local, [2], [5])
        assert exc_info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        assert outcomes[-1] == stale
        third = peer.call("v2_register_blocks", (2, [8, 96], 0, True))
        pull_and_check(third)
        peer.kill()
        with pytest.raises(LLMException) as exc_info:
            manager.pull_blocks(key, local, [2], [5])
        assert exc_info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
        assert outcomes[-1] == gone
    reap()
