"""Asynchronous transfers (`transfer_async`): each runs on a worker thread of its engine; its request is
kept, in submission order, until a status query finds it ended, and then forgotten (as the real engine).

Rules: WAITING until it ends, then COMPLETED, FAILED, or TIMEOUT past `ASYNC_TIMEOUT_S` from submission;
request ids are never 0 nor reused; `close` cancels what has not started and waits, bounded, for the rest.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from .._signals import hold_here
from .codes import (
    COMPLETED,
    PARAM_INVALID,
    SUCCESS,
    TIMEOUT,
    TRANSFER_FAILED,
    TRANSFER_TIMEOUT,
    WAITING,
)

# The bound of an asynchronous transfer, from its submission (the waits for its link included).
ASYNC_TIMEOUT_S = 60.0
_WORKERS = 4
_IDS = itertools.count(1)


@dataclass
class Request:
    """One asynchronous transfer: its id, the caller's `user_data`, and its status once it ended."""

    req: int
    user_data: int
    status: int = WAITING
    future: Future[int] | None = field(default=None, repr=False)


class Requests:
    """The asynchronous transfers of one engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[int, Request] = {}  # in submission order
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    def submit(self, user_data: int, work: Callable[[], int]) -> int:
        """Run `work` (it returns the transfer's final status) on a worker; the request id, or 0 once
        closed."""
        with self._lock:
            if self._closed:
                return 0
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    _WORKERS, thread_name_prefix="hixl-transfer", initializer=hold_here
                )
            request = Request(next(_IDS), user_data)
            self._requests[request.req] = request
            request.future = self._executor.submit(work)
        request.future.add_done_callback(lambda done: self._ended(request, done))
        return request.req

    def _ended(self, request: Request, done: Future[int]) -> None:
        status = TRANSFER_FAILED if done.cancelled() or done.exception() is not None else done.result()
        with self._lock:
            request.status = status

    def status(self, req: int) -> tuple[int, int]:
        """(code, transfer status) of one request; one that ended is forgotten."""
        with self._lock:
            request = self._requests.get(req)
            if request is None:
                return PARAM_INVALID, TRANSFER_FAILED
            if request.status != WAITING:
                del self._requests[req]
            return SUCCESS, request.status

    def statuses(self, max_count: int, skip_waiting: bool) -> list[tuple[int, int, int]]:
        """(req, user_data, status) of up to `max_count` requests in submission order (`skip_waiting`:
        only those that ended); those reported ended are forgotten."""
        found: list[tuple[int, int, int]] = []
        with self._lock:
            for request in list(self._requests.values()):
                if len(found) >= max_count:
                    break
                if request.status != WAITING:
                    del self._requests[request.req]
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
