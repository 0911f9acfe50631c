"""A `LayerSynchronizer` whose `synchronize_layer` raises ends the layer-wise push as the real library's
transfer thread ends. v2 (hicann/hixl `v2/llm_utils.py`, 2026: `TransferAsyncThread` keeps the exception):
every config reports the thread's default code, `LLM_TIMEOUT` on the public path, and so does
`synchronize`. v1 (hicann/ge's `llm_utils.py`, whose thread just dies): a config that had finished keeps its
`LLM_SUCCESS`, the others report nothing (None), and `synchronize` reports success, the real quirk. Either
way no later layer is pushed, and a synchronizer that returns False still gives `LLM_PARAM_INVALID`."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from llm_datadist import CacheDesc, DataType, LLMStatusCode
from tests._peer import PromptPeer, decoder

P, D = 1, 2
SHAPE = [1, 256]
NBYTES = 512  # one slot of SHAPE in float16
_PORTS = itertools.count(1)


def _port() -> int:
    return 30000 + (os.getpid() * 17 + next(_PORTS)) % 20000


@contextlib.contextmanager
def _pair(seed: int, v2: bool) -> Iterator[tuple[PromptPeer, Any]]:
    extra: dict[str, str] = {}
    if v2:
        extra = {
            "llm.EnableCacheManager": "1",
            "llm.MemPoolConfig": json.dumps({"memory_size": 16 << 20, "page_shift": 16}),
        }
    with PromptPeer(P, _port(), seed, extra=extra) as prompt, decoder(D, extra=extra) as dd:
        ret, codes = dd.link_clusters([prompt.cluster_info()], timeout=5000)
        assert ret == LLMStatusCode.LLM_SUCCESS and codes == [LLMStatusCode.LLM_SUCCESS]
        yield prompt, dd


def _run(seed: int, v2: bool, mode: str) -> tuple[int, list[int | None], list[bytes]]:
    """Push every layer of a 3-layer cache with a synchronizer in `mode`: (synchronize, results, the bytes
    of each destination tensor afterwards, zero before)."""
    with _pair(seed, v2) as (prompt, dd):
        source = int(prompt.call("v2_alloc", (6, SHAPE, [], None)) if v2 else prompt.alloc(6, SHAPE, []))
        manager = dd.cache_manager if v2 else dd.kv_cache_manager
        dst = manager.allocate_cache(CacheDesc(6, SHAPE, DataType.DT_FLOAT16))
        addrs = list(dst.tensor_addrs if v2 else dst.per_device_tensor_addrs[0])
        for addr in addrs:
            ctypes.memset(addr, 0, NBYTES)
        task = prompt.call("transfer", (source, [(D, addrs, None, 0)], None, None, None, mode))
        status = prompt.call("task_sync", (task, 20000))
        results = prompt.call("task_results", (task, 20000))
        landed = [ctypes.string_at(addr, NBYTES) for addr in addrs]
        manager.deallocate_cache(dst)
        expected = [prompt.expected(source, t, NBYTES).tobytes() for t in range(6)]
        return status, results, [b if b == expected[t] else b"" for t, b in enumerate(landed)]


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_a_synchronizer_that_raises_ends_the_transfer_as_the_real_thread(seed: int, v2: bool) -> None:
    status, results, landed = _run(seed, v2, "raise:1")
    if v2:
        assert (status, results) == (int(LLMStatusCode.LLM_TIMEOUT), [int(LLMStatusCode.LLM_TIMEOUT)])
    else:
        assert (status, results) == (int(LLMStatusCode.LLM_SUCCESS), [None])
    # Layer 0 landed (its tensors hold the source's bytes); nothing after the layer that raised.
    assert [bool(b) for b in landed] == [True, True, False, False, False, False]


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_a_synchronizer_that_says_no_is_still_param_invalid(seed: int, v2: bool) -> None:
    status, results, landed = _run(seed, v2, "fail:1")
    invalid = int(LLMStatusCode.LLM_PARAM_INVALID)
    assert (status, results) == (invalid, [invalid])
    assert [bool(b) for b in landed] == [True, True, False, False, False, False]
