"""`llm.TransferBackend=hixl` under `llm_datadist` and `CacheManager.remap_registered_memory`, as the real
library answers them: init's checks and words, no two-sided links, the listen address kept, one remote ip
a cluster; remap needs something to remap and a link. The data path is the same as without the option."""

from __future__ import annotations

import os

import numpy as np
import pytest

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    MemInfo,
    Memtype,
)
from llm_datadist.ext import local_rank_table

from .._peer import PromptPeer, decoder, pattern

HIXL = {"llm.EnableCacheManager": "1", "llm.TransferBackend": "hixl"}
PROMPT_PORT, DECODER_LISTEN = 26310, "127.0.0.1:26311"


def _code(exc_info: pytest.ExceptionInfo[LLMException]) -> LLMStatusCode:
    return exc_info.value.status_code


@pytest.mark.parametrize(
    ("config", "word"),
    [
        ({"listen_ip_info": "127.0.0.1:26310"}, "llm.EnableCacheManager"),
        (
            {"listen_ip_info": "127.0.0.1:26310", "enable_cache_manager": True},
            "llm.EnableRemoteCacheAccessible",
        ),
        ({"enable_cache_manager": True, "enable_remote_cache_accessible": True}, "llm.listenIpInfo"),
    ],
)
def test_init_needs_what_the_real_one_needs(config: dict[str, object], word: str) -> None:
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.transfer_backend = "hixl"
    llm_config.enable_remote_cache_accessible = False
    for name, value in config.items():
        setattr(llm_config, name, value)
    datadist = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException) as exc_info:
        datadist.init(llm_config.generate_options())
    assert _code(exc_info) == LLMStatusCode.LLM_PARAM_INVALID
    assert word in str(exc_info.value)


def test_no_two_sided_links_and_the_listen_address_stays() -> None:
    with decoder(2, extra={**HIXL, "llm.listenIpInfo": DECODER_LISTEN}) as datadist:
        members = {2: 0, 3: 1}
        for call in (
            lambda: datadist.link("comm", members, local_rank_table(members)),
            lambda: datadist.unlink(1),
            lambda: datadist.query_register_mem_status(1),
            lambda: datadist.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:26312"}),
        ):
            with pytest.raises(LLMException) as exc_info:
                call()
            assert _code(exc_info) == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
        datadist.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": DECODER_LISTEN})
        datadist.switch_role(LLMRole.MIX)  # without an address: it keeps serving init's
        runtime = os.environ["LLM_DATADIST_RUNTIME_DIR"]
        assert os.path.exists(os.path.join(runtime, "127.0.0.1_26311.sock"))


def test_links_reads_writes_and_remap_with_the_backend() -> None:
    seed = 1234
    with (
        PromptPeer(1, PROMPT_PORT, seed, extra=HIXL) as prompt,
        decoder(2, extra={**HIXL, "llm.listenIpInfo": DECODER_LISTEN}) as datadist,
    ):
        manager = datadist.cache_manager
        device = MemInfo(Memtype.MEM_TYPE_DEVICE, 0x1000, 64)
        with pytest.raises(LLMException) as exc_info:
            manager.remap_registered_memory(device)
        assert _code(exc_info) == LLMStatusCode.LLM_NOT_YET_LINK
        with pytest.raises(LLMException) as exc_info:
            manager.remap_registered_memory([])
        assert _code(exc_info) == LLMStatusCode.LLM_PARAM_INVALID
        # The backend links a cluster through one remote address.
        twice = prompt.cluster_info()
        twice.append_remote_ip_info("127.0.0.1", PROMPT_PORT + 1)
        assert datadist.link_clusters([twice]) == (
            LLMStatusCode.LLM_PARAM_INVALID,
            [LLMStatusCode.LLM_PARAM_INVALID],
        )
        assert datadist.link_clusters([prompt.cluster_info()]) == (
            LLMStatusCode.LLM_SUCCESS,
            [LLMStatusCode.LLM_SUCCESS],
        )
        shape = [4, 3, 37]  # 4 blocks of 3 x 37 fp16: odd-sized blocks
        remote_id = prompt.call("v2_register_blocks", (2, shape, 0, True))
        arrays = [np.zeros(int(np.prod(shape)), dtype=np.float16) for _ in range(2)]
        cache = manager.register_blocks_cache(
            CacheDesc(2, shape, DataType.DT_FLOAT16), [a.ctypes.data for a in arrays], BlocksCacheKey(2, 0)
        )
        manager.pull_blocks(BlocksCacheKey(1, 0), cache, [3, 0], [0, 1])
        block = arrays[0].nbytes // 4
        for t, array in enumerate(arrays):
            expected = pattern(seed, remote_id, t, array.nbytes)
            raw = array.view(np.uint8)
            assert np.array_equal(raw[:block], expected[3 * block : 4 * block])
            assert np.array_equal(raw[block : 2 * block], expected[:block])
        manager.push_blocks(BlocksCacheKey(1, 0), cache, [0], [2])
        assert prompt.call("v2_bytes", (remote_id, 1))[2 * block : 3 * block] == arrays[1].tobytes()[:block]
        # With a link, remap answers as the real one: nothing moved here, so nothing to redo.
        manager.remap_registered_memory(device)
        manager.remap_registered_memory([MemInfo(Memtype.MEM_TYPE_DEVICE, cache.tensor_addrs[0], block)])
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        assert datadist.unlink_clusters([info]) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
        manager.unregister_cache(cache.cache_id)
