"""The `serving` group of `llm-datadist bench`: pulls made as serving frameworks make them, the rows the
targets of bench/README.md's table are judged on.

Rules: a Prompt (`ours.Owner`, spawned) and a Decoder (this process), each with a fixed pool; every request
is pulled once, with argument objects of its own (a new `CacheKey(prompt_cluster_id, req_id)` that the pull
consumes, a new `BlocksCacheKey` and new block lists), into destination memory already touched; no call is
made twice with one object. The owner binds each batch of requests between timed batches (`_Requests`); one
pull of each row is checked byte for byte before the timed ones. Each row has its p50, its p99 and the CPU
both processes spent per pull (`_Clock`).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMException,
    LLMStatusCode,
)
from llm_datadist.ext import tensor_views

from .ours import OWNER, Owner, fill_value, library_arrays, link, measurer, private_arrays
from .proc import Results, cpu_ns, fmt_nbytes

GROUP = "serving"
LAYERS = 32
TENSORS = 2 * LAYERS  # K and V per layer
SMALL_NBYTES = 4 << 10
REQUEST_SLOTS = (
    32 << 10,
    256 << 10,
    2 << 20,
)  # per tensor: 2, 16 and 128 MiB requests (16, 128, 1024 tokens)
LAYERED_SLOT = 256 << 10  # the 16 MiB request, pulled layer by layer
PAGED_BLOCK = 32 << 10
PAGED_POOL_BLOCKS = 128  # per tensor: 4 MiB, 256 MiB over the 64 tensors
PAGED_TABLES = (1, 8, 64)  # blocks per tensor in one request
_BATCH_NBYTES = 256 << 20  # what the owner binds at most between two timed batches
_BATCH_KEYS = 500  # and at most this many keys
POOL_NBYTES = 384 << 20  # each side's fixed v1 pool: a batch of requests, or the paged cache, with room


def _repeats(quick: bool) -> dict[str | int, int]:
    """Requests each row pulls (timed; the checked one comes on top)."""
    if quick:
        return {"small": 300, 32 << 10: 40, 256 << 10: 16, 2 << 20: 4, "layered": 6, 1: 200, 8: 40, 64: 6}
    return {"small": 2000, 32 << 10: 200, 256 << 10: 100, 2 << 20: 24, "layered": 30, 1: 1000, 8: 200, 64: 40}


class _Clock:
    """Wall time of each call, and the CPU time (all threads, the scheduler's counts) the puller (this
    process) and the owner spent in them, over several timed batches: what the owner does between batches
    (binding the next requests) is not counted."""

    def __init__(self, owner_pid: int | None) -> None:
        self.owner_pid = owner_pid
        self.samples: list[float] = []
        self.puller_ns = 0
        self.owner_ns: int | None = 0 if owner_pid is not None else None

    def _owner_cpu_ns(self) -> int | None:
        return cpu_ns(self.owner_pid) if self.owner_pid is not None else None

    def run(self, calls: list[Callable[[], object]]) -> None:
        owner_before, puller_before = self._owner_cpu_ns(), time.process_time_ns()
        for call in calls:
            started = time.perf_counter()
            call()
            self.samples.append(time.perf_counter() - started)
        self.puller_ns += time.process_time_ns() - puller_before
        owner_after = self._owner_cpu_ns()
        if owner_before is None or owner_after is None or self.owner_ns is None:
            self.owner_ns = None
        else:
            self.owner_ns += owner_after - owner_before

    def cpu_us(self) -> dict[str, float]:
        count = max(1, len(self.samples))
        cpu = {"puller": self.puller_ns / count / 1e3}
        if self.owner_ns is not None:
            cpu["owner"] = self.owner_ns / count / 1e3
        return cpu


class _Requests:
    """The owner's requests, bound in batches (its "requests" command): each req id is new and pulled once."""

    def __init__(self, owner: Owner) -> None:
        self.owner = owner
        self.next_id = 1

    def batch(self, tensors: int, slot_nbytes: int, count: int, fill: bool = False) -> tuple[int, range]:
        """(the cache id, the req ids) of `count` new requests of `tensors` x `slot_nbytes`, the previous
        batch gone; with `fill`, slot i of tensor t holds `fill_value(t, i)`."""
        req_ids = range(self.next_id, self.next_id + count)
        self.next_id += count
        cache_id = self.owner.call("requests", (tensors, slot_nbytes, req_ids, fill))
        return int(cache_id), req_ids

    def batches(self, tensors: int, slot_nbytes: int, total: int) -> Iterator[tuple[int, range]]:
        """Batches of at most `_BATCH_KEYS` requests and `_BATCH_NBYTES`, `total` requests in all."""
        per_batch = max(1, min(_BATCH_KEYS, _BATCH_NBYTES // (tensors * slot_nbytes)))
        while total > 0:
            count = min(per_batch, total)
            total -= count
            yield self.batch(tensors, slot_nbytes, count)

    def checked(self, manager: Any, dst: Any, tensors: int, slot_nbytes: int, dst_slots: int) -> None:
        """One request pulled and checked: maps what the timed pulls reuse, and shows a wrong slot."""
        _, req_ids = self.batch(tensors, slot_nbytes, 2, fill=True)
        manager.pull_cache(CacheKey(OWNER, req_ids[1]), dst, dst_slots - 1)
        for t, view in enumerate(tensor_views(dst)):
            if not (view.view(np.uint8).reshape(dst_slots, -1)[-1] == fill_value(t, np.asarray(1))).all():
                raise RuntimeError(
                    f"serving: tensor {t} of a fresh request holds other bytes than the owner's"
                )
        try:  # the rows say "consumed": a second pull of the key finds nothing
            manager.pull_cache(CacheKey(OWNER, req_ids[1]), dst, 0)
        except LLMException as exc:
            if exc.status_code != LLMStatusCode.LLM_KV_CACHE_NOT_EXIST:
                raise
        else:
            raise RuntimeError("serving: a pull by CacheKey(req_id) did not consume the key")


def _add(results: Results, name: str, nbytes: int, clock: _Clock, row_id: str, **extra: Any) -> None:
    results.add(GROUP, name, nbytes, clock.samples, cpu_us=clock.cpu_us(), id=row_id, **extra)


# ====================================================================== v1: fresh keys, consumed


def _fresh_requests(
    results: Results, requests: _Requests, manager: Any, tensors: int, slot_nbytes: int, total: int
) -> None:
    """Whole requests by `CacheKey(req_id)`, each into the next of the Decoder's batch slots."""
    dst_slots = 8 if slot_nbytes < (1 << 20) else 2
    dst = manager.allocate_cache(CacheDesc(tensors, [dst_slots, slot_nbytes // 2], DataType.DT_FLOAT16))
    requests.checked(manager, dst, tensors, slot_nbytes, dst_slots)
    clock = _Clock(requests.owner.process.pid)
    for _, req_ids in requests.batches(tensors, slot_nbytes, total):
        clock.run(
            [
                functools.partial(manager.pull_cache, CacheKey(OWNER, req_id), dst, i % dst_slots)
                for i, req_id in enumerate(req_ids)
            ]
        )
    manager.deallocate_cache(dst)
    nbytes = tensors * slot_nbytes
    if tensors == 1:
        name, row_id = f"fresh 1 x {fmt_nbytes(slot_nbytes)} by CacheKey(req_id), consumed", "serving.small"
    else:
        name = f"fresh request, {tensors} x {fmt_nbytes(slot_nbytes)} by CacheKey(req_id)"
        row_id = f"serving.request.{slot_nbytes}"
    _add(results, name, nbytes, clock, row_id)


def _by_layer(manager: Any, keys: list[Any], dst: Any, dst_slot: int) -> None:
    """One request layer by layer: a pull per layer (its K and V), each with a key object of its own."""
    for layer, key in enumerate(keys):
        one = range(layer, layer + 1)
        manager.pull_cache(key, dst, dst_slot, src_layer_range=one, dst_layer_range=one)


def _layered(results: Results, requests: _Requests, manager: Any, total: int) -> None:
    """The 16 MiB request whole, layer by layer with a new `CacheKey(req_id)` per layer (consumed after the
    last), and layer by layer with a new `CacheKeyByIdAndIndex` per layer (the slot's key consumed the
    same way): the three in turn, so that each sees the same machine; each layered row's ratio is the whole
    one's p50 over its own."""
    slot_nbytes, dst_slots = LAYERED_SLOT, 4
    dst = manager.allocate_cache(CacheDesc(TENSORS, [dst_slots, slot_nbytes // 2], DataType.DT_FLOAT16))
    requests.checked(manager, dst, TENSORS, slot_nbytes, dst_slots)
    clocks = [_Clock(requests.owner.process.pid) for _ in range(3)]
    turn = 0
    for cache_id, req_ids in requests.batches(TENSORS, slot_nbytes, 3 * total):
        calls: list[list[Callable[[], object]]] = [[], [], []]
        for slot, req_id in enumerate(req_ids):
            way, dst_slot = turn % 3, turn % dst_slots
            turn += 1
            keys: list[CacheKey | CacheKeyByIdAndIndex]
            if way == 0:
                call = functools.partial(manager.pull_cache, CacheKey(OWNER, req_id), dst, dst_slot)
            elif way == 1:
                keys = [CacheKey(OWNER, req_id) for _ in range(LAYERS)]
                call = functools.partial(_by_layer, manager, keys, dst, dst_slot)
            else:
                keys = [CacheKeyByIdAndIndex(OWNER, cache_id, slot) for _ in range(LAYERS)]
                call = functools.partial(_by_layer, manager, keys, dst, dst_slot)
            calls[way].append(call)
        # In turn within the batch, as the requests were dealt: one call of each way, then the next.
        for index in range(max(len(c) for c in calls)):
            for way in range(3):
                if index < len(calls[way]):
                    clocks[way].run([calls[way][index]])
    manager.deallocate_cache(dst)
    nbytes = TENSORS * slot_nbytes
    whole_p50 = float(np.median(clocks[0].samples))
    size = fmt_nbytes(nbytes)
    _add(
        results,
        f"the {size} request whole, in turn with the two below",
        nbytes,
        clocks[0],
        "serving.layers.whole",
    )
    for clock, key_name, row_id in (
        (clocks[1], "CacheKey", "serving.layers.cache_key"),
        (clocks[2], "CacheKeyByIdAndIndex", "serving.layers.by_id"),
    ):
        name = f"the same, {LAYERS} pulls, a new {key_name} each"
        _add(results, name, nbytes, clock, row_id, vs_whole=whole_p50 / float(np.median(clock.samples)))


def _block_tables(count: int, table: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`count` fresh block tables of `table` distinct random blocks of the paged pool, each side's its own
    (new list objects every request, as a scheduler builds them)."""
    rng = np.random.default_rng(seed)
    return [
        (
            rng.choice(PAGED_POOL_BLOCKS, table, replace=False).tolist(),
            rng.choice(PAGED_POOL_BLOCKS, table, replace=False).tolist(),
        )
        for _ in range(count)
    ]


def _checked_blocks(
    pull: Callable[[Any, list[int], list[int]], None], local_views: list[Any], key: Any
) -> None:
    """One block pull into zeroed memory, checked: each destination block holds its source block."""
    ((src, dst),) = _block_tables(1, 8, seed=1)
    rows = [view.view(np.uint8).reshape(PAGED_POOL_BLOCKS, -1) for view in local_views]
    for tensor_rows in rows:
        tensor_rows[:] = 0
    pull(key, src, dst)
    for t, tensor_rows in enumerate(rows):
        if not (tensor_rows[dst] == fill_value(t, np.asarray(src))[:, None]).all():
            raise RuntimeError(f"serving: block pull, tensor {t} holds other bytes than the owner's")


def _paged_rows(
    results: Results,
    pull: Callable[[Any, list[int], list[int]], None],
    make_key: Callable[[], Any],
    owner_pid: int | None,
    repeats: dict[str | int, int],
    name: str,
    row_id: str,
) -> None:
    """The paged rows of one kind of pull: per table size, fresh keys and fresh tables, timed."""
    for table in PAGED_TABLES:
        clock = _Clock(owner_pid)
        count = repeats[table]
        batch = max(1, min(count, 200))
        for start in range(0, count, batch):
            tables = _block_tables(min(batch, count - start), table, seed=table * 1000 + start)
            clock.run([functools.partial(pull, make_key(), src, dst) for src, dst in tables])
        nbytes = TENSORS * table * PAGED_BLOCK
        _add(results, name.format(table=table), nbytes, clock, f"{row_id}.{table}", blocks=table)


def run_v1(results: Results, port: int, args: argparse.Namespace) -> None:
    """Fresh keys, the request shapes, layer by layer and v1 `pull_blocks`, against a v1 Prompt."""
    repeats = _repeats(args.quick)
    owner = Owner("v1", port, args.timeout_ms, pool_nbytes=POOL_NBYTES)
    datadist = measurer("v1", args.timeout_ms, pool_nbytes=POOL_NBYTES)
    try:
        link(datadist, port)
        manager = datadist.kv_cache_manager
        requests = _Requests(owner)
        _fresh_requests(results, requests, manager, 1, SMALL_NBYTES, repeats["small"])
        for slot_nbytes in REQUEST_SLOTS:
            _fresh_requests(results, requests, manager, TENSORS, slot_nbytes, repeats[slot_nbytes])
        _layered(results, requests, manager, repeats["layered"])
        requests.batch(1, SMALL_NBYTES, 1)  # the last batch's memory back to the pool
        shape = [PAGED_POOL_BLOCKS, PAGED_BLOCK // 2]
        owner.call("alloc_blocks", (TENSORS, shape, 0))
        owner.call("fill")
        local = manager.allocate_blocks_cache(CacheDesc(TENSORS, shape, DataType.DT_FLOAT16))

        def pull(key: Any, src: list[int], dst: list[int]) -> None:
            manager.pull_blocks(key, local, src, dst)

        _checked_blocks(pull, tensor_views(local), BlocksCacheKey(OWNER, 0))
        name = "v1 pull_blocks, {table} random x 32 KiB x 64, fresh table"
        _paged_rows(
            results,
            pull,
            lambda: BlocksCacheKey(OWNER, 0),
            owner.process.pid,
            repeats,
            name,
            "serving.v1_blocks",
        )
        manager.deallocate_cache(local)
        owner.call("free")
    finally:
        datadist.finalize()
        owner.close()


# ====================================================================== v2: paged, registered memory


MEMORIES = ("private", "library")  # plain private numpy memory; the library's (ext.shared_arrays)


def run_v2(results: Results, port: int, args: argparse.Namespace) -> None:
    """v2 paged: both sides `register_blocks_cache` over 64 tensors x 128 blocks of 32 KiB, one-sided
    `pull_blocks` of random blocks with a new `BlocksCacheKey` and new tables per request; over plain
    private numpy memory, and over the library's (`ext.shared_arrays`) on both sides."""
    repeats = _repeats(args.quick)
    tensor_nbytes = PAGED_POOL_BLOCKS * PAGED_BLOCK
    shape = [PAGED_POOL_BLOCKS, PAGED_BLOCK // 2]
    desc = CacheDesc(TENSORS, shape, DataType.DT_FLOAT16)
    name = "v2 pull_blocks, {table} random x 32 KiB x 64, " + "{memory}"
    owner = Owner("v2", port, args.timeout_ms)
    datadist = measurer("v2", args.timeout_ms)
    try:
        link(datadist, port)
        manager = datadist.cache_manager
        for model_id, memory in enumerate(MEMORIES, 1):
            owner.call("register_paged", (TENSORS, shape, model_id, memory))
            make = library_arrays if memory == "library" else private_arrays
            arrays = make(TENSORS, tensor_nbytes)
            local = manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays])

            def pull(key: Any, src: list[int], dst: list[int], local: Any = local) -> None:
                manager.pull_blocks(key, local, src, dst)

            views = [a.view(np.uint8) for a in arrays]
            _checked_blocks(pull, views, BlocksCacheKey(OWNER, model_id))
            _paged_rows(
                results,
                pull,
                functools.partial(BlocksCacheKey, OWNER, model_id),
                owner.process.pid,
                repeats,
                name.replace("{memory}", f"{memory} memory"),
                f"serving.v2_paged.{memory}",
            )
            manager.unregister_cache(local.cache_id)
    finally:
        datadist.finalize()
        owner.close()


HOSTS_REASON = (
    "measured by `llm-datadist bench --hosts` (its row `pull_cache fresh 1 x 4 KiB by req key, consumed`): "
    "it needs two network namespaces (root, iproute2) and Mooncake, and takes about 20 s"
)


def hosts_row(results: Results) -> None:
    """The fresh pull across hosts lives in `bench --hosts`; here, the row that says so."""
    results.skip(GROUP, "fresh 1 x 4 KiB across hosts", HOSTS_REASON, id="serving.hosts")
