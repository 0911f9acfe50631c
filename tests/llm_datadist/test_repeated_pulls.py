"""A pull repeated with the same arguments takes its pin again the cheap way (`_transfers.Repeat`), and
still sees everything the owner did in between: new bytes under the key, the key gone, the key bound to
another cache, a cache its user let go, a lock holder that stopped, a push into our cluster, a link the
owner dropped. Real processes: the owner is a spawned Prompt, the puller this process."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import numpy as np
import pytest

from llm_datadist import CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LLMException, LLMStatusCode
from llm_datadist.ext import tensor_views
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


def _unchanged(dd) -> int:  # type: ignore[no-untyped-def]
    """Pulls that ran as a repeat: those that found nothing changed (one that finds the index lock held
    waits for it, as any pin does)."""
    return int(dd._require_core().transfers.repeated)


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
    assert _unchanged(dd) == 2  # the first pull planned; the next two repeated it

    # The key goes: the repeat finds its name gone, and the full way says so.
    peer.call("remove_key", PREFIX)
    assert _status(lambda: dd.kv_cache_manager.pull_cache(key, dst)) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST

    # The key names another cache (other bytes): the first pull of it plans again, the next repeats.
    second = peer.alloc(2, [1, 32], [PREFIX])
    repeated = _unchanged(dd)
    _pull_and_check(dd, peer, key, dst, second)
    _pull_and_check(dd, peer, key, dst, second)
    assert _unchanged(dd) == repeated + 1

    # Its user lets it go; the key keeps it readable (v1), and the repeat still reads it.
    peer.call("dealloc", second)
    _pull_and_check(dd, peer, key, dst, second)
    assert _unchanged(dd) == repeated + 2

    # By cache id, with a layer range and an offset (a pull that consumes nothing): a repeat of its own;
    # without an offset it may consume a req key bound to that slot later, and is planned every time.
    third = peer.alloc(4, [1, 32], [])
    by_id = CacheKeyByIdAndIndex(P, third, 0)
    layers = {"src_layer_range": range(1, 2), "dst_layer_range": range(0, 1), "src_cache_offset": 0}
    for offset in (0, 0, None, None):
        if offset is None:
            layers.pop("src_cache_offset", None)
        dd.kv_cache_manager.pull_cache(by_id, dst, **layers)
        for t, raw in enumerate(_raw(dst)):
            np.testing.assert_array_equal(raw, peer.expected(third, 2 + t, raw.nbytes))
    assert _unchanged(dd) == repeated + 3

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
    try:
        assert (
            _status(lambda: dd.kv_cache_manager.pull_cache(key, dst))
            == LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT
        )
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
        pipe.close()
    repeated = _unchanged(dd)
    _pull_and_check(dd, peer, key, dst, first)
    assert _unchanged(dd) == repeated + 1


def test_a_repeated_pull_into_a_deallocated_cache_is_refused(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    first = peer.alloc(2, [1, 32], [PREFIX])
    dst = dd.kv_cache_manager.allocate_cache(CacheDesc(2, [1, 32], DataType.DT_FLOAT16))
    key = CacheKey(*PREFIX)
    _pull_and_check(dd, peer, key, dst, first)
    dd.kv_cache_manager.deallocate_cache(dst)
    assert _status(lambda: dd.kv_cache_manager.pull_cache(key, dst)) == LLMStatusCode.LLM_PARAM_INVALID
