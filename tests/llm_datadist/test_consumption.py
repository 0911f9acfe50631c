"""A req key is consumed by what pulls that ended well copied, not by what pulls reserved (reference §9.4:
"a key is consumed when successful pulls, whoever made them, have copied every one of its tensors").

Real processes through the public API: the owner (a Prompt) is this process; Decoder A pulls the key by
`CacheKey` and stops itself right after its pin reserved the key's tensors; Decoder B pulls the same slot
whole by `CacheKeyByIdAndIndex` and succeeds; then A fails (an error at that point, or SIGKILL). The key
must stay consumed: a pull by key finds nothing and the owner unbinds it. Through the index (a cache of 4
tensors) and through leases (a cache of more tensors than the index's masks hold), v1 and v2. And the
sibling: B pulls whole while A still pulls one layer; the key stays bound until A ends, and A's failure
gives back nothing.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from llm_datadist import (
    CacheDesc,
    CacheKey,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
)
from tests._fault_peer import FaultPeer, Transfer

OWNER_ID = 1
REQ_ID = 7
LEASED_TENSORS = 514  # more than a key's 512-bit masks: the index cannot publish it, pulls lease
SHAPE = (1, 2048)  # 4 KiB a tensor


def _owner(v2: bool, port: int) -> LLMDataDist:
    datadist = LLMDataDist(LLMRole.PROMPT, OWNER_ID)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = f"127.0.0.1:{port}"
    config.sync_kv_timeout = 20_000
    if v2:
        config.enable_cache_manager = True
        config.mem_pool_cfg = '{"memory_size": 67108864}'
    options = dict(config.generate_options())
    if not v2:
        options.update({"ge.flowGraphMemMaxSize": str(64 << 20), "llm.MemoryUtilization": "1.0"})
    datadist.init(options)
    return datadist


@pytest.fixture
def port(request: pytest.FixtureRequest) -> int:
    return 28000 + (hash(request.node.nodeid) % 900)


def _unbound_soon(owner: LLMDataDist) -> None:
    """The owner unbinds the consumed key at its next look (its server thread, within a second)."""
    table = owner._require_core().table
    deadline = time.monotonic() + 10
    while table.bound((1, REQ_ID, 0)) is not None:
        assert time.monotonic() < deadline, "the owner kept a key that pulls copied whole"
        time.sleep(0.02)


def _pull_by_key_refused(v2: bool, port: int, tensors: int) -> None:
    """A new Decoder's pull of the key: LLM_KV_CACHE_NOT_EXIST."""
    peer = FaultPeer(OWNER_ID, port, Transfer(v2, "pull", tensors, SHAPE, req_id=REQ_ID, point=""))
    try:
        assert peer.expect("linked") == ([int(LLMStatusCode.LLM_SUCCESS)],)
        outcome = peer.expect("done")
        assert outcome[:2] == ("failed", int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)), outcome
    finally:
        peer.close()


def _start(peer: FaultPeer) -> None:
    assert peer.expect("linked") == ([int(LLMStatusCode.LLM_SUCCESS)],)


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("path", ["index", "lease"])
@pytest.mark.parametrize("how", ["fails", "killed"])
def test_a_key_pulled_whole_by_another_pull_stays_consumed(v2: bool, path: str, how: str, port: int) -> None:
    tensors = LEASED_TENSORS if path == "lease" else 4
    owner = _owner(v2, port)
    manager: Any = owner.cache_manager if v2 else owner.kv_cache_manager
    reserving = by_slot = None
    try:
        cache = manager.allocate_cache(
            CacheDesc(tensors, list(SHAPE), DataType.DT_FLOAT16), [CacheKey(OWNER_ID, req_id=REQ_ID)]
        )
        reserving = FaultPeer(
            OWNER_ID,
            port,
            Transfer(v2, "pull", tensors, SHAPE, req_id=REQ_ID, point="pinned", then_fail=how == "fails"),
        )
        _start(reserving)
        assert reserving.expect("at") == ("pinned",)
        reserving.wait_stopped()
        by_slot = FaultPeer(
            OWNER_ID, port, Transfer(v2, "pull_by_id", tensors, SHAPE, cache_id=cache.cache_id, point="")
        )
        _start(by_slot)
        assert by_slot.expect("done")[0] == "ok"
        by_slot.close()
        if how == "killed":
            reserving.kill()
        else:
            reserving.resume()
            outcome = reserving.expect("done")
            assert outcome[:2] == ("failed", int(LLMStatusCode.LLM_FAILED)), outcome
            reserving.close()
        _unbound_soon(owner)
        _pull_by_key_refused(v2, port, tensors)
        manager.deallocate_cache(cache)
    finally:
        for peer in (reserving, by_slot):
            if peer is not None:
                peer.close()
        owner.finalize()


@pytest.mark.parametrize("path", ["index", "lease"])
def test_a_key_stays_bound_while_a_layer_of_it_is_still_pulled(path: str, port: int) -> None:
    """v1: Decoder A pulls layer 0 by key and stops after its pin; B pulls the whole slot by id and ends
    well; the key is gone for new pulls but stays bound while A pulls; A fails and gives back nothing."""
    tensors = LEASED_TENSORS if path == "lease" else 4
    owner = _owner(False, port)
    manager = owner.kv_cache_manager
    layer = by_slot = None
    try:
        cache = manager.allocate_cache(
            CacheDesc(tensors, list(SHAPE), DataType.DT_FLOAT16), [CacheKey(OWNER_ID, req_id=REQ_ID)]
        )
        layer = FaultPeer(
            OWNER_ID,
            port,
            Transfer(False, "pull_layer", tensors, SHAPE, req_id=REQ_ID, point="pinned", then_fail=True),
        )
        _start(layer)
        assert layer.expect("at") == ("pinned",)
        layer.wait_stopped()
        by_slot = FaultPeer(
            OWNER_ID, port, Transfer(False, "pull_by_id", tensors, SHAPE, cache_id=cache.cache_id, point="")
        )
        _start(by_slot)
        assert by_slot.expect("done")[0] == "ok"
        by_slot.close()
        _pull_by_key_refused(False, port, tensors)
        time.sleep(1.0)  # the owner's housekeeping runs meanwhile (twice a second): A's pin keeps the key
        assert owner._require_core().table.bound((1, REQ_ID, 0)) is not None
        layer.resume()
        outcome = layer.expect("done")
        assert outcome[:2] == ("failed", int(LLMStatusCode.LLM_FAILED)), outcome
        _unbound_soon(owner)
        _pull_by_key_refused(False, port, tensors)
        manager.deallocate_cache(cache)
    finally:
        for peer in (layer, by_slot):
            if peer is not None:
                peer.close()
        owner.finalize()


def test_a_failed_pull_of_a_key_nobody_else_pulled_gives_it_back(port: int) -> None:
    """The rule's other side, as before: A reserves the key and fails; nobody else pulled; the key is
    pulled again by key, whole."""
    owner = _owner(False, port)
    manager = owner.kv_cache_manager
    reserving = None
    try:
        cache = manager.allocate_cache(
            CacheDesc(4, list(SHAPE), DataType.DT_FLOAT16), [CacheKey(OWNER_ID, req_id=REQ_ID)]
        )
        reserving = FaultPeer(
            OWNER_ID,
            port,
            Transfer(False, "pull", 4, SHAPE, req_id=REQ_ID, point="copied", then_fail=True),
        )
        _start(reserving)
        assert reserving.expect("at") == ("copied",)
        reserving.wait_stopped()
        reserving.resume()
        assert reserving.expect("done")[:2] == ("failed", int(LLMStatusCode.LLM_FAILED))
        reserving.pipe.send("again")  # the same Decoder pulls it again, with the hook off
        again = reserving.expect("again")
        assert again[0] == "ok", again
        _unbound_soon(owner)
        manager.deallocate_cache(cache)
    finally:
        if reserving is not None:
            reserving.close()
        owner.finalize()
