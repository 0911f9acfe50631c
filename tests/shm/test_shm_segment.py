"""Segments and names against real POSIX shared memory: lifetimes, modes, addresses, odd sizes, prefault."""

from __future__ import annotations

import ctypes
import gc
import os
import re

import numpy as np
import posix_ipc
import psutil
import pytest

from llm_datadist._shm.errors import InvalidRange, ProcessGone, SegmentNotFound, SegmentTooSmall, ShmError
from llm_datadist._shm.names import (
    NAME_PREFIX,
    SegmentOwner,
    make_segment_name,
    owner_alive,
    parse_segment_name,
    process_start_ticks,
)
from llm_datadist._shm.segment import PAGE_NBYTES, Segment, _touch_pages

SHM_DIR = "/dev/shm"
ODD_SIZES = [1, 3333, PAGE_NBYTES, PAGE_NBYTES + 1, 3 * PAGE_NBYTES - 1]


def _path(segment: Segment) -> str:
    return os.path.join(SHM_DIR, segment.name[1:])


def _unused_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        pid = int(f.read()) - 1
    while psutil.pid_exists(pid):
        pid -= 1
    return pid


# ----------------------------------------------------------------------------- names


def test_name_carries_uid_pid_and_start_ticks() -> None:
    with Segment.create(3333) as segment:
        owner = parse_segment_name(segment.name)
        assert owner == SegmentOwner(os.getuid(), os.getpid(), process_start_ticks(os.getpid()))
        assert owner_alive(owner)
        assert re.fullmatch(rf"/{NAME_PREFIX}\.\d+\.\d+\.\d+\.[0-9a-f]{{16}}", segment.name)


def test_make_segment_name_is_fresh_and_short() -> None:
    names = {make_segment_name() for _ in range(100)}
    assert len(names) == 100
    assert all(len(name) <= 255 for name in names)


@pytest.mark.parametrize(
    "name",
    [
        "llmdd.0.1.2",
        "llmdd.0.1.2.0123456789abcdef0",
        "llmdd.0.1.2.0123456789ABCDEF",
        "other.0.1.2.0123456789abcdef",
        "llmdd.x.1.2.0123456789abcdef",
        "llmdd.0.0.2.0123456789abcdef",
        "llmdd.0.-1.2.0123456789abcdef",
        "//llmdd.0.1.2.0123456789abcdef",
        "psm_1234",
        "",
    ],
)
def test_parse_rejects_foreign_names(name: str) -> None:
    assert parse_segment_name(name) is None


def test_parse_accepts_with_and_without_slash() -> None:
    expected = SegmentOwner(uid=1000, pid=42, start_ticks=777)
    assert parse_segment_name("llmdd.1000.42.777.0123456789abcdef") == expected
    assert parse_segment_name("/llmdd.1000.42.777.0123456789abcdef") == expected


def test_start_ticks_are_stable_and_judge_pid_reuse() -> None:
    pid = os.getpid()
    ticks = process_start_ticks(pid)
    assert process_start_ticks(pid) == ticks
    assert owner_alive(SegmentOwner(os.getuid(), pid, ticks))
    assert not owner_alive(SegmentOwner(os.getuid(), pid, ticks + 1))


def test_missing_process() -> None:
    pid = _unused_pid()
    with pytest.raises(ProcessGone):
        process_start_ticks(pid)
    with pytest.raises(ProcessGone):
        process_start_ticks(0)
    assert not owner_alive(SegmentOwner(os.getuid(), pid, 1))


# ----------------------------------------------------------------------------- lifetime


@pytest.mark.parametrize("nbytes", ODD_SIZES)
def test_create_attach_round_trip(nbytes: int) -> None:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    with Segment.create(nbytes) as owner:
        assert owner.owned and owner.writable and not owner.closed
        assert owner.nbytes == nbytes == owner.array.nbytes
        assert os.stat(_path(owner)).st_size == nbytes
        owner.array[:] = data
        with Segment.attach(owner.name) as reader:
            assert not reader.owned and not reader.writable
            assert reader.nbytes == nbytes
            assert reader.address != owner.address
            np.testing.assert_array_equal(reader.array, data)
            np.testing.assert_array_equal(reader.view(nbytes - 1, 1), data[-1:])
            assert reader.view(nbytes, 0).nbytes == 0
            with pytest.raises(InvalidRange):
                reader.view(nbytes - 1, 2)
            with pytest.raises(InvalidRange):
                reader.view(-1, 1)
        assert os.path.exists(_path(owner))  # an attached mapping closing never unlinks
    assert not os.path.exists(_path(owner))


def test_attach_without_leading_slash() -> None:
    with Segment.create(100) as owner, Segment.attach(owner.name[1:]) as reader:
        assert reader.name == owner.name


def test_create_rejects_empty() -> None:
    with pytest.raises(ValueError):
        Segment.create(0)


@pytest.mark.parametrize("umask", [0, 0o077, 0o777])
def test_mode_is_0600_whatever_the_umask(umask: int) -> None:
    old = os.umask(umask)
    try:
        segment = Segment.create(3333)
    finally:
        os.umask(old)
    with segment:
        assert os.stat(_path(segment)).st_mode & 0o7777 == 0o600


def test_attach_gone_segment() -> None:
    owner = Segment.create(4096)
    name = owner.name
    owner.close()
    with pytest.raises(SegmentNotFound):
        Segment.attach(name)
    with pytest.raises(SegmentNotFound):
        Segment.attach(make_segment_name())


def test_attach_too_small_or_empty() -> None:
    with Segment.create(3333) as owner:
        with pytest.raises(SegmentTooSmall):
            Segment.attach(owner.name, min_nbytes=3334)
        Segment.attach(owner.name, min_nbytes=3333).close()
    # A name whose creator has not sized it yet (size 0) cannot be mapped.
    name = make_segment_name()
    raw = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
    raw.close_fd()
    try:
        with pytest.raises(SegmentTooSmall):
            Segment.attach(name)
    finally:
        raw.unlink()


def test_read_only_attach_refuses_writes() -> None:
    with Segment.create(3333) as owner, Segment.attach(owner.name) as reader:
        assert not reader.array.flags.writeable
        with pytest.raises(ValueError):
            reader.array[0] = 1
        with pytest.raises(ValueError):
            reader.view(10, 10)[:] = 1
        with pytest.raises(ValueError):
            reader.array.flags.writeable = True  # the buffer itself is read-only, not just the flag
        with pytest.raises(TypeError):
            (ctypes.c_char * 10).from_buffer(reader.array.data)


def test_writable_attach_writes_through() -> None:
    with Segment.create(PAGE_NBYTES + 1) as owner, Segment.attach(owner.name, writable=True) as writer:
        assert writer.writable and not writer.owned
        writer.array[-1] = 7
        assert owner.array[-1] == 7


def test_address_is_real_for_ctypes() -> None:
    payload = bytes(range(256)) * 13
    with Segment.create(PAGE_NBYTES + 1) as owner, Segment.attach(owner.name) as reader:
        ctypes.memmove(owner.address + 100, payload, len(payload))
        assert bytes(reader.view(100, len(payload))) == payload
        assert (ctypes.c_char * len(payload)).from_address(reader.address + 100).raw == payload
        assert owner.array.__array_interface__["data"][0] == owner.address


def test_mapping_outlives_unlink() -> None:
    owner = Segment.create(3333)
    owner.array[:] = 9
    reader = Segment.attach(owner.name)
    owner.close()
    assert not os.path.exists(_path(owner))
    assert int(reader.array.sum()) == 9 * 3333
    reader.close()


def test_close_with_live_user_view_does_not_crash() -> None:
    owner = Segment.create(3333)
    reader = Segment.attach(owner.name)
    owner.array[:] = 5
    view = reader.view(0, 100)
    owner_view = owner.view(3000, 333)
    reader.close()
    owner.close()
    assert reader.closed and owner.closed
    assert not os.path.exists(_path(owner))
    # The views keep their mappings alive until they go.
    assert int(view.sum()) == 500
    owner_view[:] = 1
    del view, owner_view
    gc.collect()


def test_closed_segment_refuses_use() -> None:
    owner = Segment.create(100)
    owner.close()
    owner.close()  # idempotent
    owner.unlink()  # idempotent, already gone
    assert owner.closed
    for access in (lambda: owner.array, lambda: owner.address, lambda: owner.view(0, 1)):
        with pytest.raises(ShmError):
            access()
    with pytest.raises(ShmError):
        owner.prefault()


def test_only_the_owner_unlinks() -> None:
    with Segment.create(100) as owner:
        with Segment.attach(owner.name) as reader, pytest.raises(ShmError):
            reader.unlink()
        owner.unlink()
        owner.unlink()
        assert not os.path.exists(_path(owner))
        owner.array[0] = 1  # still mapped after the unlink
    # Someone else unlinked first: close tolerates it.
    other = Segment.create(100)
    posix_ipc.unlink_shared_memory(other.name)
    other.close()


def test_forgotten_owned_segment_is_unlinked_by_gc() -> None:
    segment = Segment.create(100)
    path = _path(segment)
    del segment
    gc.collect()
    assert not os.path.exists(path)


# ----------------------------------------------------------------------------- pages


def _rss_nbytes(address: int) -> int:
    """Resident bytes of this process's mapping that starts at `address` (from /proc/self/smaps)."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == address
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping at 0x{address:x}")


def test_prefault_populates_pages() -> None:
    nbytes = 64 * PAGE_NBYTES
    with Segment.create(nbytes, prefault=False) as segment:
        assert _rss_nbytes(segment.address) == 0
        segment.prefault(PAGE_NBYTES + 1, 2 * PAGE_NBYTES)  # spans pages 1..3
        assert _rss_nbytes(segment.address) == 3 * PAGE_NBYTES
        segment.prefault()
        assert _rss_nbytes(segment.address) == nbytes
        segment.prefault()  # present already: harmless
        segment.prefault(nbytes, 0)
        with pytest.raises(InvalidRange):
            segment.prefault(nbytes - 1, 2)
    with Segment.create(nbytes) as segment:
        assert _rss_nbytes(segment.address) == nbytes
        with Segment.attach(segment.name) as reader:
            assert _rss_nbytes(reader.address) == nbytes  # attach populates page tables too


def test_prefault_keeps_data() -> None:
    with Segment.create(3 * PAGE_NBYTES + 5, prefault=False) as segment:
        data = np.random.default_rng(1).integers(0, 256, segment.nbytes, dtype=np.uint8)
        segment.array[:] = data
        segment.prefault(7, segment.nbytes - 7)
        np.testing.assert_array_equal(segment.array, data)


def test_touch_pages_fallback() -> None:
    nbytes = 8 * PAGE_NBYTES
    with Segment.create(nbytes, prefault=False) as segment:
        data = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)
        segment.array[: 2 * PAGE_NBYTES] = data[: 2 * PAGE_NBYTES]
        base_rss = _rss_nbytes(segment.address)
        # Writes touch only pages wholly inside the range (here pages 1..4), never the partial edges.
        _touch_pages(segment.array, PAGE_NBYTES - 1, 4 * PAGE_NBYTES + 2, write=True)
        assert _rss_nbytes(segment.address) == max(base_rss, 2 * PAGE_NBYTES) + 3 * PAGE_NBYTES
        np.testing.assert_array_equal(segment.array[: 2 * PAGE_NBYTES], data[: 2 * PAGE_NBYTES])
        assert not segment.array[2 * PAGE_NBYTES :].any()
        _touch_pages(segment.array, 10, 5, write=True)  # no whole page inside: nothing to do
        with Segment.attach(segment.name) as reader:
            _touch_pages(reader.array, PAGE_NBYTES + 1, 10, write=False)
