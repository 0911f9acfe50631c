"""`llm-datadist demo`: a Prompt and a Decoder process move real-sized KV cache and check every byte.

Rules: both sides are spawned processes using only the public API (plus `ext.tensor_views` to fill and
check memory); the parent only orchestrates over pipes, prints the table and reaps. The memcpy baseline is
measured in the Decoder process in the same run, between buffers that were already faulted in.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .netns import Hosts, NamespacePair, hosts_unavailable, in_netns, sigterm_as_exit

BLOCK_TOKENS = 16  # tokens per paged block, as vLLM's default
PAGED_MODEL_ID = 0
PAGED_SLOT = 100  # the pattern "slot" of the Prompt's paged pool
PUSHED_SLOT = 3  # the Prompt slot pushed layer by layer
PROMPT_CLUSTER = 1
DECODER_CLUSTER = 2
IP = "127.0.0.1"
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
U64_MAX = 2**64 - 1


@dataclass(frozen=True)
class Shape:
    layers: int
    tokens: int
    kv_heads: int
    head_dim: int

    @property
    def num_tensors(self) -> int:
        return 2 * self.layers

    @property
    def slot_nbytes(self) -> int:
        return self.tokens * self.kv_heads * self.head_dim * 2  # fp16

    @property
    def table_blocks(self) -> int:
        """Blocks of BLOCK_TOKENS tokens that hold one request in the paged runs."""
        return max(1, self.tokens // BLOCK_TOKENS)

    @property
    def pool_blocks(self) -> int:
        """Blocks in each side's paged pool: twice the table, so the table scatters over it."""
        return 2 * self.table_blocks

    @property
    def block_nbytes(self) -> int:
        return BLOCK_TOKENS * self.kv_heads * self.head_dim * 2


def block_order(shape: Shape, which: int) -> list[int]:
    """A block table scattered over the pool (the same on both sides for a given `which`)."""
    rng = np.random.default_rng([shape.pool_blocks, which])
    return [int(b) for b in rng.permutation(shape.pool_blocks)[: shape.table_blocks]]


def expected_slot(tensor_index: int, slot: int, nbytes: int) -> np.ndarray:
    """The bytes the Prompt writes into one (tensor, slot): cheap to regenerate, different everywhere."""
    words = nbytes // 8
    out = np.empty(nbytes, dtype=np.uint8)
    values = np.arange(words, dtype=np.uint64) * _GOLDEN + np.uint64(
        tensor_index * 1_000_003 + slot * 7_919 + 1
    )
    out[: words * 8] = values.view(np.uint8)
    out[words * 8 :] = (tensor_index + slot) & 0xFF
    return out


def _options(listen: str | None, timeout_ms: int) -> dict[str, str]:
    from llm_datadist import LLMConfig

    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = timeout_ms
    if listen:
        config.listen_ip_info = listen
    return dict(config.generate_options())


class _AllLayersReady:
    """A LayerSynchronizer whose forward pass is already done: every layer is ready at once."""

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


def _prompt(
    pipe: Connection,
    peer: Connection,
    shape: Shape,
    port: int,
    timeout_ms: int,
    prompt_ip: str = IP,
    decoder_ip: str = IP,
) -> None:
    from llm_datadist import (
        BlocksCacheKey,
        CacheDesc,
        CacheKey,
        DataType,
        LayerSynchronizer,
        LLMDataDist,
        LLMRole,
        LLMStatusCode,
        TransferConfig,
    )
    from llm_datadist.ext import tensor_views

    class Ready(_AllLayersReady, LayerSynchronizer):
        pass

    datadist = LLMDataDist(LLMRole.PROMPT, PROMPT_CLUSTER)
    try:
        datadist.init(_options(f"{prompt_ip}:{port}", timeout_ms))
        manager = datadist.kv_cache_manager
        desc = CacheDesc(
            shape.num_tensors, [4, shape.tokens, shape.kv_heads, shape.head_dim], DataType.DT_FLOAT16
        )
        # Slots 0-2 hold one request each; slot 3 is bound to a prefix key, used to warm the link up.
        keys = [CacheKey(PROMPT_CLUSTER, req) for req in (1, 2, 3)]
        keys.append(CacheKey(PROMPT_CLUSTER, U64_MAX, 0, 9))
        cache = manager.allocate_cache(desc, keys)
        for t, view in enumerate(tensor_views(cache)):
            raw = view.view(np.uint8).reshape(4, -1)
            for slot in range(4):
                raw[slot] = expected_slot(t, slot, shape.slot_nbytes)
        paged_desc = CacheDesc(
            shape.num_tensors,
            [shape.pool_blocks, BLOCK_TOKENS, shape.kv_heads, shape.head_dim],
            DataType.DT_FLOAT16,
        )
        paged = manager.allocate_blocks_cache(paged_desc, BlocksCacheKey(PROMPT_CLUSTER, PAGED_MODEL_ID))
        for t, view in enumerate(tensor_views(paged)):
            view.view(np.uint8).reshape(-1)[:] = expected_slot(
                t, PAGED_SLOT, shape.block_nbytes * shape.pool_blocks
            )
        pipe.send(("ready", None))
        # Serve push requests from the Decoder until the parent says stop.
        while True:
            if peer.poll(0.05):
                dst_cluster, addrs = peer.recv()
                started = time.perf_counter()
                task = manager.transfer_cache_async(
                    cache, Ready(), [TransferConfig(dst_cluster, addrs, None, PUSHED_SLOT)]
                )
                code = task.synchronize(timeout_ms)
                peer.send((int(code), time.perf_counter() - started))
                if code != LLMStatusCode.LLM_SUCCESS:
                    raise RuntimeError(f"transfer_cache_async failed: {code}")
            if pipe.poll(0.05):
                pipe.recv()
                break
        for key in keys:
            manager.remove_cache_key(key)
        manager.deallocate_cache(cache)
        manager.deallocate_cache(paged)
        pipe.send(("done", None))
    except Exception:
        pipe.send(("error", traceback.format_exc()))
    finally:
        datadist.finalize()


def _copy_bandwidth(nbytes: int, threads: int, repeats: int = 3, *, shared: bool = False) -> float:
    """Best-of-N GB/s of numpy.copyto between two already-faulted buffers, split over `threads`.

    Private numpy buffers get transparent huge pages where the kernel allows them; `shared=True` measures
    between two prefaulted shared-memory segments instead (4 KiB pages on tmpfs), which bounds a pull.
    """
    from llm_datadist._shm.segment import Segment

    segments: list[Segment] = []
    if shared:
        segments = [Segment.create(nbytes), Segment.create(nbytes)]
        src, dst = segments[0].array, segments[1].array
        src[:] = 7
    else:
        src = np.full(nbytes, 7, dtype=np.uint8)
        dst = np.zeros(nbytes, dtype=np.uint8)
    bounds = np.linspace(0, nbytes, threads + 1, dtype=np.int64)

    def part(i: int, src: np.ndarray, dst: np.ndarray) -> None:
        np.copyto(dst[bounds[i] : bounds[i + 1]], src[bounds[i] : bounds[i + 1]])

    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        workers = [threading.Thread(target=part, args=(i, src, dst)) for i in range(1, threads)]
        for worker in workers:
            worker.start()
        part(0, src, dst)
        for worker in workers:
            worker.join()
        best = min(best, time.perf_counter() - started)
    del src, dst
    for segment in segments:
        segment.close()
    return nbytes / best / 1e9


def _decoder(
    pipe: Connection,
    peer: Connection,
    shape: Shape,
    port: int,
    timeout_ms: int,
    prompt_ip: str = IP,
    decoder_ip: str = IP,
) -> None:
    from llm_datadist import (
        BlocksCacheKey,
        CacheDesc,
        CacheKey,
        DataType,
        LLMClusterInfo,
        LLMDataDist,
        LLMException,
        LLMRole,
        LLMStatusCode,
    )
    from llm_datadist.ext import tensor_views

    datadist = LLMDataDist(LLMRole.DECODER, DECODER_CLUSTER)
    rows = _Rows(pipe)
    mismatches = 0
    try:
        datadist.init(_options(None, timeout_ms))
        manager = datadist.kv_cache_manager
        slot = shape.slot_nbytes
        total = slot * shape.num_tensors
        rows.append({"name": "numpy.copyto, 1 thread", "nbytes": total, "gbps": _copy_bandwidth(total, 1)})
        rows.append({"name": "numpy.copyto, 2 threads", "nbytes": total, "gbps": _copy_bandwidth(total, 2)})
        rows.append(
            {
                "name": "numpy.copyto, 2 threads, shm to shm",
                "nbytes": total,
                "gbps": _copy_bandwidth(total, 2, shared=True),
            }
        )

        info = LLMClusterInfo()
        info.remote_cluster_id = PROMPT_CLUSTER
        info.append_local_ip_info(decoder_ip, 0)
        info.append_remote_ip_info(prompt_ip, port)
        ret, codes = datadist.link_clusters([info], timeout=10000)
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link_clusters failed: {ret} {codes}")
        dst = manager.allocate_cache(
            CacheDesc(
                shape.num_tensors, [1, shape.tokens, shape.kv_heads, shape.head_dim], DataType.DT_FLOAT16
            )
        )
        views = [view.view(np.uint8).reshape(-1) for view in tensor_views(dst)]

        def clear() -> None:
            for raw in views:
                raw[:] = 0

        def check(region: tuple[int, int], src_slot: int, src_start: int, tensors: range) -> int:
            bad = 0
            start, nbytes = region
            for t in tensors:
                want = expected_slot(t, src_slot, slot)[src_start : src_start + nbytes]
                bad += int(np.count_nonzero(views[t][start : start + nbytes] != want))
            return bad

        def timed(name: str, nbytes: int, action: Any) -> None:
            started = time.perf_counter()
            action()
            elapsed = time.perf_counter() - started
            rows.append({"name": name, "nbytes": nbytes, "seconds": elapsed, "gbps": nbytes / elapsed / 1e9})

        prefix = CacheKey(PROMPT_CLUSTER, U64_MAX, 0, 9)
        timed(
            "warm-up: 4 KiB per tensor "
            + ("(maps the segment)" if prompt_ip == IP else "(finds the segment's address)"),
            4096 * shape.num_tensors,
            lambda: manager.pull_cache(prefix, dst, size=4096),
        )
        mismatches += check((0, 4096), 3, 0, range(shape.num_tensors))

        clear()
        timed("pull_cache whole request", total, lambda: manager.pull_cache(CacheKey(PROMPT_CLUSTER, 1), dst))
        mismatches += check((0, slot), 0, 0, range(shape.num_tensors))

        clear()

        def by_layer() -> None:
            for layer in range(shape.layers):
                manager.pull_cache(
                    CacheKey(PROMPT_CLUSTER, 2),
                    dst,
                    src_layer_range=range(layer, layer + 1),
                    dst_layer_range=range(layer, layer + 1),
                )

        timed(f"pull_cache layer by layer ({shape.layers} pulls)", total, by_layer)
        mismatches += check((0, slot), 1, 0, range(shape.num_tensors))
        try:
            manager.pull_cache(
                CacheKey(PROMPT_CLUSTER, 2), dst, src_layer_range=range(0, 1), dst_layer_range=range(0, 1)
            )
            mismatches += 1  # the key should have been consumed by the last layer
        except LLMException as exc:
            if exc.status_code != LLMStatusCode.LLM_KV_CACHE_NOT_EXIST:
                raise

        clear()
        size = slot // 2 - 4096 + 1
        src_offset, dst_offset = slot // 4 + 3, slot // 2 - 7

        def offsets() -> None:
            manager.pull_cache(
                CacheKey(PROMPT_CLUSTER, 3),
                dst,
                0,
                size,
                src_cache_offset=src_offset,
                dst_cache_offset=dst_offset,
            )

        timed("pull_cache with src/dst offsets and size", size * shape.num_tensors, offsets)
        mismatches += check((dst_offset, size), 2, src_offset, range(shape.num_tensors))
        # Bytes outside the pulled region must be untouched (still zero).
        for raw in views:
            mismatches += int(np.count_nonzero(raw[:dst_offset])) + int(
                np.count_nonzero(raw[dst_offset + size :])
            )

        # Layer-wise push: the Prompt pushes its slot PUSHED_SLOT into our cache through raw addresses. The
        # first push also connects back to us and maps our segment; the second shows the steady state.
        for name in (
            f"transfer_cache_async, {shape.layers} layers, first",
            f"transfer_cache_async, {shape.layers} layers",
        ):
            clear()
            peer.send((DECODER_CLUSTER, dst.per_device_tensor_addrs[0]))
            if not peer.poll(timeout_ms / 1000.0 + 60):
                raise TimeoutError("the Prompt did not finish the push")
            code, seconds = peer.recv()
            if code != LLMStatusCode.LLM_SUCCESS:
                raise RuntimeError(f"push failed with {code}")
            rows.append(
                {
                    "name": name,
                    "nbytes": total,
                    "seconds": seconds,
                    "gbps": total / seconds / 1e9,
                }
            )
            mismatches += check((0, slot), PUSHED_SLOT, 0, range(shape.num_tensors))
        views.clear()  # drop our views before the memory is freed
        manager.deallocate_cache(dst)

        # Paged: a block table scattered over the Prompt's pool lands scattered over ours.
        paged = manager.allocate_blocks_cache(
            CacheDesc(
                shape.num_tensors,
                [shape.pool_blocks, BLOCK_TOKENS, shape.kv_heads, shape.head_dim],
                DataType.DT_FLOAT16,
            )
        )
        paged_views = [view.view(np.uint8).reshape(shape.pool_blocks, -1) for view in tensor_views(paged)]
        for blocks in paged_views:
            blocks[:] = 0
        prompt_blocks, decoder_blocks = block_order(shape, 1), block_order(shape, 2)
        table_nbytes = shape.table_blocks * shape.block_nbytes * shape.num_tensors
        label = (
            f"pull_blocks {shape.table_blocks} blocks x {shape.block_nbytes >> 10} KiB x {shape.num_tensors}"
        )
        # The first pull also maps the Prompt's paged pool (a segment of its own); the second is steady.
        for name in (f"{label}, first", label):
            for blocks in paged_views:
                blocks[:] = 0
            timed(
                name,
                table_nbytes,
                lambda: manager.pull_blocks(
                    BlocksCacheKey(PROMPT_CLUSTER, PAGED_MODEL_ID), paged, prompt_blocks, decoder_blocks
                ),
            )
            for t, blocks in enumerate(paged_views):
                want = expected_slot(t, PAGED_SLOT, shape.block_nbytes * shape.pool_blocks).reshape(
                    shape.pool_blocks, -1
                )
                mismatches += int(np.count_nonzero(blocks[decoder_blocks] != want[prompt_blocks]))
                untouched = sorted(set(range(shape.pool_blocks)) - set(decoder_blocks))
                mismatches += int(np.count_nonzero(blocks[untouched]))
        paged_views.clear()
        manager.deallocate_cache(paged)

        datadist.unlink_clusters([info])
        pipe.send(("done", {"rows": list(rows), "mismatches": mismatches}))
    except Exception:
        pipe.send(("error", traceback.format_exc()))
    finally:
        datadist.finalize()


class _Rows(list[dict[str, Any]]):
    """The Decoder's result rows; each is also sent to the parent as it is added, which prints it as a
    line of progress (a full-sized run takes a while)."""

    def __init__(self, pipe: Connection) -> None:
        super().__init__()
        self._pipe = pipe

    def append(self, row: dict[str, Any]) -> None:
        super().append(row)
        self._pipe.send(("progress", row))


Watched = tuple[tuple[mp.process.BaseProcess, Connection], ...]


def _wait(pipe: Connection, what: str, timeout_s: float, watched: Watched = ()) -> Any:
    """The next result from a child, printing its progress rows as they come. Every wait is bounded, and
    a watched process (with the pipe it reports on) that ended, a crash or an error it reported, ends the
    wait at once rather than at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{what} did not answer within {timeout_s:.0f} s")
        if not pipe.poll(min(remaining, 0.5)):
            for process, other in watched:
                if process.exitcode is None or pipe.poll(0):
                    continue
                if other is not pipe and other.poll(0):
                    status, value = other.recv()
                    if status == "error":
                        raise RuntimeError(f"{process.name} failed:\n{value}")
                raise RuntimeError(f"{what}: the {process.name} process ended (exit code {process.exitcode})")
            continue
        status, value = pipe.recv()
        if status == "progress":
            seconds = value.get("seconds")
            took = f" in {seconds * 1e3:.1f} ms" if seconds is not None else ""
            print(f"  done: {value['name']}, {_format_nbytes(value['nbytes'])}{took}", flush=True)
            continue
        if status == "error":
            raise RuntimeError(f"{what} failed:\n{value}")
        return value


def _format_nbytes(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def print_table(rows: list[dict[str, Any]], out: Any = sys.stdout) -> None:
    reference = next((r["gbps"] for r in rows if r["name"] == "numpy.copyto, 2 threads"), None)
    header = f"{'transfer':<48} {'bytes':>10} {'time ms':>9} {'GB/s':>7} {'x memcpy(2T)':>13}"
    print(header, file=out)
    print("-" * len(header), file=out)
    for row in rows:
        seconds = row.get("seconds")
        time_text = f"{seconds * 1e3:9.2f}" if seconds is not None else f"{'':>9}"
        ratio = f"{row['gbps'] / reference:13.2f}" if reference else f"{'':>13}"
        print(
            f"{row['name']:<48} {_format_nbytes(row['nbytes']):>10} {time_text} {row['gbps']:7.2f} {ratio}",
            file=out,
        )


RATIO_NOTE = """
x memcpy(2T): each row's rate divided by the 2-thread numpy.copyto row of this same run, which moves the
same bytes between two private buffers. Near 1 means the pull costs about what copying the bytes costs.
Absolute GB/s vary from run to run (often by 30% or more on a shared or virtual machine: other load,
frequency scaling, where the pages landed), so compare rows of one run; the ratios move much less.
A full run with NIXL and Mooncake beside us: `llm-datadist bench` (figures in bench/README.md)."""

COMM_NAME = "pd_comm_demo"
V2_MEMBERS = {PROMPT_CLUSTER: 0, DECODER_CLUSTER: 1}


def _v2_options(timeout_ms: int) -> dict[str, str]:
    """Cache-manager mode as vllm-ascend's LLMDataDistCMgrConnector set it up."""
    options = _options(None, timeout_ms)
    options.update(
        {"llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "1", "llm.LinkTotalTime": "60"}
    )
    return options


def _registered_blocks(shape: Shape) -> list[np.ndarray]:
    """Memory this process owns (as a framework's KV tensors would be), one array per tensor."""
    return [
        np.zeros(shape.pool_blocks * shape.block_nbytes, dtype=np.uint8) for _ in range(shape.num_tensors)
    ]


def _v2_rank_table(prompt_ip: str, decoder_ip: str) -> str:
    """The rank table of the two-sided link: one server on one host; across hosts, one server per side
    (its ip tells each member where the other is)."""
    import json

    from llm_datadist._rank_table import default_rank_table

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


def _two_sided_link(datadist: Any, deadline_s: float, prompt_ip: str, decoder_ip: str) -> int:
    from llm_datadist import RegisterMemStatus

    table = _v2_rank_table(prompt_ip, decoder_ip)
    comm_id: int = datadist.link(COMM_NAME, dict(V2_MEMBERS), table)
    deadline = time.monotonic() + deadline_s
    while (status := datadist.query_register_mem_status(comm_id)) != RegisterMemStatus.OK:
        if status == RegisterMemStatus.FAILED or time.monotonic() > deadline:
            raise RuntimeError(f"two-sided link failed: {status}")
        time.sleep(0.01)
    return comm_id


def _prompt_v2(
    pipe: Connection,
    peer: Connection,
    shape: Shape,
    port: int,
    timeout_ms: int,
    prompt_ip: str = IP,
    decoder_ip: str = IP,
) -> None:
    from llm_datadist import BlocksCacheKey, CacheDesc, DataType, LLMDataDist, LLMRole

    datadist = LLMDataDist(LLMRole.PROMPT, PROMPT_CLUSTER)
    try:
        datadist.init(_v2_options(timeout_ms))
        manager = datadist.cache_manager
        arrays = _registered_blocks(shape)
        for t, array in enumerate(arrays):
            array[:] = expected_slot(t, PAGED_SLOT, array.nbytes)
        desc = CacheDesc(
            shape.num_tensors,
            [shape.pool_blocks, BLOCK_TOKENS, shape.kv_heads, shape.head_dim],
            DataType.DT_FLOAT16,
        )
        cache = manager.register_blocks_cache(
            desc, [a.ctypes.data for a in arrays], BlocksCacheKey(PROMPT_CLUSTER, PAGED_MODEL_ID)
        )
        comm_id = _two_sided_link(datadist, 120, prompt_ip, decoder_ip)
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


def _decoder_v2(
    pipe: Connection,
    peer: Connection,
    shape: Shape,
    port: int,
    timeout_ms: int,
    prompt_ip: str = IP,
    decoder_ip: str = IP,
) -> None:
    from llm_datadist import BlocksCacheKey, CacheDesc, DataType, LLMDataDist, LLMRole

    datadist = LLMDataDist(LLMRole.DECODER, DECODER_CLUSTER)
    rows = _Rows(pipe)
    mismatches = 0
    try:
        datadist.init(_v2_options(timeout_ms))
        manager = datadist.cache_manager
        arrays = _registered_blocks(shape)
        desc = CacheDesc(
            shape.num_tensors,
            [shape.pool_blocks, BLOCK_TOKENS, shape.kv_heads, shape.head_dim],
            DataType.DT_FLOAT16,
        )
        cache = manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays])
        comm_id = _two_sided_link(datadist, 120, prompt_ip, decoder_ip)
        prompt_blocks, decoder_blocks = block_order(shape, 1), block_order(shape, 2)
        nbytes = shape.table_blocks * shape.block_nbytes * shape.num_tensors
        key = BlocksCacheKey(PROMPT_CLUSTER, PAGED_MODEL_ID)
        for name in ("v2 pull_blocks, registered memory, first", "v2 pull_blocks, registered memory"):
            for array in arrays:
                array[:] = 0
            started = time.perf_counter()
            manager.pull_blocks(key, cache, prompt_blocks, decoder_blocks)
            seconds = time.perf_counter() - started
            rows.append({"name": name, "nbytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9})
            for t, array in enumerate(arrays):
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


def _run_pair(
    prompt_target: Any,
    decoder_target: Any,
    shape: Shape,
    port: int,
    timeout_ms: int,
    *,
    together: bool,
    hosts: Hosts | None = None,
) -> dict[str, Any] | None:
    """Run a Prompt and a Decoder process; `together` starts both at once (a two-sided link needs both).
    With `hosts`, each enters its namespace first thing and the Prompt listens on its namespace's address."""
    ctx = mp.get_context("spawn")
    prompt_pipe, prompt_child = ctx.Pipe()
    decoder_pipe, decoder_child = ctx.Pipe()
    # The Decoder asks the Prompt for the layer-wise push directly, over its own pipe.
    prompt_peer, decoder_peer = ctx.Pipe()
    ips: tuple[str, ...] = ()
    if hosts is not None:
        prompt_target = in_netns(hosts.prompt_netns, prompt_target, hosts.env)
        decoder_target = in_netns(hosts.decoder_netns, decoder_target, hosts.env)
        ips = (hosts.prompt_ip, hosts.decoder_ip)
    prompt = ctx.Process(
        target=prompt_target, args=(prompt_child, prompt_peer, shape, port, timeout_ms, *ips), name="prompt"
    )
    decoder = ctx.Process(
        target=decoder_target,
        args=(decoder_child, decoder_peer, shape, port, timeout_ms, *ips),
        name="decoder",
    )
    result: dict[str, Any] | None = None
    interrupted = False
    try:
        prompt.start()
        if together:
            decoder.start()
        both: Watched = ((prompt, prompt_pipe), (decoder, decoder_pipe))
        _wait(prompt_pipe, "prompt", 600, both if together else both[:1])
        print("  done: Prompt ready", flush=True)
        if not together:
            decoder.start()
        result = _wait(decoder_pipe, "decoder", 1800, both)
        prompt_pipe.send(("stop", None))
        _wait(prompt_pipe, "prompt", 120, both[:1])
    except (TimeoutError, RuntimeError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        result = None
    except BaseException:  # Ctrl-C, or SIGTERM across hosts (`sigterm_as_exit`): no time to wait
        interrupted = True
        raise
    finally:
        for process in (decoder, prompt):
            if process.pid is None:
                continue  # never started (the Prompt failed first)
            process.join(0.5 if interrupted else 30)
            if process.is_alive():
                process.kill()
                process.join(10)
        from llm_datadist._shm.reaper import reap

        reap()
    return result


V1_START = "v1 (kv_cache_manager): starting a Prompt that allocates, prefaults and fills the requests..."
HOSTS_NOTE = """\
Across hosts: these rows ran across two network namespaces joined by a veth pair, linked over TCP
with a shared secret, the bytes moved by Mooncake Transfer Engine. A veth is a memory copy in the kernel,
not a wire, so only the ratios mean anything."""
V2_START = "v2 (cache_manager): both sides register numpy memory and link two-sided..."


def _run_hosts(
    shape: Shape, port: int, timeout_ms: int
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The v1 pair, then the v2 pair, with the Prompt in one fresh namespace and the Decoder in another
    (see `netns.Hosts`; the v2 rank table names each side's address); the namespaces are deleted before it
    returns."""
    try:
        with sigterm_as_exit(), NamespacePair() as pair:
            hosts = Hosts.of(pair)
            print(
                f"across hosts: the Prompt in network namespace {pair.ns_a} at {pair.ip_a}:{port}, the "
                f"Decoder in {pair.ns_b} at {pair.ip_b}, joined by a veth pair; a fresh random secret"
            )
            print(V1_START)
            v1 = _run_pair(_prompt, _decoder, shape, port, timeout_ms, together=False, hosts=hosts)
            print(V2_START)
            v2 = _run_pair(_prompt_v2, _decoder_v2, shape, port, timeout_ms, together=True, hosts=hosts)
            return v1, v2
    except (OSError, RuntimeError, TimeoutError, subprocess.SubprocessError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return None, None


def run(args: argparse.Namespace) -> int:
    if args.small:
        shape = Shape(layers=4, tokens=256, kv_heads=8, head_dim=128)
    else:
        shape = Shape(layers=args.layers, tokens=args.tokens, kv_heads=args.kv_heads, head_dim=args.head_dim)
    if args.hosts and (reason := hosts_unavailable()) is not None:
        print(f"demo --hosts: {reason}", file=sys.stderr)
        return 2
    port = args.port or 20000 + os.getpid() % 40000
    total = shape.slot_nbytes * shape.num_tensors
    print(
        f"KV cache: {shape.layers} layers x (K, V), {shape.tokens} tokens, {shape.kv_heads} KV heads x "
        f"{shape.head_dim}, fp16: {_format_nbytes(total)} per request, {os.cpu_count()} CPUs"
    )
    if args.hosts:
        v1, v2 = _run_hosts(shape, port, args.timeout_ms)
    else:
        print(V1_START)
        v1 = _run_pair(_prompt, _decoder, shape, port, args.timeout_ms, together=False)
        # Cache-manager mode, shaped like vllm-ascend's connector: both sides register memory they own,
        # link two-sided, and the Decoder pulls a block table.
        print(V2_START)
        v2 = _run_pair(_prompt_v2, _decoder_v2, shape, port, args.timeout_ms, together=True)
    if v1 is None or v2 is None:
        return 1
    print()
    print_table(v1["rows"] + v2["rows"])
    print(RATIO_NOTE)
    if args.hosts:
        print(HOSTS_NOTE)
    mismatches = v1["mismatches"] + v2["mismatches"]
    if mismatches:
        print(f"FAILED: {mismatches} bytes differ", file=sys.stderr)
        return 1
    print("every byte verified")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--small", action="store_true", help="4 layers x 256 tokens (4 MiB per request)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--port", type=int, default=0, help="Prompt listen port (default: derived from the pid)"
    )
    parser.add_argument("--timeout-ms", type=int, default=60000, help="sync_kv_timeout of both sides")
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="the Prompt and the Decoder in two network namespaces joined by a veth pair, linked over TCP "
        "(needs root, iproute2 and Mooncake Transfer Engine)",
    )
