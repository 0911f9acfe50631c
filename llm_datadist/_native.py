"""The optional C kernel (`llm_datadist._shm._copykernel`) as the rest of the package finds it, and views
of raw addresses.

Rules: `kernel_function` is the one place the kernel is imported; it answers None when the kernel was not
built or LLM_DATADIST_NO_EXTENSION asks for the pure-Python path, and every caller keeps that path.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

ENV_NO_EXTENSION = "LLM_DATADIST_NO_EXTENSION"

Column = npt.NDArray[np.uint64]


class CopyRuns(Protocol):
    """The kernel's copy_runs: run i from src_base + src_offsets[i] to dst_base + dst_offsets[i]."""

    def __call__(
        self,
        src_base: int,
        dst_base: int,
        src_offsets: Column,
        dst_offsets: Column,
        lengths: Column,
        nontemporal: bool,
        helper: bool = False,
        /,
    ) -> None: ...


def load_copy_kernel() -> CopyRuns | None:
    """The C kernel's copy_runs, or None when it was not built or LLM_DATADIST_NO_EXTENSION=1 (any value
    but empty or 0) asks for the pure-Python path."""
    copy_runs: CopyRuns | None = kernel_function("copy_runs")
    return copy_runs


def kernel_function(name: str) -> Any:
    """The C kernel's function `name`, or None: not built, not in this build (the index functions of a
    big-endian one), or LLM_DATADIST_NO_EXTENSION set."""
    if os.environ.get(ENV_NO_EXTENSION, "") not in ("", "0"):
        return None
    try:
        import llm_datadist._shm._copykernel as kernel
    except ImportError:
        return None
    return getattr(kernel, name, None)


def address_view(address: int, nbytes: int) -> np.ndarray[Any, Any]:
    """A uint8 array over `nbytes` of this process's memory at `address` (memory the user registered).

    The caller guarantees the range is mapped where it is touched: only the planned runs are.
    """
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(address))


def vm_columns(
    local_bases: Sequence[int],
    local_offsets: Sequence[int],
    remote_bases: Sequence[int],
    remote_offsets: Sequence[int],
    lengths: Sequence[int],
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Cross-memory runs as the uint64 columns `_puller.vm` takes: run k of tensor t moves lengths[k] bytes
    between local_bases[t] + local_offsets[k] and remote_bases[t] + remote_offsets[k] (tensor-major).
    ValueError when an address would pass 2**64 (a hostile table entry; numpy would wrap silently)."""
    end = max(lengths)
    if (
        max(local_bases) + max(local_offsets) + end >= 1 << 64
        or max(remote_bases) + max(remote_offsets) + end >= 1 << 64
    ):
        raise ValueError("a cross-memory run passes the end of the address space")
    local = np.asarray(local_bases, dtype=np.uint64)[:, None] + np.asarray(local_offsets, dtype=np.uint64)
    remote = np.asarray(remote_bases, dtype=np.uint64)[:, None] + np.asarray(remote_offsets, dtype=np.uint64)
    nbytes = np.broadcast_to(np.asarray(lengths, dtype=np.uint64), local.shape)
    return local.ravel(), remote.ravel(), nbytes.ravel()
