"""`llm-datadist soak`: a churn soak through the public API only, in real spawned processes.

Rules: four owners (v1 and v2, one of each long-lived, one of each restarted at the same address by SIGKILL
or `finalize()`) allocate, register, free and unregister caches while three pullers pull and verify every
byte; the driver relays the owners' catalogues, samples every process's RSS, fds, threads and /dev/shm
mappings at two quiescent checkpoints, and exits 0 only when nothing failed and every figure is flat.
With `--hosts` the owners run in one network namespace and the pullers in another (two "hosts" joined by
a veth pair), linked over TCP with a fresh secret, the bytes moved by the transfer engine.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np
import psutil

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)
from llm_datadist._netns import Hosts, NamespacePair, in_netns, sigterm_as_exit

IP = "127.0.0.1"
PORT_RANGE = (26000, 26999)
SYNC_KV_TIMEOUT_MS = 10_000  # generous: 8 busy processes share 2 cores; a real hang still shows
LINK_TIMEOUT_MS = 10_000
HEARTBEAT_S = 0.5
HANG_S = 30.0  # a process silent this long is hung
START_TIMEOUT_S = 60.0  # spawn + imports + init under load
WARM_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
RESTART_INTERVAL_S = (3.0, 6.0)
MIN_WARMUP_S = 1.5
MIN_LIFE_S = 2.5  # a restarted owner up this long must have served at least one verified pull
INCARNATION_SAMPLE_AFTER_S = 1.0
SETTLE_S = 1.0
BIG_PULL_NBYTES = 8 << 20  # the copy threads start at 8 MiB: warm-up waits for one such pull
MAX_FAILURE_LINES = 20  # per puller; later ones are only counted
MAX_LOGGED_FAILURES = 10  # printed as they happen; all are listed, grouped, at the end
U64_MAX = 2**64 - 1
# A growing v1 pool keeps its most recent segment when it falls empty, so which segment survives a
# checkpoint depends on the last allocation. Two caches larger than any the soak allocates, both held, then
# freed, leave every v1 pool in the same state at each checkpoint: one fresh segment no peer has mapped.
BALLAST_NBYTES = 128 << 20

# Tolerances, the reasons for them in docs/soak.md: RSS may wander by what glibc and pymalloc keep for
# reuse; everything else counts objects the library owns and must be back where it was.
RSS_TOLERANCE_NBYTES = 24 << 20

EXPECTED_ALWAYS = frozenset({LLMStatusCode.LLM_KV_CACHE_NOT_EXIST})
LINK_CODES = frozenset(
    {
        LLMStatusCode.LLM_LINK_FAILED,
        LLMStatusCode.LLM_NOT_YET_LINK,
        LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
        LLMStatusCode.LLM_TIMEOUT,
    }
)

# ---------------------------------------------------------------------------------------------- pattern
# Every unit (a batch slot or a block of one tensor) starts with a 32-byte stamp naming its owner, the owner's
# incarnation, the cache's serial number and (tensor, unit); the rest is a sequence derived from the stamp.
# A puller checks the stamp against what it asked for and the rest against the stamp, so a torn copy, a
# wrong offset or another cache's bytes are all caught, and a stale catalogue entry is told from a bug.

STAMP_NBYTES = 32
_MAGIC = 0x50AC_0000_0000_0000
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MASK64 = (1 << 64) - 1
_CHUNK_WORDS = 1 << 17  # 1 MiB of pattern at a time: no large temporaries
Stamp = tuple[int, int, int, int]


def make_stamp(cluster_id: int, incarnation: int, serial: int, tensor: int, unit: int) -> Stamp:
    return (_MAGIC | cluster_id, incarnation, serial, (tensor << 32) | unit)


def _stamp_seed(stamp: Stamp) -> int:
    value = 0
    for word in stamp:
        value = ((value ^ word) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    return value


def _body_chunks(stamp: Stamp, nbytes: int) -> Iterator[tuple[int, np.ndarray]]:
    """(offset in the unit, expected bytes) after the stamp, in chunks of at most 1 MiB."""
    seed = np.uint64(_stamp_seed(stamp))
    words = -(-(nbytes - STAMP_NBYTES) // 8)
    for first in range(0, words, _CHUNK_WORDS):
        values = np.arange(first, min(words, first + _CHUNK_WORDS), dtype=np.uint64)
        values *= _GOLDEN
        values += seed
        offset = STAMP_NBYTES + first * 8
        yield offset, values.view(np.uint8)[: nbytes - offset]


def fill_unit(unit: np.ndarray, stamp: Stamp) -> None:
    unit[:STAMP_NBYTES] = np.array(stamp, dtype="<u8").view(np.uint8)
    for offset, chunk in _body_chunks(stamp, unit.nbytes):
        unit[offset : offset + chunk.nbytes] = chunk


def read_stamp(unit: np.ndarray) -> Stamp:
    a, b, c, d = (int(w) for w in unit[:STAMP_NBYTES].copy().view("<u8"))
    return (a, b, c, d)


def body_matches(unit: np.ndarray, stamp: Stamp) -> bool:
    return all(
        np.array_equal(unit[offset : offset + chunk.nbytes], chunk)
        for offset, chunk in _body_chunks(stamp, unit.nbytes)
    )


def memory_at(address: int, nbytes: int) -> np.ndarray:
    """uint8 view of `nbytes` at a real address of this process (what `tensor_addrs` promise)."""
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(address))


# ---------------------------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class OwnerRef:
    name: str
    mode: str  # "v1" or "v2"
    cluster_id: int
    port: int
    restarting: bool
    ip: str = IP  # where it listens (its namespace's address with --hosts)


@dataclass(frozen=True)
class OwnerSpec:
    ref: OwnerRef
    incarnation: int
    seed: int
    debug_memory_s: float = 0.0  # > 0: dump where the memory is to the log this often (long-lived only)

    @property
    def label(self) -> str:
        return f"{self.ref.name}#{self.incarnation}"


@dataclass(frozen=True)
class PullerSpec:
    name: str
    mode: str
    cluster_id: int
    seed: int
    owners: tuple[OwnerRef, ...]
    ip: str = IP  # this puller's own address (its namespace's with --hosts)
    debug_memory_s: float = 0.0


@dataclass(frozen=True)
class Entry:
    """A cache an owner published: enough for a puller to name it, size its destination and check it."""

    owner: str
    cluster_id: int
    incarnation: int
    serial: int
    kind: str  # "v1" (keys), "cache" (v2, by cache id and slot), "blocks" (v2, by model id)
    num_tensors: int
    units: int  # batch slots or blocks
    unit_elems: int  # fp16 elements per unit
    keys: tuple[tuple[int, bool, int], ...] = ()  # v1: (slot, is prefix key, key id)
    cache_id: int = 0
    model_id: int = 0

    @property
    def unit_nbytes(self) -> int:
        return 2 * self.unit_elems


def _options(mode: str, listen: tuple[str, int] | None) -> dict[str, str]:
    """v1; v2 (cache manager, one-sided); v2-leased (cache manager, every pull asks the owner for a lease)."""
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = SYNC_KV_TIMEOUT_MS
    if listen is not None:
        config.listen_ip_info = f"{listen[0]}:{listen[1]}"
    if mode.startswith("v2"):
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = mode == "v2"
    return dict(config.generate_options())


def _settle_pool(kvm: Any) -> None:
    desc = CacheDesc(1, [1, BALLAST_NBYTES // 2], DataType.DT_FLOAT16)
    first = kvm.allocate_cache(desc)  # takes the segment kept from before, or a new one
    second = kvm.allocate_cache(desc)  # always a new segment: the first is full
    kvm.deallocate_cache(first)  # that segment falls empty and is not the newest: unlinked
    kvm.deallocate_cache(second)  # the newest segment is kept, empty


def _cluster_info(ref: OwnerRef, local_ip: str) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = ref.cluster_id
    if ref.mode == "v2":
        info.append_local_ip_info(local_ip, 0)
    info.append_remote_ip_info(ref.ip, ref.port)
    return info


class _ChildPipe:
    """The child's end of its pipe to the driver; sends are serialized (library threads report too)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, *message: object) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            self.conn.send(message)


def _report_thread_deaths(pipe: _ChildPipe, label: str) -> None:
    """A library thread that dies (say, a server thread on a KeyError) is a failure, reported at once."""

    def hook(args: threading.ExceptHookArgs) -> None:
        text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        name = args.thread.name if args.thread is not None else "?"
        pipe.send("fail", f"{label}: thread {name!r} died: {text.strip()}")

    threading.excepthook = hook


# ---------------------------------------------------------------------------------------------- owners


class _Owner:
    """Shared loop of both owner kinds: churn in steps until told to quiesce, resume or stop."""

    WINDOW = 6

    def __init__(self, spec: OwnerSpec, pipe: _ChildPipe) -> None:
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

    def __init__(self, spec: OwnerSpec, pipe: _ChildPipe, datadist: LLMDataDist) -> None:
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
        _settle_pool(self.kvm)

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

    def __init__(self, spec: OwnerSpec, pipe: _ChildPipe, datadist: LLMDataDist) -> None:
        super().__init__(spec, pipe)
        self.manager = datadist.cache_manager
        self.live: list[tuple[Entry, list[np.ndarray]]] = []

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


def _redirect_output(log_path: str) -> None:
    """The library logs expected link failures at error level: into the child's log file, not the table."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _memory_probe(label: str, interval_s: float) -> Any:
    if interval_s <= 0:
        return None
    from ._soak_memdebug import MemoryProbe

    return MemoryProbe(label, interval_s)


def _owner_main(conn: Connection, spec: OwnerSpec, log_path: str) -> None:
    _redirect_output(log_path)
    pipe = _ChildPipe(conn)
    _report_thread_deaths(pipe, spec.label)
    v2 = spec.ref.mode == "v2"
    datadist = LLMDataDist(LLMRole.PROMPT, spec.ref.cluster_id)
    code = 0
    probe = _memory_probe(spec.label, 0.0 if spec.ref.restarting else spec.debug_memory_s)
    try:
        datadist.init(_options(spec.ref.mode, (spec.ref.ip, spec.ref.port)))
        owner: _Owner = _V2Owner(spec, pipe, datadist) if v2 else _V1Owner(spec, pipe, datadist)
        pipe.send("up", os.getpid())
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


# ---------------------------------------------------------------------------------------------- pullers


@dataclass
class PullerSummary:
    verified: int = 0
    verified_nbytes: int = 0
    stale: int = 0
    failures: int = 0
    expected: Counter[str] = field(default_factory=Counter)
    by_incarnation: Counter[tuple[str, int]] = field(default_factory=Counter)


class _WrongBytesError(Exception):
    """A pull returned bytes that are not what the owner wrote there."""


class _Puller:
    def __init__(self, spec: PullerSpec, pipe: _ChildPipe, datadist: LLMDataDist) -> None:
        self.spec = spec
        self.pipe = pipe
        self.datadist = datadist
        self.rng = random.Random(f"{spec.seed}/{spec.name}")
        self.owners = {ref.cluster_id: ref for ref in spec.owners}
        self.order = list(self.owners)
        self.turn = 0
        self.catalogue: dict[int, dict[tuple[int, int], Entry]] = {c: {} for c in self.owners}
        self.newest: dict[int, int] = dict.fromkeys(self.owners, 0)
        self.consumed: set[tuple[int, int]] = set()  # (cluster, req key id) this puller consumed
        self.linked: dict[int, bool] = dict.fromkeys(self.owners, False)
        self.next_link: dict[int, float] = dict.fromkeys(self.owners, 0.0)
        self.summary = PullerSummary()
        self.warm_from: set[int] = set()
        self.big_pull = False
        self.warm = False
        self.next_beat = 0.0
        self.last_key: tuple[int, int] | None = None  # the req_id key of the v1 pull in progress

    # -- bookkeeping

    def fail(self, text: str) -> None:
        self.summary.failures += 1
        if self.summary.failures <= MAX_FAILURE_LINES:
            self.pipe.send("fail", f"{self.spec.name}: {text}")

    def beat(self) -> None:
        now = time.monotonic()
        if now >= self.next_beat:
            self.pipe.send("beat")
            self.next_beat = now + HEARTBEAT_S

    def handle(self, message: tuple[Any, ...]) -> str | None:
        command = message[0]
        if command == "pub":
            entry: Entry = message[1]
            cluster = entry.cluster_id
            if entry.incarnation > self.newest[cluster]:  # the owner restarted: its old catalogue is void
                self.newest[cluster] = entry.incarnation
                self.catalogue[cluster].clear()
            if entry.incarnation == self.newest[cluster]:
                self.catalogue[cluster][(entry.incarnation, entry.serial)] = entry
        elif command == "ret":
            _, name, incarnation, serial = message
            for cluster, ref in self.owners.items():
                if ref.name == name:
                    self.catalogue[cluster].pop((incarnation, serial), None)
        return str(command)

    def drain(self, timeout_s: float) -> str | None:
        """Handle what the driver sent; returns "stop" or "quiesce" when one of them came."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            if not self.pipe.conn.poll(remaining):
                return None
            command = self.handle(self.pipe.conn.recv())
            if command in ("stop", "quiesce"):
                return command
            deadline = time.monotonic()  # after the first message, take only what is already there

    # -- links

    def link(self, cluster: int, *, must: bool = False) -> bool:
        ref = self.owners[cluster]
        try:
            _, codes = self.datadist.link_clusters(
                [_cluster_info(ref, self.spec.ip)], timeout=LINK_TIMEOUT_MS
            )
        except LLMException as exc:
            codes = [exc.status_code]
        code = codes[0]
        if code in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK):
            self.linked[cluster] = True
            return True
        if ref.restarting and code in LINK_CODES and not must:
            self.summary.expected[f"link_clusters {code.name}"] += 1
        else:
            self.fail(f"link_clusters to {ref.name} gave {code.name}")
        self.next_link[cluster] = time.monotonic() + 0.1
        return False

    def unlink(self, cluster: int) -> None:
        ref = self.owners[cluster]
        self.linked[cluster] = False
        self.next_link[cluster] = time.monotonic() + 0.1
        try:
            _, codes = self.datadist.unlink_clusters(
                [_cluster_info(ref, self.spec.ip)], timeout=LINK_TIMEOUT_MS, force=True
            )
        except LLMException as exc:
            codes = [exc.status_code]
        if codes[0] not in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_NOT_YET_LINK):
            self.fail(f"unlink_clusters(force=True) from {ref.name} gave {codes[0].name}")

    # -- pulls

    def check(self, got: np.ndarray, entry: Entry, tensor: int, unit: int, *, stale_ok: bool) -> bool:
        """True when the unit holds what the entry says; False for a stale entry (the owner restarted and
        the id now names another cache: the bytes are that cache's, intact). Raises on wrong bytes."""
        want = make_stamp(entry.cluster_id, entry.incarnation, entry.serial, tensor, unit)
        stamp = read_stamp(got)
        if stamp != want:
            if (
                stale_ok
                and stamp[0] == want[0]
                and stamp[3] == want[3]
                and stamp[1] != want[1]
                and body_matches(got, stamp)
            ):
                return False
            raise _WrongBytesError(
                f"{entry.owner} {entry.kind} serial {entry.serial} (incarnation {entry.incarnation}) "
                f"tensor {tensor} unit {unit}: stamp {[hex(w) for w in stamp]}, "
                f"expected {[hex(w) for w in want]}"
            )
        if not body_matches(got, stamp):
            raise _WrongBytesError(
                f"{entry.owner} {entry.kind} serial {entry.serial} tensor {tensor} unit {unit}: bytes differ"
            )
        return True

    def pull_v1(self, entry: Entry) -> tuple[int, list[tuple[np.ndarray, int, int]], Callable[[], None]]:
        kvm = self.datadist.kv_cache_manager
        rng = self.rng
        choices = [k for k in entry.keys if k[1] or (entry.cluster_id, k[2]) not in self.consumed]
        if not choices:
            self.catalogue[entry.cluster_id].pop((entry.incarnation, entry.serial), None)
            return 0, [], lambda: None
        slot, is_prefix, key_id = rng.choice(choices)
        self.last_key = None if is_prefix else (entry.cluster_id, key_id)
        key = (
            CacheKey(entry.cluster_id, U64_MAX, prefix_id=key_id)
            if is_prefix
            else CacheKey(entry.cluster_id, key_id)
        )
        layers = entry.num_tensors // 2
        kwargs: dict[str, Any] = {}
        tensors = range(entry.num_tensors)
        if layers >= 2 and rng.random() < 0.3:
            first = rng.randrange(layers)
            stop = rng.randint(first + 1, layers)
            kwargs = {"src_layer_range": range(first, stop), "dst_layer_range": range(stop - first)}
            tensors = range(2 * first, 2 * stop)
        desc = CacheDesc(len(tensors), [1, entry.unit_elems], DataType.DT_FLOAT16)
        dst = kvm.allocate_cache(desc)
        try:
            kvm.pull_cache(key, dst, 0, **kwargs)
        except BaseException:
            kvm.deallocate_cache(dst)
            raise
        if not is_prefix and not kwargs:
            self.consumed.add((entry.cluster_id, key_id))
        units = [
            (memory_at(address, entry.unit_nbytes), t, slot)
            for address, t in zip(dst.per_device_tensor_addrs[0], tensors, strict=True)
        ]
        return len(tensors) * entry.unit_nbytes, units, lambda: kvm.deallocate_cache(dst)

    def pull_v2(self, entry: Entry) -> tuple[int, list[tuple[np.ndarray, int, int]], Callable[[], None]]:
        manager = self.datadist.cache_manager
        rng = self.rng
        n, nbytes = entry.num_tensors, entry.unit_nbytes
        if entry.kind == "cache":
            slot = rng.randrange(entry.units)
            src_units, dst_units, dst_count = [slot], [0], 1
        else:
            count = rng.randint(1, min(6, entry.units))
            src_units = rng.sample(range(entry.units), count)
            dst_count = count + rng.randint(0, 3)
            dst_units = rng.sample(range(dst_count), count)
        arrays = [np.zeros(dst_count * entry.unit_elems, dtype=np.float16) for _ in range(n)]
        desc = CacheDesc(n, [dst_count, entry.unit_elems], DataType.DT_FLOAT16)
        addrs = [int(a.ctypes.data) for a in arrays]
        # One-sided reads need a remote-accessible destination; the leased puller's is its own business.
        one_sided = self.spec.mode == "v2"
        if entry.kind == "cache":
            dst = manager.register_cache(desc, addrs, [], one_sided)
        else:
            dst = manager.register_blocks_cache(desc, addrs, None, one_sided)
        try:
            if entry.kind == "cache":
                key: CacheKey | CacheKeyByIdAndIndex = CacheKeyByIdAndIndex(
                    entry.cluster_id, entry.cache_id, slot
                )
                if not one_sided and entry.keys and rng.random() < 0.5:
                    key = CacheKey(entry.cluster_id, entry.keys[slot][2])
                manager.pull_cache(key, dst)
            else:
                blocks_key = BlocksCacheKey(entry.cluster_id, entry.model_id)
                manager.pull_blocks(blocks_key, dst, src_units, dst_units)
        except BaseException:
            manager.unregister_cache(dst.cache_id)
            raise
        units = [
            (arrays[t].view(np.uint8)[d * nbytes : (d + 1) * nbytes], t, s)
            for t in range(n)
            for s, d in zip(src_units, dst_units, strict=True)
        ]

        def release() -> None:
            manager.unregister_cache(dst.cache_id)
            arrays.clear()

        return n * len(src_units) * nbytes, units, release

    def pull(self, entry: Entry) -> None:
        ref = self.owners[entry.cluster_id]
        api = "pull_cache" if entry.kind in ("v1", "cache") else "pull_blocks"
        try:
            if entry.kind == "v1":
                nbytes, units, release = self.pull_v1(entry)
            else:
                nbytes, units, release = self.pull_v2(entry)
        except LLMException as exc:
            code = exc.status_code
            if code in EXPECTED_ALWAYS:
                self.summary.expected[f"{api} {code.name}"] += 1
                if entry.kind != "v1":
                    self.catalogue[entry.cluster_id].pop((entry.incarnation, entry.serial), None)
                elif self.last_key is not None:  # another puller consumed it, or the owner retired it
                    self.consumed.add(self.last_key)
            elif code in LINK_CODES and ref.restarting:
                self.summary.expected[f"{api} {code.name}"] += 1
                self.unlink(entry.cluster_id)
            else:
                self.fail(f"{api} from {ref.name} raised {code.name}: {exc}")
                self.unlink(entry.cluster_id)  # start afresh rather than repeat the failure on this link
            return
        except Exception:
            self.fail(f"{api} from {ref.name} raised {traceback.format_exc().strip()}")
            return
        if not units:
            return
        try:
            intact = all(self.check(got, entry, t, u, stale_ok=entry.kind == "cache") for got, t, u in units)
        except _WrongBytesError as exc:
            self.fail(f"wrong bytes: {exc}")
            return
        finally:
            release()
        if not intact:
            self.summary.stale += 1
            return
        self.summary.verified += 1
        self.summary.verified_nbytes += nbytes
        self.summary.by_incarnation[(entry.owner, entry.incarnation)] += 1
        if not ref.restarting:
            self.warm_from.add(entry.cluster_id)
        self.big_pull = self.big_pull or nbytes >= BIG_PULL_NBYTES
        if (
            not self.warm
            and self.big_pull
            and all(c in self.warm_from for c, r in self.owners.items() if not r.restarting)
        ):
            self.warm = True
            self.pipe.send("warm")

    # -- checkpoints

    def quiesce(self) -> bool:
        """Relink the restarting owners (so both checkpoints see one fresh link per owner), report quiet,
        then wait for "resume". False when told to stop."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for cluster, ref in self.owners.items():
            if ref.restarting and self.linked[cluster]:
                self.unlink(cluster)
            while not self.linked[cluster]:
                if time.monotonic() > deadline:
                    self.fail(f"could not link to {ref.name} at the checkpoint")
                    break
                if not self.link(cluster, must=time.monotonic() + 1 > deadline):
                    time.sleep(0.1)
                self.beat()
        for entries in self.catalogue.values():
            entries.clear()
        if self.spec.mode == "v1":
            _settle_pool(self.datadist.kv_cache_manager)
        self.pipe.send("quiet")
        deadline = time.monotonic() + 4 * START_TIMEOUT_S
        while time.monotonic() < deadline:
            self.beat()
            if self.pipe.conn.poll(HEARTBEAT_S):
                command = self.handle(self.pipe.conn.recv())
                if command == "resume":
                    return True
                if command == "stop":
                    return False
        self.fail("no resume after a checkpoint")
        return False

    def run(self) -> None:
        for cluster in self.order:
            self.link(cluster)
        self.pipe.send("ready", os.getpid())
        while True:
            self.beat()
            busy = False
            command = self.drain(0.0)
            if command == "quiesce":
                if not self.quiesce():
                    return
                continue
            if command == "stop":
                return
            for _ in range(len(self.order)):
                cluster = self.order[self.turn % len(self.order)]
                self.turn += 1
                if not self.linked[cluster]:
                    if time.monotonic() >= self.next_link[cluster]:
                        self.link(cluster)
                        busy = True
                    continue
                entries = self.catalogue[cluster]
                if entries:
                    self.pull(self.rng.choice(list(entries.values())))
                    busy = True
                    break
            if not busy:
                command = self.drain(0.02)
                if command == "stop":
                    return
                if command == "quiesce" and not self.quiesce():
                    return


def _puller_main(conn: Connection, spec: PullerSpec, log_path: str) -> None:
    _redirect_output(log_path)
    pipe = _ChildPipe(conn)
    _report_thread_deaths(pipe, spec.name)
    datadist = LLMDataDist(LLMRole.DECODER, spec.cluster_id)
    code = 0
    puller: _Puller | None = None
    probe = _memory_probe(spec.name, spec.debug_memory_s)
    try:
        datadist.init(_options(spec.mode, None))
        puller = _Puller(spec, pipe, datadist)
        puller.run()
        if probe is not None:
            probe.final()
    except BaseException:
        pipe.send("fail", f"{spec.name}: {traceback.format_exc().strip()}")
        code = 1
    finally:
        datadist.finalize()
    pipe.send("done", PullerSummary() if puller is None else puller.summary)
    conn.close()
    sys.exit(code)


# ---------------------------------------------------------------------------------------------- figures


@dataclass(frozen=True)
class Figures:
    rss_nbytes: int
    fds: int
    threads: int
    shm_live_nbytes: int  # /dev/shm files mapped that still exist
    shm_deleted_nbytes: int  # /dev/shm files mapped after they were unlinked
    segments: int  # /dev/shm entries this process created (its pid in the name)
    fd_kinds: tuple[str, ...] = ()  # what each fd is ("socket", "pipe", a path...), to explain a change
    # Across hosts: the transfer engine's TCP connections (Mooncake pools up to MOONCAKE_LANES_PER_PEER a
    # peer), counted apart from the fds that are ours; of those, the ones to engines that are gone
    # (CLOSE_WAIT), which Mooncake never closes.
    engine_sockets: int = 0
    stale_engine_sockets: int = 0

    @property
    def own_fds(self) -> int:
        return self.fds - self.engine_sockets


def _segment_pid(name: str) -> int | None:
    from llm_datadist._shm.names import parse_segment_name

    owner = parse_segment_name(name)
    return None if owner is None else owner.pid


def shm_entries() -> list[str]:
    try:
        return os.listdir("/dev/shm")
    except FileNotFoundError:
        return []


def sample(pid: int, entries: list[str]) -> Figures:
    process = psutil.Process(pid)
    with process.oneshot():
        rss, fds, threads = process.memory_info().rss, process.num_fds(), process.num_threads()
    live = deleted = 0
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/dev/shm/"):
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if parts[5].rstrip("\n").endswith(" (deleted)"):
                deleted += end - start
            else:
                live += end - start
    segments = sum(1 for name in entries if _segment_pid(name) == pid)
    engine, stale = _engine_sockets(pid)
    return Figures(rss, fds, threads, live, deleted, segments, _fd_kinds(pid), engine, stale)


_TCP_CLOSE_WAIT = "08"  # the state column of /proc/net/tcp
# Mooncake 0.3.13's TCP transport keeps up to this many pooled connections to each peer engine.
MOONCAKE_LANES_PER_PEER = 4


def _engine_sockets(pid: int) -> tuple[int, int]:
    """The connected TCP sockets of `pid` with neither end on one of the soak's listen ports: the transfer
    engine's connections (our links always have an owner's listen port at one end); and of those, the ones
    in CLOSE_WAIT (the peer engine went, Mooncake's pool never closes its end). Read from the tables of the
    process's own network namespace; (0, 0) on one host, where no engine runs."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    engine = stale = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}", encoding="ascii") as lines:
            next(lines, None)  # the header
            for line in lines:
                fields = line.split()
                ports = [int(field.rsplit(":", 1)[1], 16) for field in fields[1:3]]
                if fields[9] not in inodes or ports[1] == 0:  # not ours, or a listener
                    continue
                if not any(PORT_RANGE[0] <= port <= PORT_RANGE[1] for port in ports):
                    engine += 1
                    stale += fields[3] == _TCP_CLOSE_WAIT
    return engine, stale


def _fd_kinds(pid: int) -> tuple[str, ...]:
    kinds = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                kinds.append(target.split(":[")[0] if ":[" in target else target)
    return tuple(sorted(kinds))


@dataclass(frozen=True)
class Rule:
    title: str
    attribute: str
    unit: int  # divide by this to print
    tolerance: int  # end may exceed start by this much
    exact: bool = False  # end must equal start (a drop is as telling as a rise: a thread died, a link went)
    zero: bool = False  # 0 at both checkpoints (a retired segment must not stay mapped, contract 7)


RULES = (
    Rule("RSS MiB", "rss_nbytes", 1 << 20, RSS_TOLERANCE_NBYTES),
    Rule("fds", "own_fds", 1, 0, exact=True),
    Rule("threads", "threads", 1, 0, exact=True),
    Rule("shm live MiB", "shm_live_nbytes", 1 << 20, 0),
    Rule("shm deleted MiB", "shm_deleted_nbytes", 1 << 20, 0, zero=True),
    Rule("own segs", "segments", 1, 0),
)


def is_flat(rule: Rule, start: Figures, end: Figures) -> bool:
    a, b = getattr(start, rule.attribute), getattr(end, rule.attribute)
    if rule.zero:
        return bool(a == 0 and b == 0)
    return bool(b == a) if rule.exact else bool(b <= a + rule.tolerance)


# ---------------------------------------------------------------------------------------------- driver


@dataclass
class _Child:
    label: str
    kind: str  # "owner" or "puller"
    process: BaseProcess
    conn: Connection | None
    started_at: float
    ref: OwnerRef | None = None
    puller: PullerSpec | None = None
    incarnation: int = 0
    pid: int = 0
    up_at: float | None = None
    down_at: float | None = None
    warm: bool = False
    quiet: bool = False
    stopped: bool = False
    exited: bool = False
    expected_exit: bool = False
    last_seen: float = 0.0
    summary: PullerSummary | None = None
    samples: dict[str, Figures] = field(default_factory=dict)


class Soak:
    def __init__(
        self,
        duration_s: float,
        seed: int,
        log_dir: str,
        out: Any = sys.stdout,
        hosts: Hosts | None = None,
        debug_memory_s: float = 0.0,
    ) -> None:
        self.debug_memory_s = debug_memory_s
        # The memory dumps slow the children down, their last one (at stop, no heartbeat meanwhile) most.
        self.stop_timeout_s = STOP_TIMEOUT_S * (4 if debug_memory_s > 0 else 1)
        self.hang_s = HANG_S * (4 if debug_memory_s > 0 else 1)
        self.log_dir = log_dir  # each child's stdout and stderr
        self.hosts = hosts  # owners on one "host", pullers on the other; None: all on this host
        self.duration_s = duration_s
        self.seed = seed
        self.out = out
        self.ctx = mp.get_context("spawn")
        self.t0 = time.monotonic()
        self.children: list[_Child] = []
        self.owners: dict[str, _Child] = {}  # the current incarnation of each owner
        self.incarnations: list[_Child] = []  # every owner incarnation, in order
        self.pullers: list[_Child] = []
        self.failures: list[str] = []
        self.aborted = False
        self.restarts: Counter[str] = Counter()
        self.driver_samples: dict[str, Figures] = {}
        self.system_shm: dict[str, int] = {}
        self.leftover: list[str] = []
        self.churn_from = math.inf  # churn runs between the two checkpoints
        self.churn_until = math.inf

    # -- output

    def log(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f} s] {text}", file=self.out, flush=True)

    def failure(self, text: str, *, abort: bool = False) -> None:
        self.failures.append(text)
        if len(self.failures) <= MAX_LOGGED_FAILURES:
            self.log(f"FAILURE: {text.splitlines()[0] if text else text}")
        if len(self.failures) == MAX_LOGGED_FAILURES:
            self.log("(further failures are listed at the end)")
        if abort:
            self.aborted = True

    # -- processes

    def _spawn(self, label: str, kind: str, target: Callable[..., None], spec: object) -> _Child:
        parent, child_end = self.ctx.Pipe()
        log_path = os.path.join(self.log_dir, f"{label.replace('#', '-')}.log")
        if self.hosts is not None:
            netns = self.hosts.prompt_netns if kind == "owner" else self.hosts.decoder_netns
            target = in_netns(netns, target, self.hosts.env)
        process = self.ctx.Process(target=target, args=(child_end, spec, log_path), name=label, daemon=True)
        process.start()
        child_end.close()
        now = time.monotonic()
        child = _Child(label, kind, process, parent, now, last_seen=now, pid=process.pid or 0)
        self.children.append(child)
        return child

    def start_owner(self, ref: OwnerRef, incarnation: int) -> _Child:
        spec = OwnerSpec(ref, incarnation, self.seed, self.debug_memory_s)
        child = self._spawn(spec.label, "owner", _owner_main, spec)
        child.ref, child.incarnation = ref, incarnation
        self.owners[ref.name] = child
        self.incarnations.append(child)
        return child

    def start_puller(self, spec: PullerSpec) -> _Child:
        child = self._spawn(spec.name, "puller", _puller_main, spec)
        child.puller = spec
        self.pullers.append(child)
        return child

    def send(self, child: _Child, *message: object) -> None:
        if child.conn is None:
            return
        try:
            child.conn.send(message)
        except (OSError, ValueError) as exc:
            if not child.expected_exit:
                self.failure(f"{child.label}: cannot send {message[0]!r}: {exc}")

    def live(self) -> list[_Child]:
        return [c for c in self.children if not c.exited]

    def _on_message(self, child: _Child, message: tuple[Any, ...]) -> None:
        child.last_seen = time.monotonic()
        command = message[0]
        if command in ("pub", "ret"):
            mode = child.ref.mode if child.ref is not None else ""
            for puller in self.pullers:
                # Not to a puller told to stop: it reads no more, and a full pipe would block the driver.
                if (
                    puller.puller is not None
                    and puller.puller.mode.startswith(mode)
                    and not puller.exited
                    and not puller.expected_exit
                ):
                    self.send(puller, *message)
        elif command in ("up", "ready"):
            child.up_at = time.monotonic()
        elif command == "warm":
            child.warm = True
        elif command == "quiet":
            child.quiet = True
        elif command == "fail":
            self.failure(str(message[1]))
        elif command == "stopped":
            child.stopped = True
        elif command == "done":
            child.summary = message[1]
            child.stopped = True

    def _drain(self, child: _Child) -> None:
        conn = child.conn
        if conn is None:
            return
        try:
            while conn.poll(0):
                self._on_message(child, conn.recv())
        except (EOFError, OSError):
            conn.close()
            child.conn = None

    def _on_exit(self, child: _Child) -> None:
        self._drain(child)
        child.process.join(1)
        child.exited = True
        child.down_at = child.down_at or time.monotonic()
        code = child.process.exitcode
        if not child.expected_exit:
            self.failure(f"{child.label} (pid {child.pid}) exited unexpectedly, exit code {code}", abort=True)
        elif code not in (0, -signal.SIGKILL):
            self.failure(f"{child.label} (pid {child.pid}) exited with code {code}")
        if child.conn is not None:
            child.conn.close()
            child.conn = None
        child.process.close()

    def pump(self, seconds: float, until: Callable[[], bool] | None = None) -> bool:
        """Serve every pipe and watch every process for `seconds` or until `until()` holds."""
        deadline = time.monotonic() + seconds
        while True:
            if until is not None and until():
                return True
            now = time.monotonic()
            if now >= deadline:
                return until is None
            by_object: dict[Any, tuple[_Child, bool]] = {}
            for child in self.live():
                if child.conn is not None:
                    by_object[child.conn] = (child, False)
                by_object[child.process.sentinel] = (child, True)
            if not by_object:
                time.sleep(min(0.1, deadline - now))
                continue
            for obj in wait(list(by_object), timeout=min(0.1, deadline - now)):
                child, is_sentinel = by_object[obj]
                if child.exited:
                    continue
                if is_sentinel:
                    self._on_exit(child)
                else:
                    self._drain(child)
            self._watch()

    def _watch(self) -> None:
        now = time.monotonic()
        for child in self.live():
            if now - child.last_seen > self.hang_s:
                silent = f"silent for {self.hang_s:.0f} s: hung"
                self.failure(f"{child.label} (pid {child.pid}) {silent}", abort=True)
                child.expected_exit = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)
                child.last_seen = now
            if (
                child.kind == "owner"
                and child.up_at is not None
                and "start" not in child.samples
                and child.ref is not None
                and child.ref.restarting
                and now - child.up_at >= INCARNATION_SAMPLE_AFTER_S
            ):
                self._sample_child(child, "start")

    def _sample_child(self, child: _Child, when: str, entries: list[str] | None = None) -> None:
        try:
            child.samples[when] = sample(child.pid, shm_entries() if entries is None else entries)
        except (psutil.Error, OSError) as exc:
            if not child.expected_exit:
                self.failure(f"{child.label}: cannot sample its figures: {exc}")

    # -- phases

    def wait_for(
        self, what: str, children: list[_Child], flag: Callable[[_Child], bool], timeout_s: float
    ) -> bool:
        if self.pump(timeout_s, lambda: self.aborted or all(flag(c) or c.exited for c in children)):
            return not self.aborted
        missing = [c.label for c in children if not flag(c)]
        self.failure(
            f"timed out after {timeout_s:.0f} s waiting for {what}: {', '.join(missing)}", abort=True
        )
        return False

    def restart(self, name: str, how: str) -> None:
        old = self.owners[name]
        assert old.ref is not None
        if old.up_at is not None and time.monotonic() - old.up_at >= INCARNATION_SAMPLE_AFTER_S:
            self._sample_child(old, "end")
        old.expected_exit = True
        old.down_at = time.monotonic()
        if how == "SIGKILL":
            with contextlib.suppress(ProcessLookupError):
                os.kill(old.pid, signal.SIGKILL)
        else:
            self.send(old, "stop")
        if not self.pump(STOP_TIMEOUT_S, lambda: old.exited):
            self.failure(f"{old.label} did not exit within {STOP_TIMEOUT_S:.0f} s of {how}", abort=True)
            with contextlib.suppress(ProcessLookupError):
                os.kill(old.pid, signal.SIGKILL)
            return
        if how != "SIGKILL" and not old.stopped:
            self.failure(f"{old.label} exited on stop without reporting it stopped")
        self.restarts[how] += 1
        new = self.start_owner(old.ref, old.incarnation + 1)
        if self.wait_for(f"{new.label} to come up", [new], lambda c: c.up_at is not None, START_TIMEOUT_S):
            self.log(f"{old.label} {'killed (SIGKILL)' if how == 'SIGKILL' else 'finalized'}; {new.label} up")

    def checkpoint(self, when: str) -> None:
        owners = list(self.owners.values())
        for child in owners:
            child.quiet = False
            self.send(child, "quiesce")
        if not self.wait_for(f"owners to quiesce ({when})", owners, lambda c: c.quiet, START_TIMEOUT_S):
            return
        for child in self.pullers:
            child.quiet = False
            self.send(child, "quiesce")
        if not self.wait_for(
            f"pullers to quiesce ({when})", self.pullers, lambda c: c.quiet, START_TIMEOUT_S
        ):
            return
        # Leases are released one way and segments unlinked behind them: let the figures settle.
        self.pump(SETTLE_S)
        previous: dict[int, Figures] = {}
        deadline = time.monotonic() + 5 * SETTLE_S
        members = [*owners, *self.pullers]
        while True:
            entries = shm_entries()
            current = {c.pid: sample(c.pid, entries) for c in members if not c.exited}
            current[os.getpid()] = sample(os.getpid(), entries)
            stable = previous and all(
                _without_rss(current[pid]) == _without_rss(previous.get(pid, current[pid])) for pid in current
            )
            if stable or time.monotonic() > deadline:
                break
            previous = current
            self.pump(SETTLE_S / 2)
        for child in members:
            if child.pid in current:
                child.samples[when] = current[child.pid]
        self.driver_samples[when] = current[os.getpid()]
        for child in [*owners, *self.pullers]:
            child.quiet = False
            self.send(child, "resume")
        self.log(f"checkpoint {when!r}: figures sampled for {len(current)} processes")

    def run(self, ports: list[int]) -> None:
        owner_ip, puller_ip = (self.hosts.prompt_ip, self.hosts.decoder_ip) if self.hosts else (IP, IP)
        refs = [
            OwnerRef("v1-steady", "v1", 1, ports[0], False, owner_ip),
            OwnerRef("v1-restart", "v1", 2, ports[1], True, owner_ip),
            OwnerRef("v2-steady", "v2", 3, ports[2], False, owner_ip),
            OwnerRef("v2-restart", "v2", 4, ports[3], True, owner_ip),
        ]
        self.system_shm["start"] = len(shm_entries())
        for ref in refs:
            self.start_owner(ref, 1)
        owners = list(self.owners.values())
        if not self.wait_for("owners to come up", owners, lambda c: c.up_at is not None, START_TIMEOUT_S):
            return
        self.log(
            f"owners up: {', '.join(f'{c.label} (pid {c.pid}, port {c.ref.port})' for c in owners if c.ref)}"
        )
        for index, mode in enumerate(("v1", "v2", "v2-leased")):
            name = f"puller-{index + 1}"
            sources = tuple(r for r in refs if mode.startswith(r.mode))
            spec = PullerSpec(name, mode, 11 + index, self.seed, sources, puller_ip, self.debug_memory_s)
            self.start_puller(spec)
        if not self.wait_for("pullers to link", self.pullers, lambda c: c.up_at is not None, START_TIMEOUT_S):
            return
        warm_from = time.monotonic()
        if not self.wait_for(
            "a verified pull of every kind (warm-up)", self.pullers, lambda c: c.warm, WARM_TIMEOUT_S
        ):
            return
        self.pump(max(0.0, MIN_WARMUP_S - (time.monotonic() - warm_from)))
        self.checkpoint("start")
        if self.aborted:
            return
        self.churn_from = time.monotonic()
        rng = random.Random(self.seed)
        now = time.monotonic()
        end = now + self.duration_s
        restarting = [r.name for r in refs if r.restarting]
        next_restart = {name: now + rng.uniform(*RESTART_INTERVAL_S) for name in restarting}
        next_how = {name: rng.choice(("SIGKILL", "finalize")) for name in restarting}
        self.log(
            f"churn for {self.duration_s:.0f} s (owners restart every {RESTART_INTERVAL_S[0]:.0f}-"
            f"{RESTART_INTERVAL_S[1]:.0f} s)"
        )
        while not self.aborted:
            now = time.monotonic()
            if now >= end:
                break
            due = [name for name in restarting if next_restart[name] <= now]
            if not due:
                self.pump(min(end, *next_restart.values()) - now)
                continue
            for name in due:
                how = next_how[name]
                next_how[name] = "finalize" if how == "SIGKILL" else "SIGKILL"
                self.restart(name, how)
                next_restart[name] = time.monotonic() + rng.uniform(*RESTART_INTERVAL_S)
        self.churn_until = time.monotonic()
        if not self.aborted:
            self.checkpoint("end")

    def teardown(self) -> None:
        """Stop the pullers, then the owners (clean `finalize()`); SIGKILL what does not go in time."""
        for group in (self.pullers, list(self.owners.values())):
            members = [c for c in group if not c.exited]
            for child in members:
                child.expected_exit = True
                child.down_at = child.down_at or time.monotonic()
                self.send(child, "stop")
            self.pump(self.stop_timeout_s, lambda members=members: all(c.exited for c in members))  # type: ignore[misc]
            for child in members:
                if not child.exited:
                    self.failure(
                        f"{child.label} (pid {child.pid}) did not stop within {self.stop_timeout_s:.0f} s"
                    )
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child.pid, signal.SIGKILL)
            self.pump(10, lambda members=members: all(c.exited for c in members))  # type: ignore[misc]
        for child in self.children:
            if child.kind == "puller" and child.summary is None and not self.aborted:
                self.failure(f"{child.label} sent no summary")

    def kill_all(self) -> None:
        for child in self.children:
            if child.exited:
                continue
            child.expected_exit = True
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(child.pid, signal.SIGKILL)
            child.process.join(10)
            if child.conn is not None:
                child.conn.close()
                child.conn = None
            child.exited = True

    def check_segments(self) -> None:
        """Every segment a process of this run created must be gone: owners unlink at `finalize()`, and a
        killed owner's are reaped by its successor or by a survivor. Leftovers fail the run, then go."""
        pids = {c.pid for c in self.children}
        deadline = time.monotonic() + 5
        while True:
            left = sorted(name for name in shm_entries() if _segment_pid(name) in pids)
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if left:
            self.failure(f"{len(left)} segment(s) of this run's processes left in /dev/shm: {left[:5]}")
            for name in left:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join("/dev/shm", name))
        self.leftover = left
        self.system_shm["end"] = len(shm_entries())

    # -- report

    def checks(self) -> None:
        """Progress: every restarted incarnation that was up long enough served a verified pull."""
        served: Counter[tuple[str, int]] = Counter()
        for child in self.pullers:
            if child.summary is not None:
                served.update(child.summary.by_incarnation)
        for child in self.incarnations:
            if child.ref is None or child.up_at is None:
                continue
            # Only churn time counts: owners publish nothing while a checkpoint holds them quiet.
            life = min(child.down_at or math.inf, self.churn_until) - max(child.up_at, self.churn_from)
            if life >= MIN_LIFE_S and served[(child.ref.name, child.incarnation)] == 0:
                self.failure(f"{child.label} was up {life:.1f} s and no puller verified a pull from it")
        for child in self.pullers:
            if child.summary is not None and child.summary.verified == 0:
                self.failure(f"{child.label} verified no pull at all")
        if self.hosts is None:
            return
        # Mooncake keeps its connections to an engine that is gone: bounded by its lanes a peer for each
        # owner incarnation a puller read from that ended during the churn; anything more is a leak.
        for child in self.pullers:
            end = child.samples.get("end")
            if end is None or child.puller is None:
                continue
            mode = child.puller.mode
            ended = sum(
                1
                for c in self.incarnations
                if c.ref is not None
                and mode.startswith(c.ref.mode)
                and c.down_at is not None
                and c.down_at <= self.churn_until
            )
            if end.stale_engine_sockets > MOONCAKE_LANES_PER_PEER * ended:
                self.failure(
                    f"{child.label} holds {end.stale_engine_sockets} connections to engines that are "
                    f"gone, more than {MOONCAKE_LANES_PER_PEER} for each of the {ended} owner incarnations "
                    "that ended"
                )

    def report(self) -> list[str]:
        """Prints the tables; returns the figures that are not flat."""
        out = self.out
        not_flat: list[str] = []
        print("", file=out)
        legend = (
            "Resource figures at two quiescent checkpoints (after warm-up, at the end). Flat means: "
            f"RSS within +{RSS_TOLERANCE_NBYTES >> 20} MiB;",
            "fds and threads exactly equal; /dev/shm bytes mapped (live) and own segments back to at most "
            "the start;",
            "/dev/shm bytes mapped of deleted (retired) segments 0 at both.",
        )
        print("\n".join(legend), file=out)
        header = f"{'process':<28}{'pid':>8}  {'sample':<8}" + "".join(f"{r.title:>17}" for r in RULES)
        print(header, file=out)
        print("-" * len(header), file=out)
        rows: list[tuple[str, int, dict[str, Figures]]] = [("driver", os.getpid(), self.driver_samples)]
        long_lived = [c for c in self.incarnations if c.ref is not None and not c.ref.restarting]
        for child in [*long_lived, *self.pullers]:
            mode = child.ref.mode if child.ref is not None else (child.puller.mode if child.puller else "")
            role = "owner" if child.kind == "owner" else "puller"
            rows.append((f"{child.label} ({mode} {role})", child.pid, child.samples))
        for label, pid, samples in rows:
            _print_rows(out, label, pid, samples)
            start, end = samples.get("start"), samples.get("end")
            if start is None or end is None:
                not_flat.append(f"{label}: not sampled at both checkpoints (the run stopped early)")
                continue
            verdicts = []
            for rule in RULES:
                if is_flat(rule, start, end):
                    verdicts.append("flat")
                else:
                    verdicts.append("NOT FLAT")
                    a, b = getattr(start, rule.attribute), getattr(end, rule.attribute)
                    detail = ""
                    if rule.attribute == "own_fds":
                        more = Counter(end.fd_kinds) - Counter(start.fd_kinds)
                        fewer = Counter(start.fd_kinds) - Counter(end.fd_kinds)
                        detail = f" (new: {dict(more)}, gone: {dict(fewer)})"
                    not_flat.append(
                        f"{label}: {rule.title} {_format(a, rule.unit)} -> {_format(b, rule.unit)}{detail}"
                    )
            print(f"{'':<38}{'verdict':<8}" + "".join(f"{v:>17}" for v in verdicts), file=out)
        if self.hosts is not None:
            print("", file=out)
            print(
                "Across hosts, not in fds above: the transfer engine's TCP connections, and of those the "
                "ones to engines of owners that are gone (CLOSE_WAIT: Mooncake never closes them), start -> "
                "end:",
                file=out,
            )
            for child in [*long_lived, *self.pullers]:
                start, end = child.samples.get("start"), child.samples.get("end")
                if start is not None and end is not None:
                    print(
                        f"  {child.label:<26} {start.engine_sockets:>4} -> {end.engine_sockets:<4} of which "
                        f"to engines gone {start.stale_engine_sockets:>4} -> {end.stale_engine_sockets}",
                        file=out,
                    )
        restarted = [c for c in self.incarnations if c.ref is not None and c.ref.restarting]
        if restarted:
            print("", file=out)
            print(
                "Restarted owners, one row per incarnation (start 1 s after it came up, end just before "
                "its stop; not quiescent, so for information):",
                file=out,
            )
            print(header, file=out)
            for child in restarted:
                mode = child.ref.mode if child.ref else ""
                _print_rows(out, f"{child.label} ({mode} owner)", child.pid, child.samples)
        print("", file=out)
        print(
            f"/dev/shm entries on this host (all users and sessions, for information): "
            f"{self.system_shm.get('start', '-')} at start, {self.system_shm.get('end', '-')} at end; "
            f"left by this run: {len(self.leftover)}",
            file=out,
        )
        summaries = [c.summary for c in self.pullers if c.summary is not None]
        verified = sum(s.verified for s in summaries)
        nbytes = sum(s.verified_nbytes for s in summaries)
        stale = sum(s.stale for s in summaries)
        expected: Counter[str] = Counter()
        for s in summaries:
            expected.update(s.expected)
        print(
            f"pulls verified: {verified} ({nbytes / (1 << 30):.2f} GiB, every byte checked); "
            f"restarts: {sum(self.restarts.values())} ({self.restarts['SIGKILL']} SIGKILL, "
            f"{self.restarts['finalize']} finalize); owner incarnations: {len(self.incarnations)}",
            file=out,
        )
        for child in self.pullers:
            summary = child.summary
            if summary is not None:
                print(
                    f"  {child.label} ({child.puller.mode if child.puller else ''}): "
                    f"{summary.verified} pulls, "
                    f"{summary.verified_nbytes / (1 << 20):.1f} MiB verified, {summary.failures} failure(s)",
                    file=out,
                )
        print(
            f"stale catalogue entries (a restarted v2 owner reused a cache id; bytes intact): {stale}",
            file=out,
        )
        print("expected errors by call and code:" + ("" if expected else " none"), file=out)
        for name, count in sorted(expected.items()):
            print(f"  {name:<45}{count:>8}", file=out)
        return not_flat


def _print_rows(out: Any, label: str, pid: int, samples: dict[str, Figures]) -> None:
    for when in ("start", "end"):
        figures = samples.get(when)
        cells = "".join(
            f"{_format(getattr(figures, r.attribute), r.unit):>17}" if figures else f"{'-':>17}"
            for r in RULES
        )
        first = when == "start"
        print(f"{label if first else '':<28}{pid if first else '':>8}  {when:<8}{cells}", file=out)


def _without_rss(figures: Figures) -> tuple[object, ...]:
    return (
        figures.fds,
        figures.threads,
        figures.shm_live_nbytes,
        figures.shm_deleted_nbytes,
        figures.segments,
    )


def _format(value: int, unit: int) -> str:
    return f"{value / unit:.1f}" if unit > 1 else str(value)


def _pick_ports(rng: random.Random, count: int, ip: str) -> list[int]:
    """Ports in 26000-26999 whose socket for `ip` is not already in the runtime directory."""
    from ._runtime import socket_path

    ports: list[int] = []
    while len(ports) < count:
        port = rng.randint(*PORT_RANGE)
        if port not in ports and not socket_path(ip, port).exists():
            ports.append(port)
    return ports


@contextlib.contextmanager
def _environment() -> Iterator[str]:
    """A private runtime directory (unless the user chose one) and a fixed copy-thread count, for the
    children; the driver's own environment is restored afterwards."""
    saved = {key: os.environ.get(key) for key in ("LLM_DATADIST_RUNTIME_DIR", "LLM_DATADIST_COPY_THREADS")}
    created: str | None = None
    if not saved["LLM_DATADIST_RUNTIME_DIR"]:
        created = tempfile.mkdtemp(prefix="llmdd-soak-")
        os.environ["LLM_DATADIST_RUNTIME_DIR"] = os.path.join(created, "run")
    if not saved["LLM_DATADIST_COPY_THREADS"]:
        # The copy threads start lazily, up to this many: a fixed count makes "threads" comparable.
        os.environ["LLM_DATADIST_COPY_THREADS"] = "2"
    try:
        yield os.environ["LLM_DATADIST_RUNTIME_DIR"]
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)


def soak(
    duration_s: float,
    seed: int,
    out: Any = sys.stdout,
    *,
    hosts: bool = False,
    debug_memory_s: float = 0.0,
) -> int:
    """Run the soak; 0 when nothing failed and every figure is flat, 1 otherwise. With `hosts`, the owners
    run in one fresh network namespace and the pullers in another (deleted before this returns)."""
    with contextlib.ExitStack() as stack:
        runtime = stack.enter_context(_environment())
        where: Hosts | None = None
        if hosts:
            stack.enter_context(sigterm_as_exit())
            where = Hosts.of(stack.enter_context(NamespacePair()))
        rng = random.Random(seed)
        ports = _pick_ports(rng, 4, where.prompt_ip if where else IP)
        log_dir = tempfile.mkdtemp(prefix="llmdd-soak-logs-")
        runner = Soak(duration_s, seed, log_dir, out, where, debug_memory_s)
        runner.log(f"soak: {duration_s:.0f} s of churn, seed {seed}, runtime dir {runtime}, ports {ports}")
        if where is not None:
            runner.log(
                f"across hosts: owners in network namespace {where.prompt_netns} at {where.prompt_ip}, "
                f"pullers in {where.decoder_netns} at {where.decoder_ip}, joined by a veth pair; a fresh "
                "random secret"
            )
        try:
            runner.run(ports)
            runner.teardown()
        except BaseException as exc:
            runner.failure(f"driver: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            raise
        finally:
            runner.kill_all()
            runner.check_segments()
        runner.checks()
        not_flat = runner.report()
    print("", file=out)
    if runner.failures:
        grouped = Counter(runner.failures)
        print(f"FAILURES ({len(runner.failures)}, {len(grouped)} distinct):", file=out)
        for text, count in grouped.items():
            times = f"{count} x " if count > 1 else ""
            print("  " + times + text.replace("\n", "\n    "), file=out)
    if not_flat:
        print(f"NOT FLAT ({len(not_flat)}):", file=out)
        for text in not_flat:
            print("  " + text, file=out)
    if runner.failures or not_flat:
        print(f"output of every process: {log_dir}", file=out)
        print(f"soak: FAIL ({len(runner.failures)} failure(s), {len(not_flat)} figure(s) not flat)", file=out)
        return 1
    if debug_memory_s > 0:
        print(f"output of every process (memory dumps in the long-lived ones'): {log_dir}", file=out)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    print("soak: PASS (no failure, every figure flat)", file=out)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, help="churn this many minutes (default 1)")
    length.add_argument("--seconds", type=float, help="churn this many seconds (short runs)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (printed; default: random)")
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="owners and pullers on two hosts: two network namespaces made for the run (root, iproute2 "
        "and the multihost extra)",
    )
    # For finding what grows: the long-lived children dump tracemalloc, gc and malloc figures to their logs
    # every this many seconds (slows them down; docs/soak.md).
    parser.add_argument("--debug-memory", type=float, default=0.0, metavar="S", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.seconds is not None:
        duration_s = float(args.seconds)
    elif args.minutes is not None:
        duration_s = 60.0 * float(args.minutes)
    else:
        duration_s = 60.0
    if not math.isfinite(duration_s) or duration_s <= 0:
        print("soak: the duration must be positive", file=sys.stderr)
        return 2
    if args.hosts:
        from ._demo import hosts_unavailable

        reason = hosts_unavailable()
        if reason is not None:
            print(f"soak --hosts: {reason}", file=sys.stderr)
            return 2
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    return soak(duration_s, seed, hosts=args.hosts, debug_memory_s=args.debug_memory)
