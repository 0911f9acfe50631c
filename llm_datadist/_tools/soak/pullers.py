"""The soak's pullers: a v1 DECODER, a v2 one-sided puller and a v2 leased one, each pulling what the
owners' catalogues name into memory it allocates or registers for the pull, and checking every byte.

Rules: a wrong byte, an unexpected status code or exception is a failure reported to the driver; the codes
a freed cache or a restarting owner gives are counted as expected. After a link failure a puller unlinks
with force and relinks every 100 ms. At a checkpoint it holds exactly one fresh link per owner.
"""

from __future__ import annotations

import os
import random
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)

from ..patterns import body_matches, make_stamp, read_stamp
from .memdebug import settle_heap
from .spec import (
    BIG_PULL_NBYTES,
    EXPECTED_ALWAYS,
    HEARTBEAT_S,
    LINK_CODES,
    LINK_TIMEOUT_MS,
    MAX_FAILURE_LINES,
    START_TIMEOUT_S,
    U64_MAX,
    ChildPipe,
    Entry,
    PullerSpec,
    cluster_info,
    memory_at,
    memory_probe,
    options,
    redirect_output,
    report_thread_deaths,
    settle_pool,
)


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
    def __init__(self, spec: PullerSpec, pipe: ChildPipe, datadist: LLMDataDist) -> None:
        self.spec = spec
        self.pipe = pipe
        self.datadist = datadist
        self.rng = random.Random(f"{spec.seed}/{spec.name}")
        self.owners = {ref.cluster_id: ref for ref in spec.owners}
        self.order = list(self.owners)
        self.turn = 0
        self.catalogue: dict[int, dict[tuple[int, int], Entry]] = {c: {} for c in self.owners}
        self.newest: dict[int, int] = dict.fromkeys(self.owners, 0)
        # The req_id keys this puller saw consumed, by the entry they belong to (cluster, incarnation,
        # serial): forgotten with the entry, or a long run's puller grows by every key it ever pulled.
        self.consumed: dict[tuple[int, int, int], set[int]] = {}
        self.linked: dict[int, bool] = dict.fromkeys(self.owners, False)
        self.next_link: dict[int, float] = dict.fromkeys(self.owners, 0.0)
        self.summary = PullerSummary()
        self.warm_from: set[int] = set()
        self.big_pull = False
        self.warm = False
        self.next_beat = 0.0
        # The req_id key of the v1 pull in progress: (its entry, as `consumed` names it; the key id).
        self.last_key: tuple[tuple[int, int, int], int] | None = None

    # -- bookkeeping

    def fail(self, text: str) -> None:
        self.summary.failures += 1
        if self.summary.failures <= MAX_FAILURE_LINES:
            self.pipe.send("fail", f"{self.spec.name}: {text}")

    def beat(self) -> None:
        now = time.monotonic()
        if now >= self.next_beat:
            # The counts so far, for the driver's progress line.
            self.pipe.send("beat", self.summary.verified, self.summary.verified_nbytes)
            self.next_beat = now + HEARTBEAT_S

    def handle(self, message: tuple[Any, ...]) -> str | None:
        command = message[0]
        if command == "pub":
            entry: Entry = message[1]
            cluster = entry.cluster_id
            if entry.incarnation > self.newest[cluster]:  # the owner restarted: its old catalogue is void
                self.newest[cluster] = entry.incarnation
                self.catalogue[cluster].clear()
                self.consumed = {e: k for e, k in self.consumed.items() if e[0] != cluster}
            if entry.incarnation == self.newest[cluster]:
                self.catalogue[cluster][(entry.incarnation, entry.serial)] = entry
        elif command == "ret":
            _, name, incarnation, serial = message
            for cluster, ref in self.owners.items():
                if ref.name == name:
                    self.catalogue[cluster].pop((incarnation, serial), None)
                    self.consumed.pop((cluster, incarnation, serial), None)
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
            _, codes = self.datadist.link_clusters([cluster_info(ref, self.spec.ip)], timeout=LINK_TIMEOUT_MS)
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
                [cluster_info(ref, self.spec.ip)], timeout=LINK_TIMEOUT_MS, force=True
            )
        except LLMException as exc:
            codes = [exc.status_code]
        if codes[0] not in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_NOT_YET_LINK):
            self.fail(f"unlink_clusters(force=True) from {ref.name} gave {codes[0].name}")

    # -- pulls

    def check(
        self, got: np.ndarray[Any, Any], entry: Entry, tensor: int, unit: int, *, stale_ok: bool
    ) -> bool:
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

    def pull_v1(
        self, entry: Entry
    ) -> tuple[int, list[tuple[np.ndarray[Any, Any], int, int]], Callable[[], None]]:
        kvm = self.datadist.kv_cache_manager
        rng = self.rng
        entry_id = (entry.cluster_id, entry.incarnation, entry.serial)
        consumed = self.consumed.get(entry_id, set())
        choices = [k for k in entry.keys if k[1] or k[2] not in consumed]
        if not choices:
            self.catalogue[entry.cluster_id].pop((entry.incarnation, entry.serial), None)
            self.consumed.pop(entry_id, None)
            return 0, [], lambda: None
        slot, is_prefix, key_id = rng.choice(choices)
        self.last_key = None if is_prefix else (entry_id, key_id)
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
            self.consumed.setdefault(entry_id, set()).add(key_id)
        units = [
            (memory_at(address, entry.unit_nbytes), t, slot)
            for address, t in zip(dst.per_device_tensor_addrs[0], tensors, strict=True)
        ]
        return len(tensors) * entry.unit_nbytes, units, lambda: kvm.deallocate_cache(dst)

    def pull_v2(
        self, entry: Entry
    ) -> tuple[int, list[tuple[np.ndarray[Any, Any], int, int]], Callable[[], None]]:
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
                    entry_id, key_id = self.last_key
                    self.consumed.setdefault(entry_id, set()).add(key_id)
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
        self.consumed.clear()
        if self.spec.mode == "v1":
            settle_pool(self.datadist.kv_cache_manager)
        self.await_housekeeping(deadline)
        settle_heap()
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

    def await_housekeeping(self, deadline: float) -> None:
        """Wait for a whole pass of the library's housekeeping begun after now: the owners are quiet, so
        whatever segment of theirs they retired is unmapped here by then (however busy the machine, the
        checkpoint then samples a settled puller, not one whose next pass is late)."""
        core = self.datadist._require_core()
        target = core.housekept + 2  # the pass under way, if any, may have looked before the owners settled
        while core.housekept < target:
            if time.monotonic() > deadline:
                self.fail("the library's housekeeping made no pass at the checkpoint")
                return
            time.sleep(0.05)
            self.beat()

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


def puller_main(conn: Connection, spec: PullerSpec, log_path: str) -> None:
    redirect_output(log_path)
    pipe = ChildPipe(conn)
    report_thread_deaths(pipe, spec.name)
    datadist = LLMDataDist(LLMRole.DECODER, spec.cluster_id)
    code = 0
    puller: _Puller | None = None
    probe = memory_probe(spec.name, spec.debug_memory_s)
    try:
        datadist.init(options(spec.mode, None))
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
