"""`transfer_cache_async`: a Prompt process pushes layers into this Decoder's memory, named by raw
addresses, as its synchronizer releases them. Continuous, paged and continuous-to-blocks, plus errors."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest

from llm_datadist import BlocksCacheKey, CacheDesc, CacheKey, DataType, LLMException, LLMStatusCode
from llm_datadist.ext import tensor_views
from tests._peer import PromptPeer, decoder

P, D = 1, 2
SUCCESS = int(LLMStatusCode.LLM_SUCCESS)
_ports = itertools.count(24000)


@pytest.fixture
def linked(seed: int):  # type: ignore[no-untyped-def]
    with PromptPeer(P, next(_ports), seed) as peer, decoder(D) as dd:
        assert dd.link_clusters([peer.cluster_info()])[0] == LLMStatusCode.LLM_SUCCESS
        yield peer, dd


def _raw(cache) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    return [view.view(np.uint8).reshape(-1) for view in tensor_views(cache)]


def _slot(array: np.ndarray, batch_size: int, slot: int) -> np.ndarray:
    stride = array.nbytes // batch_size
    return array[slot * stride : (slot + 1) * stride]


def test_continuous_push_of_every_layer(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(6, [2, 3333], [])  # 3 layers of K, V; slot 1 is pushed
    dst = dd.kv_cache_manager.allocate_cache(CacheDesc(6, [1, 3333], DataType.DT_FLOAT16))
    for raw in _raw(dst):
        raw[:] = 0
    addrs = dst.per_device_tensor_addrs[0]
    task = peer.call("transfer", (cache_id, [(D, addrs, None, 1)], None, None, None, "go"))
    assert peer.call("task_sync", (task, 20000)) == SUCCESS
    assert peer.call("task_results", (task, 20000)) == [SUCCESS]
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, _slot(peer.expected(cache_id, t, 2 * 6666), 2, 1))


def test_a_blocks_source_without_block_indices_pushes_its_block_0(linked) -> None:  # type: ignore[no-untyped-def]
    """The source is pushed as blocks only when src_block_indices are given (the real `llm_utils`);
    without them a blocks cache takes the slot path: block `src_batch_index` (0) to the addresses."""
    peer, dd = linked
    cache_id = peer.alloc_blocks(2, [4, 64], None)  # 1 layer, 4 blocks of 128 bytes
    dst = dd.kv_cache_manager.allocate_cache(CacheDesc(2, [1, 64], DataType.DT_FLOAT16))
    for raw in _raw(dst):
        raw[:] = 0
    task = peer.call(
        "transfer", (cache_id, [(D, dst.per_device_tensor_addrs[0], None, 0)], None, None, None, "go")
    )
    assert peer.call("task_results", (task, 20000)) == [SUCCESS]
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, peer.expected(cache_id, t, 4 * 128)[:128])


def test_layers_arrive_one_by_one_as_the_synchronizer_releases_them(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    layers = 4
    cache_id = peer.alloc(2 * layers, [1, 4096], [])
    dst = dd.kv_cache_manager.allocate_cache(CacheDesc(2 * layers, [1, 4096], DataType.DT_FLOAT16))
    raws = _raw(dst)
    for raw in raws:
        raw[:] = 0
    expected = [peer.expected(cache_id, t, 8192) for t in range(2 * layers)]
    task = peer.call(
        "transfer", (cache_id, [(D, dst.per_device_tensor_addrs[0], None, 0)], None, None, None, "queue")
    )
    for layer in range(layers):
        # Nothing of this layer (or later ones) arrived before the synchronizer released it.
        for t in range(2 * layer, 2 * layers):
            assert not raws[t].any()
        peer.release_layer(layer)
        deadline = time.monotonic() + 20
        while not all(np.array_equal(raws[t], expected[t]) for t in (2 * layer, 2 * layer + 1)):
            assert time.monotonic() < deadline, f"layer {layer} never arrived"
            time.sleep(0.002)
    assert peer.call("task_sync", (task, 20000)) == SUCCESS


def test_paged_push_moves_block_tables(linked, seed: int) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc_blocks(4, [8, 100], None)  # 2 layers, 8 blocks of 200 bytes
    dst = dd.kv_cache_manager.allocate_blocks_cache(CacheDesc(4, [10, 100], DataType.DT_FLOAT16))
    for raw in _raw(dst):
        raw[:] = 0
    rng = np.random.default_rng(seed)
    src_blocks = [int(b) for b in rng.permutation(8)[:5]]
    dst_blocks = [int(b) for b in rng.permutation(10)[:5]]
    task = peer.call(
        "transfer",
        (cache_id, [(D, dst.per_device_tensor_addrs[0], None, 0)], src_blocks, dst_blocks, None, "go"),
    )
    assert peer.call("task_sync", (task, 20000)) == SUCCESS
    for t, raw in enumerate(_raw(dst)):
        got = raw.reshape(10, 200)
        remote = peer.expected(cache_id, t, 1600).reshape(8, 200)
        for src, dst_block in zip(src_blocks, dst_blocks, strict=True):
            np.testing.assert_array_equal(got[dst_block], remote[src])
        assert not got[sorted(set(range(10)) - set(dst_blocks))].any()


def test_continuous_slot_into_destination_blocks_is_refused_in_v1(linked) -> None:  # type: ignore[no-untyped-def]
    # ge's v1 helper: a continuous source with dst_block_indices (even empty) is PARAM_INVALID.
    peer, dd = linked
    cache_id = peer.alloc(2, [1, 250], [])
    dst = dd.kv_cache_manager.allocate_blocks_cache(CacheDesc(2, [6, 100], DataType.DT_FLOAT16))
    for dst_blocks in ([4, 1, 5], []):
        with pytest.raises(RuntimeError, match="LLM_PARAM_INVALID"):
            peer.call(
                "transfer",
                (cache_id, [(D, dst.per_device_tensor_addrs[0], None, 0)], None, dst_blocks, 200, "go"),
            )


def test_continuous_slot_cut_into_destination_blocks_in_v2(seed: int) -> None:
    from llm_datadist import LLMClusterInfo, LLMConfig, LLMDataDist, LLMRole
    from tests._peer import PROMPT_IP, tensor_views_v2

    pool = json.dumps({"memory_size": 16 << 20, "page_shift": 16})
    v2 = {"llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "0", "llm.MemPoolConfig": pool}
    with PromptPeer(P, next(_ports), seed, extra=v2) as peer:
        dd = LLMDataDist(LLMRole.DECODER, D)
        config = LLMConfig()
        config.device_id = 0
        dd.init({**config.generate_options(), **v2})
        try:
            info = LLMClusterInfo()
            info.remote_cluster_id = P
            info.append_local_ip_info(PROMPT_IP, 0)
            info.append_remote_ip_info(PROMPT_IP, peer.port)
            assert dd.link_clusters([info])[0] == LLMStatusCode.LLM_SUCCESS
            cache_id = peer.call("v2_alloc", (2, [1, 250], [], None))  # one layer; a 500-byte slot
            dst = dd.cache_manager.allocate_blocks_cache(CacheDesc(2, [6, 100], DataType.DT_FLOAT16))
            views = tensor_views_v2(dst)  # 200-byte blocks
            for view in views:
                view[:] = 0
            dst_blocks = [4, 1, 5]  # 200 + 200 + 100 bytes
            task = peer.call(
                "transfer", (cache_id, [(D, dst.tensor_addrs, None, 0)], None, dst_blocks, 200, "go")
            )
            assert peer.call("task_sync", (task, 20000)) == SUCCESS
            for t, raw in enumerate(views):
                source = peer.expected(cache_id, t, 500)
                np.testing.assert_array_equal(raw[800:1000], source[0:200])
                np.testing.assert_array_equal(raw[200:400], source[200:400])
                np.testing.assert_array_equal(raw[1000:1100], source[400:500])
                assert not raw[1100:].any() and not raw[:200].any()
        finally:
            dd.finalize()


def test_layer_range_pushes_only_those_layers(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(8, [1, 64], [])
    dst = dd.kv_cache_manager.allocate_cache(CacheDesc(4, [1, 64], DataType.DT_FLOAT16))
    addrs = dst.per_device_tensor_addrs[0]
    task = peer.call("transfer", (cache_id, [(D, addrs, (2, 4), 0)], None, None, None, "go"))
    assert peer.call("task_results", (task, 20000)) == [SUCCESS]
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, peer.expected(cache_id, 4 + t, 128))


def test_a_failed_layer_stops_the_job(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(6, [1, 64], [])
    dst = dd.kv_cache_manager.allocate_cache(CacheDesc(6, [1, 64], DataType.DT_FLOAT16))
    for raw in _raw(dst):
        raw[:] = 0
    task = peer.call(
        "transfer", (cache_id, [(D, dst.per_device_tensor_addrs[0], None, 0)], None, None, None, "fail:1")
    )
    assert peer.call("task_sync", (task, 20000)) == int(LLMStatusCode.LLM_PARAM_INVALID)
    raws = _raw(dst)
    np.testing.assert_array_equal(raws[0], peer.expected(cache_id, 0, 128))
    assert not raws[2].any() and not raws[4].any()


def test_addresses_outside_the_decoders_caches_are_refused(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(2, [1, 64], [])
    dst = dd.kv_cache_manager.allocate_cache(CacheDesc(2, [1, 32], DataType.DT_FLOAT16))  # too small
    task = peer.call(
        "transfer", (cache_id, [(D, dst.per_device_tensor_addrs[0], None, 0)], None, None, None, "go")
    )
    assert peer.call("task_results", (task, 20000)) == [int(LLMStatusCode.LLM_PARAM_INVALID)]
    bogus = [0x1000, 0x2000]
    task = peer.call("transfer", (cache_id, [(D, bogus, None, 0)], None, None, None, "go"))
    assert peer.call("task_results", (task, 20000)) == [int(LLMStatusCode.LLM_PARAM_INVALID)]
    assert peer.stats()["leases"] == 0


def test_pull_during_a_transfer_is_link_busy(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(4, [1, 64], [(P, 7)])
    dst = dd.kv_cache_manager.allocate_cache(CacheDesc(4, [1, 64], DataType.DT_FLOAT16))
    task = peer.call(
        "transfer", (cache_id, [(D, dst.per_device_tensor_addrs[0], None, 0)], None, None, None, "queue")
    )
    with pytest.raises(LLMException) as exc_info:
        dd.kv_cache_manager.pull_cache(CacheKey(P, 7), dst)
    assert exc_info.value.status_code == LLMStatusCode.LLM_LINK_BUSY
    peer.release_layer(0)
    peer.release_layer(1)
    assert peer.call("task_sync", (task, 20000)) == SUCCESS
    dd.kv_cache_manager.pull_cache(CacheKey(P, 7), dst)  # free again once the transfer ended


def test_synchronize_times_out_without_raising(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(2, [1, 64], [])
    dst = dd.kv_cache_manager.allocate_cache(CacheDesc(2, [1, 64], DataType.DT_FLOAT16))
    task = peer.call(
        "transfer", (cache_id, [(D, dst.per_device_tensor_addrs[0], None, 0)], None, None, None, "queue")
    )
    timeout = int(LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT)
    assert peer.call("task_sync", (task, 50)) == timeout
    assert peer.call("task_results", (task, 50)) == [timeout]
    peer.release_layer(0)
    assert peer.call("task_sync", (task, 20000)) == SUCCESS


@pytest.mark.parametrize(
    ("args", "code"),
    [
        ((None, None, None, 0), "odd"),
        ((None, None, None, 5), "batch"),
        (((0, 9), None, None, 0), "range"),
        ((None, [0], None, 0), "src blocks without dst blocks"),
        ((None, None, 64, 0), "block size for a continuous destination"),
        ((None, None, None, 0, "addrs"), "address count"),
    ],
)
def test_validation_errors_raise_param_invalid(linked, args, code) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    num_tensors = 3 if code == "odd" else 4
    cache_id = peer.alloc(num_tensors, [1, 64], [])
    dst = dd.kv_cache_manager.allocate_cache(CacheDesc(4, [1, 64], DataType.DT_FLOAT16))
    addrs = dst.per_device_tensor_addrs[0][: 3 if len(args) > 4 else 4]
    layers, src_blocks, block_nbytes, batch = args[:4]
    with pytest.raises(RuntimeError, match="LLM_PARAM_INVALID"):
        peer.call("transfer", (cache_id, [(D, addrs, layers, batch)], src_blocks, None, block_nbytes, "go"))


def test_unlinked_destination_and_role(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc(2, [1, 64], [])
    with pytest.raises(RuntimeError, match="LLM_NOT_YET_LINK"):
        peer.call("transfer", (cache_id, [(77, [0x1000, 0x2000], None, 0)], None, None, None, "go"))
    with pytest.raises(LLMException) as exc_info:
        from llm_datadist import TransferConfig
        from tests._peer import _Synchronizer

        src = dd.kv_cache_manager.allocate_cache(CacheDesc(2, [1, 64], DataType.DT_FLOAT16))
        dd.kv_cache_manager.transfer_cache_async(src, _Synchronizer("go", None), [TransferConfig(P, [1, 2])])
    assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID  # DECODER may not push in v1


def test_blocks_cache_key_unaffected(linked) -> None:  # type: ignore[no-untyped-def]
    # A paged source with a BlocksCacheKey can be pushed and still pulled afterwards.
    peer, dd = linked
    cache_id = peer.alloc_blocks(2, [4, 32], 0)
    dst = dd.kv_cache_manager.allocate_blocks_cache(CacheDesc(2, [4, 32], DataType.DT_FLOAT16))
    task = peer.call(
        "transfer", (cache_id, [(D, dst.per_device_tensor_addrs[0], None, 0)], [0, 1], [2, 3], None, "go")
    )
    assert peer.call("task_sync", (task, 20000)) == SUCCESS
    dd.kv_cache_manager.pull_blocks(BlocksCacheKey(P, 0), dst, [3], [0])
    for t, raw in enumerate(_raw(dst)):
        remote = peer.expected(cache_id, t, 256).reshape(4, 64)
        np.testing.assert_array_equal(raw.reshape(4, 64)[0], remote[3])
        np.testing.assert_array_equal(raw.reshape(4, 64)[2], remote[0])


def test_two_transfers_to_one_decoder_at_once(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    first_id = peer.alloc(8, [1, 4096], [])
    second_id = peer.alloc(8, [1, 4096], [])
    first = dd.kv_cache_manager.allocate_cache(CacheDesc(8, [1, 4096], DataType.DT_FLOAT16))
    second = dd.kv_cache_manager.allocate_cache(CacheDesc(8, [1, 4096], DataType.DT_FLOAT16))
    tasks = [
        peer.call(
            "transfer", (cache_id, [(D, dst.per_device_tensor_addrs[0], None, 0)], None, None, None, "go")
        )
        for cache_id, dst in ((first_id, first), (second_id, second))
    ]
    assert [peer.call("task_sync", (task, 20000)) for task in tasks] == [SUCCESS, SUCCESS]
    for cache_id, dst in ((first_id, first), (second_id, second)):
        for t, raw in enumerate(_raw(dst)):
            np.testing.assert_array_equal(raw, peer.expected(cache_id, t, 8192))


def test_a_transfer_waits_for_a_destinations_pull_to_end_and_is_busy_past_the_timeout(
    seed: int,
    _runtime_dir,  # type: ignore[no-untyped-def]
) -> None:
    """A pull whose call returned may still hold its lease at the owner for a moment (the release is one
    way): a transfer into that cluster waits for it, and is LLM_LINK_BUSY only if the pull still holds
    its lease when the transfer's timeout ran out."""
    from llm_datadist._protocol.messages import KEY_REQ, RULES_V1, Location, PinRequest, Release
    from llm_datadist._wire.client import ClientLink

    extra = {"llm.SyncKvCacheWaitTime": "800"}
    with PromptPeer(P, next(_ports), seed, extra=extra) as peer, decoder(D) as dd:
        assert dd.link_clusters([peer.cluster_info()])[0] == LLMStatusCode.LLM_SUCCESS
        cache_id = peer.alloc(2, [1, 64], [(P, 9)])
        dst = dd.kv_cache_manager.allocate_cache(CacheDesc(2, [1, 64], DataType.DT_FLOAT16))
        push = (cache_id, [(D, dst.per_device_tensor_addrs[0], None, 0)], None, None, None, "go")
        # A second connection from cluster D holds a pull's lease, as a pull in flight would.
        holder = ClientLink.connect(
            _runtime_dir / f"127.0.0.1_{peer.port}.sock",
            cluster_id=D,
            remote_cluster_id=P,
            role=2,
            deadline=time.monotonic() + 5,
            incarnation=5,
        )
        try:
            seq = holder.next_seq()
            request = PinRequest(seq, KEY_REQ, 9, 0, 0, 0, 2, True, 128, 0, False, False, RULES_V1)
            grant = holder.request(request, seq, time.monotonic() + 5)
            assert isinstance(grant, Location)
            with pytest.raises(RuntimeError, match="LLM_LINK_BUSY"):
                peer.call("transfer", push)  # the lease outlives the transfer's 800 ms
            peer.call_start("transfer", push)
            time.sleep(0.2)
            holder.send_only(Release(grant.lease_id, True), time.monotonic() + 5)
            task = peer.call_finish()  # started once the lease ended
            assert peer.call("task_sync", (task, 20000)) == SUCCESS
        finally:
            holder.close(say_bye=True)


def _wait_for(condition, what: str, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


@pytest.mark.parametrize("layers", [1, 16])
def test_a_transfer_asks_the_decoder_once_whatever_its_layer_count(linked, layers: int) -> None:  # type: ignore[no-untyped-def]
    """The destinations of every layer are leased at the first layer and released after the last: the
    Decoder's server handles one WriteRequest and one Release for the whole transfer."""
    peer, dd = linked
    core = dd._require_core()
    cache_id = peer.alloc(2 * layers, [1, 1000], [])
    dst = dd.kv_cache_manager.allocate_cache(CacheDesc(2 * layers, [1, 1000], DataType.DT_FLOAT16))
    push = (cache_id, [(D, dst.per_device_tensor_addrs[0], None, 0)], None, None, None, "go")
    for _ in range(2):  # the first also connects the Prompt back to us
        before = core.server.handled
        task = peer.call("transfer", push)
        assert peer.call("task_sync", (task, 20000)) == SUCCESS
        # The release is one way: the task may end a moment before the server handled it.
        _wait_for(lambda: core.leases.stats()["leases"] == 0, "the transfer's lease never ended")
    assert core.server.handled == before + 2
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, peer.expected(cache_id, t, 2000))


def test_a_destination_freed_mid_transfer_is_not_reused_before_it_ends(linked) -> None:  # type: ignore[no-untyped-def]
    """The Decoder's user deallocates the destination between two layers and allocates caches of the same
    size: the transfer still lands in the memory it leased, never in a cache allocated after, and that
    memory comes back to the pool when the transfer ends."""
    peer, dd = linked
    manager, core = dd.kv_cache_manager, dd._require_core()
    desc = CacheDesc(4, [1, 4096], DataType.DT_FLOAT16)
    cache_id = peer.alloc(4, [1, 4096], [])
    dst = manager.allocate_cache(desc)
    views = _raw(dst)
    views[0][:] = 0
    push = (cache_id, [(D, dst.per_device_tensor_addrs[0], None, 0)], None, None, None, "queue")
    task = peer.call("transfer", push)
    peer.release_layer(0)
    expected = peer.expected(cache_id, 0, 8192)
    _wait_for(lambda: np.array_equal(views[0], expected), "layer 0 never arrived")
    views.clear()  # no view of the memory outlives the cache
    manager.deallocate_cache(dst)
    used = core.leases.stats()["pool_used_nbytes"]
    later = [manager.allocate_cache(desc) for _ in range(3)]
    for cache in later:
        for raw in _raw(cache):
            raw[:] = 0x5A
    peer.release_layer(1)
    assert peer.call("task_sync", (task, 20000)) == SUCCESS
    for cache in later:
        assert all((raw == 0x5A).all() for raw in _raw(cache)), "a push landed in a cache allocated after"
        manager.deallocate_cache(cache)
    _wait_for(lambda: core.leases.stats()["leases"] == 0, "the transfer's lease never ended")
    assert core.leases.stats()["pool_used_nbytes"] < used  # the freed destination went back
