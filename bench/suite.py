"""`llm-datadist bench`: this engine side by side with memcpy and with what a user would pick instead.

Rules: every figure comes from this run on this machine; throughput is reported as GB/s and as a ratio to
`numpy.copyto` over two threads between warm buffers measured in the same run; latency as p50/p99 of many
repetitions. The owner side of every transfer is a real process (spawned), the measuring side is this one.
Peers (NIXL, Mooncake, `peers`) are measured the same way between two spawned processes when they are
installed, and reported as skipped, with the reason, when they are not. The report ends with the
performance targets of bench/README.md's table, each with its ratio from this run and PASS or MISS
(`report.py` prints and judges); the targets are judged on the `serving` rows (`serving.py`: fresh
argument objects every call, as serving frameworks pull), and the small pull repeated here with the same
objects is a labelled microbenchmark. Only the public API is driven; the one internal read is the pull's time
breakdown, printed when the core offers one.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from queue import Empty
from typing import Any

import msgpack
import numpy as np

from llm_datadist import BlocksCacheKey, CacheDesc, CacheKey, DataType, LLMException
from llm_datadist._runtime import ensure_runtime_dir
from llm_datadist._shm.reaper import reap
from llm_datadist._tools.names import free_ports

from . import peers, serving
from .ours import IP, OWNER, PREFIX, U64_MAX, Owner, link, measurer
from .proc import (
    BlockPattern,
    Results,
    block_patterns,
    copy_kernel,
    copy_samples,
    cpu_ns,
    fmt_nbytes,
    scattered_samples,
    timed,
)
from .report import KERNEL_COPY, judge_targets, plot, print_report, write_json
from .report import with_ratios as _with_ratios

# ====================================================================== helpers


def _timed_with_cpu(
    action: Callable[[], object], repeats: int, other_pid: int
) -> tuple[list[float], dict[str, float]]:
    """`timed`, plus the CPU time (user + system, all threads) each of the two processes spent per call:
    where a round trip's time goes when it is not the copy. Only this process's when the other's is not
    available."""
    other_before, ours_before = cpu_ns(other_pid), time.process_time_ns()
    samples = timed(action, repeats)
    ours, other_after = time.process_time_ns() - ours_before, cpu_ns(other_pid)
    cpu = {"this process": ours / repeats / 1e3}
    if other_before is not None and other_after is not None:
        cpu["the other"] = (other_after - other_before) / repeats / 1e3
    return samples, cpu


def _repeats(nbytes: int, quick: bool) -> int:
    budget = (64 << 20) if quick else (512 << 20)
    return max(3, min(200, budget // max(nbytes, 1)))


def _one_sided_repeats(nbytes: int, quick: bool) -> int:
    """Repetitions of one synchronous read, ours and the peers' alike: many for latency-sized reads."""
    if nbytes <= (1 << 20):
        return 300 if quick else 2000
    return _repeats(nbytes, quick)


# ====================================================================== baselines


def _memcpy_step(results: Results, name: str, nbytes: int, threads: int, quick: bool) -> None:
    results.add("memcpy", name, nbytes, copy_samples(nbytes, threads, _repeats(nbytes, quick)))


def _kernel_copy_step(results: Results, name: str, nbytes: int, threads: int, quick: bool) -> None:
    kernel = copy_kernel()
    if kernel is None:
        results.skip(
            "memcpy", name, "the C copy kernel is not built here (or LLM_DATADIST_NO_EXTENSION is set)"
        )
        return
    results.add("memcpy", name, nbytes, copy_samples(nbytes, threads, _repeats(nbytes, quick), kernel=kernel))


def _ceiling_step(results: Results, nbytes: int, quick: bool) -> None:
    """What the copy kernel does with what pulls copy, nothing of the library around it: `nbytes` on 2
    threads between two segments of shared memory (the pages the system gives `/dev/shm`), and the serving
    rows' paged pulls (`scattered_samples` of their tables). The targets name them as what limits a row."""
    rows = [(f"{KERNEL_COPY}, 2 threads, shared memory", "memcpy.shared")] + [
        (f"{KERNEL_COPY}, {count} random 32 KiB blocks x 64, shared memory", f"memcpy.scattered.{count}")
        for count in serving.PAGED_TABLES
    ]
    kernel = copy_kernel()
    if kernel is None:
        reason = "the C copy kernel is not built here (or LLM_DATADIST_NO_EXTENSION is set)"
        for name, row_id in rows:
            results.skip("memcpy", name, reason, id=row_id)
        return
    block = serving.PAGED_BLOCK
    try:
        samples = copy_samples(nbytes, 2, _repeats(nbytes, quick), kernel=kernel, shared=True)
        results.add("memcpy", rows[0][0], nbytes, samples, id=rows[0][1])
        for (name, row_id), count in zip(rows[1:], serving.PAGED_TABLES, strict=True):
            repeats = _repeats(serving.TENSORS * count * block, quick)
            samples = scattered_samples(
                serving.TENSORS, serving.PAGED_POOL_BLOCKS, block, count, repeats, kernel
            )
            results.add("memcpy", name, serving.TENSORS * count * block, samples, id=row_id)
    except LLMException as exc:  # /dev/shm too small for the buffers
        measured = {row["id"] for row in results.rows if "id" in row}
        for name, row_id in rows:
            if row_id not in measured:
                results.skip("memcpy", name, str(exc), id=row_id)


def _socket_server(path: str, mode: str, nbytes: int) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    conn, _ = listener.accept()
    payload = b"\x07" * nbytes
    try:
        while True:
            header = conn.recv(4, socket.MSG_WAITALL)
            if len(header) < 4:
                return
            (length,) = struct.unpack("!I", header)
            request = msgpack.unpackb(conn.recv(length, socket.MSG_WAITALL))
            if mode == "msgpack":
                reply = msgpack.packb([4, request[1], 1, "/llmdd.0.1.2.0123456789abcdef", 1 << 30, [0], 4096])
                conn.sendall(struct.pack("!I", len(reply)) + reply)
            else:
                conn.sendall(payload)
    finally:
        conn.close()
        listener.close()


def _socket_baseline(results: Results, runtime: Path, mode: str, nbytes: int, repeats: int) -> None:
    ctx = mp.get_context("spawn")
    path = os.fspath(runtime / f"bench-{mode}-{os.getpid()}.sock")
    server = ctx.Process(target=_socket_server, args=(path, mode, nbytes), daemon=True)
    server.start()
    try:
        deadline = time.monotonic() + 30
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        while True:  # the path appears at bind(), connections are accepted after listen()
            try:
                client.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise TimeoutError("baseline socket server did not start") from None
                time.sleep(0.01)
        buffer = bytearray(max(nbytes, 64))
        view = memoryview(buffer)

        def once(seq: int = 0) -> None:
            request = msgpack.packb([3, seq, 1, 5, 0, 0, 0, 1, True, 4096, 0, True])
            client.sendall(struct.pack("!I", len(request)) + request)
            if mode == "msgpack":
                (length,) = struct.unpack("!I", client.recv(4, socket.MSG_WAITALL))
                msgpack.unpackb(client.recv(length, socket.MSG_WAITALL))
            else:
                got = 0
                while got < nbytes:
                    got += client.recv_into(view[got:], nbytes - got)

        once()
        assert server.pid is not None
        samples, cpu = _timed_with_cpu(once, repeats, server.pid)
        client.close()
        if mode == "msgpack":
            name = "bare msgpack request/response, Unix socket"
            results.add("baseline", name, 0, samples, cpu_us=cpu, id="baseline.msgpack")
        else:
            results.add("baseline", "bytes over a Unix socket", nbytes, samples)
    finally:
        server.join(10)
        if server.is_alive():
            server.kill()
            server.join(10)
        if os.path.exists(path):
            os.unlink(path)


def _pipe_sender(conn: Connection, nbytes: int, count: int) -> None:
    payload = b"\x07" * nbytes
    for _ in range(count):
        conn.send_bytes(payload)
    conn.close()


def _pipe_baseline(results: Results, nbytes: int, repeats: int) -> None:
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_pipe_sender, args=(sender, nbytes, repeats + 1), daemon=True)
    process.start()
    sender.close()
    buffer = bytearray(nbytes)
    receiver.recv_bytes_into(buffer)
    samples = timed(lambda: receiver.recv_bytes_into(buffer), repeats)
    process.join(30)
    receiver.close()
    results.add("baseline", "multiprocessing Pipe (send_bytes)", nbytes, samples)


def _queue_sender(queue: Any, nbytes: int, count: int) -> None:
    array = np.full(nbytes, 7, dtype=np.uint8)
    for _ in range(count):
        queue.put(array)


def _queue_baseline(results: Results, nbytes: int, repeats: int) -> None:
    # A Queue's semaphores live in /dev/shm while the queue exists, and the sender opens them by name when
    # it starts: a sender that cannot (their names removed under it) dies, and the row says so.
    name = "multiprocessing Queue of numpy arrays"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue(maxsize=2)
    process = ctx.Process(target=_queue_sender, args=(queue, nbytes, repeats + 1), daemon=True)
    process.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                queue.get(timeout=0.5)
                break
            except Empty:
                if process.is_alive() and time.monotonic() < deadline:
                    continue
                results.skip("baseline", name, f"failed here: the sender ended with code {process.exitcode}")
                return
        samples = timed(lambda: queue.get(timeout=60), repeats)
        results.add("baseline", name, nbytes, samples)
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join(10)
        queue.close()
        queue.join_thread()


def _peers(results: Results, quick: bool) -> None:
    peers.run(results, functools.partial(_one_sided_repeats, quick=quick), block_patterns(quick))


# ====================================================================== our engine


def _breakdown(datadist: Any) -> Callable[[], dict[str, float] | None]:
    """Where the last pull's time went, in seconds by phase, as the core records it; None when this
    version of the core keeps no such record (the bench then prints the pull without it)."""
    core = None
    with contextlib.suppress(Exception):
        core = datadist._require_core()

    def last() -> dict[str, float] | None:
        record = getattr(getattr(core, "transfers", None), "last_pull_breakdown", None)
        if not isinstance(record, dict) or not record:
            return None
        return {str(k): float(v) for k, v in record.items() if isinstance(v, int | float)}

    return last


def _bench_v1(results: Results, port: int, args: argparse.Namespace) -> None:
    owner = Owner("v1", port, args.timeout_ms)
    datadist = measurer("v1", args.timeout_ms)
    try:
        link(datadist, port)
        manager = datadist.kv_cache_manager
        last_breakdown = _breakdown(datadist)
        key = CacheKey(OWNER, U64_MAX, 0, PREFIX)
        total = (64 << 20) if args.quick else (512 << 20)
        sizes = [4 << 10, 64 << 10, 1 << 20, 16 << 20] + ([] if args.quick else [256 << 20])
        for slice_nbytes in sizes:
            tensors = max(2, min(64, total // slice_nbytes))
            shape = [1, slice_nbytes // 2]
            owner.call("alloc", (tensors, shape))
            dst = manager.allocate_cache(CacheDesc(tensors, shape, DataType.DT_FLOAT16))
            nbytes = tensors * slice_nbytes
            manager.pull_cache(key, dst)  # maps the owner's segment once
            breakdowns: list[dict[str, float]] = []

            def pull_and_record(dst: Any = dst, breakdowns: list[dict[str, float]] = breakdowns) -> None:
                manager.pull_cache(key, dst)
                breakdown = last_breakdown()
                if breakdown is not None:
                    breakdowns.append(breakdown)

            samples = timed(pull_and_record, _repeats(nbytes, args.quick))
            extra: dict[str, Any] = {"id": f"pull.whole.{slice_nbytes}"}
            if breakdowns:
                phases = [k for k in breakdowns[0] if all(k in b for b in breakdowns)]
                extra["breakdown_us"] = {k: statistics.median(b[k] for b in breakdowns) * 1e6 for k in phases}
            name = f"whole, {tensors} x {fmt_nbytes(slice_nbytes)}"
            results.add("pull_cache", name, nbytes, samples, **extra)
            manager.deallocate_cache(dst)
            owner.call("free")
        for slice_nbytes in LAYER_SLICES[: 1 if args.quick else None]:
            _layers(results, owner, manager, slice_nbytes, args.quick)
        # Small pulls by key: latency.
        owner.call("alloc", (1, [1, 2048]))
        small = manager.allocate_cache(CacheDesc(1, [1, 2048], DataType.DT_FLOAT16))
        manager.pull_cache(key, small)
        assert owner.process.pid is not None
        samples, cpu = _timed_with_cpu(
            lambda: manager.pull_cache(key, small), 300 if args.quick else 2000, owner.process.pid
        )
        # A microbenchmark: one call made again and again with the same objects (a prefix key, never
        # consumed, the same bytes hot in the cache); the serving group's fresh pulls are what clients do.
        name = "microbenchmark: 1 x 4 KiB, the same call repeated"
        results.add("latency", name, 4096, samples, cpu_us=cpu, id="latency.small")
        _counting_cost(results, datadist, key, small, args.quick)
        manager.deallocate_cache(small)
        owner.call("free")
        for pattern in block_patterns(args.quick):
            _blocks(results, owner, manager, pattern, args.quick)
    finally:
        datadist.finalize()
        owner.close()


def _counting_cost(results: Results, datadist: Any, key: Any, small: Any, quick: bool) -> None:
    """What counting costs a small pull: the same pull with the instance's counting paused, in alternation
    with counted rounds (`LLM_DATADIST_STATS=0` switches it off for a whole process)."""
    manager = datadist.kv_cache_manager
    stats = datadist._require_core().stats
    counted: list[float] = []
    uncounted: list[float] = []
    per_round = 100 if quick else 500
    for _ in range(4 if quick else 10):
        counted.extend(timed(lambda: manager.pull_cache(key, small), per_round))
        with stats.paused():
            uncounted.extend(timed(lambda: manager.pull_cache(key, small), per_round))
    results.add(
        "latency",
        "microbenchmark: the same, stats off",
        4096,
        uncounted,
        id="latency.small.uncounted",
        vs_counted=statistics.median(uncounted) / statistics.median(counted),
    )


LAYERS = 32
LAYER_SLICES = (1 << 20, 8 << 20)  # per tensor slice: 64 MiB and 512 MiB requests (the demo's is 512 MiB)


def _layers(results: Results, owner: Owner, manager: Any, slice_nbytes: int, quick: bool) -> None:
    """A 32-layer request (K and V per layer: 64 tensors) pulled whole, and layer by layer as 32 pulls with
    one-layer `src_layer_range`/`dst_layer_range` each: the same bytes, measured in alternation so that
    both see the same machine; the second row carries the ratio (whole p50 / by-layer p50)."""
    key = CacheKey(OWNER, U64_MAX, 0, PREFIX)
    tensors, shape = 2 * LAYERS, [1, slice_nbytes // 2]
    owner.call("alloc", (tensors, shape))
    dst = manager.allocate_cache(CacheDesc(tensors, shape, DataType.DT_FLOAT16))
    nbytes = tensors * slice_nbytes

    def whole() -> None:
        manager.pull_cache(key, dst)

    def by_layer() -> None:
        for layer in range(LAYERS):
            one = range(layer, layer + 1)
            manager.pull_cache(key, dst, src_layer_range=one, dst_layer_range=one)

    whole()  # maps the owner's segment once
    by_layer()
    whole_samples: list[float] = []
    layer_samples: list[float] = []
    for repeat in range(max(5, _repeats(nbytes, quick))):
        order = ((whole, whole_samples), (by_layer, layer_samples))
        for action, samples in order if repeat % 2 == 0 else order[::-1]:
            samples.extend(timed(action, 1))
    size = fmt_nbytes(slice_nbytes)
    results.add(
        "layers",
        f"pull_cache whole, {LAYERS} layers x 2 x {size}",
        nbytes,
        whole_samples,
        id=f"layers.whole.{slice_nbytes}",
    )
    results.add(
        "layers",
        f"pull_cache layer by layer, {LAYERS} pulls",
        nbytes,
        layer_samples,
        id=f"layers.by_layer.{slice_nbytes}",
        vs_whole=statistics.median(whole_samples) / statistics.median(layer_samples),
    )
    manager.deallocate_cache(dst)
    owner.call("free")


def _blocks(results: Results, owner: Owner, manager: Any, pattern: BlockPattern, quick: bool) -> None:
    """`pull_blocks` of a scattered-block pattern, the same one the peers read as one descriptor list."""
    shape = [pattern.pool_blocks, pattern.block_nbytes // 2]
    owner.call("alloc_blocks", (pattern.tensors, shape, 0))
    local = manager.allocate_blocks_cache(CacheDesc(pattern.tensors, shape, DataType.DT_FLOAT16))
    src_blocks, dst_blocks = list(pattern.src_blocks), list(pattern.dst_blocks)
    blocks_key = BlocksCacheKey(OWNER, 0)
    manager.pull_blocks(blocks_key, local, src_blocks, dst_blocks)
    samples = timed(
        functools.partial(manager.pull_blocks, blocks_key, local, src_blocks, dst_blocks),
        _repeats(pattern.nbytes, quick),
    )
    block = fmt_nbytes(pattern.block_nbytes)
    results.add(
        "blocks",
        f"pull_blocks {pattern.table} scattered blocks x {block} x {pattern.tensors}",
        pattern.nbytes,
        samples,
        id=f"blocks.ours.{pattern.block_nbytes}",
        block_nbytes=pattern.block_nbytes,
    )
    manager.deallocate_cache(local)
    owner.call("free")


def _bench_v2(results: Results, port: int, args: argparse.Namespace) -> None:
    owner = Owner("v2", port, args.timeout_ms)
    datadist = measurer("v2", args.timeout_ms)
    try:
        link(datadist, port)
        manager = datadist.cache_manager
        for block_nbytes in peers.SIZES:
            shape = [4, block_nbytes // 2]
            model_id = block_nbytes >> 10
            owner.call("register_blocks", (1, shape, model_id))
            desc = CacheDesc(1, shape, DataType.DT_FLOAT16)
            key = BlocksCacheKey(OWNER, model_id)
            repeats = _one_sided_repeats(block_nbytes, args.quick)
            # Into this process's pool (shared memory), and into memory it registered (plain numpy memory,
            # as the peers' rows read into: where the kernel can back it with huge pages, copies are faster).
            mine = np.zeros(4 * block_nbytes, dtype=np.uint8)
            for into, local in (
                ("pool", manager.allocate_blocks_cache(desc)),
                ("registered", manager.register_blocks_cache(desc, [mine.ctypes.data])),
            ):
                manager.pull_blocks(key, local, [1], [2])  # fetches the table once
                samples = timed(functools.partial(manager.pull_blocks, key, local, [1], [2]), repeats)
                results.add(
                    "one-sided",
                    f"v2 pull_blocks 1 x {fmt_nbytes(block_nbytes)}, registered -> {into}",
                    block_nbytes,
                    samples,
                    id=f"one_sided.{into}.{block_nbytes}",
                )
                if into == "pool":
                    manager.deallocate_blocks_cache(local)
                else:
                    manager.unregister_cache(local.cache_id)
            if not (mine[2 * block_nbytes : 3 * block_nbytes].view(np.float16) == 1).all():
                raise RuntimeError("a one-sided pull returned other bytes than the owner's")
    finally:
        datadist.finalize()
        owner.close()


# ====================================================================== report


def _targets(results: Results) -> list[dict[str, Any]]:
    """The performance targets (bench/README.md's table) against this run's rows (after `_with_ratios`), for
    the layer-by-layer request sizes this suite measures (`report.judge_targets`; the bench's tests call
    it, and `_with_ratios`, here)."""
    return judge_targets(results, LAYER_SLICES)


def run(args: argparse.Namespace) -> int:
    results = Results(quiet=args.quiet)
    runtime = ensure_runtime_dir()
    # v1's owner listens on port, v2's on port + 1, the serving group's on port + 2 and port + 3
    port = args.port or free_ports(IP, 4)
    steps: list[tuple[str, Callable[[], None]]] = []
    for nbytes in (64 << 10, 1 << 20, 16 << 20, 128 << 20) + (() if args.quick else (512 << 20,)):
        for threads in (1, 2):
            plural = "s" if threads > 1 else ""
            name = f"numpy.copyto, {threads} thread{plural}"
            steps.append((name, functools.partial(_memcpy_step, results, name, nbytes, threads, args.quick)))
            name = f"{KERNEL_COPY}, {threads} thread{plural}"
            steps.append(
                (name, functools.partial(_kernel_copy_step, results, name, nbytes, threads, args.quick))
            )
    largest = 128 << 20 if args.quick else 512 << 20
    steps.append(("copy kernel ceilings", functools.partial(_ceiling_step, results, largest, args.quick)))
    rtt_repeats = 300 if args.quick else 3000
    steps.append(
        (
            "msgpack round trip",
            functools.partial(_socket_baseline, results, runtime, "msgpack", 0, rtt_repeats),
        )
    )
    for nbytes in (1 << 20, 16 << 20):
        repeats = _repeats(nbytes, args.quick)
        steps.append(
            (
                "bytes over a socket",
                functools.partial(_socket_baseline, results, runtime, "bytes", nbytes, repeats),
            )
        )
        steps.append(("multiprocessing Pipe", functools.partial(_pipe_baseline, results, nbytes, repeats)))
        steps.append(("multiprocessing Queue", functools.partial(_queue_baseline, results, nbytes, repeats)))
    steps.append(("peers", functools.partial(_peers, results, args.quick)))
    steps.append(("llm_datadist v1", functools.partial(_bench_v1, results, port, args)))
    steps.append(("llm_datadist v2", functools.partial(_bench_v2, results, port + 1, args)))
    steps.append(("serving, v1", functools.partial(serving.run_v1, results, port + 2, args)))
    steps.append(("serving, v2 paged", functools.partial(serving.run_v2, results, port + 3, args)))
    steps.append(("serving, across hosts", functools.partial(serving.hosts_row, results)))
    started = time.monotonic()
    for index, (name, step) in enumerate(steps, 1):
        if not args.quiet:
            print(f"[{index}/{len(steps)}] {name} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
        step()
    reap()
    _with_ratios(results)
    targets = _targets(results)
    print_report(results, targets)
    if args.json:
        print(write_json(args.json, results, targets))
    if args.plot:
        print(plot(results, Path(args.plot)))
    return 0
