"""`KvCacheManager`: the v1 cache API (allocate with keys, deallocate, remove keys, pull by key).

Rules: every public method validates its arguments first (the real exception types in the real order,
nothing sent before the checks pass), enforces v1's roles as the real `_check_role` does (pull on DECODER,
`remove_cache_key` and `transfer_cache_async` on PROMPT, keys on PROMPT only; MIX is neither), then
delegates to `Core`. Internal errors become `LLMException` in `api_errors`, nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from .._errors import FINALIZED, FORK_HINT, api_errors
from .._keys import KeyId
from .._owner.records import CacheRecord
from .._puller.source import SourceRef
from .._puller.transfers import BlocksSpec, PullSpec
from .._stats import GEN_V1, PULL
from .._transfer import (
    LayerArgs,
    TensorSelection,
    check_cache_key,
    check_transfer_args,
    key_fields,
    owner_key,
    parse_layer_kwargs,
    plan_transfer,
    start_transfer,
)
from .._validate import (
    check_index_lists,
    check_int64,
    check_isinstance,
    check_positive_or_set_default,
    check_uint32,
)
from ..configs import LLMRole
from ..status import LLMException, LLMStatusCode, make_error
from ..v2.cache import KvCache
from ..v2.llm_types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    LayerSynchronizer,
    Placement,
    TransferConfig,
)
from ..v2.llm_utils import CacheTask
from . import _local_ops

# What `_run_pull` runs: a pull or a block pull.
_Spec = TypeVar("_Spec", PullSpec, BlocksSpec)

if TYPE_CHECKING:
    from .._core import Core


# Checked pulls kept per manager (a connector repeats a few shapes).
_MAX_PREPARED = 1024


def _pull_plan_key(
    cache_key: object, kv_cache: object, batch_index: object, size: object, kwargs: dict[str, Any]
) -> tuple[tuple[object, ...], tuple[int, int, int, int, int]] | None:
    """What makes two `pull_cache` calls the same plan whatever key they name (the kind of key, the local
    cache, the batch index, the size, the layer ranges and offsets), with what the key names (as
    `key_fields` gives it), when every argument is of an exact type whose equality is its value and the
    key is one the full checks pass; None otherwise (the full checks then run, and say what is wrong)."""
    if type(kv_cache) is not KvCache or type(batch_index) is not int or type(size) is not int:
        return None
    for value in kwargs.values():
        if value is not None and type(value) is not int and type(value) is not range:
            return None
    if type(cache_key) is not CacheKey and type(cache_key) is not CacheKeyByIdAndIndex:
        return None
    fields = cache_key._names
    if fields is None:
        return None
    return (fields[1], kv_cache.cache_id, batch_index, size, tuple(kwargs.items())), fields


def _spec_for(fields: tuple[int, int, int, int, int], plan: PullSpec) -> PullSpec:
    """`plan` (a checked pull of the same plan key) for the key whose `fields` `_pull_plan_key` gave: the
    key's fields, then the plan's. Built with `tuple.__new__`, as the tuples they are: a named tuple's own
    `__new__` is a Python function, and every pull builds these two."""
    cluster, kind, key_id, model_id, batch = fields
    ref = _new_tuple(SourceRef, (kind, key_id, model_id, batch, *plan.ref[4:]))
    return _new_tuple(PullSpec, (cluster, ref, *plan[2:]))


_new_tuple = tuple.__new__


def _param_invalid(api: str, context: str) -> NoReturn:
    raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, context)


def _select(api: str, core: Core, layers: LayerArgs, record: CacheRecord) -> TensorSelection:
    if len(core.settings.device_ids) > 1 and (layers.src_range is not None or layers.dst_range is not None):
        _param_invalid(api, "layer ranges are not supported with several devices in one process")
    return layers.select(api, record.num_tensors)


# The pulls' error translators: they keep nothing of a call, so one of each serves every call and thread.
_PULL_ERRORS = {api: api_errors(api) for api in ("pull_cache", "pull_blocks")}


def _run_pull(
    api: str, core: Core, transfer: Callable[[_Spec, CacheRecord], None], spec: _Spec, record: CacheRecord
) -> None:
    """`transfer` (`Transfers.pull`, `pull_blocks`) of `spec` into `record`, pinned; failures translated
    (`api_errors`) and counted. Written out rather than as two with-blocks: every pull runs it."""
    pins = core.pins
    try:
        pinned = pins.enter(record.cache_id)
        try:
            transfer(spec, pinned)
        except BaseException as exc:
            pins.leave(pinned, exc)
            raise
        pins.leave(pinned, None)
    except BaseException as exc:
        try:
            _PULL_ERRORS[api].raise_for(exc)
            raise
        except LLMException as error:  # exc, or what it means
            core.stats.failed(GEN_V1, PULL, error.status_code)
            raise


class KvCacheManager:
    """The v1 manager, reached through `LLMDataDist.kv_cache_manager`.

    Differences from the real library: caches live in POSIX shared memory on the host whatever the
    placement; methods of later issues raise `LLM_FEATURE_NOT_ENABLED` until implemented (see README).
    """

    def __init__(self, core: Core, role: LLMRole) -> None:
        self._core: Core | None = core
        self._role = role
        # Checked pulls by their plan (`_pull_plan_key`: every argument but the key's identity): a pull
        # of the same plan into the same live cache checks only its key (at most _MAX_PREPARED, then
        # start over). Serving clients pull requests of a few shapes, each with a new key.
        self._prepared: dict[tuple[object, ...], tuple[Core, LLMRole, PullSpec, CacheRecord]] = {}

    # ------------------------------------------------------------------ state

    def is_initialized(self) -> bool:
        return self._core is not None

    @property
    def _initialized(self) -> bool:
        """The real attribute behind `is_initialized`."""
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
        self._prepared.clear()

    def _check_role(self, api: str, role: LLMRole) -> None:
        # The real check is an equality: MIX may neither pull nor push nor bind keys.
        if self._role != role:
            _param_invalid(api, f"[{api}] is not supported by {self._role}")

    @staticmethod
    def check_cache_key(cache_key: CacheKey) -> None:
        """LLMException(LLM_PARAM_INVALID) unless exactly one of req_id and prefix_id is set (the real
        static method)."""
        check_cache_key(cache_key)

    def _record_of(self, api: str, core: Core, cache: KvCache) -> CacheRecord:
        record = core.table.get(cache.cache_id) if cache._is_valid else None
        if record is None or not record.external:
            _param_invalid(api, f"cache {cache.cache_id} is not a valid cache of this process")
        return record

    # ------------------------------------------------------------------ allocation

    def allocate_cache(
        self, cache_desc: CacheDesc, cache_keys: list[CacheKey] | tuple[CacheKey, ...] = ()
    ) -> KvCache:
        """Allocate `num_tensors` tensors of `shape` and bind `cache_keys[i]` to batch slot i.

        A key whose req_id is 2**64-1 (and no prefix_id) pads a slot. A key with a prefix_id indexes the
        prefix table and is never consumed by a pull. Keys are only allowed on PROMPT.
        """
        api = "allocate_cache"
        core = self._require_core(api)
        check_isinstance("cache_desc", cache_desc, CacheDesc)
        check_isinstance("cache_keys", cache_keys, (list, tuple))
        for key in cache_keys:
            check_isinstance("cache_keys", key, CacheKey)
        self._check_desc(api, cache_desc)
        if cache_keys and self._role != LLMRole.PROMPT:
            _param_invalid(api, f"cache_keys is not supported by {self._role.name}")
        keys = [owner_key(api, key) for key in cache_keys]
        return self._allocate(api, core, cache_desc, keys, is_blocks=False)

    def allocate_blocks_cache(
        self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None
    ) -> KvCache:
        """Allocate a paged (PA) cache: `shape[0]` is the number of blocks, each `size // shape[0]` bytes per
        tensor. A `BlocksCacheKey` indexes it by `model_id` (a newer cache with the same model_id replaces
        the index entry); blocks keys are never consumed by pulls. Not allowed with a key on DECODER."""
        api = "allocate_blocks_cache"
        core = self._require_core(api)
        check_isinstance("cache_desc", cache_desc, CacheDesc)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey, allow_none=True)
        self._check_desc(api, cache_desc)
        # As the real code: only a DECODER is refused a key (PROMPT and MIX may index their blocks).
        if blocks_cache_key is not None and self._role == LLMRole.DECODER:
            _param_invalid(api, "blocks_cache_key is not supported by DECODER")
        model_id = None if blocks_cache_key is None else blocks_cache_key.model_id
        cache = self._allocate(api, core, cache_desc, [], is_blocks=True, blocks_model_id=model_id)
        return cache

    def _check_desc(self, api: str, cache_desc: CacheDesc) -> None:
        if cache_desc.placement != Placement.DEVICE:
            _param_invalid(api, "v1 caches support Placement.DEVICE only")
        if cache_desc.num_tensors <= 0:
            _param_invalid(api, "num_tensors must be > 0")
        shape = list(cache_desc.shape)
        if not shape or any(dim <= 0 for dim in shape):
            _param_invalid(api, f"shape {shape} must have positive dimensions")

    def _allocate(
        self,
        api: str,
        core: Core,
        cache_desc: CacheDesc,
        keys: list[KeyId | None],
        *,
        is_blocks: bool,
        blocks_model_id: int | None = None,
    ) -> KvCache:
        # With several devices in one process each device gets its own tensors: device d's tensor t is
        # tensor d * num_tensors + t of the record, so transfers move every device's copy one to one.
        devices = len(core.settings.device_ids)
        with api_errors(api):
            record = core.table.allocate(
                num_tensors=cache_desc.num_tensors * devices,
                tensor_nbytes=cache_desc.size,
                batch_size=cache_desc.shape[0],
                keys=keys,
                is_blocks=is_blocks,
                blocks_model_id=blocks_model_id,
            )
        addrs = record.tensor_addrs()
        per_device = [
            addrs[d * cache_desc.num_tensors : (d + 1) * cache_desc.num_tensors] for d in range(devices)
        ]
        return KvCache(record.cache_id, cache_desc, per_device, self)

    def deallocate_cache(self, cache: KvCache) -> None:
        """Drop the cache's own reference. The memory is freed once no key still references it."""
        api = "deallocate_cache"
        core = self._require_core(api)
        check_isinstance("cache", cache, KvCache)
        if cache.cache_id == -1 or cache.cache_desc.placement == Placement.HOST:
            _param_invalid(api, "host (cpu) caches are not deallocated by the manager")
        if not cache._is_valid:
            return
        with api_errors(api):
            core.table.deallocate(cache.cache_id)
        cache._invalidate()  # only once it is done: a call that failed can be made again

    def _deallocate_later(self, cache: KvCache) -> None:
        """`KvCache.__del__`'s deallocate: it cannot wait for the index lock, nor fail."""
        core = self._core
        if core is not None and core.forked_from is None and cache._is_valid and cache.cache_id != -1:
            cache._invalidate()
            core.table.deallocate_later(cache.cache_id)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unbind a key (PROMPT only); unknown keys are ignored."""
        api = "remove_cache_key"
        core = self._require_core(api)
        self._check_role(api, LLMRole.PROMPT)
        check_isinstance("cache_key", cache_key, CacheKey)
        key = owner_key(api, cache_key)
        if key is not None:
            with api_errors(api):
                core.table.remove_key(key)

    # ------------------------------------------------------------------ pull

    def pull_cache(
        self,
        cache_key: CacheKey | CacheKeyByIdAndIndex,
        kv_cache: KvCache,
        batch_index: int = 0,
        size: int = -1,
        **kwargs: Any,
    ) -> None:
        """Pull the remote slot named by `cache_key` into slot `batch_index` of every selected tensor.

        kwargs: src_layer_range, dst_layer_range (range, step 1), src_cache_offset, dst_cache_offset (bytes
        within the slots, >= 0: ValueError otherwise), tensor_num_per_layer (default 2); other names are
        ignored, as in the real library. `size` is bytes per tensor, -1 meaning the local slot size minus
        dst_cache_offset. A pull without offsets consumes a req_id key once every tensor of it was pulled;
        with offsets, or with a prefix key, the key stays.
        """
        api = "pull_cache"
        planned = _pull_plan_key(cache_key, kv_cache, batch_index, size, kwargs)
        memo_key = None
        if planned is not None:
            memo_key, fields = planned
            entry = self._prepared.get(memo_key)
            if entry is not None:
                core, role, spec, record = entry
                # The record is the cache's while the cache lives (ids are never reused in an instance);
                # the local pin refuses it once the user deallocated it.
                if (
                    core is self._core
                    and role is self._role
                    and core.forked_from is None
                    and kv_cache._is_valid
                ):
                    _run_pull(api, core, core.transfers.pull, _spec_for(fields, spec), record)
                    return
        core = self._require_core(api)
        self._check_role(api, LLMRole.DECODER)
        check_isinstance("cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex))
        check_isinstance("kv_cache", kv_cache, KvCache)
        check_int64("size", size)
        check_uint32("batch_index", batch_index)
        if size != -1 and size <= 0:
            _param_invalid(api, f"size must be -1 or > 0, got {size}")
        src_offset = kwargs.get("src_cache_offset")
        dst_offset = kwargs.get("dst_cache_offset")
        check_positive_or_set_default("src_cache_offset", src_offset)
        check_positive_or_set_default("dst_cache_offset", dst_offset)
        if isinstance(cache_key, CacheKey):
            check_cache_key(cache_key)
        layers = parse_layer_kwargs(kwargs)
        record = self._record_of(api, core, kv_cache)
        if batch_index >= record.batch_size:
            _param_invalid(api, f"batch_index {batch_index} out of range for batch size {record.batch_size}")
        selection = _select(api, core, layers, record)

        slot_nbytes = record.slot_nbytes
        dst_base = dst_offset or 0
        nbytes = size if size > 0 else slot_nbytes - dst_base
        if nbytes <= 0 or dst_base + nbytes > slot_nbytes:
            _param_invalid(
                api,
                f"dst_cache_offset {dst_base} + size {nbytes} does not fit the slot of {slot_nbytes} bytes",
            )
        remote_cluster_id, kind, key_id, model_id, source_batch = key_fields(api, cache_key)
        ref = SourceRef(
            kind,
            key_id,
            model_id,
            source_batch,
            selection.src_start,
            selection.count,
            selection.whole,
            nbytes,
            src_offset or 0,
            # v1 never consumes a key pulled with offsets (reference §16).
            consume=src_offset is None and dst_offset is None,
        )
        spec = PullSpec(remote_cluster_id, ref, selection.dst_start, batch_index * slot_nbytes + dst_base)
        if memo_key is not None:
            if len(self._prepared) >= _MAX_PREPARED:
                self._prepared.clear()
            self._prepared[memo_key] = (core, self._role, spec, record)
        _run_pull(api, core, core.transfers.pull, spec, record)

    def _not_yet(self, api: str) -> NoReturn:
        self._require_core(api)
        raise make_error(
            api, LLMStatusCode.LLM_FEATURE_NOT_ENABLED, f"{api} is not implemented yet on this host"
        )

    def pull_blocks(
        self,
        prompt_cache_key: BlocksCacheKey,
        decoder_kv_cache: KvCache,
        prompt_blocks: list[int],
        decoder_blocks: list[int],
        **kwargs: Any,
    ) -> None:
        """Copy remote block `prompt_blocks[k]` into local block `decoder_blocks[k]` of every selected tensor.

        The remote paged cache is the one the Prompt indexed with `BlocksCacheKey.model_id`; blocks keys are
        never consumed. kwargs: src_layer_range, dst_layer_range, tensor_num_per_layer (as pull_cache);
        other names are ignored, as in the real library. The local cache must be a blocks cache with blocks
        of the same size as the remote ones.
        """
        api = "pull_blocks"
        core = self._require_core(api)
        self._check_role(api, LLMRole.DECODER)
        check_isinstance("prompt_cache_key", prompt_cache_key, BlocksCacheKey)
        check_isinstance("decoder_kv_cache", decoder_kv_cache, KvCache)
        check_index_lists(prompt_blocks=prompt_blocks, decoder_blocks=decoder_blocks)
        if not prompt_blocks or len(prompt_blocks) != len(decoder_blocks):
            _param_invalid(
                api,
                f"prompt_blocks ({len(prompt_blocks)}) and decoder_blocks ({len(decoder_blocks)}) must be "
                "non-empty and of equal length",
            )
        layers = parse_layer_kwargs(kwargs)
        record = self._record_of(api, core, decoder_kv_cache)
        if not record.is_blocks:
            _param_invalid(api, "decoder_kv_cache must be a blocks cache (allocate_blocks_cache)")
        if max(decoder_blocks) >= record.batch_size:
            _param_invalid(
                api, f"decoder block {max(decoder_blocks)} >= the cache's {record.batch_size} blocks"
            )
        selection = _select(api, core, layers, record)
        spec = BlocksSpec(
            remote_cluster_id=prompt_cache_key.cluster_id,
            model_id=prompt_cache_key.model_id,
            src_tensor_start=selection.src_start,
            tensor_count=selection.count,
            whole=selection.whole,
            dst_tensor_start=selection.dst_start,
            src_blocks=tuple(prompt_blocks),
            dst_blocks=tuple(decoder_blocks),
        )
        _run_pull(api, core, core.transfers.pull_blocks, spec, record)

    def copy_cache(
        self,
        dst: KvCache,
        src: KvCache,
        dst_batch_index: int = 0,
        src_batch_index: int = 0,
        offset: int = 0,
        size: int = -1,
        req_id: int | None = None,
    ) -> None:
        """Copy slot `src_batch_index` of every tensor of `src` into slot `dst_batch_index` of `dst`, within
        this process; `offset` is a byte offset in both slots, `size` -1 means the slot minus `offset`.
        `req_id` is only logged."""
        api = "copy_cache"
        core = self._require_core(api)
        _local_ops.copy_cache(api, core, dst, src, dst_batch_index, src_batch_index, offset, size, req_id)

    def copy_blocks(self, cache: KvCache, copy_block_info: dict[int, list[int]]) -> None:
        """Within one blocks cache, copy block `src` to every block listed for it, in every tensor."""
        api = "copy_blocks"
        core = self._require_core(api)
        _local_ops.copy_blocks(api, core, cache, copy_block_info)

    def swap_blocks(self, src: KvCache, dst: KvCache, src_to_dst: dict[int, int]) -> None:
        """Copy blocks between a HOST cpu cache (`KvCache.create_cpu_cache`) and a DEVICE cache."""
        api = "swap_blocks"
        core = self._require_core(api)
        _local_ops.swap_blocks(api, core, src, dst, src_to_dst)

    def get_cache_tensors(self, cache: KvCache, tensor_index: int = 0) -> list[Any]:
        self._not_yet("get_cache_tensors")

    def transfer_cache_async(
        self,
        src_cache: KvCache,
        layer_synchronizer: LayerSynchronizer,
        transfer_configs: list[TransferConfig] | tuple[TransferConfig, ...],
        src_block_indices: list[int] | None = None,
        dst_block_indices: list[int] | None = None,
        dst_block_memory_size: int | None = None,
    ) -> CacheTask:
        """Push `src_cache` layer by layer (K, V per layer) into Decoders' memory named by raw addresses.

        A background thread waits for each layer through `layer_synchronizer.synchronize_layer(i, None)` and
        then pushes it to every config that wants it: continuous to continuous (slot `src_batch_index`),
        paged to paged (`src_block_indices[k]` to `dst_block_indices[k]`); continuous to blocks is refused
        here, as by the real v1 helper (v2 supports it). PROMPT only; every destination must have linked
        to us.
        Pulls from a destination cluster get LLM_LINK_BUSY while the transfer runs, and a transfer cannot
        start while one of them is pulling.
        """
        api = "transfer_cache_async"
        core = self._require_core(api)
        self._check_role(api, LLMRole.PROMPT)
        check_isinstance("src_cache", src_cache, KvCache)
        check_transfer_args(
            api,
            layer_synchronizer,
            transfer_configs,
            TransferConfig,
            src_block_indices,
            dst_block_indices,
            dst_block_memory_size,
        )
        if not src_block_indices and dst_block_indices is not None:
            # ge's v1 helper refuses continuous to blocks outright (v2 supports it).
            _param_invalid(api, "transfer from cache to blocks is not supported")
        if len(core.settings.device_ids) > 1:
            _param_invalid(api, "not supported with several devices in one process")
        record = self._record_of(api, core, src_cache)
        if record.num_tensors % 2:
            _param_invalid(api, f"cache_desc.num_tensors ({record.num_tensors}) is not even")
        plans = [
            plan_transfer(api, record, config, src_block_indices, dst_block_indices, dst_block_memory_size)
            for config in transfer_configs
        ]
        pushes = [plan.layer_push(core, record, GEN_V1) for plan in plans]
        return start_transfer(
            api,
            core,
            record,
            layer_synchronizer,
            pushes,
            [config.dst_cluster_id for config in transfer_configs],
            LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
            GEN_V1,
        )
