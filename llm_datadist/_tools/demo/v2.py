"""The demo's v2 sides (cache_manager), shaped like vllm-ascend's LLMDataDistCMgrConnector: both sides
register numpy memory they own, link two-sided through a rank table, and the Decoder pulls a block table
scattered over the Prompt's blocks into other blocks of its own, checking every byte.

Rules: as v1's: spawned processes, public API only; started together (a two-sided link needs both).
"""

from __future__ import annotations

import json
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from llm_datadist import BlocksCacheKey, CacheDesc, DataType, LLMDataDist, LLMRole, RegisterMemStatus
from llm_datadist._rank_table import default_rank_table

from ..output import library_log_to_stderr
from .common import (
    BLOCK_TOKENS,
    DECODER_CLUSTER,
    PAGED_MODEL_ID,
    PAGED_SLOT,
    PROMPT_CLUSTER,
    Rows,
    Setup,
    Shape,
    block_order,
    expected_slot,
    options,
    step,
)

# A run's communicator is this and the parent's pid (`names.run_name`): a comm name is host-wide for a
# user, and demos of one user may run at the same time.
COMM_PREFIX = "pd_comm_demo"
V2_MEMBERS = {PROMPT_CLUSTER: 0, DECODER_CLUSTER: 1}


def _cache_manager_options(timeout_ms: int) -> dict[str, str]:
    """Cache-manager mode as vllm-ascend's LLMDataDistCMgrConnector set it up."""
    settings = options(None, timeout_ms)
    settings.update(
        {"llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "1", "llm.LinkTotalTime": "60"}
    )
    return settings


def _registered_blocks(shape: Shape) -> list[np.ndarray[Any, Any]]:
    """Memory this process owns (as a framework's KV tensors would be), one array per tensor."""
    return [
        np.zeros(shape.pool_blocks * shape.block_nbytes, dtype=np.uint8) for _ in range(shape.num_tensors)
    ]


def _rank_table(prompt_ip: str, decoder_ip: str) -> str:
    """The rank table of the two-sided link: one server on one host; across hosts, one server per side
    (its ip tells each member where the other is)."""
    if prompt_ip == decoder_ip:
        return default_rank_table(V2_MEMBERS)
    servers = [
        {
            "server_id": ip,
            "device": [{"device_id": "0", "device_ip": ip, "rank_id": str(V2_MEMBERS[cluster])}],
        }
        for cluster, ip in ((PROMPT_CLUSTER, prompt_ip), (DECODER_CLUSTER, decoder_ip))
    ]
    return json.dumps({"version": "1.0", "server_count": "2", "server_list": servers, "status": "completed"})


def _two_sided_link(datadist: Any, deadline_s: float, setup: Setup) -> int:
    table = _rank_table(setup.prompt_ip, setup.decoder_ip)
    comm_id: int = datadist.link(setup.comm_name, dict(V2_MEMBERS), table)
    deadline = time.monotonic() + deadline_s
    while (status := datadist.query_register_mem_status(comm_id)) != RegisterMemStatus.OK:
        if status == RegisterMemStatus.FAILED or time.monotonic() > deadline:
            raise RuntimeError(f"two-sided link failed: {status}")
        time.sleep(0.01)
    return comm_id


def prompt(pipe: Connection, peer: Connection, shape: Shape, setup: Setup) -> None:
    library_log_to_stderr()
    datadist = LLMDataDist(LLMRole.PROMPT, PROMPT_CLUSTER)
    try:
        step(pipe, "init")
        datadist.init(_cache_manager_options(setup.timeout_ms))
        manager = datadist.cache_manager
        arrays = _registered_blocks(shape)
        for t, array in enumerate(arrays):
            step(pipe, f"writing the bytes to check into its blocks, tensor {t + 1} of {len(arrays)}")
            array[:] = expected_slot(t, PAGED_SLOT, array.nbytes)
        desc = CacheDesc(
            shape.num_tensors,
            [shape.pool_blocks, BLOCK_TOKENS, shape.kv_heads, shape.head_dim],
            DataType.DT_FLOAT16,
        )
        cache = manager.register_blocks_cache(
            desc, [a.ctypes.data for a in arrays], BlocksCacheKey(PROMPT_CLUSTER, PAGED_MODEL_ID)
        )
        step(pipe, f"linking two-sided (communicator {setup.comm_name!r})")
        comm_id = _two_sided_link(datadist, 120, setup)
        pipe.send(("ready", None))
        pipe.poll(3600)
        pipe.recv()
        datadist.unlink(comm_id)
        manager.unregister_cache(cache.cache_id)
        pipe.send(("done", None))
    except Exception:
        pipe.send(("error", traceback.format_exc()))
    finally:
        datadist.finalize()


def decoder(pipe: Connection, peer: Connection, shape: Shape, setup: Setup) -> None:
    library_log_to_stderr()
    datadist = LLMDataDist(LLMRole.DECODER, DECODER_CLUSTER)
    rows = Rows(pipe)
    mismatches = 0
    try:
        rows.step("init")
        datadist.init(_cache_manager_options(setup.timeout_ms))
        manager = datadist.cache_manager
        arrays = _registered_blocks(shape)
        desc = CacheDesc(
            shape.num_tensors,
            [shape.pool_blocks, BLOCK_TOKENS, shape.kv_heads, shape.head_dim],
            DataType.DT_FLOAT16,
        )
        cache = manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays])
        rows.step(f"linking two-sided (communicator {setup.comm_name!r})")
        comm_id = _two_sided_link(datadist, 120, setup)
        prompt_blocks, decoder_blocks = block_order(shape, 1), block_order(shape, 2)
        nbytes = shape.table_blocks * shape.block_nbytes * shape.num_tensors
        key = BlocksCacheKey(PROMPT_CLUSTER, PAGED_MODEL_ID)
        for name in ("v2 pull_blocks, registered memory, first", "v2 pull_blocks, registered memory"):
            for array in arrays:
                array[:] = 0
            rows.step(name)
            started = time.perf_counter()
            manager.pull_blocks(key, cache, prompt_blocks, decoder_blocks)
            seconds = time.perf_counter() - started
            rows.append({"name": name, "nbytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9})
            for t, array in enumerate(arrays):
                rows.step(f"checking every block pulled, tensor {t + 1} of {len(arrays)}")
                blocks = array.reshape(shape.pool_blocks, -1)
                want = expected_slot(t, PAGED_SLOT, array.nbytes).reshape(shape.pool_blocks, -1)
                mismatches += int(np.count_nonzero(blocks[decoder_blocks] != want[prompt_blocks]))
                untouched = sorted(set(range(shape.pool_blocks)) - set(decoder_blocks))
                mismatches += int(np.count_nonzero(blocks[untouched]))
        datadist.unlink(comm_id)
        manager.unregister_cache(cache.cache_id)
        pipe.send(("done", {"rows": list(rows), "mismatches": mismatches}))
    except Exception:
        pipe.send(("error", traceback.format_exc()))
    finally:
        datadist.finalize()
