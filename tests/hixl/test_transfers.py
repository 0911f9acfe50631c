"""Two engines in two processes read and write each other's registered memory: bytes checked on both
sides, synchronous and asynchronous, READ and WRITE, several descriptors and odd sizes; ranges outside
registered memory, deregistered memory and engines that did not connect are refused."""

from __future__ import annotations

import ctypes
import json
import time

import hixl

from ._local import SERVER, local_engine
from ._peer import Peer, pattern, peer

HOST = int(hixl.MEM_HOST)
DEVICE = int(hixl.MEM_DEVICE)


def _serve(remote: Peer, sizes: list[int], options: dict[str, str] | None = None) -> list[tuple[int, int]]:
    """The peer serves at SERVER with one registered buffer per size, buffer i filled with pattern(i):
    their (address, handle)."""
    assert remote("initialize", SERVER, options or {}) == hixl.SUCCESS
    regions = []
    for seed, nbytes in enumerate(sizes):
        addr = remote("alloc", nbytes, seed)
        ret, handle = remote("register_mem", (addr, nbytes), DEVICE if seed % 2 else HOST)
        assert ret == hixl.SUCCESS
        regions.append((addr, handle))
    return regions


def _wait(engine: hixl.Hixl, req: int) -> hixl.TransferStatus:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ret, status = engine.get_transfer_status(req)
        assert ret == hixl.SUCCESS
        if status != hixl.TransferStatus.WAITING:
            return status
        time.sleep(0.002)
    raise AssertionError("the asynchronous transfer did not end")


def _ops(*descs: tuple[int, int, int]) -> list[hixl.TransferOpDesc]:
    return [hixl.TransferOpDesc(*d) for d in descs]


def test_sync_read_and_write_of_several_odd_ranges() -> None:
    with peer() as remote, local_engine() as local:
        (a, _), (b, _) = _serve(remote, [3333, 4097])
        here, _ = local.register(16384)
        assert local.engine.connect(SERVER, 2000) == hixl.SUCCESS
        reads = _ops((here, a, 3333), (here + 5000, b + 1, 4096), (here + 10001, a + 100, 1))
        assert local.engine.transfer_sync(SERVER, hixl.READ, reads, 2000) == hixl.SUCCESS
        a_bytes, b_bytes = pattern(0, 3333), pattern(1, 4097)
        assert ctypes.string_at(here, 3333) == a_bytes
        assert ctypes.string_at(here + 5000, 4096) == b_bytes[1:]
        assert ctypes.string_at(here + 10001, 1) == a_bytes[100:101]
        assert ctypes.string_at(here + 3333, 1667) == bytes(1667)  # nothing else was written
        new = pattern(9, 4097)
        ctypes.memmove(here, new, 4097)
        writes = _ops((here, a + 3, 3330), (here, b, 4097))
        assert local.engine.transfer_sync(SERVER, hixl.WRITE, writes, 2000) == hixl.SUCCESS
        assert remote("read", a, 3333) == a_bytes[:3] + new[:3330]
        assert remote("read", b, 4097) == new


def test_memory_from_the_librarys_allocator_is_read_and_written_by_address() -> None:
    """A peer registers memory of `ext.shared_arrays`: hixl names it by its address there, as any other."""
    with peer() as remote, local_engine() as local:
        assert remote("initialize", SERVER, {}) == hixl.SUCCESS
        a = remote("alloc", 300000, 4, True)
        assert remote("register_mem", (a, 300000), HOST)[0] == hixl.SUCCESS
        here, _ = local.register(300000)
        assert local.engine.connect(SERVER, 2000) == hixl.SUCCESS
        reads = _ops((here, a + 7, 299993))
        assert local.engine.transfer_sync(SERVER, hixl.READ, reads, 2000) == hixl.SUCCESS
        assert ctypes.string_at(here, 299993) == pattern(4, 300000)[7:]
        new = pattern(5, 1000)
        ctypes.memmove(here, new, 1000)
        assert local.engine.transfer_sync(SERVER, hixl.WRITE, _ops((here, a, 1000)), 2000) == hixl.SUCCESS
        assert remote("read", a, 1000) == new


def test_async_read_and_write() -> None:
    with peer() as remote, local_engine() as local:
        ((a, _),) = _serve(remote, [3333])
        here, _ = local.register(3333)
        assert local.engine.connect(SERVER, 2000) == hixl.SUCCESS
        args = hixl.TransferArgs()
        args.user_data = 42
        ret, req = local.engine.transfer_async(SERVER, hixl.READ, _ops((here, a, 3333)), args)
        assert ret == hixl.SUCCESS and req != 0
        assert _wait(local.engine, req) == hixl.TransferStatus.COMPLETED
        assert ctypes.string_at(here, 3333) == pattern(0, 3333)
        # An ended request is reported once.
        assert local.engine.get_transfer_status(req) == (hixl.PARAM_INVALID, hixl.TransferStatus.FAILED)
        ctypes.memset(here, 0x11, 3333)
        ret, req = local.engine.transfer_async(SERVER, hixl.WRITE, _ops((here + 1, a + 2, 3331)))
        assert ret == hixl.SUCCESS
        assert _wait(local.engine, req) == hixl.TransferStatus.COMPLETED
        assert remote("read", a, 3333) == pattern(0, 3333)[:2] + b"\x11" * 3331
        # A remote range outside registered memory fails the request, not the call.
        ret, req = local.engine.transfer_async(SERVER, hixl.READ, _ops((here, a + 1, 3333)))
        assert ret == hixl.SUCCESS
        assert _wait(local.engine, req) == hixl.TransferStatus.FAILED
        # A local one fails the call.
        ret, req = local.engine.transfer_async(SERVER, hixl.READ, _ops((here + 1, a, 3333)))
        assert (ret, req) == (hixl.PARAM_INVALID, 0)


def test_all_transfer_statuses_of_the_client_server_engine() -> None:
    cs = {hixl.OPTION_LOCAL_COMM_RES: json.dumps({"version": "1.3"})}
    with peer() as remote, local_engine(options=cs) as local:
        ((a, _),) = _serve(remote, [4096], cs)
        here, _ = local.register(4096)
        assert local.engine.connect(SERVER, 2000) == hixl.SUCCESS
        reqs = []
        for i in range(3):
            args = hixl.TransferArgs()
            args.user_data = 100 + i
            ret, req = local.engine.transfer_async(SERVER, hixl.READ, _ops((here, a, 4096)), args)
            assert ret == hixl.SUCCESS
            reqs.append(req)
        seen: dict[int, tuple[int, hixl.TransferStatus]] = {}
        deadline = time.monotonic() + 10
        while len(seen) < 3 and time.monotonic() < deadline:
            ret, results = local.engine.get_all_transfer_status(hixl.GetTransferStatusArgs(skip_waiting=True))
            assert ret == hixl.SUCCESS
            seen.update({r.req: (r.user_data, r.status) for r in results})
            time.sleep(0.002)
        assert seen == {req: (100 + i, hixl.TransferStatus.COMPLETED) for i, req in enumerate(reqs)}
        assert local.engine.get_all_transfer_status() == (hixl.SUCCESS, [])
        # This engine keeps registered memory while it is connected.
        ret, handle = local.engine.register_mem(hixl.MemDesc(here, 4096), hixl.MEM_HOST)
        assert local.engine.deregister_mem(handle) == hixl.FAILED
        assert local.engine.disconnect(SERVER) == hixl.SUCCESS
        assert local.engine.deregister_mem(handle) == hixl.SUCCESS


def test_ranges_outside_registered_memory_are_refused() -> None:
    with peer() as remote, local_engine() as local:
        ((a, _),) = _serve(remote, [3333])
        unregistered = remote("alloc", 4096, 7)
        here, _ = local.register(4096)
        loose = local.buffers.alloc(4096)
        assert local.engine.connect(SERVER, 2000) == hixl.SUCCESS
        for descs in (
            _ops((here, a + 3000, 334)),  # one byte past the end
            _ops((here, a - 1, 10)),  # one byte before the start
            _ops((here, unregistered, 16)),  # memory the peer never registered
            _ops((here, a, 16), (here + 16, a + 3330, 4)),  # one good range, one bad: nothing moves
            _ops((loose, a, 16)),  # local memory this engine never registered
            _ops((here + 4090, a, 16)),  # past the end of ours
        ):
            for op in (hixl.READ, hixl.WRITE):
                assert local.engine.transfer_sync(SERVER, op, descs, 2000) == hixl.PARAM_INVALID
        assert ctypes.string_at(here, 4096) == bytes(4096)
        assert remote("read", a, 3333) == pattern(0, 3333)
        assert remote("read", unregistered, 4096) == pattern(7, 4096)
        # A null address and an empty list are the engine's first refusals.
        assert local.engine.transfer_sync(SERVER, hixl.READ, _ops((0, a, 1))) == hixl.PARAM_INVALID
        assert local.engine.transfer_sync(SERVER, hixl.READ, []) == hixl.PARAM_INVALID


def test_deregistered_memory_is_refused_and_new_memory_is_found() -> None:
    with peer() as remote, local_engine() as local:
        (a, a_handle), (b, _) = _serve(remote, [3333, 3333])
        here, _ = local.register(3333)
        assert local.engine.connect(SERVER, 2000) == hixl.SUCCESS
        assert local.engine.transfer_sync(SERVER, hixl.READ, _ops((here, a, 3333))) == hixl.SUCCESS
        assert remote("deregister_mem", a_handle) == hixl.SUCCESS
        for op in (hixl.READ, hixl.WRITE):
            assert local.engine.transfer_sync(SERVER, op, _ops((here, a, 1))) == hixl.PARAM_INVALID
        assert local.engine.transfer_sync(SERVER, hixl.READ, _ops((here, b, 3333))) == hixl.SUCCESS
        assert ctypes.string_at(here, 3333) == pattern(1, 3333)
        # Registered after the connection: found without connecting again.
        c = remote("alloc", 5000, 3)
        assert remote("register_mem", (c, 5000), HOST)[0] == hixl.SUCCESS
        assert local.engine.transfer_sync(SERVER, hixl.READ, _ops((here, c + 1000, 3333))) == hixl.SUCCESS
        assert ctypes.string_at(here, 3333) == pattern(3, 5000)[1000:4333]
        assert remote("read", a, 3333) == pattern(0, 3333)


def test_only_the_side_that_connected_reaches_the_other() -> None:
    client_address = "127.0.0.1:26301"
    with peer() as remote, local_engine(client_address) as local:
        ((a, _),) = _serve(remote, [3333])
        here, _ = local.register(3333, seed=11)
        # Not connected: nothing moves, either way.
        assert local.engine.transfer_sync(SERVER, hixl.READ, _ops((here, a, 8))) == hixl.NOT_CONNECTED
        assert local.engine.connect(SERVER, 2000) == hixl.SUCCESS
        peer_here = remote("alloc", 3333)
        assert remote("register_mem", (peer_here, 3333), HOST)[0] == hixl.SUCCESS
        # The server did not connect to its client: it reaches nothing of it.
        ops = [(peer_here, here, 8)]
        assert remote("transfer_sync", client_address, int(hixl.READ), ops, 1000) == hixl.NOT_CONNECTED
        assert remote("connect", client_address, 2000) == hixl.SUCCESS
        assert remote("transfer_sync", client_address, int(hixl.READ), ops, 1000) == hixl.SUCCESS
        assert remote("read", peer_here, 8) == pattern(11, 3333)[:8]


def test_eight_mib_in_sixteen_kib_blocks() -> None:
    """The vendor sample's shape: 8 MiB read as 512 descriptors of 16 KiB, then written back."""
    nbytes, block = 8 << 20, 16 << 10
    with peer() as remote, local_engine() as local:
        ((a, _),) = _serve(remote, [nbytes])
        here, _ = local.register(nbytes)
        assert local.engine.connect(SERVER, 2000) == hixl.SUCCESS
        ops = _ops(*((here + i, a + i, block) for i in range(0, nbytes, block)))
        assert local.engine.transfer_sync(SERVER, hixl.READ, ops, 30000) == hixl.SUCCESS
        assert ctypes.string_at(here, nbytes) == pattern(0, nbytes)
        reversed_ops = _ops(*((here + i, a + nbytes - block - i, block) for i in range(0, nbytes, block)))
        assert local.engine.transfer_sync(SERVER, hixl.WRITE, reversed_ops, 30000) == hixl.SUCCESS
        data = remote("read", a + nbytes - block, block)
        assert data == pattern(0, nbytes)[:block]
