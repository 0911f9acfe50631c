"""The demo parent's view of the two sides of a pair while they work: their messages, their progress, and
whether they still run.

Rules: every wait is bounded; a side that reported an error, or ended while it was watched, ends the wait at
once. Messages of sides not waited on are read as they come too: steps and rows are printed when they come
(never late, never out of order), results are kept for the wait that asks for them. A side that has been
quiet for `TICK_S` gets a line saying what it is doing (its last step), so a long step is never silent.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from llm_datadist._shm.space import format_nbytes

from ..output import say

TICK_S = 2.0  # the longest the demo stays silent while a side works
_POLL_S = 0.25


@dataclass
class Side:
    """One spawned side: its process, the parent's end of its pipe, and what it last said it does."""

    name: str
    process: BaseProcess
    pipe: Connection
    step: str = "starting (spawn, imports)"
    results: deque[tuple[str, Any]] = field(default_factory=deque)
    closed: bool = False  # its pipe reached EOF

    def ended(self) -> bool:
        """Started, exited, and nothing left to read."""
        if self.process.pid is None or self.process.exitcode is None or self.results:
            return False
        return self.closed or not self.pipe.poll(0)


class Watch:
    """Waits on the sides of one pair, printing their progress (see the module's rules)."""

    def __init__(self, *sides: Side) -> None:
        self.sides = sides
        self._last_line = time.monotonic()

    def line(self, text: str) -> None:
        say(text)
        self._last_line = time.monotonic()

    def wait(self, side: Side, what: str, timeout_s: float, watched: tuple[Side, ...] = ()) -> Any:
        """The next result of `side` ("ready", "done": its value); RuntimeError when it or a side in
        `watched` reported an error or ended first, TimeoutError after `timeout_s`."""
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            self._read_all()
            if side.results:
                _status, value = side.results.popleft()
                return value
            for other in (side, *watched):
                if other.ended():
                    code = other.process.exitcode
                    raise RuntimeError(f"{what}: the {other.name} process ended (exit code {code})")
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"{what} did not answer within {timeout_s:.0f} s")
            if now - self._last_line >= TICK_S:
                self.line(f"  ... {side.name}: {side.step} ({now - started:.0f} s)")
            pipes = [s.pipe for s in self.sides if s.process.pid is not None and not s.closed]
            if pipes:
                wait(pipes, min(_POLL_S, deadline - now))
            else:
                time.sleep(min(_POLL_S, deadline - now))

    def _read_all(self) -> None:
        for side in self.sides:
            if side.process.pid is None or side.closed:
                continue
            try:
                while side.pipe.poll(0):
                    self._take(side, *side.pipe.recv())
            except (EOFError, OSError):
                side.closed = True  # it exited; `ended` tells once its results are taken

    def _take(self, side: Side, status: str, value: Any) -> None:
        if status == "step":
            side.step = value
        elif status == "progress":
            seconds = value.get("seconds")
            took = f" in {seconds * 1e3:.1f} ms" if seconds is not None else ""
            self.line(f"  done: {value['name']}, {format_nbytes(value['nbytes'])}{took}")
        elif status == "error":
            raise RuntimeError(f"the {side.name} failed:\n{value}")
        else:
            side.results.append((status, value))
