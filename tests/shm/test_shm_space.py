"""What /dev/shm can still back (`shm.space`), without a small mount: the figures, the error's message, a
request no machine has refused before anything is created, pages given back, and a mapping that populates
only the pages an object holds. tests/llm_datadist/test_small_dev_shm.py fills a real 64 MiB /dev/shm."""

from __future__ import annotations

import os

import pytest

from llm_datadist._shm.errors import OutOfPoolMemory, SharedMemoryExhausted
from llm_datadist._shm.pool import Pool
from llm_datadist._shm.segment import PAGE_NBYTES, Segment, _data_extents
from llm_datadist._shm.space import check_space, exhausted, format_nbytes, shm_space

HUGE_NBYTES = 1 << 50  # 1 PiB: more than any /dev/shm has free


def test_space_is_statvfs_of_dev_shm() -> None:
    space = shm_space()
    info = os.statvfs("/dev/shm")
    assert space.directory == "/dev/shm"
    assert space.size_nbytes == info.f_blocks * info.f_frsize
    assert 0 <= space.free_nbytes <= space.size_nbytes
    assert space.used_nbytes == space.size_nbytes - space.free_nbytes


def test_exhausted_names_the_mount_the_figures_and_both_ways_to_raise_it() -> None:
    error = exhausted(HUGE_NBYTES, "a test block")
    message = str(error)
    assert isinstance(error, OutOfPoolMemory)  # a full host is handled as a full pool is
    assert message.startswith(
        f"/dev/shm cannot back 1048576.0 GiB ({HUGE_NBYTES} bytes) more for a test block"
    )
    assert f"({error.free_nbytes} bytes) free of {format_nbytes(error.size_nbytes)}" in message
    assert "mounted at /dev/shm" in message
    assert "`--shm-size=" in message and "`mount -o remount,size=" in message
    assert error.needed_nbytes == HUGE_NBYTES and error.error is None and error.directory == "/dev/shm"


def test_check_space_passes_what_fits_and_refuses_what_does_not() -> None:
    check_space(0, "nothing")
    check_space(PAGE_NBYTES, "a page")
    with pytest.raises(SharedMemoryExhausted, match="more for a lot"):
        check_space(HUGE_NBYTES, "a lot")


def test_a_prefaulted_segment_too_large_is_refused_before_it_exists() -> None:
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(SharedMemoryExhausted) as info:
        Segment.create(HUGE_NBYTES)
    assert info.value.error is None and info.value.needed_nbytes == HUGE_NBYTES
    assert not {name for name in set(os.listdir("/dev/shm")) - before if f".{os.getpid()}." in name}


def test_a_pool_refuses_before_populating_and_stays_usable() -> None:
    pool = Pool()
    try:
        with pytest.raises(SharedMemoryExhausted, match="more for a pool block of"):
            pool.allocate(HUGE_NBYTES)
        assert pool.used_nbytes == 0
        block = pool.allocate(3333)
        assert block.nbytes == 3333
        pool.free(block)
    finally:
        pool.close()


def test_release_zeroes_whole_pages_only() -> None:
    with Segment.create(4 * PAGE_NBYTES) as segment:
        segment.array[:] = 9
        segment.release(PAGE_NBYTES - 1, 2 * PAGE_NBYTES + 2)  # pages 1 and 2 whole, 0 and 3 in part
        assert (segment.array[:PAGE_NBYTES] == 9).all()
        assert not segment.array[PAGE_NBYTES : 3 * PAGE_NBYTES].any()
        assert (segment.array[3 * PAGE_NBYTES :] == 9).all()
        segment.release(5, 10)  # inside one page: nothing
        assert segment.array[5] == 9


def test_attach_populates_the_data_extents_only() -> None:
    with Segment.create(64 * PAGE_NBYTES, prefault=False) as owner:
        owner.array[: 2 * PAGE_NBYTES] = 1
        owner.array[10 * PAGE_NBYTES : 11 * PAGE_NBYTES + 1] = 2
        fd = os.open(f"/dev/shm{owner.name}", os.O_RDONLY)
        try:
            assert _data_extents(fd, owner.nbytes) == [
                (0, 2 * PAGE_NBYTES),
                (10 * PAGE_NBYTES, 2 * PAGE_NBYTES),
            ]
        finally:
            os.close(fd)
        for writable in (False, True):
            peer = Segment.attach(owner.name, writable=writable)
            try:
                assert (peer.array[: 2 * PAGE_NBYTES] == 1).all()
                assert peer.array[11 * PAGE_NBYTES] == 2 and not peer.array[20 * PAGE_NBYTES]
            finally:
                peer.close()
        fd = os.open(f"/dev/shm{owner.name}", os.O_RDONLY)
        try:  # reading a hole through the peer allocated that page only; the rest is still a hole
            assert (
                _data_extents(fd, owner.nbytes)[-1][0] + _data_extents(fd, owner.nbytes)[-1][1]
                <= 21 * PAGE_NBYTES
            )
        finally:
            os.close(fd)
