"""Extensions outside the real API (not in `__all__`): numpy views of a cache's tensors, memory for the user
to register that peers copy at memory speed, a rank table for links on one host, and this process's
transfer statistics (as plain data, and for Prometheus).

Rules: a view aliases the cache's shared memory; it is valid until the cache is freed (after that the
memory may be handed to another cache). bf16 tensors come back as `ml_dtypes.bfloat16` when ml_dtypes is
installed, as raw `uint16` otherwise.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _library as library
from ._prometheus import Collector
from ._rank_table import default_rank_table
from ._shm.errors import SharedMemoryExhausted
from ._stats import Snapshot, own_readings, snapshot
from .data_type import numpy_dtype
from .status import LLMStatusCode, make_error
from .v2.cache import Cache, KvCache
from .v2.llm_datadist import LLMDataDist

if TYPE_CHECKING:
    from ._owner.records import CacheRecord


def tensor_views(cache: KvCache | Cache) -> list[np.ndarray[Any, Any]]:
    """One numpy array per tensor of `cache` (a v1 `KvCache` or a v2 `Cache`, allocated or registered),
    shaped like `cache.cache_desc.shape`, sharing its memory."""
    api = "tensor_views"
    record = _live_record(cache)
    if record is None:
        raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, f"cache {cache.cache_id} is not a live cache")
    desc = cache.cache_desc
    dtype = numpy_dtype(desc.data_type)
    shape = tuple(desc.shape)
    if record.registered:  # the caller's own memory, at its addresses
        return [
            np.ctypeslib.as_array((ctypes.c_ubyte * record.tensor_nbytes).from_address(addr))
            .view(dtype)
            .reshape(shape)
            for addr in record.addrs
        ]
    segment = record.pool_block.segment
    views = []
    for t in range(record.num_tensors):
        start = record.tensor_offset(t)
        raw = segment.array[start : start + record.tensor_nbytes]
        views.append(raw.view(dtype).reshape(shape))
    return views


def shared_arrays(
    count: int, shape: int | tuple[int, ...], dtype: Any = np.float16
) -> list[np.ndarray[Any, Any]]:
    """`count` zeroed arrays of `shape` and `dtype` (numpy's), for registering where torch or numpy would
    allocate a KV cache and register it (`register_cache`, `register_blocks_cache`). Torch tensors over
    them: `torch.from_numpy(array)` (bf16: a uint16 array, then `.view(torch.bfloat16)`).

    They lie in one segment of POSIX shared memory of this process, so a peer on this host maps it and
    copies from it (or, pushing, into it) with memcpy, where private memory is read through
    process_vm_readv (docs/dataplane.md, "Registered memory"). Register all the tensors of one cache from
    one call: a registration whose tensors lie in one such segment is published by its name. The memory is
    freed, and its name removed, once every array over it is gone and no registration holds it; a process
    forked after this call shares it with its parent (writes show on both sides). Every page is backed now:
    a full /dev/shm raises LLMException `LLM_OUT_OF_MEMORY` here, never a SIGBUS later. TypeError /
    ValueError for a count, shape or dtype that is not one (or holds no byte)."""
    api = "shared_arrays"
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"count must be an int, got {type(count).__name__}")
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
        raise TypeError(f"shape must be ints, got {shape!r}")
    if count <= 0 or any(d <= 0 for d in dims):
        raise ValueError(f"count and every dimension must be positive, got {count} x {shape!r}")
    kind = np.dtype(dtype)
    nbytes = kind.itemsize * int(np.prod(dims, dtype=object))
    if not nbytes:
        raise ValueError(f"an array of {shape!r} {kind} holds no byte")
    try:
        raws = library.allocate(count, nbytes)
    except SharedMemoryExhausted as exc:
        raise make_error(api, LLMStatusCode.LLM_OUT_OF_MEMORY, str(exc)) from exc
    return [raw.view(kind).reshape(dims) for raw in raws]


def _live_record(cache: KvCache | Cache) -> CacheRecord | None:
    """The record of `cache` in the instance it came from, if it is still that cache."""
    if isinstance(cache, KvCache):
        manager = getattr(cache, "_kv_cache_manager", None)
        core = getattr(manager, "_core", None)
        return core.table.get(cache.cache_id) if core is not None and cache._is_valid else None
    if not isinstance(cache, Cache):
        return None
    # A v2 Cache names no manager: the process's initialised instance, and the same memory.
    instance = LLMDataDist.llm_engine_instance
    core = instance._core if instance is not None else None
    record = core.table.get(cache.cache_id) if core is not None else None
    if record is None or record.tensor_addrs() != list(cache.tensor_addrs):
        return None
    return record


def local_rank_table(cluster_rank_info: dict[int, int]) -> str:
    """A rank table (JSON text) for `LLMDataDist.link(comm_name, cluster_rank_info, rank_table)` between
    processes of this host.

    `cluster_rank_info` maps each member's cluster id to its rank, as `link` takes it. The result is an
    HCCL rank table of version "1.0" with one server, `"127.0.0.1"`, and one device per rank from 0 to the
    highest rank (`device_id` = `rank_id` = the rank, as strings; no `device_ip`, which one host does not
    need)::

        {"version": "1.0", "server_count": "1", "status": "completed",
         "server_list": [{"server_id": "127.0.0.1",
                          "device": [{"device_id": "0", "rank_id": "0"},
                                     {"device_id": "1", "rank_id": "1"}]}]}

    On Ascend the same argument is the cluster's real rank table (server ips, device ips); both are parsed
    and validated the same way here. TypeError / ValueError for a dict that is not cluster id -> rank, is
    empty, or has a rank of 4096 or more.
    """
    return default_rank_table(cluster_rank_info)


def stats() -> Snapshot:
    """What this process's instances moved so far, how fast, what failed, and what they hold now, summed
    over its live instances (docs/metrics.md): `Snapshot.counters`, `Snapshot.gauges`; `later.since(earlier)`
    for what happened in between, `totals()` per operation. Empty figures with counting switched off
    (`LLM_DATADIST_STATS=0`)."""
    return snapshot()


def register_prometheus(registry: Any = None) -> Any:
    """Serve this process's figures through the application's own Prometheus endpoint: registers a
    collector (returned, for `registry.unregister`) that reads this process's live instances at every
    scrape, into `registry` (default: `prometheus_client.REGISTRY`). The metrics are those of
    `llm-datadist exporter` (docs/metrics.md). Needs the `prometheus` extra (`prometheus_client`)."""
    from prometheus_client import REGISTRY

    collector = Collector(own_readings)
    (REGISTRY if registry is None else registry).register(collector)
    return collector
