"""The demo's v1 sides (kv_cache_manager): the Prompt allocates and fills requests and a paged pool and
pushes one request layer by layer when asked; the Decoder measures memcpy first, then pulls every way
(whole, layer by layer, with offsets, paged blocks) and has the Prompt push, checking every byte.

Rules: each side is a spawned process using only the public API (plus `ext.tensor_views` to fill and check
memory); the memcpy baseline is measured in the Decoder, in the same run, between buffers already faulted in.
"""

from __future__ import annotations

import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    TransferConfig,
)
from llm_datadist._native import load_copy_kernel
from llm_datadist._shm.segment import Segment
from llm_datadist._shm.space import format_nbytes
from llm_datadist.ext import tensor_views

from ..output import library_log_to_stderr
from .common import (
    BLOCK_TOKENS,
    DECODER_CLUSTER,
    KERNEL_COPY,
    NUMPY_COPY,
    PAGED_MODEL_ID,
    PAGED_SLOT,
    PROMPT_CLUSTER,
    PUSHED_SLOT,
    REQUEST_NBYTES,
    REQUEST_PULLS,
    REQUEST_REQ,
    SMALL_NBYTES,
    SMALL_PULLS,
    SMALL_REQ,
    U64_MAX,
    Rows,
    Setup,
    Shape,
    block_order,
    expected_slot,
    options,
    step,
)


class _AllLayersReady(LayerSynchronizer):
    """A LayerSynchronizer whose forward pass is already done: every layer is ready at once."""

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


def prompt(pipe: Connection, peer: Connection, shape: Shape, setup: Setup) -> None:
    library_log_to_stderr()
    datadist = LLMDataDist(LLMRole.PROMPT, PROMPT_CLUSTER)
    timeout_ms = setup.timeout_ms
    try:
        step(pipe, f"init, listening on {setup.prompt_ip}:{setup.port}")
        datadist.init(options(f"{setup.prompt_ip}:{setup.port}", timeout_ms))
        manager = datadist.kv_cache_manager
        n = shape.num_tensors
        desc = CacheDesc(
            shape.num_tensors, [4, shape.tokens, shape.kv_heads, shape.head_dim], DataType.DT_FLOAT16
        )
        # Slots 0-2 hold one request each; slot 3 is bound to a prefix key, used to warm the link up.
        keys = [CacheKey(PROMPT_CLUSTER, req) for req in (1, 2, 3)]
        keys.append(CacheKey(PROMPT_CLUSTER, U64_MAX, 0, 9))
        step(pipe, f"allocating 4 requests ({format_nbytes(4 * shape.slot_nbytes * n)}), pages prefaulted")
        cache = manager.allocate_cache(desc, keys)
        for t, view in enumerate(tensor_views(cache)):
            step(pipe, f"writing the bytes to check into the requests, tensor {t + 1} of {n}")
            raw = view.view(np.uint8).reshape(4, -1)
            for slot in range(4):
                raw[slot] = expected_slot(t, slot, shape.slot_nbytes)
        paged_desc = CacheDesc(
            shape.num_tensors,
            [shape.pool_blocks, BLOCK_TOKENS, shape.kv_heads, shape.head_dim],
            DataType.DT_FLOAT16,
        )
        paged_nbytes = shape.block_nbytes * shape.pool_blocks
        step(pipe, f"allocating a paged pool ({format_nbytes(paged_nbytes * n)}), pages prefaulted")
        paged = manager.allocate_blocks_cache(paged_desc, BlocksCacheKey(PROMPT_CLUSTER, PAGED_MODEL_ID))
        for t, view in enumerate(tensor_views(paged)):
            step(pipe, f"writing the bytes to check into the paged pool, tensor {t + 1} of {n}")
            view.view(np.uint8).reshape(-1)[:] = expected_slot(
                t, PAGED_SLOT, shape.block_nbytes * shape.pool_blocks
            )
        serving = []
        for pulls, first_req, nbytes, tensors in (
            (SMALL_PULLS, SMALL_REQ, SMALL_NBYTES, 1),
            (REQUEST_PULLS, REQUEST_REQ, REQUEST_NBYTES, n),
        ):
            step(pipe, f"allocating {pulls} serving requests of {tensors} x {format_nbytes(nbytes)}")
            requests = manager.allocate_cache(
                CacheDesc(tensors, [pulls, nbytes // 2], DataType.DT_FLOAT16),
                [CacheKey(PROMPT_CLUSTER, first_req + i) for i in range(pulls)],
            )
            for t, view in enumerate(tensor_views(requests)):
                raw = view.view(np.uint8).reshape(pulls, -1)
                for i in range(pulls):
                    raw[i] = expected_slot(t, first_req + i, nbytes)
            serving.append(requests)
        pipe.send(("ready", None))
        # Serve push requests from the Decoder until the parent says stop.
        while True:
            if peer.poll(0.05):
                dst_cluster, addrs = peer.recv()
                step(pipe, "pushing a request layer by layer (transfer_cache_async)")
                started = time.perf_counter()
                task = manager.transfer_cache_async(
                    cache, _AllLayersReady(), [TransferConfig(dst_cluster, addrs, None, PUSHED_SLOT)]
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
        for requests in serving:  # their keys were consumed by the Decoder's pulls
            manager.deallocate_cache(requests)
        pipe.send(("done", None))
    except Exception:
        pipe.send(("error", traceback.format_exc()))
    finally:
        datadist.finalize()


def copy_bandwidth(
    nbytes: int, threads: int, repeats: int = 3, *, shared: bool = False, kernel: bool = False
) -> float:
    """Best-of-N GB/s of numpy.copyto between two already-faulted buffers, split over `threads`; with
    `kernel`, of the C copy kernel's streaming copy instead (the caller checked that it was built).

    Private numpy buffers get transparent huge pages where the kernel allows them; `shared=True` measures
    between two prefaulted shared-memory segments instead (4 KiB pages on tmpfs), which bounds a pull.
    """
    segments: list[Segment] = []
    if shared:
        segments = [Segment.create(nbytes), Segment.create(nbytes)]
        src, dst = segments[0].array, segments[1].array
        src[:] = 7
    else:
        src = np.full(nbytes, 7, dtype=np.uint8)
        dst = np.zeros(nbytes, dtype=np.uint8)
    bounds = np.linspace(0, nbytes, threads + 1, dtype=np.uint64)
    copy_runs = load_copy_kernel() if kernel else None
    src_base, dst_base = src.ctypes.data, dst.ctypes.data

    def part(i: int, src: np.ndarray[Any, Any], dst: np.ndarray[Any, Any]) -> None:
        if copy_runs is None:
            np.copyto(dst[bounds[i] : bounds[i + 1]], src[bounds[i] : bounds[i + 1]])
            return
        offsets = bounds[i : i + 1]
        copy_runs(src_base, dst_base, offsets, offsets, bounds[i + 1 : i + 2] - offsets, True)

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


def decoder(pipe: Connection, peer: Connection, shape: Shape, setup: Setup) -> None:
    library_log_to_stderr()
    datadist = LLMDataDist(LLMRole.DECODER, DECODER_CLUSTER)
    rows = Rows(pipe)
    mismatches = 0
    timeout_ms = setup.timeout_ms
    try:
        rows.step("init")
        datadist.init(options(None, timeout_ms))
        manager = datadist.kv_cache_manager
        slot = shape.slot_nbytes
        total = slot * shape.num_tensors
        rows.step(f"measuring numpy.copyto of {format_nbytes(total)}, 1 thread (best of 3)")
        rows.append({"name": "numpy.copyto, 1 thread", "nbytes": total, "gbps": copy_bandwidth(total, 1)})
        rows.step(f"measuring numpy.copyto of {format_nbytes(total)}, 2 threads (best of 3)")
        rows.append({"name": NUMPY_COPY, "nbytes": total, "gbps": copy_bandwidth(total, 2)})
        if load_copy_kernel() is not None:
            rows.step(f"measuring the copy kernel's streaming copy of {format_nbytes(total)}, 2 threads")
            rows.append({"name": KERNEL_COPY, "nbytes": total, "gbps": copy_bandwidth(total, 2, kernel=True)})
        rows.step(f"measuring numpy.copyto of {format_nbytes(total)} between two shared-memory segments")
        rows.append(
            {
                "name": "numpy.copyto, 2 threads, shm to shm",
                "nbytes": total,
                "gbps": copy_bandwidth(total, 2, shared=True),
            }
        )

        info = LLMClusterInfo()
        info.remote_cluster_id = PROMPT_CLUSTER
        info.append_local_ip_info(setup.decoder_ip, 0)
        info.append_remote_ip_info(setup.prompt_ip, setup.port)
        rows.step(f"linking to the Prompt at {setup.prompt_ip}:{setup.port}")
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
                rows.step(f"checking every byte pulled, tensor {t + 1} of {len(tensors)}")
                want = expected_slot(t, src_slot, slot)[src_start : src_start + nbytes]
                bad += int(np.count_nonzero(views[t][start : start + nbytes] != want))
            return bad

        def timed(name: str, nbytes: int, action: Any) -> None:
            rows.step(name)
            started = time.perf_counter()
            action()
            elapsed = time.perf_counter() - started
            rows.append({"name": name, "nbytes": nbytes, "seconds": elapsed, "gbps": nbytes / elapsed / 1e9})

        prefix = CacheKey(PROMPT_CLUSTER, U64_MAX, 0, 9)
        timed(
            "warm-up: 4 KiB per tensor "
            + (
                "(maps the segment)"
                if setup.prompt_ip == setup.decoder_ip
                else "(finds the segment's address)"
            ),
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
            rows.step(f"{name}: the Prompt pushes into this cache")
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
        rows.step("allocating a paged pool")
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
                rows.step(f"checking every block pulled, tensor {t + 1} of {len(paged_views)}")
                want = expected_slot(t, PAGED_SLOT, shape.block_nbytes * shape.pool_blocks).reshape(
                    shape.pool_blocks, -1
                )
                mismatches += int(np.count_nonzero(blocks[decoder_blocks] != want[prompt_blocks]))
                untouched = sorted(set(range(shape.pool_blocks)) - set(decoder_blocks))
                mismatches += int(np.count_nonzero(blocks[untouched]))
        paged_views.clear()
        manager.deallocate_cache(paged)

        mismatches += _serving(manager, rows, shape)
        datadist.unlink_clusters([info])
        pipe.send(("done", {"rows": list(rows), "mismatches": mismatches}))
    except Exception:
        pipe.send(("error", traceback.format_exc()))
    finally:
        datadist.finalize()


def _serving(manager: Any, rows: Rows, shape: Shape) -> int:
    """The serving rows: every request the Prompt bound for them pulled once by a key object of its own,
    as a serving framework pulls (consumed), each pull timed alone with the Decoder's CPU for it; the last
    pull of each kind checked byte by byte. The number of bytes that differ."""
    mismatches = 0
    for pulls, first_req, nbytes, tensors in (
        (SMALL_PULLS, SMALL_REQ, SMALL_NBYTES, 1),
        (REQUEST_PULLS, REQUEST_REQ, REQUEST_NBYTES, shape.num_tensors),
    ):
        name = f"fresh request, {tensors} x {format_nbytes(nbytes)} by CacheKey(req_id)"
        rows.step(f"serving: {pulls} x {name}")
        dst = manager.allocate_cache(CacheDesc(tensors, [1, nbytes // 2], DataType.DT_FLOAT16))
        views = [view.view(np.uint8).reshape(-1) for view in tensor_views(dst)]
        for raw in views:
            raw[:] = 0  # touched: the pulls time the copy, not the first touch of our pages
        keys = [CacheKey(PROMPT_CLUSTER, first_req + i) for i in range(pulls)]
        samples, cpu = [], []
        for key in keys:
            cpu_started, started = time.process_time(), time.perf_counter()
            manager.pull_cache(key, dst)
            samples.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu_started)
        for t, raw in enumerate(views):
            mismatches += int(np.count_nonzero(raw != expected_slot(t, first_req + pulls - 1, nbytes)))
        try:
            manager.pull_cache(CacheKey(PROMPT_CLUSTER, first_req), dst)
            mismatches += 1  # the key should have been consumed by its pull
        except LLMException as exc:
            if exc.status_code != LLMStatusCode.LLM_KV_CACHE_NOT_EXIST:
                raise
        views.clear()
        manager.deallocate_cache(dst)
        total = tensors * nbytes
        p50 = float(np.median(samples))
        rows.append(
            {
                "name": name,
                "nbytes": total,
                "serving": {
                    "pulls": pulls,
                    "p50": p50,
                    "p99": float(np.percentile(samples, 99)),
                    "cpu": float(np.median(cpu)),
                },
                "gbps": total / p50 / 1e9,
            }
        )
    return mismatches
