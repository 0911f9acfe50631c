"""Asynchronous connects and disconnects: a bounded queue of tasks, a few workers, and the status of the
latest task per remote engine, with the rules of the real engine's connect pool.

Rules: RESOURCE_EXHAUSTED beyond `capacity` queued tasks; one engine's tasks run one at a time in order;
a status is never overwritten by an older task of the other kind; a finished disconnect forgets the
engine. Workers start with the first task; `close` drops what waits and joins them, each task bounded.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .._signals import held
from ..utils.log import log
from .codes import (
    ALREADY_CONNECTED,
    CONNECT_FAILED,
    CONNECT_PENDING,
    CONNECTED,
    CONNECTING,
    DISCONNECT_PENDING,
    DISCONNECTING,
    FAILED,
    NOT_CONNECT,
    RESOURCE_EXHAUSTED,
    SUCCESS,
)

# (remote engine, timeout ms) -> a status code.
Call = Callable[[str, int], int]


@dataclass(frozen=True)
class _Task:
    remote: str
    timeout_ms: int
    connect: bool


class ConnectPool:
    """The asynchronous connects of one engine."""

    def __init__(self, threads: int, capacity: int, connect: Call, disconnect: Call) -> None:
        self._threads = threads
        self._capacity = capacity
        self._connect = connect
        self._disconnect = disconnect
        self._lock = threading.Condition()
        self._tasks: deque[_Task] = deque()
        self._doing: set[str] = set()
        self._status: dict[str, int] = {}
        self._workers: list[threading.Thread] = []
        self._closed = False

    def submit(self, remote: str, timeout_ms: int, *, connect: bool) -> int:
        with self._lock:
            if self._closed:
                return FAILED
            if len(self._tasks) >= self._capacity:
                return RESOURCE_EXHAUSTED
            self._set(remote, CONNECT_PENDING if connect else DISCONNECT_PENDING)
            self._tasks.append(_Task(remote, timeout_ms, connect))
            if len(self._workers) < self._threads:
                worker = threading.Thread(target=self._work, name="hixl-connect", daemon=True)
                self._workers.append(worker)
                with held():  # SIGTERM and SIGINT are the program's main thread's (`_signals`)
                    worker.start()
            self._lock.notify()
        return SUCCESS

    def status(self, remote: str) -> int:
        with self._lock:
            return self._status.get(remote, NOT_CONNECT)

    def statuses(self) -> dict[str, int]:
        with self._lock:
            return dict(self._status)

    def _set(self, remote: str, status: int) -> None:
        """Record `status` unless a later task of the other kind is pending (the caller holds the lock)."""
        current = self._status.get(remote)
        if status in (CONNECTING, CONNECTED, CONNECT_FAILED) and current == DISCONNECT_PENDING:
            return
        if status in (DISCONNECTING, NOT_CONNECT) and current == CONNECT_PENDING:
            return
        if status == NOT_CONNECT:
            self._status.pop(remote, None)
        else:
            self._status[remote] = status

    def _next(self) -> _Task | None:
        """The first task whose engine no worker serves (the caller holds the lock)."""
        for task in self._tasks:
            if task.remote not in self._doing:
                self._tasks.remove(task)
                return task
        return None

    def _work(self) -> None:
        while True:
            with self._lock:
                task = self._next()
                while task is None and not self._closed:
                    self._lock.wait()
                    task = self._next()
                if self._closed or task is None:
                    return
                self._doing.add(task.remote)
                self._set(task.remote, CONNECTING if task.connect else DISCONNECTING)
            try:
                if task.connect:
                    code = self._connect(task.remote, task.timeout_ms)
                    status = CONNECTED if code in (SUCCESS, ALREADY_CONNECTED) else CONNECT_FAILED
                else:
                    self._disconnect(task.remote, task.timeout_ms)
                    status = NOT_CONNECT
            except Exception:  # a bug in a call: the task failed, said in the log; the worker goes on
                log.error(
                    "asynchronous %s of %s failed",
                    "connect" if task.connect else "disconnect",
                    task.remote,
                    exc_info=True,
                )
                status = CONNECT_FAILED if task.connect else NOT_CONNECT
            with self._lock:
                self._set(task.remote, status)
                self._doing.discard(task.remote)
                self._lock.notify_all()

    def close(self, timeout_s: float) -> None:
        with self._lock:
            self._closed = True
            self._tasks.clear()
            workers, self._workers = self._workers, []
            self._lock.notify_all()
        for worker in workers:
            worker.join(timeout_s)
