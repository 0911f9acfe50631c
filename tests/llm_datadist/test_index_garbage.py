"""Random bytes written into every region of an owner's index while a Decoder pulls from it, as a stray
writer of our uid could: the owner's calls never fail for it, the Decoder's transfers fail only with
documented codes meanwhile, the owner repairs its index, the Decoder's pulls are whole again afterwards
without relinking, and the owner frees everything it should."""

from __future__ import annotations

import multiprocessing as mp
import random
import time
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
    LLMException,
    LLMRole,
)
from llm_datadist.ext import tensor_views

OWNER_ID = 1
U64_MAX = 2**64 - 1  # req_id of a prefix key
DESC = CacheDesc(4, [1, 1024], DataType.DT_FLOAT16)
BLOCKS = CacheDesc(4, [8, 1024], DataType.DT_FLOAT16)


def _expected(cache_index: int, tensor: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng([cache_index, tensor]).integers(0, 256, nbytes, dtype=np.uint8)


def _puller(pipe: Connection, port: int) -> None:
    """Pull the prefix key and the blocks over and over until told to stop; then report outcomes, and on
    "verify" pull each once more and say whether the bytes are right."""
    datadist = LLMDataDist(LLMRole.DECODER, 2)
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = 1000
    datadist.init(config.generate_options())
    info = LLMClusterInfo()
    info.remote_cluster_id = OWNER_ID
    info.append_remote_ip_info("127.0.0.1", port)
    datadist.link_clusters([info], timeout=10_000)
    manager = datadist.kv_cache_manager
    cache = manager.allocate_cache(DESC)
    blocks = manager.allocate_blocks_cache(BLOCKS)

    def pull_both() -> bool:
        manager.pull_cache(CacheKey(OWNER_ID, U64_MAX, 0, 5), cache)
        manager.pull_blocks(BlocksCacheKey(OWNER_ID, 3), blocks, list(range(8)), list(range(8)))
        views = [v.view(np.uint8).reshape(-1) for v in tensor_views(cache)]
        block_views = [v.view(np.uint8).reshape(-1) for v in tensor_views(blocks)]
        return all(np.array_equal(v, _expected(1, t, v.nbytes)) for t, v in enumerate(views)) and all(
            np.array_equal(v, _expected(2, t, v.nbytes)) for t, v in enumerate(block_views)
        )

    outcomes: dict[str, int] = {}
    pipe.send("linked")
    while not pipe.poll(0):
        try:
            pull_both()
            outcomes["ok"] = outcomes.get("ok", 0) + 1
        except LLMException as exc:
            outcomes[exc.status_code.name] = outcomes.get(exc.status_code.name, 0) + 1
        except Exception as exc:
            outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
    assert pipe.recv() == "stop"
    pipe.send(outcomes)
    assert pipe.recv() == "verify"
    verdicts = []
    for _ in range(20):
        try:
            verdicts.append("right" if pull_both() else "wrong bytes")
        except LLMException as exc:
            verdicts.append(exc.status_code.name)
    pipe.send(verdicts)
    datadist.finalize()


def test_garbage_in_every_region_while_a_decoder_pulls(seed: int) -> None:
    rng = random.Random(seed)
    port = 29950 + seed % 40
    owner = LLMDataDist(LLMRole.PROMPT, OWNER_ID)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = f"127.0.0.1:{port}"
    owner.init(config.generate_options())
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    process = ctx.Process(target=_puller, args=(child, port), daemon=True)
    kept: list[Any] = []
    try:
        manager = owner.kv_cache_manager
        cache = manager.allocate_cache(DESC, [CacheKey(OWNER_ID, U64_MAX, 0, 5)])
        blocks = manager.allocate_blocks_cache(BLOCKS, BlocksCacheKey(OWNER_ID, 3))
        for index, target in ((1, cache), (2, blocks)):
            for t, view in enumerate(tensor_views(target)):
                raw = view.view(np.uint8).reshape(-1)
                raw[:] = _expected(index, t, raw.nbytes)
        process.start()
        child.close()
        assert pipe.poll(60) and pipe.recv() == "linked"
        index = owner._require_core().table.index
        regions = [
            (0, 4096),
            (4096, index._caches_offset),
            (index._caches_offset, index._names_offset),
            (index._names_offset, index._buckets_offset),
            (index._buckets_offset, index._addrs_offset),
        ]
        path = f"/dev/shm/{index.name[1:]}"
        deadline = time.monotonic() + 4.0
        serial = 100
        with open(path, "r+b") as raw_file:
            while time.monotonic() < deadline:
                start, end = rng.choice(regions)
                raw_file.seek(rng.randrange(start, min(end, start + 8192) - 8))
                raw_file.write(rng.randbytes(rng.choice((1, 4, 8))))
                raw_file.flush()
                # The owner's own calls go on whatever the file holds.
                serial += 1
                kept.append(manager.allocate_cache(DESC, [CacheKey(OWNER_ID, req_id=serial)]))
                if len(kept) > 4:
                    manager.remove_cache_key(CacheKey(OWNER_ID, req_id=serial - 4))
                    manager.deallocate_cache(kept.pop(0))
                time.sleep(0.02)
        pipe.send("stop")
        assert pipe.poll(60)
        outcomes = pipe.recv()
        print(f"pulls while the index was scribbled on: {outcomes}")
        assert set(outcomes) <= {"ok", "LLM_FAILED", "LLM_KV_CACHE_NOT_EXIST", "LLM_PARAM_INVALID"}, outcomes
        table = owner._require_core().table
        repaired = time.monotonic() + 10
        while table.index.audit():
            assert time.monotonic() < repaired, "the owner did not repair its index"
            time.sleep(0.05)
        pipe.send("verify")
        assert pipe.poll(60)
        verdicts = pipe.recv()
        assert verdicts == ["right"] * 20, verdicts  # whole again, on the same link
        process.join(30)
        for offset, cache_kept in enumerate(kept):
            manager.remove_cache_key(CacheKey(OWNER_ID, req_id=serial - len(kept) + 1 + offset))
            manager.deallocate_cache(cache_kept)
        kept.clear()
        manager.remove_cache_key(CacheKey(OWNER_ID, U64_MAX, 0, 5))
        manager.deallocate_cache(cache)
        manager.deallocate_cache(blocks)
        deadline = time.monotonic() + 10
        leases = owner._require_core().leases
        while leases.stats() != {"caches": 0, "keys": 0, "leases": 0, "pins": 0, "pool_used_nbytes": 0}:
            assert time.monotonic() < deadline, leases.stats()
            time.sleep(0.02)
        assert len(table.mirror._free_names) == table.index.names
    finally:
        kept.clear()
        if process.is_alive():
            process.kill()
            process.join(10)
        pipe.close()
        owner.finalize()
