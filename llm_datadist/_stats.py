"""What an initialised instance moved, how fast and what failed: its figures in a stats segment of its
own (`shm.stats`), which `llm-datadist stats` and `llm_datadist.ext.stats()` read without waking it.

Rules: a transfer is counted once, when it ends, by the layer that knows its kind (API generation, what
it did, how the bytes moved): successes with their bytes, runs and duration (a histogram of powers of two
of microseconds), failures by generation and operation and by status code. Adds take no lock (each thread
writes its own row of the segment). `LLM_DATADIST_STATS=0` switches counting off (`Stats.off`): the same
calls then do nothing, which is how `bench` measures what counting costs. docs/metrics.md lists every
figure.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from llm_datadist._shm.errors import ShmError
from llm_datadist._shm.stats import DEFAULT_ROWS, BadStats, StatsReading, StatsSegment, read_stats

from ._native import kernel_function
from ._wire.door import REFUSAL_CAUSES
from .configs import LLMRole
from .status import LLMStatusCode
from .utils.log import log

ENV_STATS = "LLM_DATADIST_STATS"

# The API that made the transfer: llm_datadist's two generations, and the `hixl` engine.
GENERATIONS: Final = ("v1", "v2", "hixl")
GEN_V1, GEN_V2, GEN_HIXL = 0, 1, 2
# The role a `hixl` engine's instance records (not an LLMRole: an engine is neither side).
ROLE_HIXL: Final = 100
# pull and push: through a pin (the owner's index, or a lease it grants); read and write: one-sided (v2
# with remote cache access: the owner's memory read with no pin, or written under one).
OPERATIONS: Final = ("pull", "push", "read", "write")
PULL, PUSH, READ, WRITE = 0, 1, 2, 3
# shm: a mapped segment of a peer on this host; cma: registered memory of a peer on this host
# (process_vm_readv / process_vm_writev); mooncake: a peer on another host, through Mooncake.
TRANSPORTS: Final = ("shm", "cma", "mooncake")
SHM, CMA, MOONCAKE = 0, 1, 2
# Histogram buckets: bucket i counts transfers shorter than 2**i us (i < BUCKETS - 1), the last the rest.
BUCKETS: Final = 22
EVENTS: Final = (
    "links_made",
    "links_broken",
    *(f"links_refused_{cause}" for cause in REFUSAL_CAUSES),
    "keys_published",
    "keys_removed",
    "keys_consumed",
    "peer_restarts_seen",
)
GAUGES: Final = ("caches", "pool_used_bytes", "leases", "pins", "links", "index_lock_waits")
_FAILED_CODES: Final = tuple(code for code in LLMStatusCode if code != LLMStatusCode.LLM_SUCCESS)


def bucket_names(prefix: str) -> list[str]:
    """The histogram's slots for `prefix` ("<generation>.<operation>"), bucket by bucket."""
    names = [f"{prefix}.under_{1 << i}us" for i in range(BUCKETS - 1)]
    names.append(f"{prefix}.over_{1 << (BUCKETS - 2)}us")
    return names


def operation_totals(counters: Mapping[str, int]) -> dict[str, dict[str, float]]:
    """Per operation ("pull", "push", "read", "write"): transfers, bytes, seconds and failures, every
    generation and transport together."""
    out: dict[str, dict[str, float]] = {}
    for operation in OPERATIONS:
        row = {"transfers": 0.0, "bytes": 0.0, "seconds": 0.0, "failures": 0.0}
        for generation in GENERATIONS:
            prefix = f"{generation}.{operation}"
            for transport_name in TRANSPORTS:
                row["transfers"] += counters.get(f"{prefix}.{transport_name}.transfers", 0)
                row["bytes"] += counters.get(f"{prefix}.{transport_name}.bytes", 0)
            row["seconds"] += counters.get(f"{prefix}.seconds_sum_ns", 0) / 1e9
            row["failures"] += counters.get(f"{prefix}.failures", 0)
        out[operation] = row
    return out


def _slot_names() -> list[str]:
    names = [
        f"{generation}.{operation}.{transport}.{field}"
        for generation in GENERATIONS
        for operation in OPERATIONS
        for transport in TRANSPORTS
        for field in ("transfers", "bytes", "runs")
    ]
    for generation in GENERATIONS:
        for operation in OPERATIONS:
            prefix = f"{generation}.{operation}"
            names.append(f"{prefix}.seconds_sum_ns")
            names.append(f"{prefix}.failures")
            names.extend(bucket_names(prefix))
    names.extend(f"status.{code.name}" for code in _FAILED_CODES)
    names.extend(f"events.{event}" for event in EVENTS)
    return names


SLOTS: Final = tuple(_slot_names())
_SLOT: Final = {name: index for index, name in enumerate(SLOTS)}
_KIND_WIDTH = 3  # transfers, bytes, runs
_OPERATION_COUNT, _TRANSPORT_COUNT = len(OPERATIONS), len(TRANSPORTS)
_TIMING_BASE = len(GENERATIONS) * len(OPERATIONS) * len(TRANSPORTS) * _KIND_WIDTH
_TIMING_WIDTH = 2 + BUCKETS  # the sum, failures, the buckets
_STATUS_SLOT: Final[dict[LLMStatusCode, int]] = {code: _SLOT[f"status.{code.name}"] for code in _FAILED_CODES}
LINKS_MADE, LINKS_BROKEN = _SLOT["events.links_made"], _SLOT["events.links_broken"]
KEY_EVENTS: Final = {kind: _SLOT[f"events.keys_{kind}"] for kind in ("published", "removed", "consumed")}
PEER_RESTARTS = _SLOT["events.peer_restarts_seen"]
REFUSALS: Final = {cause: _SLOT[f"events.links_refused_{cause}"] for cause in REFUSAL_CAUSES}


# (first slot of a kind's transfers, bytes and runs; first slot of its operation's timing), by
# [generation][operation][transport].
_PLACES: Final = tuple(
    tuple(
        tuple(
            (
                ((generation * _OPERATION_COUNT + operation) * _TRANSPORT_COUNT + transport) * _KIND_WIDTH,
                _TIMING_BASE + (generation * _OPERATION_COUNT + operation) * _TIMING_WIDTH,
            )
            for transport in range(_TRANSPORT_COUNT)
        )
        for operation in range(_OPERATION_COUNT)
    )
    for generation in range(len(GENERATIONS))
)


# One transfer's adds in C (None without the kernel: the same adds in Python).
_count_transfer = kernel_function("count_transfer")


def role_name(role: int) -> str:
    """A stats segment's role as the readers show it: "prompt", "decoder", "mix", "hixl" (else the
    number)."""
    if role == ROLE_HIXL:
        return "hixl"
    try:
        return LLMRole(role).name.lower()
    except ValueError:
        return str(role)


def counting_enabled() -> bool:
    return os.environ.get(ENV_STATS, "") not in ("0", "off", "no", "false")


@dataclass(frozen=True)
class Snapshot:
    """Figures of this process's instances, summed, at one moment (`llm_datadist.ext.stats()`): plain data.

    `counters` holds every slot (docs/metrics.md): per API generation, operation and transport the
    transfers, bytes and byte runs; per generation and operation the summed duration in ns, the failures
    and a histogram of durations; failures by status code; links made and broken. `gauges` are the
    latest values (caches, pool bytes in use, leases, local pins, links). `since(earlier)` is the
    difference (gauges as now), `totals()` sums transfers, bytes, seconds and failures per operation."""

    taken_ns: int
    counters: dict[str, int] = field(default_factory=dict)
    gauges: dict[str, int] = field(default_factory=dict)

    def since(self, earlier: Snapshot) -> Snapshot:
        """What happened between `earlier` and this snapshot."""
        counters = {name: value - earlier.counters.get(name, 0) for name, value in self.counters.items()}
        return Snapshot(self.taken_ns - earlier.taken_ns, counters, dict(self.gauges))

    def totals(self) -> dict[str, dict[str, float]]:
        """`operation_totals` of these counters."""
        return operation_totals(self.counters)

    def to_dict(self) -> dict[str, Any]:
        return {"taken_ns": self.taken_ns, "counters": dict(self.counters), "gauges": dict(self.gauges)}


def own_readings() -> list[StatsReading]:
    """One reading per live instance of this process that counts, its gauges refreshed first."""
    readings = []
    for stats in list(_live):
        try:
            stats.publish_gauges()
        except Exception:  # an instance closing meanwhile: its last gauges stand
            log.debug("stats: gauges not refreshed", exc_info=True)
        reading = stats.reading()
        if reading is not None:
            readings.append(reading)
    return readings


def snapshot() -> Snapshot:
    """The figures of every live instance of this process, summed (`llm_datadist.ext.stats`)."""
    counters = dict.fromkeys(SLOTS, 0)
    gauges = dict.fromkeys(GAUGES, 0)
    for reading in own_readings():
        for name, value in reading.slots.items():
            counters[name] = counters.get(name, 0) + value
        for name, value in reading.gauges.items():
            gauges[name] = gauges.get(name, 0) + value
    return Snapshot(time.time_ns(), counters, gauges)


class Stats:
    """The counting side of one instance (`off()` when counting is switched off or the segment could not
    be made: every call then does nothing)."""

    __slots__ = ("__weakref__", "_claimed", "_incarnations", "_local", "_lock", "_segment", "gauge_source")

    def __init__(self, segment: StatsSegment | None) -> None:
        self._segment = segment
        # Each thread adds to a row of its own (no lock, no lost add): `_puller.local.row` is its first word,
        # claimed at its first add; once every row but the last is claimed, later threads share the last
        # one under `_lock` (their `_puller.local.row` is then negative).
        self._local = threading.local()
        self._lock = threading.Lock()
        self._claimed = 0
        self._incarnations: dict[int, int] = {}  # cluster id -> the incarnation its last link found
        # What the gauges are now, by name (`GAUGES`); set by the instance, read by `publish_gauges`.
        self.gauge_source: Callable[[], dict[str, int]] | None = None
        if segment is not None:
            _live.add(self)

    @classmethod
    def create(cls, *, role: int, cluster_id: int, rows: int = DEFAULT_ROWS) -> Stats:
        """A new stats segment for an instance; counting off (and said why) when it is switched off or
        the segment cannot be made (a full /dev/shm must not keep an instance from starting)."""
        if not counting_enabled():
            return cls.off()
        try:
            segment = StatsSegment.create(
                SLOTS, GAUGES, role=role, cluster_id=cluster_id, created_ns=time.time_ns(), rows=rows
            )
        except (ShmError, OSError) as exc:
            log.warning("no stats for this instance: its stats segment could not be made (%s)", exc)
            return cls.off()
        return cls(segment)

    @classmethod
    def off(cls) -> Stats:
        return cls(None)

    @property
    def name(self) -> str | None:
        """The stats segment's name (None when counting is off)."""
        return None if self._segment is None else self._segment.name

    def transfer(
        self, generation: int, operation: int, transport: int, nbytes: int, runs: int, seconds: float
    ) -> None:
        """One transfer that ended well: `nbytes` in `runs` byte runs, in `seconds`. The hot path: a few
        word adds in this thread's own row, nothing else."""
        segment = self._segment
        if segment is None:
            return
        try:
            address = self._local.address
        except AttributeError:
            self._claim(segment)
            address = self._local.address
        kind, timing = _PLACES[generation][operation][transport]
        ns = int(seconds * 1e9) if seconds > 0 else 0
        if address:  # this thread's own row, and the C kernel: its adds, in one call
            _count_transfer(address, kind, timing, BUCKETS, nbytes, runs, ns)
            return
        bucket = min((ns // 1000).bit_length(), BUCKETS - 1)  # as the kernel's
        row = self._local.row
        if row < 0:  # every row is taken: the shared one, under its lock
            self._add_all(
                segment,
                ((kind, 1), (kind + 1, nbytes), (kind + 2, runs), (timing, ns), (timing + 2 + bucket, 1)),
            )
            return
        # This thread's own row without the kernel: the same adds inline (a call per add costs twice).
        words = segment.words
        kind += row
        timing += row
        words[kind] += 1
        words[kind + 1] += nbytes
        words[kind + 2] += runs
        words[timing] += ns
        words[timing + 2 + bucket] += 1

    def failed(self, generation: int, operation: int, code: LLMStatusCode) -> None:
        """One transfer that failed with `code`."""
        segment = self._segment
        if segment is None:
            return
        timing = _PLACES[generation][operation][0][1]
        status = _STATUS_SLOT.get(code)
        self._add_all(segment, ((timing + 1, 1),) if status is None else ((timing + 1, 1), (status, 1)))

    def event(self, slot: int, n: int = 1) -> None:
        if self._segment is not None:
            self._add_all(self._segment, ((slot, n),))

    # The hooks the instance's parts call (bound methods of this object: none refers back to the instance).

    def linked(self, link: object) -> None:
        """A link made: a peer linked to again under its cluster id with another incarnation restarted."""
        self.event(LINKS_MADE)
        peer = getattr(link, "peer", None)
        if peer is None:
            return
        seen = self._incarnations.get(peer.cluster_id)
        self._incarnations[peer.cluster_id] = peer.incarnation
        if seen is not None and seen != peer.incarnation:
            self.event(PEER_RESTARTS)

    def refused(self, cause: str) -> None:
        self.event(REFUSALS.get(cause, REFUSALS["other"]))

    def keys(self, kind: str, n: int) -> None:
        self.event(KEY_EVENTS[kind], n)

    def _add_all(self, segment: StatsSegment, adds: Iterable[tuple[int, int]]) -> None:
        """Add each (slot, n) in the calling thread's row."""
        try:
            row = self._local.row
        except AttributeError:
            row = self._claim(segment)
        words = segment.words
        if row >= 0:
            for slot, n in adds:
                words[row + slot] += n
            return
        with self._lock:  # the shared last row
            for slot, n in adds:
                words[-row + slot] += n

    def _claim(self, segment: StatsSegment) -> int:
        """The calling thread's row, claimed now (negative: the shared last row), and where it is for the
        C kernel (`_puller.local.address`: 0 for the shared row, or without the kernel)."""
        with self._lock:
            if self._claimed < segment.rows - 1:
                row = segment.row_word(self._claimed)
                self._claimed += 1
            else:
                row = -segment.row_word(segment.rows - 1)
        self._local.row = row
        self._local.address = segment.address + 8 * row if row >= 0 and _count_transfer is not None else 0
        return row

    def publish_gauges(self) -> None:
        """Write what `gauge_source` says now into the gauges (whole words: a reader sees each old or new)."""
        segment, source = self._segment, self.gauge_source
        if segment is None or source is None:
            return
        for name, value in source().items():
            segment.set_gauge(GAUGES.index(name), value)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Count nothing inside the with-block, on any thread (what `bench` compares a counted pull with:
        one instance per process, so it cannot be another instance)."""
        segment, self._segment = self._segment, None
        try:
            yield
        finally:
            self._segment = segment

    def reading(self) -> StatsReading | None:
        if self._segment is None:
            return None
        try:
            return read_stats(self._segment.name)
        except BadStats:  # another process wrote over our segment: no figures rather than wrong ones
            return None

    def close(self) -> None:
        _live.discard(self)
        if self._segment is not None:
            self._segment.close()


# Every instance of this process that counts (`snapshot`).
_live: weakref.WeakSet[Stats] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for stats in list(_live):
        stats._lock = threading.Lock()  # one a thread of the parent held stays held in the child
        # The rows claimed before the fork are in the parent's mapping: the child's threads claim rows
        # again, in the private memory the segment moved to (`shm.stats`).
        stats._local = threading.local()
        stats._claimed = 0


os.register_at_fork(after_in_child=_after_fork_in_child)
