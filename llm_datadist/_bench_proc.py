"""Plumbing shared by `_bench` and `_bench_peers`: timing a call repeatedly, and a spawned helper process
that answers over a pipe.

Rules: a helper answers each request with ("ok", value) or ("error", text); every wait on it is bounded;
`close` asks it to stop, then kills and reaps it if it has not.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any


def timed(action: Callable[[], object], repeats: int) -> list[float]:
    """Seconds each of `repeats` calls of `action` took."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return samples


class Child:
    """A spawned process running `target(pipe, *args)`; it answers with ("ok", value) or ("error", text)."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.process.start()
        child.close()

    def reply(self, timeout_s: float) -> Any:
        """The next answer's value; TimeoutError, or RuntimeError with the helper's error text."""
        if not self.pipe.poll(timeout_s):
            raise TimeoutError(f"the helper process did not answer within {timeout_s:.0f} s")
        try:
            status, value = self.pipe.recv()
        except EOFError:
            raise RuntimeError(f"the helper process exited with code {self.process.exitcode}") from None
        if status != "ok":
            raise RuntimeError(f"the helper process failed: {value}")
        return value

    def close(self) -> None:
        """Ask it to stop ("stop" is every helper's last command), then kill it if it did not."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.pipe.send(("stop", None))
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self.pipe.close()
