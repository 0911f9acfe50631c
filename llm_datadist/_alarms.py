"""Alarms: a callback run once at a deadline on one daemon thread of the process, unless cancelled first.
For bounds on what a thread holds while it is inside code that is not ours (a user's callback): the
thread cannot be interrupted, but what it holds can be let go on time.

Rules: callbacks run in deadline order, one at a time, outside the lock, and must not block; a callback
that raises is logged. `cancel` after the callback started does not wait for it (the caller guards what
both touch). The thread starts at the first alarm, and again in a child after fork.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable

from ._signals import hold_here
from .utils.log import log


class Alarm:
    __slots__ = ("callback", "cancelled", "deadline")

    def __init__(self, deadline: float, callback: Callable[[], None]) -> None:
        self.deadline = deadline
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _Alarms:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, Alarm]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def _forked(self) -> None:
        """In a child after fork: the thread is gone and the lock may have been held; the parent's alarms
        belong to the parent's threads."""
        self.__init__()  # type: ignore[misc]

    def at(self, deadline: float, callback: Callable[[], None]) -> Alarm:
        """Run `callback` at `deadline` (time.monotonic()) unless the returned alarm is cancelled first."""
        alarm = Alarm(deadline, callback)
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._order), alarm))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="llmdd-alarms", daemon=True)
                self._thread.start()
            elif self._heap[0][2] is alarm:
                self._cond.notify()
        return alarm

    def _run(self) -> None:
        hold_here()
        while True:
            with self._cond:
                while True:
                    while self._heap and self._heap[0][2].cancelled:
                        heapq.heappop(self._heap)
                    if not self._heap:
                        self._cond.wait()
                        continue
                    wait_s = self._heap[0][0] - time.monotonic()
                    if wait_s <= 0:
                        alarm = heapq.heappop(self._heap)[2]
                        break
                    self._cond.wait(wait_s)
            try:
                alarm.callback()
            except Exception:
                log.exception("an alarm's callback failed")


alarms = _Alarms()
os.register_at_fork(after_in_child=alarms._forked)
