"""Plumbing shared by `suite`, `hosts` and `peers`: the rows of a run (`Results`), timing a call repeatedly
and memcpy the same way, a spawned helper process that answers over a pipe, and the scattered-block pattern
that our `pull_blocks` and the peers both read.

Rules: a helper answers each request with ("ok", value) or ("error", text); every wait on it is bounded;
`close` asks it to stop, then kills and reaps it if it has not. A pattern is drawn from a fixed seed, so
every reader of one run reads exactly the same blocks.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

BLOCK_SIZES = (16 << 10, 64 << 10, 256 << 10)
BLOCK_TENSORS = 64


class Results:
    """The rows of one run, in the order measured; each is printed to stderr as it comes unless `quiet`."""

    def __init__(self, quiet: bool) -> None:
        self.rows: list[dict[str, Any]] = []
        self.quiet = quiet

    def add(self, group: str, name: str, nbytes: int, seconds: list[float], **extra: Any) -> None:
        ordered = sorted(seconds)
        p50 = statistics.median(ordered)
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        row = {
            "group": group,
            "name": name,
            "nbytes": nbytes,
            "gbps": nbytes / p50 / 1e9 if nbytes else None,
            "p50_us": p50 * 1e6,
            "p99_us": p99 * 1e6,
            "samples": len(seconds),
            **extra,
        }
        self.rows.append(row)
        if not self.quiet:
            print(
                f"  {group:<10} {name:<48} {fmt_nbytes(nbytes):>9}  p50 {p50 * 1e6:10.1f} us",
                file=sys.stderr,
            )

    def skip(self, group: str, name: str, reason: str, **extra: Any) -> None:
        self.rows.append({"group": group, "name": name, "skipped": reason, **extra})
        if not self.quiet:
            print(f"  {group:<10} {name:<48} skipped: {reason}", file=sys.stderr)


def fmt_nbytes(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def timed(action: Callable[[], object], repeats: int) -> list[float]:
    """Seconds each of `repeats` calls of `action` took."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return samples


def cpu_ns(pid: int) -> int | None:
    """CPU time another process has used, all threads, in ns (the scheduler's own count: psutil's clock
    ticks are 10 ms, too coarse for a few thousand calls of a few hundred microseconds). None where the
    kernel keeps no such count (no /proc/PID/task/*/schedstat)."""
    total, read = 0, False
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int((task / "schedstat").read_text().split()[0])
            read = True
    return total if read else None


# The C copy kernel's entry point (`llm_datadist._shm._copykernel.copy_runs`: src_base, dst_base, the
# src offsets, dst offsets and lengths, nontemporal, and optionally helper).
KernelCopy = Callable[..., None]


def copy_kernel() -> KernelCopy | None:
    """The copy kernel's `copy_runs`, or None where it was not built (or LLM_DATADIST_NO_EXTENSION asks
    for the pure-Python path)."""
    if os.environ.get("LLM_DATADIST_NO_EXTENSION", "") not in ("", "0"):
        return None
    try:
        from llm_datadist._shm._copykernel import copy_runs
    except ImportError:
        return None
    return copy_runs


def copy_samples(
    nbytes: int,
    threads: int,
    repeats: int,
    *,
    kernel: KernelCopy | None = None,
    shared: bool = False,
) -> list[float]:
    """`timed` copies of `nbytes` between two warm private buffers, split over `threads`: numpy.copyto
    (memcpy), or with `kernel` the copy kernel's streaming stores (one call per thread, GIL released).
    `shared`: between two segments of shared memory (`ext.shared_arrays`) instead, as every pull between
    caches of the library copies."""
    src, dst = _buffers(nbytes, shared)
    src.fill(7)
    np.copyto(dst, src)  # warm: both buffers faulted in
    bounds = np.linspace(0, nbytes, threads + 1, dtype=np.int64)
    src_base, dst_base = src.ctypes.data, dst.ctypes.data
    columns = [
        (
            np.array([bounds[i]], dtype=np.uint64),
            np.array([bounds[i + 1] - bounds[i]], dtype=np.uint64),
        )
        for i in range(threads)
    ]

    def part(i: int) -> None:
        if kernel is None:
            np.copyto(dst[bounds[i] : bounds[i + 1]], src[bounds[i] : bounds[i + 1]])
            return
        offsets, lengths = columns[i]
        kernel(src_base, dst_base, offsets, offsets, lengths, True)

    def once() -> None:
        workers = [threading.Thread(target=part, args=(i,)) for i in range(1, threads)]
        for worker in workers:
            worker.start()
        part(0)
        for worker in workers:
            worker.join()

    return timed(once, repeats)


def _buffers(nbytes: int, shared: bool) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Two buffers of `nbytes`: private numpy memory, or each in a segment of shared memory of its own."""
    if not shared:
        return np.empty(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    from llm_datadist.ext import shared_arrays

    return shared_arrays(1, nbytes, np.uint8)[0], shared_arrays(1, nbytes, np.uint8)[0]


def scattered_samples(
    tensors: int, tensor_blocks: int, block_nbytes: int, count: int, repeats: int, kernel: KernelCopy
) -> list[float]:
    """The copy of a paged pull with nothing of the library around it: `count` random blocks of each of
    `tensors` tensors (`tensor_blocks` blocks of `block_nbytes` each) into random blocks of as many, drawn
    anew for each copy (only the copy is timed), between two segments of shared memory, with one call of
    the kernel that shares the copy with its helper thread, as the library's pulls copy."""
    tensor_nbytes = tensor_blocks * block_nbytes
    src, dst = _buffers(tensors * tensor_nbytes, True)
    src.fill(7)
    np.copyto(dst, src)
    rng = np.random.default_rng(0)
    starts = np.repeat(np.arange(tensors, dtype=np.uint64) * tensor_nbytes, count)
    lengths = np.full(tensors * count, block_nbytes, dtype=np.uint64)

    def table() -> np.ndarray[Any, Any]:
        blocks = [rng.choice(tensor_blocks, count, replace=False) for _ in range(tensors)]
        return starts + np.concatenate(blocks).astype(np.uint64) * block_nbytes

    samples = []
    for _ in range(repeats):
        src_at, dst_at = table(), table()
        started = time.perf_counter()
        kernel(src.ctypes.data, dst.ctypes.data, src_at, dst_at, lengths, True, True)
        samples.append(time.perf_counter() - started)
    return samples


class Child:
    """A spawned process running `target(pipe, *args)`; it answers with ("ok", value) or ("error", text)."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.process.start()
        child.close()

    def reply(self, timeout_s: float) -> Any:
        """The next answer's value; TimeoutError, or RuntimeError with the helper's error text."""
        if not self.pipe.poll(timeout_s):
            raise TimeoutError(f"the helper process did not answer within {timeout_s:.0f} s")
        try:
            status, value = self.pipe.recv()
        except EOFError:
            raise RuntimeError(f"the helper process exited with code {self.process.exitcode}") from None
        if status != "ok":
            raise RuntimeError(f"the helper process failed: {value}")
        return value

    def close(self) -> None:
        """Ask it to stop ("stop" is every helper's last command), then kill it if it did not."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.pipe.send(("stop", None))
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self.pipe.close()


@dataclass(frozen=True)
class BlockPattern:
    """`table` blocks of `block_nbytes` per tensor, over `tensors` tensors of `pool_blocks` blocks each (a
    paged pool twice the size of the table), read from `src_blocks` into `dst_blocks` of every tensor: a
    paged KV cache's block table. One tensor's pool is `pool_blocks * block_nbytes` contiguous bytes."""

    block_nbytes: int
    tensors: int
    pool_blocks: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]

    @property
    def table(self) -> int:
        return len(self.src_blocks)

    @property
    def nbytes(self) -> int:
        """Bytes one read of the pattern moves."""
        return self.tensors * self.table * self.block_nbytes

    @property
    def tensor_nbytes(self) -> int:
        return self.pool_blocks * self.block_nbytes


def block_patterns(quick: bool) -> list[BlockPattern]:
    """The patterns of one run: 64 tensors x 16/64/256 KiB blocks, 8 MiB per tensor read (1 MiB quick),
    at most 256 blocks per tensor, the blocks drawn at random from a pool twice the table's size."""
    per_tensor_nbytes = (1 << 20) if quick else (8 << 20)
    rng = np.random.default_rng(0)
    patterns = []
    for block_nbytes in BLOCK_SIZES:
        table = max(4, min(256, per_tensor_nbytes // block_nbytes))
        pool_blocks = 2 * table
        src_blocks = tuple(int(b) for b in rng.permutation(pool_blocks)[:table])
        dst_blocks = tuple(int(b) for b in rng.permutation(pool_blocks)[:table])
        patterns.append(BlockPattern(block_nbytes, BLOCK_TENSORS, pool_blocks, src_blocks, dst_blocks))
    return patterns
