"""The transfer arguments both API generations share: a cache key's check, a pull's layer kwargs turned
into tensor indices (`TensorSelection`), and `transfer_cache_async`'s checks, per-config push values and job.

Rules: checks raise the real exception types with the real messages (`LLMException` via `make_error`,
`TypeError`/`ValueError` from `_validate`) and run before anything is sent; v1 and v2 differ only in
what they pass in (key label, config type, timeout code). The byte runs of a push are `_puller.pushplan`'s.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from ._errors import api_errors
from ._keys import KEY_PREFIX, KEY_REQ, KeyId
from ._owner.records import CacheRecord
from ._puller.pushplan import TensorPush, blocks_push, slot_push, slot_to_blocks_push
from ._stats import GEN_V1, PUSH
from ._validate import check_index_lists, check_isinstance, check_range_step1, check_uint32, check_uint64
from .status import LLMStatusCode, make_error, raise_if_true
from .v2.llm_types import U64_MAX, CacheKey, CacheKeyByIdAndIndex, LayerSynchronizer, TransferConfig
from .v2.llm_utils import CacheTask, LayerPush, TransferJob

if TYPE_CHECKING:
    from ._core import Core


def _param_invalid(api: str, context: str) -> NoReturn:
    raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, context)


@dataclass(frozen=True)
class TensorSelection:
    """Which tensors a transfer moves: `count` tensors from `src_start` at the source to `dst_start` here.
    `whole` means no source range was given: the source must have exactly `count` tensors."""

    src_start: int
    count: int
    whole: bool
    dst_start: int


@dataclass(frozen=True)
class LayerArgs:
    """The layer kwargs of a pull, type-checked (reference §9.3)."""

    src_range: range | None
    dst_range: range | None
    per_layer: int
    per_layer_given: bool

    def select(self, api: str, num_tensors: int) -> TensorSelection:
        """Turn layer ranges into tensor indices of a local cache of `num_tensors` (LLM_PARAM_INVALID)."""
        per_layer, src_range, dst_range = self.per_layer, self.src_range, self.dst_range
        if src_range is None and dst_range is None and not self.per_layer_given:
            return _whole_cache(num_tensors)  # no layer kwargs: every tensor, the common case
        uses_layers = src_range is not None or dst_range is not None
        # The default of 2 only matters with layer ranges; a 1-tensor cache pulls whole without them.
        if (uses_layers or self.per_layer_given) and not 1 <= per_layer <= num_tensors:
            _param_invalid(api, f"tensor_num_per_layer must be in [1, {num_tensors}], got {per_layer}")
        if uses_layers and num_tensors % per_layer != 0:
            _param_invalid(
                api, f"{num_tensors} tensors are not a multiple of tensor_num_per_layer {per_layer}"
            )
        if dst_range is not None:
            dst_start, dst_count = dst_range.start * per_layer, len(dst_range) * per_layer
            if dst_count == 0 or dst_start + dst_count > num_tensors:
                _param_invalid(
                    api, f"dst_layer_range {dst_range} does not fit {num_tensors // per_layer} layers"
                )
        else:
            dst_start, dst_count = 0, num_tensors
        if src_range is None:
            return TensorSelection(0, dst_count, True, dst_start)
        src_start, src_count = src_range.start * per_layer, len(src_range) * per_layer
        if src_count != dst_count:
            _param_invalid(
                api, f"source selects {src_count} tensors, destination {dst_count} (layer ranges differ)"
            )
        return TensorSelection(src_start, src_count, False, dst_start)


@functools.lru_cache(maxsize=64)
def _whole_cache(num_tensors: int) -> TensorSelection:
    return TensorSelection(0, num_tensors, True, 0)


_NO_LAYER_ARGS = LayerArgs(None, None, 2, False)


def parse_layer_kwargs(kwargs: dict[str, Any]) -> LayerArgs:
    """Type-check a pull's layer kwargs as the real `layer_range_to_tensor_indices` does: each range a
    `range` (TypeError) of step 1 starting at >= 0 (PARAM_INVALID) whose first and last layer are uint32
    (ValueError). Other names are ignored, as the real `kwargs.get` ignores them."""
    if not kwargs:
        return _NO_LAYER_ARGS
    src_range = kwargs.get("src_layer_range")
    dst_range = kwargs.get("dst_layer_range")
    per_layer = kwargs.get("tensor_num_per_layer", 2)
    check_uint32("tensor_num_per_layer", per_layer)
    for name, layer_range in (("src_layer_range", src_range), ("dst_layer_range", dst_range)):
        check_range_step1(name, layer_range, allow_none=True)
        if layer_range:
            check_uint32(name, layer_range[0])
            check_uint32(name, layer_range[-1])
    return LayerArgs(src_range, dst_range, per_layer, "tensor_num_per_layer" in kwargs)


def check_cache_key(cache_key: CacheKey, *, prefix_label: str = "prefix id") -> None:
    """The real `check_cache_key`: exactly one of req_id and prefix_id is a valid id (not 2**64-1), else
    LLMException(LLM_PARAM_INVALID) with the real message (v2's says "prefix id:", v1's "prefix id")."""
    req_valid, prefix_valid = cache_key.req_id != U64_MAX, cache_key.prefix_id != U64_MAX
    req_id, prefix_id = cache_key.req_id, cache_key.prefix_id
    raise_if_true(
        not req_valid and not prefix_valid,
        "one of req id and prefix id should contain valid value:[0, 2**64-1), "
        f"req id:{req_id},{prefix_label}{prefix_id}.",
    )
    raise_if_true(
        req_valid and prefix_valid,
        "only one of req id and prefix id should contain valid value:[0, 2**64-1), "
        f"req id:{req_id}, {prefix_label}{prefix_id}.",
    )


def owner_key(api: str, key: CacheKey) -> KeyId | None:
    """The owner-side index of a key bound at allocation or registration: (kind, req_id or prefix_id,
    model_id), None for a padding key (neither set). A key that sets both is refused here, as every pull of
    it would be (LLM_PARAM_INVALID; for a prefix key, pass req_id=2**64-1 and prefix_id=P)."""
    req_valid, prefix_valid = key.req_id != U64_MAX, key.prefix_id != U64_MAX
    if req_valid and prefix_valid:
        _param_invalid(
            api,
            f"a key sets either req_id or prefix_id, not both (req_id {key.req_id}, prefix_id "
            f"{key.prefix_id}): no pull could name it; a prefix key has req_id=2**64-1",
        )
    if prefix_valid:
        return (KEY_PREFIX, key.prefix_id, key.model_id)
    if req_valid:
        return (KEY_REQ, key.req_id, key.model_id)
    return None


def key_fields(api: str, key: CacheKey | CacheKeyByIdAndIndex) -> tuple[int, int, int, int, int]:
    """(remote cluster id, key kind, key id, model id, batch index) of what a pull key names, as the
    owner knows it (`SourceRef`); LLM_PARAM_INVALID unless exactly one of req_id and prefix_id is set."""
    names = key._names  # what the key names, worked out as it was made
    if names is not None:
        return names
    if isinstance(key, CacheKeyByIdAndIndex):
        raise make_error(api, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache id {key.cache_id}")
    _param_invalid(api, "exactly one of req_id and prefix_id must be set in the cache key")


def check_transfer_args(
    api: str,
    layer_synchronizer: object,
    transfer_configs: object,
    config_type: type,
    src_block_indices: object,
    dst_block_indices: object,
    dst_block_memory_size: object,
) -> None:
    """The type checks transfer_cache_async makes in both modes (before anything else)."""
    check_isinstance("layer_synchronizer", layer_synchronizer, LayerSynchronizer)
    check_isinstance("transfer_configs", transfer_configs, (list, tuple))
    assert isinstance(transfer_configs, (list, tuple))
    for config in transfer_configs:
        check_isinstance("transfer_configs", config, config_type)
    check_index_lists(src_block_indices=src_block_indices, dst_block_indices=dst_block_indices)
    if dst_block_memory_size is not None:
        check_uint64("dst_block_memory_size", dst_block_memory_size)
    # An empty list is valid, as in the real library: the task pushes nothing and reports LLM_SUCCESS.


def start_transfer(
    api: str,
    core: Core,
    record: CacheRecord,
    synchronizer: LayerSynchronizer,
    pushes: list[LayerPush],
    dst_cluster_ids: list[int],
    timeout_code: LLMStatusCode,
    generation: int,
    operation: int = PUSH,
) -> CacheTask:
    """Start a transfer_cache_async job (both modes): every destination must be linked (either way) and
    not pulling from us; the source stays pinned and pulls from the destinations are busy until it ends."""
    clusters = set(dst_cluster_ids)
    linked = {peer.cluster_id for peer in core.server.peers()} | set(core.links.clusters())
    for cluster_id in sorted(clusters):
        if cluster_id not in linked:
            raise make_error(api, LLMStatusCode.LLM_NOT_YET_LINK, f"cluster {cluster_id} is not linked")
    with api_errors(api):
        pinned = core.pins.pin(record.cache_id)
    # Checked and marked under the gate the server grants pulls under and under the index lock pullers
    # pin under: no pull slips in between. A destination whose pull returned may still hold its lease for a
    # moment (a release is one way and the server handles it in turn): wait for it, within the transfer
    # timeout, outside the gate.
    deadline = time.monotonic() + core.sync_kv_timeout_s
    try:
        while True:
            with core.pull_gate, api_errors(api):
                busy = core.start_pushing(clusters)
            if busy is None:
                break
            if time.monotonic() >= deadline:
                raise make_error(api, LLMStatusCode.LLM_LINK_BUSY, f"cluster {busy} is pulling from us")
            core.leases.wait_for_end(min(0.05, max(deadline - time.monotonic(), 0.0)))
    except BaseException:
        core.pins.unpin(pinned)
        raise

    def finish() -> None:
        core.stop_pushing(clusters)
        core.pins.unpin(pinned)

    def failed(code: LLMStatusCode) -> None:
        core.stats.failed(generation, operation, code)

    job = TransferJob(
        synchronizer,
        pushes,
        record.num_tensors // 2,
        on_exit=finish,
        on_failed=failed,
        hold_s=core.sync_kv_timeout_s,
        raised_code=timeout_code if generation != GEN_V1 else None,
    )
    job.start()
    return CacheTask(job, dst_cluster_ids, timeout_code=timeout_code)


@dataclass(frozen=True)
class _TransferPlan:
    """How one TransferConfig moves each of its layers: K and V of layer l (tensors 2l and 2l + 1) land at
    their two `dst_addrs` as `tensor` says."""

    dst_cluster_id: int
    layers: range
    dst_addrs: tuple[int, ...]
    tensor: TensorPush

    def layer_push(self, core: Core, record: CacheRecord, generation: int) -> LayerPush:
        """The job's part for this config: layer l pushes spans 2(l - first layer) and the next, of one
        lease of every layer's destination (`Transfers.leased_push`)."""
        spans = []
        for i, layer in enumerate(self.layers):
            addrs = self.dst_addrs[2 * i : 2 * i + 2]
            spans.extend(self.tensor.spans(record, (2 * layer, 2 * layer + 1), addrs))
        pushes = core.transfers.leased_push(self.dst_cluster_id, record, spans, generation)
        start = self.layers.start

        def push_layer(layer: int) -> None:
            pushes.push(2 * (layer - start), 2)

        return LayerPush(self.dst_cluster_id, self.layers, push_layer, pushes.end, pushes.pause)


def plan_transfer(
    api: str,
    record: CacheRecord,
    config: TransferConfig,
    src_block_indices: list[int] | None,
    dst_block_indices: list[int] | None,
    dst_block_memory_size: int | None,
) -> _TransferPlan:
    """Validate one config against the source cache (reference §9.6) and plan its per-layer copies."""
    if record.registered:
        _param_invalid(
            api, "a TransferConfig push reads a pool cache (a registered one needs remote cache access)"
        )
    if record.num_tensors % 2:
        _param_invalid(
            api, f"the source cache must hold K, V per layer (an even tensor count), not {record.num_tensors}"
        )
    num_layers = record.num_tensors // 2
    layers = config.src_layer_range if config.src_layer_range is not None else range(num_layers)
    if not layers or layers.stop > num_layers:
        _param_invalid(api, f"src_layer_range {layers} is not within the cache's {num_layers} layers")
    if len(config.dst_addrs) != 2 * len(layers):
        _param_invalid(
            api, f"{len(config.dst_addrs)} dst_addrs for {len(layers)} layers (2 per layer expected)"
        )
    if src_block_indices is not None and (
        dst_block_indices is None or len(src_block_indices) != len(dst_block_indices)
    ):
        _param_invalid(api, "src_block_indices need dst_block_indices of the same length")
    block_nbytes = record.slot_nbytes  # a slot, or a block of a paged cache
    if src_block_indices and not record.is_blocks:
        _param_invalid(api, "a continuous source takes no src_block_indices")
    # As the real `llm_utils`: the source is pushed as blocks only when src_block_indices are given; a
    # blocks cache without them takes the slot path, its blocks being its slots (block 0 by default).
    if src_block_indices:
        if config.src_batch_index != 0:
            _param_invalid(api, "src_batch_index must be 0 for a blocks source")
        if dst_block_indices is None:
            _param_invalid(api, "a blocks source pushes blocks to blocks: give src and dst block indices")
        if max(src_block_indices) >= record.batch_size:
            _param_invalid(api, f"src_block_indices must be non-empty and below {record.batch_size}")
        dst_block_nbytes = dst_block_memory_size or block_nbytes
        if dst_block_nbytes < block_nbytes:
            _param_invalid(
                api, f"dst_block_memory_size {dst_block_nbytes} is smaller than a block ({block_nbytes})"
            )
        tensor = blocks_push(src_block_indices, dst_block_indices, block_nbytes, dst_block_nbytes)
        return _TransferPlan(config.dst_cluster_id, layers, tuple(config.dst_addrs), tensor)
    if config.src_batch_index >= record.batch_size:
        _param_invalid(api, f"src_batch_index {config.src_batch_index} >= batch size {record.batch_size}")
    slot_offset = config.src_batch_index * block_nbytes
    if dst_block_indices is None:
        if dst_block_memory_size:
            _param_invalid(api, "dst_block_memory_size must be None or 0 for a continuous destination")
        tensor = slot_push(slot_offset, block_nbytes)
        return _TransferPlan(config.dst_cluster_id, layers, tuple(config.dst_addrs), tensor)
    if not dst_block_memory_size:
        _param_invalid(api, "continuous to blocks needs dst_block_memory_size")
    if not dst_block_indices:
        _param_invalid(api, "dst_block_indices must not be empty")
    piece = dst_block_memory_size
    if len(dst_block_indices) * piece < block_nbytes:
        _param_invalid(
            api, f"{len(dst_block_indices)} blocks of {piece} bytes cannot hold a {block_nbytes}-byte slot"
        )
    tensor = slot_to_blocks_push(slot_offset, block_nbytes, dst_block_indices, piece)
    return _TransferPlan(config.dst_cluster_id, layers, tuple(config.dst_addrs), tensor)
