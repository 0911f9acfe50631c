"""The C kernel's checked read (`vm_read_checked`, shm/_copykernel.c): one process_vm_readv between two
polls of a socket for a hang-up and two reads of a generation word. Here it reads this process's own memory
(the kernel allows a process to read itself), with a socket pair standing in for a link."""

from __future__ import annotations

import ctypes
import os
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

copykernel: Any = pytest.importorskip(
    "llm_datadist._shm._copykernel", reason="the optional C copy kernel was not built"
)
if not hasattr(copykernel, "vm_read_checked"):
    pytest.skip("a big-endian build has no checked read", allow_module_level=True)

DONE, GONE, STALE, CHANGED, SHORT = range(5)
SLOT, GENERATION, VERSION = 2, 7, 99


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def iovecs(*runs: tuple[int, int]) -> Any:
    array = (_Iovec * len(runs))()
    for i, (base, nbytes) in enumerate(runs):
        array[i].iov_base = base
        array[i].iov_len = nbytes
    return array


@pytest.fixture
def link() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, peers = socket.socketpair()
    try:
        yield ours, peers
    finally:
        ours.close()
        peers.close()


@pytest.fixture
def words() -> np.ndarray:
    table = np.zeros(4, dtype=np.uint64)
    table[0], table[SLOT] = VERSION, GENERATION
    return table


def read(
    sock: socket.socket, words: np.ndarray, local: Any, remote: Any, wanted: int, *, version: int = VERSION
) -> int:
    return int(
        copykernel.vm_read_checked(
            sock.fileno(), os.getpid(), local, remote, wanted, words, SLOT, GENERATION, version
        )
    )


def test_a_current_word_and_a_live_peer_copy_every_run(link, words) -> None:  # type: ignore[no-untyped-def]
    src = np.arange(10000, dtype=np.uint32).view(np.uint8)
    dst = np.zeros_like(src)
    local = iovecs((dst.ctypes.data, 4000), (dst.ctypes.data + 5000, 3000))
    remote = iovecs((src.ctypes.data + 100, 4000), (src.ctypes.data + 9000, 3000))
    assert read(link[0], words, local, remote, 7000) == DONE
    np.testing.assert_array_equal(dst[:4000], src[100:4100])
    np.testing.assert_array_equal(dst[5000:8000], src[9000:12000])
    assert not dst[4000:5000].any() and not dst[8000:].any()


@pytest.mark.parametrize("word", [0, SLOT])
def test_a_stale_word_copies_nothing(link, words, word: int) -> None:  # type: ignore[no-untyped-def]
    src = np.full(64, 5, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    words[word] += 1
    assert read(link[0], words, iovecs((dst.ctypes.data, 64)), iovecs((src.ctypes.data, 64)), 64) == STALE
    assert not dst.any()


def test_version_zero_leaves_word_zero_unread(link, words) -> None:  # type: ignore[no-untyped-def]
    src = np.full(64, 5, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    words[0] = 12345
    local, remote = iovecs((dst.ctypes.data, 64)), iovecs((src.ctypes.data, 64))
    assert read(link[0], words, local, remote, 64, version=0) == DONE
    assert (dst == 5).all()


def test_a_peer_that_hung_up_is_gone_before_any_copy(link, words) -> None:  # type: ignore[no-untyped-def]
    src = np.full(64, 5, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    link[1].close()
    assert read(link[0], words, iovecs((dst.ctypes.data, 64)), iovecs((src.ctypes.data, 64)), 64) == GONE
    assert not dst.any()


def test_a_word_the_copy_changes_is_changed(link, words) -> None:  # type: ignore[no-untyped-def]
    """The copy itself overwrites the generation word (as an owner reusing the memory meanwhile would)."""
    newer = np.array([GENERATION + 1], dtype=np.uint64)
    local = iovecs((words.ctypes.data + 8 * SLOT, 8))
    assert read(link[0], words, local, iovecs((newer.ctypes.data, 8)), 8) == CHANGED


def test_a_copy_that_moves_less_than_asked_is_short(link, words) -> None:  # type: ignore[no-untyped-def]
    dst = np.zeros(64, dtype=np.uint8)
    assert read(link[0], words, iovecs((dst.ctypes.data, 64)), iovecs((8, 64)), 64) == SHORT  # unmapped


@pytest.mark.parametrize(
    "local_runs, remote_runs, slot",
    [
        (1, 2, SLOT),  # the arrays differ
        (0, 0, SLOT),  # no run
        (1025, 1025, SLOT),  # more than IOV_MAX
        (1, 1, 4),  # the word past the table
        (1, 1, -1),
    ],
)
def test_bad_arguments_are_refused(link, words, local_runs: int, remote_runs: int, slot: int) -> None:  # type: ignore[no-untyped-def]
    dst = np.zeros(8, dtype=np.uint8)
    local = (_Iovec * local_runs)(*[(dst.ctypes.data, 0)] * local_runs)
    remote = (_Iovec * remote_runs)(*[(dst.ctypes.data, 0)] * remote_runs)
    with pytest.raises(ValueError):
        copykernel.vm_read_checked(
            link[0].fileno(), os.getpid(), local, remote, 0, words, slot, GENERATION, VERSION
        )
