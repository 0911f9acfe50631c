"""One error model: every public method of both generations, on the owner and on a puller, raises only
the documented types (LLMException with a status code, TypeError, ValueError, RuntimeError), while a
stopped process holds the owner's index lock and while the owner's index holds garbage; a call that failed
leaves its object usable, and once the lock is back (or the index repaired) the same calls work again."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llm_datadist import (
    BlocksCacheKey,
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
from tests._api_driver import ApiDriver
from tests._peer import start_index_holder

OWNER_ID = 1
ALLOWED = (LLMException, TypeError, ValueError, RuntimeError)
DESC = CacheDesc(2, [1, 32], DataType.DT_FLOAT16)
BLOCKS = CacheDesc(2, [4, 32], DataType.DT_FLOAT16)


@pytest.fixture(params=[False, True], ids=["v1", "v2"])
def owner(request: pytest.FixtureRequest) -> Iterator[tuple[LLMDataDist, int, bool]]:
    v2 = request.param
    port = 29000 + (hash(request.node.nodeid) % 900)
    datadist = LLMDataDist(LLMRole.PROMPT, OWNER_ID)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = f"127.0.0.1:{port}"
    config.sync_kv_timeout = 300  # the owner's calls wait this long for the index lock
    if v2:
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = True
        config.mem_pool_cfg = '{"memory_size": 16777216}'
    datadist.init(config.generate_options())
    manager: Any = datadist.cache_manager if v2 else datadist.kv_cache_manager
    # Held here: a v1 KvCache deallocates itself when its last reference goes.
    caches = [
        manager.allocate_cache(DESC, [CacheKey(OWNER_ID, req_id=7)]),  # cache id 1
        manager.allocate_blocks_cache(BLOCKS, BlocksCacheKey(OWNER_ID, 3)),
    ]
    try:
        yield datadist, port, v2
    finally:
        caches.clear()
        datadist.finalize()


class _Kept:
    """What the owner's calls made: pool caches, registered caches, and the memory under the latter."""

    def __init__(self) -> None:
        self.pool: list[Any] = []
        self.registered: list[Any] = []
        self.arrays = [np.zeros(64, dtype=np.float16) for _ in range(2)]


def _owner_calls(datadist: LLMDataDist, v2: bool, kept: _Kept) -> list[tuple[str, Callable[[], Any]]]:
    """Every public method of the owner's manager and front end that touches its table."""
    addrs = [int(a.ctypes.data) for a in kept.arrays]
    info = LLMClusterInfo()
    info.remote_cluster_id = 2
    m: Any = datadist.cache_manager if v2 else datadist.kv_cache_manager
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("allocate_cache", lambda: kept.pool.append(m.allocate_cache(DESC, [CacheKey(OWNER_ID, req_id=8)]))),
        (
            "allocate_blocks_cache",
            lambda: kept.pool.append(m.allocate_blocks_cache(BLOCKS, BlocksCacheKey(OWNER_ID, 4))),
        ),
        ("remove_cache_key", lambda: m.remove_cache_key(CacheKey(OWNER_ID, req_id=8))),
        ("copy_cache", lambda: kept.pool.extend(_copied(m))),
    ]
    if v2:
        calls += [
            ("register_cache", lambda: kept.registered.append(m.register_cache(DESC, addrs))),
            ("unregister_cache", lambda: _each(kept.registered, lambda c: m.unregister_cache(c.cache_id))),
            ("unlink_clusters", lambda: datadist.unlink_clusters([info])),
        ]
    calls.append(("deallocate_cache", lambda: _each(kept.pool, _dealloc(m, v2))))
    return calls


def _copied(manager: Any) -> list[Any]:
    caches = [manager.allocate_cache(DESC) for _ in range(2)]
    manager.copy_cache(caches[0], caches[1])
    return caches


def _dealloc(manager: Any, v2: bool) -> Callable[[Any], None]:
    def dealloc(cache: Any) -> None:
        if v2 and cache.is_blocks_cache:
            manager.deallocate_blocks_cache(cache)
        else:
            manager.deallocate_cache(cache)

    return dealloc


def _each(caches: list[Any], call: Callable[[Any], None]) -> None:
    """`call` on each cache; a cache whose call failed stays in the list (for the retry)."""
    for cache in list(caches):
        call(cache)
        caches.remove(cache)


def _outcomes(calls: list[tuple[str, Callable[[], Any]]]) -> dict[str, BaseException | None]:
    outcomes: dict[str, BaseException | None] = {}
    for name, call in calls:
        try:
            call()
            outcomes[name] = None
        except BaseException as exc:
            outcomes[name] = exc
    return outcomes


def _documented(outcomes: dict[str, Any]) -> None:
    wrong = {
        name: repr(exc) for name, exc in outcomes.items() if exc is not None and not isinstance(exc, ALLOWED)
    }
    assert not wrong, f"undocumented exception types: {wrong}"


def _driver_documented(results: list[tuple[str, tuple[Any, ...]]]) -> None:
    wrong = {
        name: outcome
        for name, outcome in results
        if outcome[0] not in ("ok", "LLMException", "TypeError", "ValueError", "RuntimeError")
    }
    assert not wrong, f"undocumented exception types at the puller: {wrong}"


def test_under_a_held_lock(owner: tuple[LLMDataDist, int, bool], _runtime_dir: Path) -> None:
    datadist, port, v2 = owner
    driver = ApiDriver(v2, OWNER_ID, port)
    kept = _Kept()
    try:
        assert driver.link_codes == [int(LLMStatusCode.LLM_SUCCESS)]
        holder, pipe = start_index_holder(
            os.fspath(_runtime_dir / f"127.0.0.1_{port}.sock"), OWNER_ID, "lock"
        )
        try:
            results = driver.run()
            _driver_documented(results)
            by_name = dict(results)
            timeout = int(LLMStatusCode.LLM_TIMEOUT if v2 else LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT)
            pull = by_name["pull_cache by id" if v2 else "pull_cache by key"]
            assert pull[:2] == ("LLMException", timeout), pull
            outcomes = _outcomes(_owner_calls(datadist, v2, kept))
            _documented(outcomes)
            assert isinstance(outcomes["allocate_cache"], LLMException)
            assert outcomes["allocate_cache"].status_code == LLMStatusCode.LLM_TIMEOUT
        finally:
            os.kill(holder.pid, signal.SIGKILL)
            holder.join(10)
            pipe.close()
        # The lock is back: the same calls work (those that failed included), and nothing is left over.
        again = _outcomes(_owner_calls(datadist, v2, kept))
        assert all(exc is None for exc in again.values()), again
        assert not kept.pool and not kept.registered
        results = dict(driver.run())
        assert results["pull_cache by id" if v2 else "pull_cache by key"] == ("ok",), results
    finally:
        driver.close()


def _scribble(datadist: LLMDataDist, rng: random.Random) -> None:
    """Random bytes into every region of the owner's index, as a stray writer of our uid could."""
    index = datadist._require_core().table.index
    path = f"/dev/shm/{index.name[1:]}"
    regions = [
        (0, 4096),
        (4096, index._caches_offset),
        (index._caches_offset, index._names_offset),
        (index._names_offset, index._buckets_offset),
        (index._buckets_offset, index._addrs_offset),
        (index._addrs_offset, index.nbytes),
    ]
    with open(path, "r+b") as raw:
        for start, end in regions:
            for _ in range(4):
                # Where something lives: the first pages of each region hold what is in use.
                at = rng.randrange(start, min(end, start + 8192) - 8)
                raw.seek(at)
                raw.write(rng.randbytes(rng.choice((1, 4, 8))))


def test_with_garbage_in_the_index(owner: tuple[LLMDataDist, int, bool], seed: int) -> None:
    datadist, port, v2 = owner
    rng = random.Random(seed)
    driver = ApiDriver(v2, OWNER_ID, port)
    kept = _Kept()
    try:
        _scribble(datadist, rng)
        _driver_documented(driver.run())
        _documented(_outcomes(_owner_calls(datadist, v2, kept)))
        table = datadist._require_core().table
        for _ in range(4):
            table.sync()  # housekeeping: the audit finds the garbage and repairs it
        assert not table.index.audit()
        # Everything the owner published is found again: the key (unless a pull consumed it) and blocks.
        results = dict(driver.run())
        _driver_documented(list(results.items()))
        assert results["pull_blocks"] == ("ok",), results
    finally:
        driver.close()
