"""The soak's owners: a v1 PROMPT with a growing pool and a v2 owner of registered numpy memory, each
allocating, keying, freeing and unregistering caches in steps while pullers read them.

Rules: every cache an owner publishes is filled with the stamp pattern first and retracted before it is
freed; on "quiesce" an owner frees everything and brings its memory to the state every checkpoint compares;
it beats every `HEARTBEAT_S` and leaves its run loop only on "stop" or when the driver is gone.
"""

from __future__ import annotations

import os
import random
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
)

from ..patterns import fill_unit, make_stamp
from .memdebug import settle_heap
from .spec import (
    HEARTBEAT_S,
    OWNER_UNLINK_CHANCE,
    PULLER_CLUSTER_BASE,
    U64_MAX,
    ChildPipe,
    Entry,
    OwnerSpec,
    memory_at,
    memory_probe,
    options,
    redirect_output,
    report_thread_deaths,
    settle_pool,
)


class _Owner:
    """Shared loop of both owner kinds: churn in steps until told to quiesce, resume or stop."""

    WINDOW = 6

    def __init__(self, spec: OwnerSpec, pipe: ChildPipe) -> None:
        self.spec = spec
        self.pipe = pipe
        self.rng = random.Random(f"{spec.seed}/{spec.ref.name}/{spec.incarnation}")
        self.serial = 0

    def step(self) -> None:
        raise NotImplementedError

    def retire_all(self) -> None:
        raise NotImplementedError

    def settle(self) -> None:
        """Bring the memory to the state every checkpoint compares (nothing to do by default)."""

    def run(self) -> None:
        paused = False
        next_step = next_beat = time.monotonic()
        while True:
            now = time.monotonic()
            timeout = HEARTBEAT_S if paused else max(0.0, min(next_step - now, HEARTBEAT_S))
            try:
                if self.pipe.conn.poll(timeout):
                    command = self.pipe.conn.recv()[0]
                    if command == "stop":
                        self.retire_all()
                        return
                    if command == "quiesce":
                        self.retire_all()
                        self.settle()
                        settle_heap()
                        paused = True
                        self.pipe.send("quiet")
                    elif command == "resume":
                        paused = False
                        next_step = time.monotonic()
                    continue
            except EOFError:
                return  # the driver is gone
            if now >= next_beat:
                self.pipe.send("beat")
                next_beat = now + HEARTBEAT_S
            if not paused and now >= next_step:
                self.step()
                next_step = time.monotonic() + self.rng.uniform(0.05, 0.25)

    def publish(self, entry: Entry) -> None:
        self.pipe.send("pub", entry)

    def retract(self, entry: Entry) -> None:
        self.pipe.send("ret", entry.owner, entry.incarnation, entry.serial)


class _V1Owner(_Owner):
    """A v1 PROMPT with a growing pool (no `ge.flowGraphMemMaxSize`): caches of 70-126 MiB take a segment
    of their own and small ones share 64 MiB segments; freeing them lets the pool shrink again."""

    def __init__(self, spec: OwnerSpec, pipe: ChildPipe, datadist: LLMDataDist) -> None:
        super().__init__(spec, pipe)
        self.kvm = datadist.kv_cache_manager
        self.live: list[tuple[Entry, Any]] = []

    def _key(self, is_prefix: bool, key_id: int) -> CacheKey:
        cluster = self.spec.ref.cluster_id
        return CacheKey(cluster, U64_MAX, prefix_id=key_id) if is_prefix else CacheKey(cluster, key_id)

    def _retire(self, index: int) -> None:
        entry, cache = self.live.pop(index)
        self.retract(entry)
        for _, is_prefix, key_id in entry.keys:
            self.kvm.remove_cache_key(self._key(is_prefix, key_id))  # consumed keys are ignored
        self.kvm.deallocate_cache(cache)

    def retire_all(self) -> None:
        while self.live:
            self._retire(0)

    def settle(self) -> None:
        settle_pool(self.kvm)

    def step(self) -> None:
        rng = self.rng
        if self.serial > 0 and rng.random() < 0.05:
            self.retire_all()  # everything goes: every segment of the pool falls empty
            return
        has_large = any(e.num_tensors * e.units * e.unit_nbytes > (64 << 20) for e, _ in self.live)
        large = self.serial == 0 or (not has_large and rng.random() < 0.25)
        while len(self.live) >= self.WINDOW:
            self._retire(0)
        if large:
            num_tensors, units = rng.choice((2, 4, 8)), 1
            unit_elems = (rng.randint(70, 126) << 20) // (2 * num_tensors) - rng.randrange(0, 999)
        else:
            num_tensors, units = rng.choice((2, 4, 6)), rng.randint(1, 3)
            unit_elems = rng.choice((1667, 2048, 32769, rng.randint(64, 200_000)))
        self.serial += 1
        spec = self.spec
        keys = tuple(
            (slot, rng.random() < 0.5, (spec.incarnation << 40) | (self.serial << 3) | slot)
            for slot in range(units)
        )
        desc = CacheDesc(num_tensors, [units, unit_elems], DataType.DT_FLOAT16)
        cache = self.kvm.allocate_cache(desc, [self._key(p, k) for _, p, k in keys])
        unit_nbytes = 2 * unit_elems
        for t, address in enumerate(cache.per_device_tensor_addrs[0]):
            memory = memory_at(address, units * unit_nbytes)
            for u in range(units):
                stamp = make_stamp(spec.ref.cluster_id, spec.incarnation, self.serial, t, u)
                fill_unit(memory[u * unit_nbytes : (u + 1) * unit_nbytes], stamp)
        entry = Entry(
            spec.ref.name,
            spec.ref.cluster_id,
            spec.incarnation,
            self.serial,
            "v1",
            num_tensors,
            units,
            unit_elems,
            keys=keys,
        )
        self.live.append((entry, cache))
        self.publish(entry)


class _V2Owner(_Owner):
    """A v2 owner in one-sided mode: numpy memory registered remote-accessible (continuous caches by id,
    blocks caches by model id) and unregistered again while pullers read it."""

    def __init__(self, spec: OwnerSpec, pipe: ChildPipe, datadist: LLMDataDist) -> None:
        super().__init__(spec, pipe)
        self.datadist = datadist
        self.manager = datadist.cache_manager
        self.live: list[tuple[Entry, list[np.ndarray[Any, Any]]]] = []

    def unlink_a_puller(self) -> None:
        """End a v2 puller's link from the serving side, while it may be pulling."""
        info = LLMClusterInfo()
        info.remote_cluster_id = PULLER_CLUSTER_BASE + self.rng.choice((1, 2))
        ret, codes = self.datadist.unlink_clusters([info])
        if codes[0] == LLMStatusCode.LLM_SUCCESS:
            self.pipe.send("event", "owner-side unlink")
        elif codes[0] != LLMStatusCode.LLM_NOT_YET_LINK:  # that puller is relinking now
            self.pipe.send(
                "fail", f"{self.spec.label}: unlink_clusters from the serving side gave {ret.name}"
            )

    def _retire(self, index: int) -> None:
        entry, arrays = self.live.pop(index)
        self.retract(entry)
        self.manager.unregister_cache(entry.cache_id)
        arrays.clear()  # the memory goes back to the allocator: a late reader must not see it

    def retire_all(self) -> None:
        while self.live:
            self._retire(0)

    def step(self) -> None:
        rng = self.rng
        if self.spec.ref.restarting and rng.random() < OWNER_UNLINK_CHANCE:
            self.unlink_a_puller()
        while len(self.live) >= self.WINDOW:
            self._retire(0)
        self.serial += 1
        if self.serial == 1:  # a first pull large enough to start the pullers' copy threads
            kind, num_tensors, units, unit_elems = "cache", 4, 2, (3 << 20) // 2 + 1
        else:
            kind = rng.choice(("cache", "blocks"))
            num_tensors, units = rng.choice((1, 2, 4)), rng.randint(2, 12)
            unit_elems = rng.choice((64, 2049, 32768, rng.randint(64, 400_000)))
        spec = self.spec
        unit_nbytes = 2 * unit_elems
        arrays = [np.empty(units * unit_elems, dtype=np.float16) for _ in range(num_tensors)]
        for t, array in enumerate(arrays):
            raw = array.view(np.uint8)
            for u in range(units):
                stamp = make_stamp(spec.ref.cluster_id, spec.incarnation, self.serial, t, u)
                fill_unit(raw[u * unit_nbytes : (u + 1) * unit_nbytes], stamp)
        desc = CacheDesc(num_tensors, [units, unit_elems], DataType.DT_FLOAT16)
        addrs = [int(a.ctypes.data) for a in arrays]
        model_id = (spec.incarnation << 32) | self.serial  # never reused, not even by a later incarnation
        keys: tuple[tuple[int, bool, int], ...] = ()
        if kind == "cache":  # keys for the leased puller (keys on registered memory are never consumed)
            keys = tuple((u, False, (spec.incarnation << 40) | (self.serial << 4) | u) for u in range(units))
            cache_keys = [CacheKey(spec.ref.cluster_id, key_id) for _, _, key_id in keys]
            cache = self.manager.register_cache(desc, addrs, cache_keys, True)
        else:
            key = BlocksCacheKey(spec.ref.cluster_id, model_id)
            cache = self.manager.register_blocks_cache(desc, addrs, key, True)
        entry = Entry(
            spec.ref.name,
            spec.ref.cluster_id,
            spec.incarnation,
            self.serial,
            kind,
            num_tensors,
            units,
            unit_elems,
            keys=keys,
            cache_id=cache.cache_id,
            model_id=model_id,
        )
        self.live.append((entry, arrays))
        self.publish(entry)


def owner_main(conn: Connection, spec: OwnerSpec, log_path: str) -> None:
    redirect_output(log_path)
    pipe = ChildPipe(conn)
    report_thread_deaths(pipe, spec.label)
    v2 = spec.ref.mode == "v2"
    datadist = LLMDataDist(LLMRole.PROMPT, spec.ref.cluster_id)
    code = 0
    probe = memory_probe(spec.label, 0.0 if spec.ref.restarting else spec.debug_memory_s)
    try:
        datadist.init(options(spec.ref.mode, (spec.ref.ip, spec.ref.port)))
        owner: _Owner = _V2Owner(spec, pipe, datadist) if v2 else _V1Owner(spec, pipe, datadist)
        core = datadist._require_core()  # where its index is: the driver stalls its lock now and then
        pipe.send("up", os.getpid(), core.table.index.name, core.incarnation)
        owner.run()
        if probe is not None:
            probe.final()
    except BaseException:
        pipe.send("fail", f"{spec.label}: {traceback.format_exc().strip()}")
        code = 1
    finally:
        datadist.finalize()
    pipe.send("stopped")
    conn.close()
    sys.exit(code)
