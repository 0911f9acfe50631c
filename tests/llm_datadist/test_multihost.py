"""Across hosts: a Prompt and a Decoder in two network namespaces joined by a veth pair (two "hosts" with
their own addresses), linked over TCP with the shared secret, bytes moved by Mooncake Transfer Engine.
Real processes, real engines; traffic only between the two namespaces. Skipped, with the reason, where
namespaces cannot be made or the `multihost` extra is not installed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from llm_datadist._remote import engine_available
from tests._netns import HostPair, HostProcess, require_netns

SECRET = "test-secret-of-the-multihost-suite"
PORT = 26100
PROMPT_ID, DECODER_ID = 1, 2

# Both hosts: the library, numpy views of caches, and a check that a view holds what the Prompt wrote.
COMMON = """
import time
import numpy as np
from llm_datadist import *
from llm_datadist.ext import tensor_views

def fill(cache, base):
    for t, view in enumerate(tensor_views(cache)):
        flat = view.view(np.uint8).reshape(-1)
        flat[:] = (np.arange(flat.size) * 7 + base + 31 * t) % 251

def expected(base, t, nbytes):
    return ((np.arange(nbytes) * 7 + base + 31 * t) % 251).astype(np.uint8)

def raw(cache):
    return [view.view(np.uint8).reshape(-1) for view in tensor_views(cache)]
"""

V1_PROMPT = """
dd = LLMDataDist(LLMRole.PROMPT, prompt_id)
config = LLMConfig()
config.device_id = 0
config.listen_ip_info = f"{ip}:{port}"
config.sync_kv_timeout = timeout_ms
dd.init(config.generate_options())
kvm = dd.kv_cache_manager
caches = {}
result = None
"""

V1_DECODER = """
dd = LLMDataDist(LLMRole.DECODER, decoder_id)
config = LLMConfig()
config.device_id = 0
config.sync_kv_timeout = timeout_ms
dd.init(config.generate_options())
kvm = dd.kv_cache_manager
cluster = LLMClusterInfo()
cluster.remote_cluster_id = prompt_id
cluster.append_local_ip_info(local_ip, 0)
cluster.append_remote_ip_info(ip, port)
ret, rets = dd.link_clusters([cluster], 5000)
result = (int(ret), [int(code) for code in rets])
"""


def _skip_reason() -> str | None:
    return engine_available()


@pytest.fixture
def pair() -> Iterator[HostPair]:
    require_netns()
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    with HostPair() as made:
        yield made


def _host(pair: HostPair, side: str, secret: str | None = SECRET) -> HostProcess:
    env = {"LLM_DATADIST_SECRET": secret} if secret is not None else {}
    host = pair.host("a" if side == "a" else "b", env=env)
    host.run(COMMON)
    return host


def _v1(pair: HostPair, timeout_ms: int = 5000, **decoder_env: Any) -> tuple[HostProcess, HostProcess]:
    """A v1 Prompt on host a, a Decoder on host b linked to it."""
    prompt = _host(pair, "a")
    prompt.run(V1_PROMPT, ip=pair.ip_a, port=PORT, prompt_id=PROMPT_ID, timeout_ms=timeout_ms)
    decoder = _host(pair, "b")
    linked = decoder.run(
        V1_DECODER,
        ip=pair.ip_a,
        port=PORT,
        local_ip=pair.ip_b,
        prompt_id=PROMPT_ID,
        decoder_id=DECODER_ID,
        timeout_ms=timeout_ms,
    )
    assert linked == (0, [0])
    return prompt, decoder


def test_v1_pull_by_key_whole_by_layer_and_with_offsets(pair: HostPair) -> None:
    prompt, decoder = _v1(pair)
    prompt.run(
        """
desc = CacheDesc(8, [1, 3333], DataType.DT_INT8)
for req_id in (42, 43, 44):
    caches[req_id] = kvm.allocate_cache(desc, [CacheKey(prompt_id, req_id=req_id)])
    fill(caches[req_id], req_id)
""",
        prompt_id=PROMPT_ID,
    )
    result = decoder.run(
        """
desc = CacheDesc(8, [4, 3333], DataType.DT_INT8)
dst = kvm.allocate_cache(desc)
views = [v.reshape(4, 3333) for v in raw(dst)]
kvm.pull_cache(CacheKey(prompt_id, req_id=42), dst, 3)
whole = all(np.array_equal(views[t][3], expected(42, t, 3333)) for t in range(8))
for layer in range(4):  # K and V of one layer per pull
    kvm.pull_cache(CacheKey(prompt_id, req_id=43), dst, 0, src_layer_range=range(layer, layer + 1),
                   dst_layer_range=range(layer, layer + 1))
layers = all(np.array_equal(views[t][0], expected(43, t, 3333)) for t in range(8))
kvm.pull_cache(CacheKey(prompt_id, req_id=44), dst, 1, 1000, src_cache_offset=17, dst_cache_offset=5)
offsets = all(np.array_equal(views[t][1][5:1005], expected(44, t, 3333)[17:1017]) for t in range(8))
try:
    kvm.pull_cache(CacheKey(prompt_id, req_id=42), dst, 2)
    again = "pulled twice"
except LLMException as exc:
    again = exc.status_code.name
result = (whole, layers, offsets, again)
""",
        prompt_id=PROMPT_ID,
    )
    assert result == (True, True, True, "LLM_KV_CACHE_NOT_EXIST")
    # Pulls without offsets consumed their keys; the one with offsets did not (reference §16). No lease
    # is left behind (the Release of the last pull is one way: give it a moment).
    deadline = time.monotonic() + 5
    while (stats := prompt.run("result = dd._require_core().table.stats()"))["leases"] and (
        time.monotonic() < deadline
    ):
        time.sleep(0.02)
    assert (stats["keys"], stats["leases"]) == (1, 0), stats


def test_v1_pull_blocks(pair: HostPair) -> None:
    prompt, decoder = _v1(pair)
    prompt.run(
        """
desc = CacheDesc(4, [40, 2048], DataType.DT_INT8)
caches[0] = kvm.allocate_blocks_cache(desc, BlocksCacheKey(prompt_id, 0))
fill(caches[0], 5)
""",
        prompt_id=PROMPT_ID,
    )
    result = decoder.run(
        """
desc = CacheDesc(4, [16, 2048], DataType.DT_INT8)
dst = kvm.allocate_blocks_cache(desc)
src_blocks, dst_blocks = [39, 3, 4, 5, 17], [0, 7, 8, 9, 15]
kvm.pull_blocks(BlocksCacheKey(prompt_id, 0), dst, src_blocks, dst_blocks)
views = [v.reshape(16, 2048) for v in raw(dst)]
result = all(
    np.array_equal(views[t][d], expected(5, t, 40 * 2048).reshape(40, 2048)[s])
    for t in range(4) for s, d in zip(src_blocks, dst_blocks)
)
""",
        prompt_id=PROMPT_ID,
    )
    assert result is True


def test_v1_layerwise_push(pair: HostPair) -> None:
    prompt, decoder = _v1(pair)
    addrs = decoder.run(
        """
desc = CacheDesc(8, [2, 4097], DataType.DT_INT8)
dst = kvm.allocate_cache(desc)
result = [addr + 4097 for addr in dst.per_device_tensor_addrs[0]]  # into slot 1 of every tensor
""",
    )
    code = prompt.run(
        """
class Go(LayerSynchronizer):
    def synchronize_layer(self, layer_index, timeout_in_millis):
        return True

src = kvm.allocate_cache(CacheDesc(8, [1, 4097], DataType.DT_INT8))
fill(src, 9)
task = kvm.transfer_cache_async(src, Go(), [TransferConfig(decoder_id, addrs, range(0, 4), 0)])
result = int(task.synchronize(10000))
kvm.deallocate_cache(src)
""",
        decoder_id=DECODER_ID,
        addrs=addrs,
    )
    assert code == 0
    result = decoder.run(
        "result = all(np.array_equal(v.reshape(2, 4097)[1], expected(9, t, 4097))"
        " for t, v in enumerate(raw(dst)))"
    )
    assert result is True
