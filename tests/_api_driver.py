"""A Decoder process that calls every public method a puller has, of one API generation, against one
owner, and reports how each call ended: ("ok",) or (exception type name, status code or None, message).
The test decides what the owner's state is meanwhile (its index lock held by a stopped process, its index
corrupt). Driven over a pipe: "run" makes every call once and reports; "stop" ends it."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    TransferWithCacheKeyConfig,
)

CALL_TIMEOUT_S = 60.0


class _Go(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


def _calls(datadist: LLMDataDist, v2: bool, owner_id: int, port: int) -> list[tuple[str, Callable[[], Any]]]:
    """(name, call) for every public method of a puller, a fresh link first; the owner has req key 7 (two
    tensors of [1, 32] fp16), cache id 1 holding it, blocks model id 3 (two tensors of [4, 32]), all
    remote accessible."""
    desc = CacheDesc(2, [1, 32], DataType.DT_FLOAT16)
    blocks_desc = CacheDesc(2, [4, 32], DataType.DT_FLOAT16)
    info = LLMClusterInfo()
    info.remote_cluster_id = owner_id
    info.append_remote_ip_info("127.0.0.1", port)
    if v2:
        info.append_local_ip_info("127.0.0.1", 0)
    relink: list[tuple[str, Callable[[], Any]]] = [
        ("unlink_clusters", lambda: datadist.unlink_clusters([info])),
        ("link_clusters", lambda: datadist.link_clusters([info], timeout=5000)),
    ]
    if v2:
        m: Any = datadist.cache_manager
        cache = m.allocate_cache(desc)
        blocks = m.allocate_blocks_cache(blocks_desc)
        return [
            *relink,
            # With remote access a pull names a cache by id (a key of its own is refused, TypeError).
            ("pull_cache by key", lambda: m.pull_cache(CacheKey(owner_id, req_id=7), cache)),
            ("pull_cache by id", lambda: m.pull_cache(CacheKeyByIdAndIndex(owner_id, 1, 0), cache)),
            ("pull_blocks", lambda: m.pull_blocks(BlocksCacheKey(owner_id, 3), blocks, [0, 1], [1, 0])),
            ("push_cache", lambda: m.push_cache(CacheKeyByIdAndIndex(owner_id, 1, 0), cache)),
            ("push_blocks", lambda: m.push_blocks(BlocksCacheKey(owner_id, 3), blocks, [0], [2])),
            (
                "transfer_cache_async",
                lambda: m.transfer_cache_async(
                    blocks,
                    _Go(),
                    [TransferWithCacheKeyConfig(BlocksCacheKey(owner_id, 3), range(1), range(1))],
                    [0],
                    [3],
                ).synchronize(int(CALL_TIMEOUT_S * 1000)),
            ),
            ("copy_cache", lambda: m.copy_cache(cache, cache)),
            ("allocate and deallocate", lambda: m.deallocate_cache(m.allocate_cache(desc))),
        ]
    k: Any = datadist.kv_cache_manager
    cache = k.allocate_cache(desc)
    blocks = k.allocate_blocks_cache(blocks_desc)
    return [
        *relink,
        ("pull_cache by key", lambda: k.pull_cache(CacheKey(owner_id, req_id=7), cache)),
        ("pull_cache by id", lambda: k.pull_cache(CacheKeyByIdAndIndex(owner_id, 1, 0), cache)),
        ("pull_blocks", lambda: k.pull_blocks(BlocksCacheKey(owner_id, 3), blocks, [0, 1], [1, 0])),
        ("check_link_status", lambda: datadist.check_link_status(owner_id)),
        ("copy_cache", lambda: k.copy_cache(cache, cache)),
        ("allocate and deallocate", lambda: k.deallocate_cache(k.allocate_cache(desc))),
    ]


def _main(pipe: Connection, v2: bool, owner_id: int, port: int) -> None:
    datadist = LLMDataDist(LLMRole.DECODER, 2)
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = 500
    if v2:
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = True
        config.mem_pool_cfg = '{"memory_size": 16777216}'
    datadist.init(config.generate_options())
    calls = _calls(datadist, v2, owner_id, port)
    info = LLMClusterInfo()
    info.remote_cluster_id = owner_id
    info.append_remote_ip_info("127.0.0.1", port)
    if v2:
        info.append_local_ip_info("127.0.0.1", 0)
    pipe.send(("ready", [int(code) for code in datadist.link_clusters([info], timeout=5000)[1]]))
    while pipe.poll(CALL_TIMEOUT_S):
        if pipe.recv() != "run":
            break
        results: list[tuple[str, tuple[Any, ...]]] = []
        for name, call in calls:
            try:
                call()
                results.append((name, ("ok",)))
            except LLMException as exc:
                results.append((name, ("LLMException", int(exc.status_code), str(exc))))
            except BaseException as exc:
                results.append((name, (type(exc).__name__, None, traceback.format_exc())))
        pipe.send(("results", results))
    datadist.finalize()


class ApiDriver:
    def __init__(self, v2: bool, owner_id: int, port: int) -> None:
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.process = ctx.Process(target=_main, args=(child, v2, owner_id, port), daemon=True)
        self.process.start()
        child.close()
        assert self.pipe.poll(CALL_TIMEOUT_S), "the Decoder did not start"
        what, self.link_codes = self.pipe.recv()
        assert what == "ready"

    def run(self) -> list[tuple[str, tuple[Any, ...]]]:
        self.pipe.send("run")
        assert self.pipe.poll(CALL_TIMEOUT_S * 4), "the Decoder did not report"
        what, results = self.pipe.recv()
        assert what == "results"
        return list(results)

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.pipe.send("stop")
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self.pipe.close()
