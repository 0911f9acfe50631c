"""Stub for the optional C copy kernel (shm/_copykernel.c)."""

import mmap
import sys

import numpy as np
import numpy.typing as npt

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:
    from typing_extensions import Buffer

STREAMING: int

def copy_runs(
    src_base: int,
    dst_base: int,
    src_offsets: npt.NDArray[np.uint64],
    dst_offsets: npt.NDArray[np.uint64],
    lengths: npt.NDArray[np.uint64],
    nontemporal: bool,
    /,
) -> None: ...
def count_transfer(
    address: int, kind: int, timing: int, buckets: int, nbytes: int, runs: int, ns: int, /
) -> None: ...

# Absent from a big-endian build (every pull then takes the Python way).
def index_pull_key(
    mapping: mmap.mmap,
    fd: int,
    plan: bytes,
    dst_addrs: bytes,
    segments: bytes,
    src_out: bytearray | None,
    copy: int,
    /,
) -> int: ...
def index_unpin_key(mapping: mmap.mmap, fd: int, plan: bytes, /) -> int: ...
def vm_read_checked(
    fd: int,
    pid: int,
    local_iovecs: Buffer,
    remote_iovecs: Buffer,
    wanted: int,
    words: Buffer,
    slot: int,
    generation: int,
    version: int,
    /,
) -> int: ...
