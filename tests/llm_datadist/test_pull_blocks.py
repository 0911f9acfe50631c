"""`pull_blocks` between a real Prompt process and this Decoder: paged caches, scattered block tables,
layer ranges, and every documented error."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from llm_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMStatusCode
from llm_datadist.ext import tensor_views
from tests._peer import PromptPeer, decoder

P = 1
_ports = itertools.count(25000)


@pytest.fixture
def linked(seed: int):  # type: ignore[no-untyped-def]
    with PromptPeer(P, next(_ports), seed) as peer, decoder() as dd:
        assert dd.link_clusters([peer.cluster_info()])[0] == LLMStatusCode.LLM_SUCCESS
        yield peer, dd


def _blocks(view: np.ndarray, num_blocks: int) -> np.ndarray:
    return view.view(np.uint8).reshape(num_blocks, -1)


def _status(exc_info: pytest.ExceptionInfo[LLMException]) -> LLMStatusCode:
    return exc_info.value.status_code


def test_scattered_blocks_land_where_the_table_says(linked, seed: int) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    shape = [16, 5, 3, 11]  # 16 blocks of 330 bytes (odd on purpose)
    cache_id = peer.alloc_blocks(4, shape, 0)
    kvm = dd.kv_cache_manager
    local = kvm.allocate_blocks_cache(CacheDesc(4, [12, 5, 3, 11], DataType.DT_FLOAT16))
    for view in tensor_views(local):
        view.view(np.uint8)[:] = 0
    rng = np.random.default_rng(seed)
    prompt_blocks = [int(b) for b in rng.permutation(16)[:9]]
    decoder_blocks = [int(b) for b in rng.permutation(12)[:9]]
    kvm.pull_blocks(BlocksCacheKey(P, 0), local, prompt_blocks, decoder_blocks)
    for t, view in enumerate(tensor_views(local)):
        remote = _blocks(peer.expected(cache_id, t, 16 * 330), 16)
        got = _blocks(view, 12)
        for src, dst in zip(prompt_blocks, decoder_blocks, strict=True):
            np.testing.assert_array_equal(got[dst], remote[src])
        untouched = sorted(set(range(12)) - set(decoder_blocks))
        assert not got[untouched].any()
    # Blocks keys are never consumed: the same table pulls again.
    kvm.pull_blocks(BlocksCacheKey(P, 0), local, prompt_blocks[:1], decoder_blocks[:1])
    assert peer.stats()["leases"] == 0


def test_layer_ranges_select_tensors(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    cache_id = peer.alloc_blocks(8, [4, 64], 3)  # 4 layers of K, V
    kvm = dd.kv_cache_manager
    local = kvm.allocate_blocks_cache(CacheDesc(4, [4, 64], DataType.DT_FLOAT16))  # 2 layers
    kvm.pull_blocks(
        BlocksCacheKey(P, model_id=3),
        local,
        [0, 3],
        [1, 2],
        src_layer_range=range(2, 4),
        dst_layer_range=range(0, 2),
    )
    for t, view in enumerate(tensor_views(local)):
        remote = _blocks(peer.expected(cache_id, 4 + t, 4 * 128), 4)
        got = _blocks(view, 4)
        np.testing.assert_array_equal(got[1], remote[0])
        np.testing.assert_array_equal(got[2], remote[3])


def test_model_id_selects_the_newest_cache(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    peer.alloc_blocks(2, [2, 32], 5)
    newer = peer.alloc_blocks(2, [2, 32], 5)
    local = dd.kv_cache_manager.allocate_blocks_cache(CacheDesc(2, [2, 32], DataType.DT_FLOAT16))
    dd.kv_cache_manager.pull_blocks(BlocksCacheKey(P, 5), local, [1], [0])
    for t, view in enumerate(tensor_views(local)):
        np.testing.assert_array_equal(_blocks(view, 2)[0], _blocks(peer.expected(newer, t, 128), 2)[1])


@pytest.mark.parametrize(
    ("prompt_blocks", "decoder_blocks", "kwargs", "why"),
    [
        ([], [], {}, "empty lists"),
        ([0, 1], [0], {}, "different lengths"),
        ([0], [4], {}, "decoder block out of range"),
        ([4], [0], {}, "prompt block out of range (checked against the remote cache)"),
        ([0], [0], {"src_layer_range": range(0, 1), "tensor_num_per_layer": 1}, "source range smaller"),
        ([0], [0], {"tensor_num_per_layer": 3}, "tensor_num_per_layer beyond the cache"),
    ],
)
def test_invalid_block_tables(linked, prompt_blocks, decoder_blocks, kwargs, why) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    peer.alloc_blocks(2, [4, 32], 0)
    local = dd.kv_cache_manager.allocate_blocks_cache(CacheDesc(2, [4, 32], DataType.DT_FLOAT16))
    with pytest.raises(LLMException) as exc_info:
        dd.kv_cache_manager.pull_blocks(BlocksCacheKey(P, 0), local, prompt_blocks, decoder_blocks, **kwargs)
    assert _status(exc_info) == LLMStatusCode.LLM_PARAM_INVALID, why
    assert peer.stats()["leases"] == 0


def test_block_size_mismatch_and_non_blocks_destination(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    peer.alloc_blocks(2, [4, 32], 0)
    kvm = dd.kv_cache_manager
    other_size = kvm.allocate_blocks_cache(CacheDesc(2, [4, 16], DataType.DT_FLOAT16))
    with pytest.raises(LLMException) as exc_info:
        kvm.pull_blocks(BlocksCacheKey(P, 0), other_size, [0], [0])
    assert _status(exc_info) == LLMStatusCode.LLM_PARAM_INVALID
    continuous = kvm.allocate_cache(CacheDesc(2, [4, 32], DataType.DT_FLOAT16))
    with pytest.raises(LLMException) as exc_info:
        kvm.pull_blocks(BlocksCacheKey(P, 0), continuous, [0], [0])
    assert _status(exc_info) == LLMStatusCode.LLM_PARAM_INVALID


def test_unknown_model_id_and_unlinked_cluster(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    peer.alloc_blocks(2, [4, 32], None)  # no key: not pullable by model_id
    local = dd.kv_cache_manager.allocate_blocks_cache(CacheDesc(2, [4, 32], DataType.DT_FLOAT16))
    with pytest.raises(LLMException) as exc_info:
        dd.kv_cache_manager.pull_blocks(BlocksCacheKey(P, 0), local, [0], [0])
    assert _status(exc_info) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    with pytest.raises(LLMException) as exc_info:
        dd.kv_cache_manager.pull_blocks(BlocksCacheKey(9, 0), local, [0], [0])
    assert _status(exc_info) == LLMStatusCode.LLM_NOT_YET_LINK


def test_argument_types(linked) -> None:  # type: ignore[no-untyped-def]
    _, dd = linked
    kvm = dd.kv_cache_manager
    local = kvm.allocate_blocks_cache(CacheDesc(2, [4, 32], DataType.DT_FLOAT16))
    with pytest.raises(TypeError):
        kvm.pull_blocks(("cluster", 0), local, [0], [0])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        kvm.pull_blocks(BlocksCacheKey(P, 0), local, 0, [0])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        kvm.pull_blocks(BlocksCacheKey(P, 0), local, [-1], [0])
    with pytest.raises(ValueError):
        kvm.pull_blocks(BlocksCacheKey(P, 0), local, [0], [0], src_layer_range=range(2**32, 2**32 + 1))
    # Other keyword arguments are ignored, as the real `kwargs.get` ignores them: the pull goes ahead (and
    # finds nothing under model_id 0 here).
    with pytest.raises(LLMException) as exc_info:
        kvm.pull_blocks(BlocksCacheKey(P, 0), local, [0], [0], src_cache_offset=0)
    assert _status(exc_info) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def test_blocks_keys_only_on_prompt_and_pull_only_on_decoder(linked) -> None:  # type: ignore[no-untyped-def]
    _, dd = linked
    with pytest.raises(LLMException) as exc_info:
        dd.kv_cache_manager.allocate_blocks_cache(
            CacheDesc(2, [4, 32], DataType.DT_FLOAT16), BlocksCacheKey(2, 0)
        )
    assert _status(exc_info) == LLMStatusCode.LLM_PARAM_INVALID
