"""The HIXL engine API (`import hixl`) between two processes: a server engine registers a buffer and
serves at an address; a client engine connects to it, reads parts of the buffer into its own registered
memory, writes some back, reads once more asynchronously and tells the server it is done with a notify.

    python examples/hixl_read_write.py
"""

from __future__ import annotations

import ctypes
import time
from multiprocessing.connection import Connection

from _pair import run_pair

import hixl

SERVER = "127.0.0.1:26020"  # the server's engine name: peers connect to it
NBYTES = 1 << 20  # 1 MiB buffers
BLOCK = 4096 + 17  # odd-sized blocks, to show that nothing needs aligning


def start(name: str) -> hixl.Hixl:
    engine = hixl.Hixl()
    ret = engine.initialize(name, {hixl.OPTION_AUTO_CONNECT: "0"})
    if ret != hixl.SUCCESS:
        raise SystemExit(f"initialize({name}) failed: {ret}")
    return engine


def register(engine: hixl.Hixl, buffer: ctypes.Array[ctypes.c_char]) -> int:
    ret, handle = engine.register_mem(hixl.MemDesc(ctypes.addressof(buffer), len(buffer)), hixl.MEM_HOST)
    if ret != hixl.SUCCESS:
        raise SystemExit(f"register_mem failed: {ret}")
    return handle


def server(control: Connection) -> None:
    engine = start(SERVER)
    buffer = ctypes.create_string_buffer(bytes(i % 251 for i in range(NBYTES)), NBYTES)
    handle = register(engine, buffer)
    control.send(ctypes.addressof(buffer))  # what a framework tells its peer: where the bytes are
    deadline = time.monotonic() + 60
    notifies: list[hixl.NotifyDesc] = []
    while not notifies and time.monotonic() < deadline:
        _, notifies = engine.get_notifies()
        time.sleep(0.01)
    if not notifies:
        raise SystemExit("server: no notify from the client")
    print(f"server: notify {notifies[0].name!r}: {notifies[0].notify_msg!r}")
    assert buffer.raw[:BLOCK] == b"\xab" * BLOCK, "the client's write did not arrive"
    print(f"server: the first {BLOCK} bytes are the client's now")
    engine.deregister_mem(handle)
    engine.finalize()


def client(control: Connection) -> None:
    engine = start("127.0.0.1")  # no port: a client only
    remote = control.recv()
    buffer = ctypes.create_string_buffer(NBYTES)
    here = ctypes.addressof(buffer)
    handle = register(engine, buffer)
    if engine.connect(SERVER, timeout_in_millis=5000) != hixl.SUCCESS:
        raise SystemExit("client: connect failed")
    # Every other block of the server's buffer, into the same place here: one descriptor each, one call.
    blocks = range(0, NBYTES - BLOCK, 2 * BLOCK)
    descs = [hixl.TransferOpDesc(here + offset, remote + offset, BLOCK) for offset in blocks]
    ret = engine.transfer_sync(SERVER, hixl.READ, descs, timeout_in_millis=5000)
    assert ret == hixl.SUCCESS, ret
    expected = bytes(i % 251 for i in range(NBYTES))
    assert all(buffer.raw[o : o + BLOCK] == expected[o : o + BLOCK] for o in blocks)
    print(f"client: read {len(descs)} blocks of {BLOCK} bytes ({len(descs) * BLOCK} bytes), all as sent")
    ctypes.memset(here, 0xAB, BLOCK)
    ret = engine.transfer_sync(SERVER, hixl.WRITE, [hixl.TransferOpDesc(here, remote, BLOCK)])
    assert ret == hixl.SUCCESS, ret
    print(f"client: wrote {BLOCK} bytes to the server")
    ret, req = engine.transfer_async(SERVER, hixl.READ, [hixl.TransferOpDesc(here, remote + BLOCK, BLOCK)])
    assert ret == hixl.SUCCESS, ret
    status, deadline = hixl.TransferStatus.WAITING, time.monotonic() + 10
    while status == hixl.TransferStatus.WAITING and time.monotonic() < deadline:
        ret, status = engine.get_transfer_status(req)
    assert status == hixl.TransferStatus.COMPLETED, status
    assert buffer.raw[:BLOCK] == expected[BLOCK : 2 * BLOCK]
    print(f"client: read {BLOCK} more bytes asynchronously (request {req})")
    ret = engine.send_notify(SERVER, hixl.NotifyDesc("done", f"{len(descs) + 2} transfers"))
    assert ret == hixl.SUCCESS, ret
    engine.disconnect(SERVER)
    engine.deregister_mem(handle)
    engine.finalize()


if __name__ == "__main__":
    run_pair(server, client)
