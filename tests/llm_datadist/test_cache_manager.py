"""Cache-manager (v2) mode between a real Prompt process and this process: pools, registered memory the
library did not allocate (numpy arrays in both processes), one-sided and two-sided links, pulls and pushes."""

from __future__ import annotations

import ctypes
import functools
import itertools
import json
import random
import time

import numpy as np
import pytest

from llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    RegisterMemStatus,
)
from llm_datadist._rank_table import default_rank_table
from llm_datadist._stats import TRANSPORTS
from llm_datadist.ext import stats
from tests._peer import PROMPT_IP, PromptPeer, tensor_views_v2

P, D = 1, 2
_ports = itertools.count(22000)
POOL = json.dumps({"memory_size": 64 << 20, "page_shift": 16})


def _v2_options(
    *, remote_access: bool, pools: bool = True, extra: dict[str, str] | None = None
) -> dict[str, str]:
    options = {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1" if remote_access else "0",
    }
    if pools:
        options["llm.MemPoolConfig"] = POOL
        options["llm.HostMemPoolConfig"] = POOL
    options.update(extra or {})
    return options


class _Decoder:
    """This process as a v2 DECODER; finalized on exit."""

    def __init__(
        self, *, remote_access: bool, pools: bool = True, extra: dict[str, str] | None = None
    ) -> None:
        self.dd = LLMDataDist(LLMRole.DECODER, D)
        config = LLMConfig()
        config.device_id = 0
        config.sync_kv_timeout = 5000
        options = dict(config.generate_options())
        options.update(_v2_options(remote_access=remote_access, pools=pools, extra=extra))
        self.dd.init(options)

    def __enter__(self) -> LLMDataDist:
        return self.dd

    def __exit__(self, *exc: object) -> None:
        self.dd.finalize()


def _link_one_sided(dd: LLMDataDist, peer: PromptPeer) -> None:
    info = LLMClusterInfo()
    info.remote_cluster_id = P
    info.append_local_ip_info(PROMPT_IP, 0)
    info.append_remote_ip_info(PROMPT_IP, peer.port)
    assert dd.link_clusters([info], 5000) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])


def _numpy_blocks_cache(
    dd: LLMDataDist, num_tensors: int, shape: list[int], *, remote_accessible: bool | None = True
):  # type: ignore[no-untyped-def]
    arrays = [np.zeros(int(np.prod(shape)), dtype=np.float16) for _ in range(num_tensors)]
    desc = CacheDesc(num_tensors, shape, DataType.DT_FLOAT16)
    cache = dd.cache_manager.register_blocks_cache(
        desc, [a.ctypes.data for a in arrays], None, remote_accessible
    )
    return cache, [a.view(np.uint8) for a in arrays]


# How a one-sided read reaches each kind of the owner's memory: its pool and the library's memory through
# the mapped segment, private memory it registered through process_vm_readv.
OWNER_MEMORY = {"registered numpy": "cma", "registered library memory": "shm", "pool": "shm"}


@pytest.mark.parametrize("owner_memory", sorted(OWNER_MEMORY))
def test_one_sided_block_pull_from_the_owners_memory(seed: int, owner_memory: str) -> None:
    extra = _v2_options(remote_access=True)
    with PromptPeer(P, next(_ports), seed, extra=extra) as peer, _Decoder(remote_access=True) as dd:
        if owner_memory == "pool":
            cache_id = peer.call("v2_alloc", (4, [16, 3, 7, 5], [], 0))
        elif owner_memory == "registered numpy":
            cache_id = peer.call("v2_register_blocks", (4, [16, 3, 7, 5], 0, True))
        else:
            cache_id = peer.call("v2_register_blocks", (4, [16, 3, 7, 5], 0, True, "library"))
        before = stats().counters
        _link_one_sided(dd, peer)
        local, arrays = _numpy_blocks_cache(dd, 4, [10, 3, 7, 5])  # 210-byte blocks
        src_blocks, dst_blocks = [15, 2, 7, 0], [9, 0, 4, 5]
        dd.cache_manager.pull_blocks(BlocksCacheKey(P, 0), local, src_blocks, dst_blocks)
        for t, array in enumerate(arrays):
            remote = peer.expected(cache_id, t, 16 * 210).reshape(16, 210)
            got = array.reshape(10, 210)
            np.testing.assert_array_equal(got[dst_blocks], remote[src_blocks])
            assert not got[[1, 2, 3, 6, 7, 8]].any()
        # One-sided reads see the owner's new data in the same blocks (no stale copy anywhere).
        peer.call("v2_rewrite", cache_id)
        dd.cache_manager.pull_blocks(BlocksCacheKey(P, 0), local, [3], [1])
        for t, array in enumerate(arrays):
            np.testing.assert_array_equal(
                array.reshape(10, 210)[1], peer.expected(cache_id + 1000, t, 16 * 210).reshape(16, 210)[3]
            )
        assert peer.stats()["leases"] == 0  # one-sided: the owner pinned nothing
        reads = {
            t: stats().counters[f"v2.read.{t}.transfers"] - before[f"v2.read.{t}.transfers"]
            for t in TRANSPORTS
        }
        assert reads == {t: 2 if t == OWNER_MEMORY[owner_memory] else 0 for t in TRANSPORTS}


def test_two_sided_link_then_block_pull_by_request(seed: int) -> None:
    extra = _v2_options(remote_access=False, extra={"llm.LinkTotalTime": "20"})
    with (
        PromptPeer(P, next(_ports), seed, extra=extra) as peer,
        _Decoder(remote_access=False, extra={"llm.LinkTotalTime": "20"}) as dd,
    ):
        cache_id = peer.call("v2_register_blocks", (2, [8, 64], 3, None))
        local, arrays = _numpy_blocks_cache(dd, 2, [8, 64], remote_accessible=None)
        members = {P: 0, D: 1}
        table = default_rank_table(members)
        name = "pd_comm_127.0.0.1_127.0.0.1"
        prompt_comm = peer.call("link", (name, list(members.items()), table))
        comm_id = dd.link(name, members, table)
        deadline = time.monotonic() + 20
        while dd.query_register_mem_status(comm_id) != RegisterMemStatus.OK:
            assert time.monotonic() < deadline, "the two-sided link never came up"
            time.sleep(0.01)
        while peer.call("query", prompt_comm) != RegisterMemStatus.OK.value:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        dd.cache_manager.pull_blocks(BlocksCacheKey(P, 3), local, [7, 1], [0, 6])
        for t, array in enumerate(arrays):
            remote = peer.expected(cache_id, t, 8 * 128).reshape(8, 128)
            np.testing.assert_array_equal(array.reshape(8, 128)[[0, 6]], remote[[7, 1]])
        assert peer.stats()["leases"] == 0
        dd.unlink(comm_id)
        with pytest.raises(LLMException) as exc_info:
            dd.cache_manager.pull_blocks(BlocksCacheKey(P, 3), local, [7], [0])
        assert exc_info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK


def test_pull_cache_by_key_from_a_pool_consumes_the_key(seed: int) -> None:
    extra = _v2_options(remote_access=False)
    with PromptPeer(P, next(_ports), seed, extra=extra) as peer, _Decoder(remote_access=False) as dd:
        cache_id = peer.call("v2_alloc", (4, [2, 3333], [(P, 5), (P, 6)], None))
        _link_one_sided(dd, peer)
        local = dd.cache_manager.allocate_cache(CacheDesc(4, [1, 3333], DataType.DT_FLOAT16))
        dd.cache_manager.pull_cache(CacheKey(P, 6), local, src_cache_offset=5)  # v2 ignores the offsets
        for t, view in enumerate(tensor_views_v2(local)):
            np.testing.assert_array_equal(view, peer.expected(cache_id, t, 2 * 6666)[6666:])
        with pytest.raises(LLMException) as exc_info:
            dd.cache_manager.pull_cache(CacheKey(P, 6), local)
        assert exc_info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        dd.cache_manager.pull_cache(CacheKeyByIdAndIndex(P, cache_id, 0), local)


@pytest.mark.parametrize("owner_memory", ["private", "library"])
def test_push_blocks_writes_into_the_owners_registered_memory(seed: int, owner_memory: str) -> None:
    extra = _v2_options(remote_access=True)
    with PromptPeer(P, next(_ports), seed, extra=extra) as peer, _Decoder(remote_access=True) as dd:
        cache_id = peer.call("v2_register_blocks", (2, [6, 50], 4, True, owner_memory))
        _link_one_sided(dd, peer)
        local, arrays = _numpy_blocks_cache(dd, 2, [6, 50])
        rng = np.random.default_rng(1)
        for array in arrays:
            array[:] = rng.integers(0, 256, array.nbytes, dtype=np.uint8)
        dd.cache_manager.push_blocks(BlocksCacheKey(P, 4), local, [0, 5], [2, 3], tensor_num_per_layer=1)
        for t, array in enumerate(arrays):
            remote = np.frombuffer(peer.call("v2_bytes", (cache_id, t)), dtype=np.uint8).reshape(6, 100)
            np.testing.assert_array_equal(remote[2], array.reshape(6, 100)[0])
            np.testing.assert_array_equal(remote[3], array.reshape(6, 100)[5])
            np.testing.assert_array_equal(remote[0], peer.expected(cache_id, t, 600).reshape(6, 100)[0])


def test_large_block_tables_go_through_the_copy_threads_both_ways(seed: int) -> None:
    """More than a handful of cross-memory runs take numpy columns, and 8 MiB or more is split over the
    copy threads: a 10 MiB registered cache, 32 scattered 64 KiB blocks per tensor, pulled, then pushed."""
    extra = _v2_options(remote_access=True)
    shape = [40, 32768]  # 40 blocks of 64 KiB per tensor
    block = 64 << 10
    with PromptPeer(P, next(_ports), seed, extra=extra) as peer, _Decoder(remote_access=True) as dd:
        cache_id = peer.call("v2_register_blocks", (4, shape, 9, True))
        _link_one_sided(dd, peer)
        local, arrays = _numpy_blocks_cache(dd, 4, shape)
        rng = np.random.default_rng(seed)
        src_blocks = [int(b) for b in rng.permutation(40)[:32]]
        dst_blocks = [int(b) for b in rng.permutation(40)[:32]]
        dd.cache_manager.pull_blocks(BlocksCacheKey(P, 9), local, src_blocks, dst_blocks)
        untouched = sorted(set(range(40)) - set(dst_blocks))
        for t, array in enumerate(arrays):
            remote = peer.expected(cache_id, t, 40 * block).reshape(40, block)
            got = array.reshape(40, block)
            np.testing.assert_array_equal(got[dst_blocks], remote[src_blocks])
            assert not got[untouched].any()
        # And back: every local block written into other remote blocks, layer by layer (2 tensors each).
        for array in arrays:
            array[:] = rng.integers(0, 256, array.nbytes, dtype=np.uint8)
        dd.cache_manager.push_blocks(BlocksCacheKey(P, 9), local, dst_blocks, src_blocks)
        for t, array in enumerate(arrays):
            remote = np.frombuffer(peer.call("v2_bytes", (cache_id, t)), dtype=np.uint8).reshape(40, block)
            np.testing.assert_array_equal(remote[src_blocks], array.reshape(40, block)[dst_blocks])
            kept = sorted(set(range(40)) - set(src_blocks))
            np.testing.assert_array_equal(
                remote[kept], peer.expected(cache_id, t, 40 * block).reshape(40, block)[kept]
            )


def test_documented_errors() -> None:
    with _Decoder(remote_access=True, pools=False) as dd:
        with pytest.raises(LLMException) as exc_info:
            _ = dd.kv_cache_manager
        assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        with pytest.raises(LLMException) as exc_info:
            dd.check_link_status(P)
        assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        with pytest.raises(LLMException) as exc_info:
            dd.check_link_status("not an id")  # type: ignore[arg-type]
        assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID  # the mode is checked first
        for placement in (Placement.DEVICE, Placement.HOST):
            desc = CacheDesc(1, [1, 8], DataType.DT_FLOAT16, placement)
            with pytest.raises(LLMException) as exc_info:
                dd.cache_manager.allocate_cache(desc)
            assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID  # no pool configured
            with pytest.raises(LLMException) as exc_info:
                dd.cache_manager.allocate_blocks_cache(desc)
            assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        local, _ = _numpy_blocks_cache(dd, 2, [4, 8])
        with pytest.raises(LLMException) as exc_info:
            dd.cache_manager.pull_blocks(CacheKey(P, 1), local, [], [0])
        assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID  # no CacheKey one-sided
        with pytest.raises(LLMException) as exc_info:
            dd.cache_manager.pull_blocks(BlocksCacheKey(P, 0), local, [0], [0])
        assert exc_info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
        with pytest.raises(LLMException) as exc_info:
            dd.cache_manager.register_blocks_cache(CacheDesc(2, [4, 8], DataType.DT_FLOAT16), [0, 1])
        assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID  # address 0
        info = LLMClusterInfo()
        info.remote_cluster_id = P
        info.append_remote_ip_info(PROMPT_IP, 1)
        with pytest.raises(LLMException):
            dd.link_clusters([info])  # v2 needs local ip info
        with pytest.raises(LLMException) as exc_info:
            dd.link("x", {D: 0}, default_rank_table({D: 0, P: 1}))
        assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID  # one member
        with pytest.raises(LLMException) as exc_info:
            dd.link("x", {P: 0, D: 1}, "{not json")
        assert exc_info.value.status_code == LLMStatusCode.LLM_LINK_FAILED


def test_pools_and_out_of_memory() -> None:
    small = json.dumps({"memory_size": 1 << 20, "page_shift": 12})
    with _Decoder(remote_access=False, pools=False, extra={"llm.MemPoolConfig": small}) as dd:
        cm = dd.cache_manager
        first = cm.allocate_cache(CacheDesc(3, [1, 1024, 128], DataType.DT_FLOAT16))  # 768 KiB of 1 MiB
        with pytest.raises(LLMException) as exc_info:
            cm.allocate_cache(CacheDesc(3, [1, 1024, 128], DataType.DT_FLOAT16))
        assert exc_info.value.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY
        with pytest.raises(LLMException) as exc_info:
            cm.allocate_cache(CacheDesc(1, [1, 8], DataType.DT_FLOAT16, Placement.HOST))
        assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID  # no host pool
        # Identical keys in one call, two padding keys of one model_id included (the native check).
        padding = 2**64 - 1
        for keys in (
            [CacheKey(D, 1), CacheKey(D, 1)],
            [CacheKey(D, padding), CacheKey(D, padding), CacheKey(D, 1)],
            [CacheKey(D, padding, 3), CacheKey(P, padding, 3)],
        ):
            with pytest.raises(LLMException) as exc_info:
                cm.allocate_cache(CacheDesc(1, [3, 8], DataType.DT_FLOAT16), keys)
            assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        # Padding keys of different model_ids are different keys.
        cm.deallocate_cache(
            cm.allocate_cache(
                CacheDesc(1, [3, 8], DataType.DT_FLOAT16), [CacheKey(D, padding, 0), CacheKey(D, padding, 1)]
            )
        )
        cm.deallocate_cache(first)
        assert first.tensor_addrs == []
        cm.allocate_cache(CacheDesc(3, [1, 1024, 128], DataType.DT_FLOAT16))


def test_layer_wise_push_by_key_into_registered_memory(seed: int) -> None:
    extra = _v2_options(remote_access=True)
    with PromptPeer(P, next(_ports), seed, extra=extra) as peer, _Decoder(remote_access=True) as dd:
        cache_id = peer.call("v2_alloc", (4, [4, 64], [], 0))  # 2 layers, 4 blocks of 128 bytes
        _link_one_sided(dd, peer)
        local, arrays = _numpy_blocks_cache(dd, 4, [6, 64])
        # This process's cache must be named by a model id for a BlocksCacheKey push.
        dd._require_core().table.bind_blocks_key(9, local.cache_id)
        code = peer.call("v2_transfer", (cache_id, [(D, 9, (0, 2), (0, 2))], [3, 0], [5, 1]))
        assert code == int(LLMStatusCode.LLM_SUCCESS)
        for t, array in enumerate(arrays):
            remote = peer.expected(cache_id, t, 4 * 128).reshape(4, 128)
            got = array.reshape(6, 128)
            np.testing.assert_array_equal(got[5], remote[3])
            np.testing.assert_array_equal(got[1], remote[0])
            assert not got[[0, 2, 3, 4]].any()


def test_a_blocks_source_without_block_indices_pushes_block_0_into_block_0(seed: int) -> None:
    """As the real `llm_utils` (and the vendor's `transfer_cache_async_sample.py`): the source counts as
    blocks only when `src_block_indices` are given; without them the slot path runs with batch index 0,
    which for blocks caches is block 0 of the source into block 0 of the destination."""
    extra = _v2_options(remote_access=True)
    with PromptPeer(P, next(_ports), seed, extra=extra) as peer, _Decoder(remote_access=True) as dd:
        cache_id = peer.call("v2_alloc", (4, [4, 64], [], 0))  # 2 layers, 4 blocks of 128 bytes
        _link_one_sided(dd, peer)
        local, arrays = _numpy_blocks_cache(dd, 4, [6, 64])
        dd._require_core().table.bind_blocks_key(9, local.cache_id)
        code = peer.call("v2_transfer", (cache_id, [(D, 9, (0, 1), (0, 1))], None, None))
        assert code == int(LLMStatusCode.LLM_SUCCESS)
        for t, array in enumerate(arrays):
            got = array.reshape(6, 128)
            if t < 2:  # layer 0: K and V
                remote = peer.expected(cache_id, t, 4 * 128).reshape(4, 128)
                np.testing.assert_array_equal(got[0], remote[0])
                assert not got[1:].any()
            else:
                assert not got.any()


def test_local_copies_between_pool_registered_and_cpu_caches() -> None:
    with _Decoder(remote_access=False) as dd:
        cm = dd.cache_manager
        pool = cm.allocate_blocks_cache(CacheDesc(2, [4, 33], DataType.DT_FLOAT16))
        registered, arrays = _numpy_blocks_cache(dd, 2, [4, 33], remote_accessible=False)
        rng = np.random.default_rng(3)
        for array in arrays:
            array[:] = rng.integers(0, 256, array.nbytes, dtype=np.uint8)
        cm.copy_blocks(registered, {0: [2, 3]})
        for array in arrays:
            blocks = array.reshape(4, 66)
            np.testing.assert_array_equal(blocks[2], blocks[0])
            np.testing.assert_array_equal(blocks[3], blocks[0])
        host = [np.zeros(4 * 66, dtype=np.uint8) for _ in range(2)]
        cpu = Cache.create_cpu_cache(
            CacheDesc(2, [4, 33], DataType.DT_FLOAT16, Placement.HOST), [h.ctypes.data for h in host]
        )
        cm.swap_blocks(registered, cpu, {1: 0, 0: 3})  # swap out
        for array, h in zip(arrays, host, strict=True):
            np.testing.assert_array_equal(h.reshape(4, 66)[0], array.reshape(4, 66)[1])
            np.testing.assert_array_equal(h.reshape(4, 66)[3], array.reshape(4, 66)[0])
        cm.swap_blocks(cpu, pool, {3: 2})  # swap in
        for t, view in enumerate(tensor_views_v2(pool)):
            np.testing.assert_array_equal(view.reshape(4, 66)[2], host[t].reshape(4, 66)[3])
        with pytest.raises(LLMException):
            cm.swap_blocks(registered, pool, {0: 0})  # DEVICE to DEVICE
        with pytest.raises(LLMException):
            cm.copy_blocks(registered, {0: [9]})
        continuous = cm.allocate_cache(CacheDesc(2, [3, 50], DataType.DT_FLOAT16))
        other = cm.allocate_cache(CacheDesc(2, [2, 50], DataType.DT_FLOAT16))
        for view in tensor_views_v2(continuous):
            view[:] = rng.integers(0, 256, view.nbytes, dtype=np.uint8)
        cm.copy_cache(other, continuous, 1, 2, offset=7, size=33)
        for src, dst in zip(tensor_views_v2(continuous), tensor_views_v2(other), strict=True):
            np.testing.assert_array_equal(dst[100 + 7 : 100 + 40], src[200 + 7 : 200 + 40])
        with pytest.raises(LLMException):
            cm.copy_cache(other, pool)  # blocks caches are not copy_cache's


def test_remote_accessible_defaults_and_switch_role(seed: int) -> None:
    with _Decoder(remote_access=False, extra={"llm.LinkTotalTime": "1"}) as dd:
        cm = dd.cache_manager
        device, _ = _numpy_blocks_cache(dd, 1, [2, 8], remote_accessible=None)
        assert dd._require_core().table.get(device.cache_id).remote_accessible  # DEVICE default: True
        comm_id = dd.link("alone", {D: 0, P: 1}, default_rank_table({D: 0, P: 1}))
        arrays = [np.zeros(16, dtype=np.float16)]
        desc = CacheDesc(1, [2, 8], DataType.DT_FLOAT16)
        later = cm.register_blocks_cache(desc, [arrays[0].ctypes.data])
        assert not dd._require_core().table.get(later.cache_id).remote_accessible  # after link(): False
        with pytest.raises(LLMException):
            cm.register_blocks_cache(desc, [arrays[0].ctypes.data + 64], remote_accessible=True)
        deadline = time.monotonic() + 10
        while dd.query_register_mem_status(comm_id) == RegisterMemStatus.PREPARING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert dd.query_register_mem_status(comm_id) == RegisterMemStatus.FAILED  # nobody else came
        dd.unlink(comm_id)
        # v2 switch_role: no same-role check; the listen address decides whether this side serves.
        dd.switch_role(LLMRole.DECODER, {"llm.listenIpInfo": f"{PROMPT_IP}:{next(_ports)}"})
        assert dd._require_core().public_path is not None
        dd.switch_role(LLMRole.PROMPT)
        assert dd._require_core().public_path is None


def test_push_cache_and_continuous_slot_into_blocks(seed: int) -> None:
    extra = _v2_options(remote_access=True)
    with PromptPeer(P, next(_ports), seed, extra=extra) as peer, _Decoder(remote_access=True) as dd:
        cont_id = peer.call("v2_alloc", (2, [3, 300], [], None))  # 600-byte slots
        _link_one_sided(dd, peer)
        cm = dd.cache_manager
        local = cm.allocate_cache(CacheDesc(2, [2, 300], DataType.DT_FLOAT16))
        rng = np.random.default_rng(5)
        for view in tensor_views_v2(local):
            view[:] = rng.integers(0, 256, view.nbytes, dtype=np.uint8)
        cm.push_cache(CacheKeyByIdAndIndex(P, cont_id, 2), local, 1)
        for t, view in enumerate(tensor_views_v2(local)):
            remote = np.frombuffer(peer.call("v2_bytes", (cont_id, t)), dtype=np.uint8)
            np.testing.assert_array_equal(remote[1200:1800], view[600:1200])
            np.testing.assert_array_equal(remote[:1200], peer.expected(cont_id, t, 1800)[:1200])
        with pytest.raises(LLMException):
            cm.push_cache(CacheKeyByIdAndIndex(P, cont_id, 3), local)  # no slot 3 over there
        # A continuous remote slot cut into local blocks of 256 bytes: 600 = 256 + 256 + 88.
        blocks = cm.allocate_blocks_cache(CacheDesc(2, [5, 128], DataType.DT_FLOAT16))
        cm.pull_blocks(CacheKeyByIdAndIndex(P, cont_id, 0), blocks, [], [4, 0, 2])
        for t, view in enumerate(tensor_views_v2(blocks)):
            source = peer.expected(cont_id, t, 1800)[:600]
            np.testing.assert_array_equal(view[1024:1280], source[:256])
            np.testing.assert_array_equal(view[0:256], source[256:512])
            np.testing.assert_array_equal(view[512:600], source[512:600])


def test_v2_timeout_is_llm_timeout(seed: int, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """A two-sided v2 pull pins in the owner's index: a stopped owner does not stop it; a process stopped
    while it holds the index lock makes it fail with v2's timeout code."""
    import os
    import signal

    import psutil

    from tests._peer import PROMPT_IP, start_index_holder

    extra = _v2_options(remote_access=False)
    with PromptPeer(P, next(_ports), seed, extra=extra) as peer:
        dd_ctx = _Decoder(remote_access=False, extra={"llm.SyncKvCacheWaitTime": "300"})
        with dd_ctx as dd:
            cache_id = peer.call("v2_alloc", (2, [1, 64], [(P, 1)], None))
            _link_one_sided(dd, peer)
            local = dd.cache_manager.allocate_cache(CacheDesc(2, [1, 64], DataType.DT_FLOAT16))
            os.kill(peer.pid, signal.SIGSTOP)
            try:
                while psutil.Process(peer.pid).status() != psutil.STATUS_STOPPED:
                    time.sleep(0.001)
                dd.cache_manager.pull_cache(CacheKeyByIdAndIndex(P, cache_id, 0), local)
            finally:
                os.kill(peer.pid, signal.SIGCONT)
            socket_file = os.fspath(_runtime_dir / f"{PROMPT_IP}_{peer.port}.sock")
            holder, pipe = start_index_holder(socket_file, P, "lock")
            try:
                with pytest.raises(LLMException) as exc_info:
                    dd.cache_manager.pull_cache(CacheKeyByIdAndIndex(P, cache_id, 0), local)
            finally:
                holder.kill()
                holder.join(10)
                pipe.close()
            assert exc_info.value.status_code == LLMStatusCode.LLM_TIMEOUT


def test_forged_requests_are_refused_without_touching_memory(seed: int, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    from llm_datadist._protocol.messages import KEY_BLOCKS, RULES_V2, PinRequest, WriteRequest
    from llm_datadist._wire.client import ClientLink

    extra = _v2_options(remote_access=False)
    port = next(_ports)
    with PromptPeer(P, port, seed, extra=extra) as peer:
        cache_id = peer.call("v2_register_blocks", (2, [4, 64], 0, True))
        before = [peer.call("v2_bytes", (cache_id, t)) for t in range(2)]
        link = ClientLink.connect(
            _runtime_dir / f"{PROMPT_IP}_{port}.sock",
            cluster_id=66,
            remote_cluster_id=P,
            role=2,
            deadline=time.monotonic() + 5,
        )
        try:
            deadline = time.monotonic() + 5
            # Addresses that are not inside one registered tensor: refused, nothing pinned or written.
            for addrs, sizes in (((0x1000,), (64,)), ((2**47,), (1 << 20,))):
                seq = link.next_seq()
                with pytest.raises(Exception, match="not inside one tensor"):
                    link.request(WriteRequest(seq, addrs, sizes), seq, deadline)
            # A tensor range beyond the cache: refused.
            seq = link.next_seq()
            with pytest.raises(Exception, match="exceed"):
                link.request(
                    PinRequest(seq, KEY_BLOCKS, 0, 0, 0, 1, 5, False, 0, 0, False, False, RULES_V2),
                    seq,
                    deadline,
                )
        finally:
            link.close(say_bye=True)
        assert [peer.call("v2_bytes", (cache_id, t)) for t in range(2)] == before
        assert peer.stats()["leases"] == 0


def test_mode_specific_arguments() -> None:
    from llm_datadist import TransferConfig, TransferWithCacheKeyConfig
    from tests._peer import _Synchronizer

    with _Decoder(remote_access=False) as dd:
        cm = dd.cache_manager
        source = cm.allocate_cache(CacheDesc(2, [1, 64], DataType.DT_FLOAT16))
        # Remote cache access is checked before any argument.
        with pytest.raises(LLMException) as exc_info:
            cm.push_cache(CacheKeyByIdAndIndex(P, 1, 0), source)
        assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        with pytest.raises(LLMException) as exc_info:
            cm.push_cache("key", source, src_batch_index=-1)  # type: ignore[arg-type]
        assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        with pytest.raises(LLMException) as exc_info:
            cm.push_blocks("key", source, [0], [0])  # type: ignore[arg-type]
        assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        key_config = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(P, 1, 0), range(0, 1), range(0, 1))
        with pytest.raises(TypeError):
            cm.transfer_cache_async(source, _Synchronizer("go", None), [key_config])
        with pytest.raises(LLMException) as exc_info:
            cm.transfer_cache_async(source, _Synchronizer("go", None), [TransferConfig(P, [1, 2])])
        assert exc_info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
    with _Decoder(remote_access=True) as dd:
        source = dd.cache_manager.allocate_cache(CacheDesc(2, [1, 64], DataType.DT_FLOAT16))
        with pytest.raises(TypeError):
            dd.cache_manager.transfer_cache_async(
                source, _Synchronizer("go", None), [TransferConfig(P, [1, 2])]
            )
        with pytest.raises(TypeError):
            dd.cache_manager.pull_cache(CacheKey(P, 1), source)  # one-sided pulls take a cache id


def test_one_sided_readers_notice_a_freed_or_reused_cache(seed: int) -> None:
    extra = _v2_options(remote_access=True)
    with PromptPeer(P, next(_ports), seed, extra=extra) as peer, _Decoder(remote_access=True) as dd:
        first = peer.call("v2_alloc", (2, [4, 64], [], 0))
        _link_one_sided(dd, peer)
        local, arrays = _numpy_blocks_cache(dd, 2, [4, 64])
        cm = dd.cache_manager
        cm.pull_blocks(BlocksCacheKey(P, 0), local, [1], [1])  # the table (with cache `first`) is cached now
        core = dd._require_core()
        stale = core.oneside.remote_table(P).caches[first]
        # The owner frees the cache and allocates another over the same pool memory, same model id.
        peer.call("v2_dealloc_blocks", first)
        second = peer.call("v2_alloc", (2, [4, 64], [], 0))
        assert not core.oneside.remote_is_current(P, stale)
        # A transfer through the stale entry refuses instead of returning the new cache's bytes as the old's.
        pinned = core.table.get(local.cache_id)
        with pytest.raises(Exception, match="was freed"):
            core.oneside.read(P, stale, 0, pinned, 0, 2, [])
        # Through the API the stale entry is noticed and the table fetched again: the new cache is read.
        cm.pull_blocks(BlocksCacheKey(P, 0), local, [2], [0])
        for t, array in enumerate(arrays):
            np.testing.assert_array_equal(
                array.reshape(4, 128)[0], peer.expected(second, t, 512).reshape(4, 128)[2]
            )
        # A cache id that is gone stays gone.
        plain = cm.allocate_cache(CacheDesc(2, [1, 64], DataType.DT_FLOAT16))
        with pytest.raises(LLMException) as exc_info:
            cm.pull_cache(CacheKeyByIdAndIndex(P, first, 0), plain)
        assert exc_info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def test_repeated_one_sided_pulls_reuse_their_checks_but_not_stale_state(seed: int) -> None:
    """A repeat of a one-sided pull with equal arguments skips the argument checks (a prepared pull kept by
    the manager); everything that depends on state is looked at again on each call."""
    extra = _v2_options(remote_access=True)
    with PromptPeer(P, next(_ports), seed, extra=extra) as peer, _Decoder(remote_access=True) as dd:
        first = peer.call("v2_alloc", (2, [4, 64], [], 0))
        _link_one_sided(dd, peer)
        cm = dd.cache_manager
        local, arrays = _numpy_blocks_cache(dd, 2, [4, 64])

        def block(cache_id: int, t: int, index: int) -> np.ndarray:
            return peer.expected(cache_id, t, 512).reshape(4, 128)[index]

        src, dst = [1], [2]
        cm.pull_blocks(BlocksCacheKey(P, 0), local, src, dst)
        assert len(cm._prepared) == 1
        # The caller's lists are copied: changing them later changes nothing in what was kept.
        src[0], dst[0] = 3, 0
        cm.pull_blocks(BlocksCacheKey(P, 0), local, [1], [2])
        assert not arrays[0].reshape(4, 128)[0].any()
        cm.pull_blocks(BlocksCacheKey(P, 0), local, src, dst)  # [3] -> [0], a second prepared pull
        for t, array in enumerate(arrays):
            np.testing.assert_array_equal(array.reshape(4, 128)[2], block(first, t, 1))
            np.testing.assert_array_equal(array.reshape(4, 128)[0], block(first, t, 3))
        # Equal values of other types still meet the full checks.
        with pytest.raises(TypeError):
            cm.pull_blocks(BlocksCacheKey(P, 0), local, [True], [2])
        # New data in the same remote block is read again (nothing is cached but the checks).
        peer.call("v2_rewrite", first)
        cm.pull_blocks(BlocksCacheKey(P, 0), local, [1], [2])
        np.testing.assert_array_equal(arrays[1].reshape(4, 128)[2], block(first + 1000, 1, 1))
        # The remote cache freed and another allocated under the same model id: the table is fetched again.
        peer.call("v2_dealloc_blocks", first)
        second = peer.call("v2_alloc", (2, [4, 64], [], 0))
        cm.pull_blocks(BlocksCacheKey(P, 0), local, [1], [2])
        np.testing.assert_array_equal(arrays[0].reshape(4, 128)[2], block(second, 0, 1))
        # The local cache unregistered: its old handle fails as before; a new cache takes the full path.
        cm.unregister_cache(local.cache_id)
        with pytest.raises(LLMException) as exc_info:
            cm.pull_blocks(BlocksCacheKey(P, 0), local, [1], [2])
        assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        again, again_arrays = _numpy_blocks_cache(dd, 2, [4, 64])
        cm.pull_blocks(BlocksCacheKey(P, 0), again, [1], [2])
        np.testing.assert_array_equal(again_arrays[1].reshape(4, 128)[2], block(second, 1, 1))
        # pull_cache repeats too: slot 1 of a continuous remote cache, twice, the second over new data; and
        # a remote blocks cache is refused on every call, not only the first.
        continuous = peer.call("v2_alloc", (2, [2, 64], [], None))  # 2 slots of 128 bytes per tensor
        plain = cm.allocate_cache(CacheDesc(2, [1, 64], DataType.DT_FLOAT16))
        views = [np.ctypeslib.as_array((ctypes.c_ubyte * 128).from_address(a)) for a in plain.tensor_addrs]
        for tag in (continuous, continuous + 1000):
            cm.pull_cache(CacheKeyByIdAndIndex(P, continuous, 1), plain)
            for t, view in enumerate(views):
                np.testing.assert_array_equal(view, peer.expected(tag, t, 256)[128:])
            peer.call("v2_rewrite", continuous)
        assert any(key[0] == "pull_cache" for key in cm._prepared)  # the second call was a prepared one
        for _ in range(2):
            with pytest.raises(LLMException) as exc_info:
                cm.pull_cache(CacheKeyByIdAndIndex(P, second, 0), plain)
            assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    # After finalize the manager refuses, prepared pulls or not.
    with pytest.raises(LLMException) as exc_info:
        cm.pull_blocks(BlocksCacheKey(P, 0), again, [1], [2])
    assert exc_info.value.status_code == LLMStatusCode.LLM_ENGINE_FINALIZED


def _outcome(call) -> object:  # type: ignore[no-untyped-def]
    """What a call did: "ok", or the error's type and status code (LLMException) or type (others)."""
    try:
        call()
    except LLMException as exc:
        return ("LLMException", exc.status_code)
    except Exception as exc:
        return (type(exc).__name__,)
    return "ok"


def _block_index(rng: random.Random) -> object:
    """A block index a caller might pass: in range for the local cache (4 blocks) or the remote one (8),
    just out of them, negative, past uint64, or of another type."""
    if rng.random() < 0.7:
        return rng.randint(0, 3)
    return rng.choice([rng.randint(-2, 9), 2**64 - 1, 2**64, True, 1.0])


def test_a_checked_plan_checks_every_new_block_table_as_the_full_way(seed: int) -> None:
    """A one-sided `pull_blocks` whose plan (key, local cache) was checked before checks only its new block
    lists: any lists, good or bad, give what the full checks give with no plan kept (the same error, or
    the same bytes), by a blocks key and by a cache id alike."""
    extra = _v2_options(remote_access=True)
    with PromptPeer(P, next(_ports), seed, extra=extra) as peer, _Decoder(remote_access=True) as dd:
        blocks = peer.call("v2_alloc", (2, [8, 64], [], 0))  # 8 remote blocks of 128 bytes
        continuous = peer.call("v2_alloc", (2, [2, 128], [], None))  # 2 slots of 256 bytes
        _link_one_sided(dd, peer)
        cm = dd.cache_manager
        local, arrays = _numpy_blocks_cache(dd, 2, [4, 64])  # 4 local blocks of 128 bytes
        keys = {
            "blocks": lambda: BlocksCacheKey(P, 0),
            "slot": lambda: CacheKeyByIdAndIndex(P, continuous, 1),
        }
        for name, key in keys.items():  # a plan of each kind checked and kept
            cm.pull_blocks(key(), local, [1, 2] if name == "blocks" else [], [0, 1])
        rng = random.Random(seed)
        tables = [  # each check the full way makes of the lists, and lists that pass them all
            ([1, 2], [3, 3], "blocks"),
            ([], [], "blocks"),
            ([7], [0, 1], "blocks"),
            ([1], [-1], "blocks"),
            ([-1], [0], "blocks"),
            ([8], [0], "blocks"),
            ([0], [4], "blocks"),
            ([2**64], [0], "blocks"),
            ([0], [2**64 - 1], "blocks"),
            ([True], [0], "blocks"),
            ([1.0], [0], "blocks"),
            ([7, 0], [2, 1], "blocks"),
            ([], [0, 1], "slot"),
            ([], [-1, 0], "slot"),
            ([], [0], "slot"),
            ([1], [0, 1], "slot"),
            ([], [3, 0, 1], "slot"),
        ]
        for _ in range(120):
            name = rng.choice(["blocks", "slot"])
            src = [_block_index(rng) for _ in range(rng.randint(0, 4))]
            dst = [_block_index(rng) for _ in range(rng.randint(0, 4))]
            tables.append((src if name == "blocks" or rng.random() < 0.2 else [], dst, name))
        for src, dst, name in tables:
            for array in arrays:
                array[:] = 0
            pull = functools.partial(cm.pull_blocks, keys[name](), local, list(src), list(dst))
            prepared = _outcome(pull)
            after_prepared = [array.copy() for array in arrays]
            kept = dict(cm._prepared)
            cm._prepared.clear()
            for array in arrays:
                array[:] = 0
            full = _outcome(pull)
            assert prepared == full, (src, dst, name)
            for got, want in zip(after_prepared, arrays, strict=True):
                np.testing.assert_array_equal(got, want)
            cm._prepared.update(kept)
        assert blocks > 0 and len(tables) == 137
