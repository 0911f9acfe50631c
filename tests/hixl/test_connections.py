"""Connections between two engines in two processes: connect and disconnect, asynchronous connects and
their statuses, AUTO_CONNECT, timeouts against a stopped peer, a peer that finalizes or dies while
connected."""

from __future__ import annotations

import ctypes
import json
import time

import pytest

import hixl

from ._local import SERVER, local_engine
from ._peer import Peer, pattern, peer

NOBODY = "127.0.0.1:26399"


def _serve(remote: Peer, nbytes: int = 3333) -> int:
    """The peer serves at SERVER with one registered buffer of pattern(0): its address."""
    assert remote("initialize", SERVER, {}) == hixl.SUCCESS
    addr: int = remote("alloc", nbytes, 0)
    assert remote("register_mem", (addr, nbytes), int(hixl.MEM_HOST))[0] == hixl.SUCCESS
    return addr


def _read(engine: hixl.Hixl, here: int, there: int, nbytes: int, timeout_ms: int = 2000) -> int:
    return engine.transfer_sync(SERVER, hixl.READ, [hixl.TransferOpDesc(here, there, nbytes)], timeout_ms)


def _status_becomes(engine: hixl.Hixl, remote: str, wanted: hixl.AsyncConnectStatus) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ret, status = engine.get_async_connect_status(remote)
        assert ret == hixl.SUCCESS
        if status == wanted:
            return
        time.sleep(0.005)
    raise AssertionError(f"{remote} never became {wanted}: {status}")


def test_connect_and_disconnect() -> None:
    with peer() as remote, local_engine() as local:
        there = _serve(remote)
        here, _ = local.register(3333)
        engine = local.engine
        assert engine.connect(NOBODY, 500) == hixl.FAILED  # nothing serves there, said at once
        assert engine.connect("127.0.0.1", 500) == hixl.FAILED  # an engine without a port serves nothing
        assert engine.disconnect(SERVER) == hixl.NOT_CONNECTED
        assert engine.connect(SERVER, 2000) == hixl.SUCCESS
        assert engine.connect(SERVER, 2000) == hixl.ALREADY_CONNECTED
        assert _read(engine, here, there, 3333) == hixl.SUCCESS
        assert engine.disconnect(SERVER) == hixl.SUCCESS
        assert engine.disconnect(SERVER) == hixl.NOT_CONNECTED
        assert _read(engine, here, there, 3333) == hixl.NOT_CONNECTED
        assert engine.connect(SERVER, 2000) == hixl.SUCCESS  # and again
        assert _read(engine, here, there, 3333) == hixl.SUCCESS
        assert ctypes.string_at(here, 3333) == pattern(0, 3333)


def test_async_connects_and_their_statuses() -> None:
    with peer() as remote, local_engine() as local:
        there = _serve(remote)
        here, _ = local.register(3333)
        engine = local.engine
        assert engine.connect_async(SERVER, 2000) == hixl.SUCCESS
        _status_becomes(engine, SERVER, hixl.AsyncConnectStatus.CONNECTED)
        assert engine.get_all_async_connect_status() == (hixl.SUCCESS, {SERVER: hixl.CONNECTED})
        assert _read(engine, here, there, 3333) == hixl.SUCCESS
        assert engine.disconnect_async(SERVER, 2000) == hixl.SUCCESS
        _status_becomes(engine, SERVER, hixl.AsyncConnectStatus.NOT_CONNECT)
        assert engine.get_all_async_connect_status() == (hixl.SUCCESS, {})
        assert _read(engine, here, there, 3333) == hixl.NOT_CONNECTED
        assert engine.connect_async(NOBODY, 500) == hixl.SUCCESS
        _status_becomes(engine, NOBODY, hixl.AsyncConnectStatus.CONNECT_FAILED)


def test_a_full_connect_queue_is_resource_exhausted() -> None:
    pool = json.dumps({"connect_pool.thread_num": "1", "connect_pool.task_queue_capacity": "1"})
    with peer() as remote, local_engine(options={hixl.OPTION_GLOBAL_RESOURCE_CONFIG: pool}) as local:
        _serve(remote)
        engine = local.engine
        remote.pause()  # the one worker's connect waits out its timeout
        assert engine.connect_async(SERVER, 1000) == hixl.SUCCESS
        _status_becomes(engine, SERVER, hixl.AsyncConnectStatus.CONNECTING)
        assert engine.connect_async(NOBODY, 1000) == hixl.SUCCESS  # queued
        assert engine.get_async_connect_status(NOBODY) == (hixl.SUCCESS, hixl.CONNECT_PENDING)
        assert engine.connect_async("127.0.0.1:26398", 1000) == hixl.RESOURCE_EXHAUSTED
        remote.resume()
        _status_becomes(engine, NOBODY, hixl.AsyncConnectStatus.CONNECT_FAILED)


def test_auto_connect() -> None:
    with peer() as remote:
        there = _serve(remote)
        with local_engine(options={hixl.OPTION_AUTO_CONNECT: "1"}) as local:
            here, _ = local.register(3333)
            assert _read(local.engine, here, there, 3333) == hixl.SUCCESS
            assert ctypes.string_at(here, 3333) == pattern(0, 3333)
            assert local.engine.connect(SERVER) == hixl.ALREADY_CONNECTED
            ret, req = local.engine.transfer_async(NOBODY, hixl.READ, [hixl.TransferOpDesc(here, there, 1)])
            assert (ret, req) == (hixl.NOT_CONNECTED, 0)
        with local_engine(options={hixl.OPTION_AUTO_CONNECT: "0"}) as local:
            here, _ = local.register(3333)
            assert _read(local.engine, here, there, 3333) == hixl.NOT_CONNECTED


def test_waits_on_a_stopped_peer_end_at_their_timeout() -> None:
    with peer() as remote, local_engine() as local:
        there = _serve(remote)
        here, _ = local.register(3333)
        engine = local.engine
        remote.pause()
        try:
            start = time.monotonic()
            assert engine.connect(SERVER, 300) == hixl.TIMEOUT
            assert time.monotonic() - start < 2.0
        finally:
            remote.resume()
        assert engine.connect(SERVER, 2000) == hixl.SUCCESS
        remote.pause()
        try:
            # A read on this host is one-sided: a stopped peer does not hold it up.
            assert _read(engine, here, there, 3333, 300) == hixl.SUCCESS
            start = time.monotonic()
            assert engine.send_notify(SERVER, hixl.NotifyDesc("n", "m"), 300) == hixl.TIMEOUT
            assert time.monotonic() - start < 2.0
        finally:
            remote.resume()
        # A link that timed out waiting for its peer is broken until connected again.
        assert engine.send_notify(SERVER, hixl.NotifyDesc("n", "m")) == hixl.NOTIFY_FAILED
        assert engine.disconnect(SERVER) == hixl.SUCCESS
        assert engine.connect(SERVER, 2000) == hixl.SUCCESS
        assert engine.send_notify(SERVER, hixl.NotifyDesc("n", "m")) == hixl.SUCCESS


@pytest.mark.parametrize("how", ["finalize", "kill"])
def test_a_peer_that_ends_while_connected(how: str) -> None:
    with peer() as remote, local_engine(options={hixl.OPTION_AUTO_CONNECT: "0"}) as local:
        there = _serve(remote)
        here, _ = local.register(3333)
        engine = local.engine
        assert engine.connect(SERVER, 2000) == hixl.SUCCESS
        assert _read(engine, here, there, 3333) == hixl.SUCCESS
        if how == "finalize":
            assert remote("finalize") is None
        else:
            remote.kill()
        for op in (hixl.READ, hixl.WRITE):
            desc = [hixl.TransferOpDesc(here, there, 8)]
            assert engine.transfer_sync(SERVER, op, desc, 1000) == hixl.FAILED
        assert engine.send_notify(SERVER, hixl.NotifyDesc("n", "m")) == hixl.NOTIFY_FAILED
        assert engine.disconnect(SERVER) == hixl.SUCCESS
        assert engine.connect(SERVER, 500) == hixl.FAILED


def test_finalize_while_connected_both_ways() -> None:
    """The test's engine finalizes while the peer is connected to it and it to the peer: the peer's next
    transfer fails, its own memory and notifies stay its own."""
    address = "127.0.0.1:26301"
    with peer() as remote:
        there = _serve(remote)
        with local_engine(address) as local:
            here, _ = local.register(3333, seed=4)
            assert local.engine.connect(SERVER, 2000) == hixl.SUCCESS
            assert remote("connect", address, 2000) == hixl.SUCCESS
            ops = [(there, here, 3333)]
            assert remote("transfer_sync", address, int(hixl.READ), ops, 1000) == hixl.SUCCESS
            assert local.engine.send_notify(SERVER, hixl.NotifyDesc("bye", "now")) == hixl.SUCCESS
        assert remote("transfer_sync", address, int(hixl.READ), ops, 1000) == hixl.FAILED
        assert remote("get_notifies") == (hixl.SUCCESS, [("bye", "now")])
        assert remote("read", there, 3333) == pattern(4, 3333)
        assert remote("disconnect", address, 1000) == hixl.SUCCESS
