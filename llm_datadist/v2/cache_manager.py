"""`CacheManager`: the v2 ("cache-manager mode") cache API.

Rules: no role checks (the role is only a label in v2). Memory comes from the configured pools
(`mem_pool_cfg` for DEVICE, `host_mem_pool_cfg` for HOST) or is the user's own, registered by address;
registered memory is reached by peers through cross-memory attach, checked when it is registered. With
`enable_remote_cache_accessible` transfers are one-sided: the peer's table of caches is read from its index
once per link, then read with no message to the peer (writes pin the destination in its index first).
Transfer timeouts raise `LLM_TIMEOUT`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from llm_datadist._shm.copyplan import plan_block_copy

from .._copy import address_view
from .._core import PLACEMENT_DEVICE, PLACEMENT_HOST
from .._errors import api_errors
from .._keys import KEY_BLOCKS, KEY_PREFIX, KEY_REQ, KeyId
from .._movers import UnitRun
from .._owner.records import CacheRecord
from .._source import V2, RemoteCache, RemoteTable, SourceRef
from .._transfer import (
    LayerArgs,
    TensorSelection,
    check_cache_key,
    check_transfer_args,
    key_fields,
    parse_layer_kwargs,
    plan_transfer,
    start_transfer,
)
from .._validate import (
    check_index_lists,
    check_int64,
    check_isinstance,
    check_range_step1,
    check_uint32,
    check_uint64,
)
from .._vm import allow_peers_to_attach, cross_memory_supported
from ..status import LLMStatusCode, make_error
from .cache import Cache
from .llm_types import (
    U64_MAX,
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    LayerSynchronizer,
    MemInfo,
    Memtype,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from .llm_utils import CacheTask, LayerPush

if TYPE_CHECKING:
    from collections.abc import Callable

    from llm_datadist._shm.segment import Segment

    from .._core import Core
    from .._transport import ClientLink
    from .._vm import PreparedRuns

    # (remote slot, remote unit bytes, remote unit count) -> the byte runs to copy in every tensor.
    _RunsFor = Callable[[int, int, int], list[UnitRun]]

# The real library caps the addresses registered over all register calls (240; 256 before 8.1).
MAX_REGISTERED_ADDRS = 240


def _invalid(api: str, context: str) -> NoReturn:
    raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, context)


@dataclass(frozen=True, slots=True)
class _Found:
    """What a one-sided pull found on the remote side and derived from it: the link and the peer's table it
    looked in, the entry, the runs, and what `Core.transfer_one_sided` prepared (the copy, the mapped
    generation segment)."""

    link: ClientLink
    table: RemoteTable
    remote: RemoteCache
    runs: list[UnitRun]
    prepared: PreparedRuns | None
    words: Segment | None  # None for a peer on another host (nothing of it is mapped here)


@dataclass(slots=True, eq=False)
class _OneSidedPull:
    """A one-sided pull whose arguments were checked: everything `pull_cache` / `pull_blocks` derive from
    their arguments and the local record alone, so a repeat with equal arguments into the same live record
    skips straight to `_run_one_sided` (which checks the remote side afresh each time). Only `found`
    changes: what the last call found, which the next reuses while the link, the peer's table and the
    entry's generation say it is still what a lookup would find."""

    core: Core
    record: CacheRecord
    cluster_id: int
    cache_id: int | None
    model_id: int | None
    slot: int
    selection: TensorSelection
    runs_for: _RunsFor
    continuous_source: bool  # pull_cache: the remote cache must not be a blocks cache
    found: _Found | None = None


@dataclass(frozen=True, slots=True)
class _SwapSide:
    """One cache of a swap_blocks call: its tensors' addresses and block layout; `cache_id` None for a cpu
    cache (memory the caller owns, nothing to pin)."""

    cache_id: int | None
    addrs: list[int]
    block_nbytes: int
    num_blocks: int
    num_tensors: int
    span_nbytes: int
    placement: int


# Prepared pulls kept per manager; past this many the memo starts over (a connector repeats a few shapes).
_MAX_PREPARED = 1024


def _exact_ints(values: object) -> tuple[int, ...] | None:
    """`values` as a tuple when it is a list or tuple of exact ints (bools and subclasses hash like ints
    but must still meet the full checks), else None."""
    if type(values) is not list and type(values) is not tuple:
        return None
    items = tuple(values)
    for value in items:  # a loop, not all(): cheaper for the few items of a repeated pull
        if type(value) is not int:
            return None
    return items


@functools.cache
def _timeout_errors(api: str) -> api_errors:
    """`api_errors` with LLM_TIMEOUT for timeouts; it keeps no state, so one per api serves every call."""
    return api_errors(api, timeout_code=LLMStatusCode.LLM_TIMEOUT)


def _owner_key(key: CacheKey) -> KeyId | None:
    if key.prefix_id != U64_MAX:
        return (KEY_PREFIX, key.prefix_id, key.model_id)
    if key.req_id != U64_MAX:
        return (KEY_REQ, key.req_id, key.model_id)
    return None


class CacheManager:
    """The v2 manager, reached through `LLMDataDist.cache_manager` in cache-manager mode."""

    def __init__(self, core: Core) -> None:
        self._core: Core | None = core
        # Guards the two below (user threads call in at once).
        self._lock = threading.Lock()
        self._registered_addrs = 0
        self._prepared: dict[tuple[object, ...], _OneSidedPull] = {}

    def _require_core(self, api: str) -> Core:
        if self._core is None:
            raise make_error(api, LLMStatusCode.LLM_FAILED, "cache manager is not initialized")
        return self._core

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

    def _handle(self, record: CacheRecord, desc: CacheDesc) -> Cache:
        cache = Cache(record.cache_id, desc, record.tensor_addrs(), record.is_blocks)
        cache._manager = self  # type: ignore[attr-defined]
        return cache

    # ------------------------------------------------------------------ pool allocation

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
        return self._pool_allocate(api, cache_desc, [_owner_key(k) for k in cache_keys], is_blocks=False)

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
        cache_desc._is_blocks = True
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

    # ------------------------------------------------------------------ registration

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
            )
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
        check_isinstance("cache_keys", cache_keys, (list, tuple))
        for key in cache_keys:
            check_isinstance("cache_keys", key, CacheKey)
        keys = [_owner_key(k) for k in cache_keys]
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
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey, allow_none=True)
        model_id = None if blocks_cache_key is None else blocks_cache_key.model_id
        cache = self._register(
            api, cache_desc, addrs, [], remote_accessible, is_blocks=True, blocks_model_id=model_id
        )
        cache_desc._is_blocks = True
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
        key = _owner_key(cache_key)
        with self._timeout_errors(api):
            bound = core.table.bound(key) if key is not None else None
            if key is not None and bound is not None and not bound.registered:
                core.table.remove_key(key)

    def remap_registered_memory(self, mem_infos: MemInfo | list[MemInfo]) -> None:
        """Validated as the real one: a list or one MemInfo, each a MemInfo of device memory with addr != 0
        and size > 0 (LLM_PARAM_INVALID for each); memory here never moves, so a valid remap (an empty list
        included) has nothing to do."""
        api = "remap_registered_memory"
        self._require_core(api)
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

    # ------------------------------------------------------------------ transfers

    def _timeout_errors(self, api: str) -> api_errors:
        return _timeout_errors(api)

    def _layers(self, api: str, layers: LayerArgs, num_tensors: int) -> TensorSelection:
        return layers.select(api, num_tensors)

    def _prepared_pull(self, key: tuple[object, ...] | None, cache: object) -> _OneSidedPull | None:
        """The prepared pull for `key` if its record is still the live cache `cache` names, else None (the
        caller then takes the full path, which raises whatever a changed state calls for)."""
        if key is None:
            return None
        with self._lock:
            prepared = self._prepared.get(key)
        if prepared is None or prepared.core is not self._core:
            return None
        record = prepared.record
        if (
            type(cache) is not Cache
            or getattr(cache, "_manager", None) is not self
            or not cache.tensor_addrs
            or not record.external
            or prepared.core.table.get(cache.cache_id) is not record
        ):
            return None
        return prepared

    def _remember(self, key: tuple[object, ...] | None, prepared: _OneSidedPull) -> None:
        if key is None:
            return
        with self._lock:
            if len(self._prepared) >= _MAX_PREPARED:
                self._prepared.clear()
            self._prepared[key] = prepared

    def _run_one_sided(self, api: str, pull: _OneSidedPull) -> None:
        """The part of a one-sided pull that depends on state: pin the local cache, check the peer, find the
        remote cache in the peer's table (refetched when stale), read. When the link and the peer's table
        are those of the last call, and that call's entry is still current (by model id: in a table whose
        version is current), the lookup would find that entry again: the read reuses what was derived."""
        core = pull.core
        with self._timeout_errors(api), core.pins.pinned(pull.record.cache_id) as pinned:
            self._one_sided(api, pinned)
            link = core.oneside.check_peer(pull.cluster_id)
            found, selection = pull.found, pull.selection
            if (
                found is not None
                and found.link is link
                and found.table is link.remote_table
                and pinned is pull.record
                and core.oneside.remote_cache_current(
                    link,
                    found.remote,
                    found.table if pull.model_id is not None else None,
                    words=found.words,
                )
            ):
                core.oneside.read(
                    pull.cluster_id,
                    found.remote,
                    selection.src_start,
                    pinned,
                    selection.dst_start,
                    selection.count,
                    found.runs,
                    link=link,
                    prepared=found.prepared,
                    words=found.words,
                )
                return
            table, remote = self._find_remote(api, core, pull.cluster_id, pull.cache_id, pull.model_id)
            if pull.continuous_source and remote.is_blocks:
                _invalid(api, "the source of pull_cache must not be a blocks cache")
            runs, (prepared, words) = self._pull_one_sided(
                api, core, pull.cluster_id, remote, pull.slot, pinned, selection, pull.runs_for, link
            )
            if pinned is pull.record:
                pull.found = _Found(link, table, remote, runs, prepared, words)

    def _remote(
        self, api: str, core: Core, cluster_id: int, cache_id: int | None, model_id: int | None
    ) -> RemoteCache:
        """A cache from the peer's table (one-sided mode), refetching the table once on a miss.

        Nothing learnt from a peer is trusted once it ended: a dead peer is a link failure before any
        check against its table."""
        core.oneside.check_peer(cluster_id)
        return self._find_remote(api, core, cluster_id, cache_id, model_id)[1]

    @staticmethod
    def _find_remote(
        api: str, core: Core, cluster_id: int, cache_id: int | None, model_id: int | None
    ) -> tuple[RemoteTable, RemoteCache]:
        """`_remote` once the peer was checked, with the table the cache was found in. A model id is looked
        up only in a table whose version is current (the owner may have bound it to another cache since), a
        cache id in any (ids are never reused)."""
        for refresh in (False, True):
            table = core.oneside.remote_table(cluster_id, refresh=refresh)
            if (
                model_id is not None
                and not refresh
                and not core.oneside.remote_table_current(cluster_id, table)
            ):
                continue
            wanted = table.blocks.get(model_id) if model_id is not None else cache_id
            # An entry whose cache the owner has freed since the table was fetched is stale: refetch.
            if (
                wanted is not None
                and wanted in table.caches
                and core.oneside.remote_is_current(cluster_id, table.caches[wanted])
            ):
                return table, table.caches[wanted]
        name = f"model_id {model_id}" if model_id is not None else f"cache id {cache_id}"
        raise make_error(api, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"no remote-accessible cache with {name}")

    def pull_cache(
        self,
        cache_key: CacheKey | CacheKeyByIdAndIndex,
        cache: Cache,
        batch_index: int = 0,
        size: int = -1,
        **kwargs: Any,
    ) -> None:
        """Pull the remote slot into slot `batch_index` of `cache` (not a blocks cache). `size` -1 means the
        local slot; the remote slot must hold it. kwargs: src_layer_range, dst_layer_range,
        tensor_num_per_layer; other names (v1's offsets too) are ignored, as in the real v2. With remote
        cache access on, the key must be a CacheKeyByIdAndIndex (TypeError otherwise)."""
        api = "pull_cache"
        memo_key: tuple[object, ...] | None = None
        if (
            not kwargs
            and type(cache_key) is CacheKeyByIdAndIndex
            and type(batch_index) is int
            and type(size) is int
        ):
            memo_key = (
                api,
                cache_key.cluster_id,
                cache_key.cache_id,
                cache_key.batch_index,
                getattr(cache, "cache_id", None),
                batch_index,
                size,
            )
            prepared = self._prepared_pull(memo_key, cache)
            if prepared is not None:
                self._run_one_sided(api, prepared)
                return
        core = self._require_core(api)
        if core.settings.remote_cache_accessible:
            check_isinstance("cache_key", cache_key, CacheKeyByIdAndIndex)
        else:
            check_isinstance("cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex))
        check_isinstance("cache", cache, Cache)
        check_uint32("batch_index", batch_index)
        check_int64("size", size)
        record = self._record_of(api, core, cache)
        if record.is_blocks:
            _invalid(api, "the destination of pull_cache must not be a blocks cache")
        if size != -1 and size <= 0:
            _invalid(api, f"size must be -1 or > 0, got {size}")
        if isinstance(cache_key, CacheKey):
            self.check_cache_key(cache_key)
        layers = parse_layer_kwargs(kwargs)
        if batch_index >= record.batch_size:
            _invalid(api, f"batch_index {batch_index} out of range for {record.batch_size} slots")
        selection = self._layers(api, layers, record.num_tensors)
        nbytes = record.slot_nbytes if size == -1 else size
        if nbytes > record.slot_nbytes:
            _invalid(api, f"size {nbytes} exceeds the local slot of {record.slot_nbytes} bytes")
        local_offset = batch_index * record.slot_nbytes

        def runs_for(slot: int, unit_nbytes: int, num_units: int) -> list[UnitRun]:
            if nbytes > unit_nbytes:
                raise make_error(
                    api, LLMStatusCode.LLM_PARAM_INVALID, f"{nbytes} bytes exceed the remote slot"
                )
            if slot >= num_units:
                raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, f"remote slot {slot} out of range")
            return [UnitRun(slot * unit_nbytes, local_offset, nbytes)]

        if core.settings.remote_cache_accessible:
            assert isinstance(cache_key, CacheKeyByIdAndIndex)
            pull = _OneSidedPull(
                core,
                record,
                cache_key.cluster_id,
                cache_key.cache_id,
                None,
                cache_key.batch_index,
                selection,
                runs_for,
                continuous_source=True,
            )
            self._remember(memo_key, pull)
            self._run_one_sided(api, pull)
            return
        with self._timeout_errors(api), core.pins.pinned(record.cache_id) as pinned:
            self._pull_resolved(core, key_fields(api, cache_key), pinned, selection, runs_for)

    def pull_blocks(
        self,
        src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
        dst_cache: Cache,
        src_blocks: list[int] | tuple[int, ...] = (),
        dst_blocks: list[int] | tuple[int, ...] = (),
        **kwargs: Any,
    ) -> None:
        """Into a blocks cache: with a BlocksCacheKey, remote block `src_blocks[k]` to local `dst_blocks[k]`;
        with a CacheKey / CacheKeyByIdAndIndex (a continuous remote slot, `src_blocks` empty), the slot cut
        into local-block-sized pieces, piece k to `dst_blocks[k]`. kwargs as `pull_cache` (other names are
        ignored). With remote cache access a CacheKey has no one-sided meaning: LLM_PARAM_INVALID (the real
        library's engine refuses it)."""
        api = "pull_blocks"
        memo_key: tuple[object, ...] | None = None
        src_items, dst_items = _exact_ints(src_blocks), _exact_ints(dst_blocks)
        if not kwargs and src_items is not None and dst_items is not None:
            if type(src_cache_key) is BlocksCacheKey:
                remote_id: tuple[object, ...] = ("blocks", src_cache_key.cluster_id, src_cache_key.model_id)
            elif type(src_cache_key) is CacheKeyByIdAndIndex:
                remote_id = (
                    "slot",
                    src_cache_key.cluster_id,
                    src_cache_key.cache_id,
                    src_cache_key.batch_index,
                )
            else:
                remote_id = ()
            if remote_id:
                memo_key = (api, remote_id, getattr(dst_cache, "cache_id", None), src_items, dst_items)
                prepared = self._prepared_pull(memo_key, dst_cache)
                if prepared is not None:
                    self._run_one_sided(api, prepared)
                    return
        core = self._require_core(api)
        check_isinstance("src_cache_key", src_cache_key, (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey))
        check_isinstance("dst_cache", dst_cache, Cache)
        check_index_lists(src_blocks=src_blocks, dst_blocks=dst_blocks)
        # The plan below may be kept for later calls: it must not see the caller's lists change.
        src_blocks = tuple(src_blocks) if src_blocks is not None else ()
        dst_blocks = tuple(dst_blocks) if dst_blocks is not None else ()
        record = self._record_of(api, core, dst_cache, "dst_cache")
        if not record.is_blocks:
            _invalid(api, "the destination of pull_blocks must be a blocks cache")
        if not dst_blocks:
            _invalid(api, "dst_blocks must not be empty")
        if max(dst_blocks) >= record.batch_size:
            _invalid(api, f"dst block {max(dst_blocks)} >= the cache's {record.batch_size} blocks")
        by_blocks = isinstance(src_cache_key, BlocksCacheKey)
        if by_blocks and len(src_blocks) != len(dst_blocks):
            _invalid(api, "src_blocks and dst_blocks must have the same length")
        if isinstance(src_cache_key, CacheKey):
            self.check_cache_key(src_cache_key)
        if not by_blocks and src_blocks:
            _invalid(api, "src_blocks must be empty when pulling a continuous cache into blocks")
        if core.settings.remote_cache_accessible and isinstance(src_cache_key, CacheKey):
            _invalid(api, "with remote cache access a CacheKey cannot be pulled; use CacheKeyByIdAndIndex")
        layers = parse_layer_kwargs(kwargs)
        selection = self._layers(api, layers, record.num_tensors)
        block = record.slot_nbytes

        def runs_for(slot: int, unit_nbytes: int, num_units: int) -> list[UnitRun]:
            if by_blocks:
                if unit_nbytes != block:
                    _invalid(api, f"remote blocks are {unit_nbytes} bytes, local blocks {block}")
                if max(src_blocks) >= num_units:
                    _invalid(api, f"src block {max(src_blocks)} >= the remote cache's {num_units} blocks")
                return [
                    UnitRun(s * block, d * block, block) for s, d in zip(src_blocks, dst_blocks, strict=True)
                ]
            if slot >= num_units:
                _invalid(api, f"remote slot {slot} out of range")
            pieces = -(-unit_nbytes // block)
            if pieces > len(dst_blocks):
                _invalid(api, f"a {unit_nbytes}-byte slot needs {pieces} blocks, {len(dst_blocks)} given")
            base = slot * unit_nbytes
            return [
                UnitRun(base + k * block, d * block, min(block, unit_nbytes - k * block))
                for k, d in enumerate(dst_blocks[:pieces])
            ]

        if core.settings.remote_cache_accessible:
            if isinstance(src_cache_key, BlocksCacheKey):
                ids: tuple[int | None, int | None, int] = (None, src_cache_key.model_id, 0)
            else:
                assert isinstance(src_cache_key, CacheKeyByIdAndIndex)
                ids = (src_cache_key.cache_id, None, src_cache_key.batch_index)
            pull = _OneSidedPull(
                core, record, src_cache_key.cluster_id, *ids, selection, runs_for, continuous_source=False
            )
            self._remember(memo_key, pull)
            self._run_one_sided(api, pull)
            return
        with self._timeout_errors(api), core.pins.pinned(record.cache_id) as pinned:
            if isinstance(src_cache_key, BlocksCacheKey):
                fields = (src_cache_key.cluster_id, KEY_BLOCKS, 0, src_cache_key.model_id, 0)
            else:
                fields = key_fields(api, src_cache_key)
            self._pull_resolved(core, fields, pinned, selection, runs_for)

    def push_cache(
        self,
        dst_cache_key: CacheKeyByIdAndIndex,
        src_cache: Cache,
        src_batch_index: int = 0,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        size: int = -1,
        tensor_num_per_layer: int = 2,
    ) -> None:
        """Write slot `src_batch_index` of `src_cache` into the remote slot the key names, layer by layer
        (one synchronous transfer per layer). Needs remote cache access (LLM_PARAM_INVALID, checked first)."""
        api = "push_cache"
        core = self._require_core(api)
        self._require_remote_access(api, core)
        check_isinstance("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex)
        check_isinstance("src_cache", src_cache, Cache)
        check_uint32("src_batch_index", src_batch_index)
        check_int64("size", size)
        record = self._record_of(api, core, src_cache, "src_cache")
        if record.is_blocks:
            _invalid(api, "the source of push_cache must not be a blocks cache")
        if size != -1:
            _invalid(api, "size must be -1")
        if src_batch_index >= record.batch_size:
            _invalid(api, f"src_batch_index {src_batch_index} out of range")
        src_layers, dst_layers = self._push_layers(
            api, record, src_layer_range, dst_layer_range, tensor_num_per_layer
        )
        with self._timeout_errors(api), core.pins.pinned(record.cache_id) as pinned:
            remote = self._remote(api, core, dst_cache_key.cluster_id, dst_cache_key.cache_id, None)
            if remote.is_blocks:
                _invalid(api, "the destination of push_cache must not be a blocks cache")
            if dst_cache_key.batch_index >= remote.num_units or remote.unit_nbytes < record.slot_nbytes:
                _invalid(api, "the remote slot cannot hold the local slot")
            runs = [
                UnitRun(
                    dst_cache_key.batch_index * remote.unit_nbytes,
                    src_batch_index * record.slot_nbytes,
                    record.slot_nbytes,
                )
            ]
            self._push_layer_by_layer(
                api,
                core,
                dst_cache_key.cluster_id,
                remote,
                pinned,
                src_layers,
                dst_layers,
                tensor_num_per_layer,
                runs,
            )

    def push_blocks(
        self,
        dst_cache_key: BlocksCacheKey,
        src_cache: Cache,
        src_blocks: list[int] | tuple[int, ...] = (),
        dst_blocks: list[int] | tuple[int, ...] = (),
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = 2,
    ) -> None:
        """Write local blocks `src_blocks[k]` into remote blocks `dst_blocks[k]` of the blocks cache the key
        names, layer by layer. Needs remote cache access (LLM_PARAM_INVALID, checked first); the source is a
        blocks cache."""
        api = "push_blocks"
        core = self._require_core(api)
        self._require_remote_access(api, core)
        check_isinstance("dst_cache_key", dst_cache_key, BlocksCacheKey)
        check_isinstance("src_cache", src_cache, Cache)
        check_index_lists(src_blocks=src_blocks, dst_blocks=dst_blocks)
        record = self._record_of(api, core, src_cache, "src_cache")
        if not record.is_blocks:
            _invalid(api, "the source of push_blocks must be a blocks cache")
        if not dst_blocks or len(src_blocks) != len(dst_blocks):
            _invalid(api, "dst_blocks must be non-empty and as long as src_blocks")
        if max(src_blocks) >= record.batch_size:
            _invalid(api, f"src block {max(src_blocks)} >= the cache's {record.batch_size} blocks")
        src_layers, dst_layers = self._push_layers(
            api, record, src_layer_range, dst_layer_range, tensor_num_per_layer
        )
        block = record.slot_nbytes
        with self._timeout_errors(api), core.pins.pinned(record.cache_id) as pinned:
            remote = self._remote(api, core, dst_cache_key.cluster_id, None, dst_cache_key.model_id)
            if remote.unit_nbytes != block or max(dst_blocks) >= remote.num_units:
                _invalid(api, "remote block size or block index does not match")
            runs = [UnitRun(d * block, s * block, block) for s, d in zip(src_blocks, dst_blocks, strict=True)]
            self._push_layer_by_layer(
                api,
                core,
                dst_cache_key.cluster_id,
                remote,
                pinned,
                src_layers,
                dst_layers,
                tensor_num_per_layer,
                runs,
            )

    # ------------------------------------------------------------------ layer-wise push

    def transfer_cache_async(
        self,
        src_cache: Cache,
        layer_synchronizer: LayerSynchronizer,
        transfer_configs: list[TransferConfig] | list[TransferWithCacheKeyConfig],
        src_block_indices: list[int] | None = None,
        dst_block_indices: list[int] | None = None,
        dst_block_memory_size: int | None = None,
    ) -> CacheTask:
        """Push `src_cache` layer by layer as its synchronizer releases the layers. Without remote cache
        access the configs are `TransferConfig`s (raw destination addresses, as in v1); with it they are
        `TransferWithCacheKeyConfig`s naming the destination cache, written one-sided. A timeout reports
        LLM_TIMEOUT. The source must not be a HOST cache."""
        api = "transfer_cache_async"
        core = self._require_core(api)
        remote_access = core.settings.remote_cache_accessible
        expected = TransferWithCacheKeyConfig if remote_access else TransferConfig
        check_transfer_args(
            api,
            layer_synchronizer,
            transfer_configs,
            expected,
            src_block_indices,
            dst_block_indices,
            dst_block_memory_size,
        )
        record = self._record_of(api, core, src_cache, "src_cache")
        if record.placement == PLACEMENT_HOST:
            _invalid(api, "the source of transfer_cache_async must not be a HOST cache")
        if record.num_tensors % 2:
            _invalid(
                api, f"the source must hold K, V per layer (an even tensor count), not {record.num_tensors}"
            )
        if not remote_access:
            plans = [
                plan_transfer(
                    api, record, config, src_block_indices, dst_block_indices, dst_block_memory_size
                )
                for config in transfer_configs
                if isinstance(config, TransferConfig)  # checked above; narrows the type
            ]
            pushes = [
                LayerPush(plan.dst_cluster_id, plan.layers, functools.partial(plan.push, core, record))
                for plan in plans
            ]
        else:
            pushes = [
                self._key_push(api, core, record, config, src_block_indices, dst_block_indices)
                for config in transfer_configs
                if isinstance(config, TransferWithCacheKeyConfig)  # checked above; narrows the type
            ]
        dst_clusters = [config.dst_cluster_id for config in transfer_configs]
        return start_transfer(
            api, core, record, layer_synchronizer, pushes, dst_clusters, LLMStatusCode.LLM_TIMEOUT
        )

    def _key_push(
        self,
        api: str,
        core: Core,
        record: CacheRecord,
        config: TransferWithCacheKeyConfig,
        src_blocks: list[int] | None,
        dst_blocks: list[int] | None,
    ) -> LayerPush:
        """One TransferWithCacheKeyConfig as a layer push: source layer l goes to destination layer
        dst_layer_range[l - src_layer_range.start] of the cache the key names, one-sided."""
        layers, dst_layers = config.src_layer_range, config.dst_layer_range
        if layers.stop > record.num_tensors // 2:
            _invalid(api, f"src_layer_range {layers} exceeds the source's {record.num_tensors // 2} layers")
        key = config.cache_key
        to_blocks = isinstance(key, BlocksCacheKey)
        if to_blocks != record.is_blocks:
            _invalid(
                api, "a BlocksCacheKey destination needs a blocks source, and a cache id a continuous one"
            )
        unit = record.slot_nbytes
        if to_blocks:
            if not src_blocks or dst_blocks is None or len(src_blocks) != len(dst_blocks):
                _invalid(api, "blocks to blocks needs src and dst block indices of the same length")
            if max(src_blocks) >= record.batch_size:
                _invalid(api, f"src block {max(src_blocks)} >= the source's {record.batch_size} blocks")
        elif config.src_batch_index >= record.batch_size:
            _invalid(api, f"src_batch_index {config.src_batch_index} out of range")

        def push_layer(layer: int) -> None:
            dst_layer = dst_layers[layer - layers.start]
            if isinstance(key, BlocksCacheKey):
                remote = self._remote(api, core, key.cluster_id, None, key.model_id)
                assert src_blocks is not None and dst_blocks is not None
                if remote.unit_nbytes != unit or max(dst_blocks) >= remote.num_units:
                    _invalid(api, "remote block size or block index does not match")
                runs = [
                    UnitRun(d * unit, s * unit, unit) for s, d in zip(src_blocks, dst_blocks, strict=True)
                ]
            else:
                remote = self._remote(api, core, key.cluster_id, key.cache_id, None)
                if key.batch_index >= remote.num_units or remote.unit_nbytes < unit:
                    _invalid(api, "the remote slot cannot hold the local slot")
                runs = [UnitRun(key.batch_index * remote.unit_nbytes, config.src_batch_index * unit, unit)]
            self._check_remote_tensors(api, remote, TensorSelection(2 * dst_layer, 2, False, 2 * layer))
            with api_errors(api, timeout_code=LLMStatusCode.LLM_TIMEOUT):
                core.transfers.transfer_pinned(
                    key.cluster_id, remote, 2 * dst_layer, record, 2 * layer, 2, runs, write=True
                )

        return LayerPush(config.dst_cluster_id, layers, push_layer)

    # ------------------------------------------------------------------ local copies

    def copy_cache(
        self,
        dst: Cache,
        src: Cache,
        dst_batch_index: int = 0,
        src_batch_index: int = 0,
        offset: int = 0,
        size: int = -1,
        req_id: int | None = None,
    ) -> None:
        """Copy one slot of every tensor between two non-blocks caches of this process (pool or registered);
        `offset` < slot; `size` -1 means slot - offset. `req_id` is only logged."""
        api = "copy_cache"
        core = self._require_core(api)
        check_uint32("dst_batch_index", dst_batch_index)
        check_uint32("src_batch_index", src_batch_index)
        check_uint64("offset", offset)
        check_int64("size", size)
        if req_id is not None:
            check_uint64("req_id", req_id)
        dst_record = self._record_of(api, core, dst, "dst")
        src_record = self._record_of(api, core, src, "src")
        if dst_record.is_blocks or src_record.is_blocks:
            _invalid(api, "copy_cache does not take blocks caches")
        if (
            dst_record.num_tensors != src_record.num_tensors
            or dst_record.slot_nbytes != src_record.slot_nbytes
        ):
            _invalid(api, "the caches differ in tensor count or slot size")
        slot = src_record.slot_nbytes
        if dst_batch_index >= dst_record.batch_size or src_batch_index >= src_record.batch_size:
            _invalid(api, "batch index out of range")
        if offset >= slot:
            _invalid(api, f"offset {offset} must be smaller than the slot ({slot} bytes)")
        nbytes = slot - offset if size == -1 else size
        if nbytes <= 0 or offset + nbytes > slot:
            _invalid(api, f"size {size} does not fit the slot after offset {offset}")
        with (
            self._timeout_errors(api),
            core.pins.pinned(src_record.cache_id),
            core.pins.pinned(dst_record.cache_id),
        ):
            _addr_copy(
                core.copier,
                src_record.tensor_addrs(),
                dst_record.tensor_addrs(),
                src_record.tensor_nbytes,
                dst_record.tensor_nbytes,
                [src_batch_index],
                [dst_batch_index],
                slot,
                slot,
                nbytes,
                offset,
            )

    def copy_blocks(self, cache: Cache, copy_block_info: dict[int, list[int]]) -> None:
        """Within one blocks cache, copy block `src` to each listed destination block, in every tensor."""
        api = "copy_blocks"
        core = self._require_core(api)
        check_isinstance("copy_block_info", copy_block_info, dict)
        pairs: list[tuple[int, int]] = []
        for src_block, dst_blocks in copy_block_info.items():
            check_uint64("copy_block_info", src_block)
            check_isinstance("copy_block_info", dst_blocks, list)
            for dst_block in dst_blocks:
                check_uint64("copy_block_info", dst_block)
                pairs.append((src_block, dst_block))
        record = self._record_of(api, core, cache)
        if not record.is_blocks:
            _invalid(api, "copy_blocks takes a blocks cache")
        if any(max(pair) >= record.batch_size for pair in pairs):
            _invalid(api, f"block index out of range ({record.batch_size} blocks)")
        destinations = [d for _, d in pairs]
        if len(set(destinations)) != len(destinations) or set(destinations) & set(copy_block_info):
            _invalid(api, "a destination block is listed twice or is also a source")
        if not pairs:
            return
        block = record.slot_nbytes
        with self._timeout_errors(api), core.pins.pinned(record.cache_id):
            addrs = record.tensor_addrs()
            _addr_copy(
                core.copier,
                addrs,
                addrs,
                record.tensor_nbytes,
                record.tensor_nbytes,
                [s for s, _ in pairs],
                destinations,
                block,
                block,
                block,
            )

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: dict[int, int]) -> None:
        """Copy blocks `src -> dst` between two blocks caches, HOST -> DEVICE or DEVICE -> HOST by their
        placements, as the real `swap_blocks`: pool, registered or cpu caches (`Cache.create_cpu_cache`,
        memory the caller owns). Checked in the real order: both blocks caches, the same block size and
        tensor count, indices in `[0, blocks)`, then the placements (all LLM_PARAM_INVALID)."""
        api = "swap_blocks"
        core = self._require_core(api)
        check_isinstance("src", src_cache, Cache)
        check_isinstance("dst", dst_cache, Cache)
        if not src_cache.is_blocks_cache:
            _invalid(api, "param check failed, src cache should be blocks cache.")
        if not dst_cache.is_blocks_cache:
            _invalid(api, "param check failed, dst cache should be blocks cache.")
        check_isinstance("src_to_dst", src_to_dst, dict)
        for src_block, dst_block in src_to_dst.items():
            check_isinstance("src_to_dst", src_block, int)
            check_isinstance("src_to_dst", dst_block, int)
        src = self._swap_side(api, core, src_cache, "src")
        dst = self._swap_side(api, core, dst_cache, "dst")
        if src.block_nbytes != dst.block_nbytes:
            _invalid(
                api, f"src block size:{src.block_nbytes} and dst block size:{dst.block_nbytes} must be equal"
            )
        if src.num_tensors != dst.num_tensors:
            _invalid(
                api, f"src num_tensors:{src.num_tensors} and dst num_tensors:{dst.num_tensors} must be equal"
            )
        for src_block, dst_block in src_to_dst.items():
            if not 0 <= src_block < src.num_blocks:
                _invalid(api, f"src_block_index:{src_block} must be in [0, {src.num_blocks})")
            if not 0 <= dst_block < dst.num_blocks:
                _invalid(api, f"dst_block_index:{dst_block} must be in [0, {dst.num_blocks})")
        if {src.placement, dst.placement} != {PLACEMENT_HOST, PLACEMENT_DEVICE}:
            _invalid(
                api,
                f"swap src placement:{Placement(src.placement)} to dst placement:{Placement(dst.placement)} "
                "is not support",
            )
        src_units, dst_units = list(src_to_dst), list(src_to_dst.values())
        if len(set(dst_units)) != len(dst_units):
            _invalid(api, "a destination block is named twice")
        if not src_units:
            return
        with self._timeout_errors(api), contextlib.ExitStack() as pins:
            for side in (src, dst):
                if side.cache_id is not None:
                    pins.enter_context(core.pins.pinned(side.cache_id))
            _addr_copy(
                core.copier,
                src.addrs,
                dst.addrs,
                src.span_nbytes,
                dst.span_nbytes,
                src_units,
                dst_units,
                src.block_nbytes,
                dst.block_nbytes,
                src.block_nbytes,
            )

    def _swap_side(self, api: str, core: Core, cache: Cache, name: str) -> _SwapSide:
        """One side of swap_blocks: a cpu cache (cache_id -1: the caller's memory, as its descriptor says)
        or a live cache of this process (its record)."""
        if cache.cache_id == -1:
            desc = cache.cache_desc
            addrs = list(cache.tensor_addrs)
            if len(addrs) != desc.num_tensors:
                _invalid(api, f"{name}: {len(addrs)} addresses for {desc.num_tensors} tensors")
            blocks = desc.shape[0]
            return _SwapSide(
                None, addrs, desc.size // blocks, blocks, desc.num_tensors, desc.size, int(desc.placement)
            )
        record = self._record_of(api, core, cache, name)
        return _SwapSide(
            record.cache_id,
            record.tensor_addrs(),
            record.slot_nbytes,
            record.batch_size,
            record.num_tensors,
            record.tensor_nbytes,
            record.placement,
        )

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _require_remote_access(api: str, core: Core) -> None:
        if not core.settings.remote_cache_accessible:
            _invalid(api, f"{api} is only supported while enable_remote_cache_accessible is True")

    def _pull_one_sided(
        self,
        api: str,
        core: Core,
        cluster_id: int,
        remote: RemoteCache,
        slot: int,
        local: CacheRecord,
        selection: TensorSelection,
        runs_for: _RunsFor,
        link: ClientLink,
    ) -> tuple[list[UnitRun], tuple[PreparedRuns | None, Segment | None]]:
        """Read the selected tensors of remote slot `slot` straight from the peer's table (no round trip)
        over `link` (`Core.check_peer`'s); the runs read and what the read prepared, for a repeat."""
        self._check_remote_tensors(api, remote, selection)
        runs = runs_for(slot, remote.unit_nbytes, remote.num_units)
        prepared = core.oneside.read(
            cluster_id,
            remote,
            selection.src_start,
            local,
            selection.dst_start,
            selection.count,
            runs,
            link=link,
        )
        return runs, prepared

    @staticmethod
    def _pull_resolved(
        core: Core,
        fields: tuple[int, int, int, int, int],
        local: CacheRecord,
        selection: TensorSelection,
        runs_for: _RunsFor,
    ) -> None:
        """Pull through the peer, which resolves the key (fields as `_key_fields` gives them) and pins."""
        cluster_id, kind, key_id, model_id, slot = fields
        ref = SourceRef(
            kind,
            key_id,
            model_id,
            slot,
            selection.src_start,
            selection.count,
            selection.whole,
            consume=True,
            rules=V2,
        )
        core.transfers.transfer_resolved(
            cluster_id,
            ref,
            local,
            selection.dst_start,
            lambda loc: runs_for(loc.slot, loc.unit_nbytes, loc.num_units),
        )

    @staticmethod
    def _one_sided(api: str, local: CacheRecord) -> None:
        # The real one-sided path needs the local side registered for remote access too (HIXL connector).
        if not local.remote_accessible:
            _invalid(api, "with remote cache access, the local cache must be remote_accessible too")

    @staticmethod
    def _check_remote_tensors(api: str, remote: RemoteCache, selection: TensorSelection) -> None:
        count = len(remote.tensor_bases)
        if selection.whole and selection.count != count:
            _invalid(api, f"the remote cache has {count} tensors, the local selection {selection.count}")
        if selection.src_start + selection.count > count:
            _invalid(api, f"remote tensors [{selection.src_start}, +{selection.count}) exceed its {count}")

    def _push_layer_by_layer(
        self,
        api: str,
        core: Core,
        cluster_id: int,
        remote: RemoteCache,
        local: CacheRecord,
        src_layers: range,
        dst_layers: range,
        per_layer: int,
        runs: list[UnitRun],
    ) -> None:
        """push_cache / push_blocks: one pinned write of `runs` per (source layer, destination layer)."""
        for src_layer, dst_layer in zip(src_layers, dst_layers, strict=True):
            n = per_layer
            self._check_remote_tensors(api, remote, TensorSelection(dst_layer * n, n, False, src_layer * n))
            core.transfers.transfer_pinned(
                cluster_id, remote, dst_layer * n, local, src_layer * n, n, runs, write=True
            )

    @staticmethod
    def _push_layers(
        api: str, record: CacheRecord, src: range | None, dst: range | None, per_layer: int
    ) -> tuple[range, range]:
        check_range_step1("src_layer_range", src, allow_none=True)
        check_range_step1("dst_layer_range", dst, allow_none=True)
        check_uint32("tensor_num_per_layer", per_layer)
        if per_layer < 1 or record.num_tensors % per_layer:
            _invalid(api, f"tensor_num_per_layer {per_layer} must divide the {record.num_tensors} tensors")
        layers = range(record.num_tensors // per_layer)
        src = layers if src is None else src
        dst = layers if dst is None else dst
        if len(src) != len(dst) or not src or src.stop > len(layers):
            _invalid(
                api, f"layer ranges {src} and {dst} must be non-empty, of equal length, within the cache"
            )
        return src, dst


__all__ = ["PLACEMENT_HOST", "CacheManager"]


def _addr_copy(
    copier: Any,
    src_addrs: list[int],
    dst_addrs: list[int],
    src_span_nbytes: int,
    dst_span_nbytes: int,
    src_units: list[int],
    dst_units: list[int],
    src_unit_nbytes: int,
    dst_unit_nbytes: int,
    nbytes: int,
    offset: int = 0,
) -> None:
    """Copy unit `src_units[k]` to unit `dst_units[k]` of every tensor pair, through address views (pool
    caches, registered memory and cpu caches alike); one numpy-built plan per tensor."""
    for src_addr, dst_addr in zip(src_addrs, dst_addrs, strict=True):
        runs = plan_block_copy(
            [offset], [offset], src_units, dst_units, src_unit_nbytes, dst_unit_nbytes, nbytes
        )
        copier.run(runs, address_view(src_addr, src_span_nbytes), address_view(dst_addr, dst_span_nbytes))
