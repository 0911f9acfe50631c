"""v2 (CacheManager) with a two-sided link, the vllm-ascend LLMDataDistCMgrConnector's way: both sides
register their own paged memory, both call `link` with the same communicator name, members and rank
table, wait until `query_register_mem_status` says OK, and then the Decoder pulls blocks.

    python examples/v2_two_sided.py

On Ascend the rank table is the cluster's HCCL rank table; on one host
`llm_datadist.ext.local_rank_table(members)` builds one (its format is in that function's docstring).
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

import numpy as np
from _pair import run_pair

from llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    RegisterMemStatus,
)
from llm_datadist.ext import local_rank_table

PROMPT_ID, DECODER_ID = 1, 2
MEMBERS = {PROMPT_ID: 0, DECODER_ID: 1}  # cluster id -> rank
COMM_NAME = "pd_comm_127.0.0.1_127.0.0.1"
NUM_LAYERS, NUM_BLOCKS, BLOCK_SHAPE = 4, 32, (16, 8, 128)
MODEL_ID = 0


def start(role: LLMRole, cluster_id: int) -> LLMDataDist:
    dd = LLMDataDist(role, cluster_id)
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.link_total_time = 30  # seconds for every member to come up
    dd.init(config.generate_options())
    return dd


def register(dd: LLMDataDist, cluster_id: int) -> tuple[list[np.ndarray], Cache]:
    tensors = [np.zeros((NUM_BLOCKS, *BLOCK_SHAPE), dtype=np.float16) for _ in range(2 * NUM_LAYERS)]
    desc = CacheDesc(len(tensors), [NUM_BLOCKS, *BLOCK_SHAPE], DataType.DT_FLOAT16)
    key = BlocksCacheKey(cluster_id, model_id=MODEL_ID)
    return tensors, dd.cache_manager.register_blocks_cache(desc, [t.ctypes.data for t in tensors], key)


def link(dd: LLMDataDist) -> int:
    comm_id = dd.link(COMM_NAME, MEMBERS, local_rank_table(MEMBERS))
    deadline = time.monotonic() + 30
    while dd.query_register_mem_status(comm_id) != RegisterMemStatus.OK:
        if time.monotonic() > deadline:
            raise SystemExit("the two-sided link did not come up")
        time.sleep(0.01)
    return comm_id


def prompt(control: Connection) -> None:
    dd = start(LLMRole.PROMPT, PROMPT_ID)
    tensors, cache = register(dd, PROMPT_ID)
    for tensor_index, tensor in enumerate(tensors):
        tensor[...] = (tensor_index * 100 + np.arange(NUM_BLOCKS)).reshape(-1, 1, 1, 1)
    comm_id = link(dd)
    control.recv()  # the Decoder is done
    dd.unlink(comm_id)
    dd.cache_manager.unregister_cache(cache.cache_id)
    dd.finalize()


def decoder(control: Connection) -> None:
    dd = start(LLMRole.DECODER, DECODER_ID)
    tensors, cache = register(dd, DECODER_ID)
    comm_id = link(dd)
    src_blocks, dst_blocks = [9, 2, 25], [0, 1, 2]
    dd.cache_manager.pull_blocks(BlocksCacheKey(PROMPT_ID, model_id=MODEL_ID), cache, src_blocks, dst_blocks)
    for tensor_index, tensor in enumerate(tensors):
        for src, dst in zip(src_blocks, dst_blocks, strict=True):
            assert np.all(tensor[dst] == tensor_index * 100 + src)
    print(f"Decoder: pulled {len(src_blocks)} blocks of {len(tensors)} tensors over a two-sided link")
    dd.unlink(comm_id)
    control.send("done")
    dd.cache_manager.unregister_cache(cache.cache_id)
    dd.finalize()


if __name__ == "__main__":
    run_pair(prompt, decoder)
