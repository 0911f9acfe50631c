"""Copy plans: a pull becomes a list of contiguous byte runs (src offset, dst offset, nbytes), merged where
both sides continue, bounds-checked, split across copy threads, and executed with `np.copyto` per run.

Plans are pure arithmetic on offsets (no memory touched); block plans are built with numpy, without a
Python loop per block per tensor. `execute` holds no lock: numpy releases the GIL for each copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import InvalidRange

__all__ = [
    "BlockPlan",
    "Run",
    "StridedCopy",
    "block_runs",
    "check_runs",
    "execute",
    "execute_block_runs",
    "execute_blocks",
    "execute_strided",
    "merge_runs",
    "plan_block_copy",
    "plan_tensor_copy",
    "split_runs",
]


@dataclass(frozen=True, slots=True)
class Run:
    """Copy `nbytes` bytes from `src_offset` of the source to `dst_offset` of the destination."""

    src_offset: int
    dst_offset: int
    nbytes: int


def merge_runs(runs: Iterable[Run]) -> list[Run]:
    """The same byte mapping in as few runs as order allows: a run is merged into the one before it when
    both its source and its destination start exactly where the previous one's end. Drops empty runs."""
    merged: list[Run] = []
    for run in runs:
        if run.nbytes == 0:
            continue
        if merged:
            last = merged[-1]
            if (
                last.src_offset + last.nbytes == run.src_offset
                and last.dst_offset + last.nbytes == run.dst_offset
            ):
                merged[-1] = Run(last.src_offset, last.dst_offset, last.nbytes + run.nbytes)
                continue
        merged.append(run)
    return merged


def plan_tensor_copy(src_offsets: Sequence[int], dst_offsets: Sequence[int], nbytes: int) -> list[Run]:
    """One run of `nbytes` per (src, dst) tensor pair, in order, merged. ValueError on unequal lengths."""
    if len(src_offsets) != len(dst_offsets):
        raise ValueError(f"{len(src_offsets)} source tensors but {len(dst_offsets)} destination tensors")
    if nbytes < 0:
        raise ValueError(f"nbytes must be non-negative, got {nbytes}")
    return merge_runs(Run(int(s), int(d), nbytes) for s, d in zip(src_offsets, dst_offsets, strict=True))


def plan_block_copy(
    src_tensor_offsets: Sequence[int],
    dst_tensor_offsets: Sequence[int],
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    src_block_nbytes: int,
    dst_block_nbytes: int,
    nbytes: int,
) -> list[Run]:
    """Runs that copy, for each tensor t and each k, `nbytes` from
    src_tensor_offsets[t] + src_blocks[k] * src_block_nbytes to dst_tensor_offsets[t] + dst_blocks[k] *
    dst_block_nbytes. Generated tensor by tensor, blocks in the given order, then consecutive runs merged.

    ValueError on unequal list lengths, a negative block index or size, or `nbytes` larger than a block
    (such a copy would spill into the next block, and the result would depend on the order of the runs).
    """
    if len(src_tensor_offsets) != len(dst_tensor_offsets):
        raise ValueError(
            f"{len(src_tensor_offsets)} source tensors but {len(dst_tensor_offsets)} destination tensors"
        )
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    if nbytes < 0 or src_block_nbytes < 0 or dst_block_nbytes < 0:
        raise ValueError(
            f"negative size: nbytes={nbytes}, block nbytes {src_block_nbytes}/{dst_block_nbytes}"
        )
    if nbytes > src_block_nbytes or nbytes > dst_block_nbytes:
        raise ValueError(f"nbytes={nbytes} exceeds a block ({src_block_nbytes} / {dst_block_nbytes} bytes)")
    if nbytes == 0 or not src_tensor_offsets or not src_blocks:
        return []
    src_block_indices = np.asarray(src_blocks, dtype=np.int64)
    dst_block_indices = np.asarray(dst_blocks, dtype=np.int64)
    if src_block_indices.min() < 0 or dst_block_indices.min() < 0:
        raise ValueError("block indices must be non-negative")
    # Row t, column k: the run of tensor t, block k; flattening row-major keeps tensor-then-block order.
    src_starts = (
        np.asarray(src_tensor_offsets, dtype=np.int64)[:, None]
        + (src_block_indices * src_block_nbytes)[None, :]
    ).ravel()
    dst_starts = (
        np.asarray(dst_tensor_offsets, dtype=np.int64)[:, None]
        + (dst_block_indices * dst_block_nbytes)[None, :]
    ).ravel()
    return _merge_uniform(src_starts, dst_starts, nbytes)


def _merge_uniform(
    src_starts: npt.NDArray[np.int64], dst_starts: npt.NDArray[np.int64], nbytes: int
) -> list[Run]:
    """`merge_runs` for runs of equal length, vectorised: a run continues the previous one when both of its
    starts are exactly `nbytes` past the previous starts."""
    continues = (src_starts[1:] == src_starts[:-1] + nbytes) & (dst_starts[1:] == dst_starts[:-1] + nbytes)
    first_indices = np.flatnonzero(np.concatenate(([True], ~continues)))
    counts = np.diff(np.append(first_indices, len(src_starts)))
    return [
        Run(src, dst, count * nbytes)
        for src, dst, count in zip(
            src_starts[first_indices].tolist(),
            dst_starts[first_indices].tolist(),
            counts.tolist(),
            strict=True,
        )
    ]


def split_runs(runs: Sequence[Run], parts: int, *, min_part_nbytes: int = 4 << 20) -> list[list[Run]]:
    """Split a plan into at most `parts` lists of nearly equal byte counts (for parallel copy threads),
    cutting runs where a boundary falls inside one. Every byte of the plan lands in exactly one part.

    A single part (the runs as given) when `parts` is 1 or the plan holds under 2 * min_part_nbytes bytes;
    otherwise each part holds at least `min_part_nbytes` bytes. Zero-length runs are dropped when splitting.
    """
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    if min_part_nbytes < 1:
        raise ValueError(f"min_part_nbytes must be at least 1, got {min_part_nbytes}")
    total_nbytes = sum(run.nbytes for run in runs)
    part_count = min(parts, total_nbytes // min_part_nbytes)
    if part_count <= 1:
        return [list(runs)]
    # Part i covers plan bytes [i * total // n, (i + 1) * total // n): sizes differ by at most one byte.
    result: list[list[Run]] = []
    current: list[Run] = []
    part_end_nbytes = total_nbytes // part_count
    position_nbytes = 0  # plan bytes placed so far
    for run in runs:
        src_offset, dst_offset, left_nbytes = run.src_offset, run.dst_offset, run.nbytes
        while left_nbytes > 0:
            take_nbytes = min(left_nbytes, part_end_nbytes - position_nbytes)
            current.append(Run(src_offset, dst_offset, take_nbytes))
            src_offset += take_nbytes
            dst_offset += take_nbytes
            left_nbytes -= take_nbytes
            position_nbytes += take_nbytes
            if position_nbytes == part_end_nbytes and len(result) < part_count - 1:
                result.append(current)
                current = []
                part_end_nbytes = (len(result) + 1) * total_nbytes // part_count
    result.append(current)
    return result


def check_runs(runs: Sequence[Run], src_nbytes: int, dst_nbytes: int) -> None:
    """`InvalidRange` if any run has a negative field or reaches outside [0, src_nbytes) / [0, dst_nbytes)."""
    for run in runs:
        if run.src_offset < 0 or run.dst_offset < 0 or run.nbytes < 0:
            raise InvalidRange(f"negative field in {run}")
        if run.src_offset + run.nbytes > src_nbytes:
            raise InvalidRange(f"{run} reads past the end of a {src_nbytes}-byte source")
        if run.dst_offset + run.nbytes > dst_nbytes:
            raise InvalidRange(f"{run} writes past the end of a {dst_nbytes}-byte destination")


def execute(runs: Sequence[Run], src: npt.NDArray[np.uint8], dst: npt.NDArray[np.uint8]) -> None:
    """Check the runs against both arrays, then copy each run with `np.copyto` (which releases the GIL).

    `src` and `dst` are 1-D uint8 arrays (ValueError otherwise); runs are applied in order.
    """
    for label, array in (("src", src), ("dst", dst)):
        if array.ndim != 1 or array.dtype != np.uint8:
            raise ValueError(f"{label} must be a 1-D uint8 array, got {array.ndim}-D {array.dtype}")
    check_runs(runs, src.nbytes, dst.nbytes)
    for run in runs:
        np.copyto(
            dst[run.dst_offset : run.dst_offset + run.nbytes],
            src[run.src_offset : run.src_offset + run.nbytes],
        )


@dataclass(frozen=True)
class BlockPlan:
    """A paged copy kept as index arrays rather than runs: in tensor pair i, unit `src_units[k]` (of
    `src_unit_nbytes`, starting at `src_tensor_offsets[i]`) goes to unit `dst_units[k]` of the destination,
    `nbytes` from each. Executed with one numpy gather/scatter per tensor, not a Python call per block."""

    src_tensor_offsets: tuple[int, ...]
    dst_tensor_offsets: tuple[int, ...]
    src_units: npt.NDArray[np.int64]
    dst_units: npt.NDArray[np.int64]
    src_unit_nbytes: int
    dst_unit_nbytes: int
    nbytes: int

    @classmethod
    def make(
        cls,
        src_tensor_offsets: Sequence[int],
        dst_tensor_offsets: Sequence[int],
        src_units: Sequence[int],
        dst_units: Sequence[int],
        src_unit_nbytes: int,
        dst_unit_nbytes: int,
        nbytes: int,
    ) -> BlockPlan:
        if len(src_tensor_offsets) != len(dst_tensor_offsets) or len(src_units) != len(dst_units):
            raise ValueError("tensor offsets and unit lists must pair up")
        if nbytes <= 0 or nbytes > src_unit_nbytes or nbytes > dst_unit_nbytes:
            raise ValueError(
                f"{nbytes} bytes per unit do not fit units of {src_unit_nbytes}/{dst_unit_nbytes}"
            )
        src = np.asarray(src_units, dtype=np.int64)
        dst = np.asarray(dst_units, dtype=np.int64)
        if (src.size and src.min() < 0) or (dst.size and dst.min() < 0):
            raise ValueError("unit indices must be >= 0")
        return cls(
            tuple(src_tensor_offsets),
            tuple(dst_tensor_offsets),
            src,
            dst,
            src_unit_nbytes,
            dst_unit_nbytes,
            nbytes,
        )

    @property
    def total_nbytes(self) -> int:
        return len(self.src_tensor_offsets) * int(self.src_units.size) * self.nbytes

    def check(self, src_nbytes: int, dst_nbytes: int) -> None:
        """InvalidRange unless every unit of every tensor lies inside the arrays."""
        if not self.src_units.size:
            return
        src_end = (
            max(self.src_tensor_offsets) + int(self.src_units.max()) * self.src_unit_nbytes + self.nbytes
        )
        dst_end = (
            max(self.dst_tensor_offsets) + int(self.dst_units.max()) * self.dst_unit_nbytes + self.nbytes
        )
        if min(self.src_tensor_offsets) < 0 or min(self.dst_tensor_offsets) < 0:
            raise InvalidRange("negative tensor offset")
        if src_end > src_nbytes or dst_end > dst_nbytes:
            raise InvalidRange(
                f"block plan reaches {src_end}/{dst_end} beyond {src_nbytes}/{dst_nbytes} bytes"
            )


def block_runs(plan: BlockPlan) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The plan's per-tensor runs as (src_starts, dst_starts, lengths) relative to each tensor's offset, in
    unit order, with units that continue on both sides merged into one run (numpy, no loop per unit)."""
    src = plan.src_units * plan.src_unit_nbytes
    dst = plan.dst_units * plan.dst_unit_nbytes
    if not src.size:
        return src, dst, np.zeros(0, dtype=np.int64)
    # Unit k continues unit k-1 when both of its starts sit exactly where k-1's bytes end.
    continues = (src[1:] == src[:-1] + plan.nbytes) & (dst[1:] == dst[:-1] + plan.nbytes)
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    ends = np.append(starts[1:], src.size)
    return src[starts], dst[starts], (ends - starts).astype(np.int64) * plan.nbytes


def execute_block_runs(
    plan: BlockPlan, src: npt.NDArray[np.uint8], dst: npt.NDArray[np.uint8], tensors: range | None = None
) -> None:
    """The plan in one pass: an `np.copyto` per merged run per tensor. Cheaper than `execute_blocks`'
    gather and scatter once units are large enough that a Python call per unit costs little (the
    caller decides); source and destination must not overlap."""
    plan.check(src.nbytes, dst.nbytes)
    src_starts, dst_starts, lengths = block_runs(plan)
    pieces = list(zip(src_starts.tolist(), dst_starts.tolist(), lengths.tolist(), strict=True))
    for i in tensors if tensors is not None else range(len(plan.src_tensor_offsets)):
        src_base = plan.src_tensor_offsets[i]
        dst_base = plan.dst_tensor_offsets[i]
        for s, d, n in pieces:
            np.copyto(dst[dst_base + d : dst_base + d + n], src[src_base + s : src_base + s + n])


def execute_blocks(
    plan: BlockPlan, src: npt.NDArray[np.uint8], dst: npt.NDArray[np.uint8], tensors: range | None = None
) -> None:
    """Copy the plan's units for `tensors` (all by default): per tensor one gather and one scatter over
    strided 2-D views (numpy releases the GIL, so a caller can run disjoint tensor ranges on threads)."""
    plan.check(src.nbytes, dst.nbytes)
    if not plan.src_units.size:
        return
    src_rows = int(plan.src_units.max()) + 1
    dst_rows = int(plan.dst_units.max()) + 1
    for i in tensors if tensors is not None else range(len(plan.src_tensor_offsets)):
        src_2d = np.lib.stride_tricks.as_strided(
            src[plan.src_tensor_offsets[i] :],
            shape=(src_rows, plan.nbytes),
            strides=(plan.src_unit_nbytes, 1),
        )
        dst_2d = np.lib.stride_tricks.as_strided(
            dst[plan.dst_tensor_offsets[i] :],
            shape=(dst_rows, plan.nbytes),
            strides=(plan.dst_unit_nbytes, 1),
        )
        dst_2d[plan.dst_units] = src_2d[plan.src_units]


@dataclass(frozen=True, slots=True)
class StridedCopy:
    """`rows` copies of `nbytes`: row i from src_offset + i*src_stride to dst_offset + i*dst_stride.

    A slot pull is exactly this (one row per tensor, each side's tensors a constant pitch apart), and numpy
    executes it as one call over two strided 2-D views; rows that are contiguous on both sides collapse
    into a single memmove, large enough for memcpy's streaming stores."""

    src_offset: int
    src_stride: int
    dst_offset: int
    dst_stride: int
    rows: int
    nbytes: int

    @classmethod
    def from_offsets(
        cls, src_offsets: Sequence[int], dst_offsets: Sequence[int], nbytes: int
    ) -> StridedCopy | None:
        """The strided form of one run per (src, dst) pair, or None when either side is not evenly spaced."""
        if not src_offsets or len(src_offsets) != len(dst_offsets) or nbytes <= 0:
            return None
        rows = len(src_offsets)
        src_stride = src_offsets[1] - src_offsets[0] if rows > 1 else nbytes
        dst_stride = dst_offsets[1] - dst_offsets[0] if rows > 1 else nbytes
        if src_stride < nbytes or dst_stride < nbytes:
            return None  # overlapping rows: leave them to the run-by-run path
        for i in range(2, rows):
            if (
                src_offsets[i] - src_offsets[i - 1] != src_stride
                or dst_offsets[i] - dst_offsets[i - 1] != dst_stride
            ):
                return None
        return cls(src_offsets[0], src_stride, dst_offsets[0], dst_stride, rows, nbytes)

    def check(self, src_nbytes: int, dst_nbytes: int) -> None:
        if self.src_offset < 0 or self.dst_offset < 0 or self.rows <= 0 or self.nbytes <= 0:
            raise InvalidRange(f"invalid strided copy {self}")
        src_end = self.src_offset + (self.rows - 1) * self.src_stride + self.nbytes
        dst_end = self.dst_offset + (self.rows - 1) * self.dst_stride + self.nbytes
        if src_end > src_nbytes or dst_end > dst_nbytes:
            raise InvalidRange(
                f"strided copy reaches {src_end}/{dst_end} beyond {src_nbytes}/{dst_nbytes} bytes"
            )


def _rows_view(array: npt.NDArray[np.uint8], offset: int, rows: int, nbytes: int, stride: int) -> Any:
    """`rows` rows of `nbytes` bytes, `stride` apart, from `offset` of `array`: a view, no copy (1-D for one
    row). numpy refuses a view reaching past the array; callers have bounds-checked already."""
    if rows == 1:
        return array[offset : offset + nbytes]
    return np.ndarray((rows, nbytes), dtype=np.uint8, buffer=array, offset=offset, strides=(stride, 1))


def execute_strided(
    copy: StridedCopy, src: npt.NDArray[np.uint8], dst: npt.NDArray[np.uint8], rows: range | None = None
) -> None:
    """Bounds-check `copy`, then copy its `rows` (all by default) with one numpy call (numpy turns rows
    contiguous on both sides into one memmove)."""
    copy.check(src.nbytes, dst.nbytes)
    part = rows if rows is not None else range(copy.rows)
    if not part:
        return
    count = len(part)
    np.copyto(
        _rows_view(dst, copy.dst_offset + part.start * copy.dst_stride, count, copy.nbytes, copy.dst_stride),
        _rows_view(src, copy.src_offset + part.start * copy.src_stride, count, copy.nbytes, copy.src_stride),
    )
