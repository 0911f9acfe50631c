"""Which threads the kernel may hand SIGTERM and SIGINT to: the program's, never the library's.

Rules: Python runs signal handlers on the main thread only, and a signal the kernel delivers to another
thread does not interrupt what the main thread is blocked in (a `time.sleep`, an `Event.wait`): the
handler would wait for it. So every thread the library starts holds (blocks) both signals first thing
(`hold_here`), and code that makes threads we do not start ourselves (a transfer engine's) makes them
inside `held()`, whose threads inherit the mask.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

__all__ = ["HELD", "held", "hold_here"]

HELD = frozenset({signal.SIGTERM, signal.SIGINT})


def hold_here() -> None:
    """Block SIGTERM and SIGINT in the calling thread (one the library started), for good."""
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Block SIGTERM and SIGINT in the calling thread for the block, so threads started in it (by C code)
    inherit the block; one that arrives meanwhile is delivered when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
