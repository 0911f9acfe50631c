"""`MemDesc.local_only` (hixl_types.h, the HIXL data-structure page: "only used locally, not exposed to
the remote", default False): memory registered so is the engine's own side of its transfers, and a remote
engine that names it gets PARAM_INVALID with nothing moved, reading or writing."""

from __future__ import annotations

import ctypes

import pytest

import hixl

from ._local import SERVER, local_engine
from ._peer import pattern, peer

HOST = int(hixl.MEM_HOST)
NBYTES = 4096


def test_the_field_reads_and_writes_as_the_binding() -> None:
    desc = hixl.MemDesc(addr=0x1000, len=64)
    assert desc.local_only is False
    desc.local_only = True
    assert desc.local_only is True
    for bad in (1, "yes", None):
        with pytest.raises(TypeError):
            desc.local_only = bad  # type: ignore[assignment]
    assert desc.local_only is True


def test_a_remote_engine_cannot_name_local_only_memory() -> None:
    with peer() as remote, local_engine() as local:
        assert remote("initialize", SERVER, {}) == hixl.SUCCESS
        shared = remote("alloc", NBYTES, 1)
        private = remote("alloc", NBYTES, 2)
        assert remote("register_mem", (shared, NBYTES), HOST)[0] == hixl.SUCCESS
        assert remote("register_mem", (private, NBYTES, True), HOST)[0] == hixl.SUCCESS
        here, _ = local.register(NBYTES, seed=3)
        assert local.engine.connect(SERVER, 5000) == hixl.SUCCESS
        read = [hixl.TransferOpDesc(here, shared, NBYTES)]
        assert local.engine.transfer_sync(SERVER, hixl.READ, read) == hixl.SUCCESS
        assert ctypes.string_at(here, NBYTES) == pattern(1, NBYTES)
        for op in (hixl.READ, hixl.WRITE):
            descs = [hixl.TransferOpDesc(here, private, NBYTES)]
            assert local.engine.transfer_sync(SERVER, op, descs) == hixl.PARAM_INVALID
        assert remote("read", private, NBYTES) == pattern(2, NBYTES)
        assert ctypes.string_at(here, NBYTES) == pattern(1, NBYTES)


def test_local_only_memory_is_the_local_side_of_this_engines_transfers() -> None:
    with peer() as remote, local_engine() as local:
        assert remote("initialize", SERVER, {}) == hixl.SUCCESS
        there = remote("alloc", NBYTES, 4)
        assert remote("register_mem", (there, NBYTES), HOST)[0] == hixl.SUCCESS
        here = local.buffers.alloc(NBYTES, 5)
        desc = hixl.MemDesc(here, NBYTES)
        desc.local_only = True
        ret, handle = local.engine.register_mem(desc, hixl.MemType.MEM_HOST)
        assert ret == hixl.SUCCESS and handle
        assert local.engine.connect(SERVER, 5000) == hixl.SUCCESS
        descs = [hixl.TransferOpDesc(here, there, NBYTES)]
        assert local.engine.transfer_sync(SERVER, hixl.READ, descs) == hixl.SUCCESS
        assert ctypes.string_at(here, NBYTES) == pattern(4, NBYTES)
        ctypes.memset(here, 0x6B, NBYTES)
        assert local.engine.transfer_sync(SERVER, hixl.WRITE, descs) == hixl.SUCCESS
        assert remote("read", there, NBYTES) == bytes([0x6B]) * NBYTES
        assert local.engine.disconnect(SERVER) == hixl.SUCCESS
        assert local.engine.deregister_mem(handle) == hixl.SUCCESS
