"""Stub for the optional C copy kernel (shm/_copykernel.c)."""

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
    /,
) -> None: ...
