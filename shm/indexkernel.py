"""The C kernel's pulls through an owner's published index (shm/_copykernel.c; `llm_datadist._puller.fresh`
has the
rules): `index_pull_key` looks a key up, checks it as the full way's pin would, and either copies under the
index lock or pins through the puller's row; `index_unpin_key` ends such a pin, crediting what it pulled.

Rules: `kernel` is None without the C kernel (not built, a big-endian build, or LLM_DATADIST_NO_EXTENSION
set): every pull then takes the full way, in Python.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["Kernel", "kernel"]


class Kernel(NamedTuple):
    """The C kernel's calls on an index."""

    index_pull_key: Callable[[mmap.mmap, int, bytes, bytes, bytes, bytearray | None, int], int]
    index_unpin_key: Callable[[mmap.mmap, int, bytes], int]


def _load_kernel() -> Kernel | None:
    if os.environ.get("LLM_DATADIST_NO_EXTENSION", "") not in ("", "0"):
        return None
    try:
        from ._copykernel import index_pull_key, index_unpin_key
    except ImportError:
        return None
    return Kernel(index_pull_key, index_unpin_key)


# Module-level so that tests can swap it (None: the full way).
kernel = _load_kernel()
