"""The bounds of `transfer_async`'s requests: at most 4096 per remote engine not yet reported ended (the
real client/server engine's flag queue), RESOURCE_EXHAUSTED past that with nothing started, room again
once one is reported, the bound kept per remote engine; and a request that ended and nobody asked about
is forgotten after a while (it no longer counts, and asking about it then is PARAM_INVALID)."""

from __future__ import annotations

import ctypes
import time

import pytest

import hixl
from llm_datadist._hixl import requests

from ._local import SERVER, local_engine
from ._peer import Peer, pattern, peer

HOST = int(hixl.MEM_HOST)
OTHER = "127.0.0.1:26301"
NBYTES = 3333


def _serve(remote: Peer, address: str, seed: int) -> int:
    """The peer serves at `address` with one registered buffer of pattern(seed): its address."""
    assert remote("initialize", address, {}) == hixl.SUCCESS
    addr = remote("alloc", NBYTES, seed)
    ret, _ = remote("register_mem", (addr, NBYTES), HOST)
    assert ret == hixl.SUCCESS
    return int(addr)


def _read(engine: hixl.Hixl, remote: str, here: int, there: int) -> tuple[int, int]:
    return engine.transfer_async(remote, hixl.READ, [hixl.TransferOpDesc(here, there, NBYTES)])


def _ended(engine: hixl.Hixl, req: int) -> hixl.TransferStatus:
    """Ask about `req` until it ended (this reports it, and so forgets it)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ret, status = engine.get_transfer_status(req)
        assert ret == hixl.SUCCESS, ret
        if status != hixl.TransferStatus.WAITING:
            return status
        time.sleep(0.002)
    raise AssertionError(f"request {req} did not end")


def test_past_4096_unreported_requests_to_one_engine_transfer_async_is_resource_exhausted() -> None:
    with peer() as first, peer() as second, local_engine() as local:
        a = _serve(first, SERVER, 1)
        b = _serve(second, OTHER, 2)
        here, _ = local.register(NBYTES)
        assert local.engine.connect(SERVER, 5000) == hixl.SUCCESS
        assert local.engine.connect(OTHER, 5000) == hixl.SUCCESS
        reqs = []
        for _ in range(4096):
            ret, req = _read(local.engine, SERVER, here, a)
            assert ret == hixl.SUCCESS, ret
            reqs.append(req)
        # Running, queued or ended: none was reported, so each holds its place.
        assert _read(local.engine, SERVER, here, a) == (hixl.RESOURCE_EXHAUSTED, 0)
        # The bound is per remote engine.
        ret, other = _read(local.engine, OTHER, here + 0, b)
        assert ret == hixl.SUCCESS
        assert _ended(local.engine, other) == hixl.TransferStatus.COMPLETED
        # One reported ended gives one place back, and only one.
        assert _ended(local.engine, reqs.pop(0)) == hixl.TransferStatus.COMPLETED
        ret, req = _read(local.engine, SERVER, here, a)
        assert ret == hixl.SUCCESS
        reqs.append(req)
        assert _read(local.engine, SERVER, here, a) == (hixl.RESOURCE_EXHAUSTED, 0)
        assert all(_ended(local.engine, req) == hixl.TransferStatus.COMPLETED for req in reqs)
        assert ctypes.string_at(here, NBYTES) == pattern(1, NBYTES)
        # All reported: the whole bound is free again.
        for _ in range(3):
            ret, req = _read(local.engine, SERVER, here, a)
            assert ret == hixl.SUCCESS
            assert _ended(local.engine, req) == hixl.TransferStatus.COMPLETED


def test_the_client_server_engine_reports_through_get_all_transfer_status_and_frees_places() -> None:
    cs = {hixl.OPTION_LOCAL_COMM_RES: '{"version": "1.3"}'}
    with peer() as remote, local_engine(options=cs) as local:
        assert remote("initialize", SERVER, cs) == hixl.SUCCESS
        a = remote("alloc", NBYTES, 3)
        assert remote("register_mem", (a, NBYTES), HOST)[0] == hixl.SUCCESS
        here, _ = local.register(NBYTES)
        assert local.engine.connect(SERVER, 5000) == hixl.SUCCESS
        for _ in range(4096):
            assert _read(local.engine, SERVER, here, a)[0] == hixl.SUCCESS
        assert _read(local.engine, SERVER, here, a) == (hixl.RESOURCE_EXHAUSTED, 0)
        reported = 0
        deadline = time.monotonic() + 60
        while reported < 4096:
            assert time.monotonic() < deadline, f"only {reported} of 4096 requests were reported"
            args = hixl.GetTransferStatusArgs(skip_waiting=True)
            ret, results = local.engine.get_all_transfer_status(args)
            assert ret == hixl.SUCCESS
            assert all(r.status == hixl.TransferStatus.COMPLETED for r in results)
            reported += len(results)
            time.sleep(0.005)
        assert _read(local.engine, SERVER, here, a)[0] == hixl.SUCCESS


def test_a_request_nobody_asks_about_is_forgotten_after_it_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    # Shorter bounds for the test: the rule is the same at 4096 and 60 s.
    monkeypatch.setattr(requests, "MAX_REQUESTS_PER_PEER", 16)
    monkeypatch.setattr(requests, "UNASKED_KEEP_S", 0.3)
    with peer() as remote, local_engine() as local:
        a = _serve(remote, SERVER, 4)
        here, _ = local.register(NBYTES)
        assert local.engine.connect(SERVER, 5000) == hixl.SUCCESS
        fired = []
        for _ in range(16):
            ret, req = _read(local.engine, SERVER, here, a)
            assert ret == hixl.SUCCESS
            fired.append(req)
        assert _read(local.engine, SERVER, here, a) == (hixl.RESOURCE_EXHAUSTED, 0)
        # Nobody asks: once they ended and the keep passed, they are forgotten and their places free. Reaping
        # goes in the order requests ended, and all these ended before any new one started: sixteen new
        # places mean all sixteen are forgotten.
        placed = 0
        deadline = time.monotonic() + 30
        while placed < 16:
            ret, _ = _read(local.engine, SERVER, here, a)
            if ret == hixl.SUCCESS:
                placed += 1
                continue
            assert ret == hixl.RESOURCE_EXHAUSTED
            assert time.monotonic() < deadline, f"unasked requests were never forgotten ({placed} places)"
            time.sleep(0.05)
        for req in fired:
            assert local.engine.get_transfer_status(req) == (hixl.PARAM_INVALID, hixl.TransferStatus.FAILED)
        assert ctypes.string_at(here, NBYTES) == pattern(4, NBYTES)
