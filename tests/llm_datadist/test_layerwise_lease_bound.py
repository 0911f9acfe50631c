"""A layer-wise push (`transfer_cache_async` with `TransferConfig`s, v1 and v2) leases the Decoder's
memory at its first layer. While the Prompt's job waits in the user's `synchronize_layer`, that lease is
kept for at most the Prompt's `sync_kv_timeout`, then released; the next layer leases again. So a
synchronizer that blocks holds none of the Decoder's memory past that bound: the Decoder frees it at once,
and a layer pushed after the memory went fails rather than writing into it. A synchronizer that is merely
slow still delivers every layer."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from llm_datadist import CacheDesc, DataType, LLMStatusCode
from tests._peer import PromptPeer, decoder

P, D = 1, 2
PROMPT_TIMEOUT_MS = 300
SUCCESS = int(LLMStatusCode.LLM_SUCCESS)
SHAPE = [1, 4096]  # one slot of 8 KiB per tensor
LAYERS = 2
_PORTS = itertools.count(1)


def _port() -> int:
    return 30000 + (os.getpid() * 13 + next(_PORTS)) % 20000


def _wait_for(condition: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


@contextlib.contextmanager
def _pair(seed: int, v2: bool) -> Iterator[tuple[PromptPeer, Any]]:
    extra = {"llm.SyncKvCacheWaitTime": str(PROMPT_TIMEOUT_MS)}
    decoder_extra: dict[str, str] = {}
    if v2:
        v2_options = {
            "llm.EnableCacheManager": "1",
            "llm.MemPoolConfig": json.dumps({"memory_size": 16 << 20, "page_shift": 16}),
        }
        extra.update(v2_options)
        decoder_extra.update(v2_options)
    with (
        PromptPeer(P, _port(), seed, extra=extra) as prompt,
        decoder(D, sync_kv_timeout_ms=5000, extra=decoder_extra) as dd,
    ):
        ret, codes = dd.link_clusters([prompt.cluster_info()], timeout=5000)
        assert ret == LLMStatusCode.LLM_SUCCESS and codes == [LLMStatusCode.LLM_SUCCESS]
        yield prompt, dd


def _push(prompt: PromptPeer, cache_id: int, addrs: list[int]) -> int:
    """Start a layer-wise push of slot 0 of every layer to `addrs`, each layer waiting for a token."""
    return int(prompt.call("transfer", (cache_id, [(D, addrs, None, 0)], None, None, None, "queue")))


def _destination(dd: Any, v2: bool) -> tuple[Any, list[int], list[np.ndarray]]:
    """A cache of the Decoder (this process) for the push, zeroed: (cache, its tensor addresses, views)."""
    desc = CacheDesc(2 * LAYERS, SHAPE, DataType.DT_FLOAT16)
    manager = dd.cache_manager if v2 else dd.kv_cache_manager
    cache = manager.allocate_cache(desc)
    addrs = list(cache.tensor_addrs if v2 else cache.per_device_tensor_addrs[0])
    nbytes = SHAPE[1] * 2
    views = [np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(addr)) for addr in addrs]
    for view in views:
        view[:] = 0
    return cache, addrs, views


def _lease_let_go_while_waiting(
    prompt: PromptPeer, dd: Any, source: int, addrs: list[int], views: list[np.ndarray]
) -> int:
    """Start the push, release layer 0, and wait until it landed and then until the Prompt, waiting for
    layer 1 in its synchronizer past its timeout, released the lease it took of our memory. The task."""
    leases = dd._require_core().leases  # the leases our server holds for peers
    task = _push(prompt, source, addrs)
    prompt.release_layer(0)
    for t in (0, 1):
        expected = prompt.expected(source, t, views[t].nbytes)
        _wait_for(lambda: (views[t] == expected).all(), "layer 0 never landed")  # noqa: B023
    _wait_for(lambda: leases.count == 0, "the Decoder's memory stayed leased while the Prompt waited")
    return task


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_memory_freed_while_the_synchronizer_blocks_is_not_written(seed: int, v2: bool) -> None:
    with _pair(seed, v2) as (prompt, dd):
        source = int(
            prompt.call("v2_alloc", (2 * LAYERS, SHAPE, [], None))
            if v2
            else prompt.alloc(2 * LAYERS, SHAPE, [])
        )
        cache, addrs, views = _destination(dd, v2)
        task = _lease_let_go_while_waiting(prompt, dd, source, addrs, views)
        # No lease holds it: the free is at once, and the next layer finds no memory to write.
        (dd.cache_manager if v2 else dd.kv_cache_manager).deallocate_cache(cache)
        prompt.release_layer(1)
        assert prompt.call("task_results", (task, 20000)) == [int(LLMStatusCode.LLM_PARAM_INVALID)]


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_a_slow_synchronizer_still_delivers_every_layer(seed: int, v2: bool) -> None:
    with _pair(seed, v2) as (prompt, dd):
        source = int(
            prompt.call("v2_alloc", (2 * LAYERS, SHAPE, [], None))
            if v2
            else prompt.alloc(2 * LAYERS, SHAPE, [])
        )
        cache, addrs, views = _destination(dd, v2)
        task = _lease_let_go_while_waiting(prompt, dd, source, addrs, views)
        prompt.release_layer(1)  # the next layer leases again
        assert prompt.call("task_results", (task, 20000)) == [SUCCESS]
        for t, view in enumerate(views):
            np.testing.assert_array_equal(view, prompt.expected(source, t, view.nbytes))
        (dd.cache_manager if v2 else dd.kv_cache_manager).deallocate_cache(cache)
