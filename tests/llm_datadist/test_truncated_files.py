"""A file shrunk under its mappings fails a transfer, never a process. Any process of the user can truncate
the files behind an owner: its published index, its generation words, its pool segments. Every read of
them, by the owner and by its pullers, goes through pread, the C kernel's SIGBUS guard or process_vm_readv,
so what would have been SIGBUS is LLM_FAILED for that transfer; the owner grows its index back and
republishes it from its own record, and later pulls work.

Real processes through the public API: the owner is a Prompt in a child process (`tests._peer`), this
process is the Decoder. The owner is stopped (SIGSTOP) while the file is cut, so that the Decoder meets the
damage before the owner's next look repairs it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)
from llm_datadist.ext import tensor_views
from llm_datadist.v2.llm_types import U64_MAX
from tests._peer import PROMPT_IP, PromptPeer, decoder, tensor_views_v2

P, D = 1, 2
SHAPE = [1, 4096]  # 8 KiB a tensor


@pytest.fixture
def port(request: pytest.FixtureRequest) -> int:
    return 29000 + (hash(request.node.nodeid) % 900)


def _truncate(name: str, nbytes: int) -> None:
    os.truncate(f"/dev/shm/{name.lstrip('/')}", nbytes)


@contextmanager
def _stopped(peer: PromptPeer) -> Iterator[None]:
    """The owner stopped: its housekeeping cannot repair anything meanwhile."""
    os.kill(peer.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(peer.pid, signal.SIGCONT)


def _failed(call: object) -> LLMStatusCode:
    with pytest.raises(LLMException) as info:
        call()  # type: ignore[operator]
    return info.value.status_code


def _right_or_failed(call: object) -> None:
    try:
        call()  # type: ignore[operator]
    except LLMException as exc:
        assert exc.status_code == LLMStatusCode.LLM_FAILED, exc


def _eventually(call: object, timeout_s: float = 10.0) -> None:
    """`call` succeeds once the owner repaired what was cut (its next lock, at most half a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            call()  # type: ignore[operator]
            return
        except LLMException as exc:
            assert exc.status_code == LLMStatusCode.LLM_FAILED, exc
            assert time.monotonic() < deadline, f"still failing after the owner's repair: {exc}"
            time.sleep(0.05)


@pytest.mark.parametrize("size", ["empty", "one page", "half"])
def test_a_shrunk_index_fails_a_pull_and_the_owner_grows_it_back(seed: int, port: int, size: str) -> None:
    with PromptPeer(P, port, seed) as peer, decoder(D) as dd:
        assert dd.link_clusters([peer.cluster_info()], 5000)[0] == LLMStatusCode.LLM_SUCCESS
        manager = dd.kv_cache_manager
        local = manager.allocate_cache(CacheDesc(2, SHAPE, DataType.DT_FLOAT16))
        first = peer.alloc(2, SHAPE, [(P, 0)])
        second = peer.alloc(2, SHAPE, [(P, 1)])
        peer.alloc(2, SHAPE, [(P, U64_MAX, 0, 5)])  # a prefix key: pulled again and again, never consumed
        manager.pull_cache(CacheKey(P, 0), local, 0)  # maps the index
        repeat = lambda: manager.pull_cache(CacheKey(P, U64_MAX, 0, 5), local, 0)  # noqa: E731
        repeat()
        repeat()  # a repeat: the C kernel's path where it is built
        index = peer.call("segments")["index"]
        nbytes = os.stat(f"/dev/shm/{index.lstrip('/')}").st_size
        cut = {"empty": 0, "one page": 4096, "half": nbytes // 2}[size]
        # The owner looks at what pullers did (key 0 consumed) first: what pullers write into the part of
        # the file that is cut before the owner's next look is lost with it.
        assert peer.stats()["keys"] == 2
        with _stopped(peer):
            _truncate(index, cut)
            assert _failed(lambda: manager.pull_cache(CacheKey(P, 1), local, 0)) == LLMStatusCode.LLM_FAILED
            if size != "half":
                assert _failed(repeat) == LLMStatusCode.LLM_FAILED
            else:  # a repeat reads only what it read before: where that was not cut, it goes through
                _right_or_failed(repeat)
        # The owner is alive, grows the file back at its next look and republishes it: the key that a
        # failed pull could not reserve is pulled now, whole.
        _eventually(lambda: manager.pull_cache(CacheKey(P, 1), local, 0))
        got = tensor_views(local)[1].view(np.uint8).reshape(-1)
        np.testing.assert_array_equal(got, peer.expected(second, 1, got.nbytes))
        _eventually(repeat)
        assert os.stat(f"/dev/shm/{index.lstrip('/')}").st_size == nbytes
        peer.alloc(2, SHAPE, [(P, 2)])  # the owner's own calls work
        manager.pull_cache(CacheKey(P, 2), local, 0)
        stats = peer.stats()
        assert stats["keys"] == 1 and stats["pins"] == 0  # the prefix key; three req keys consumed
        del first


# A small pull copies under the index lock; a larger one pins through the row and copies with it free,
# from 512 KiB with the kernel's helper thread taking a share.
@pytest.mark.parametrize("shape", [SHAPE, [1, 65536], [1, 1 << 20]], ids=["held", "pinned", "helper"])
def test_a_shrunk_pool_segment_fails_the_pull_not_the_puller(seed: int, port: int, shape: list[int]) -> None:
    with PromptPeer(P, port, seed) as peer, decoder(D) as dd:
        assert dd.link_clusters([peer.cluster_info()], 5000)[0] == LLMStatusCode.LLM_SUCCESS
        manager = dd.kv_cache_manager
        local = manager.allocate_cache(CacheDesc(2, shape, DataType.DT_FLOAT16))
        peer.alloc(2, shape, [(P, 0)])
        peer.alloc(2, shape, [(P, 1)])
        manager.pull_cache(CacheKey(P, 0), local, 0)  # maps the pool segment
        (pool,) = peer.call("segments")["pools"]
        _truncate(pool, 0)
        code = _failed(lambda: manager.pull_cache(CacheKey(P, 1), local, 0))
        assert code == LLMStatusCode.LLM_FAILED
        # Both processes live on: the owner answers, and the Decoder's pull of a cache in a segment of
        # its own works.
        stats = peer.stats()
        assert stats["keys"] == 1 and stats["pins"] == 0  # the failed pull gave its key back
        big = peer.alloc(1, [1, 40 << 20], [(P, 2)])  # 80 MiB: more than the pool's first segment
        local_big = manager.allocate_cache(CacheDesc(1, [1, 40 << 20], DataType.DT_FLOAT16))
        manager.pull_cache(CacheKey(P, 2), local_big, 0)
        got = tensor_views(local_big)[0].view(np.uint8).reshape(-1)
        np.testing.assert_array_equal(got, peer.expected(big, 0, got.nbytes))


def _v2_extra() -> dict[str, str]:
    return {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.MemPoolConfig": json.dumps({"memory_size": 64 << 20, "page_shift": 16}),
    }


@contextmanager
def _v2_decoder() -> Iterator[LLMDataDist]:
    dd = LLMDataDist(LLMRole.DECODER, D)
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = 5000
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.mem_pool_cfg = json.dumps({"memory_size": 64 << 20, "page_shift": 16})
    dd.init(config.generate_options())
    try:
        yield dd
    finally:
        dd.finalize()


@pytest.mark.parametrize("memory", ["pool", "registered"])
@pytest.mark.parametrize("file", ["generations", "index"])
def test_a_shrunk_file_fails_a_one_sided_read(seed: int, port: int, memory: str, file: str) -> None:
    with PromptPeer(P, port, seed, extra=_v2_extra()) as peer, _v2_decoder() as dd:
        if memory == "registered":
            cache_id = peer.call("v2_register_blocks", (2, [8, 96], 0, True))
        else:
            cache_id = peer.call("v2_alloc", (2, [8, 96], [], 0))
        desc = CacheDesc(2, [8, 96], DataType.DT_FLOAT16)
        cache = dd.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(D, 0))
        info = LLMClusterInfo()
        info.remote_cluster_id = P
        info.append_local_ip_info(PROMPT_IP, 0)
        info.append_remote_ip_info(PROMPT_IP, port)
        assert dd.link_clusters([info], 5000)[0] == LLMStatusCode.LLM_SUCCESS
        pull = lambda: dd.cache_manager.pull_blocks(BlocksCacheKey(P, 0), cache, [2], [2])  # noqa: E731
        pull()
        pull()  # a repeat: the C kernel's checked read where it is built
        name = peer.call("segments")[file]
        with _stopped(peer):
            _truncate(name, 0)
            if file == "generations":  # every one-sided read checks its cache's word
                assert _failed(pull) == LLMStatusCode.LLM_FAILED
            else:  # a read of a cache in the table it already holds reads no index
                _right_or_failed(pull)
        if file == "index":  # the owner grows its index back; generation words are lost for good
            _eventually(pull)
            got = tensor_views_v2(cache)[0].reshape(8, -1)[2]
            np.testing.assert_array_equal(got, peer.expected(cache_id, 0, 8 * 192).reshape(8, 192)[2])
        assert peer.stats()["caches"] == 1  # the owner lives
