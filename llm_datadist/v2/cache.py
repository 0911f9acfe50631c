"""The cache handles user code holds: `KvCache` (v1) and `Cache` (v2).

Rules: a handle only describes a cache (id, descriptor, real tensor addresses in this process); the
manager that made it owns the memory. Addresses stay valid until the cache is freed; afterwards the handle
is invalid and its address lists are cleared, as in the real library.
"""

from __future__ import annotations

from typing import Any

from .._validate import check_isinstance, check_items
from ..status import LLMStatusCode, make_error
from .llm_types import CacheDesc, Placement


def _check_addr_list(api: str, name: str, addrs: object, num_tensors: int) -> list[int]:
    check_isinstance(name, addrs, (list, tuple))
    assert isinstance(addrs, (list, tuple))
    for addr in addrs:
        if not isinstance(addr, int) or isinstance(addr, bool):
            raise TypeError(f"`{name}` only support [int] items, but got {type(addr).__name__}")
        if not 0 < addr < 2**64:
            raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, f"address {addr} is not a valid address")
    if len(addrs) != num_tensors:
        raise make_error(
            api, LLMStatusCode.LLM_PARAM_INVALID, f"{len(addrs)} addresses for {num_tensors} tensors"
        )
    return list(addrs)


class KvCache:
    """A v1 cache: `per_device_tensor_addrs[d][t]` is tensor t on device d (one device here unless the
    process was initialised with several `device_id`s).

    Made by `KvCacheManager.allocate_cache`; users do not construct it. Like the real class, dropping the
    last reference to a still-valid cache deallocates it while its manager is initialised.
    """

    def __init__(
        self,
        cache_id: int,
        cache_desc: CacheDesc,
        per_device_tensor_addrs: list[list[int]],
        kv_cache_manager: Any = None,
    ) -> None:
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._per_device_tensor_addrs = per_device_tensor_addrs
        self._kv_cache_manager = kv_cache_manager
        self._valid = kv_cache_manager is not None

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        return self._cache_desc

    @property
    def per_device_tensor_addrs(self) -> list[list[int]]:
        return self._per_device_tensor_addrs

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int] | list[list[int]]) -> KvCache:
        """A HOST cache over memory the caller owns (used by `swap_blocks`); cache_id is -1."""
        api = "create_cpu_cache"
        # The real order: descriptor, placement, a non-empty list, then each item (a list of num_tensors
        # ints, or an int), all of one kind. Tuples count as lists here.
        check_isinstance("cache_desc", cache_desc, CacheDesc)
        if cache_desc.placement != Placement.HOST:
            raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, "cache_desc placement must be HOST")
        check_isinstance("addrs", addrs, (list, tuple))
        assert isinstance(addrs, (list, tuple))
        if not addrs:
            raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, "addrs length should be bigger than zero.")
        nested = isinstance(addrs[0], (list, tuple))
        name = "the internal element of addrs"
        for item in addrs:
            check_isinstance(name, item, (list, tuple, int))
            if isinstance(item, (list, tuple)):
                check_items(name, item, int)
                if len(item) != cache_desc.num_tensors:
                    raise make_error(
                        api,
                        LLMStatusCode.LLM_PARAM_INVALID,
                        f"cache_desc num_tensors:{cache_desc.num_tensors} should be equal to size of "
                        f"the internal element of addrs:{len(item)}",
                    )
            if isinstance(item, (list, tuple)) != nested:
                raise make_error(
                    api,
                    LLMStatusCode.LLM_PARAM_INVALID,
                    "the type of the internal element of addrs should be consistent.",
                )
        if nested:
            per_device = [_check_addr_list(api, "addrs", item, cache_desc.num_tensors) for item in addrs]
        else:
            per_device = [_check_addr_list(api, "addrs", addrs, cache_desc.num_tensors)]
        return cls(-1, cache_desc, per_device, None)

    def _invalidate(self) -> None:
        self._valid = False
        self._per_device_tensor_addrs = []

    @property
    def _is_valid(self) -> bool:
        return self._valid

    def __repr__(self) -> str:
        return f"KvCache(cache_id={self._cache_id}, valid={self._valid})"

    def __del__(self) -> None:
        manager = getattr(self, "_kv_cache_manager", None)
        if not getattr(self, "_valid", False) or manager is None:
            return
        try:
            if manager.is_initialized():
                # Not `deallocate_cache`: a finalizer may neither wait for the owner's index lock nor fail.
                manager._deallocate_later(self)
        except Exception:
            pass


class Cache:
    """A v2 cache: `tensor_addrs[t]` is the address of tensor t. No automatic free on `__del__`."""

    def __init__(
        self,
        cache_id: int,
        cache_desc: CacheDesc,
        tensor_addrs: list[int],
        is_blocks_cache: bool = False,
    ) -> None:
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._tensor_addrs = tensor_addrs
        self._is_blocks_cache = is_blocks_cache

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        return self._cache_desc

    @property
    def tensor_addrs(self) -> list[int]:
        return self._tensor_addrs

    @property
    def is_blocks_cache(self) -> bool:
        return self._is_blocks_cache

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int]) -> Cache:
        """A HOST blocks cache over memory the caller owns; cache_id is -1 and `is_blocks_cache` is True."""
        api = "create_cpu_cache"
        # The real order: descriptor, the address list (type, then items), placement, then the count.
        check_isinstance("cache_desc", cache_desc, CacheDesc)
        check_isinstance("addrs", addrs, (list, tuple), inner=int)
        if cache_desc.placement != Placement.HOST:
            raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, "cache_desc placement must be HOST")
        assert isinstance(addrs, (list, tuple))
        if not addrs:
            raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, "addrs must not be empty")
        return cls(-1, cache_desc, _check_addr_list(api, "addrs", addrs, cache_desc.num_tensors), True)

    def __repr__(self) -> str:
        return f"Cache(cache_id={self._cache_id}, is_blocks_cache={self._is_blocks_cache})"
