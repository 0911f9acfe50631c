"""The transfers this process starts to one peer incarnation: an engine of its own (`PeerEngine`), and the
orphans, transfers whose call gave up while the engine still runs them (`Orphans`).

Rules: Mooncake keeps its pooled connections to a peer engine until the engine ends (it has no call that
closes them, and never notices an idle one's peer went), so each peer incarnation we transfer with gets
an engine that ends with the last link using it. One worker thread per engine runs its transfers, in
batches of at most `MAX_DESCRIPTORS` runs, so that the caller's deadline and the peer's death are noticed
on time; the local memory stays pinned until the engine let go of it. An orphan holds back only the
transfers whose local memory overlaps its own: one to a dead peer never stops the others.

Life of a `PeerEngine` (who moves it):

| state   | what it does                                   | next, and who moves it                        |
|---------|------------------------------------------------|-----------------------------------------------|
| serving | runs the transfers queued to it, in order      | retired: `CrossHost`, when the worker is idle |
|         |                                                | and no live link uses it, or at `drain`       |
| retired | refuses new transfers, runs those queued       | ended: the worker, once the queue is empty    |
| ended   | the engine destroyed (its connections closed), | -                                             |
|         | the worker thread gone                         |                                               |
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import StatusError, TransferTimeout
from .._signals import hold_here
from ..status import LLMStatusCode
from ..utils.log import log
from .remote import DEFAULT_PROGRESS_TIMEOUT_S, MAX_DESCRIPTORS, register, start_engine, unregister

_POLL_S = 0.02  # how often a waiting caller looks at its deadline and at the peer
IDLE_CHECK_S = 0.5  # how often an idle worker asks whether a link still uses its engine

Spans = list[tuple[int, int]]  # [start, end) address ranges, sorted, disjoint


def spans_of(addrs: Sequence[int], lengths: Sequence[int]) -> Spans:
    """The local memory a transfer touches: its runs, sorted and merged."""
    merged: Spans = []
    for start, nbytes in sorted(zip(addrs, lengths, strict=True)):
        end = start + nbytes
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def overlap(a: Spans, b: Spans) -> bool:
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][0] < b[j][1] and b[j][0] < a[i][1]:
            return True
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return False


class _Ticket:
    """One transfer between its caller and the worker: queued, running, done; `cancelled` by a caller
    that gave up before it ran (the worker skips it); `orphan` (a token) once its caller gave up while it
    runs."""

    __slots__ = ("cancelled", "done", "error", "orphan", "running", "spans_of")

    def __init__(self, spans: Callable[[], Spans]) -> None:
        self.running = False
        self.done = threading.Event()
        self.cancelled = False
        self.error: BaseException | None = None
        self.orphan: int | None = None
        self.spans_of = spans


class Orphans:
    """This process's transfers whose call gave up while an engine still runs them, by the local memory
    they may still write into (or read from). Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._spans: dict[int, Spans] = {}
        self._tokens = itertools.count(1)

    def __len__(self) -> int:
        with self._cond:
            return len(self._spans)

    def wait_clear(
        self, addrs: Sequence[int], lengths: Sequence[int], deadline: float, timeout_code: LLMStatusCode
    ) -> None:
        """Wait until no orphan touches the memory of runs `addrs`/`lengths`: what an orphan writes late
        must not overwrite what this transfer writes. TransferTimeout(`timeout_code`) at `deadline`."""
        with self._cond:
            if not self._spans:
                return
            mine = spans_of(addrs, lengths)
            while any(overlap(mine, theirs) for theirs in self._spans.values()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeout(
                        timeout_code,
                        "a transfer into the same memory that failed earlier is still running in the "
                        f"transfer engine (it ends within {progress_timeout_s():g} s)",
                    )
                self._cond.wait(remaining)

    def gave_up(self, ticket: _Ticket) -> None:
        """The caller of `ticket` gave up: a transfer not started yet never runs, a running one becomes an
        orphan until it ends."""
        with self._cond:
            if ticket.done.is_set():
                return
            if not ticket.running:
                ticket.cancelled = True
                return
            ticket.orphan = next(self._tokens)
            self._spans[ticket.orphan] = ticket.spans_of()

    def start(self, ticket: _Ticket) -> bool:
        """The worker takes `ticket`: False when its caller gave up before."""
        with self._cond:
            ticket.running = not ticket.cancelled
            return ticket.running

    def ended(self, ticket: _Ticket) -> None:
        with self._cond:
            ticket.done.set()
            if ticket.orphan is not None:
                del self._spans[ticket.orphan]
                self._cond.notify_all()


ORPHANS = Orphans()


class PeerEngine:
    """Our engine for the transfers to one peer incarnation's engine at `peer` ("ip:port"), started on
    `local_ip`, with its worker thread. `links` are the links that use it (weakly held), `first_link` the
    one it is started for; `on_idle(self)` is asked when the worker has been idle for a while, and retires
    the engine when none is live."""

    def __init__(
        self, local_ip: str, peer: str, on_idle: Callable[[PeerEngine], None], first_link: Any
    ) -> None:
        self._engine: Any
        self._engine, self.address, self.protocol, self._quick_from = start_engine(local_ip, quick_end=True)
        self.local_ip = local_ip
        self.peer = peer
        # Noted before the worker starts: its first idle check must see the link it was started for.
        self.links: weakref.WeakSet[Any] = weakref.WeakSet([first_link])
        self._on_idle = on_idle
        self._cond = threading.Condition()
        self._queue: deque[tuple[_Ticket, Callable[[], None]]] = deque()
        self._retired = False
        self._pending = 0  # transfers queued or running
        self._registered: dict[int, int] = {}  # over RDMA: our own memory, address -> nbytes
        self._thread = threading.Thread(target=self._work, name=f"llmdd-engine-{peer}", daemon=True)
        self._thread.start()
        log.debug("transfer engine at %s for %s", self.address, peer)

    # ----------------------------------------------------------------- life

    def retire(self) -> None:
        """No new transfer; the engine ends once those queued have run."""
        with self._cond:
            self._retired = True
            self._cond.notify_all()

    @property
    def retired(self) -> bool:
        return self._retired

    @property
    def pending(self) -> int:
        """Transfers queued or running (those whose call gave up included)."""
        return self._pending

    def join(self, timeout_s: float) -> bool:
        """Wait (bounded) until the engine ended; True when it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _work(self) -> None:
        hold_here()
        while True:
            with self._cond:
                if not self._queue and not self._retired:
                    self._cond.wait(IDLE_CHECK_S)
                item = self._queue.popleft() if self._queue else None
                retired = self._retired
            if item is not None:
                ticket, work = item
                item = None
                if ORPHANS.start(ticket):
                    work()
                ORPHANS.ended(ticket)
                del ticket, work
                with self._cond:
                    self._pending -= 1
                continue
            if retired:
                break
            try:
                self._on_idle(self)
            except Exception:  # never lose the worker: ask again at the next idle moment
                log.exception("transfer engine for %s: the idle check failed", self.peer)
        self._end()

    def _end(self) -> None:
        # Destroying the engine closes its connections and joins its threads, the GIL held: quick only
        # once its handshake listener's long accept() is over (`remote.start_engine`).
        wait_s = self._quick_from - time.monotonic()
        if 0 < wait_s <= 2.0:
            time.sleep(wait_s)
        with self._cond:
            engine, self._engine = self._engine, None
            self._registered.clear()
        del engine
        # The engine's buffers were freed into glibc's heap, which keeps them (a peer that restarts every
        # few seconds would leave the process tens of MiB above what it uses): give them back now.
        _trim_heap()
        log.debug("transfer engine at %s for %s ended", self.address, self.peer)

    # ----------------------------------------------------------------- our memory (RDMA only)

    def register(self, addr: int, nbytes: int) -> None:
        """Over RDMA, the engine that reads or writes our memory must have it registered."""
        with self._cond:
            if self._engine is not None:
                register(self._engine, self._registered, addr, nbytes)

    def unregister(self, addr: int) -> None:
        with self._cond:
            if self._engine is not None:
                unregister(self._engine, self._registered, addr)

    # ----------------------------------------------------------------- transfers

    def transfer(
        self,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
        *,
        write: bool,
        deadline: float,
        timeout_code: LLMStatusCode,
        check_peer: Callable[[], None],
        hold: Callable[[], Callable[[], None]],
    ) -> None:
        """Read (or `write`) runs between our memory and the peer's engine. Returns when all landed;
        TransferTimeout(`timeout_code`) at `deadline`; whatever `check_peer` raises (the link says the peer
        is gone) at once. `hold()` pins the local memory and returns its release, called when the engine
        is done with it, which may be after this call gave up (an orphan: the caller waits with
        `ORPHANS.wait_clear` before a transfer touching its memory)."""
        if not lengths:
            return
        batches = [
            (
                list(local_addrs[i : i + MAX_DESCRIPTORS]),
                list(remote_addrs[i : i + MAX_DESCRIPTORS]),
                list(lengths[i : i + MAX_DESCRIPTORS]),
            )
            for i in range(0, len(lengths), MAX_DESCRIPTORS)
        ]
        ticket = _Ticket(lambda: spans_of(local_addrs, lengths))
        release = hold()

        def work() -> None:
            try:
                ticket.error = self._run(batches, write)
            except BaseException as exc:  # reported to the caller, never lost in this thread
                ticket.error = exc
            finally:
                release()

        with self._cond:
            if self._retired:
                release()
                raise StatusError(
                    LLMStatusCode.LLM_LINK_FAILED, f"the link to the engine at {self.peer} was closed"
                )
            self._queue.append((ticket, work))
            self._pending += 1
            self._cond.notify_all()
        try:
            while not ticket.done.wait(min(_POLL_S, max(deadline - time.monotonic(), 0.0))):
                check_peer()
                if time.monotonic() >= deadline:
                    raise TransferTimeout(
                        timeout_code, f"the transfer with {self.peer} did not finish in time"
                    )
        except BaseException:
            ORPHANS.gave_up(ticket)
            if ticket.cancelled:
                release()  # the worker skips it, and its release with it
            raise
        if ticket.error is not None:
            raise ticket.error

    def _run(
        self, batches: list[tuple[list[int], list[int], list[int]]], write: bool
    ) -> BaseException | None:
        engine = self._engine
        run = engine.batch_transfer_sync_write if write else engine.batch_transfer_sync_read
        for local, remote, nbytes in batches:
            code = run(self.peer, local, remote, nbytes)
            if code != 0:
                # The engine gave up on the peer (unreachable, reset, refused): the link is broken.
                return StatusError(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"the transfer engine failed a {'write to' if write else 'read from'} {self.peer} "
                    f"(code {code})",
                )
        return None


def _load_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None (another C library)."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_malloc_trim = _load_trim()


def _trim_heap() -> None:
    if _malloc_trim is not None:
        _malloc_trim(0)


def progress_timeout_s() -> float:
    """How long a transfer can outlive its call (the engine's progress timeout)."""
    try:
        return float(os.environ.get("MC_TCP_PROGRESS_TIMEOUT_SEC", DEFAULT_PROGRESS_TIMEOUT_S))
    except ValueError:
        return float(DEFAULT_PROGRESS_TIMEOUT_S)
