"""The v2 data classes (real path: `llm_datadist.v2.llm_types`): cache descriptions, keys, transfer configs.

They are values: each validates its arguments on construction (and in setters) with the real exception
types, and holds nothing else. Keys compare by identity (the real classes define no `__eq__`/`__hash__`).
Layout facts the engine relies on: dim 0 of a CacheDesc shape is always the batch / block dimension, and a
slot (or block) is `size // shape[0]` bytes (`slot_nbytes`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Any

from llm_datadist._keys import KEY_BLOCKS, KEY_CACHE_ID, KEY_PREFIX, KEY_REQ
from llm_datadist._validate import (
    U64_MAX,
    check_int32,
    check_int64,
    check_isinstance,
    check_layer_range,
    check_list_int64,
    check_list_of,
    check_list_uint64,
    check_uint32,
    check_uint64,
)
from llm_datadist.data_type import DataType, dtype_itemsize
from llm_datadist.status import raise_if_false, raise_if_true

if TYPE_CHECKING:
    from .cache import Cache, KvCache
    from .llm_utils import CacheTask

__all__ = [
    "U64_MAX",
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheTask",
    "KvCache",
    "LayerSynchronizer",
    "MemInfo",
    "Memtype",
    "Placement",
    "RegisterMemStatus",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "slot_nbytes",
]


class Placement(IntEnum):
    """Where a cache lives: HOST=0, DEVICE=1; `str()` gives "Placement.HOST" (IntEnum as in current hixl),
    `format()` with a spec the number (f"{placement:d}" is "0")."""

    HOST = 0
    DEVICE = 1

    def __str__(self) -> str:
        return f"{self.__class__.__name__}.{self.name}"

    def __format__(self, format_spec: str) -> str:
        # As on Python 3.11+ (status.LLMStatusCode says why): "" gives str(), any other spec the number.
        return int.__format__(self, format_spec)


class RegisterMemStatus(Enum):
    """What `query_register_mem_status` reports: OK=0, PREPARING=1, FAILED=2 (a plain Enum)."""

    OK = 0
    PREPARING = 1
    FAILED = 2


class Memtype(Enum):
    """Memory kind of a `MemInfo`: MEM_TYPE_DEVICE=0, MEM_TYPE_HOST=1 (a plain Enum)."""

    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class MemInfo:
    """`MemInfo(mem_type: Memtype, addr: int, size: int)`, the argument of `remap_registered_memory`.

    TypeError for wrong types; the value checks (addr != 0, size > 0) belong to the API that takes it.
    """

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        check_isinstance("mem_type", mem_type, Memtype)
        check_isinstance("addr", addr, int)
        check_isinstance("size", size, int)
        self._mem_type = mem_type
        self._addr = addr
        self._size = size

    @property
    def mem_type(self) -> Memtype:
        return self._mem_type

    @property
    def addr(self) -> int:
        return self._addr

    @property
    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"MemInfo(mem_type={self._mem_type}, addr={self._addr}, size={self._size})"


class CacheDesc:
    """Describes one tensor of a cache; the cache holds `num_tensors` tensors of that shape and dtype.

    `CacheDesc(num_tensors, shape, data_type, placement=Placement.DEVICE, batch_dim_index=0,
    seq_len_dim_index=-1, kv_tensor_format=None)`. Checks: `num_tensors` uint32; `shape` a list/tuple of
    int64; `data_type` a DataType; `placement` a Placement; `seq_len_dim_index` int32 (TypeError/ValueError);
    `batch_dim_index` in [0, len(shape)) and `seq_len_dim_index` -1 or in range (LLMException PARAM_INVALID).
    Unlike the real class, None is not accepted for `data_type` or `placement`.

    `shape` returns the object passed in (not a copy); `update_dim` mutates it (so a tuple shape cannot be
    updated: TypeError). `batch_size` is `shape[batch_dim_index]` fixed at construction. `size` is bytes per
    tensor, product(shape) * itemsize, computed on first use; a negative dim or DT_STRING raises LLMException.
    The engine ignores `batch_dim_index` and always treats dim 0 as batch/blocks.
    """

    def __init__(
        self,
        num_tensors: int,
        shape: list[int] | tuple[int, ...],
        data_type: DataType,
        placement: Placement = Placement.DEVICE,
        batch_dim_index: int = 0,
        seq_len_dim_index: int = -1,
        kv_tensor_format: str | None = None,
    ) -> None:
        check_uint32("num_tensors", num_tensors)
        check_list_of("shape", shape, int)
        check_isinstance("data_type", data_type, DataType)
        check_isinstance("placement", placement, Placement)
        check_isinstance("batch_dim_index", batch_dim_index, int)
        check_int32("seq_len_dim_index", seq_len_dim_index)
        check_isinstance("kv_tensor_format", kv_tensor_format, str, allow_none=True)
        raise_if_false(
            0 <= batch_dim_index < len(shape),
            "batch_dim_index {0} out of range, [0, {1})",
            batch_dim_index,
            len(shape),
        )
        raise_if_false(
            seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape),
            "seq_len_dim_index {0} is invalid, should be -1 or in range [0, {1})",
            seq_len_dim_index,
            len(shape),
        )
        check_list_int64("shape", shape)
        self._num_tensors = num_tensors
        self._shape = shape
        self._data_type = data_type
        self._placement = placement
        self._batch_dim = batch_dim_index
        self._batch_size = shape[batch_dim_index]
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format
        self._size = -1  # computed lazily; -1 means "not yet"
        # Set to True by allocate_blocks_cache / register_blocks_cache on the caller's object (a real quirk).
        self._is_blocks = False

    @property
    def num_tensors(self) -> int:
        return self._num_tensors

    @property
    def shape(self) -> list[int] | tuple[int, ...]:
        """The shape object given to the constructor (not a copy)."""
        return self._shape

    @property
    def data_type(self) -> DataType:
        return self._data_type

    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def batch_dim(self) -> int:
        """The `batch_dim_index` given (the real class has no `batch_dim_index` getter)."""
        return self._batch_dim

    @property
    def batch_size(self) -> int:
        """`shape[batch_dim_index]` as it was at construction (`update_dim` does not change it)."""
        return self._batch_size

    @property
    def seq_len_dim_index(self) -> int:
        return self._seq_len_dim_index

    @property
    def kv_tensor_format(self) -> str | None:
        return self._kv_tensor_format

    @property
    def size(self) -> int:
        """Bytes per tensor: product(shape) * itemsize (an empty shape is a scalar: one item)."""
        if self._size == -1:
            raise_if_true(
                any(dim < 0 for dim in self._shape),
                "Failed to calc tensor size, shape = {0}, data_type = {1}",
                self._shape,
                self._data_type,
            )
            self._size = math.prod(self._shape) * dtype_itemsize(self._data_type)
        return self._size

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        """Set `shape[dim_index] = dim_value` on the shape object itself and forget the cached size.

        IndexError for a bad index and TypeError for a tuple shape (Python's own errors, as in the real
        class); `dim_value` must be an int64 here.
        """
        check_int64("dim_value", dim_value)
        self._shape[dim_index] = dim_value  # type: ignore[index]
        self._size = -1

    def __repr__(self) -> str:
        # The missing space before kv_tensor_format is the real repr's.
        return (
            f"CacheDesc(num_tensors={self._num_tensors}, shape={self._shape}, data_type={self._data_type}, "
            f"placement={self._placement}, batch_dim_index={self._batch_dim}, "
            f"seq_len_dim_index={self._seq_len_dim_index},kv_tensor_format={self._kv_tensor_format})"
        )


def slot_nbytes(desc: CacheDesc) -> int:
    """Bytes of one batch slot (non-PA cache) or one block (PA cache) of each tensor: `size // shape[0]`.

    The engine always uses dim 0, whatever `batch_dim_index` says. A scalar shape or `shape[0] == 0` raises
    LLMException(PARAM_INVALID). Not in the real package (which computes it natively).
    """
    raise_if_false(len(desc.shape) > 0, "scalar is not supported, shape = {0}", desc.shape)
    raise_if_false(desc.shape[0] > 0, "dim 0 should be > 0, shape = {0}", desc.shape)
    return desc.size // desc.shape[0]


_CACHE_KEY_PARAMS = ("prompt_cluster_id", "cluster_id", "req_id", "model_id", "prefix_id")
_BLOCKS_KEY_PARAMS = ("prompt_cluster_id", "cluster_id", "model_id")


class CacheKey:
    """Index of one batch slot of a non-PA cache.

    `CacheKey(cluster_id, req_id, model_id=0, prefix_id=2**64-1)` positionally, or by keyword with
    `prompt_cluster_id` or `cluster_id`, `req_id`, `model_id`, `prefix_id`; at most 4 arguments. Too many
    arguments, an unknown keyword, or a missing cluster id / req_id raise LLMException(PARAM_INVALID); every
    value must be a uint64 (TypeError / ValueError). As in the real class a positional value overrides the
    same keyword, and `cluster_id` wins over `prompt_cluster_id` when both are given.

    Owner side: the cluster id is ignored; the key is (req_id, model_id), or (prefix_id, model_id) when
    prefix_id != 2**64-1. Puller side: the cluster id names the remote. No value `__eq__`/`__hash__`.
    """

    def __init__(self, *args: int, **kwargs: int) -> None:
        raise_if_false(len(args) + len(kwargs) <= 4, "Param num is over limit")
        for name, value in zip(("cluster_id", "req_id", "model_id", "prefix_id"), args, strict=False):
            kwargs[name] = value
        raise_if_false(
            "prompt_cluster_id" in kwargs or "cluster_id" in kwargs,
            "Param prompt_cluster_id or cluster_id is required",
        )
        raise_if_false("req_id" in kwargs, "Param req_id is required")
        for key in kwargs:
            raise_if_false(key in _CACHE_KEY_PARAMS, "Unsupported param:{}", key)
        self._cluster_id = kwargs["cluster_id"] if "cluster_id" in kwargs else kwargs["prompt_cluster_id"]
        self._req_id = kwargs["req_id"]
        self._model_id = kwargs.get("model_id", 0)
        self._prefix_id = kwargs.get("prefix_id", U64_MAX)
        check_uint64("cluster_id", self._cluster_id)
        check_uint64("req_id", self._req_id)
        check_uint64("model_id", self._model_id)
        check_uint64("prefix_id", self._prefix_id)
        # What a pull of it names, as `_transfer.key_fields` gives it (None: the full checks refuse it).
        req, prefix = self._req_id, self._prefix_id
        kind, key_id = (KEY_REQ, req) if prefix == U64_MAX else (KEY_PREFIX, prefix)
        names = (self._cluster_id, kind, key_id, self._model_id, 0)
        self._names = None if (req == U64_MAX) == (prefix == U64_MAX) else names

    @property
    def prompt_cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def req_id(self) -> int:
        return self._req_id

    @property
    def model_id(self) -> int:
        return self._model_id

    @property
    def prefix_id(self) -> int:
        return self._prefix_id

    def __repr__(self) -> str:
        return (
            f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
            f"prefix_id={self._prefix_id}, model_id={self._model_id})"
        )


class CacheKeyByIdAndIndex:
    """Addresses a remote cache by the remote side's `cache_id` and a batch slot, bypassing keys.

    `CacheKeyByIdAndIndex(cluster_id, cache_id, batch_index=0)`: uint64, int64, uint32 (TypeError /
    ValueError). Also the destination key of `push_cache` and of `TransferWithCacheKeyConfig`.
    """

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        check_uint64("cluster_id", cluster_id)
        check_int64("cache_id", cache_id)
        check_uint32("batch_index", batch_index)
        self._cluster_id = cluster_id
        self._cache_id = cache_id
        self._batch_index = batch_index
        self._req_id = U64_MAX  # the real class carries it for packing: "no req key"
        # What a pull of it names, as `_transfer.key_fields` gives it (None: the full checks refuse it).
        self._names = None if cache_id < 0 else (cluster_id, KEY_CACHE_ID, cache_id, 0, batch_index)

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def batch_index(self) -> int:
        return self._batch_index

    def __repr__(self) -> str:
        return (
            f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, cache_id={self._cache_id}, "
            f"batch_index={self._batch_index})"
        )


class BlocksCacheKey:
    """Index of a PA (blocks) cache: `BlocksCacheKey(cluster_id, model_id=0)`, or keywords
    `prompt_cluster_id` / `cluster_id` and `model_id`; at most 2 arguments (LLMException otherwise, as for
    an unknown keyword or a missing cluster id).

    The only value check is "is an int" (TypeError), as in the real class: no range check. The repr names
    the cluster id with the keyword you used (`cluster_id` when positional). Owner side: only `model_id`
    indexes the blocks cache. No value `__eq__`/`__hash__`.
    """

    def __init__(self, *args: int, **kwargs: int) -> None:
        raise_if_false(len(args) + len(kwargs) <= 2, "Param num is over limit")
        for name, value in zip(("cluster_id", "model_id"), args, strict=False):
            kwargs[name] = value
        raise_if_false(
            "prompt_cluster_id" in kwargs or "cluster_id" in kwargs,
            "Param prompt_cluster_id or cluster_id is required",
        )
        for key in kwargs:
            raise_if_false(key in _BLOCKS_KEY_PARAMS, "Unsupported param:{}", key)
        self._cluster_id_key = "cluster_id" if "cluster_id" in kwargs else "prompt_cluster_id"
        self._cluster_id = kwargs[self._cluster_id_key]
        self._model_id = kwargs.get("model_id", 0)
        check_isinstance("cluster_id", self._cluster_id, int, extra_fmt="The first param ")
        check_isinstance("model_id", self._model_id, int, extra_fmt="The second param ")
        self._names = (self._cluster_id, KEY_BLOCKS, 0, self._model_id, 0)  # what a pull of it names

    @property
    def prompt_cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def model_id(self) -> int:
        return self._model_id

    def __repr__(self) -> str:
        return f"BlocksCacheKey({self._cluster_id_key}={self._cluster_id}, model_id={self._model_id})"


class LayerSynchronizer(ABC):
    """Implemented by the user for `transfer_cache_async`: tells when a layer's KV has been written."""

    @abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """Block until layer `layer_index` of the forward pass has written its KV, then return True;
        False aborts the transfer. `timeout_in_millis` is always None (the real library passes no timeout)."""


class TransferConfig:
    """Push target as raw remote addresses, for `transfer_cache_async` without remote-cache access.

    `TransferConfig(dst_cluster_id, dst_addrs, src_layer_range=None, src_batch_index=0)`: `dst_addrs` holds
    2 addresses (K, V) per transferred layer, in layer order. Checks, also applied by the setters:
    `dst_cluster_id` uint64; `dst_addrs` a list/tuple of uint64; `src_layer_range` None (all layers) or a
    range with step 1 and 0 <= start < stop (LLMException); `src_batch_index` uint32.
    `dst_layer_range` is a plain attribute, initially None, as in the real class.
    """

    def __init__(
        self,
        dst_cluster_id: int,
        dst_addrs: list[int] | tuple[int, ...],
        src_layer_range: range | None = None,
        src_batch_index: int = 0,
    ) -> None:
        self._check_dst_cluster_id(dst_cluster_id)
        self._check_dst_addrs(dst_addrs)
        check_layer_range("src_layer_range", src_layer_range)
        self._check_src_batch_index(src_batch_index)
        self._dst_cluster_id = dst_cluster_id
        self._dst_addrs = dst_addrs
        self._src_layer_range = src_layer_range
        self._src_batch_index = src_batch_index
        self.dst_layer_range: range | None = None

    @staticmethod
    def _check_dst_cluster_id(dst_cluster_id: int) -> None:
        check_uint64("dst_cluster_id", dst_cluster_id)

    @staticmethod
    def _check_dst_addrs(dst_addrs: Sequence[int]) -> None:
        check_list_of("dst_addrs", dst_addrs, int)
        check_list_uint64("dst_addrs", dst_addrs)

    @staticmethod
    def _check_src_batch_index(src_batch_index: int) -> None:
        check_uint32("src_batch_index", src_batch_index)

    @property
    def dst_cluster_id(self) -> int:
        return self._dst_cluster_id

    @dst_cluster_id.setter
    def dst_cluster_id(self, dst_cluster_id: int) -> None:
        self._check_dst_cluster_id(dst_cluster_id)
        self._dst_cluster_id = dst_cluster_id

    @property
    def dst_addrs(self) -> list[int] | tuple[int, ...]:
        return self._dst_addrs

    @dst_addrs.setter
    def dst_addrs(self, dst_addrs: list[int] | tuple[int, ...]) -> None:
        self._check_dst_addrs(dst_addrs)
        self._dst_addrs = dst_addrs

    @property
    def src_layer_range(self) -> range | None:
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, src_layer_range: range | None) -> None:
        check_layer_range("src_layer_range", src_layer_range)
        self._src_layer_range = src_layer_range

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, src_batch_index: int) -> None:
        self._check_src_batch_index(src_batch_index)
        self._src_batch_index = src_batch_index

    def __repr__(self) -> str:
        return (
            f"TransferConfig(dst_cluster_id={self._dst_cluster_id}, dst_addrs={self._dst_addrs}, "
            f"src_layer_range={self._src_layer_range}, src_batch_index={self._src_batch_index})"
        )


class TransferWithCacheKeyConfig:
    """Push target as a remote key, for `transfer_cache_async` with remote-cache access.

    `TransferWithCacheKeyConfig(cache_key, src_layer_range, dst_layer_range, src_batch_index=0)`. The ranges
    default to None in the signature but are required: None raises TypeError. Each must have step 1 and
    0 <= start < stop, and they must have equal lengths (LLMException(PARAM_INVALID)). With a BlocksCacheKey,
    `src_batch_index` must be 0 (LLMException). The plain attribute `dst_cluster_id` is the key's cluster id.

    Differences from the real class: its length check compares `src.stop - src.start` with
    `dst.stop - src.start` (a typo, in effect requiring equal stops); here the lengths are compared. Setters
    reject None, and the `cache_key` setter also updates `dst_cluster_id` (the real one leaves it stale).
    Setters do not re-check the two ranges against each other; `transfer_cache_async` does.
    """

    def __init__(
        self,
        cache_key: BlocksCacheKey | CacheKeyByIdAndIndex,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        src_batch_index: int = 0,
    ) -> None:
        check_isinstance("cache_key", cache_key, [BlocksCacheKey, CacheKeyByIdAndIndex])
        check_layer_range("src_layer_range", src_layer_range, allow_none=False)
        check_layer_range("dst_layer_range", dst_layer_range, allow_none=False)
        assert src_layer_range is not None and dst_layer_range is not None
        raise_if_false(
            len(src_layer_range) == len(dst_layer_range),
            "src_layer_range size should be equal to dst_layer_range size, {0} vs {1}",
            src_layer_range,
            dst_layer_range,
        )
        check_uint32("src_batch_index", src_batch_index)
        raise_if_true(
            isinstance(cache_key, BlocksCacheKey) and src_batch_index != 0,
            "src_batch_index should be 0 when cache_key is BlocksCacheKey.",
        )
        self._cache_key = cache_key
        self._src_layer_range: range = src_layer_range
        self._dst_layer_range: range = dst_layer_range
        self._src_batch_index = src_batch_index
        self.dst_cluster_id: int = cache_key.cluster_id

    @property
    def cache_key(self) -> BlocksCacheKey | CacheKeyByIdAndIndex:
        return self._cache_key

    @cache_key.setter
    def cache_key(self, cache_key: BlocksCacheKey | CacheKeyByIdAndIndex) -> None:
        check_isinstance("cache_key", cache_key, [BlocksCacheKey, CacheKeyByIdAndIndex])
        self._cache_key = cache_key
        self.dst_cluster_id = cache_key.cluster_id

    @property
    def src_layer_range(self) -> range:
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, src_layer_range: range) -> None:
        check_layer_range("src_layer_range", src_layer_range, allow_none=False)
        self._src_layer_range = src_layer_range

    @property
    def dst_layer_range(self) -> range:
        return self._dst_layer_range

    @dst_layer_range.setter
    def dst_layer_range(self, dst_layer_range: range) -> None:
        check_layer_range("dst_layer_range", dst_layer_range, allow_none=False)
        self._dst_layer_range = dst_layer_range

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, src_batch_index: int) -> None:
        # The real setter checks the BlocksCacheKey rule before the uint32 range; kept in that order.
        raise_if_true(
            isinstance(self._cache_key, BlocksCacheKey) and src_batch_index != 0,
            "src_batch_index should be 0 when cache_key is BlocksCacheKey.",
        )
        check_uint32("src_batch_index", src_batch_index)
        self._src_batch_index = src_batch_index

    def __repr__(self) -> str:
        return (
            f"TransferWithCacheKeyConfig(cache_key={self._cache_key}, "
            f"src_layer_range={self._src_layer_range}, dst_layer_range={self._dst_layer_range}, "
            f"src_batch_index={self._src_batch_index})"
        )


def __getattr__(name: str) -> Any:
    # The real module defines Cache, KvCache and CacheTask here; ours live in `v2.cache` and `v2.llm_utils`,
    # which import this module, so they are resolved on first use (PEP 562) instead of imported above.
    if name in ("Cache", "KvCache"):
        from . import cache

        return getattr(cache, name)
    if name == "CacheTask":
        from .llm_utils import CacheTask

        return CacheTask
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
