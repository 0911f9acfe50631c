"""v1 (KvCacheManager): the Prompt allocates two requests' KV cache under keys; the Decoder links and pulls
one whole into slot 3 of its batch, and the other layer by layer into slot 0.

    python examples/v1_pull.py

The Prompt must stay initialised while anyone pulls from it: `finalize` (or the process ending) frees its
caches, so it waits here for the Decoder's "done".
"""

from __future__ import annotations

from multiprocessing.connection import Connection

import numpy as np
from _pair import run_pair

from llm_datadist import (
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

PROMPT_ID, DECODER_ID = 1, 2
PROMPT_IP, PROMPT_PORT = "127.0.0.1", 26000
NUM_LAYERS = 4  # each layer has a K and a V tensor
TOKENS, KV_HEADS, HEAD_DIM = 256, 8, 128


def prompt(control: Connection) -> None:
    dd = LLMDataDist(LLMRole.PROMPT, PROMPT_ID)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = f"{PROMPT_IP}:{PROMPT_PORT}"  # where Decoders link to
    dd.init(config.generate_options())
    kvm = dd.kv_cache_manager
    desc = CacheDesc(2 * NUM_LAYERS, [1, TOKENS, KV_HEADS, HEAD_DIM], DataType.DT_FLOAT16)
    caches = []
    for req_id in (42, 43):
        cache = kvm.allocate_cache(desc, [CacheKey(PROMPT_ID, req_id=req_id)])
        for tensor_index, tensor in enumerate(tensor_views(cache)):  # "prefill": tensor t of request r
            tensor[...] = req_id * 100 + tensor_index
        caches.append(cache)
    control.send("ready")
    control.recv()  # the Decoder is done
    for cache in caches:
        kvm.deallocate_cache(cache)
    dd.finalize()


def decoder(control: Connection) -> None:
    dd = LLMDataDist(LLMRole.DECODER, DECODER_ID)
    config = LLMConfig()
    config.device_id = 0
    dd.init(config.generate_options())
    control.recv()  # the Prompt is ready
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_ID
    cluster.append_remote_ip_info(PROMPT_IP, PROMPT_PORT)
    ret, per_cluster = dd.link_clusters([cluster], timeout=5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise SystemExit(f"link_clusters failed: {ret}, {per_cluster}")
    kvm = dd.kv_cache_manager
    # A batch of 4 slots, each the size of one request's slot at the Prompt.
    dst = kvm.allocate_cache(CacheDesc(2 * NUM_LAYERS, [4, TOKENS, KV_HEADS, HEAD_DIM], DataType.DT_FLOAT16))

    kvm.pull_cache(CacheKey(PROMPT_ID, req_id=42), dst, batch_index=3)
    for layer in range(NUM_LAYERS):  # layer by layer, as a decoder overlapping transfer with compute would
        one = range(layer, layer + 1)
        kvm.pull_cache(CacheKey(PROMPT_ID, req_id=43), dst, 0, src_layer_range=one, dst_layer_range=one)

    tensors = tensor_views(dst)
    for tensor_index, tensor in enumerate(tensors):
        assert np.all(tensor[3] == 4200 + tensor_index) and np.all(tensor[0] == 4300 + tensor_index)
    print(f"Decoder: pulled 2 requests x {len(tensors)} tensors, every byte as the Prompt wrote it")

    try:  # a pull consumes its key at the Prompt: a second one finds nothing
        kvm.pull_cache(CacheKey(PROMPT_ID, req_id=42), dst, batch_index=1)
    except LLMException as error:
        assert error.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        print(f"Decoder: pulling req_id 42 again: {error.status_code.name}")

    kvm.deallocate_cache(dst)
    dd.unlink_clusters([cluster], timeout=5000)
    dd.finalize()
    control.send("done")


if __name__ == "__main__":
    run_pair(prompt, decoder)
