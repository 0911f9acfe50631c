"""The Copier's paths (the C kernel when built; without it kernel scatter-gather, one numpy call per unit,
gather+scatter), on one thread and split over threads, against per-block and per-run references; and that
each path is the one actually taken. Tests that take `c_kernel` run once with the C kernel (skipped when it
was not built) and once without it, as with LLM_DATADIST_NO_EXTENSION=1."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_datadist import _native
from llm_datadist._puller import copy as _copy
from llm_datadist._puller.copy import Copier
from llm_datadist._shm.copyplan import BlockPlan, Run, StridedCopy
from llm_datadist._shm.errors import InvalidRange
from tests.shm.test_shm_blockplan import reference_blocks

try:
    from llm_datadist._shm._copykernel import copy_runs as built_kernel
except ImportError:  # no compiler when the project was installed
    built_kernel = None
needs_extension = pytest.mark.skipif(built_kernel is None, reason="the optional C copy kernel was not built")


def _plan(
    rng: np.random.Generator, tensors: int, pool: int, table: int, unit: int, *, runs: bool
) -> BlockPlan:
    if runs:  # ascending on both sides, so neighbouring units merge into longer runs
        src_units = sorted(rng.choice(pool, table, replace=False).tolist())
        dst_units = sorted(rng.choice(pool, table, replace=False).tolist())
    else:
        src_units = rng.permutation(pool)[:table].tolist()
        dst_units = rng.permutation(pool)[:table].tolist()
    span = pool * unit
    return BlockPlan.make(
        [t * span for t in range(tensors)],
        [t * span for t in range(tensors)],
        src_units,
        dst_units,
        unit,
        unit,
        unit,
    )


@pytest.fixture
def copier() -> Any:
    copier = Copier(threads=2)
    yield copier
    copier.close()


@pytest.fixture(params=[pytest.param(True, marks=needs_extension), False], ids=["c-kernel", "no-extension"])
def c_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """The Copier with the C kernel, or with the pure-Python paths (as LLM_DATADIST_NO_EXTENSION=1 gives)."""
    monkeypatch.setattr(_copy, "_copy_runs", built_kernel if request.param else None)
    return bool(request.param)


@pytest.mark.parametrize(
    ("unit", "tensors", "table"),
    [
        (16 << 10, 4, 8),  # small: one thread
        (16 << 10, 8, 96),  # 12 MiB: split over both threads
        (256 << 10, 2, 4),  # per-unit numpy copies, one thread
        (256 << 10, 4, 12),  # per-unit numpy copies, two threads
    ],
)
@pytest.mark.parametrize("runs", [False, True])
@pytest.mark.parametrize("kernel", [True, False])
def test_paged_copies_match_the_reference(
    copier: Copier, c_kernel: bool, unit: int, tensors: int, table: int, runs: bool, kernel: bool
) -> None:
    rng = np.random.default_rng(unit + tensors + table)
    plan = _plan(rng, tensors, 2 * table, table, unit, runs=runs)
    src = rng.integers(0, 256, tensors * 2 * table * unit, dtype=np.uint8)
    dst = rng.integers(0, 256, src.size, dtype=np.uint8)
    want = reference_blocks(plan, src, dst)
    copier._kernel_copies = kernel
    copier.run_blocks(plan, src, dst)
    np.testing.assert_array_equal(dst, want)
    assert copier._kernel_copies is kernel  # the kernel accepted every copy it was asked for


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 40),
    st.integers(1, 4096),
    st.booleans(),
    st.integers(0, 2**32 - 1),
    st.booleans() if built_kernel is not None else st.just(False),
)
def test_any_small_paged_plan_through_the_kernel_matches(
    tensors: int, table: int, unit: int, runs: bool, seed: int, c_kernel: bool
) -> None:
    rng = np.random.default_rng(seed)
    plan = _plan(rng, tensors, table + 3, table, unit, runs=runs)
    src = rng.integers(0, 256, tensors * (table + 3) * unit, dtype=np.uint8)
    dst = rng.integers(0, 256, src.size, dtype=np.uint8)
    want = reference_blocks(plan, src, dst)
    copier = Copier(threads=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_copy, "_copy_runs", built_kernel if c_kernel else None)
        copier.run_blocks(plan, src, dst)
    np.testing.assert_array_equal(dst, want)
    assert copier._kernel_copies


def test_each_path_is_the_one_taken(copier: Copier, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the C kernel."""
    monkeypatch.setattr(_copy, "_copy_runs", None)
    taken: list[str] = []
    monkeypatch.setattr(_copy, "read_from_arrays", _spy(taken, "kernel", _copy.read_from_arrays))
    monkeypatch.setattr(_copy, "execute_block_runs", _spy(taken, "per-unit", _copy.execute_block_runs))
    monkeypatch.setattr(_copy, "execute_blocks", _spy(taken, "gather", _copy.execute_blocks))
    rng = np.random.default_rng(0)
    src = np.zeros(8 << 20, dtype=np.uint8)
    dst = np.zeros(8 << 20, dtype=np.uint8)

    def path(plan: BlockPlan, into: np.ndarray) -> set[str]:
        taken.clear()
        copier.run_blocks(plan, src, into)
        return set(taken)

    # Between two arrays every unit size goes through process_vm_readv on this process (a mapping that
    # shrinks under the copy is then an error, not SIGBUS).
    assert path(_plan(rng, 1, 16, 4, 64 << 10, runs=False), dst) == {"kernel"}
    assert path(_plan(rng, 1, 16, 4, 256 << 10, runs=False), dst) == {"kernel"}
    # Source and destination in one array: units could overlap, so gather everything first.
    assert path(_plan(rng, 1, 8, 4, 64 << 10, runs=False), src[: 4 << 20]) == {"gather"}
    copier._kernel_copies = False  # as after the kernel refused a copy: numpy
    assert path(_plan(rng, 1, 16, 4, 64 << 10, runs=False), dst) == {"gather"}
    assert path(_plan(rng, 1, 16, 4, 256 << 10, runs=False), dst) == {"per-unit"}


def test_a_plan_past_the_arrays_moves_nothing(copier: Copier, c_kernel: bool) -> None:
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(100, dtype=np.uint8)
    with pytest.raises(InvalidRange):
        copier.run_blocks(BlockPlan.make([0], [0], [0, 1], [0, 9], 10, 10, 10), src, dst[:95])
    with pytest.raises(InvalidRange):
        copier.run([Run(0, 0, 10), Run(10, 90, 11)], src, dst)
    with pytest.raises(InvalidRange):
        copier.run([Run(0, 0, 10), Run(91, 10, 10)], src, dst)
    with pytest.raises(InvalidRange):
        copier.run_strided(StridedCopy(0, 10, 0, 10, 11, 10), src, dst)
    assert not dst.any()


def test_a_read_only_destination_is_refused(copier: Copier, c_kernel: bool) -> None:
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(100, dtype=np.uint8)
    dst.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        copier.run([Run(0, 0, 10), Run(20, 20, 10)], src, dst)
    with pytest.raises(ValueError, match="read-only"):
        copier.run_blocks(BlockPlan.make([0], [0], [0, 1], [0, 9], 10, 10, 10), src, dst)
    assert not dst.any()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3333), st.integers(0, 3333), st.integers(0, 3333)), max_size=12),
    st.integers(0, 2**32 - 1),
    st.booleans() if built_kernel is not None else st.just(False),
)
def test_any_run_list_matches_a_per_run_reference(
    triples: list[tuple[int, int, int]], seed: int, c_kernel: bool
) -> None:
    """Odd sizes, unaligned offsets, zero-length runs, later runs overwriting earlier ones."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, 6666, dtype=np.uint8)
    dst = rng.integers(0, 256, 6667, dtype=np.uint8)
    runs = [Run(s, d, n) for s, d, n in triples]
    want = dst.copy()
    for run in runs:
        want[run.dst_offset : run.dst_offset + run.nbytes] = src[run.src_offset : run.src_offset + run.nbytes]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_copy, "_copy_runs", built_kernel if c_kernel else None)
        Copier(threads=1).run(runs, src, dst)
    np.testing.assert_array_equal(dst, want)


@pytest.mark.parametrize("nbytes", [3333, (4 << 20) + 3333])
def test_large_run_lists_and_strided_copies_split_over_threads(
    copier: Copier, c_kernel: bool, nbytes: int
) -> None:
    """Enough bytes to split over both threads, cut inside a run, and to take streaming stores."""
    rows, pitch = 5, nbytes + 4099
    rng = np.random.default_rng(nbytes)
    src = rng.integers(0, 256, rows * pitch + 7, dtype=np.uint8)
    dst = rng.integers(0, 256, rows * pitch + 7, dtype=np.uint8)
    runs = [Run(7 + (i * 3 % rows) * pitch, 1 + i * pitch, nbytes) for i in range(rows)]
    want = dst.copy()
    for run in runs:
        want[run.dst_offset : run.dst_offset + run.nbytes] = src[run.src_offset : run.src_offset + run.nbytes]
    copier.run(runs, src, dst)
    np.testing.assert_array_equal(dst, want)
    for copy in (
        StridedCopy(3, pitch, 5, pitch + 1, rows - 1, nbytes),
        StridedCopy(0, nbytes, 7, nbytes, 3, nbytes),
    ):
        want = dst.copy()
        for i in range(copy.rows):
            d, s = copy.dst_offset + i * copy.dst_stride, copy.src_offset + i * copy.src_stride
            want[d : d + copy.nbytes] = src[s : s + copy.nbytes]
        copier.run_strided(copy, src, dst)
        np.testing.assert_array_equal(dst, want)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=20), st.integers(1, 5))
def test_cut_runs_covers_every_byte_once_in_order(lengths: list[int], parts: int) -> None:
    src_offsets = np.cumsum([0, *lengths[:-1]], dtype=np.uint64) * np.uint64(3)
    dst_offsets = np.cumsum([0, *lengths[:-1]], dtype=np.uint64) + np.uint64(11)
    nbytes = np.array(lengths, dtype=np.uint64)
    if not sum(lengths):
        return
    pieces = _copy._cut_runs(src_offsets, dst_offsets, nbytes, parts)
    assert len(pieces) <= parts
    total = sum(lengths)
    sizes = [int(piece[2].sum()) for piece in pieces]
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1
    # Byte by byte, the pieces in order map the same source bytes to the same destination bytes.
    want = [
        (int(s) + k, int(d) + k)
        for s, d, n in zip(src_offsets, dst_offsets, nbytes, strict=True)
        for k in range(n)
    ]
    got = [
        (int(s) + k, int(d) + k)
        for piece in pieces
        for s, d, n in zip(*piece, strict=True)
        for k in range(int(n))
    ]
    assert got == want


@needs_extension
def test_the_c_kernel_takes_every_copy_between_two_arrays(
    copier: Copier, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, bool, bool]] = []

    def spy(src: int, dst: int, s: Any, d: Any, n: Any, streaming: bool, helper: bool = False) -> None:
        calls.append((int(n.sum()), streaming, helper))
        assert built_kernel is not None
        built_kernel(src, dst, s, d, n, streaming, helper)

    monkeypatch.setattr(_copy, "_copy_runs", spy)
    numpy: list[str] = []
    monkeypatch.setattr(_copy, "execute", _spy(numpy, "numpy", _copy.execute))
    rng = np.random.default_rng(0)
    src = np.zeros(16 << 20, dtype=np.uint8)
    dst = np.zeros(16 << 20, dtype=np.uint8)
    # Two copy threads: one call, which the kernel's helper thread shares (it takes none of a small one).
    for unit in (16 << 10, 64 << 10, 256 << 10):
        calls.clear()
        copier.run_blocks(_plan(rng, 1, 16, 4, unit, runs=False), src, dst)
        assert calls == [(4 * unit, 4 * unit >= _copy._STREAMING_MIN_NBYTES, True)]  # streaming from 512 KiB
    calls.clear()
    copier.run_blocks(_plan(rng, 4, 16, 16, 256 << 10, runs=False), src, dst)  # 16 MiB: both threads
    assert calls == [(16 << 20, True, True)]
    calls.clear()
    copier.run([Run(0, 0, 100), Run(200, 300, 50)], src, dst)
    assert calls == [(150, False, True)]
    calls.clear()
    copier.run([Run(0, 0, 100)], src, dst)  # one small run: the kernel's copy_run, one call, GIL kept
    assert calls == [] and numpy == []
    copier.run_strided(StridedCopy(0, 1 << 20, 0, 1 << 20, 4, 1000), src, dst)  # small: one call
    assert calls == [(4000, False, True)]
    calls.clear()
    copier.run_strided(StridedCopy(0, 1 << 20, 0, 1 << 20, 16, 1 << 19), src, dst)  # 8 MiB
    assert calls == [(8 << 20, True, True)]
    calls.clear()
    # More copy threads than two: one call per thread over slices of about equal bytes, no helper.
    four = Copier(threads=4)
    try:
        four.run_blocks(_plan(rng, 4, 16, 16, 256 << 10, runs=False), src, dst)
        assert sorted(calls) == [(4 << 20, True, False)] * 4
    finally:
        four.close()
    calls.clear()
    assert numpy == []  # between two arrays nothing went through numpy (it would die of SIGBUS)
    # Source and destination in one array: the numpy paths, which handle overlap.
    copier.run([Run(0, 10, 100), Run(200, 300, 50)], src, src)
    copier.run_blocks(_plan(rng, 1, 8, 4, 64 << 10, runs=False), src, src[: 4 << 20])
    assert calls == [] and numpy == ["numpy"]


def test_the_environment_variable_turns_the_extension_off() -> None:
    probe = "from llm_datadist._puller import copy; print(copy._copy_runs is None)"
    for value, off in (("1", True), ("0", built_kernel is None), ("", built_kernel is None)):
        env = {**os.environ, _native.ENV_NO_EXTENSION: value}
        result = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=True
        )
        assert result.stdout.strip() == str(off), value


def _spy(taken: list[str], label: str, function: Any) -> Any:
    def spy(*args: Any, **kwargs: Any) -> Any:
        taken.append(label)
        return function(*args, **kwargs)

    return spy


def test_memory_vanishing_under_a_mapping_is_an_error_not_a_crash(copier: Copier, c_kernel: bool) -> None:
    """A segment its owner truncates after we mapped it: a numpy copy of the lost pages would die of
    SIGBUS; the kernel path and the C kernel report EFAULT, which becomes a ShmError (LLM_FAILED at the
    API)."""
    import os

    import posix_ipc

    from llm_datadist._shm.errors import ShmError
    from llm_datadist._shm.segment import Segment

    segment = Segment.create(1 << 20)
    try:
        dst = np.zeros(1 << 20, dtype=np.uint8)
        shm = posix_ipc.SharedMemory(segment.name)
        os.ftruncate(shm.fd, 4096)
        shm.close_fd()
        plan = BlockPlan.make([0], [0], [8], [8], 16 << 10, 16 << 10, 16 << 10)  # 128 KiB in: gone now
        with pytest.raises(ShmError, match="copying blocks"):
            copier.run_blocks(plan, segment.array, dst)
        assert copier._kernel_copies  # a lost page is not the kernel refusing the call
        if c_kernel:  # numpy would die of SIGBUS here
            with pytest.raises(ShmError, match="copying runs"):
                copier.run([Run(0, 0, 10), Run(8 << 16, 0, 4096)], segment.array, dst)
    finally:
        segment.close()


@needs_extension
@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 600 << 10), min_size=1, max_size=40),
    order=st.randoms(use_true_random=False),
    streaming=st.booleans(),
)
def test_the_kernels_helper_thread_copies_every_byte_of_any_runs(
    lengths: list[int], order: Any, streaming: bool
) -> None:
    """copy_runs with its helper thread: runs of any lengths (short ones several to a claim, long ones cut
    into chunks), each landing where it should and nothing else written, as copying alone does."""
    assert built_kernel is not None
    starts = np.cumsum([0, *lengths])
    src = np.random.default_rng(len(lengths)).integers(0, 256, int(starts[-1]), dtype=np.uint8)
    places = list(range(len(lengths)))
    order.shuffle(places)  # each run into another place of the destination, with a gap after each
    dst_starts, at = [0] * len(lengths), 0
    for i in places:
        dst_starts[i], at = at, at + lengths[i] + 64
    dst = np.zeros(at, dtype=np.uint8)
    column = lambda values: np.asarray(values, dtype=np.uint64)  # noqa: E731
    built_kernel(
        src.ctypes.data,
        dst.ctypes.data,
        column(starts[:-1]),
        column(dst_starts),
        column(lengths),
        streaming,
        True,
    )
    want = np.zeros_like(dst)
    for i, n in enumerate(lengths):
        want[dst_starts[i] : dst_starts[i] + n] = src[starts[i] : starts[i] + n]
    assert np.array_equal(dst, want)


@needs_extension
def test_runs_that_overlap_their_destination_are_moved_alone_even_with_the_helper() -> None:
    assert built_kernel is not None
    data = np.arange(4 << 20, dtype=np.uint64).view(np.uint8).copy()
    want = data.copy()
    want[8:] = data[:-8].copy()  # memmove one 32 MiB run 8 bytes up
    one = lambda value: np.array([value], dtype=np.uint64)  # noqa: E731
    built_kernel(data.ctypes.data, data.ctypes.data, one(0), one(8), one(data.nbytes - 8), True, True)
    assert np.array_equal(data, want)
