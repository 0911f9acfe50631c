"""`CacheManager`'s memory: caches carved from the configured pools, memory the user registers by
address, and the keys bound to them (the real class's allocation, registration and key calls).

Rules: every check comes before the table is changed; registered memory is checked against what the
kernel allows peers to attach (`_puller.vm`) and capped at `MAX_REGISTERED_ADDRS` addresses over all calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .. import _library as library
from .._core import PLACEMENT_DEVICE
from .._errors import StatusError, api_errors
from .._keys import KeyId
from .._owner.records import CacheRecord
from .._puller.vm import allow_peers_to_attach, cross_memory_supported
from .._validate import (
    check_int64,
    check_isinstance,
    check_uint64,
)
from ..status import LLMStatusCode, make_error
from ..utils.log import log
from .cache import Cache
from .llm_types import (
    U64_MAX,
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    MemInfo,
    Memtype,
    Placement,
)

if TYPE_CHECKING:
    from .._core import Core
from .._procmaps import require_mapped
from .._transfer import owner_key
from ._base import ManagerBase, _invalid

# The real library caps the addresses registered over all register calls (240; 256 before 8.1).
MAX_REGISTERED_ADDRS = 240


class Memory(ManagerBase):
    """The allocation, registration and key calls of `CacheManager`."""

    def _handle(self, record: CacheRecord, desc: CacheDesc) -> Cache:
        cache = Cache(record.cache_id, desc, record.tensor_addrs(), record.is_blocks)
        cache._manager = self  # type: ignore[attr-defined]
        return cache

    @staticmethod
    def _check_desc(api: str, desc: CacheDesc) -> None:
        check_isinstance("cache_desc", desc, CacheDesc)
        if desc.num_tensors <= 0:
            _invalid(api, "num_tensors must be > 0")
        shape = list(desc.shape)
        if not shape or any(dim <= 0 for dim in shape):
            _invalid(api, f"shape {shape} must have positive dimensions")

    def _pool_allocate(
        self,
        api: str,
        desc: CacheDesc,
        keys: list[KeyId | None],
        *,
        is_blocks: bool,
        blocks_model_id: int | None = None,
    ) -> Cache:
        core = self._require_core(api)
        placement = int(desc.placement)
        pool = core.settings.device_pool if placement == PLACEMENT_DEVICE else core.settings.host_pool
        if pool is None:
            option = "mem_pool_cfg" if placement == PLACEMENT_DEVICE else "host_mem_pool_cfg"
            _invalid(
                api,
                "you should config memory pool firstly and then set placement that matches it "
                f"({desc.placement} needs {option})",
            )
        with api_errors(api, timeout_code=LLMStatusCode.LLM_TIMEOUT):
            record = core.table.allocate(
                num_tensors=desc.num_tensors,
                tensor_nbytes=desc.size,
                batch_size=desc.shape[0],
                keys=keys,
                is_blocks=is_blocks,
                placement=placement,
                remote_accessible=placement == PLACEMENT_DEVICE,
                unique_keys=True,
                blocks_model_id=blocks_model_id,
            )
        return self._handle(record, desc)

    def allocate_cache(
        self, cache_desc: CacheDesc, cache_keys: list[CacheKey] | tuple[CacheKey, ...] = ()
    ) -> Cache:
        """Allocate from the placement's pool (none configured: LLM_PARAM_INVALID); `cache_keys[i]` binds
        slot i (at most `shape[0]` keys, none already bound, no two identical in the call, padding keys of
        one model_id included, as the native check: LLM_PARAM_INVALID). Pool exhausted: LLM_OUT_OF_MEMORY."""
        api = "allocate_cache"
        self._require_core(api)
        self._check_desc(api, cache_desc)
        check_isinstance("cache_keys", cache_keys, (list, tuple))
        for key in cache_keys:
            check_isinstance("cache_keys", key, CacheKey)
        # The native CheckCacheKeys: a key is (prefix_id if set, else req_id, model_id), padding too.
        seen: set[tuple[int, int]] = set()
        for key in cache_keys:
            data_key = (key.prefix_id if key.prefix_id != U64_MAX else key.req_id, key.model_id)
            if data_key in seen:
                _invalid(api, f"multiply identical cache_keys {data_key} occurred in the request")
            seen.add(data_key)
        return self._pool_allocate(api, cache_desc, [owner_key(api, k) for k in cache_keys], is_blocks=False)

    def allocate_blocks_cache(
        self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None
    ) -> Cache:
        """A pool-backed paged cache (`shape[0]` blocks), indexed by `blocks_cache_key.model_id` if given."""
        api = "allocate_blocks_cache"
        self._require_core(api)
        self._check_desc(api, cache_desc)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey, allow_none=True)
        model_id = None if blocks_cache_key is None else blocks_cache_key.model_id
        cache = self._pool_allocate(api, cache_desc, [], is_blocks=True, blocks_model_id=model_id)
        return cache

    def deallocate_cache(self, cache: Cache) -> None:
        """Free a pool cache (deferred while keys remain). Blocks caches: use deallocate_blocks_cache.
        Registered caches are ignored (use unregister_cache)."""
        api = "deallocate_cache"
        core = self._require_core(api)
        check_isinstance("cache", cache, Cache)
        if cache.is_blocks_cache:
            _invalid(api, "deallocate_cache does not take a blocks cache; use deallocate_blocks_cache")
        self._release(api, core, cache)

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Free a pool blocks cache at once and drop its model_id index entry."""
        api = "deallocate_blocks_cache"
        core = self._require_core(api)
        check_isinstance("cache", cache, Cache)
        if not cache.is_blocks_cache:
            _invalid(api, "deallocate_blocks_cache takes a blocks cache only")
        self._release(api, core, cache)

    def _release(self, api: str, core: Core, cache: Cache) -> None:
        record = core.table.get(cache.cache_id)
        if record is None or record.registered or getattr(cache, "_manager", None) is not self:
            return
        with self._timeout_errors(api):
            core.table.deallocate(cache.cache_id)
        cache._tensor_addrs = []  # only once it is done: a call that failed can be made again

    def _register(
        self,
        api: str,
        desc: CacheDesc,
        addrs: object,
        keys: list[KeyId | None],
        remote_accessible: object,
        *,
        is_blocks: bool,
        blocks_model_id: int | None = None,
    ) -> Cache:
        core = self._require_core(api)
        self._check_desc(api, desc)
        check_isinstance("addrs", addrs, (list, tuple))
        assert isinstance(addrs, (list, tuple))
        for addr in addrs:
            check_uint64("addrs", addr)
        check_isinstance("remote_accessible", remote_accessible, bool, allow_none=True)
        if not addrs or len(addrs) != desc.num_tensors:
            _invalid(
                api, f"{len(addrs)} addresses for {desc.num_tensors} tensors (one per tensor, non-empty)"
            )
        if any(addr == 0 for addr in addrs):
            _invalid(api, "addresses must not be 0")
        with self._lock:
            if self._registered_addrs + len(addrs) > MAX_REGISTERED_ADDRS:
                _invalid(api, f"at most {MAX_REGISTERED_ADDRS} addresses may be registered in all")
            # Reserved now, given back if the registration fails.
            self._registered_addrs += len(addrs)
        try:
            return self._register_reserved(
                api, core, desc, addrs, keys, remote_accessible, is_blocks, blocks_model_id
            )
        except BaseException:
            with self._lock:
                self._registered_addrs -= len(addrs)
            raise

    def _register_reserved(
        self,
        api: str,
        core: Core,
        desc: CacheDesc,
        addrs: list[int] | tuple[int, ...],
        keys: list[KeyId | None],
        remote_accessible: object,
        is_blocks: bool,
        blocks_model_id: int | None,
    ) -> Cache:
        linked = core.comms.two_sided_links_made
        if remote_accessible is None:
            remote_accessible = desc.placement == Placement.DEVICE and not linked
        elif remote_accessible and linked:
            _invalid(api, "remote_accessible=True is not allowed after link()")
        # Peers reach registered memory by cross-memory attach: check now, not at the first pull.
        reason = cross_memory_supported()
        if reason is not None:
            raise make_error(
                api, LLMStatusCode.LLM_FEATURE_NOT_ENABLED, f"peers cannot reach this memory: {reason}"
            )
        allow_peers_to_attach()
        with api_errors(api):
            # The real library takes device memory on trust (its own tests register address 1). What is
            # not this process's readable and writable memory now is registered too, said once, and checked
            # again by every transfer of ours that touches it; peers' reads of it fail (EFAULT).
            unchecked = _unmapped_now(api, addrs, desc.size)
            record = core.table.register(
                num_tensors=desc.num_tensors,
                tensor_nbytes=desc.size,
                batch_size=desc.shape[0],
                addrs=list(addrs),
                keys=keys,
                is_blocks=is_blocks,
                placement=int(desc.placement),
                remote_accessible=bool(remote_accessible),
                blocks_model_id=blocks_model_id,
                # Memory of `ext.shared_arrays`, all in one segment: published by it, peers map it. (A hixl
                # engine's `register_mem` is published by address: its peers name memory by address.)
                shared=library.span(addrs, desc.size),
            )
            record.unchecked = unchecked
        return self._handle(record, desc)

    def register_cache(
        self,
        cache_desc: CacheDesc,
        addrs: list[int],
        cache_keys: list[CacheKey] | tuple[CacheKey, ...] = (),
        remote_accessible: bool | None = None,
    ) -> Cache:
        """Register memory the caller owns (`tensor.data_ptr()`, numpy `ctypes.data`), one address per tensor.

        `remote_accessible` defaults to True for DEVICE (False after `link()`) and False for HOST. Keys on
        registered memory are never consumed. Addresses must not overlap another registered cache.
        """
        api = "register_cache"
        self._require_core(api)  # a finalized manager touches nothing, arguments included
        check_isinstance("cache_keys", cache_keys, (list, tuple))
        for key in cache_keys:
            check_isinstance("cache_keys", key, CacheKey)
        keys = [owner_key(api, k) for k in cache_keys]
        return self._register(api, cache_desc, addrs, keys, remote_accessible, is_blocks=False)

    def register_blocks_cache(
        self,
        cache_desc: CacheDesc,
        addrs: list[int],
        blocks_cache_key: BlocksCacheKey | None = None,
        remote_accessible: bool | None = None,
    ) -> Cache:
        """The paged form of `register_cache`; `blocks_cache_key.model_id` indexes it."""
        api = "register_blocks_cache"
        self._require_core(api)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey, allow_none=True)
        model_id = None if blocks_cache_key is None else blocks_cache_key.model_id
        cache = self._register(
            api, cache_desc, addrs, [], remote_accessible, is_blocks=True, blocks_model_id=model_id
        )
        return cache

    def unregister_cache(self, cache_id: int) -> None:
        """Forget a registered cache by id (unknown ids are ignored); its keys then give
        LLM_KV_CACHE_NOT_EXIST.

        The memory is the caller's again when this returns: a peer's transfer that pins it (a pull
        resolved by key, any push) is waited for, up to `sync_kv_timeout`; past that this raises
        LLM_TIMEOUT and the cache stays registered (without its keys). One-sided reads pin nothing: one
        that overlaps the unregistration fails its generation check and returns no data."""
        api = "unregister_cache"
        core = self._require_core(api)
        check_int64("cache_id", cache_id)
        record = core.table.get(cache_id)
        if record is None:
            return
        with self._timeout_errors(api):
            unregistered = core.table.unregister(cache_id, timeout_s=core.sync_kv_timeout_s)
        if unregistered:
            with self._lock:
                self._registered_addrs -= record.num_tensors

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unbind a key of a pool cache; unknown keys and keys of registered caches are ignored."""
        api = "remove_cache_key"
        core = self._require_core(api)
        check_isinstance("cache_key", cache_key, CacheKey)
        key = owner_key(api, cache_key)
        with self._timeout_errors(api):
            bound = core.table.bound(key) if key is not None else None
            if key is not None and bound is not None and not bound.registered:
                core.table.remove_key(key)

    def remap_registered_memory(self, mem_infos: MemInfo | list[MemInfo]) -> None:
        """Checked as the real one: a list or one MemInfo, each a MemInfo of device memory with addr != 0
        and size > 0, the list not empty (LLM_PARAM_INVALID), and a link made (LLM_NOT_YET_LINK). Then the
        real one redoes the NICs' registrations of that memory after a memory error moved its pages; here
        nothing holds pages by physical address (peers reach memory by virtual address at every copy), so
        there is nothing to redo (docs/hixl.md, "remap")."""
        api = "remap_registered_memory"
        core = self._require_core(api)
        if not isinstance(mem_infos, (list, MemInfo)):
            _invalid(
                api, f"mem_infos type only support list of MemInfo or MemInfo, but got {type(mem_infos)}."
            )
        infos = mem_infos if isinstance(mem_infos, list) else [mem_infos]
        for i, info in enumerate(infos):
            if not isinstance(info, MemInfo):
                _invalid(api, f"mem_infos[{i}] type only support MemInfo, but got {type(info)}.")
            if info.mem_type != Memtype.MEM_TYPE_DEVICE:
                _invalid(
                    api, f"check mem_info.mem_type failed, only support Memtype.MEM_TYPE_DEVICE, index={i}."
                )
            if info.addr == 0:
                _invalid(api, f"check mem_info.addr failed, addr can not be zero, index={i}.")
            if info.size <= 0:
                _invalid(api, f"check mem_info.size failed, size must be > 0, index={i}.")
        # Then the engine's: something to remap, and a link whose registrations it would redo.
        if not infos:
            _invalid(api, "mem_infos is empty")
        if not core.links.clusters() and not core.server.peers():
            raise make_error(api, LLMStatusCode.LLM_NOT_YET_LINK, "No comm link yet")


_said_unchecked = [False]


def _unmapped_now(api: str, addrs: Sequence[int], nbytes: int) -> bool:
    """Whether some tensor is not this process's readable and writable memory now (logged the first time
    in the process, with what was found)."""
    try:
        require_mapped(((addr, nbytes) for addr in addrs), what="tensor", writable=True)
    except StatusError as exc:
        if not _said_unchecked[0]:
            _said_unchecked[0] = True
            log.warning(
                "%s: %s. Registered as the real library does with device memory; every transfer of this "
                "process that touches it checks it first and fails with LLM_PARAM_INVALID while it is not "
                "there (said once per process)",
                api,
                exc.detail,
            )
        return True
    return False
