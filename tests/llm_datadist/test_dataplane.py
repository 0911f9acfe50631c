"""The data plane on one host: pulls resolve, pin and consume in the owner's published index, with no
message to the owner. Real processes throughout: the owner is a spawned Prompt, the pullers are this
process and spawned holders that pin, lock, or die holding a pin."""

from __future__ import annotations

import os
import signal
import struct
import time
from collections.abc import Iterator
from pathlib import Path

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
from tests._peer import PROMPT_IP, PromptPeer, linked_decoder, start_index_holder

P = 1  # the Prompt's cluster id
REQ = 1  # key kinds as the protocol numbers them
PREFIX = 2
_next_port = [0]


def _port() -> int:
    _next_port[0] += 1
    return 30000 + (os.getpid() * 7 + _next_port[0]) % 20000


def _desc(num_tensors: int, shape: list[int]) -> CacheDesc:
    return CacheDesc(num_tensors, shape, DataType.DT_FLOAT16)


def _raw(cache) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    return [view.view(np.uint8).reshape(-1) for view in tensor_views(cache)]


def _status(exc_info: pytest.ExceptionInfo[LLMException]) -> LLMStatusCode:
    return exc_info.value.status_code


@pytest.fixture
def linked(seed: int) -> Iterator[tuple[PromptPeer, object]]:
    with linked_decoder(P, _port(), seed) as pair:
        yield pair


def _socket_file(runtime: Path, peer: PromptPeer) -> str:
    return os.fspath(runtime / f"{PROMPT_IP}_{peer.port}.sock")


def _reap(process) -> None:  # type: ignore[no-untyped-def]
    if process.is_alive():
        os.kill(process.pid, signal.SIGKILL)
    process.join(10)


def _wait_for(condition, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_pull_wakes_no_owner_thread(linked) -> None:  # type: ignore[no-untyped-def]
    """The owner's server thread handles no message for a pull: its count of handled messages stays put
    over many pulls by key, by id and of blocks, and the owner catches up with what they consumed."""
    peer, dd = linked
    cache_id = peer.alloc(2, [2, 64], [(P, 1), (P, 2**64 - 1, 0, 5)])
    blocks_id = peer.alloc_blocks(2, [4, 32], 9)
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(_desc(2, [2, 64]))
    dst_blocks = kvm.allocate_blocks_cache(_desc(2, [4, 32]), None)
    before = peer.call("handled")
    from llm_datadist import BlocksCacheKey

    for _ in range(200):
        kvm.pull_cache(CacheKey(P, 2**64 - 1, 0, 5), dst, batch_index=1)
        kvm.pull_blocks(BlocksCacheKey(P, 9), dst_blocks, [0, 3], [1, 2])
    kvm.pull_cache(CacheKeyByIdAndIndex(P, cache_id, 0), dst)  # consumes req 1, bound to slot 0
    assert peer.call("handled") == before
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, peer.expected(cache_id, t, 256))
    stats = peer.stats()
    assert stats["keys"] == 1 and stats["pins"] == 0  # req 1 consumed, prefix 5 stays
    expected = [peer.expected(blocks_id, t, 256) for t in range(2)]
    for t, raw in enumerate(_raw(dst_blocks)):
        np.testing.assert_array_equal(raw[64:128], expected[t][0:64])
        np.testing.assert_array_equal(raw[128:192], expected[t][192:256])


def test_a_puller_killed_holding_a_pin_gives_the_key_back(linked, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """A pin names its puller's row: when the puller dies, the owner clears the row, gives back what the
    pin consumed, and frees the cache that only that pin kept."""
    peer, dd = linked
    cache_id = peer.alloc(2, [1, 32], [(P, 1)])
    holder, pipe = start_index_holder(_socket_file(_runtime_dir, peer), P, "pin", (REQ, 1, 0))
    try:
        assert peer.call("stats")["pins"] == 1
        assert peer.call("stats")["keys"] == 1  # consumed in the index, but a pin still refers to it
        with pytest.raises(LLMException) as exc_info:
            dd.kv_cache_manager.pull_cache(
                CacheKey(P, 1), dd.kv_cache_manager.allocate_cache(_desc(2, [1, 32]))
            )
        assert _status(exc_info) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST  # taken by the holder's pin
        peer.call("dealloc", cache_id)
        os.kill(holder.pid, signal.SIGKILL)
    finally:
        _reap(holder)
        pipe.close()
    _wait_for(lambda: peer.call("stats")["pins"] == 0)
    assert peer.call("stats")["keys"] == 1  # the dead puller consumed nothing
    dst = dd.kv_cache_manager.allocate_cache(_desc(2, [1, 32]))
    dd.kv_cache_manager.pull_cache(CacheKey(P, 1), dst)
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, peer.expected(cache_id, t, 64))
    assert peer.stats() == {"caches": 0, "keys": 0, "leases": 0, "pins": 0, "pool_used_nbytes": 0}


def test_a_cache_freed_under_a_pin_is_freed_when_the_pin_ends(linked, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    peer, _ = linked
    cache_id = peer.alloc(2, [1, 32], [(P, 1)])
    holder, pipe = start_index_holder(_socket_file(_runtime_dir, peer), P, "pin", (REQ, 1, 0))
    try:
        peer.call("dealloc", cache_id)
        stats = peer.call("stats")
        assert stats["caches"] == 1 and stats["pool_used_nbytes"] > 0  # the pinned memory is kept
        pipe.send("unpin")
        assert pipe.poll(10) and pipe.recv() == ("ok", "unpinned")
        # The holder's pull ended well: its key is consumed, and the cache goes at the owner's next look.
        _wait_for(lambda: peer.call("stats")["caches"] == 0)
        assert peer.call("stats") == {"caches": 0, "keys": 0, "leases": 0, "pins": 0, "pool_used_nbytes": 0}
    finally:
        _reap(holder)
        pipe.close()


def test_a_stopped_lock_holder_gives_the_timeout_code(linked, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """Every wait is bounded: a process stopped while it holds the index lock makes a pull fail with v1's
    timeout code within sync_kv_timeout (400 ms here), and pulls work again once it is gone."""
    peer, dd = linked
    cache_id = peer.alloc(2, [1, 32], [(P, 2**64 - 1, 0, 3)])
    dst = dd.kv_cache_manager.allocate_cache(_desc(2, [1, 32]))
    holder, pipe = start_index_holder(_socket_file(_runtime_dir, peer), P, "lock")
    try:
        started = time.monotonic()
        with pytest.raises(LLMException) as exc_info:
            dd.kv_cache_manager.pull_cache(CacheKey(P, 2**64 - 1, 0, 3), dst)
        assert _status(exc_info) == LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT
        assert time.monotonic() - started < 5.0
    finally:
        _reap(holder)  # the kernel drops a dead holder's lock
        pipe.close()
    dd.kv_cache_manager.pull_cache(CacheKey(P, 2**64 - 1, 0, 3), dst)
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, peer.expected(cache_id, t, 64))


def test_a_corrupt_index_fails_the_pull_not_the_puller(linked) -> None:  # type: ignore[no-untyped-def]
    """The index is hostile input: a cache entry that points past its segment is refused (LLM_FAILED)."""
    peer, dd = linked
    peer.alloc(2, [1, 32], [(P, 2**64 - 1, 0, 3)])
    dst = dd.kv_cache_manager.allocate_cache(_desc(2, [1, 32]))
    dd.kv_cache_manager.pull_cache(CacheKey(P, 2**64 - 1, 0, 3), dst)
    name = peer.call("index_name")
    with open(f"/dev/shm/{name[1:]}", "r+b") as index_file:
        header = index_file.read(64)
        rows, caches = struct.unpack_from("<II", header, 32)
        # Every live cache entry: its offset (at +24 within the entry) far past its segment.
        base = 4096 + rows * 128
        for slot in range(min(caches, 64)):
            index_file.seek(base + slot * 128)
            if struct.unpack("<Q", index_file.read(8))[0]:
                index_file.seek(base + slot * 128 + 24)
                index_file.write(struct.pack("<Q", 1 << 50))
    with pytest.raises(LLMException) as exc_info:
        dd.kv_cache_manager.pull_cache(CacheKey(P, 2**64 - 1, 0, 3), dst)
    assert _status(exc_info) == LLMStatusCode.LLM_FAILED


def test_unregister_waits_for_a_pin_on_registered_memory(seed: int, _runtime_dir: Path) -> None:
    """Registered memory is in the index too: a v2 puller pins it with no message, and the owner's
    unregister_cache waits for that pin (LLM_TIMEOUT past sync_kv_timeout, the cache still registered),
    then goes through once the pin ended."""
    import json

    extra = {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.MemPoolConfig": json.dumps({"memory_size": 16 << 20, "page_shift": 16}),
        "llm.SyncKvCacheWaitTime": "300",
    }
    with PromptPeer(P, _port(), seed, extra=extra) as peer:
        cache_id = peer.call("v2_register_blocks", (2, [8, 64], 5, True))
        holder, pipe = start_index_holder(_socket_file(_runtime_dir, peer), P, "pin-v2", (4, 0, 5))
        try:
            assert peer.call("stats")["pins"] == 1
            with pytest.raises(RuntimeError, match="LLM_TIMEOUT"):
                peer.call("v2_unregister", cache_id)
            pipe.send("unpin")
            assert pipe.poll(10) and pipe.recv() == ("ok", "unpinned")
            peer.call("v2_unregister", cache_id)
            assert peer.call("stats")["caches"] == 0
        finally:
            _reap(holder)
            pipe.close()


def test_a_row_the_owner_took_back_ends_the_link(linked) -> None:  # type: ignore[no-untyped-def]
    """The owner ends a connection (finalizing, or dropping it) between the puller's look at the socket
    and its lock on the index: the row it finds is no longer its own, and the pull reports the link gone
    (LLM_LINK_FAILED), not a corrupt index. The race is made deterministic by pinning without the look."""
    from llm_datadist._puller.dataplane import peer_index, pin
    from llm_datadist._puller.source import SourceRef

    peer, dd = linked
    peer.alloc(2, [1, 32], [(P, 1)])
    dst = dd.kv_cache_manager.allocate_cache(_desc(2, [1, 32]))
    core = dd._require_core()
    link = core.links.get(P)
    index = peer_index(link, core.incarnation, time.monotonic() + 5, core.settings.timeout_code)
    assert index is not None
    assert peer.call("drop", 2)  # clears our row, closes our connection
    with pytest.raises(Exception) as exc_info:
        pin(
            link,
            index,
            SourceRef(REQ, 1, 0, 0, 0, 2, True, 64, 0, True),
            cluster_id=2,
            deadline=time.monotonic() + 5,
            timeout_code=LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
        )
    assert getattr(exc_info.value, "code", None) == LLMStatusCode.LLM_LINK_FAILED
    assert link.broken is not None
    with pytest.raises(LLMException) as api_exc:
        dd.kv_cache_manager.pull_cache(CacheKey(P, 1), dst)
    assert _status(api_exc) == LLMStatusCode.LLM_LINK_FAILED
    assert peer.stats()["keys"] == 1  # nothing was consumed
