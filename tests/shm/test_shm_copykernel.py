"""The optional C copy kernel (shm/_copykernel.c) against a numpy reference: random runs with odd sizes and
unaligned offsets, both store kinds; its argument checks; a page vanishing mid-copy. Skipped when the
extension was not built (no compiler at install time)."""

from __future__ import annotations

import errno
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

copykernel: Any = pytest.importorskip(
    "llm_datadist._shm._copykernel", reason="the optional C copy kernel was not built"
)


def u64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def reference(
    src: np.ndarray, dst: np.ndarray, runs: list[tuple[int, int, int]], *, same: bool = False
) -> np.ndarray:
    """What dst must hold after the runs, applied in order (from dst itself when `same`)."""
    want = dst.copy()
    for s, d, n in runs:
        want[d : d + n] = (want if same else src)[s : s + n].copy()
    return want


def copy(
    src: np.ndarray,
    dst: np.ndarray,
    runs: list[tuple[int, int, int]],
    nontemporal: bool,
    helper: bool = False,
) -> None:
    columns = np.array(runs, dtype=np.uint64).reshape(-1, 3)
    copykernel.copy_runs(
        src.ctypes.data,
        dst.ctypes.data,
        np.ascontiguousarray(columns[:, 0]),
        np.ascontiguousarray(columns[:, 1]),
        np.ascontiguousarray(columns[:, 2]),
        nontemporal,
        helper,
    )


@st.composite
def run_lists(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, int]]]:
    """Arrays of an odd size and runs inside them: unaligned offsets, zero-length runs, sizes around the
    64-byte streaming loop and the 16-byte alignment head."""
    nbytes = draw(st.sampled_from([1, 63, 65, 3333, 4097, 70001]))
    runs = []
    for _ in range(draw(st.integers(0, 12))):
        length = draw(
            st.one_of(st.sampled_from([0, 1, 15, 16, 17, 63, 64, 65, 3333]), st.integers(0, nbytes))
        )
        length = min(length, nbytes)
        runs.append((draw(st.integers(0, nbytes - length)), draw(st.integers(0, nbytes - length)), length))
    return nbytes, runs


@settings(max_examples=150, deadline=None)
@given(run_lists(), st.booleans(), st.integers(0, 2**32 - 1))
def test_runs_match_a_numpy_reference(
    case: tuple[int, list[tuple[int, int, int]]], nontemporal: bool, seed: int
) -> None:
    _between_two_arrays(case, nontemporal, seed)


def _between_two_arrays(case: tuple[int, list[tuple[int, int, int]]], nontemporal: bool, seed: int) -> None:
    nbytes, runs = case
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = rng.integers(0, 256, nbytes, dtype=np.uint8)
    want = reference(src, dst, runs)
    copy(src, dst, runs, nontemporal)
    np.testing.assert_array_equal(dst, want)


@settings(max_examples=60, deadline=None)
@given(run_lists(), st.booleans(), st.integers(0, 2**32 - 1))
def test_runs_within_one_array_move_as_memmove_does(
    case: tuple[int, list[tuple[int, int, int]]], nontemporal: bool, seed: int
) -> None:
    nbytes, runs = case
    array = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    want = reference(array, array, runs, same=True)
    copy(array, array, runs, nontemporal)
    np.testing.assert_array_equal(array, want)


@st.composite
def lane_runs(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, int]]]:
    """Runs long enough for the streaming copy's lanes (4 KiB up, cut into 64 KiB pieces that four lanes
    copy in turn), of lengths around those sizes, at any alignment, some overlapping one another."""
    nbytes = draw(st.sampled_from([300_001, 1 << 20]))
    runs = []
    for _ in range(draw(st.integers(1, 12))):
        length = draw(
            st.one_of(
                st.sampled_from([4095, 4096, 4097, 65535, 65536, 65537, 69632, 69633, 131072, 200_003]),
                st.integers(0, 150_000),
            )
        )
        runs.append((draw(st.integers(0, nbytes - length)), draw(st.integers(0, nbytes - length)), length))
    return nbytes, runs


@settings(max_examples=120, deadline=None)
@given(lane_runs(), st.integers(0, 2**32 - 1))
def test_runs_through_the_lanes_end_as_if_copied_one_by_one(
    case: tuple[int, list[tuple[int, int, int]]], seed: int
) -> None:
    """Between two arrays, and within one (a run may then read what an earlier one wrote: the lanes wait
    for it), with streaming stores."""
    _between_two_arrays(case, True, seed)
    nbytes, runs = case
    array = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    want = reference(array, array, runs, same=True)
    copy(array, array, runs, True)
    np.testing.assert_array_equal(array, want)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64), st.sampled_from([4096, 32768, 65536 + 64, 262144 + 1]), st.integers(0, 2**32 - 1))
def test_scattered_blocks_with_the_helper_match_a_numpy_reference(count: int, block: int, seed: int) -> None:
    """A paged pull's copy: `count` blocks to distinct blocks elsewhere, shared with the helper thread."""
    rng = np.random.default_rng(seed)
    blocks = 128
    src = rng.integers(0, 256, blocks * block, dtype=np.uint8)
    dst = rng.integers(0, 256, blocks * block, dtype=np.uint8)
    runs = [
        (int(s) * block, int(d) * block, block)
        for s, d in zip(
            rng.choice(blocks, count, replace=False), rng.choice(blocks, count, replace=False), strict=True
        )
    ]
    want = reference(src, dst, runs)
    copy(src, dst, runs, True, helper=True)
    np.testing.assert_array_equal(dst, want)


@pytest.mark.parametrize("nontemporal", [False, True])
def test_large_unaligned_runs(nontemporal: bool) -> None:
    rng = np.random.default_rng(3333)
    src = rng.integers(0, 256, (8 << 20) + 3333, dtype=np.uint8)
    dst = np.zeros_like(src)
    runs = [(3, 5, (4 << 20) + 1), ((4 << 20) + 7, (4 << 20) + 9, (4 << 20) - 3333)]
    want = reference(src, dst, runs)
    copy(src, dst, runs, nontemporal)
    np.testing.assert_array_equal(dst, want)


def test_no_runs_copy_nothing() -> None:
    copykernel.copy_runs(0, 0, u64(), u64(), u64(), True)


def test_streaming_is_reported() -> None:
    assert copykernel.STREAMING in (0, 1)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((1.0, 0, u64(), u64(), u64(), False), TypeError),  # an address must be an int
        ((0, "0", u64(), u64(), u64(), False), TypeError),
        ((-1, 0, u64(), u64(), u64(), False), ValueError),  # outside [0, 2**64)
        ((0, 1 << 64, u64(), u64(), u64(), False), ValueError),
        ((0, 0, [0], u64(), u64(), False), TypeError),  # not a buffer
        ((0, 0, u64(), np.zeros(0, np.int64), u64(), False), TypeError),  # signed
        ((0, 0, u64(), u64(), np.zeros(0, np.float64), False), TypeError),
        ((0, 0, np.zeros(0, np.uint32), u64(), u64(), False), TypeError),  # 4-byte items
        ((0, 0, b"12345678", u64(), u64(), False), TypeError),  # bytes: format 'B'
        ((0, 0, np.zeros((1, 1), np.uint64), u64(0), u64(0), False), TypeError),  # 2-D
        ((0, 0, np.zeros(4, np.uint64)[::2], u64(0, 0), u64(0, 0), False), TypeError),  # not contiguous
        ((0, 0, memoryview(bytearray(32)).cast("Q")[::2], u64(0, 0), u64(0, 0), False), TypeError),
        ((0, 0, u64(0), u64(0, 1), u64(0), False), ValueError),  # unequal lengths
        ((0, 0, u64(0), u64(0), u64(0)), TypeError),  # nontemporal missing
        ((1 << 63, 0, u64(1 << 63), u64(0), u64(1), False), ValueError),  # past 2**64
        ((0, 0, u64(0), u64(2**64 - 1), u64(2), True), ValueError),
    ],
)
def test_bad_arguments_are_rejected_before_any_copy(args: tuple[Any, ...], error: type[Exception]) -> None:
    with pytest.raises(error):
        copykernel.copy_runs(*args)


def test_a_run_past_the_address_space_copies_none_of_the_runs() -> None:
    src = np.arange(16, dtype=np.uint8)
    dst = np.zeros(16, dtype=np.uint8)
    with pytest.raises(ValueError, match="run 1"):
        copykernel.copy_runs(
            src.ctypes.data, dst.ctypes.data, u64(0, 2**64 - 8), u64(0, 0), u64(8, 16), False
        )
    assert not dst.any()


@pytest.mark.parametrize("nontemporal", [False, True])
def test_a_page_vanishing_mid_copy_is_efault_not_sigbus(nontemporal: bool) -> None:
    """A shared mapping whose file is truncated under it: the copy faults with SIGBUS in C, and the kernel
    reports EFAULT; later copies on any thread work as before."""
    import mmap
    import tempfile

    with tempfile.TemporaryFile() as file:
        file.truncate(1 << 20)
        mapping = mmap.mmap(file.fileno(), 1 << 20)
        try:
            src = np.frombuffer(mapping, dtype=np.uint8)
            dst = np.zeros(1 << 20, dtype=np.uint8)
            os.ftruncate(file.fileno(), 4096)
            with pytest.raises(OSError) as caught:
                copykernel.copy_runs(
                    src.ctypes.data, dst.ctypes.data, u64(0), u64(0), u64(1 << 20), nontemporal
                )
            assert caught.value.errno == errno.EFAULT
            copy(dst, dst, [(0, 4096, 4096)], nontemporal)  # the handler is gone or still ours: fine
            del src
        finally:
            mapping.close()
