"""What every part of the v2 `CacheManager` shares: the instance it serves, the checks that a cache is a
live cache of this manager, and the errors they raise.

Rules: the parts (`_memory`, `_pulls`, `_pushes`, `_copies`) each hold one room of the real class's API and
reach the instance only through `_require_core`; none calls another part. What a transfer does happens in
the library (`Core.transfers`, `Core.oneside`, `Core.pins`); a part checks the arguments, builds one
request or prepared read, and makes one call.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, NoReturn

from .._errors import FINALIZED, FORK_HINT, StatusError, api_errors
from .._owner.records import CacheRecord
from .._puller.oneside import check_remote_tensors
from .._puller.source import RemoteCache
from .._transfer import LayerArgs, TensorSelection, check_cache_key
from .._validate import check_isinstance
from ..status import LLMStatusCode, make_error
from .cache import Cache
from .llm_types import CacheKey

if TYPE_CHECKING:
    from .._core import Core
    from .._puller.oneside import PreparedRead


def _invalid(api: str, context: str) -> NoReturn:
    raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, context)


@functools.cache
def _timeout_errors(api: str) -> api_errors:
    """`api_errors` with LLM_TIMEOUT for timeouts; it keeps no state, so one per api serves every call."""
    return api_errors(api, timeout_code=LLMStatusCode.LLM_TIMEOUT)


class ManagerBase:
    """The state the parts of `CacheManager` share."""

    def __init__(self, core: Core) -> None:
        self._core: Core | None = core
        # Guards the two below (user threads call in at once).
        self._lock = threading.Lock()
        self._registered_addrs = 0
        # Prepared one-sided reads by the arguments that made them (see `_pulls`), with their instance.
        self._prepared: dict[tuple[object, ...], tuple[Core, PreparedRead]] = {}

    @property
    def _initialized(self) -> bool:
        """False once the LLMDataDist the manager came from was finalized (the real attribute)."""
        return self._core is not None

    def _require_core(self, api: str) -> Core:
        core = self._core
        if core is None:
            raise make_error(api, LLMStatusCode.LLM_ENGINE_FINALIZED, FINALIZED)
        if core.forked_from is not None:
            raise make_error(api, LLMStatusCode.LLM_FAILED, FORK_HINT.format(pid=core.forked_from))
        return core

    def _finalize(self) -> None:
        self._core = None

    @staticmethod
    def check_cache_key(cache_key: CacheKey) -> None:
        """LLMException(LLM_PARAM_INVALID) unless exactly one of req_id and prefix_id is set (the real
        static method, with its message)."""
        check_cache_key(cache_key, prefix_label="prefix id:")

    def _record_of(self, api: str, core: Core, cache: Cache, name: str = "cache") -> CacheRecord:
        check_isinstance(name, cache, Cache)
        record = core.table.get(cache.cache_id) if cache.tensor_addrs else None
        if record is None or not record.external or getattr(cache, "_manager", None) is not self:
            _invalid(api, f"{name} (cache {cache.cache_id}) is not a live cache of this process")
        return record

    def _timeout_errors(self, api: str) -> api_errors:
        return _timeout_errors(api)

    def _layers(self, api: str, layers: LayerArgs, num_tensors: int) -> TensorSelection:
        return layers.select(api, num_tensors)

    @staticmethod
    def _remote(
        api: str, core: Core, cluster_id: int, cache_id: int | None, model_id: int | None
    ) -> RemoteCache:
        """A cache from the peer's table (one-sided mode); LLM_KV_CACHE_NOT_EXIST as `api`'s LLMException."""
        core.oneside.check_peer(cluster_id)
        try:
            return core.oneside.find(cluster_id, cache_id, model_id)[1]
        except StatusError as exc:
            if exc.code != LLMStatusCode.LLM_KV_CACHE_NOT_EXIST:
                raise
            raise make_error(api, exc.code, exc.detail) from exc

    @staticmethod
    def _check_remote_tensors(api: str, remote: RemoteCache, selection: TensorSelection) -> None:
        try:
            check_remote_tensors(remote, selection.src_start, selection.count, selection.whole)
        except StatusError as exc:
            _invalid(api, exc.detail)
