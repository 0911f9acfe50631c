"""Our engine's two sides as every bench of it sets them up: the owner, a spawned process that allocates,
fills and frees the caches a benchmark pulls from (`Owner` drives it over a pipe), and the measuring side,
this process (`measurer`, `link`).

Rules: the owner answers each command with ("ok", value) or ("error", text) (`proc.Child`); every cache it
fills holds `fill_value` in each row, so a row pulled from or into the wrong place shows.
"""

from __future__ import annotations

import functools
import json
import os
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
)
from llm_datadist._tools.netns import in_netns
from llm_datadist._tools.patterns import unit_bytes
from llm_datadist.ext import shared_arrays, tensor_views

from . import peers
from .proc import Child

OWNER, MEASURER = 1, 2
IP = "127.0.0.1"
U64_MAX = 2**64 - 1
PREFIX = 7  # the owner binds every benchmark cache to this prefix key: prefix keys are never consumed


def fill_value(tensor_index: int, row: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The byte the owner's "fill" writes into row `row` (a batch slot or a block) of tensor `tensor_index`:
    different for neighbouring rows and tensors, so a row pulled from or into the wrong place shows."""
    return unit_bytes(tensor_index * 31 + row)


def fixed_pool(pool_nbytes: int) -> dict[str, str]:
    """The options of a fixed v1 pool of `pool_nbytes` (one segment, as a serving deployment configures it;
    without them the pool grows by new segments, which a puller maps on first use); none for 0."""
    if not pool_nbytes:
        return {}
    return {"ge.flowGraphMemMaxSize": str(pool_nbytes), "llm.MemoryUtilization": "1.0"}


def private_arrays(count: int, nbytes: int) -> list[np.ndarray[Any, Any]]:
    """`count` arrays of `nbytes` of plain private numpy memory, every page touched (ones, as the owner's
    registered memory always held)."""
    return [np.ones(nbytes // 2, dtype=np.float16) for _ in range(count)]


def library_arrays(count: int, nbytes: int) -> list[np.ndarray[Any, Any]]:
    """`count` arrays of `nbytes` from the library's allocator (`ext.shared_arrays`: one segment, every page
    backed), ones of float16 as `private_arrays`."""
    arrays = shared_arrays(count, nbytes // 2, np.float16)
    for array in arrays:
        array.fill(1)  # as private_arrays: ones
    return arrays


def _owner(
    pipe: Connection, mode: str, port: int, timeout_ms: int, ip: str = IP, pool_nbytes: int = 0
) -> None:
    """Owns the caches; answers commands until told to stop. `pool_nbytes`: a fixed v1 pool of that size."""
    datadist = LLMDataDist(LLMRole.PROMPT, OWNER)
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = timeout_ms
    config.listen_ip_info = f"{ip}:{port}"
    options = dict(config.generate_options())
    if mode == "v2":
        options.update({"llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "1"})
    else:
        options.update(fixed_pool(pool_nbytes))
    keep: list[Any] = []
    requests: list[tuple[Any, range]] = []  # the "requests" cache and its req ids, at most one
    try:
        datadist.init(options)
        pipe.send(("ok", os.getpid()))
        while True:
            if not pipe.poll(3600):
                break
            command, args = pipe.recv()
            if command == "stop":
                break
            if command == "alloc":  # v1: a continuous cache bound to the prefix key
                num_tensors, shape = args
                desc = CacheDesc(num_tensors, list(shape), DataType.DT_FLOAT16)
                cache = datadist.kv_cache_manager.allocate_cache(desc, [CacheKey(OWNER, U64_MAX, 0, PREFIX)])
                keep.append(cache)
                pipe.send(("ok", cache.cache_id))
            elif command == "alloc_blocks":
                num_tensors, shape, model_id = args
                desc = CacheDesc(num_tensors, list(shape), DataType.DT_FLOAT16)
                cache = datadist.kv_cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(OWNER, model_id))
                keep.append(cache)
                pipe.send(("ok", cache.cache_id))
            elif command == "fill":  # every allocated cache: each row of tensor t holds fill_value(t, row)
                for cache in keep:
                    for t, view in enumerate(tensor_views(cache)):
                        rows = view.view(np.uint8).reshape(view.shape[0], -1)
                        rows[:] = fill_value(t, np.arange(rows.shape[0]))[:, None]
                pipe.send(("ok", None))
            elif command == "free":
                manager = datadist.kv_cache_manager
                manager.remove_cache_key(CacheKey(OWNER, U64_MAX, 0, PREFIX))
                for cache in keep:
                    manager.deallocate_cache(cache)
                keep.clear()
                pipe.send(("ok", None))
            elif command == "requests":
                pipe.send(("ok", _requests(datadist.kv_cache_manager, requests, *args)))
            elif command in ("register_blocks", "register_paged"):  # v2: memory this process owns
                # register_paged: (memory "private" | "library") as the 4th argument, and block b of tensor
                # t holds fill_value(t, b); register_blocks: private memory of ones.
                num_tensors, shape, model_id, *memory = args
                nbytes = 2 * int(np.prod(shape))
                make = library_arrays if memory == ["library"] else private_arrays
                arrays = make(num_tensors, nbytes)
                if command == "register_paged":
                    for t, array in enumerate(arrays):
                        rows = array.view(np.uint8).reshape(shape[0], -1)
                        rows[:] = fill_value(t, np.arange(shape[0]))[:, None]
                desc = CacheDesc(num_tensors, list(shape), DataType.DT_FLOAT16)
                registered = datadist.cache_manager.register_blocks_cache(
                    desc, [a.ctypes.data for a in arrays], BlocksCacheKey(OWNER, model_id)
                )
                keep.append((registered, arrays))
                pipe.send(("ok", registered.cache_id))
            else:
                pipe.send(("error", f"unknown command {command}"))
    except Exception:
        pipe.send(("error", traceback.format_exc()))
    finally:
        keep.clear()
        requests.clear()
        datadist.finalize()


def _requests(
    manager: Any,
    requests: list[tuple[Any, range]],
    tensors: int,
    slot_nbytes: int,
    req_ids: range,
    fill: bool,
) -> int:
    """A serving Prompt's next batch of requests: the previous batch's keys removed (those its puller did
    not consume) and its cache freed, then one cache of `len(req_ids)` batch slots of `slot_nbytes` per
    tensor, slot i bound to `CacheKey(OWNER, req_ids[i])`; with `fill`, row i of tensor t holds
    `fill_value(t, i)`. In a fixed pool the new cache reuses the old one's (touched) memory. Its cache id."""
    for cache, old_ids in requests:
        for req_id in old_ids:
            manager.remove_cache_key(CacheKey(OWNER, req_id))
        manager.deallocate_cache(cache)
    requests.clear()
    desc = CacheDesc(tensors, [len(req_ids), slot_nbytes // 2], DataType.DT_FLOAT16)
    cache = manager.allocate_cache(desc, [CacheKey(OWNER, req_id) for req_id in req_ids])
    requests.append((cache, req_ids))
    if fill:
        for t, view in enumerate(tensor_views(cache)):
            rows = view.view(np.uint8).reshape(view.shape[0], -1)
            rows[:] = fill_value(t, np.arange(rows.shape[0]))[:, None]
    return int(cache.cache_id)


class Owner(Child):
    """The spawned process that owns the caches a benchmark pulls from (`_owner`), listening on `ip`; with
    `netns`, it enters that network namespace first, with `env` added to its environment; `quiet` sends its
    stdout and stderr to /dev/null (its engine's log lines; failures come through the pipe); `pool_nbytes`
    gives a v1 owner a fixed pool of that size."""

    def __init__(
        self,
        mode: str,
        port: int,
        timeout_ms: int,
        *,
        ip: str = IP,
        netns: str = "",
        env: dict[str, str] | None = None,
        quiet: bool = False,
        pool_nbytes: int = 0,
    ) -> None:
        target: Callable[..., None] = functools.partial(peers.quietly, _owner) if quiet else _owner
        target = in_netns(netns, target, env) if netns else target
        super().__init__(target, mode, port, timeout_ms, ip, pool_nbytes)
        self.port = port
        self.reply(600)

    def call(self, command: str, args: Any = None) -> Any:
        self.pipe.send((command, args))
        return self.reply(600)


def measurer(mode: str, timeout_ms: int, pool_nbytes: int = 0) -> Any:
    """The measuring side, in this process: a v1 Decoder (with a fixed pool of `pool_nbytes`, if given) or
    a v2 instance with remote access and a pool."""
    datadist = LLMDataDist(LLMRole.DECODER, MEASURER)
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = timeout_ms
    options = dict(config.generate_options())
    if mode != "v2":
        options.update(fixed_pool(pool_nbytes))
    else:
        options.update(
            {
                "llm.EnableCacheManager": "1",
                "llm.EnableRemoteCacheAccessible": "1",
                "llm.MemPoolConfig": json.dumps({"memory_size": 1 << 30, "page_shift": 16}),
            }
        )
    datadist.init(options)
    return datadist


def link(datadist: Any, port: int, ip: str = IP, local_ip: str = IP) -> None:
    info = LLMClusterInfo()
    info.remote_cluster_id = OWNER
    info.append_local_ip_info(local_ip, 0)
    info.append_remote_ip_info(ip, port)
    ret, codes = datadist.link_clusters([info], timeout=10000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"link_clusters failed: {codes}")
