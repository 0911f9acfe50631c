"""Stub for the optional C copy kernel (shm/_copykernel.c)."""

import mmap

import numpy as np
import numpy.typing as npt

STREAMING: int

def copy_runs(
    src_base: int,
    dst_base: int,
    src_offsets: npt.NDArray[np.uint64],
    dst_offsets: npt.NDArray[np.uint64],
    lengths: npt.NDArray[np.uint64],
    nontemporal: bool,
    parts: int = 1,
    /,
) -> None: ...
def start_threads(count: int, /) -> int: ...

# Absent from a big-endian build (shm.repin then runs its Python twins).
def index_repin(mapping: mmap.mmap, fd: int, plan: bytes, /) -> int: ...
def index_unpin(mapping: mmap.mmap, fd: int, row_offset: int, ticket: int, cache_offset: int, /) -> int: ...
def index_pull(
    mapping: mmap.mmap,
    fd: int,
    plan: bytes,
    src_base: int,
    dst_base: int,
    src_offsets: npt.NDArray[np.uint64],
    dst_offsets: npt.NDArray[np.uint64],
    lengths: npt.NDArray[np.uint64],
    nontemporal: bool,
    parts: int = 1,
    /,
) -> tuple[int, bool, int]: ...
