"""Unpins a puller still owes in peers' indexes, and the mappings they keep open.

Rules: a pin is the puller's until it clears it, whatever happens to the link. An unpin that could not get
the index lock in time is owed (`owe`) and done later by `settle` (housekeeping); the index it goes through
stays mapped until then, even after its link let go of it (`release`), and is closed by whichever of the
two comes last. One lock serialises all of it, across threads of the process.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from llm_datadist._shm.errors import ShmError
from llm_datadist._shm.index import Index

_lock = threading.Lock()
_owed: list[tuple[Index, int, int]] = []  # (index, row, ticket)
_released: set[int] = set()  # id() of owed indexes whose link let go of them


def _forget_in_child() -> None:
    """A forked child owes nothing: the pins are its parent's (a pin is its holder's, pid and start time),
    and the parent's threads, one of which may have held the lock, did not come along."""
    global _lock, _owed, _released
    _lock = threading.Lock()
    _owed = []
    _released = set()


os.register_at_fork(after_in_child=_forget_in_child)


def owe(index: Index, row: int, ticket: int) -> None:
    """An unpin to do later, as a failed pull's (the transfer that owes it failed)."""
    with _lock:
        _owed.append((index, row, ticket))


def release(index: Index) -> None:
    """The link lets go of its mapping of a peer's index: closed now, or once its owed unpins are done."""
    with _lock:
        if any(entry[0] is index for entry in _owed):
            _released.add(id(index))
            return
    index.close()


def settle(timeout_s: float, unpin_locked: Callable[[Index, int, int, bool], object]) -> int:
    """Do the owed unpins whose lock can be had within `timeout_s` each; how many are still owed."""
    with _lock:
        owed = list(_owed)
    for entry in owed:
        index, row, ticket = entry
        if not index.closed:
            try:
                index.lock(timeout_s)
            except ShmError:
                continue
            try:
                unpin_locked(index, row, ticket, False)
            except ShmError:
                pass  # a corrupt row is the owner's to repair; ours is over either way
            finally:
                index.unlock()
        with _lock:
            _owed.remove(entry)
            close = id(index) in _released and not any(other[0] is index for other in _owed)
            if close:
                _released.discard(id(index))
        if close:
            index.close()
    with _lock:
        return len(_owed)


def owed() -> int:
    with _lock:
        return len(_owed)
