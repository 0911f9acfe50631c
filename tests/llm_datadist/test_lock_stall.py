"""A process stopped while it holds an owner's index lock: the owner's server thread keeps answering other
peers at once, requests that need the lock wait in their connection's queue and are served once it is free,
a connection that ends meanwhile loses nothing (its lease ends when the lock comes back, the key it took is
given back and visible in the index again), and the owner's own calls fail with LLM_TIMEOUT leaving their
object usable for a retry. The owner is this process; the holders are spawned processes."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llm_datadist import (
    CacheDesc,
    CacheKey,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)
from llm_datadist._protocol.messages import KEY_REQ, RULES_V1, Location, Ping, PinRequest, Release
from llm_datadist._shm.index import Index
from llm_datadist._shm.index_layout import KIND_REQ
from llm_datadist._wire.client import ClientLink
from tests._peer import start_index_holder, start_lease_holder

OWNER_ID = 1


@pytest.fixture
def owner(request: pytest.FixtureRequest) -> Iterator[tuple[LLMDataDist, int]]:
    port = 28000 + (hash(request.node.nodeid) % 900)
    datadist = LLMDataDist(LLMRole.PROMPT, OWNER_ID)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = f"127.0.0.1:{port}"
    config.sync_kv_timeout = 2000
    datadist.init(config.generate_options())
    try:
        yield datadist, port
    finally:
        datadist.finalize()


def _socket(runtime: Path, port: int) -> str:
    return os.fspath(runtime / f"127.0.0.1_{port}.sock")


def _link(path: str) -> ClientLink:
    return ClientLink.connect(
        Path(path), cluster_id=77, remote_cluster_id=OWNER_ID, role=2, deadline=time.monotonic() + 10
    )


def _kill(process: object) -> None:
    pid = process.pid  # type: ignore[attr-defined]
    os.kill(pid, signal.SIGKILL)
    process.join(10)  # type: ignore[attr-defined]


def _key_in_index(datadist: LLMDataDist, req_id: int) -> int | None:
    """The unpulled mask of the key as a puller sees it in the owner's index (None: not found)."""
    core = datadist._require_core()
    index = Index.attach(core.table.index.name, pid=os.getpid(), incarnation=core.incarnation)
    try:
        with index.locked(5.0):
            name = index.lookup(KIND_REQ, req_id, 0)
            return None if name is None else name.mask
    finally:
        index.close()


def test_the_server_answers_and_loses_nothing_while_a_stopped_process_holds_the_lock(
    owner: tuple[LLMDataDist, int], _runtime_dir: Path
) -> None:
    datadist, port = owner
    manager = datadist.kv_cache_manager
    cache = manager.allocate_cache(CacheDesc(2, [1, 32], DataType.DT_FLOAT16), [CacheKey(OWNER_ID, req_id=5)])
    path = _socket(_runtime_dir, port)
    # A peer takes a lease on the key (by message), then the lock holder stops with the lock.
    leaser = start_lease_holder(path, OWNER_ID, 5)
    assert _key_in_index(datadist, 5) is None  # the lease consumed it
    locker, pipe = start_index_holder(path, OWNER_ID, "lock")
    asker = _link(path)
    try:
        # Another peer's Ping: answered at once, not after the owner's 5 s lock timeout.
        other = _link(path)
        started = time.monotonic()
        seq = other.next_seq()
        other.request(Ping(seq), seq, started + 10)
        assert time.monotonic() - started < 1.0
        other.close(say_bye=True)
        # The lease holder dies during the stall: its connection ends, its lease must end later.
        _kill(leaser)
        # A request that needs the lock waits in its queue (no error, no five-second stall of the server).
        seq = asker.next_seq()
        request = PinRequest(seq, KEY_REQ, 5, 0, 0, 0, 2, True, 64, 0, True, False, RULES_V1)
        # The owner's own call: LLM_TIMEOUT after its 5 s, and the cache stays usable.
        with pytest.raises(LLMException) as exc_info:
            manager.deallocate_cache(cache)
        assert exc_info.value.status_code == LLMStatusCode.LLM_TIMEOUT
        assert cache._is_valid
        # Now the lock comes back: the parked request is answered, the dead peer's lease ended and gave the
        # key back (visible in the index), and the retried deallocate frees.
        _kill(locker)
        pipe.close()
        grant = asker.request(request, seq, time.monotonic() + 10)
        assert isinstance(grant, Location)
        asker.send_only(Release(grant.lease_id, False), time.monotonic() + 5)  # give it back unused
        deadline = time.monotonic() + 10
        while _key_in_index(datadist, 5) != 0b11:
            assert time.monotonic() < deadline, "the key of the dead peer's lease did not come back"
            time.sleep(0.02)
        manager.remove_cache_key(CacheKey(OWNER_ID, req_id=5))
        manager.deallocate_cache(cache)
        leases = datadist._require_core().leases
        deadline = time.monotonic() + 10
        while leases.stats() != {"caches": 0, "keys": 0, "leases": 0, "pins": 0, "pool_used_nbytes": 0}:
            assert time.monotonic() < deadline, leases.stats()
            time.sleep(0.02)
    finally:
        asker.close(say_bye=True)
        for process in (leaser, locker):
            if process.is_alive():
                _kill(process)


def test_a_finalizer_deallocation_waits_for_the_lock_instead_of_leaking(
    owner: tuple[LLMDataDist, int], _runtime_dir: Path
) -> None:
    """A KvCache dropped (its finalizer deallocates) while the lock is held elsewhere is freed once the
    lock comes back, not leaked until finalize."""
    datadist, port = owner
    manager = datadist.kv_cache_manager
    cache = manager.allocate_cache(CacheDesc(2, [1, 32], DataType.DT_FLOAT16))
    table = datadist._require_core().table
    locker, pipe = start_index_holder(_socket(_runtime_dir, port), OWNER_ID, "lock")
    try:
        del cache  # its finalizer cannot get the lock now
        assert table.get(1) is not None  # not freed yet
    finally:
        _kill(locker)
        pipe.close()
    deadline = time.monotonic() + 10
    leases = datadist._require_core().leases
    while leases.stats()["pool_used_nbytes"] or table.get(1) is not None:
        assert time.monotonic() < deadline, "a finalizer's deallocation was lost"
        time.sleep(0.02)
