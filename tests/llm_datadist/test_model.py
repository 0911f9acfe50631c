"""A stateful, model-based test with real processes: one owner and two pullers, each a real `LLMDataDist`
in a spawned child (tests/_model_peer.py), driven by a hypothesis `RuleBasedStateMachine` through
allocations, deallocations, registrations, key removals, pulls (by key, by cache id and index, by blocks),
pushes, links, unlinks, SIGKILLs of the owner and restarts of a new owner at the same ip:port.

Each rule asks an executable model of the reference semantics (a small class per side: the owner's caches,
keys with their un-pulled tensors, the blocks index, each puller's link and the owner incarnation it
reached) what must happen, makes the real call, compares the outcome (success with the exact bytes, or the
exact `LLMStatusCode`), then updates the model. Invariants after every step: the owner's server still
answers a fresh link (and, in v1, every healthy link's `check_link_status`), and the owner's table holds
exactly the caches and keys the model holds (deferred frees included).

Two machines: v1 (`KvCacheManager`: PROMPT owner, DECODER pullers, key consumption of reference §9.4,
deferred frees, `transfer_cache_async` pushes) and v2 (`CacheManager` with remote cache access: pool and
registered numpy memory, one-sided `pull_cache`/`pull_blocks` by `CacheKeyByIdAndIndex`/`BlocksCacheKey`,
`push_cache`/`push_blocks`, `unregister_cache`).

Replaying a failure: hypothesis prints the shrunk program (`state = V1Machine()`, then one line per step)
and the seed it ran with; `LLM_DATADIST_TEST_SEED=<seed> pytest tests/llm_datadist/test_model.py` runs the
same examples again (the owner's bytes are a fixed function of incarnation, cache id and tensor), and the
printed `@reproduce_failure(...)` blob replays one program exactly. Knobs: `LLM_DATADIST_MODEL_EXAMPLES`
(examples per machine), `LLM_DATADIST_MODEL_DEBUG=1` (print every program), `LLM_DATADIST_MODEL_SHRINK_S`
(bound on shrinking).

What it found, all fixed: a one-sided puller kept reading and writing the cache a model id named when it
fetched the owner's table after the owner bound that model id to a newer cache; on a link to a killed
owner, one-sided calls checked their arguments against the dead owner's table (LLM_PARAM_INVALID) before
the link error; after a restart had reaped the dead owner's segments, a pull on the old link gave
LLM_FAILED instead of LLM_LINK_FAILED.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    initialize,
    invariant,
    precondition,
    rule,
)

from llm_datadist import LLMConfig, LLMStatusCode
from tests._model_peer import IP, LOCAL_ID, Node, Outcome, pattern, probe

S = LLMStatusCode
OWNER = 1
PULLERS = (2, 3)
PROBE = 9  # the cluster id of the invariant's throwaway link
V1_PORT = 23700
V2_PORT = 23701
U64_MAX = 2**64 - 1
BYTES_SEED = 0x5EED  # the owner's bytes are pattern(BYTES_SEED, incarnation tag, cache id, tensor)

NUM_TENSORS = 4  # 2 layers of K, V
SLOT_ELEMS = 51  # 102-byte slots (odd on purpose)
BLOCK_ELEMS = 33  # 66-byte blocks
OWNER_BLOCKS = 5
PULLER_BLOCKS = 3
SLOT_NBYTES = SLOT_ELEMS * 2
BLOCK_NBYTES = BLOCK_ELEMS * 2
MAX_KILLS = 2  # per example: restarts spawn a process, the slowest step

EXAMPLES = int(os.environ.get("LLM_DATADIST_MODEL_EXAMPLES", "50"))
STEPS = 30
SHRINK_S = int(os.environ.get("LLM_DATADIST_MODEL_SHRINK_S", "100"))
POOL = json.dumps({"memory_size": 4 << 20, "page_shift": 12})

# What a puller's next operation gives on a link whose owner was killed (the owner it linked to is gone,
# whether or not a new one serves the same address now): pinned from what the library gives.
BROKEN_LINK = S.LLM_LINK_FAILED


def _tensors(layer: int | None) -> range:
    return range(NUM_TENSORS) if layer is None else range(2 * layer, 2 * layer + 2)


# ----------------------------------------------------------------------------- the model


@dataclass
class MCache:
    """One cache in the owner's table: present until freed (v1: no external reference and no key left)
    or unregistered."""

    cache_id: int
    blocks: bool
    batch: int  # slots, or blocks
    registered: bool = False
    external: bool = True
    keys: set[tuple[str, int]] = field(default_factory=set)
    content: list[np.ndarray] = field(default_factory=list)  # the expected bytes of each tensor

    @property
    def unit_nbytes(self) -> int:
        return BLOCK_NBYTES if self.blocks else SLOT_NBYTES

    def unit(self, t: int, index: int) -> np.ndarray:
        return self.content[t][index * self.unit_nbytes : (index + 1) * self.unit_nbytes]


@dataclass
class MKey:
    cache_id: int
    slot: int
    unpulled: set[int]


@dataclass
class OwnerModel:
    """The owner incarnation's state as the reference says it must be."""

    tag: int
    alive: bool = True
    next_cache_id: int = 1  # ids count from 1 and are never reused (reference §9.1)
    caches: dict[int, MCache] = field(default_factory=dict)
    ever: list[int] = field(default_factory=list)  # every cache id handed out, in order
    ever_blocks: set[int] = field(default_factory=set)
    registered_ever: set[int] = field(default_factory=set)
    keys: dict[tuple[str, int], MKey] = field(default_factory=dict)  # ("req" | "prefix", id) -> binding
    keys_ever: list[tuple[str, int]] = field(default_factory=list)
    blocks_index: dict[int, int] = field(default_factory=dict)  # model_id -> cache_id
    next_key_id: int = 100

    def new_cache(self, blocks: bool, batch: int, registered: bool = False) -> MCache:
        cache_id = self.next_cache_id
        self.next_cache_id += 1
        nbytes = batch * (BLOCK_NBYTES if blocks else SLOT_NBYTES)
        content = [pattern(BYTES_SEED, self.tag, cache_id, t, nbytes) for t in range(NUM_TENSORS)]
        cache = MCache(cache_id, blocks, batch, registered, content=content)
        self.caches[cache_id] = cache
        self.ever.append(cache_id)
        if blocks:
            self.ever_blocks.add(cache_id)
        if registered:
            self.registered_ever.add(cache_id)
        return cache

    def unbind(self, key: tuple[str, int]) -> None:
        binding = self.keys.pop(key, None)
        if binding is None:
            return
        cache = self.caches[binding.cache_id]
        cache.keys.discard(key)
        self.maybe_free(cache)

    def maybe_free(self, cache: MCache) -> None:
        if not cache.external and not cache.keys:
            self.forget(cache.cache_id)

    def forget(self, cache_id: int) -> None:
        self.caches.pop(cache_id, None)
        for model_id in [m for m, c in self.blocks_index.items() if c == cache_id]:
            del self.blocks_index[model_id]

    def slot_key(self, cache_id: int, slot: int) -> tuple[str, int] | None:
        for key, binding in self.keys.items():
            if key[0] == "req" and binding.cache_id == cache_id and binding.slot == slot:
                return key
        return None

    def consume(self, key: tuple[str, int] | None, tensors: range) -> None:
        """A pull of `tensors` through req key `key`: the key goes once every tensor was pulled (§9.4)."""
        if key is None or key[0] != "req":
            return
        binding = self.keys[key]
        binding.unpulled -= set(tensors)
        if not binding.unpulled:
            self.unbind(key)


# ----------------------------------------------------------------------------- the processes


class Cluster:
    """The processes, kept across examples (a new example re-inits their LLMDataDists): an owner, which
    kill/restart replace, two pullers, and a spare process started ahead so that a restart is cheap."""

    def __init__(self) -> None:
        self.owner: Node | None = None
        self.spare: Node | None = None
        self.pullers: list[Node] = []
        self.tags = itertools.count(1)

    def start(self) -> None:
        self.owner = Node("owner", BYTES_SEED)
        self.pullers = [Node(f"puller{c}", BYTES_SEED) for c in PULLERS]
        self.spare = Node("owner", BYTES_SEED)
        for node in (self.owner, *self.pullers):
            node.ready()

    def new_owner(self) -> Node:
        """The spare becomes the owner (a process that has not run an LLMDataDist yet); another spare
        starts in the background."""
        if self.owner is not None:
            self.owner.close()
        assert self.spare is not None
        self.owner, self.spare = self.spare.ready(), Node("owner", BYTES_SEED)
        return self.owner

    def close(self) -> None:
        for node in (*self.pullers, self.owner, self.spare):
            if node is not None:
                node.close()


_CLUSTER: Cluster | None = None
TALLY: collections.Counter[str] = collections.Counter()  # outcomes seen, printed after each machine


def _options(v2: bool, port: int | None) -> dict[str, str]:
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = 5000
    if port is not None:
        config.listen_ip_info = f"{IP}:{port}"
    options = dict(config.generate_options())
    if v2:
        options.update(
            {
                "llm.EnableCacheManager": "1",
                "llm.EnableRemoteCacheAccessible": "1",
                "llm.MemPoolConfig": POOL,
                "llm.HostMemPoolConfig": POOL,
            }
        )
    return options


def _name(code: int | None) -> str:
    return "success" if code is None else S(code).name


# ----------------------------------------------------------------------------- the machines


class _Machine(RuleBasedStateMachine):
    """What both modes share: processes, links, kill and restart, the invariants."""

    V2: ClassVar[bool] = False
    PORT: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        assert _CLUSTER is not None
        self.cluster = _CLUSTER
        self.owner_model = OwnerModel(tag=0, alive=False)
        self.links: list[int | None] = [None, None]  # per puller: the owner tag it linked to
        self.local_addrs: list[list[int]] = []  # per puller: its "cont" cache's tensor addresses
        self.kills = 0

    # ------------------------------------------------------------------ helpers

    @property
    def owner(self) -> Node:
        assert self.cluster.owner is not None
        return self.cluster.owner

    def _init_owner(self) -> None:
        tag = next(self.cluster.tags)
        self.owner.ok("init", "prompt", OWNER, _options(self.V2, self.PORT), tag)
        self.owner_model = OwnerModel(tag=tag)

    def _link_state(self, p: int) -> int | None:
        """The code any remote operation of puller `p` must give because of its link, or None (healthy)."""
        tag = self.links[p]
        if tag is None:
            return int(S.LLM_NOT_YET_LINK)
        if not self.owner_model.alive or tag != self.owner_model.tag:
            return int(BROKEN_LINK)
        return None

    def _healthy(self) -> list[int]:
        return [p for p in range(2) if self._link_state(p) is None]

    def _check(self, outcome: Outcome, expected: int | None, what: str) -> None:
        TALLY[f"{what.split('(')[0]}: {_name(outcome.code)}"] += 1
        assert outcome.code == expected, (
            f"{what}: expected {_name(expected)}, got {_name(outcome.code)} {outcome.message}"
        )

    def _sync_peers(self) -> None:
        """Wait until the owner's server lists exactly the healthy pullers (an unlink, forced or not, and a
        puller's finalize reach it asynchronously)."""
        if not self.owner_model.alive:
            return
        expected = sorted(PULLERS[p] for p in self._healthy())
        peers = self.owner.ok("wait_peers", expected)
        assert peers == expected, f"owner's peers {peers}, expected {expected}"

    def _pick(self, items: list[Any], pick: int) -> Any:
        return items[pick % len(items)]

    # ------------------------------------------------------------------ set-up

    @initialize()
    def start(self) -> None:
        for p, node in enumerate(self.cluster.pullers):
            node.ok("init", "decoder", PULLERS[p], _options(self.V2, None), 0)
            self._make_locals(node)
        if not self.owner.alive:
            self.cluster.new_owner()
        self._init_owner()
        self._populate()
        for p in range(2):
            self._link(p)

    def _make_locals(self, node: Node) -> None:
        """Each puller's destination (and push source) caches: one slot, and a few blocks."""
        self.local_addrs.append(node.ok("make_local", "cont", NUM_TENSORS, [1, SLOT_ELEMS], False))
        node.ok("make_local", "blocks", NUM_TENSORS, [PULLER_BLOCKS, BLOCK_ELEMS], True)

    def _populate(self) -> None:
        """What every example starts with (so that most steps have something to work on)."""

    # ------------------------------------------------------------------ links

    def _link(self, p: int) -> None:
        if self.links[p] is not None:
            expected: int = int(S.LLM_ALREADY_LINK)
        elif not self.owner_model.alive:
            expected = int(S.LLM_LINK_FAILED)
        else:
            expected = int(S.LLM_SUCCESS)
        codes = self.cluster.pullers[p].ok("link", OWNER, self.PORT)
        TALLY[f"link: {S(codes[0]).name}"] += 1
        assert codes == [expected, expected], f"link: expected {S(expected).name}, got {codes}"
        if expected == S.LLM_SUCCESS:
            self.links[p] = self.owner_model.tag
            self._sync_peers()

    def _unlink(self, p: int, force: bool) -> None:
        # A forced unlink of a cluster with no link succeeds, as the real UnlinkCluster's force flag.
        expected = int(S.LLM_NOT_YET_LINK) if self.links[p] is None and not force else int(S.LLM_SUCCESS)
        codes = self.cluster.pullers[p].ok("unlink", OWNER, self.PORT, force)
        TALLY[f"unlink{' force' if force else ''}: {S(codes[0]).name}"] += 1
        assert codes == [expected, expected], f"unlink: expected {S(expected).name}, got {codes}"
        self.links[p] = None
        self._sync_peers()

    @rule(p=st.integers(0, 1), twice=st.booleans())
    def link(self, p: int, twice: bool) -> None:
        """Link (a second link_clusters to the same cluster: LLM_ALREADY_LINK, even over a dead link)."""
        self._link(p)
        if twice:
            self._link(p)

    @precondition(lambda self: self.owner_model.alive and len(self._healthy()) < 2)
    @rule(pick=st.integers(0, 1))
    def recover(self, pick: int) -> None:
        """What a puller does after its owner died (or it unlinked): unlink (force), then link afresh."""
        p = self._pick([q for q in range(2) if self._link_state(q) is not None], pick)
        if self.links[p] is not None:
            self._unlink(p, True)
        self._link(p)

    @precondition(lambda self: any(tag is not None for tag in self.links))
    @rule(pick=st.integers(0, 1), force=st.booleans(), twice=st.booleans())
    def unlink(self, pick: int, force: bool, twice: bool) -> None:
        """Unlink a linked puller (again: LLM_NOT_YET_LINK in the per-cluster list, SUCCESS if forced)."""
        p = self._pick([q for q in range(2) if self.links[q] is not None], pick)
        self._unlink(p, force)
        if twice:
            self._unlink(p, force)

    # ------------------------------------------------------------------ the owner dies, another comes

    @precondition(lambda self: self.owner_model.alive and self.kills < MAX_KILLS)
    @rule()
    def kill(self) -> None:
        self.owner.kill()
        self.kills += 1
        self.owner_model.alive = False

    @precondition(lambda self: not self.owner_model.alive)
    @rule()
    def restart(self) -> None:
        self.cluster.new_owner()
        self._init_owner()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def owner_serves(self) -> None:
        if not self.owner_model.alive:
            return
        assert self.owner.alive, "the owner process died"
        reason = probe(self.PORT, OWNER, PROBE)
        assert reason is None, f"the owner's server does not serve: {reason}"

    @invariant()
    def owner_table_matches_the_model(self) -> None:
        if not self.owner_model.alive:
            return
        stats = self.owner.ok("stats")
        # Every pull ended before this look: no lease, no pin in the owner's index.
        expected = {
            "caches": len(self.owner_model.caches),
            "keys": len(self.owner_model.keys),
            "leases": 0,
            "pins": 0,
        }
        got = {name: stats[name] for name in expected}
        assert got == expected, f"owner table {got}, model {expected}"


class V1Machine(_Machine):
    """KvCacheManager mode: a PROMPT owner with listen_ip_info, DECODER pullers."""

    V2 = False
    PORT = V1_PORT

    # ------------------------------------------------------------------ owner: memory and keys

    @precondition(lambda self: self.owner_model.alive and len(self.owner_model.caches) < 8)
    @rule(
        kinds=st.lists(st.sampled_from(["req", "prefix", "pad", "again"]), min_size=1, max_size=2),
        pick=st.integers(0, 2**16),
    )
    def alloc(self, kinds: list[str], pick: int) -> None:
        """A continuous cache with one key per slot: a new req or prefix key, padding, or again a key made
        before (refused with LLM_PARAM_INVALID if it is still bound)."""
        model = self.owner_model
        keys: list[tuple[str, int] | None] = []
        for kind in kinds:
            if kind == "pad":
                keys.append(None)
            elif kind == "again" and model.keys_ever:
                keys.append(self._pick(model.keys_ever, pick))
            else:
                model.next_key_id += 1
                keys.append(("prefix" if kind == "prefix" else "req", model.next_key_id))
        bound = [k for k in keys if k is not None and k in model.keys]
        wire = [self._wire_key(k) for k in keys]
        outcome = self.owner.call("alloc", NUM_TENSORS, [len(kinds), SLOT_ELEMS], wire, None)
        if bound:
            self._check(outcome, int(S.LLM_PARAM_INVALID), f"alloc with a bound key({bound})")
            return
        self._check(outcome, None, "alloc")
        assert outcome.value == model.next_cache_id, (
            f"cache id {outcome.value}, expected {model.next_cache_id}"
        )
        cache = model.new_cache(False, len(kinds))
        bindings: dict[tuple[str, int], int] = {}
        for slot, key in enumerate(keys):
            if key is not None:
                bindings[key] = slot  # v1: the same key twice in one call, the last slot wins
        for key, slot in bindings.items():
            model.keys[key] = MKey(cache.cache_id, slot, set(range(NUM_TENSORS)))
            cache.keys.add(key)
            if key not in model.keys_ever:
                model.keys_ever.append(key)

    @staticmethod
    def _wire_key(key: tuple[str, int] | None) -> tuple[int, int, int, int]:
        if key is None:
            return (OWNER, U64_MAX, 0, U64_MAX)
        if key[0] == "req":
            return (OWNER, key[1], 0, U64_MAX)
        return (OWNER, U64_MAX, 0, key[1])

    @precondition(lambda self: self.owner_model.alive and len(self.owner_model.caches) < 8)
    @rule(model_id=st.integers(0, 1))
    def alloc_blocks(self, model_id: int) -> None:
        model = self.owner_model
        outcome = self.owner.call("alloc", NUM_TENSORS, [OWNER_BLOCKS, BLOCK_ELEMS], [], model_id)
        self._check(outcome, None, "alloc_blocks")
        assert outcome.value == model.next_cache_id
        cache = model.new_cache(True, OWNER_BLOCKS)
        model.blocks_index[model_id] = cache.cache_id  # the newest cache under a model id wins (§6.4)

    @precondition(lambda self: self.owner_model.alive and self.owner_model.ever)
    @rule(pick=st.integers(0, 2**16))
    def dealloc(self, pick: int) -> None:
        """Drop the cache's own reference (again: a no-op); the memory goes when no key is left."""
        model = self.owner_model
        cache_id = self._pick(model.ever, pick)
        self._check(self.owner.call("dealloc", cache_id), None, f"dealloc({cache_id})")
        cache = model.caches.get(cache_id)
        if cache is not None and cache.external:
            cache.external = False
            for model_id in [m for m, c in model.blocks_index.items() if c == cache_id]:
                del model.blocks_index[model_id]
            model.maybe_free(cache)

    @precondition(lambda self: self.owner_model.alive)
    @rule(pick=st.integers(0, 2**16))
    def remove_key(self, pick: int) -> None:
        model = self.owner_model
        key = self._pick([*model.keys_ever, ("req", 1)], pick)  # ("req", 1) was never bound
        self._check(self.owner.call("remove_key", self._wire_key(key)), None, f"remove_cache_key({key})")
        model.unbind(key)

    # ------------------------------------------------------------------ pullers

    def _slot_bytes(self, cache: MCache, slot: int, layer: int | None) -> list[bytes]:
        """What the puller's one-slot destination holds after pulling `slot` (zeros elsewhere)."""
        tensors = _tensors(layer)
        return [
            cache.unit(t, slot).tobytes() if t in tensors else bytes(SLOT_NBYTES) for t in range(NUM_TENSORS)
        ]

    @rule(
        p=st.integers(0, 1),
        by_id=st.booleans(),
        pick=st.integers(0, 2**16),
        slot=st.integers(0, 1),
        layer=st.sampled_from([None, 0, 1]),
        live=st.booleans(),
    )
    def pull_cache(self, p: int, by_id: bool, pick: int, slot: int, layer: int | None, live: bool) -> None:
        """By key or by cache id and slot, whole or one layer; `live` picks among what the model holds,
        else among everything this owner ever had (and one that never existed)."""
        model = self.owner_model
        expected_code = self._link_state(p)
        expected_bytes: list[bytes] | None = None
        consume: tuple[str, int] | None = None
        tensors = _tensors(layer)
        if by_id:
            continuous = [c for c in model.ever if c not in model.ever_blocks]
            held = [c for c in continuous if c in model.caches]
            # model.next_cache_id does not exist (yet).
            cache_id = self._pick(held if live and held else [*continuous, model.next_cache_id], pick)
            wire: tuple[Any, ...] = ("id", OWNER, cache_id, slot)
            what = f"pull_cache by id(CacheKeyByIdAndIndex({cache_id}, {slot}), layer {layer})"
            if expected_code is None:
                cache = model.caches.get(cache_id)
                if cache is None:
                    expected_code = int(S.LLM_KV_CACHE_NOT_EXIST)
                elif slot >= cache.batch:
                    expected_code = int(S.LLM_PARAM_INVALID)
                else:
                    expected_bytes = self._slot_bytes(cache, slot, layer)
                    consume = model.slot_key(cache_id, slot)
        else:
            bound = list(model.keys)
            key = self._pick(bound if live and bound else [*model.keys_ever, ("req", 1)], pick)
            wire = ("req", *self._wire_key(key))
            what = f"pull_cache by key({key}, layer {layer})"
            if expected_code is None:
                binding = model.keys.get(key)
                if binding is None:
                    expected_code = int(S.LLM_KV_CACHE_NOT_EXIST)
                else:
                    expected_bytes = self._slot_bytes(model.caches[binding.cache_id], binding.slot, layer)
                    consume = key
        layers = None if layer is None else (layer, layer + 1)
        outcome = self.cluster.pullers[p].call("pull_cache", wire, layers)
        self._check(outcome, expected_code, what)
        if expected_bytes is not None:
            assert outcome.value == expected_bytes, f"{what}: wrong bytes"
            model.consume(consume, tensors)

    @rule(
        p=st.integers(0, 1),
        model_id=st.integers(0, 1),
        src=st.permutations(range(OWNER_BLOCKS)),
        dst=st.permutations(range(PULLER_BLOCKS)),
        count=st.integers(1, PULLER_BLOCKS),
    )
    def pull_blocks(self, p: int, model_id: int, src: list[int], dst: list[int], count: int) -> None:
        """Blocks keys are never consumed; a model id names the newest blocks cache registered under it."""
        model = self.owner_model
        src_blocks, dst_blocks = list(src[:count]), list(dst[:count])
        expected_code = self._link_state(p)
        expected_bytes = None
        if expected_code is None:
            cache_id = model.blocks_index.get(model_id)
            if cache_id is None:
                expected_code = int(S.LLM_KV_CACHE_NOT_EXIST)
            else:
                cache = model.caches[cache_id]
                expected_bytes = []
                for t in range(NUM_TENSORS):
                    local = bytearray(PULLER_BLOCKS * BLOCK_NBYTES)
                    for s, d in zip(src_blocks, dst_blocks, strict=True):
                        local[d * BLOCK_NBYTES : (d + 1) * BLOCK_NBYTES] = cache.unit(t, s).tobytes()
                    expected_bytes.append(bytes(local))
        outcome = self.cluster.pullers[p].call("pull_blocks", OWNER, model_id, src_blocks, dst_blocks)
        what = f"pull_blocks(model_id {model_id}, {src_blocks} -> {dst_blocks})"
        self._check(outcome, expected_code, what)
        if expected_bytes is not None:
            assert outcome.value == expected_bytes, f"{what}: wrong bytes"

    @precondition(lambda self: self.owner_model.alive)
    @rule(p=st.integers(0, 1), pick=st.integers(0, 2**16), slot=st.integers(0, 1))
    def push(self, p: int, pick: int, slot: int) -> None:
        """transfer_cache_async from the owner into the puller's cache: only to a puller linked to it."""
        model = self.owner_model
        sources = [c.cache_id for c in model.caches.values() if c.external and not c.blocks]
        if not sources:
            return
        cache = model.caches[self._pick(sources, pick)]
        slot = min(slot, cache.batch - 1)
        puller = self.cluster.pullers[p]
        puller.ok("zero_local", "cont")
        outcome = self.owner.call("transfer", cache.cache_id, PULLERS[p], self.local_addrs[p], slot)
        what = f"transfer_cache_async(cache {cache.cache_id} slot {slot} -> puller {p})"
        if self._link_state(p) is not None:
            self._check(outcome, int(S.LLM_NOT_YET_LINK), what)
            return
        self._check(outcome, None, what)
        assert outcome.value == [0, 0], f"{what}: task codes {outcome.value}"
        got = puller.ok("local_bytes", "cont")
        assert got == self._slot_bytes(cache, slot, None), f"{what}: wrong bytes"

    def _populate(self) -> None:
        self.alloc(["req", "prefix"], 0)
        self.alloc_blocks(0)

    @rule(p=st.integers(0, 1))
    def check_link_status(self, p: int) -> None:
        outcome = self.cluster.pullers[p].call("check_link", OWNER)
        self._check(outcome, self._link_state(p), "check_link_status")

    @invariant()
    def healthy_links_answer(self) -> None:
        for p in self._healthy():
            outcome = self.cluster.pullers[p].call("check_link", OWNER)
            self._check(outcome, None, f"check_link_status invariant(puller {p})")


class V2Machine(_Machine):
    """CacheManager mode with remote cache access: every side may pull and push; the owner listens."""

    V2 = True
    PORT = V2_PORT

    def _populate(self) -> None:
        self.alloc(False, None)
        self.alloc(True, 0)

    # ------------------------------------------------------------------ owner: memory

    def _new(self, outcome: Outcome, blocks: bool, registered: bool, model_id: int | None, what: str) -> None:
        model = self.owner_model
        self._check(outcome, None, what)
        assert outcome.value == model.next_cache_id, (
            f"cache id {outcome.value}, expected {model.next_cache_id}"
        )
        cache = model.new_cache(blocks, OWNER_BLOCKS if blocks else 2, registered)
        if model_id is not None:
            model.blocks_index[model_id] = cache.cache_id  # the newest cache under a model id wins (§6.4)

    @precondition(lambda self: self.owner_model.alive and len(self.owner_model.caches) < 8)
    @rule(blocks=st.booleans(), model_id=st.sampled_from([None, 0, 1]))
    def alloc(self, blocks: bool, model_id: int | None) -> None:
        """A pool cache: 2 slots, or blocks (under BlocksCacheKey(model_id), or none)."""
        shape = [OWNER_BLOCKS, BLOCK_ELEMS] if blocks else [2, SLOT_ELEMS]
        wire_model = (-1 if model_id is None else model_id) if blocks else None
        outcome = self.owner.call("alloc", NUM_TENSORS, shape, [], wire_model)
        self._new(outcome, blocks, False, model_id if blocks else None, "allocate(pool)")

    @precondition(lambda self: self.owner_model.alive and len(self.owner_model.caches) < 8)
    @rule(blocks=st.booleans(), model_id=st.sampled_from([None, 0, 1]))
    def register(self, blocks: bool, model_id: int | None) -> None:
        """numpy memory of the owner, registered (remote accessible)."""
        shape = [OWNER_BLOCKS, BLOCK_ELEMS] if blocks else [2, SLOT_ELEMS]
        wire_model = (-1 if model_id is None else model_id) if blocks else None
        outcome = self.owner.call("register", NUM_TENSORS, shape, wire_model)
        self._new(outcome, blocks, True, model_id if blocks else None, "register")

    def _ever(self, registered: bool) -> list[int]:
        model = self.owner_model
        return [c for c in model.ever if (c in model.registered_ever) == registered]

    @precondition(lambda self: self.owner_model.alive and self._ever(False))
    @rule(pick=st.integers(0, 2**16))
    def dealloc(self, pick: int) -> None:
        """deallocate_cache / deallocate_blocks_cache of a pool cache (no keys: freed at once)."""
        model = self.owner_model
        held = [c for c in self._ever(False) if c in model.caches]
        if not held:
            return
        cache_id = self._pick(held, pick)
        self._check(self.owner.call("dealloc", cache_id), None, f"deallocate({cache_id})")
        model.forget(cache_id)

    @precondition(lambda self: self.owner_model.alive and self._ever(True))
    @rule(pick=st.integers(0, 2**16))
    def unregister(self, pick: int) -> None:
        """unregister_cache by id (of a cache unregistered before too: a no-op)."""
        model = self.owner_model
        cache_id = self._pick(self._ever(True), pick)
        self._check(self.owner.call("unregister", cache_id), None, f"unregister_cache({cache_id})")
        model.forget(cache_id)

    @precondition(lambda self: self.owner_model.alive and self.owner_model.caches)
    @rule(pick=st.integers(0, 2**16))
    def rewrite(self, pick: int) -> None:
        """The owner writes new data into a cache's memory: one-sided readers must see it."""
        model = self.owner_model
        cache = model.caches[self._pick(sorted(model.caches), pick)]
        tag = next(self.cluster.tags)
        self.owner.ok("rewrite", cache.cache_id, tag)
        nbytes = len(cache.content[0])
        cache.content = [pattern(BYTES_SEED, tag, cache.cache_id, t, nbytes) for t in range(NUM_TENSORS)]

    # ------------------------------------------------------------------ pullers

    def _by_id(self, pick: int, live: bool) -> int:
        model = self.owner_model
        held = sorted(model.caches)
        return int(self._pick(held if live and held else [*model.ever, model.next_cache_id], pick))

    def _slot_target(self, p: int, cache_id: int, slot: int) -> tuple[int | None, MCache | None]:
        code = self._link_state(p)
        if code is not None:
            return code, None
        cache = self.owner_model.caches.get(cache_id)
        if cache is None:
            return int(S.LLM_KV_CACHE_NOT_EXIST), None
        if cache.blocks or slot >= cache.batch:
            return int(S.LLM_PARAM_INVALID), None
        return None, cache

    def _blocks_target(self, p: int, model_id: int) -> tuple[int | None, MCache | None]:
        code = self._link_state(p)
        if code is not None:
            return code, None
        cache_id = self.owner_model.blocks_index.get(model_id)
        if cache_id is None:
            return int(S.LLM_KV_CACHE_NOT_EXIST), None
        return None, self.owner_model.caches[cache_id]

    @rule(
        p=st.integers(0, 1),
        pick=st.integers(0, 2**16),
        slot=st.integers(0, 2),
        layer=st.sampled_from([None, 0, 1]),
        live=st.booleans(),
    )
    def pull_cache(self, p: int, pick: int, slot: int, layer: int | None, live: bool) -> None:
        """One-sided pull_cache by CacheKeyByIdAndIndex (keys are never touched in this mode)."""
        cache_id = self._by_id(pick, live)
        code, cache = self._slot_target(p, cache_id, slot)
        layers = None if layer is None else (layer, layer + 1)
        outcome = self.cluster.pullers[p].call("pull_cache", ("id", OWNER, cache_id, slot), layers)
        what = f"pull_cache(CacheKeyByIdAndIndex({cache_id}, {slot}), layer {layer})"
        self._check(outcome, code, what)
        if cache is not None:
            tensors = _tensors(layer)
            expected = [
                cache.unit(t, slot).tobytes() if t in tensors else bytes(SLOT_NBYTES)
                for t in range(NUM_TENSORS)
            ]
            assert outcome.value == expected, f"{what}: wrong bytes"

    @rule(
        p=st.integers(0, 1),
        model_id=st.integers(0, 1),
        src=st.permutations(range(OWNER_BLOCKS)),
        dst=st.permutations(range(PULLER_BLOCKS)),
        count=st.integers(1, PULLER_BLOCKS),
    )
    def pull_blocks(self, p: int, model_id: int, src: list[int], dst: list[int], count: int) -> None:
        src_blocks, dst_blocks = list(src[:count]), list(dst[:count])
        code, cache = self._blocks_target(p, model_id)
        outcome = self.cluster.pullers[p].call("pull_blocks", OWNER, model_id, src_blocks, dst_blocks)
        what = f"pull_blocks(model_id {model_id}, {src_blocks} -> {dst_blocks})"
        self._check(outcome, code, what)
        if cache is not None:
            expected = []
            for t in range(NUM_TENSORS):
                local = bytearray(PULLER_BLOCKS * BLOCK_NBYTES)
                for s, d in zip(src_blocks, dst_blocks, strict=True):
                    local[d * BLOCK_NBYTES : (d + 1) * BLOCK_NBYTES] = cache.unit(t, s).tobytes()
                expected.append(bytes(local))
            assert outcome.value == expected, f"{what}: wrong bytes"

    @rule(
        p=st.integers(0, 1),
        pick=st.integers(0, 2**16),
        slot=st.integers(0, 2),
        layer=st.sampled_from([None, 0, 1]),
        live=st.booleans(),
    )
    def push_cache(self, p: int, pick: int, slot: int, layer: int | None, live: bool) -> None:
        """push_cache of the puller's slot (new bytes each time) into an owner slot, whole or one layer."""
        cache_id = self._by_id(pick, live)
        code, cache = self._slot_target(p, cache_id, slot)
        puller = self.cluster.pullers[p]
        tag = next(self.cluster.tags)
        puller.ok("local_fill", "cont", tag)
        layers = None if layer is None else (layer, layer + 1)
        outcome = puller.call("push_cache", OWNER, cache_id, slot, layers)
        self._check(outcome, code, f"push_cache(CacheKeyByIdAndIndex({cache_id}, {slot}), layer {layer})")
        if cache is not None:
            for t in _tensors(layer):
                cache.unit(t, slot)[:] = pattern(BYTES_SEED, tag, LOCAL_ID, t, SLOT_NBYTES)

    @rule(
        p=st.integers(0, 1),
        model_id=st.integers(0, 1),
        src=st.permutations(range(PULLER_BLOCKS)),
        dst=st.permutations(range(OWNER_BLOCKS)),
        count=st.integers(1, PULLER_BLOCKS),
    )
    def push_blocks(self, p: int, model_id: int, src: list[int], dst: list[int], count: int) -> None:
        src_blocks, dst_blocks = list(src[:count]), list(dst[:count])
        code, cache = self._blocks_target(p, model_id)
        puller = self.cluster.pullers[p]
        tag = next(self.cluster.tags)
        puller.ok("local_fill", "blocks", tag)
        outcome = puller.call("push_blocks", OWNER, model_id, src_blocks, dst_blocks)
        self._check(outcome, code, f"push_blocks(model_id {model_id}, {src_blocks} -> {dst_blocks})")
        if cache is not None:
            for t in range(NUM_TENSORS):
                local = pattern(BYTES_SEED, tag, LOCAL_ID, t, PULLER_BLOCKS * BLOCK_NBYTES)
                for s, d in zip(src_blocks, dst_blocks, strict=True):
                    cache.unit(t, d)[:] = local[s * BLOCK_NBYTES : (s + 1) * BLOCK_NBYTES]

    @invariant()
    def owner_bytes_match_the_model(self) -> None:
        """Every owner cache holds what the model says (pushes landed where they should, nowhere else)."""
        if not self.owner_model.alive:
            return
        for cache_id, cache in self.owner_model.caches.items():
            got = self.owner.ok("bytes", cache_id)
            assert got == [c.tobytes() for c in cache.content], f"owner cache {cache_id} holds other bytes"


# ----------------------------------------------------------------------------- running them


def _run(machine: type[_Machine], seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    global _CLUSTER
    # Every shrink attempt replays a whole program against real processes: bound the shrinking (hypothesis
    # stops after 300 s by default) so that a failure is reported well within the test's timeout.
    from hypothesis.internal.conjecture import engine

    monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", SHRINK_S, raising=False)
    cluster = Cluster()
    _CLUSTER = cluster
    try:
        cluster.start()
        test = get_state_machine_test(
            machine,
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=STEPS,
                deadline=None,
                database=None,
                print_blob=True,
                verbosity=Verbosity.debug if os.environ.get("LLM_DATADIST_MODEL_DEBUG") else Verbosity.normal,
                phases=[Phase.explicit, Phase.generate, Phase.shrink],
                suppress_health_check=list(HealthCheck),
            ),
        )
        print(f"{machine.__name__}: hypothesis seed {seed} (replay: LLM_DATADIST_TEST_SEED={seed})")
        TALLY.clear()
        hypothesis_seed(seed)(test)()
        print(f"{machine.__name__} outcomes: {dict(sorted(TALLY.items()))}")
    finally:
        _CLUSTER = None
        cluster.close()
        from llm_datadist._shm.reaper import reap

        reap()  # what a SIGKILLed owner left, if no survivor noticed it


@pytest.mark.timeout(300)
def test_v1_model(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(V1Machine, seed, monkeypatch)


@pytest.mark.timeout(300)
def test_v2_model(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(V2Machine, seed, monkeypatch)
