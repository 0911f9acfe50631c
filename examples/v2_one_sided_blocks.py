"""v2 (CacheManager) with remote cache access, the HIXL connector's way: both sides register paged KV
memory they own (numpy here; `tensor.data_ptr()` works the same), the Decoder links to the side that
listens and reads blocks one-sided (no round trip to the Prompt), then writes one block back.

    python examples/v2_one_sided_blocks.py
"""

from __future__ import annotations

from multiprocessing.connection import Connection

import numpy as np
from _pair import run_pair

from llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
)

PROMPT_ID, DECODER_ID = 1, 2
PROMPT_IP, PROMPT_PORT = "127.0.0.1", 26002
NUM_LAYERS, NUM_BLOCKS, BLOCK_SHAPE = 4, 32, (16, 8, 128)  # 16 tokens x 8 heads x 128 per block
MODEL_ID = 0


def start(role: LLMRole, cluster_id: int, listen: str | None) -> LLMDataDist:
    dd = LLMDataDist(role, cluster_id)
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    if listen is not None:
        config.listen_ip_info = listen
    dd.init(config.generate_options())
    return dd


def register(dd: LLMDataDist, cluster_id: int) -> tuple[list[np.ndarray], Cache]:
    """One numpy array per tensor (K and V of every layer), registered as a blocks cache."""
    tensors = [np.zeros((NUM_BLOCKS, *BLOCK_SHAPE), dtype=np.float16) for _ in range(2 * NUM_LAYERS)]
    desc = CacheDesc(len(tensors), [NUM_BLOCKS, *BLOCK_SHAPE], DataType.DT_FLOAT16)
    key = BlocksCacheKey(cluster_id, model_id=MODEL_ID)
    cache = dd.cache_manager.register_blocks_cache(desc, [t.ctypes.data for t in tensors], key, True)
    return tensors, cache


def prompt(control: Connection) -> None:
    dd = start(LLMRole.PROMPT, PROMPT_ID, f"{PROMPT_IP}:{PROMPT_PORT}")
    tensors, cache = register(dd, PROMPT_ID)
    for tensor_index, tensor in enumerate(tensors):  # block b of tensor t holds t * 100 + b
        tensor[...] = (tensor_index * 100 + np.arange(NUM_BLOCKS)).reshape(-1, 1, 1, 1)
    control.send("ready")
    control.recv()  # the Decoder is done
    assert np.all(tensors[0][31] == 7), "the Decoder's push did not arrive"
    print("Prompt: block 31 holds what the Decoder pushed")
    dd.cache_manager.unregister_cache(cache.cache_id)
    dd.finalize()


def decoder(control: Connection) -> None:
    dd = start(LLMRole.DECODER, DECODER_ID, None)
    tensors, cache = register(dd, DECODER_ID)
    control.recv()  # the Prompt is ready
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_ID
    cluster.append_local_ip_info(PROMPT_IP, 0)  # v2 needs the local side too
    cluster.append_remote_ip_info(PROMPT_IP, PROMPT_PORT)
    ret, per_cluster = dd.link_clusters([cluster], timeout=5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise SystemExit(f"link_clusters failed: {ret}, {per_cluster}")
    manager = dd.cache_manager
    src_blocks, dst_blocks = [3, 17, 4, 30], [0, 1, 2, 3]  # the request's blocks at the Prompt, and ours
    manager.pull_blocks(BlocksCacheKey(PROMPT_ID, model_id=MODEL_ID), cache, src_blocks, dst_blocks)
    for tensor_index, tensor in enumerate(tensors):
        for src, dst in zip(src_blocks, dst_blocks, strict=True):
            assert np.all(tensor[dst] == tensor_index * 100 + src)
    print(f"Decoder: pulled {len(src_blocks)} blocks of {len(tensors)} tensors, one-sided")
    tensors[0][5] = 7  # and write one block back into the Prompt's block 31 (layer 0's K and V)
    tensors[1][5] = 7
    manager.push_blocks(
        BlocksCacheKey(PROMPT_ID, model_id=MODEL_ID), cache, [5], [31], range(0, 1), range(0, 1)
    )
    dd.unlink_clusters([cluster], timeout=5000)
    control.send("done")
    manager.unregister_cache(cache.cache_id)
    dd.finalize()


if __name__ == "__main__":
    run_pair(prompt, decoder)
