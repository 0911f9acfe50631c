"""Asynchronous transfers (`transfer_async`): each runs on a worker thread of its engine; its request is
kept, in submission order, until a status query reports it ended, and then forgotten (as the real engine).

Rules: at most `MAX_REQUESTS_PER_PEER` requests per remote engine that nobody was told ended (running,
queued, or ended and not asked about), RESOURCE_EXHAUSTED past that, as the real engine; a request that
ended and was not asked about within `UNASKED_KEEP_S` is forgotten (the real engine keeps it until asked).
WAITING until it ends, then COMPLETED, FAILED, or TIMEOUT past `ASYNC_TIMEOUT_S` from submission; request
ids are never 0 nor reused; `close` cancels what has not started and waits, bounded, for the rest.

    state     | moved by                          | to
    WAITING   | its worker, when the transfer ends | ended (COMPLETED, FAILED, TIMEOUT)
    ended     | a status query that reports it     | forgotten
    ended     | any call, `UNASKED_KEEP_S` later   | forgotten (reaped)
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from .._signals import hold_here
from ..utils.log import log
from .codes import (
    COMPLETED,
    FAILED,
    PARAM_INVALID,
    RESOURCE_EXHAUSTED,
    SUCCESS,
    TIMEOUT,
    TRANSFER_FAILED,
    TRANSFER_TIMEOUT,
    WAITING,
)

# The bound of an asynchronous transfer, from its submission (the waits for its link included).
ASYNC_TIMEOUT_S = 60.0
# Requests per remote engine not yet reported ended: the real client/server engine's flag queue
# (`HixlCSClient::kFlagQueueSize`, src/hixl/cs/hixl_cs_client.h of hicann/hixl), one flag per request,
# given back only when a status query sees it done; without a free flag `BatchTransferHostAsync` is
# RESOURCE_EXHAUSTED. The communicator engine has no count of its own (a pinned host word per request).
MAX_REQUESTS_PER_PEER = 4096
# How long a request that ended is kept for a query that never comes (a caller that fires and forgets).
UNASKED_KEEP_S = 60.0
_WORKERS = 4
_IDS = itertools.count(1)


@dataclass
class Request:
    """One asynchronous transfer: its id, the remote engine (cluster id) it counts against, the caller's
    `user_data`, and its status once it ended (and when)."""

    req: int
    peer: int
    user_data: int
    status: int = WAITING
    ended_at: float = 0.0
    future: Future[int] | None = field(default=None, repr=False)


class Requests:
    """The asynchronous transfers of one engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[int, Request] = {}  # in submission order
        self._per_peer: Counter[int] = Counter()  # requests kept, by remote engine
        # Those that ended and were not reported yet, in the order they ended: what reaping looks at.
        self._unasked: OrderedDict[int, Request] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    def submit(self, peer: int, user_data: int, work: Callable[[], int]) -> tuple[int, int]:
        """(code, request id): `work` (it returns the transfer's final status) runs on a worker. FAILED
        once closed, RESOURCE_EXHAUSTED while `peer` has `MAX_REQUESTS_PER_PEER` requests kept."""
        with self._lock:
            if self._closed:
                return FAILED, 0
            self._reap(time.monotonic())
            if self._per_peer[peer] >= MAX_REQUESTS_PER_PEER:
                log.error(
                    "transfer_async: %d transfers to this remote engine were not reported ended yet: ask "
                    "get_transfer_status for them before starting more",
                    MAX_REQUESTS_PER_PEER,
                )
                return RESOURCE_EXHAUSTED, 0
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    _WORKERS, thread_name_prefix="hixl-transfer", initializer=hold_here
                )
            request = Request(next(_IDS), peer, user_data)
            self._requests[request.req] = request
            self._per_peer[peer] += 1
            request.future = self._executor.submit(work)
        # Runs at once, here, when the work already ended.
        request.future.add_done_callback(lambda done: self._ended_with(request, done))
        return SUCCESS, request.req

    def _ended_with(self, request: Request, done: Future[int]) -> None:
        status = TRANSFER_FAILED if done.cancelled() or done.exception() is not None else done.result()
        with self._lock:
            request.status = status
            request.ended_at = time.monotonic()
            request.future = None  # the work's closure (its descriptors) goes now, not when asked
            if self._requests.get(request.req) is request:
                self._unasked[request.req] = request

    def _forget(self, request: Request) -> None:
        """(lock held)"""
        del self._requests[request.req]
        self._unasked.pop(request.req, None)
        self._per_peer[request.peer] -= 1
        if not self._per_peer[request.peer]:
            del self._per_peer[request.peer]

    def _reap(self, now: float) -> None:
        """Forget the requests that ended `UNASKED_KEEP_S` ago and were never asked about (lock held)."""
        reaped = 0
        unasked = self._unasked
        while unasked:
            request = next(iter(unasked.values()))
            if now - request.ended_at < UNASKED_KEEP_S:
                break
            self._forget(request)
            reaped += 1
        if reaped:
            log.warning(
                "transfer_async: forgot %d transfers that ended over %.0f s ago and were never asked about",
                reaped,
                UNASKED_KEEP_S,
            )

    def status(self, req: int) -> tuple[int, int]:
        """(code, transfer status) of one request; one that ended is forgotten."""
        with self._lock:
            self._reap(time.monotonic())
            request = self._requests.get(req)
            if request is None:
                return PARAM_INVALID, TRANSFER_FAILED
            if request.status != WAITING:
                self._forget(request)
            return SUCCESS, request.status

    def statuses(self, max_count: int, skip_waiting: bool) -> list[tuple[int, int, int]]:
        """(req, user_data, status) of up to `max_count` requests in submission order (`skip_waiting`:
        only those that ended); those reported ended are forgotten."""
        found: list[tuple[int, int, int]] = []
        with self._lock:
            self._reap(time.monotonic())
            for request in list(self._requests.values()):
                if len(found) >= max_count:
                    break
                if request.status != WAITING:
                    self._forget(request)
                elif skip_waiting:
                    continue
                found.append((request.req, request.user_data, request.status))
        return found

    def close(self, timeout_s: float) -> None:
        """Cancel what has not started, wait up to `timeout_s` for what runs."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
            running = [r.future for r in self._requests.values() if r.future is not None]
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
            wait(running, timeout=timeout_s)


def final_status(code: int) -> int:
    """The transfer status of an asynchronous transfer that ended with `code`."""
    if code == SUCCESS:
        return COMPLETED
    return TRANSFER_TIMEOUT if code == TIMEOUT else TRANSFER_FAILED
