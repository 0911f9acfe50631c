"""Local pins: the references this process's own transfers hold on its caches while they copy into or
out of them (a pull writing into a destination, a push reading its source, an engine's transfer that
outlived its call).

Rules: a pinned cache is never freed, whatever its user or its keys do meanwhile; pinning a cache the user
already deallocated is refused. The last local pin of a cache nothing else references frees it, at once
or, when the index lock is busy, when it is next had: a transfer's end never waits for the lock. A pin
and its end take no lock while the cache's user holds it (`pin` says why that is safe).
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
        """Pin a live cache (StatusError LLM_PARAM_INVALID once its user deallocated or unregistered it),
        without the table's lock: the hold is added first and `external` looked at after. Whoever ends
        the user's reference (deallocate, unregister) sets `external` first and counts the holds after
        (both under the lock), so that one of the two always sees the other: either that end counts this
        hold and keeps the memory, or this pin sees `external` gone and lets go."""
        record = self._table.caches.get(cache_id)
        if record is None:
            raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"cache {cache_id} was deallocated")
        record.pin_holds.append(None)
        if not record.external:
            self.unpin(record)
            raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"cache {cache_id} was deallocated")
        if record.unchecked:
            try:
                require_tensors_mapped(record)
            except BaseException:
                self.unpin(record)
                raise
        return record

    def enter(self, cache_id: int) -> CacheRecord:
        """`pin` for a transfer, with its fault point ("local"; unpinned when it fires)."""
        record = self.pin(cache_id)
        if _faults.hook is not None:
            try:
                _faults.at("local")
            except BaseException:
                self.unpin(record)
                raise
        return record

    def leave(self, record: CacheRecord, exc: BaseException | None) -> None:
        """`unpin` after a transfer that raised `exc` (None: it ended well): a copy that met memory that
        was not there says which tensor of a registered cache went."""
        self.unpin(record)
        if isinstance(exc, ShmError) and record.registered:
            require_tensors_mapped(record)

    def unpin(self, record: CacheRecord) -> None:
        """End a local pin; a cache only it kept is freed now, or at the next housekeeping if the index
        lock is busy (a transfer's end never waits for it). Without the lock while the user holds the
        cache and nobody watches for pins' ends (`Changes.watching`): nothing is to be freed or told."""
        record.pin_holds.pop()
        table = self._table
        if record.external and not table.changed.watchers:
            return
        with table.lock:
            if not record.external and not record.referenced and table.caches.get(record.cache_id) is record:
                table.mirror.now_or_later(lambda: table.maybe_free(record))
            table.changed.notify()

    def hold(self, record: CacheRecord) -> Callable[[], None]:
        """Pin `record` (which the caller holds pinned already) until the returned release is called: a
        transfer engine may use its memory after the call that started it gave up."""
        record.pin_holds.append(None)
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self.unpin(record)

        return release

    def wait_for_local_pins(self, timeout_s: float) -> bool:
        """Wait until no local pin is held (every transfer of this process ended); False at the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._table.lock, self._table.changed.watching():
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
        self._record = record = self._pins.enter(self._cache_id)
        return record

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        record, self._record = self._record, None
        if record is not None:
            self._pins.leave(record, exc)


def require_tensors_mapped(record: CacheRecord) -> None:
    """StatusError(LLM_PARAM_INVALID) naming the first tensor of registered `record` that is not this
    process's readable and writable memory now."""
    require_mapped(
        ((addr, record.tensor_nbytes) for addr in record.addrs),
        what=f"cache {record.cache_id}: tensor",
        writable=True,
    )
