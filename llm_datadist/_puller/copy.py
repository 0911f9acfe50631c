"""Executes copy plans from `shm.copyplan`, splitting large ones over a small pool of threads.

Rules: numpy releases the GIL inside `copyto`, so two threads reach the memory's bandwidth on two cores;
small plans run inline on the caller's thread (a thread hand-off costs more than it saves). The whole
plan is bounds-checked once before any byte moves. Every copy between mappings goes through the optional C
kernel (`llm_datadist._shm._copykernel`: one call per thread, non-temporal stores for large copies) when
it was built; without it, or with the environment variable LLM_DATADIST_NO_EXTENSION=1, through
process_vm_readv on this very process. Both turn memory vanishing under a mapping (a file another process
truncated) into an error for that copy, where a load through the mapping would kill the process with
SIGBUS; numpy copies only arrays that overlap, or where the kernel refuses process_vm_readv.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from llm_datadist._shm.copyplan import (
    BlockPlan,
    Run,
    StridedCopy,
    block_runs,
    check_runs,
    execute,
    execute_block_runs,
    execute_blocks,
    execute_strided,
    split_runs,
)
from llm_datadist._shm.errors import InvalidRange, ShmError

from .._native import CopyRuns, kernel_function, load_copy_kernel, vm_columns
from .._signals import held
from .vm import VmError, VmNotPermitted, VmRun, read_from, read_from_arrays, write_to_arrays

ENV_COPY_THREADS = "LLM_DATADIST_COPY_THREADS"
# Below this much per thread a hand-off to another thread costs more than it saves.
_MIN_PART_NBYTES = 4 << 20
# Without the C kernel, paged copies with units at least this large take one numpy call per unit (one pass,
# few calls); smaller units go through the kernel's scatter-gather copy (process_vm_readv on this process:
# one pass, one call per 1024 units). Measured on 2 cores, 64 tensors of scattered blocks, bytes per second
# with 2 threads:
#   unit     gather+scatter   kernel   numpy per unit
#   16 KiB   7.6 GB/s         8.0      2.8
#   64 KiB   7.4              9.8      7.9
#   256 KiB  7.7              9.3      10.6
_PER_UNIT_MIN_NBYTES = 128 << 10
# The C kernel (shm/_copykernel.c) copies a thread's whole share of runs in one call, and with streaming
# (non-temporal) stores it skips reading each destination line into the cache before overwriting it. Two
# runs on 2 cores (AMD EPYC, 2 MiB L2 per core, 32 MiB L3), 2 threads, /dev/shm to /dev/shm, as ratios to
# a 512 MiB 2-thread numpy.copyto (13.2-13.6 GB/s) in the same run:
#   copy                                   no extension   C memcpy    C streaming
#   64 tensors x 256 x 16 KiB scattered    0.36 / 0.20    0.62 / 0.59   0.76 / 0.69
#   64 tensors x 128 x 64 KiB scattered    0.50 / 0.39    0.85 / 0.50   1.18 / 0.80
#   64 tensors x 32 x 256 KiB scattered    0.89 / 0.82    0.92 / 0.92   1.37 / 1.29
#   64 tensors x 8 x 16 KiB (8 MiB)        0.48 / 0.47    1.27 / 1.45   1.95 / 1.91
#   64 x 4 MiB slices, strided             0.74 / 0.71    (numpy)       1.35 / 1.37
#   2 runs x 256 MiB                       0.88 / 0.86    0.89 / 0.60   0.95 / 1.27
# (glibc's memcpy streams only single copies far larger than a block.) Below 512 KiB plain stores leave the
# destination in cache for whoever reads it next, and one small run stays a numpy call (the latency of a
# small pull by key). From there up streaming pays even on one thread: one layer of a 32-layer request of
# 1 MiB tensors (2 runs x 1 MiB, cold) copied in 111 us streaming against 213 us with memcpy (numpy on two
# threads: 156 us, the hand-off to the second thread alone costing about 25 us), and 32 such layer pulls
# took 5.9-6.1 ms against 7.6-7.9 ms with a 4 MiB threshold. Since the kernel streams four spans at once
# (its lanes), a layer of 2 x 256 KiB (cold) streams in a median 43-50 us against 58-77 us with plain
# stores (three pairs of runs of 32 layer pulls, alternating): streaming from 512 KiB.
_STREAMING_MIN_NBYTES = 512 << 10


# Module-level so that tests can swap it (None: the pure-Python path).
_copy_runs = load_copy_kernel()
_copy_run: Callable[[int, int, int, bool], None] | None = (
    None if _copy_runs is None else kernel_function("copy_run")
)
_load_word: Callable[[int], int] | None = None if _copy_runs is None else kernel_function("load_word")


def load_word(address: int) -> int:
    """The aligned 8-byte word at `address` of a mapping (a peer's generation word), guarded as copies are:
    ShmError, not SIGBUS, if the memory vanished under the mapping (the C kernel's guarded load; without it,
    process_vm_readv on this process)."""
    if _copy_runs is not None and _load_word is not None:
        try:
            return _load_word(address)
        except OSError as exc:
            raise ShmError(f"reading the word at {address:#x} failed: {exc}") from exc
    word = ctypes.c_uint64()
    try:
        read_from(os.getpid(), [VmRun(ctypes.addressof(word), address, 8)])
    except VmNotPermitted:
        return int(ctypes.c_uint64.from_address(address).value)  # nothing guarded is allowed here
    except VmError as exc:
        raise ShmError(f"reading the word at {address:#x} failed: {exc}") from exc
    return int(word.value)


def load_words(addresses: tuple[int, ...]) -> list[int]:
    """`load_word` of each of `addresses`, in order."""
    return [load_word(address) for address in addresses]


def _kernel_can_copy(src: np.ndarray[Any, Any], dst: np.ndarray[Any, Any]) -> bool:
    """The C kernel takes a base address per side: each array must be one contiguous range, the two must
    not overlap (runs could then depend on each other's writes), and dst writable (numpy would refuse)."""
    if not dst.flags.writeable:
        raise ValueError("the destination array is read-only")
    return bool(src.flags.c_contiguous and dst.flags.c_contiguous and not np.may_share_memory(src, dst))


def _cut_runs(
    src_offsets: np.ndarray[Any, Any],
    dst_offsets: np.ndarray[Any, Any],
    lengths: np.ndarray[Any, Any],
    parts: int,
) -> list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    """The runs in `parts` slices of about equal bytes (a run across a cut is split between two slices)."""
    run_starts = np.cumsum(lengths) - lengths  # where each run starts among the plan's bytes
    total = int(run_starts[-1] + lengths[-1])
    pieces = []
    for i in range(parts):
        low, high = total * i // parts, total * (i + 1) // parts
        if low == high:
            continue
        first = int(np.searchsorted(run_starts, low, side="right")) - 1  # the run holding byte `low`
        stop = int(np.searchsorted(run_starts, high, side="left"))  # runs [first, stop) meet [low, high)
        src_part, dst_part, nbytes = (
            src_offsets[first:stop].copy(),
            dst_offsets[first:stop].copy(),
            lengths[first:stop].copy(),
        )
        skip = low - int(run_starts[first])
        src_part[0] += skip
        dst_part[0] += skip
        nbytes[0] -= skip
        nbytes[-1] -= int(run_starts[stop - 1]) + int(lengths[stop - 1]) - high
        pieces.append((src_part, dst_part, nbytes))
    return pieces


def _default_threads() -> int:
    configured = os.environ.get(ENV_COPY_THREADS)
    if configured and configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, min(4, os.cpu_count() or 1))


def _started_pool(workers: int) -> ThreadPoolExecutor:
    """A pool whose `workers` threads all exist when this returns (ThreadPoolExecutor starts them one per
    submit, and only while none is idle: tasks that wait for each other make it start every one)."""
    executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llmdd-copy")
    barrier = threading.Barrier(workers)

    def meet() -> None:
        barrier.wait(timeout=10.0)

    with held():  # its threads leave SIGTERM and SIGINT to the program's main thread (`_signals`)
        futures = [executor.submit(meet) for _ in range(workers)]
    for future in futures:
        future.result(timeout=15.0)
    return executor


class Copier:
    """Runs copy plans; one instance per process, shared by every pull."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads if threads is not None else _default_threads()
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        # False once the kernel refused a copy within this process (a seccomp filter, no such call).
        self._kernel_copies = True

    def run(self, runs: Sequence[Run], src: np.ndarray[Any, Any], dst: np.ndarray[Any, Any]) -> None:
        check_runs(runs, src.nbytes, dst.nbytes)
        if not runs:
            return
        if _kernel_can_copy(src, dst):
            if len(runs) == 1:
                run = runs[0]
                src_address, dst_address = src.ctypes.data + run.src_offset, dst.ctypes.data + run.dst_offset
                if self._copy_one(src_address, dst_address, run.nbytes):
                    return
            else:
                columns = np.array(
                    [(run.src_offset, run.dst_offset, run.nbytes) for run in runs], dtype=np.uint64
                )
                offsets = np.ascontiguousarray(columns.T)
                if self._guarded_runs(src, dst, offsets[0], offsets[1], offsets[2], "runs"):
                    return
        parts = split_runs(runs, self.threads) if self.threads > 1 else [list(runs)]
        if len(parts) <= 1:
            execute(runs, src, dst)
            return

        def work(indices: range) -> None:
            for index in indices:
                execute(parts[index], src, dst)

        self._in_parts(len(parts), len(parts), work)

    def run_columns(
        self,
        src: np.ndarray[Any, Any],
        dst: np.ndarray[Any, Any],
        src_offsets: np.ndarray[Any, Any],
        dst_offsets: np.ndarray[Any, Any],
        lengths: np.ndarray[Any, Any],
    ) -> None:
        """`run` for runs given as three int64 columns (run i: lengths[i] bytes from src_offsets[i] of `src`
        to dst_offsets[i] of `dst`), checked and copied with no Python per run."""
        if not lengths.size:
            return
        src_ends, dst_ends = src_offsets + lengths, dst_offsets + lengths
        if (
            min(int(src_offsets.min()), int(dst_offsets.min()), int(lengths.min())) < 0
            or int(src_ends.max()) > src.nbytes
            or int(dst_ends.max()) > dst.nbytes
        ):
            raise InvalidRange(
                f"runs reach outside a {src.nbytes}-byte source or a {dst.nbytes}-byte destination"
            )
        if _kernel_can_copy(src, dst) and self._guarded_runs(
            src,
            dst,
            src_offsets.astype(np.uint64),
            dst_offsets.astype(np.uint64),
            lengths.astype(np.uint64),
            "runs",
        ):
            return
        runs = zip(src_offsets.tolist(), dst_offsets.tolist(), lengths.tolist(), strict=True)
        self.run([Run(*run) for run in runs], src, dst)

    def one_call(self, total: int) -> int:
        """How a pull's copy of `total` bytes runs inside its call of the kernel: the kernel's `copy` flags
        (1: there; | 2: streaming stores; | 4: the kernel's helper thread takes a share, when this process
        copies on more than one thread, two threads in all). 0 when more copy threads than two would take
        it (`copy_addresses`)."""
        if min(self.threads, total // _MIN_PART_NBYTES) > 2:
            return 0
        return 1 | (2 if total >= _STREAMING_MIN_NBYTES else 0) | (4 if self.threads > 1 else 0)

    def copy_addresses(self, src: np.ndarray[Any, Any], dst: np.ndarray[Any, Any], nbytes: int) -> bool:
        """`nbytes` from each address of uint64 column `src` to the same row of `dst` (addresses the caller
        checked and keeps mapped), through the C kernel, cut over the copy threads when large; False when
        there is no kernel (nothing done)."""
        if _copy_runs is None:
            return False
        lengths = np.full(src.size, nbytes, np.uint64)
        self._c_copy(_copy_runs, 0, 0, src, dst, lengths, "a fresh pull")
        return True

    # Every copy between two mappings goes through the C kernel or through process_vm_readv on this very
    # process: either turns memory vanishing under a mapping (a peer's segment, or ours, truncated by
    # another process) into an error for that copy, where numpy would die of SIGBUS. Only arrays that
    # overlap (a copy inside one cache of this process), or a process where the kernel refuses such copies
    # (a seccomp filter), copy with numpy.

    def _copy_one(self, src_address: int, dst_address: int, nbytes: int) -> bool:
        """One run between raw addresses, guarded; False when neither guarded way may copy (nothing done).
        A large one is cut over the copy threads."""
        if _copy_runs is not None and nbytes >= 2 * _MIN_PART_NBYTES and self.threads > 1:
            zero = np.zeros(1, dtype=np.uint64)
            self._c_copy(
                _copy_runs, src_address, dst_address, zero, zero, np.full(1, nbytes, np.uint64), "run"
            )
            return True
        if _copy_runs is not None and _copy_run is not None:
            try:
                _copy_run(src_address, dst_address, nbytes, nbytes >= _STREAMING_MIN_NBYTES)
            except OSError as exc:
                raise ShmError(f"copying a run within this process failed: {exc}") from exc
            return True
        if not self._kernel_copies:
            return False
        return self._self_copy(
            np.array([dst_address], dtype=np.uint64),
            np.array([src_address], dtype=np.uint64),
            np.array([nbytes], dtype=np.uint64),
            1,
            "a run",
        )

    def _guarded_runs(
        self,
        src: np.ndarray[Any, Any],
        dst: np.ndarray[Any, Any],
        src_offsets: np.ndarray[Any, Any],
        dst_offsets: np.ndarray[Any, Any],
        lengths: np.ndarray[Any, Any],
        what: str,
    ) -> bool:
        """Checked runs (uint64 columns of offsets into src and dst), guarded; False when neither guarded
        way may copy (nothing done)."""
        if _copy_runs is not None:
            self._c_copy(
                _copy_runs, src.ctypes.data, dst.ctypes.data, src_offsets, dst_offsets, lengths, what
            )
            return True
        if not self._kernel_copies:
            return False
        total = int(lengths.sum())
        parts = self.threads if total >= 2 * _MIN_PART_NBYTES and lengths.size > 1 else 1
        local = np.uint64(dst.ctypes.data) + dst_offsets
        return self._self_copy(local, np.uint64(src.ctypes.data) + src_offsets, lengths, parts, what)

    def _self_copy(
        self,
        local: np.ndarray[Any, Any],
        remote: np.ndarray[Any, Any],
        nbytes: np.ndarray[Any, Any],
        parts: int,
        what: str,
    ) -> bool:
        """process_vm_readv on this process (remote -> local); False when the kernel refuses such copies
        here (nothing to trust in the destination yet: the caller copies another way)."""
        try:
            self._kernel_copy(os.getpid(), local, remote, nbytes, parts)
        except VmNotPermitted:
            self._kernel_copies = False
            return False
        except VmError as exc:
            if exc.errno == errno.ENOSYS:
                self._kernel_copies = False
                return False
            # The runs were checked against both arrays, so only memory vanishing under a mapping (a
            # segment truncated by another process) gets here.
            raise ShmError(f"copying {what} within this process failed: {exc}") from exc
        return True

    def run_strided(self, copy: StridedCopy, src: np.ndarray[Any, Any], dst: np.ndarray[Any, Any]) -> None:
        """Execute a strided copy: one numpy call, or one per thread over disjoint rows when it is large
        (contiguous rows on both sides are first split into halves of one big run)."""
        copy.check(src.nbytes, dst.nbytes)
        total = copy.rows * copy.nbytes
        if total and _kernel_can_copy(src, dst):
            if copy.src_stride == copy.dst_stride == copy.nbytes:  # rows back to back on both sides
                rows, stride_src, stride_dst, nbytes = 1, 0, 0, total
            else:
                rows, stride_src, stride_dst, nbytes = (
                    copy.rows,
                    copy.src_stride,
                    copy.dst_stride,
                    copy.nbytes,
                )
            if rows == 1:
                src_address, dst_address = (
                    src.ctypes.data + copy.src_offset,
                    dst.ctypes.data + copy.dst_offset,
                )
                if self._copy_one(src_address, dst_address, nbytes):
                    return
            else:
                row_indices = np.arange(rows, dtype=np.uint64)
                if self._guarded_runs(
                    src,
                    dst,
                    np.uint64(copy.src_offset) + row_indices * np.uint64(stride_src),
                    np.uint64(copy.dst_offset) + row_indices * np.uint64(stride_dst),
                    np.full(rows, nbytes, dtype=np.uint64),
                    "rows",
                ):
                    return
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

    def run_blocks(self, plan: BlockPlan, src: np.ndarray[Any, Any], dst: np.ndarray[Any, Any]) -> None:
        """Execute a paged plan in one pass over the bytes where it can (see _PER_UNIT_MIN_NBYTES), split
        over the copy threads when it is large. Overlapping arrays take the gather-then-scatter path."""
        plan.check(src.nbytes, dst.nbytes)
        if not dst.flags.writeable:  # process_vm_readv would write into it regardless
            raise ValueError("the destination array is read-only")
        count = len(plan.src_tensor_offsets)
        if not count or not plan.src_units.size:
            return
        copy_runs = _copy_runs
        if copy_runs is not None and _kernel_can_copy(src, dst):
            src_starts, dst_starts, lengths = block_runs(plan)
            src_offsets = np.asarray(plan.src_tensor_offsets, dtype=np.uint64)[:, None] + src_starts.astype(
                np.uint64
            )
            dst_offsets = np.asarray(plan.dst_tensor_offsets, dtype=np.uint64)[:, None] + dst_starts.astype(
                np.uint64
            )
            nbytes = np.broadcast_to(lengths.astype(np.uint64), src_offsets.shape)
            self._c_copy(
                copy_runs,
                src.ctypes.data,
                dst.ctypes.data,
                src_offsets.ravel(),
                dst_offsets.ravel(),
                nbytes.ravel(),
                "blocks",
            )
            return
        parts = self.threads if plan.total_nbytes >= 2 * _MIN_PART_NBYTES else 1
        execute = execute_blocks
        if not np.may_share_memory(src, dst):
            if self._kernel_copies and self._kernel_blocks(plan, src, dst, parts):
                return  # guarded (see `_copy_one`)
            if plan.nbytes >= _PER_UNIT_MIN_NBYTES:
                execute = execute_block_runs
        parts = min(parts, count)
        if parts <= 1:
            execute(plan, src, dst)
            return
        self._in_parts(count, parts, lambda tensors: execute(plan, src, dst, tensors))

    def run_vm(
        self,
        pid: int,
        local: np.ndarray[Any, Any],
        remote: np.ndarray[Any, Any],
        nbytes: np.ndarray[Any, Any],
        *,
        write: bool,
    ) -> None:
        """Cross-memory copies with process `pid` (reads, or writes with `write`): run i moves nbytes[i]
        between local[i] here and remote[i] there (uint64 columns), split over the copy threads by bytes
        when there is enough to split. Raises what `vm` raises."""
        total = int(nbytes.sum())
        parts = self.threads if total >= 2 * _MIN_PART_NBYTES and nbytes.size > 1 else 1
        self._kernel_copy(pid, local, remote, nbytes, parts, write=write)

    def _kernel_copy(
        self,
        pid: int,
        local: np.ndarray[Any, Any],
        remote: np.ndarray[Any, Any],
        nbytes: np.ndarray[Any, Any],
        parts: int,
        *,
        write: bool = False,
    ) -> None:
        """The runs in `parts` slices of about equal bytes, one per copy thread."""
        copy = write_to_arrays if write else read_from_arrays
        if parts <= 1:
            copy(pid, local, remote, nbytes)
            return
        ends = np.cumsum(nbytes)
        cuts = [0, *np.searchsorted(ends, [int(ends[-1]) * i // parts for i in range(1, parts)]).tolist()]
        cuts.append(int(nbytes.size))

        def work(indices: range) -> None:
            for i in indices:
                a, b = cuts[i], cuts[i + 1]
                if a < b:
                    copy(pid, local[a:b], remote[a:b], nbytes[a:b])

        self._in_parts(parts, parts, work)

    def _kernel_blocks(
        self, plan: BlockPlan, src: np.ndarray[Any, Any], dst: np.ndarray[Any, Any], parts: int
    ) -> bool:
        """The plan as one scatter-gather list for process_vm_readv on this very process, cut into `parts`
        of about equal bytes. False (nothing to trust in dst yet) when the kernel refuses such copies."""
        src_starts, dst_starts, lengths = block_runs(plan)
        dst_address, src_address = dst.ctypes.data, src.ctypes.data
        local, remote, nbytes = vm_columns(
            [dst_address + offset for offset in plan.dst_tensor_offsets],
            dst_starts.tolist(),
            [src_address + offset for offset in plan.src_tensor_offsets],
            src_starts.tolist(),
            lengths.tolist(),
        )
        return self._self_copy(local, remote, nbytes, parts, "blocks")

    def _c_copy(
        self,
        copy_runs: CopyRuns,
        src_address: int,
        dst_address: int,
        src_offsets: np.ndarray[Any, Any],
        dst_offsets: np.ndarray[Any, Any],
        lengths: np.ndarray[Any, Any],
        what: str,
    ) -> None:
        """Checked runs (uint64 columns of offsets from the two base addresses) through the C kernel,
        streaming stores when the copy is large: one call, which the kernel's helper thread shares when
        this process copies on two threads (`one_call`), else one call per copy thread over slices of about
        equal bytes."""
        total = int(lengths.sum())
        if not total:
            return
        parts = max(1, min(self.threads, total // _MIN_PART_NBYTES))
        streaming = total >= _STREAMING_MIN_NBYTES
        helper = bool(self.one_call(total) & 4)
        pieces = _cut_runs(src_offsets, dst_offsets, lengths, parts) if parts > 1 and not helper else None

        def work(indices: range) -> None:
            for i in indices:
                if pieces is None:
                    copy_runs(src_address, dst_address, src_offsets, dst_offsets, lengths, streaming, helper)
                else:
                    copy_runs(src_address, dst_address, *pieces[i], streaming)

        try:
            if pieces is None:
                work(range(1))
            else:
                self._in_parts(len(pieces), len(pieces), work)
        except OSError as exc:
            # The runs were checked against both arrays, so only memory vanishing under a mapping (a
            # segment truncated by its owner) gets here: the kernel turns that SIGBUS into EFAULT.
            raise ShmError(f"copying {what} within this process failed: {exc}") from exc

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
                self._executor = _started_pool(self.threads - 1)
            return self._executor

    def start(self) -> None:
        """Start the copy threads now rather than at the first large copy, so that a process's thread
        count is the same from `init` on (a long-lived process stays flat on every figure)."""
        if self.threads > 1:
            self._get_executor()

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
