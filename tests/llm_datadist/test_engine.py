"""The cache table on its own (real pool, real shared memory, no sockets): key binding, leases, key
consumption and the deferred free."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llm_datadist._errors import StatusError
from llm_datadist._keys import KEY_CACHE_ID, KEY_PREFIX, KEY_REQ
from llm_datadist._owner.leases import Leases
from llm_datadist._owner.table import CacheTable
from llm_datadist._protocol.messages import RULES_V1, Location, PinRequest
from llm_datadist._shm.pool import Pool
from llm_datadist.status import LLMStatusCode


@pytest.fixture
def table() -> Iterator[CacheTable]:
    t = CacheTable({1: Pool(capacity_nbytes=1 << 20)}, oom_code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY)
    yield t
    t.close()


@pytest.fixture
def leases(table: CacheTable) -> Iterator[Leases]:
    book = Leases(table)
    yield book
    book.close()


def _resolve(leases: Leases, kind: int, ident: int, owner: object, **overrides: object) -> Location:
    args: dict[str, object] = {
        "seq": 1,
        "key_kind": kind,
        "key_id": ident,
        "model_id": 0,
        "batch_index": 0,
        "tensor_start": 0,
        "tensor_count": 4,
        "whole": True,
        "nbytes": 100,
        "src_offset": 0,
        "consume": True,
        "for_write": False,
        "rules": RULES_V1,
    }
    args.update(overrides)
    return leases.resolve(PinRequest(**args), owner)  # type: ignore[arg-type]


def _pulled_from(grant: Location, src_offset: int) -> tuple[int, ...]:
    """Where a v1 pull of a key reads each tensor (the puller adds the slot and the offset)."""
    return tuple(base + grant.slot * grant.unit_nbytes + src_offset for base in grant.tensor_bases)


def test_keys_bind_slots_and_grants_point_at_them(table: CacheTable, leases: Leases) -> None:
    record = table.allocate(
        num_tensors=4, tensor_nbytes=300, batch_size=3, keys=[(KEY_REQ, 1, 0), None, (KEY_REQ, 2, 0)]
    )
    assert record.cache_id == 1 and record.slot_nbytes == 100
    grant = _resolve(leases, KEY_REQ, 2, owner="a", src_offset=7, nbytes=93)
    assert (grant.slot, grant.unit_nbytes) == (2, 100)
    assert _pulled_from(grant, 7) == tuple(record.tensor_offset(t) + 2 * 100 + 7 for t in range(4))
    assert grant.segment == record.block.segment.name
    leases.release(grant.lease_id, ok=True, owner="a")
    assert table.bound((KEY_REQ, 2, 0)) is None and table.bound((KEY_REQ, 1, 0)) is not None


def test_duplicate_keys_last_wins_and_bound_keys_are_refused(table: CacheTable, leases: Leases) -> None:
    record = table.allocate(
        num_tensors=1, tensor_nbytes=20, batch_size=2, keys=[(KEY_REQ, 1, 0), (KEY_REQ, 1, 0)]
    )
    grant = _resolve(leases, KEY_REQ, 1, owner="a", tensor_count=1, nbytes=10, consume=False)
    assert _pulled_from(grant, 0) == (record.tensor_offset(0) + 10,)
    with pytest.raises(StatusError) as exc_info:
        table.allocate(num_tensors=1, tensor_nbytes=20, batch_size=1, keys=[(KEY_REQ, 1, 0)])
    assert exc_info.value.code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(StatusError):
        table.allocate(num_tensors=1, tensor_nbytes=20, batch_size=1, keys=[(KEY_REQ, 5, 0), (KEY_REQ, 6, 0)])


def test_partial_pulls_consume_the_key_once_every_tensor_was_pulled(
    table: CacheTable, leases: Leases
) -> None:
    table.allocate(num_tensors=4, tensor_nbytes=100, batch_size=1, keys=[(KEY_REQ, 1, 0)])
    for _ in range(2):  # pulling the same tensors twice does not count twice
        grant = _resolve(leases, KEY_REQ, 1, "a", tensor_start=2, tensor_count=2, whole=False)
        leases.release(grant.lease_id, ok=True, owner="a")
        assert table.bound((KEY_REQ, 1, 0)) is not None
    grant = _resolve(leases, KEY_REQ, 1, "a", tensor_start=0, tensor_count=2, whole=False)
    leases.release(grant.lease_id, ok=True, owner="a")
    assert table.bound((KEY_REQ, 1, 0)) is None


def test_failed_or_unconsuming_pulls_keep_the_key(table: CacheTable, leases: Leases) -> None:
    table.allocate(num_tensors=4, tensor_nbytes=100, batch_size=1, keys=[(KEY_REQ, 1, 0)])
    grant = _resolve(leases, KEY_REQ, 1, "a")
    leases.release(grant.lease_id, ok=False, owner="a")
    grant = _resolve(leases, KEY_REQ, 1, "a", consume=False)
    leases.release(grant.lease_id, ok=True, owner="a")
    assert table.bound((KEY_REQ, 1, 0)) is not None


def test_prefix_keys_are_never_consumed(table: CacheTable, leases: Leases) -> None:
    table.allocate(num_tensors=4, tensor_nbytes=100, batch_size=1, keys=[(KEY_PREFIX, 9, 0)])
    for _ in range(2):
        grant = _resolve(leases, KEY_PREFIX, 9, "a")
        leases.release(grant.lease_id, ok=True, owner="a")
    assert table.bound((KEY_PREFIX, 9, 0)) is not None


def test_pull_by_cache_id_consumes_the_slots_req_key(table: CacheTable, leases: Leases) -> None:
    record = table.allocate(
        num_tensors=4, tensor_nbytes=200, batch_size=2, keys=[(KEY_REQ, 1, 0), (KEY_REQ, 2, 0)]
    )
    grant = _resolve(leases, KEY_CACHE_ID, record.cache_id, "a", batch_index=1)
    leases.release(grant.lease_id, ok=True, owner="a")
    assert table.bound((KEY_REQ, 1, 0)) is not None and table.bound((KEY_REQ, 2, 0)) is None
    with pytest.raises(StatusError) as exc_info:
        _resolve(leases, KEY_CACHE_ID, record.cache_id, "a", batch_index=2)
    assert exc_info.value.code == LLMStatusCode.LLM_PARAM_INVALID


def test_a_dead_connections_leases_are_dropped_and_the_key_comes_back(
    table: CacheTable, leases: Leases
) -> None:
    table.allocate(num_tensors=4, tensor_nbytes=100, batch_size=1, keys=[(KEY_REQ, 1, 0)])
    _resolve(leases, KEY_REQ, 1, "dead")
    # The key is taken while its pull is in flight: a second pull of it finds nothing.
    with pytest.raises(StatusError) as exc_info:
        _resolve(leases, KEY_REQ, 1, "other")
    assert exc_info.value.code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert leases.stats()["leases"] == 1
    assert leases.drop_owner("dead") == 1
    assert leases.stats()["leases"] == 0 and table.bound((KEY_REQ, 1, 0)) is not None
    grant = _resolve(leases, KEY_REQ, 1, "next")  # pullable again, and consumed by a good pull
    leases.release(grant.lease_id, ok=True, owner="next")
    assert table.bound((KEY_REQ, 1, 0)) is None


def test_a_failed_partial_pull_gives_its_tensors_back(table: CacheTable, leases: Leases) -> None:
    table.allocate(num_tensors=4, tensor_nbytes=100, batch_size=1, keys=[(KEY_REQ, 1, 0)])
    first = _resolve(leases, KEY_REQ, 1, "a", tensor_start=0, tensor_count=2, whole=False)
    leases.release(first.lease_id, ok=True, owner="a")
    failed = _resolve(leases, KEY_REQ, 1, "a", tensor_start=2, tensor_count=2, whole=False)
    with pytest.raises(StatusError) as exc_info:  # the last tensors were taken: the key is gone...
        _resolve(leases, KEY_REQ, 1, "b", tensor_start=0, tensor_count=1, whole=False)
    assert exc_info.value.code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    leases.release(failed.lease_id, ok=False, owner="a")
    assert table.bound((KEY_REQ, 1, 0)) is not None  # ...and back after the failure, with only those tensors
    again = _resolve(leases, KEY_REQ, 1, "a", tensor_start=2, tensor_count=2, whole=False)
    leases.release(again.lease_id, ok=True, owner="a")
    assert table.bound((KEY_REQ, 1, 0)) is None


def test_a_key_pulled_whole_by_another_pull_stays_consumed_when_its_reserver_fails(
    table: CacheTable, leases: Leases
) -> None:
    """Consumption follows the copy, not the reservation: a pull by key reserves the key; a pull by cache
    id and slot copies all of it and ends well; the reserving pull then fails and gives back nothing."""
    record = table.allocate(num_tensors=4, tensor_nbytes=100, batch_size=1, keys=[(KEY_REQ, 1, 0)])
    reserving = _resolve(leases, KEY_REQ, 1, "a")
    by_slot = _resolve(leases, KEY_CACHE_ID, record.cache_id, "b")
    leases.release(by_slot.lease_id, ok=True, owner="b")
    assert table.bound((KEY_REQ, 1, 0)) is not None  # the reserving pull is still in flight
    leases.release(reserving.lease_id, ok=False, owner="a")
    assert table.bound((KEY_REQ, 1, 0)) is None
    with pytest.raises(StatusError) as exc_info:
        _resolve(leases, KEY_REQ, 1, "c")
    assert exc_info.value.code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert leases.stats()["leases"] == 0


def test_a_key_is_kept_while_a_tensor_of_it_is_still_being_pulled(table: CacheTable, leases: Leases) -> None:
    """The sibling the other way: one pull copied every tensor while another, which reserved a layer,
    is still in flight; the key is unbound only when that one ends, and its failure gives back nothing."""
    record = table.allocate(num_tensors=4, tensor_nbytes=100, batch_size=1, keys=[(KEY_REQ, 1, 0)])
    layer = _resolve(leases, KEY_REQ, 1, "a", tensor_start=0, tensor_count=2, whole=False)
    whole = _resolve(leases, KEY_CACHE_ID, record.cache_id, "b")
    leases.release(whole.lease_id, ok=True, owner="b")
    assert table.bound((KEY_REQ, 1, 0)) is not None  # the layer's pull still reserves part of it
    with pytest.raises(StatusError):
        _resolve(leases, KEY_REQ, 1, "c")  # pulled whole meanwhile: no new pull finds it
    leases.release(layer.lease_id, ok=False, owner="a")
    assert table.bound((KEY_REQ, 1, 0)) is None


def test_memory_is_freed_only_when_nothing_references_it(table: CacheTable, leases: Leases) -> None:
    record = table.allocate(num_tensors=4, tensor_nbytes=100, batch_size=1, keys=[(KEY_REQ, 1, 0)])
    grant = _resolve(leases, KEY_REQ, 1, "a")
    table.deallocate(record.cache_id)
    table.remove_key((KEY_REQ, 1, 0))
    assert leases.stats()["caches"] == 1  # a peer is still copying out of it
    leases.release(grant.lease_id, ok=True, owner="a")
    assert leases.stats() == {"caches": 0, "keys": 0, "leases": 0, "pins": 0, "pool_used_nbytes": 0}


def test_leases_belong_to_their_connection(table: CacheTable, leases: Leases) -> None:
    table.allocate(num_tensors=4, tensor_nbytes=100, batch_size=1, keys=[(KEY_REQ, 1, 0)])
    grant = _resolve(leases, KEY_REQ, 1, "a")
    with pytest.raises(StatusError):
        leases.release(grant.lease_id, ok=True, owner="b")
    with pytest.raises(StatusError):
        leases.release(grant.lease_id + 1, ok=True, owner="a")


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"key_id": 99}, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST),
        ({"key_kind": KEY_PREFIX}, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST),
        ({"model_id": 1}, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST),
        ({"tensor_count": 3}, LLMStatusCode.LLM_PARAM_INVALID),
        ({"tensor_start": 2, "tensor_count": 3, "whole": False}, LLMStatusCode.LLM_PARAM_INVALID),
        ({"nbytes": 101}, LLMStatusCode.LLM_PARAM_INVALID),
        ({"src_offset": 1}, LLMStatusCode.LLM_PARAM_INVALID),
    ],
)
def test_resolve_checks(
    table: CacheTable, leases: Leases, overrides: dict[str, object], code: LLMStatusCode
) -> None:
    table.allocate(num_tensors=4, tensor_nbytes=100, batch_size=1, keys=[(KEY_REQ, 1, 0)])
    with pytest.raises(StatusError) as exc_info:
        _resolve(leases, KEY_REQ, 1, "a", **overrides)
    assert exc_info.value.code == code
    assert leases.stats()["leases"] == 0


def test_pool_exhaustion_uses_the_modes_code(table: CacheTable, leases: Leases) -> None:
    with pytest.raises(StatusError) as exc_info:
        table.allocate(num_tensors=2, tensor_nbytes=1 << 20, batch_size=1, keys=[])
    assert exc_info.value.code == LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
    assert leases.stats()["caches"] == 0


def test_a_key_a_pin_consumed_is_gone_for_a_request_too(table: CacheTable, leases: Leases) -> None:
    """Pulls by key pin in the index; a request for the same key over the socket (the older path, still
    served) sees a key a pin emptied as gone, by key and by cache id and slot, and the key is unbound once
    the pin ends. The pin is made through a second open file description of the index, as a puller's."""
    import os

    from llm_datadist._owner.rows import Holder
    from llm_datadist._shm.index import Index
    from llm_datadist._shm.index_layout import KIND_REQ

    record = table.allocate(num_tensors=4, tensor_nbytes=100, batch_size=1, keys=[(KEY_REQ, 9, 0)])
    puller = Index.attach(table.index.name, pid=os.getpid(), incarnation=0)
    try:
        owner = object()
        row, ticket = leases.assign_row(owner, 5, Holder(0, -1))
        with puller.locked(1.0):
            name = puller.lookup(KIND_REQ, 9, 0)
            assert name is not None
            assert puller.consume(name.number, 0b1111) == 0b1111
            puller.set_row(row, ticket, record.gen_slot, record.generation, name.number, 0b1111, range(4))
        for kind, ident in ((KEY_REQ, 9), (KEY_CACHE_ID, record.cache_id)):
            if kind == KEY_CACHE_ID:
                grant = _resolve(leases, kind, ident, owner="b")  # the slot's key is gone: nothing consumed
                leases.release(grant.lease_id, ok=True, owner="b")
                continue
            with pytest.raises(StatusError) as exc_info:
                _resolve(leases, kind, ident, owner="b")
            assert exc_info.value.code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        assert leases.stats()["keys"] == 1  # the pin still refers to it
        with puller.locked(1.0):
            puller.clear_row(row, ticket)
            puller.bump_epoch()
        assert leases.stats()["keys"] == 0 and table.bound((KEY_REQ, 9, 0)) is None
        leases.connection_ended(owner)
    finally:
        puller.close()
