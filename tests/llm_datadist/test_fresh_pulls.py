"""Small pulls of keys as serving clients make them (a new key object per request, each pulled once) take
one kernel call (`_puller.fresh.FreshPulls`), and mean what the full way means: the bytes of the key's slot, a
req key consumed once every tensor of it was copied (so a second pull is `LLM_KV_CACHE_NOT_EXIST` and the
owner lets the key go), layer by layer too, a prefix key never consumed. Real processes: the owner is a
spawned Prompt, the puller this process; without the C kernel the same outcomes come the full way."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from llm_datadist import CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LLMException, LLMStatusCode
from llm_datadist._shm import indexkernel
from llm_datadist.ext import tensor_views
from tests._peer import PromptPeer, linked_decoder

P = 1
U64 = 2**64 - 1
_PORTS = itertools.count(1)
# Without the C kernel every pull takes the full way (the pure-Python path): the same outcomes, none fast.
FAST = indexkernel.kernel is not None


@pytest.fixture
def linked(seed: int) -> Iterator[tuple[PromptPeer, object]]:
    with linked_decoder(P, 30000 + (os.getpid() * 23 + next(_PORTS)) % 20000, seed) as pair:
        yield pair


def _raw(cache) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    return [view.view(np.uint8).reshape(-1) for view in tensor_views(cache)]


def _fresh(dd) -> int:  # type: ignore[no-untyped-def]
    return int(dd._require_core().transfers.fresh.done)


def _keys(peer: PromptPeer) -> int:
    return int(peer.call("stats")["keys"])


def _map_segment(peer: PromptPeer, manager) -> None:  # type: ignore[no-untyped-def]
    """A first pull, which maps the owner's segment the full way (the kernel's way reads it after)."""
    peer.alloc(2, [1, 512], [(P, 1)])
    manager.pull_cache(CacheKey(P, 1), manager.allocate_cache(CacheDesc(2, [1, 512], DataType.DT_FLOAT16)))


def _pull_slot_once(peer: PromptPeer, manager, req: int, dst, cache_id: int, slot: int) -> None:  # type: ignore[no-untyped-def]
    """Pull req key `req` (slot `slot` of the owner's cache `cache_id`, a batch of 2) into `dst`: its bytes
    arrive, and the key is consumed (a second pull of it is LLM_KV_CACHE_NOT_EXIST)."""
    manager.pull_cache(CacheKey(P, req), dst)
    for t, raw in enumerate(_raw(dst)):
        whole = peer.expected(cache_id, t, 2 * raw.nbytes)
        np.testing.assert_array_equal(raw, whole[slot * raw.nbytes : (slot + 1) * raw.nbytes])
    with pytest.raises(LLMException) as caught:
        manager.pull_cache(CacheKey(P, req), dst)
    assert caught.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


# Elements per slot of a tensor: a request of 4 KiB, copied under the index lock, and one of 256 KiB, pinned
# through our row and copied with the lock free.
SIZES = pytest.mark.parametrize("elements", [512, 32768], ids=["held", "pinned"])


@SIZES
def test_new_key_objects_each_pulled_once_are_copied_and_consumed(linked, elements: int) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    manager = dd.kv_cache_manager
    requests = 12
    caches = [peer.alloc(4, [2, elements], [(P, 100 + r), (P, 200 + r)]) for r in range(requests)]
    assert _keys(peer) == 2 * requests
    dst = manager.allocate_cache(CacheDesc(4, [1, elements], DataType.DT_FLOAT16))
    for r, cache_id in enumerate(caches):
        for slot, req in ((0, 100 + r), (1, 200 + r)):
            for raw in _raw(dst):
                raw[:] = 0
            _pull_slot_once(peer, manager, req, dst, cache_id, slot)
    # The first pull mapped the owner's segment the full way; every other one took one kernel call.
    assert _fresh(dd) == (2 * requests - 1 if FAST else 0)
    deadline = time.monotonic() + 10
    while _keys(peer) and time.monotonic() < deadline:  # the owner lets consumed keys go at its next look
        time.sleep(0.01)
    assert _keys(peer) == 0


@SIZES
def test_layer_by_layer_with_new_key_objects_consumes_after_the_last_layer(linked, elements: int) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    manager = dd.kv_cache_manager
    layers = 4
    _map_segment(peer, manager)
    cache_id = peer.alloc(2 * layers, [1, elements], [(P, 7)])
    dst = manager.allocate_cache(CacheDesc(2 * layers, [1, elements], DataType.DT_FLOAT16))
    before = _fresh(dd)
    for layer in range(layers):
        key = CacheKey(P, 7)  # a new object each layer, as a connector builds it
        rng = range(layer, layer + 1)
        manager.pull_cache(key, dst, src_layer_range=rng, dst_layer_range=rng)
    assert _fresh(dd) == before + (layers if FAST else 0)
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, peer.expected(cache_id, t, raw.nbytes))
    with pytest.raises(LLMException) as caught:
        manager.pull_cache(CacheKey(P, 7), dst, src_layer_range=range(0, 1), dst_layer_range=range(0, 1))
    assert caught.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


@SIZES
def test_layer_by_layer_by_cache_id_consumes_the_slots_req_key(linked, elements: int) -> None:  # type: ignore[no-untyped-def]
    """Connectors pull each layer with a new `CacheKeyByIdAndIndex`: the kernel takes it by the cache's id
    and the batch index, and consumes the req key bound to that slot once every layer was pulled."""
    peer, dd = linked
    manager = dd.kv_cache_manager
    layers = 4
    _map_segment(peer, manager)
    cache_id = peer.alloc(2 * layers, [2, elements], [(P, 30), (P, 31)])
    dst = manager.allocate_cache(CacheDesc(2 * layers, [1, elements], DataType.DT_FLOAT16))
    before = _fresh(dd)
    for layer in range(layers):
        rng = range(layer, layer + 1)
        manager.pull_cache(
            CacheKeyByIdAndIndex(P, cache_id, 1), dst, src_layer_range=rng, dst_layer_range=rng
        )
    assert _fresh(dd) == before + (layers if FAST else 0)
    for t, raw in enumerate(_raw(dst)):
        whole = peer.expected(cache_id, t, 2 * raw.nbytes)
        np.testing.assert_array_equal(raw, whole[raw.nbytes :])
    with pytest.raises(LLMException) as caught:  # slot 1's key went with its last layer; slot 0's stays
        manager.pull_cache(CacheKey(P, 31), dst)
    assert caught.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    manager.pull_cache(CacheKey(P, 30), dst)
    with pytest.raises(LLMException) as caught:  # refused as the full way refuses it
        manager.pull_cache(CacheKeyByIdAndIndex(P, cache_id, 2), dst)
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_a_prefix_key_is_never_consumed(linked) -> None:  # type: ignore[no-untyped-def]
    peer, dd = linked
    manager = dd.kv_cache_manager
    cache_id = peer.alloc(2, [1, 256], [(P, U64, 0, 9)])
    dst = manager.allocate_cache(CacheDesc(2, [1, 256], DataType.DT_FLOAT16))
    for _ in range(5):
        for raw in _raw(dst):
            raw[:] = 0
        manager.pull_cache(CacheKey(P, U64, 0, 9), dst)
        for t, raw in enumerate(_raw(dst)):
            np.testing.assert_array_equal(raw, peer.expected(cache_id, t, raw.nbytes))
    assert _fresh(dd) == (4 if FAST else 0)
    assert _keys(peer) == 1


def test_caches_in_several_segments_of_the_owner_are_all_pulled_the_kernels_way(linked) -> None:  # type: ignore[no-untyped-def]
    """An owner whose pool grew holds caches in more than one segment: once a full pull mapped each, pulls
    of caches in any of them take the kernel's way, in whatever order they come."""
    peer, dd = linked
    manager = dd.kv_cache_manager
    small = peer.alloc(1, [1, 2048], [(P, U64, 0, 1)])
    big = peer.alloc(1, [1, 40 << 20], [(P, U64, 0, 2)])  # 80 MiB: more than the pool's first segment
    assert len(peer.call("segments")["pools"]) == 2
    dst = manager.allocate_cache(CacheDesc(1, [1, 2048], DataType.DT_FLOAT16))
    first = {1: small, 2: big}
    for prefix in (1, 2):  # each maps its segment the full way
        manager.pull_cache(CacheKey(P, U64, 0, prefix), dst, size=4096)
    before = _fresh(dd)
    for prefix in (1, 2, 2, 1, 2, 1, 1):
        (raw,) = _raw(dst)
        raw[:] = 0
        manager.pull_cache(CacheKey(P, U64, 0, prefix), dst, size=4096)
        np.testing.assert_array_equal(raw, peer.expected(first[prefix], 0, 4096))
    assert _fresh(dd) == before + (7 if FAST else 0)


def test_a_segment_unmapped_here_meanwhile_fails_no_pull(linked) -> None:  # type: ignore[no-untyped-def]
    """Housekeeping unmaps a peer's segment here (its pool let it go, or the mapping cache is full) while
    small pulls remember it: the next pull takes the full way, maps it again, and succeeds."""
    peer, dd = linked
    manager = dd.kv_cache_manager
    caches = [peer.alloc(2, [1, 256], [(P, 50 + r)]) for r in range(3)]
    dst = manager.allocate_cache(CacheDesc(2, [1, 256], DataType.DT_FLOAT16))
    link = dd._require_core().links.get(P)
    for r, cache_id in enumerate(caches):
        manager.pull_cache(CacheKey(P, 50 + r), dst)
        for t, raw in enumerate(_raw(dst)):
            np.testing.assert_array_equal(raw, peer.expected(cache_id, t, raw.nbytes))
        for name in link.mappings.names():  # as `Links.unmap_retired` does
            link.mappings.drop(name)


def test_a_pull_of_a_known_plan_is_refused_as_the_first_pull_of_it_is(linked) -> None:  # type: ignore[no-untyped-def]
    """The face keeps a checked pull's plan by value (every argument but the key): a later pull of the same
    plan checks only its own key, and is refused with the code the full checks give."""
    peer, dd = linked
    manager = dd.kv_cache_manager
    dst = manager.allocate_cache(CacheDesc(2, [1, 256], DataType.DT_FLOAT16))
    cache_id = peer.alloc(2, [2, 256], [(P, 1), (P, 2)])
    wrong = [CacheKey(77, 1), CacheKey(P, 99), CacheKeyByIdAndIndex(77, cache_id, 0)]

    def codes() -> list[LLMStatusCode]:
        found = []
        for key in wrong:
            with pytest.raises(LLMException) as caught:
                manager.pull_cache(key, dst)
            found.append(caught.value.status_code)
        return found

    first = codes()  # no plan kept yet: the full checks
    assert first == [
        LLMStatusCode.LLM_NOT_YET_LINK,
        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        LLMStatusCode.LLM_NOT_YET_LINK,
    ]
    manager.pull_cache(CacheKey(P, 1), dst)  # keeps the plan
    manager.pull_cache(CacheKeyByIdAndIndex(P, cache_id, 0), dst)
    assert codes() == first
    manager.pull_cache(CacheKey(P, 2), dst)  # a key of its own, with the kept plan: slot 1's bytes
    for t, raw in enumerate(_raw(dst)):
        np.testing.assert_array_equal(raw, peer.expected(cache_id, t, 2 * raw.nbytes)[raw.nbytes :])


@pytest.mark.parametrize("threads", [2, 4])
def test_a_request_split_over_the_copy_threads_is_copied_and_consumed(linked, threads: int) -> None:  # type: ignore[no-untyped-def]
    """A request large enough for more than one thread (16 MiB here): with two copy threads, one kernel call
    shares the copy with the kernel's helper thread; with four, it is pinned in one kernel call, copied by
    the copy threads with the lock free and unpinned in another call. Consumed either way."""
    peer, dd = linked
    manager = dd.kv_cache_manager
    dd._require_core().copier.threads = threads
    elements = 2 << 20  # 4 MiB a tensor's slot
    _map_segment(peer, manager)
    cache_id = peer.alloc(4, [2, elements], [(P, 40), (P, 41)])
    dst = manager.allocate_cache(CacheDesc(4, [1, elements], DataType.DT_FLOAT16))
    before = _fresh(dd)
    for slot, req in ((0, 40), (1, 41)):
        _pull_slot_once(peer, manager, req, dst, cache_id, slot)
    assert _fresh(dd) == before + (2 if FAST else 0)


class _Recording:
    """The C kernel with `index_pull_key`'s outcomes recorded (the rest passed through)."""

    def __init__(self, kernel: object) -> None:
        self._kernel = kernel
        self.outcomes: list[int] = []

    def index_pull_key(self, *args: object) -> int:
        outcome = int(self._kernel.index_pull_key(*args))  # type: ignore[attr-defined]
        self.outcomes.append(outcome)
        return outcome

    def __getattr__(self, name: str) -> object:
        return getattr(self._kernel, name)


@pytest.mark.skipif(not FAST, reason="the kernel's hang-up poll needs the C kernel built")
@SIZES
def test_a_killed_owner_is_a_link_failure_before_its_index_is_read(
    linked, elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The owner killed between two pulls of the kernel's way: the next pull's one call finds the link's
    socket hung up before it reads the dead owner's index (outcome 7), and the pull fails as the link's
    failure (LLM_LINK_FAILED), the link broken; nothing of the owner's memory is read."""
    peer, dd = linked
    manager = dd.kv_cache_manager
    _map_segment(peer, manager)
    cache_id = peer.alloc(2, [2, elements], [(P, 10), (P, 11)])
    dst = manager.allocate_cache(CacheDesc(2, [1, elements], DataType.DT_FLOAT16))
    recording = _Recording(indexkernel.kernel)
    monkeypatch.setattr(indexkernel, "kernel", recording)
    _pull_slot_once(peer, manager, 10, dst, cache_id, 0)
    assert recording.outcomes and recording.outcomes[0] in (0, 4)  # done, or pinned for the copy threads
    for raw in _raw(dst):
        raw[:] = 0
    peer.kill()
    with pytest.raises(LLMException) as caught:
        manager.pull_cache(CacheKey(P, 11), dst)
    assert caught.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    assert recording.outcomes[-1] == 7  # the kernel's hang-up poll, before the index
    assert not any(raw.any() for raw in _raw(dst))
