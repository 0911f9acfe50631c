"""Executes copy plans from `shm.copyplan`, splitting large ones over a small pool of threads.

Rules: numpy releases the GIL inside `copyto`, so two threads reach the memory's bandwidth on two cores;
small plans run inline on the caller's thread (a thread hand-off costs more than it saves). The whole
plan is bounds-checked once before any byte moves.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from shm.copyplan import (
    BlockPlan,
    Run,
    StridedCopy,
    check_runs,
    execute,
    execute_blocks,
    execute_strided,
    split_runs,
)

ENV_COPY_THREADS = "LLM_DATADIST_COPY_THREADS"
# Below this much per thread a hand-off to another thread costs more than it saves.
_MIN_PART_NBYTES = 4 << 20


def address_view(address: int, nbytes: int) -> np.ndarray:
    """A uint8 array over `nbytes` of this process's memory at `address` (memory the user registered).

    The caller guarantees the range is mapped where it is touched: only the planned runs are.
    """
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(address))


def _default_threads() -> int:
    configured = os.environ.get(ENV_COPY_THREADS)
    if configured and configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, min(4, os.cpu_count() or 1))


class Copier:
    """Runs copy plans; one instance per process, shared by every pull."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads if threads is not None else _default_threads()
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def run(self, runs: Sequence[Run], src: np.ndarray, dst: np.ndarray) -> None:
        check_runs(runs, src.nbytes, dst.nbytes)
        parts = split_runs(runs, self.threads) if self.threads > 1 else [list(runs)]
        if len(parts) <= 1:
            execute(runs, src, dst)
            return

        def work(indices: range) -> None:
            for index in indices:
                execute(parts[index], src, dst)

        self._in_parts(len(parts), len(parts), work)

    def run_strided(self, copy: StridedCopy, src: np.ndarray, dst: np.ndarray) -> None:
        """Execute a strided copy: one numpy call, or one per thread over disjoint rows when it is large
        (contiguous rows on both sides are first split into halves of one big run)."""
        copy.check(src.nbytes, dst.nbytes)
        total = copy.rows * copy.nbytes
        parts = self.threads if total >= 2 * _MIN_PART_NBYTES else 1
        if parts > 1 and copy.rows < parts:
            # Few large rows: cut each row instead (one run per row, split as runs are).
            runs = [
                Run(copy.src_offset + i * copy.src_stride, copy.dst_offset + i * copy.dst_stride, copy.nbytes)
                for i in range(copy.rows)
            ]
            self.run(runs, src, dst)
            return
        if parts <= 1:
            execute_strided(copy, src, dst)
            return
        self._in_parts(copy.rows, parts, lambda rows: execute_strided(copy, src, dst, rows))

    def run_blocks(self, plan: BlockPlan, src: np.ndarray, dst: np.ndarray) -> None:
        """Execute a paged plan, its tensors split over the copy threads when it is large."""
        plan.check(src.nbytes, dst.nbytes)
        count = len(plan.src_tensor_offsets)
        parts = min(self.threads, count) if plan.total_nbytes >= 2 * _MIN_PART_NBYTES else 1
        if parts <= 1:
            execute_blocks(plan, src, dst)
            return
        self._in_parts(count, parts, lambda tensors: execute_blocks(plan, src, dst, tensors))

    def _in_parts(self, count: int, parts: int, work: Callable[[range], None]) -> None:
        """Run `work` over `parts` disjoint slices of range(count): the first on this thread, the others
        on the pool, and wait for all (an exception in any of them is raised here)."""
        bounds = [count * i // parts for i in range(parts + 1)]
        executor = self._get_executor()
        futures: list[Future[None]] = [
            executor.submit(work, range(bounds[i], bounds[i + 1])) for i in range(1, parts)
        ]
        try:
            work(range(bounds[0], bounds[1]))
        finally:
            for future in futures:
                future.result()

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self.threads - 1, thread_name_prefix="llmdd-copy"
                )
            return self._executor

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
