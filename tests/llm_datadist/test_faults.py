"""Fault injection at each step of a transfer's pin: a Decoder process stops itself after it pinned (in
the owner's index, or by a lease for a cache the index cannot hold) and before it copied, or after it
copied and before it let go; meanwhile the owner (this process) ends the link from its side (unlink, drop,
finalize), tries to free and reuse the memory, or the Decoder is killed. After each: a transfer that
reported success moved only the bytes that memory held while pinned (never what the owner wrote into
reused memory), the owner leaked nothing (pool bytes, rows, names, leases), the key came back or stayed
consumed by the rules, and the owner's server answered another peer while the Decoder was stopped."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any

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
from llm_datadist._protocol.messages import Ping, Pong
from llm_datadist._runtime import socket_path
from llm_datadist._shm import indexkernel
from llm_datadist._wire.client import ClientLink
from tests._fault_peer import FaultPeer, Transfer, finalize_during_pull

OWNER_ID = 1
SOURCE = 0x11  # what the owner's cache holds while a Decoder pulls it
REUSED = 0x22  # what the owner writes into memory it was able to reuse
PUSHED = 0x33  # what a Decoder pushes
# Tensors of a cache the index cannot publish (a key's tensors are a 512-bit mask): pulls of it lease.
LEASED_TENSORS = 514


def _owner(
    v2: bool, port: int, sync_kv_timeout_ms: int, pool_nbytes: int = 64 << 20, *, remote: bool = False
) -> LLMDataDist:
    """The owner, in this process, with a pool of `pool_nbytes` (small: freed memory is reused soon)."""
    datadist = LLMDataDist(LLMRole.PROMPT, OWNER_ID)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = f"127.0.0.1:{port}"
    config.sync_kv_timeout = sync_kv_timeout_ms
    if v2:
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = remote
        config.mem_pool_cfg = f'{{"memory_size": {pool_nbytes}, "page_shift": 12}}'
    options = dict(config.generate_options())
    if not v2:
        options.update({"ge.flowGraphMemMaxSize": str(pool_nbytes), "llm.MemoryUtilization": "1.0"})
    datadist.init(options)
    return datadist


def _unregister_eventually(owner: LLMDataDist, cache_id: int) -> None:
    """Unregister once whatever pinned the cache let go (its holder unpinned or was seen dead)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            owner.cache_manager.unregister_cache(cache_id)
            return
        except LLMException as exc:
            assert exc.status_code == LLMStatusCode.LLM_TIMEOUT and time.monotonic() < deadline, exc


def _fill(cache: Any, value: int) -> None:
    nbytes = cache.cache_desc.size
    addrs = cache.tensor_addrs if hasattr(cache, "tensor_addrs") else cache.per_device_tensor_addrs[0]
    for addr in addrs:
        ctypes.memset(addr, value, nbytes)


def _ping_answered(port: int) -> float:
    """Seconds the owner's server took to answer a Ping from a fresh link (another peer)."""
    started = time.monotonic()
    link = ClientLink.connect(
        socket_path("127.0.0.1", port),
        cluster_id=99,
        remote_cluster_id=OWNER_ID,
        role=2,
        deadline=started + 5,
    )
    try:
        seq = link.next_seq()
        assert isinstance(link.request(Ping(seq), seq, time.monotonic() + 5), Pong)
    finally:
        link.close(say_bye=True)
    return time.monotonic() - started


def _reaped(pid: int) -> None:
    """The owner, a survivor, removes what a killed Decoder left in /dev/shm (as soon as it is gone)."""
    deadline = time.monotonic() + 15
    while any(f".{pid}." in name for name in os.listdir("/dev/shm")):
        assert time.monotonic() < deadline, f"segments of the killed pid {pid} were not reaped"
        time.sleep(0.05)


def _no_leak(datadist: LLMDataDist) -> None:
    """Once every cache is freed and the Decoder gone: nothing of the owner's table or index is held."""
    core = datadist._require_core()
    deadline = time.monotonic() + 10
    while True:
        core.table.sync()
        stats = core.leases.stats()
        rows_free = len(core.table.mirror.rows._free) == core.table.index.rows
        names_free = len(core.table.mirror._free_names) == core.table.index.names
        if stats == {"caches": 0, "keys": 0, "leases": 0, "pins": 0, "pool_used_nbytes": 0} and rows_free:
            assert names_free
            return
        assert time.monotonic() < deadline, (stats, rows_free, core.table.mirror.rows.orphans)
        time.sleep(0.02)


@pytest.fixture
def port(request: pytest.FixtureRequest) -> int:
    return 27000 + (hash(request.node.nodeid) % 900)


# ----------------------------------------------------------------------------------- pulls of pool caches


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("path", ["index", "lease", "kernel"])
@pytest.mark.parametrize("point", ["pinned", "copied"])
@pytest.mark.parametrize("fault", ["reuse", "drop", "kill"])
def test_a_pull_never_returns_reused_memory(v2: bool, path: str, point: str, fault: str, port: int) -> None:
    """A Decoder stopped mid-pull while the owner drops its link (v2: `unlink_clusters` from the serving
    side), frees the cache and reuses the pool, or the Decoder is killed. "kernel": a v1 pull after a first
    pull from the same segment, which the C kernel pins (`_puller.fresh`)."""
    if path == "kernel" and (v2 or indexkernel.kernel is None):
        pytest.skip("the C kernel's way is v1's, and needs the kernel built")
    tensors = LEASED_TENSORS if path == "lease" else 4
    shape = (1, 2048)  # 4 KiB a tensor
    owner = _owner(v2, port, 20_000, pool_nbytes=4 * tensors * 4096)  # room for four such caches
    manager: Any = owner.cache_manager if v2 else owner.kv_cache_manager
    peer = None
    try:
        source = manager.allocate_cache(
            CacheDesc(tensors, list(shape), DataType.DT_FLOAT16), [CacheKey(OWNER_ID, req_id=7)]
        )
        _fill(source, SOURCE)
        warm = None
        if path == "kernel":
            warm = manager.allocate_cache(
                CacheDesc(tensors, list(shape), DataType.DT_FLOAT16), [CacheKey(OWNER_ID, req_id=8)]
            )
        transfer = Transfer(v2, "pull", tensors, shape, req_id=7, point=point, warm_req_id=8 if warm else 0)
        peer = FaultPeer(OWNER_ID, port, transfer)
        assert peer.expect("linked") == ([int(LLMStatusCode.LLM_SUCCESS)],)
        assert peer.expect("at") == ((point, "kernel") if warm else (point,))
        if warm is not None:
            manager.deallocate_cache(warm)  # its key was pulled whole: nothing else holds it
        peer.wait_stopped()
        assert _ping_answered(port) < 1.0  # the stopped Decoder holds no lock: the server answers at once
        reused: list[Any] = []
        if fault == "drop":
            if v2:
                info = LLMClusterInfo()
                info.remote_cluster_id = 2
                ret, _ = owner.unlink_clusters([info])
                assert ret == LLMStatusCode.LLM_SUCCESS
            else:
                owner._require_core().drop_peer(2)
        if fault in ("reuse", "drop"):
            manager.remove_cache_key(CacheKey(OWNER_ID, req_id=7))
            manager.deallocate_cache(source)
            # Take every byte the pool will give: the pinned cache's memory must not be among it.
            with pytest.raises(LLMException) as exc_info:
                for _ in range(64):
                    cache = manager.allocate_cache(CacheDesc(tensors, list(shape), DataType.DT_FLOAT16))
                    _fill(cache, REUSED)
                    reused.append(cache)
            assert exc_info.value.status_code in (
                LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY,
                LLMStatusCode.LLM_OUT_OF_MEMORY,
            )
        if fault == "kill":
            peer.kill()
            _reaped(peer.process.pid)
        else:
            peer.resume()
            outcome = peer.expect("done")
            if outcome[0] == "ok":
                assert all(set(data) == {SOURCE} for data in outcome[1]), "a pull returned reused memory"
            else:
                assert outcome[0] == "failed", outcome
                assert outcome[1] == int(LLMStatusCode.LLM_LINK_FAILED), outcome
            if fault == "reuse":
                assert outcome[0] == "ok", outcome  # nothing ended the link: the pull completes
            peer.close()
        for cache in reused:
            manager.deallocate_cache(cache)
        if fault == "kill":
            # The pull never finished: the key (and so the cache) came back, whole.
            core = owner._require_core()
            deadline = time.monotonic() + 10
            while core.table.bound((1, 7, 0)) is None:
                assert time.monotonic() < deadline, "the key of a killed pull did not come back"
                time.sleep(0.02)
            manager.remove_cache_key(CacheKey(OWNER_ID, req_id=7))
            manager.deallocate_cache(source)
        _no_leak(owner)
    finally:
        if peer is not None:
            peer.close()
        owner.finalize()


# ----------------------------------------------------------------------------------- registered memory (v2)


def _registered(
    owner: LLMDataDist, tensors: int, shape: tuple[int, ...], *, blocks: bool
) -> tuple[Any, list[np.ndarray]]:
    manager = owner.cache_manager
    arrays = [np.full(int(np.prod(shape)), SOURCE, dtype=np.uint8) for _ in range(tensors)]
    desc = CacheDesc(tensors, [shape[0], shape[1] // 2], DataType.DT_FLOAT16)
    addrs = [int(array.ctypes.data) for array in arrays]
    if blocks:
        cache = manager.register_blocks_cache(desc, addrs, BlocksCacheKey(OWNER_ID, 3))
    else:
        cache = manager.register_cache(desc, addrs)
    return cache, arrays


@pytest.mark.parametrize("kind", ["blocks", "push"])
@pytest.mark.parametrize("point", ["pinned", "copied"])
@pytest.mark.parametrize("fault", ["unlink", "finalize", "kill"])
def test_registered_memory_is_never_handed_back_while_pinned(
    kind: str, point: str, fault: str, port: int
) -> None:
    """v2, memory the owner registered: a Decoder stopped mid-pull (pull_blocks) or mid-push (push_cache),
    the owner unlinks it from the serving side or finalizes, or the Decoder is killed. `unregister_cache`
    never returns while the pin is held (LLM_TIMEOUT after sync_kv_timeout), so the caller never reuses
    memory a transfer still reaches; a finalize waits for the transfer, and one that outlived the wait
    fails instead of succeeding."""
    # Blocks: 4 of 4 KiB a tensor; a push: the whole tensor is one slot of 16 KiB.
    tensors, shape = 4, (4, 4096) if kind == "blocks" else (1, 16384)
    owner = _owner(True, port, 300 if fault == "finalize" else 500, remote=kind == "push")
    peer = None
    finalized = False
    try:
        cache, arrays = _registered(owner, tensors, shape, blocks=kind == "blocks")
        transfer = Transfer(
            True,
            kind,
            tensors,
            (shape[0], shape[1] // 2),
            model_id=3,
            cache_id=cache.cache_id,
            fill=PUSHED,
            point=point,
        )
        peer = FaultPeer(OWNER_ID, port, transfer)
        assert peer.expect("linked") == ([int(LLMStatusCode.LLM_SUCCESS)],)
        assert peer.expect("at") == (point,)
        peer.wait_stopped()
        assert _ping_answered(port) < 1.0
        if fault == "kill":
            peer.kill()
            _reaped(peer.process.pid)
            _unregister_eventually(owner, cache.cache_id)  # as soon as the owner sees the holder gone
            _no_leak(owner)
            return
        if fault == "unlink":
            info = LLMClusterInfo()
            info.remote_cluster_id = 2
            ret, _ = owner.unlink_clusters([info])
            assert ret == LLMStatusCode.LLM_SUCCESS
            with pytest.raises(LLMException) as exc_info:
                owner.cache_manager.unregister_cache(cache.cache_id)
            assert exc_info.value.status_code == LLMStatusCode.LLM_TIMEOUT  # still pinned by its holder
            peer.resume()
            outcome = peer.expect("done")
            # The pin held: the transfer is whole, or it failed because the link ended (never "success" with
            # something else).
            if outcome[0] == "ok":
                if kind == "push":
                    assert all(set(array.tobytes()) == {PUSHED} for array in arrays)
                else:
                    assert all(set(data) == {SOURCE} for data in outcome[1])
            else:
                assert outcome[:2] == ("failed", int(LLMStatusCode.LLM_LINK_FAILED)), outcome
            _unregister_eventually(owner, cache.cache_id)  # the holder let go (its orphaned row is freed)
            _no_leak(owner)
            return
        # finalize: one run resumes the Decoder while finalize waits (the transfer ends well, then the
        # owner goes), the other after finalize gave up waiting (the pin was revoked: the transfer fails).
        resumer = threading.Timer(0.2, peer.resume) if point == "pinned" else None
        if resumer is not None:
            resumer.start()
        owner.finalize()
        finalized = True
        for array in arrays:
            array[...] = REUSED  # finalize returned: the memory is the user's again
        if resumer is None:
            peer.resume()
        else:
            resumer.join()
        outcome = peer.expect("done")
        if resumer is not None and kind == "blocks":
            assert outcome[0] == "ok", outcome  # it ended while finalize waited for it
        elif resumer is not None:
            # A push pins layer by layer: the pinned layer lands while finalize waits, the next finds the
            # link ended.
            assert outcome[0] == "ok" or outcome[1] == int(LLMStatusCode.LLM_LINK_FAILED), outcome
        else:
            assert outcome[0] == "failed" and outcome[1] == int(LLMStatusCode.LLM_LINK_FAILED), outcome
        if kind == "blocks" and outcome[0] == "ok":
            assert all(set(data) == {SOURCE} for data in outcome[1])
    finally:
        if peer is not None:
            peer.close()
        if not finalized:
            owner.finalize()


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("point", ["pinned", "copied"])
def test_a_decoder_that_finalizes_while_another_thread_pulls_waits_for_it(
    v2: bool, point: str, port: int
) -> None:
    """`finalize` on one thread while another thread's pull is between its pin and its unpin: finalize
    returns only once that pull ended, and the pull completes with the right bytes."""
    owner = _owner(v2, port, 20_000)
    manager: Any = owner.cache_manager if v2 else owner.kv_cache_manager
    try:
        source = manager.allocate_cache(
            CacheDesc(4, [1, 2048], DataType.DT_FLOAT16), [CacheKey(OWNER_ID, req_id=7)]
        )
        _fill(source, SOURCE)
        outcome = finalize_during_pull(
            OWNER_ID, port, Transfer(v2, "pull", 4, (1, 2048), req_id=7, point=point)
        )
        assert outcome[0] == "ok", outcome
        assert all(set(data) == {SOURCE} for data in outcome[1])
        assert outcome[2], "finalize returned while the pull was still running"
        manager.deallocate_cache(source)
        _no_leak(owner)  # the key went with the pull that consumed it
    finally:
        owner.finalize()


@pytest.mark.parametrize("point", ["pinned", "copied"])
@pytest.mark.parametrize("fault", ["reuse", "finalize"])
def test_a_v1_push_never_lands_in_reused_memory(point: str, fault: str, port: int) -> None:
    """v1 `transfer_cache_async`: the Prompt (a child) stops after the Decoder (this process) granted its
    push into a cache, or after its copy; the Decoder frees that cache and fills its whole pool with new
    caches of other bytes, or finalizes. The freed cache's memory is not reused while the push holds it:
    every new cache keeps its bytes, and a finalize waits for the push (resumed meanwhile)."""
    from tests._fault_peer import PusherPeer

    tensors, shape = 2, (1, 2048)
    decoder = LLMDataDist(LLMRole.DECODER, 2)
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = 20_000
    options = dict(config.generate_options())
    options.update({"ge.flowGraphMemMaxSize": str(4 * tensors * 4096), "llm.MemoryUtilization": "1.0"})
    decoder.init(options)
    peer = PusherPeer(port, tensors, shape, point)
    finalized = False
    try:
        assert peer.expect("up") == ()
        info = LLMClusterInfo()
        info.remote_cluster_id = OWNER_ID
        info.append_remote_ip_info("127.0.0.1", port)
        ret, _ = decoder.link_clusters([info], timeout=20_000)
        assert ret == LLMStatusCode.LLM_SUCCESS
        manager = decoder.kv_cache_manager
        target = manager.allocate_cache(CacheDesc(tensors, list(shape), DataType.DT_FLOAT16))
        peer.pipe.send(list(target.per_device_tensor_addrs[0]))
        assert peer.expect("at") == (point,)
        peer.wait_stopped()
        if fault == "finalize":
            threading.Timer(0.2, peer.resume).start()
            decoder.finalize()  # waits for the push it granted
            finalized = True
            (results,) = peer.expect("done")
            assert results == [int(LLMStatusCode.LLM_SUCCESS)], results
            return
        manager.deallocate_cache(target)
        reused = []
        with pytest.raises(LLMException):
            for _ in range(8):
                cache = manager.allocate_cache(CacheDesc(tensors, list(shape), DataType.DT_FLOAT16))
                _fill(cache, REUSED)
                reused.append(cache)
        peer.resume()
        (results,) = peer.expect("done")
        assert results == [int(LLMStatusCode.LLM_SUCCESS)], results
        for cache in reused:
            addrs = cache.per_device_tensor_addrs[0]
            assert all(set(ctypes.string_at(addr, 4096)) == {REUSED} for addr in addrs), (
                "a push landed in reused memory"
            )
            manager.deallocate_cache(cache)
        peer.close()  # its connection (and row) ends with it
        _no_leak(decoder)
    finally:
        peer.close()
        if not finalized:
            decoder.finalize()
