"""Local pins: the references this process's own transfers hold on its caches while they copy into or
out of them (a pull writing into a destination, a push reading its source, an engine's transfer that
outlived its call).

Rules: a pinned cache is never freed, whatever its user or its keys do meanwhile; pinning a cache the user
already deallocated is refused. The last local pin of a cache nothing else references frees it, at once
or, when the index lock is busy, when it is next had: a transfer's end never waits for the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .. import _faults
from .._errors import StatusError
from .._procmaps import require_mapped
from .._shm.errors import ShmError
from ..status import LLMStatusCode
from .records import CacheRecord
from .table import CacheTable


class LocalPins:
    """The local pins on one table's caches."""

    def __init__(self, table: CacheTable) -> None:
        self._table = table

    def pinned(self, cache_id: int) -> _Pinned:
        """Keep a local cache alive while a pull writes into it, for the duration of a with-block."""
        return _Pinned(self, cache_id)

    def pin(self, cache_id: int) -> CacheRecord:
        with self._table.lock:
            record = self._table.caches.get(cache_id)
            if record is None or not record.external:
                raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"cache {cache_id} was deallocated")
            record.pins += 1
        if record.unchecked:
            try:
                require_tensors_mapped(record)
            except BaseException:
                self.unpin(record)
                raise
        return record

    def unpin(self, record: CacheRecord) -> None:
        """End a local pin; a cache only it kept is freed now, or at the next housekeeping if the index
        lock is busy (a transfer's end never waits for it)."""
        with self._table.lock:
            record.pins -= 1
            # (`external` first: a cache its user still holds is the common case, and is never freed here)
            if (
                not record.external
                and not record.referenced
                and self._table.caches.get(record.cache_id) is record
            ):
                self._table.mirror.now_or_later(lambda: self._table.maybe_free(record))
            self._table.changed.notify()

    def hold(self, record: CacheRecord) -> Callable[[], None]:
        """Pin `record` (which the caller holds pinned already) until the returned release is called: a
        transfer engine may use its memory after the call that started it gave up."""
        with self._table.lock:
            record.pins += 1
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self.unpin(record)

        return release

    def wait_for_local_pins(self, timeout_s: float) -> bool:
        """Wait until no local pin is held (every transfer of this process ended); False at the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._table.lock:
            while any(record.pins for record in self._table.caches.values()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._table.changed.wait(min(remaining, 0.05))
            return True


class _Pinned:
    """`LocalPins.pinned`: a class, not @contextmanager, since every transfer enters one."""

    __slots__ = ("_cache_id", "_pins", "_record")

    def __init__(self, pins: LocalPins, cache_id: int) -> None:
        self._pins = pins
        self._cache_id = cache_id
        self._record: CacheRecord | None = None

    def __enter__(self) -> CacheRecord:
        self._record = record = self._pins.pin(self._cache_id)
        if _faults.hook is not None:
            try:
                _faults.at("local")
            except BaseException:
                self._record = None
                self._pins.unpin(record)
                raise
        return record

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        record, self._record = self._record, None
        if record is None:
            return
        self._pins.unpin(record)
        if isinstance(exc, ShmError) and record.registered:
            # A copy met memory that was not there: if it is ours, say which tensor went.
            require_tensors_mapped(record)


def require_tensors_mapped(record: CacheRecord) -> None:
    """StatusError(LLM_PARAM_INVALID) naming the first tensor of registered `record` that is not this
    process's readable and writable memory now."""
    require_mapped(
        ((addr, record.tensor_nbytes) for addr in record.addrs),
        what=f"cache {record.cache_id}: tensor",
        writable=True,
    )
