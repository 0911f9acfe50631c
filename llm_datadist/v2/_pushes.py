"""`CacheManager`'s writes into peers: `push_cache` and `push_blocks` (layer by layer, each layer pinned at
the peer for its write) and `transfer_cache_async` (layer-wise as the synchronizer releases the layers).

Rules: writes never go unpinned (a write cannot be taken back once it landed in reused memory): each goes
through `Core.transfers.transfer_pinned`, or, without remote cache access, the v1 push plans of
`_transfer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._core import PLACEMENT_HOST
from .._errors import api_errors
from .._owner.records import CacheRecord
from .._puller.movers import UnitRun
from .._puller.source import RemoteCache
from .._stats import GEN_V2, PUSH, WRITE
from .._transfer import (
    TensorSelection,
    check_transfer_args,
    plan_transfer,
    start_transfer,
)
from .._validate import (
    check_index_lists,
    check_int64,
    check_isinstance,
    check_range_step1,
    check_uint32,
)
from ..status import LLMException, LLMStatusCode
from .cache import Cache
from .llm_types import (
    BlocksCacheKey,
    CacheKeyByIdAndIndex,
    LayerSynchronizer,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from .llm_utils import CacheTask, LayerPush

if TYPE_CHECKING:
    from .._core import Core
from ._base import ManagerBase, _invalid


class Pushes(ManagerBase):
    """The pushes of `CacheManager`."""

    @staticmethod
    def _require_remote_access(api: str, core: Core) -> None:
        if not core.settings.remote_cache_accessible:
            _invalid(api, f"{api} is only supported while enable_remote_cache_accessible is True")

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
        try:
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
        except LLMException as exc:
            core.stats.failed(GEN_V2, WRITE, exc.status_code)
            raise

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
        try:
            with self._timeout_errors(api), core.pins.pinned(record.cache_id) as pinned:
                remote = self._remote(api, core, dst_cache_key.cluster_id, None, dst_cache_key.model_id)
                if remote.unit_nbytes != block or max(dst_blocks) >= remote.num_units:
                    _invalid(api, "remote block size or block index does not match")
                runs = [
                    UnitRun(d * block, s * block, block) for s, d in zip(src_blocks, dst_blocks, strict=True)
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
        except LLMException as exc:
            core.stats.failed(GEN_V2, WRITE, exc.status_code)
            raise

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
            pushes = [plan.layer_push(core, record, GEN_V2) for plan in plans]
        else:
            pushes = [
                self._key_push(api, core, record, config, src_block_indices, dst_block_indices)
                for config in transfer_configs
                if isinstance(config, TransferWithCacheKeyConfig)  # checked above; narrows the type
            ]
        dst_clusters = [config.dst_cluster_id for config in transfer_configs]
        operation = WRITE if remote_access else PUSH
        return start_transfer(
            api,
            core,
            record,
            layer_synchronizer,
            pushes,
            dst_clusters,
            LLMStatusCode.LLM_TIMEOUT,
            GEN_V2,
            operation,
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
        dst_layer_range[l - src_layer_range.start] of the cache the key names, one-sided. As the real
        `llm_utils`, the source counts as blocks only when `src_block_indices` are given (blocks to blocks,
        into a BlocksCacheKey); without them a slot goes to a slot: slot `src_batch_index` of the source (a
        block, for a blocks cache) into slot `batch_index` of the destination (block 0 of a blocks cache)."""
        layers, dst_layers = config.src_layer_range, config.dst_layer_range
        if layers.stop > record.num_tensors // 2:
            _invalid(api, f"src_layer_range {layers} exceeds the source's {record.num_tensors // 2} layers")
        key = config.cache_key
        by_blocks = bool(src_blocks)
        unit = record.slot_nbytes
        if by_blocks:
            assert src_blocks is not None
            if not isinstance(key, BlocksCacheKey):
                _invalid(api, "src_block_indices push blocks: the destination must be a BlocksCacheKey")
            if dst_blocks is None or len(src_blocks) != len(dst_blocks):
                _invalid(api, "blocks to blocks needs src and dst block indices of the same length")
            if max(src_blocks) >= record.batch_size:
                _invalid(api, f"src block {max(src_blocks)} >= the source's {record.batch_size} blocks")
        elif dst_blocks:
            _invalid(
                api, "dst_block_indices without src_block_indices: a slot into blocks by key is not supported"
            )
        elif config.src_batch_index >= record.batch_size:
            _invalid(api, f"src_batch_index {config.src_batch_index} out of range")

        def push_layer(layer: int) -> None:
            dst_layer = dst_layers[layer - layers.start]
            if isinstance(key, BlocksCacheKey):
                remote = self._remote(api, core, key.cluster_id, None, key.model_id)
                dst_slot = 0
            else:
                remote = self._remote(api, core, key.cluster_id, key.cache_id, None)
                dst_slot = key.batch_index
            if by_blocks:
                assert src_blocks is not None and dst_blocks is not None
                if remote.unit_nbytes != unit or max(dst_blocks) >= remote.num_units:
                    _invalid(api, "remote block size or block index does not match")
                runs = [
                    UnitRun(d * unit, s * unit, unit) for s, d in zip(src_blocks, dst_blocks, strict=True)
                ]
            else:
                if dst_slot >= remote.num_units or remote.unit_nbytes < unit:
                    _invalid(api, "the remote slot cannot hold the local slot")
                runs = [UnitRun(dst_slot * remote.unit_nbytes, config.src_batch_index * unit, unit)]
            self._check_remote_tensors(api, remote, TensorSelection(2 * dst_layer, 2, False, 2 * layer))
            with api_errors(api, timeout_code=LLMStatusCode.LLM_TIMEOUT):
                core.transfers.transfer_pinned(
                    key.cluster_id,
                    remote,
                    2 * dst_layer,
                    record,
                    2 * layer,
                    2,
                    runs,
                    write=True,
                    count_as=(GEN_V2, WRITE),
                )

        return LayerPush(config.dst_cluster_id, layers, push_layer)

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
                cluster_id,
                remote,
                dst_layer * n,
                local,
                src_layer * n,
                n,
                runs,
                write=True,
                count_as=(GEN_V2, WRITE),
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
