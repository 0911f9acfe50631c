"""An unregister waits for this process's own transfers into or out of that memory, as it waits for peers':
registered memory is the user's the moment the call returns. Each case stops one transfer of the test
process right after it pinned its own memory (the "local" fault point), unregisters that memory from
another thread, and, as a user would, refills the memory the moment the call returns. Then the transfer
goes on. The refill must survive (a pull into it), or the peer must get the bytes that were there before
(a push or write from it); or the unregister gave the timeout code and the memory is still registered.

The siblings: hixl `deregister_mem` under `transfer_async` READ and WRITE; v2 `unregister_cache` under
`pull_blocks` into the memory and `push_blocks` out of it, and under a local `copy_blocks`; an own transfer
held past the timeout (the unregister fails, the transfer still completes, the next unregister succeeds).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import hixl
from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMException,
    LLMStatusCode,
    _faults,
)
from tests._peer import PROMPT_IP, PromptPeer, decoder, pattern
from tests.hixl._local import SERVER, local_engine
from tests.hixl._peer import peer

REFILL = 0x11
WINDOW_S = 0.3  # how long an unregister is given to return early (a fixed one waits much longer)
P = 1  # the Prompt's cluster id
MODEL = 7
_PORTS = itertools.count(1)


def _port() -> int:
    return 30000 + (os.getpid() * 11 + next(_PORTS)) % 20000


class _StopAtLocalPin:
    """The `_faults` hook: the first transfer to pin its own memory waits there until `go`."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()
        self._armed = True
        self._lock = threading.Lock()

    def __call__(self, point: str) -> None:
        if point != "local":
            return
        with self._lock:
            if not self._armed:
                return
            self._armed = False
        self.reached.set()
        assert self.go.wait(30), "the test never let the transfer go on"


@contextlib.contextmanager
def _held() -> Iterator[_StopAtLocalPin]:
    hook = _StopAtLocalPin()
    _faults.hook = hook
    try:
        yield hook
    finally:
        _faults.hook = None
        hook.go.set()


def _unregister_during(
    hook: _StopAtLocalPin, unregister: Callable[[], Any], refill: Callable[[], None], window_s: float
) -> tuple[Any, bool]:
    """Once the transfer waits at its pin: unregister on another thread, refill the memory as soon as that
    returned SUCCESS, and let the transfer go on after `window_s` (or once the unregister returned).
    (the unregister's result, whether it returned before the transfer went on)."""
    assert hook.reached.wait(30), "the transfer never pinned its memory"
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(unregister())
        except LLMException as exc:
            result.append(exc.status_code)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(window_s)
    early = not thread.is_alive()
    if early and result[0] in (hixl.SUCCESS, None):
        refill()  # the memory is the user's: the caller reuses it at once
    hook.go.set()
    thread.join(30)
    assert not thread.is_alive()
    if not early and result[0] in (hixl.SUCCESS, None):
        refill()
    return result[0], early


# ---------------------------------------------------------------------------------------------- hixl

NBYTES = 1 << 20


def _ended(engine: hixl.Hixl, req: int) -> hixl.TransferStatus:
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ret, status = engine.get_transfer_status(req)
        assert ret == hixl.SUCCESS, ret
        if status != hixl.TransferStatus.WAITING:
            return status
        time.sleep(0.002)
    raise AssertionError(f"request {req} did not end")


@pytest.mark.parametrize("op", ["read", "write"])
def test_deregister_mem_waits_for_this_engines_transfer_async(op: str) -> None:
    with peer() as remote, local_engine() as local:
        assert remote("initialize", SERVER, {}) == hixl.SUCCESS
        there = remote("alloc", NBYTES, 5)
        assert remote("register_mem", (there, NBYTES), int(hixl.MEM_HOST))[0] == hixl.SUCCESS
        here, handle = local.register(NBYTES, seed=6)
        before_here = ctypes.string_at(here, NBYTES)
        assert local.engine.connect(SERVER, 5000) == hixl.SUCCESS
        with _held() as hook:
            kind = hixl.READ if op == "read" else hixl.WRITE
            ret, req = local.engine.transfer_async(SERVER, kind, [hixl.TransferOpDesc(here, there, NBYTES)])
            assert ret == hixl.SUCCESS
            code, _ = _unregister_during(
                hook,
                lambda: local.engine.deregister_mem(handle),
                lambda: ctypes.memset(here, REFILL, NBYTES),
                window_s=0.2,  # the engine waits 1 s
            )
            status = _ended(local.engine, req)
        assert status == hixl.TransferStatus.COMPLETED
        if code == hixl.SUCCESS:
            assert ctypes.string_at(here, NBYTES) == bytes([REFILL]) * NBYTES
        else:
            # It gave up waiting: the memory stayed registered, and goes now that the transfer ended.
            assert code == hixl.TIMEOUT, code
            assert local.engine.deregister_mem(handle) == hixl.SUCCESS
        if op == "write":
            # The peer got the bytes the memory held while it was registered, not the refill.
            assert remote("read", there, NBYTES) == before_here


# ------------------------------------------------------------------------------------------------ v2

SHAPE = [8, 4096]  # 8 blocks of 8 KiB
NUM_TENSORS = 2


def _v2_prompt_extra(timeout_ms: int) -> dict[str, str]:
    return {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.MemPoolConfig": json.dumps({"memory_size": 16 << 20, "page_shift": 16}),
        "llm.SyncKvCacheWaitTime": str(timeout_ms),
    }


@contextlib.contextmanager
def _v2_pair(seed: int, port: int, timeout_ms: int) -> Iterator[tuple[PromptPeer, Any, int]]:
    """A v2 Prompt with a registered blocks cache under `MODEL`, and a linked v2 Decoder in this process:
    (prompt, decoder's cache manager, the prompt's cache id)."""
    extra = _v2_prompt_extra(timeout_ms)
    with PromptPeer(P, port, seed, extra=extra) as prompt:
        cache_id = prompt.call("v2_register_blocks", (NUM_TENSORS, SHAPE, MODEL, True))
        with decoder(sync_kv_timeout_ms=timeout_ms, extra=extra) as dd:
            info = prompt.cluster_info()
            info.append_local_ip_info(PROMPT_IP, 0)
            ret, codes = dd.link_clusters([info], timeout=5000)
            assert ret == LLMStatusCode.LLM_SUCCESS and codes == [LLMStatusCode.LLM_SUCCESS]
            yield prompt, dd.cache_manager, cache_id


def _registered(manager: Any, fill: int) -> tuple[Any, list[np.ndarray]]:
    arrays = [np.full(int(np.prod(SHAPE)) * 2, fill, dtype=np.uint8) for _ in range(NUM_TENSORS)]
    desc = CacheDesc(NUM_TENSORS, list(SHAPE), DataType.DT_FLOAT16)
    cache = manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays])
    return cache, arrays


def _in_thread(work: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def _refill(arrays: list[np.ndarray]) -> Callable[[], None]:
    def refill() -> None:
        for array in arrays:
            array[:] = REFILL

    return refill


def test_unregister_cache_waits_for_this_process_pull_into_the_memory(seed: int) -> None:
    with _v2_pair(seed, _port(), 5000) as (_, manager, _), _held() as hook:
        cache, arrays = _registered(manager, 0)
        blocks = list(range(SHAPE[0]))
        thread, errors = _in_thread(
            lambda: manager.pull_blocks(BlocksCacheKey(P, MODEL), cache, blocks, blocks)
        )
        code, early = _unregister_during(
            hook, lambda: manager.unregister_cache(cache.cache_id), _refill(arrays), WINDOW_S
        )
        thread.join(30)
        assert not thread.is_alive() and not errors, errors
        assert (code, early) == (None, False)
        assert all((array == REFILL).all() for array in arrays)


def test_unregister_cache_waits_for_this_process_push_out_of_the_memory(seed: int) -> None:
    with _v2_pair(seed, _port(), 5000) as (prompt, manager, remote_id), _held() as hook:
        cache, arrays = _registered(manager, 0x5A)
        blocks = list(range(SHAPE[0]))
        thread, errors = _in_thread(
            lambda: manager.push_blocks(BlocksCacheKey(P, MODEL), cache, blocks, blocks)
        )
        code, early = _unregister_during(
            hook, lambda: manager.unregister_cache(cache.cache_id), _refill(arrays), WINDOW_S
        )
        thread.join(30)
        assert not thread.is_alive() and not errors, errors
        assert (code, early) == (None, False)
        for t in range(NUM_TENSORS):
            got = prompt.call("v2_bytes", (remote_id, t))
            assert bytes(got) == bytes([0x5A]) * len(got)


def test_unregister_cache_waits_for_this_process_local_copy(seed: int) -> None:
    with _v2_pair(seed, _port(), 5000) as (_, manager, _), _held() as hook:
        cache, arrays = _registered(manager, 0x77)
        thread, errors = _in_thread(lambda: manager.copy_blocks(cache, {0: [1, 2]}))
        code, early = _unregister_during(
            hook, lambda: manager.unregister_cache(cache.cache_id), _refill(arrays), WINDOW_S
        )
        thread.join(30)
        assert not thread.is_alive() and not errors, errors
        assert (code, early) == (None, False)
        assert all((array == REFILL).all() for array in arrays)


def test_an_own_transfer_held_past_the_timeout_fails_the_unregister_not_the_transfer(seed: int) -> None:
    with _v2_pair(seed, _port(), 300) as (_, manager, remote_id), _held() as hook:
        cache, arrays = _registered(manager, 0)
        blocks = list(range(SHAPE[0]))
        thread, errors = _in_thread(
            lambda: manager.pull_blocks(BlocksCacheKey(P, MODEL), cache, blocks, blocks)
        )
        assert hook.reached.wait(30)
        with pytest.raises(LLMException) as exc_info:
            manager.unregister_cache(cache.cache_id)
        assert exc_info.value.status_code == LLMStatusCode.LLM_TIMEOUT
        hook.go.set()
        thread.join(30)
        assert not thread.is_alive() and not errors, errors
        for t, array in enumerate(arrays):
            assert array.tobytes() == pattern(seed, remote_id, t, array.nbytes).tobytes()
        manager.unregister_cache(cache.cache_id)
