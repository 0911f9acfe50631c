"""The vendor's sample programs' call sequences (`examples/python/llm_datadist/*.py` and
`examples/python/hixl/` in hicann/hixl), written here: the same calls, in the same order, with the same
arguments, in two (or three) real processes that meet at barriers where the samples call
`torch.distributed.barrier()`; numpy arrays where the samples use NPU tensors. Each checks the bytes the
sample prints or checks, and the status codes the samples treat as failure. `docs/porting.md` lists, sample
by sample, what a user changes to run the originals here. One test more pins, over the same processes, the
layer mapping the vendor's 2026 `test_transfer_layer_range.py` pins."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

LOCAL = "127.0.0.1"
WAIT_S = 60.0


class _Group:
    """What the samples' gloo process group gives them: a barrier across the group."""

    def __init__(self, barrier: Any) -> None:
        self._barrier = barrier

    def barrier(self) -> None:
        self._barrier.wait(WAIT_S)


def _main(role: Callable[..., Any], barrier: Any, results: Any, index: int, args: tuple[Any, ...]) -> None:
    try:
        results.put((index, "ok", role(_Group(barrier), *args)))
    except BaseException:
        results.put((index, "error", traceback.format_exc()))
        barrier.abort()  # the other side fails at its next barrier instead of waiting


def _run(*roles: tuple[Callable[..., Any], tuple[Any, ...]], parties: int | None = None) -> list[Any]:
    """Run each role in a process of its own; their return values, in order. `parties`: how many of them
    meet at the barriers (all, unless said)."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(parties or len(roles))
    results = ctx.Queue()
    processes = [
        ctx.Process(target=_main, args=(role, barrier, results, index, args), daemon=True)
        for index, (role, args) in enumerate(roles)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    try:
        for _ in processes:
            index, kind, value = results.get(timeout=WAIT_S * 2)
            outcomes[index] = (kind, value)
    finally:
        for process in processes:
            process.join(WAIT_S)
            if process.is_alive():
                process.kill()
                process.join(5)
    errors = [value for kind, value in outcomes.values() if kind == "error"]
    assert not errors, "\n".join(errors)
    return [outcomes[index][1] for index in range(len(roles))]


# ------------------------------------------------------------------------------------------------ helpers


def _datadist(role: Any, cluster_id: int, device_id: int = 0, **config: Any) -> Any:
    from llm_datadist import LLMConfig, LLMDataDist

    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = device_id
    for name, value in config.items():
        setattr(llm_config, name, value)
    datadist.init(llm_config.generate_options())
    return datadist


def _rank_table_link(datadist: Any) -> int:
    """The samples' `link`: two-sided, with a rank table; `ext.local_rank_table` stands in for the one they
    build from `/dev/davinci*` and `hccn_tool`."""
    import time

    from llm_datadist import RegisterMemStatus
    from llm_datadist.ext import local_rank_table

    cluster_rank_info = {1: 0, 2: 1}
    comm_id = datadist.link("link", cluster_rank_info, local_rank_table(cluster_rank_info))
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        status = datadist.query_register_mem_status(comm_id)
        if status == RegisterMemStatus.OK:
            return int(comm_id)
        assert status != RegisterMemStatus.FAILED, "link failed"
        time.sleep(0.05)
    raise AssertionError("the link was not ready in time")


def _cluster(remote_id: int, remote_port: int | None, local_port: int | None = None) -> Any:
    from llm_datadist import LLMClusterInfo

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = remote_id
    if local_port is not None:
        cluster.append_local_ip_info(LOCAL, local_port)
    if remote_port is not None:
        cluster.append_remote_ip_info(LOCAL, remote_port)
    return cluster


def _succeeds(call: Callable[[], Any]) -> None:
    from llm_datadist import LLMStatusCode

    ret, rets = call()
    assert ret == LLMStatusCode.LLM_SUCCESS, (ret, rets)


def _desc(num_tensors: int, shape: list[int], dtype: str) -> Any:
    from llm_datadist import CacheDesc, DataType, Placement

    return CacheDesc(num_tensors, shape, getattr(DataType, dtype), Placement.DEVICE)


# --------------------------------------------------------------------------- pull_cache_sample.py


def _pull_cache_prompt(group: _Group) -> list[bytes]:
    from llm_datadist import CacheKey, LLMRole
    from llm_datadist.ext import tensor_views

    datadist = _datadist(
        LLMRole.PROMPT, 1, 0, enable_cache_manager=True, mem_pool_cfg='{"memory_size": 67108864}'
    )
    comm_id = _rank_table_link(datadist)
    cache_manager = datadist.cache_manager
    keys = [
        CacheKey(prompt_cluster_id=1, req_id=0, model_id=0),
        CacheKey(prompt_cluster_id=1, req_id=1, model_id=0),
    ]
    cache = cache_manager.allocate_cache(_desc(4, [2, 16 * 1024], "DT_FLOAT16"), keys)
    for t, view in enumerate(tensor_views(cache)):
        view.view(np.uint8)[...] = (
            np.random.default_rng(t).integers(0, 256, view.nbytes, np.uint8).reshape(view.shape[0], -1)
        )
    sent = [view.tobytes() for view in tensor_views(cache)]
    group.barrier()  # cache ready
    group.barrier()  # decoder pull_cache end
    datadist.unlink(comm_id)
    group.barrier()  # wait peer unlink end
    for key in keys:
        cache_manager.remove_cache_key(key)  # a no-op after the pulls
    cache_manager.deallocate_cache(cache)
    datadist.finalize()
    return sent


def _pull_cache_decoder(group: _Group) -> list[bytes]:
    from llm_datadist import CacheKey, LLMRole
    from llm_datadist.ext import tensor_views

    datadist = _datadist(
        LLMRole.DECODER, 2, 1, enable_cache_manager=True, mem_pool_cfg='{"memory_size": 67108864}'
    )
    comm_id = _rank_table_link(datadist)
    cache_manager = datadist.cache_manager
    cache = cache_manager.allocate_cache(_desc(4, [2, 16 * 1024], "DT_FLOAT16"))
    group.barrier()  # cache ready
    cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=0, model_id=0), cache, batch_index=0)
    cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=1, model_id=0), cache, batch_index=1)
    got = [view.tobytes() for view in tensor_views(cache)]
    group.barrier()  # pull_cache end
    datadist.unlink(comm_id)
    group.barrier()  # wait peer unlink end
    cache_manager.deallocate_cache(cache)
    datadist.finalize()
    return got


def test_pull_cache_sample() -> None:
    """Two keys of one cache pulled into batch 0 and 1: the Decoder holds the Prompt's bytes."""
    sent, got = _run((_pull_cache_prompt, ()), (_pull_cache_decoder, ()))
    assert got == sent


# --------------------------------------------------------------------------- pull_blocks_sample.py


def _pull_blocks_prompt(group: _Group) -> None:
    from llm_datadist import BlocksCacheKey, LLMRole

    datadist = _datadist(LLMRole.PROMPT, 1, 0, enable_cache_manager=True)
    tensor = np.ones((2, 1024 * 1024), np.float32)
    datadist.cache_manager.register_blocks_cache(
        _desc(1, [2, 1024 * 1024], "DT_FLOAT"), [tensor.ctypes.data], BlocksCacheKey(1, 0)
    )
    comm_id = _rank_table_link(datadist)
    group.barrier()  # cache ready
    group.barrier()  # decoder pull_blocks end
    datadist.unlink(comm_id)
    group.barrier()  # wait peer unlink end
    datadist.finalize()


def _pull_blocks_decoder(group: _Group) -> tuple[bool, bool, bool]:
    from llm_datadist import BlocksCacheKey, Cache, CacheDesc, DataType, LLMRole, Placement

    datadist = _datadist(LLMRole.DECODER, 2, 1, enable_cache_manager=True)
    cache_manager = datadist.cache_manager
    tensor = np.zeros((2, 1024 * 1024), np.float32)  # the sample fills ones on both sides; zeros tell apart
    cache = cache_manager.register_blocks_cache(_desc(1, [2, 1024 * 1024], "DT_FLOAT"), [tensor.ctypes.data])
    comm_id = _rank_table_link(datadist)
    group.barrier()  # cache ready
    cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 1])
    pulled = bool((tensor == 1).all())
    cpu_tensor = np.random.default_rng(0).random((2, 1024 * 1024), np.float32)
    cpu_cache = Cache.create_cpu_cache(
        CacheDesc(1, [2, 1024 * 1024], DataType.DT_FLOAT, Placement.HOST), [cpu_tensor.ctypes.data]
    )
    cache_manager.swap_blocks(cache, cpu_cache, {0: 0, 1: 1})  # swap out
    swapped_out = bool((cpu_tensor == 1).all())
    tensor[...] = 7
    cache_manager.swap_blocks(cpu_cache, cache, {0: 0, 1: 1})  # swap in
    swapped_in = bool((tensor == 1).all())
    group.barrier()  # pull_blocks end
    datadist.unlink(comm_id)
    group.barrier()  # wait peer unlink end
    datadist.finalize()
    return pulled, swapped_out, swapped_in


def test_pull_blocks_sample() -> None:
    """Registered blocks pulled one-sided over a rank-table link, then swapped out to a CPU cache and in."""
    _, decoder = _run((_pull_blocks_prompt, ()), (_pull_blocks_decoder, ()))
    assert decoder == (True, True, True)


# --------------------------------------------------------------------------- pull_from_cache_to_blocks.py


def _cache_to_blocks_prompt(group: _Group) -> bytes:
    from llm_datadist import CacheKey, LLMRole
    from llm_datadist.ext import tensor_views

    datadist = _datadist(
        LLMRole.PROMPT, 1, 0, enable_cache_manager=True, mem_pool_cfg='{"memory_size": 67108864}'
    )
    comm_id = _rank_table_link(datadist)
    cache_manager = datadist.cache_manager
    key = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    cache = cache_manager.allocate_cache(_desc(4, [2, 16 * 1024], "DT_FLOAT16"), [key])
    for t, view in enumerate(tensor_views(cache)):
        view[...] = t + 2
    sent = b"".join(view[0].tobytes() for view in tensor_views(cache))
    group.barrier()  # cache ready
    group.barrier()  # decoder pull_blocks end
    datadist.unlink(comm_id)
    group.barrier()  # wait peer unlink end
    cache_manager.remove_cache_key(key)
    cache_manager.deallocate_cache(cache)
    datadist.finalize()
    return sent


def _cache_to_blocks_decoder(group: _Group) -> tuple[bytes, bool]:
    from llm_datadist import CacheKey, LLMRole

    datadist = _datadist(
        LLMRole.DECODER, 2, 1, enable_cache_manager=True, mem_pool_cfg='{"memory_size": 67108864}'
    )
    cache_manager = datadist.cache_manager
    tensors = [np.ones((2, 16 * 1024), np.float16) for _ in range(4)]
    cache = cache_manager.register_blocks_cache(
        _desc(4, [2, 16 * 1024], "DT_FLOAT16"), [t.ctypes.data for t in tensors]
    )
    comm_id = _rank_table_link(datadist)
    group.barrier()  # cache ready
    cache_manager.pull_blocks(
        CacheKey(prompt_cluster_id=1, req_id=0, model_id=0), cache, src_blocks=[], dst_blocks=[0]
    )
    got = b"".join(t[0].tobytes() for t in tensors)
    untouched = all((t[1] == 1).all() for t in tensors)
    group.barrier()  # pull_blocks end
    datadist.unlink(comm_id)
    group.barrier()  # wait peer unlink end
    datadist.finalize()
    return got, untouched


def test_pull_from_cache_to_blocks_sample() -> None:
    """A regular cache's batch pulled into block 0 of registered blocks (no source blocks)."""
    sent, (got, untouched) = _run((_cache_to_blocks_prompt, ()), (_cache_to_blocks_decoder, ()))
    assert got == sent
    assert untouched


# ------------------------------------------------- push_blocks_sample.py, hixl_transfer_backend_sample.py


def _push_prompt(group: _Group, backend: str) -> list[list[float]]:
    from llm_datadist import BlocksCacheKey, LLMRole

    options = {"transfer_backend": backend} if backend else {}
    datadist = _datadist(LLMRole.PROMPT, 0, 0, local_comm_res="", listen_ip_info=f"{LOCAL}:26000", **options)
    cache_manager = datadist.cache_manager
    tensors = [np.ones((3, 10), np.float32), np.ones((3, 10), np.float32)]
    cache = cache_manager.register_blocks_cache(
        _desc(2, [3, 10], "DT_FLOAT"), [t.ctypes.data for t in tensors], BlocksCacheKey(0, 0)
    )
    group.barrier()  # register end
    if backend == "hixl":  # hixl_transfer_backend_sample.py: the Prompt links and pulls block 2 too
        _succeeds(lambda: datadist.link_clusters([_cluster(1, 26001, 26000)], 5000))
        cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, src_blocks=[2], dst_blocks=[2])
    group.barrier()  # decoder push blocks end
    rows = [t[:, 0].tolist() for t in tensors]
    if backend == "hixl":
        _succeeds(lambda: datadist.unlink_clusters([_cluster(1, None)], 5000))
        group.barrier()  # wait peer unlink end
    else:  # the Decoder may have finalized by now: a forced unlink still succeeds
        _succeeds(lambda: datadist.unlink_clusters([_cluster(1, None)], 5000, force=True))
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return rows


def _push_decoder(group: _Group, backend: str) -> None:
    from llm_datadist import BlocksCacheKey, LLMRole

    options = {"transfer_backend": backend} if backend else {}
    datadist = _datadist(LLMRole.DECODER, 1, 0, local_comm_res="", listen_ip_info=f"{LOCAL}:26001", **options)
    cache_manager = datadist.cache_manager
    tensors = [np.zeros((3, 10), np.float32), np.zeros((3, 10), np.float32)]
    cache = cache_manager.register_blocks_cache(
        _desc(2, [3, 10], "DT_FLOAT"), [t.ctypes.data for t in tensors], BlocksCacheKey(1, 0)
    )
    group.barrier()  # register end
    _succeeds(lambda: datadist.link_clusters([_cluster(0, 26000, 26001)], 5000))
    dst_blocks = [0, 1] if backend == "hixl" else [0, 2]
    cache_manager.push_blocks(BlocksCacheKey(0, 0), cache, src_blocks=[0, 1], dst_blocks=dst_blocks)
    group.barrier()  # push_blocks end
    if backend == "hixl":
        _succeeds(lambda: datadist.unlink_clusters([_cluster(0, None)], 5000))
        group.barrier()  # wait peer unlink end
    else:
        _succeeds(lambda: datadist.unlink_clusters([_cluster(0, None)], 5000, force=True))
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


@pytest.mark.parametrize("backend", ["", "hixl"])
def test_push_blocks_sample(backend: str) -> None:
    """push_blocks_sample.py (both backends it offers): the Decoder pushes its blocks 0 and 1 into the
    Prompt's 0 and 2; each side then unlinks with force, whoever finalized first. With "hixl" this is
    hixl_transfer_backend_sample.py: the Prompt also pulls the Decoder's block 2, the pushes go to 0 and 1,
    and the Prompt checks every value is 0."""
    prompt, _ = _run((_push_prompt, (backend,)), (_push_decoder, (backend,)))
    if backend == "hixl":
        assert prompt == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    else:
        assert prompt == [[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]


# --------------------------------------------------------------------------- push_cache_sample.py


def _push_cache_prompt(group: _Group) -> list[float]:
    from llm_datadist import LLMRole

    datadist = _datadist(LLMRole.PROMPT, 0, 0, local_comm_res="", listen_ip_info=f"{LOCAL}:26000")
    cache_manager = datadist.cache_manager
    tensors = [np.zeros((3, 10), np.float32), np.zeros((3, 10), np.float32)]
    cache = cache_manager.register_cache(_desc(2, [3, 10], "DT_FLOAT"), [t.ctypes.data for t in tensors])
    assert cache.cache_id == 1  # the sample pushes to cache id 1
    group.barrier()  # register end
    group.barrier()  # decoder push cache end
    sums = [float(t.sum()) for t in tensors]
    group.barrier()  # wait unlink end
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return sums


def _push_cache_decoder(group: _Group) -> None:
    from llm_datadist import CacheKeyByIdAndIndex, LLMRole

    datadist = _datadist(LLMRole.DECODER, 1, 0, local_comm_res="", listen_ip_info=f"{LOCAL}:26001")
    cache_manager = datadist.cache_manager
    tensors = [np.ones((3, 10), np.float32), np.ones((3, 10), np.float32)]
    cache = cache_manager.register_cache(_desc(2, [3, 10], "DT_FLOAT"), [t.ctypes.data for t in tensors])
    group.barrier()  # register end
    _succeeds(lambda: datadist.link_clusters([_cluster(0, 26000, 26001)], 5000))
    cache_manager.push_cache(
        CacheKeyByIdAndIndex(cluster_id=0, cache_id=1, batch_index=0), cache, src_batch_index=0
    )
    group.barrier()  # push cache end
    _succeeds(lambda: datadist.unlink_clusters([_cluster(0, 26000)], 5000))
    group.barrier()  # unlink end
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def test_push_cache_sample() -> None:
    """The Decoder pushes batch 0 of its registered cache into the Prompt's cache id 1, batch 0: the first
    of the 3 rows of each tensor (10 floats of 1)."""
    prompt, _ = _run((_push_cache_prompt, ()), (_push_cache_decoder, ()))
    assert prompt == [10.0, 10.0]


# --------------------------------------------------------------------------- transfer_cache_async_sample.py


def _async_prompt(group: _Group, layers: int = 1, src_layers: range = range(0, 1)) -> tuple[str, list[int]]:
    from llm_datadist import BlocksCacheKey, LayerSynchronizer, LLMRole, TransferWithCacheKeyConfig

    asked: list[int] = []

    class LayerSynchronizerImpl(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            asked.append(layer_index)
            return True

    datadist = _datadist(
        LLMRole.PROMPT,
        0,
        0,
        listen_ip_info=f"{LOCAL}:26001",
        enable_cache_manager=True,
        enable_remote_cache_accessible=True,
    )
    cache_manager = datadist.cache_manager
    tensors = [np.full((3, 10), t + 1, np.float32) for t in range(2 * layers)]
    cache = cache_manager.register_blocks_cache(
        _desc(2 * layers, [3, 10], "DT_FLOAT"), [t.ctypes.data for t in tensors], BlocksCacheKey(0, 0)
    )
    group.barrier()  # register end
    _succeeds(lambda: datadist.link_clusters([_cluster(1, 26000, 26001)], 5000))
    config = TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), src_layers, range(0, len(src_layers)))
    task = cache_manager.transfer_cache_async(cache, LayerSynchronizerImpl(), [config])
    results = task.get_results()
    group.barrier()  # transfer cache end
    _succeeds(lambda: datadist.unlink_clusters([_cluster(1, None)], 5000, force=True))
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return ",".join(result.name for result in results), asked


def _async_decoder(group: _Group) -> list[list[float]]:
    from llm_datadist import BlocksCacheKey, LLMRole

    datadist = _datadist(
        LLMRole.DECODER,
        1,
        0,
        listen_ip_info=f"{LOCAL}:26000",
        enable_cache_manager=True,
        enable_remote_cache_accessible=True,
    )
    cache_manager = datadist.cache_manager
    tensors = [np.zeros((3, 10), np.float32), np.zeros((3, 10), np.float32)]
    cache = cache_manager.register_blocks_cache(
        _desc(2, [3, 10], "DT_FLOAT"), [t.ctypes.data for t in tensors], BlocksCacheKey(1, 0)
    )
    group.barrier()  # register end
    group.barrier()  # prompt transfer cache end
    rows = [t[:, 0].tolist() for t in tensors]
    _succeeds(lambda: datadist.unlink_clusters([_cluster(0, None)], 5000, force=True))
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return rows


def test_transfer_cache_async_sample() -> None:
    """A blocks cache pushed layer by layer with no block indices: the cache-to-cache path with batch index
    0, block 0 of both; layer 0 is both tensors (K and V: two tensors a layer)."""
    (results, asked), rows = _run((_async_prompt, ()), (_async_decoder, ()))
    assert (results, asked) == ("LLM_SUCCESS", [0])
    assert rows == [[1.0, 0.0, 0.0], [2.0, 0.0, 0.0]]


def test_a_source_layer_range_not_from_0_lands_at_the_destination_range_start() -> None:
    """What the vendor's 2026 `test_transfer_layer_range.py` (hixl 49b96c6) pins: source layer l goes to
    destination layer `dst_layer_range[l - src_layer_range.start]`, and the synchronizer is asked for the
    source's layer. Layer 1 of a 2-layer source (tensors 2 and 3) lands in layer 0 of the destination."""
    (results, asked), rows = _run((_async_prompt, (2, range(1, 2))), (_async_decoder, ()))
    assert (results, asked) == ("LLM_SUCCESS", [1])
    assert rows == [[3.0, 0.0, 0.0], [4.0, 0.0, 0.0]]


# --------------------------------------------------------------------------- switch_role_sample.py


def _switch_prompt(group: _Group) -> list[list[float]]:
    from llm_datadist import BlocksCacheKey, LLMRole

    datadist = _datadist(LLMRole.PROMPT, 0, 0, local_comm_res="", listen_ip_info=f"{LOCAL}:26000")
    cache_manager = datadist.cache_manager
    tensors = [np.ones((3, 10), np.float32), np.ones((3, 10), np.float32)]
    cache = cache_manager.register_blocks_cache(
        _desc(2, [3, 10], "DT_FLOAT"), [t.ctypes.data for t in tensors], BlocksCacheKey(0, 0)
    )
    group.barrier()  # register end
    group.barrier()  # decoder unlink
    datadist.switch_role(LLMRole.DECODER)
    group.barrier()  # prompt switch role end, close listen
    group.barrier()  # decoder switch role end, listen
    _succeeds(lambda: datadist.link_clusters([_cluster(1, 26000, 26000)], 5000))
    group.barrier()  # prompt link end
    group.barrier()  # decoder push blocks end
    rows = [t[:, 0].tolist() for t in tensors]
    _succeeds(lambda: datadist.unlink_clusters([_cluster(1, None)], 5000, force=True))
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return rows


def _switch_decoder(group: _Group) -> list[float]:
    from llm_datadist import BlocksCacheKey, LLMConfig, LLMRole

    datadist = _datadist(LLMRole.DECODER, 1, 0, local_comm_res="")
    cache_manager = datadist.cache_manager
    tensors = [np.zeros((3, 10), np.float32), np.zeros((3, 10), np.float32)]
    cache = cache_manager.register_blocks_cache(
        _desc(2, [3, 10], "DT_FLOAT"), [t.ctypes.data for t in tensors], BlocksCacheKey(1, 0)
    )
    group.barrier()  # register end
    _succeeds(lambda: datadist.link_clusters([_cluster(0, 26000, 26000)], 5000))
    cache_manager.pull_blocks(BlocksCacheKey(0, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2])
    pulled = tensors[0][:, 0].tolist()
    _succeeds(lambda: datadist.unlink_clusters([_cluster(0, 26000)], 5000))
    group.barrier()  # decoder unlink
    group.barrier()  # prompt switch role end, close listen
    llm_config = LLMConfig()
    llm_config.listen_ip_info = f"{LOCAL}:26000"
    datadist.switch_role(LLMRole.PROMPT, llm_config.generate_options())
    group.barrier()  # decoder switch role end, listen
    group.barrier()  # prompt link end
    for t in tensors:
        t[...] = 5
    cache_manager.push_blocks(
        BlocksCacheKey(0, 0),
        cache,
        src_blocks=[0, 1, 2],
        dst_blocks=[0, 1, 2],
        src_layer_range=range(0, 2),
        dst_layer_range=range(0, 2),
        tensor_num_per_layer=1,
    )
    group.barrier()  # decoder push blocks end
    _succeeds(lambda: datadist.unlink_clusters([_cluster(0, None)], 5000, force=True))
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return pulled


def test_switch_role_sample() -> None:
    """The Decoder pulls, unlinks and becomes the Prompt at the same address; the old Prompt, now a
    Decoder, links to it and receives its push of every block of both layers."""
    prompt, pulled = _run((_switch_prompt, ()), (_switch_decoder, ()))
    assert pulled == [1.0, 0.0, 1.0]
    assert prompt == [[5.0, 5.0, 5.0], [5.0, 5.0, 5.0]]


# --------------------------------------------------------------------------- pull_blocks_xpyd_sample.py


def _ip_port_to_int(ip_port: str) -> int:
    import socket
    import struct

    ip, port = ip_port.split(":")
    return (struct.unpack("!I", socket.inet_aton(ip))[0] << 16) | int(port)


def _xpyd_prompt(group: _Group, ip_port: str) -> None:
    from llm_datadist import BlocksCacheKey, LLMRole

    me = _ip_port_to_int(ip_port)
    datadist = _datadist(LLMRole.PROMPT, me, 0, local_comm_res="", listen_ip_info=ip_port)
    cache_manager = datadist.cache_manager
    tensor = np.full((3, 10), me % 1000, np.float32)
    cache = cache_manager.register_blocks_cache(
        _desc(1, [3, 10], "DT_FLOAT"), [tensor.ctypes.data], BlocksCacheKey(me, 0)
    )
    group.barrier()  # registered (the sample sleeps 5 s instead)
    group.barrier()  # the Decoder is done (the sample sleeps 30 s instead)
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def _xpyd_decoder(group: _Group, ip_port: str, remotes: list[str]) -> list[list[float]]:
    from llm_datadist import BlocksCacheKey, LLMRole

    me = _ip_port_to_int(ip_port)
    datadist = _datadist(LLMRole.DECODER, me, 0, local_comm_res="")
    cache_manager = datadist.cache_manager
    tensor = np.zeros((3, 10), np.float32)
    cache = cache_manager.register_blocks_cache(
        _desc(1, [3, 10], "DT_FLOAT"), [tensor.ctypes.data], BlocksCacheKey(me, 0)
    )
    group.barrier()
    clusters = []
    for remote in remotes:
        cluster = _cluster(_ip_port_to_int(remote), None)
        cluster.append_local_ip_info(ip_port.split(":")[0], 0)
        cluster.append_remote_ip_info(remote.split(":")[0], int(remote.split(":")[1]))
        clusters.append(cluster)
    _succeeds(lambda: datadist.link_clusters(clusters, 5000))
    seen = []
    for remote in remotes:
        cache_manager.pull_blocks(
            BlocksCacheKey(_ip_port_to_int(remote), 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2]
        )
        seen.append(tensor[:, 0].tolist())
    _succeeds(lambda: datadist.unlink_clusters(clusters, 5000))
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    group.barrier()
    return seen


def test_pull_blocks_xpyd_sample() -> None:
    """One Decoder links to two Prompts at once, cluster ids made of ip and port (48 bits), and pulls the
    same blocks from each in turn."""
    prompts = [f"{LOCAL}:26000", f"{LOCAL}:26001"]
    *_, seen = _run(
        (_xpyd_prompt, (prompts[0],)),
        (_xpyd_prompt, (prompts[1],)),
        (_xpyd_decoder, (f"{LOCAL}:26010", prompts)),
    )
    first, second = (float(_ip_port_to_int(p) % 1000) for p in prompts)
    assert seen == [[first, 0.0, first], [second, 0.0, second]]


# --------------------------------------------------------------------------- hixl_d2rd_multiproc_sample.py

BUF_SIZE = 8 * 1024 * 1024
BLOCK_SIZE = 16 * 1024


def _options() -> dict[str, str]:
    import json

    import hixl

    resource_config = {"comm_resource_config.protocol_desc": ["roce:device"]}
    return {hixl.OPTION_AUTO_CONNECT: "1", hixl.OPTION_GLOBAL_RESOURCE_CONFIG: json.dumps(resource_config)}


def _d2rd_server(group: _Group, send: Any) -> None:
    import hixl

    engine = hixl.Hixl()
    handle = None
    try:
        assert engine.initialize(f"{LOCAL}:16001", _options()) == hixl.SUCCESS
        buffer = np.full(BUF_SIZE, 0xAA, np.uint8)
        ret, handle = engine.register_mem(hixl.MemDesc(buffer.ctypes.data, BUF_SIZE), hixl.MemType.MEM_DEVICE)
        assert ret == hixl.SUCCESS
        send.send(buffer.ctypes.data)  # the sample sends it over a TCP socket of its own
        group.barrier()  # the client is done (the sample waits for it to disconnect)
    finally:
        if handle is not None:
            assert engine.deregister_mem(handle) == hixl.SUCCESS
        engine.finalize()


def _d2rd_client(group: _Group, receive: Any) -> bool:
    import hixl

    engine = hixl.Hixl()
    handle = None
    connected = False
    try:
        assert engine.initialize(f"{LOCAL}:16000", _options()) == hixl.SUCCESS
        buffer = np.zeros(BUF_SIZE, np.uint8)
        ret, handle = engine.register_mem(hixl.MemDesc(buffer.ctypes.data, BUF_SIZE), hixl.MemType.MEM_DEVICE)
        assert ret == hixl.SUCCESS
        assert receive.poll(WAIT_S)
        remote_addr = receive.recv()
        assert engine.connect(f"{LOCAL}:16001", timeout_in_millis=5000) == hixl.SUCCESS
        connected = True
        ops = [
            hixl.TransferOpDesc(
                local_addr=buffer.ctypes.data + i, remote_addr=remote_addr + i, len=BLOCK_SIZE
            )
            for i in range(0, BUF_SIZE, BLOCK_SIZE)
        ]
        ret = engine.transfer_sync(f"{LOCAL}:16001", hixl.TransferOp.READ, ops, timeout_in_millis=30000)
        assert ret == hixl.SUCCESS, ret
        return bool((buffer == 0xAA).all())
    finally:
        if connected:
            assert engine.disconnect(f"{LOCAL}:16001", timeout_in_millis=5000) == hixl.SUCCESS
        if handle is not None:
            assert engine.deregister_mem(handle) == hixl.SUCCESS
        engine.finalize()
        group.barrier()


def test_hixl_d2rd_multiproc_sample() -> None:
    """Two hixl engines: the client reads the server's 8 MiB of 0xAA in 512 ops of 16 KiB."""
    receive, send = mp.get_context("spawn").Pipe(duplex=False)
    _, verified = _run((_d2rd_server, (send,)), (_d2rd_client, (receive,)))
    assert verified
