"""v1 layer-wise push: while the Prompt "computes" layer after layer, `transfer_cache_async` sends each
finished layer's K and V into the Decoder's cache, so the transfer overlaps the compute.

    python examples/v1_layerwise_push.py

The Decoder links to the Prompt, then tells it (over the pipe that stands in for your scheduler) where its
K and V tensors are: `TransferConfig` takes raw destination addresses, two per layer.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

import numpy as np
from _pair import run_pair

from llm_datadist import (
    CacheDesc,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    TransferConfig,
)
from llm_datadist.ext import tensor_views

PROMPT_ID, DECODER_ID = 1, 2
PROMPT_IP, PROMPT_PORT = "127.0.0.1", 26001
NUM_LAYERS = 8
DESC = CacheDesc(2 * NUM_LAYERS, [1, 512, 8, 128], DataType.DT_FLOAT16)


class Model(LayerSynchronizer):
    """The layer synchronizer: `transfer_cache_async` asks it, layer by layer, when a layer is ready."""

    def __init__(self, tensors: list[np.ndarray]) -> None:
        self.tensors = tensors

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        time.sleep(0.01)  # the forward pass of this layer...
        self.tensors[2 * layer_index][...] = 1000 + layer_index  # ...writes its K
        self.tensors[2 * layer_index + 1][...] = 2000 + layer_index  # ...and its V
        return True  # False would fail this layer (and the layers after it)


def prompt(control: Connection) -> None:
    dd = LLMDataDist(LLMRole.PROMPT, PROMPT_ID)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = f"{PROMPT_IP}:{PROMPT_PORT}"
    dd.init(config.generate_options())
    kvm = dd.kv_cache_manager
    cache = kvm.allocate_cache(DESC)
    control.send("ready")
    dst_addrs = control.recv()  # the Decoder linked and says where to write
    task = kvm.transfer_cache_async(
        cache, Model(tensor_views(cache)), [TransferConfig(DECODER_ID, dst_addrs)]
    )
    status = task.synchronize(timeout_in_millis=10000)
    results = task.get_results(timeout_in_millis=10000)
    print(f"Prompt: transfer {status.name}, per destination {[r.name for r in results]}")
    control.send(status == LLMStatusCode.LLM_SUCCESS)
    control.recv()  # the Decoder checked the bytes
    kvm.deallocate_cache(cache)
    dd.finalize()


def decoder(control: Connection) -> None:
    dd = LLMDataDist(LLMRole.DECODER, DECODER_ID)
    config = LLMConfig()
    config.device_id = 0
    dd.init(config.generate_options())
    kvm = dd.kv_cache_manager
    dst = kvm.allocate_cache(DESC)
    control.recv()  # the Prompt is ready
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_ID
    cluster.append_remote_ip_info(PROMPT_IP, PROMPT_PORT)
    ret, per_cluster = dd.link_clusters([cluster], timeout=5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise SystemExit(f"link_clusters failed: {ret}, {per_cluster}")
    control.send(dst.per_device_tensor_addrs[0])  # K0, V0, K1, V1, ...: two addresses per layer
    if not control.recv():
        raise SystemExit("the Prompt's transfer failed")
    tensors = tensor_views(dst)
    for layer in range(NUM_LAYERS):
        assert np.all(tensors[2 * layer] == 1000 + layer) and np.all(tensors[2 * layer + 1] == 2000 + layer)
    print(f"Decoder: {NUM_LAYERS} layers arrived, every byte as the Prompt computed it")
    control.send("done")
    kvm.deallocate_cache(dst)
    dd.unlink_clusters([cluster], timeout=5000)
    dd.finalize()


if __name__ == "__main__":
    run_pair(prompt, decoder)
