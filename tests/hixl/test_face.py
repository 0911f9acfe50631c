"""The `hixl` face in one process: names, values, defaults and argument conversion as the real binding,
the statuses before `initialize`, what `initialize` refuses, and registration rules."""

from __future__ import annotations

import ctypes
import gc
import json
import multiprocessing as mp
import os
from multiprocessing.connection import Connection

import pytest

import hixl
import hixl.hixl

from ._local import local_engine

# The names the real package exports (hicann/hixl src/python/hixl_py/hixl/__init__.py).
REAL_NAMES = {
    "SUCCESS",
    "PARAM_INVALID",
    "TIMEOUT",
    "NOT_CONNECTED",
    "ALREADY_CONNECTED",
    "NOTIFY_FAILED",
    "UNSUPPORTED",
    "FAILED",
    "RESOURCE_EXHAUSTED",
    "FEATURE_SUPPORTED",
    "FEATURE_NOT_SUPPORTED",
    "OPTION_ENABLE_USE_FABRIC_MEM",
    "OPTION_RDMA_TRAFFIC_CLASS",
    "OPTION_RDMA_SERVICE_LEVEL",
    "OPTION_BUFFER_POOL",
    "OPTION_GLOBAL_RESOURCE_CONFIG",
    "OPTION_AUTO_CONNECT",
    "OPTION_LOCAL_COMM_RES",
    "MemType",
    "MEM_DEVICE",
    "MEM_HOST",
    "TransferOp",
    "READ",
    "WRITE",
    "TransferStatus",
    "AsyncConnectStatus",
    "NOT_CONNECT",
    "CONNECT_PENDING",
    "CONNECTING",
    "CONNECTED",
    "CONNECT_FAILED",
    "DISCONNECT_PENDING",
    "DISCONNECTING",
    "FeatureType",
    "AUTO_CONNECT",
    "CLIENT_SERVER_COMM",
    "MemDesc",
    "TransferOpDesc",
    "TransferArgs",
    "GetTransferStatusArgs",
    "TransferResult",
    "NotifyDesc",
    "Hixl",
    "get_capability",
}
CS = '{"version": "1.3"}'  # LocalCommRes that selects the client/server engine


def test_the_package_exports_the_real_names() -> None:
    assert set(hixl.__all__) == REAL_NAMES
    for name in REAL_NAMES:
        assert getattr(hixl, name) is getattr(hixl.hixl, name)
    assert hixl.Hixl.__module__ == "hixl.hixl"
    options = {
        hixl.OPTION_ENABLE_USE_FABRIC_MEM: "EnableUseFabricMem",
        hixl.OPTION_RDMA_TRAFFIC_CLASS: "RdmaTrafficClass",
        hixl.OPTION_RDMA_SERVICE_LEVEL: "RdmaServiceLevel",
        hixl.OPTION_BUFFER_POOL: "BufferPool",
        hixl.OPTION_GLOBAL_RESOURCE_CONFIG: "GlobalResourceConfig",
        hixl.OPTION_AUTO_CONNECT: "AutoConnect",
        hixl.OPTION_LOCAL_COMM_RES: "LocalCommRes",
    }
    assert all(key == value for key, value in options.items())


def test_plain_enums_equal_their_numbers_and_scoped_ones_only_themselves() -> None:
    assert hixl.MEM_HOST == 1 and hixl.WRITE == 1 and hixl.CLIENT_SERVER_COMM == 1
    assert hixl.MemType(0) is hixl.MEM_DEVICE and hixl.READ is hixl.TransferOp.READ
    assert str(hixl.MemType.MEM_HOST) == "MemType.MEM_HOST"
    assert repr(hixl.TransferOp.WRITE) == "<TransferOp.WRITE: 1>"
    assert hixl.TransferStatus.WAITING != 0 and int(hixl.TransferStatus.TIMEOUT) == 2
    assert hixl.AsyncConnectStatus.CONNECTED != 3 and int(hixl.CONNECTED) == 3
    assert hixl.NOT_CONNECT is hixl.AsyncConnectStatus.NOT_CONNECT
    assert str(hixl.TransferStatus.FAILED) == "TransferStatus.FAILED"
    # TransferStatus's values are not exported: its TIMEOUT and FAILED would hide the status codes.
    assert hixl.TIMEOUT == 103901 and hixl.FAILED == 503900
    assert not hasattr(hixl, "WAITING") and not hasattr(hixl, "COMPLETED")


def test_value_classes_convert_as_the_binding() -> None:
    desc = hixl.MemDesc(2**64 - 1, 0)
    assert (desc.addr, desc.len) == (2**64 - 1, 0)
    for bad in (-1, 2**64, 1.5, "1", None):
        with pytest.raises(TypeError):
            hixl.MemDesc(bad, 1)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            hixl.TransferOpDesc(1, 1, bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        hixl.GetTransferStatusArgs(max_query_count=2**32)
    with pytest.raises(TypeError):
        hixl.GetTransferStatusArgs(skip_waiting=1)  # type: ignore[arg-type]
    result = hixl.TransferResult()
    with pytest.raises(AttributeError):
        result.status = hixl.TransferStatus.COMPLETED  # type: ignore[misc]
    notify = hixl.NotifyDesc(name="a\0b", notify_msg="é")
    assert (notify.name, notify.notify_msg) == ("a", "é")  # the engine's C strings end at a NUL
    with pytest.raises(TypeError):
        hixl.NotifyDesc(name=1, notify_msg="")  # type: ignore[arg-type]


def test_before_initialize_every_call_is_failed() -> None:
    engine = hixl.Hixl()
    desc = hixl.TransferOpDesc(1, 2, 3)
    assert engine.connect("127.0.0.1:26301") == hixl.FAILED
    assert engine.connect("127.0.0.1:26301", 0) == hixl.FAILED  # not initialised comes first
    assert engine.register_mem(hixl.MemDesc(1, 1), hixl.MEM_HOST) == (hixl.FAILED, 0)
    assert engine.deregister_mem(1) == hixl.FAILED
    assert engine.transfer_sync("127.0.0.1:26301", hixl.READ, [desc]) == hixl.FAILED
    assert engine.transfer_async("127.0.0.1:26301", hixl.READ, [desc]) == (hixl.FAILED, 0)
    assert engine.get_transfer_status(5) == (hixl.FAILED, hixl.TransferStatus.FAILED)
    assert engine.get_async_connect_status("x") == (hixl.FAILED, hixl.NOT_CONNECT)
    assert engine.get_all_async_connect_status() == (hixl.FAILED, {})
    assert engine.get_all_transfer_status() == (hixl.FAILED, [])
    assert engine.get_notifies() == (hixl.FAILED, [])
    engine.finalize()  # nothing to do


def test_wrong_argument_types_are_type_errors() -> None:
    with local_engine() as local:
        engine = local.engine
        with pytest.raises(TypeError):
            engine.register_mem(hixl.MemDesc(1, 1), 1)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            engine.transfer_sync("127.0.0.1:1", 0, [])  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            engine.transfer_sync("127.0.0.1:1", hixl.READ, [(1, 2, 3)])  # type: ignore[list-item]
        with pytest.raises(TypeError):
            engine.connect("127.0.0.1:1", 2**31)
        with pytest.raises(TypeError):
            hixl.get_capability(0)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            engine.initialize("127.0.0.1:0", {"AutoConnect": 1})  # type: ignore[dict-item]


def test_timeouts_must_be_positive() -> None:
    with local_engine() as local:
        engine = local.engine
        assert engine.connect("127.0.0.1:26301", 0) == hixl.PARAM_INVALID
        assert engine.disconnect("127.0.0.1:26301", -1) == hixl.PARAM_INVALID
        assert engine.connect_async("127.0.0.1:26301", 0) == hixl.PARAM_INVALID
        assert engine.disconnect_async("127.0.0.1:26301", 0) == hixl.PARAM_INVALID
        desc = hixl.TransferOpDesc(1, 2, 3)
        assert engine.transfer_sync("127.0.0.1:26301", hixl.READ, [desc], 0) == hixl.PARAM_INVALID
        notify = hixl.NotifyDesc("n", "m")
        assert engine.send_notify("127.0.0.1:26301", notify, 0) == hixl.PARAM_INVALID


@pytest.mark.parametrize(
    ("address", "options", "expected"),
    [
        ("localhost:26301", {}, hixl.PARAM_INVALID),
        ("127.0.0.1:x", {}, hixl.PARAM_INVALID),
        ("127.0.0.1:70000", {}, hixl.PARAM_INVALID),
        ("127.0.0.1", {}, hixl.SUCCESS),  # no port: a client only
        ("[::1]:0", {}, hixl.SUCCESS),
        ("127.0.0.1:0", {"NoSuchOption": "1"}, hixl.PARAM_INVALID),
        ("127.0.0.1:0", {"AutoConnect": ""}, hixl.PARAM_INVALID),
        ("127.0.0.1:0", {"AutoConnect": "2"}, hixl.PARAM_INVALID),
        ("127.0.0.1:0", {"RdmaTrafficClass": "130"}, hixl.PARAM_INVALID),
        ("127.0.0.1:0", {"RdmaTrafficClass": "132", "adxl.RdmaServiceLevel": "4"}, hixl.SUCCESS),
        ("127.0.0.1:0", {"RdmaServiceLevel": "8"}, hixl.PARAM_INVALID),
        ("127.0.0.1:0", {"BufferPool": "4:8"}, hixl.SUCCESS),
        ("127.0.0.1:0", {"BufferPool": "4:x"}, hixl.PARAM_INVALID),
        ("127.0.0.1:0", {"EnableUseFabricMem": "1"}, hixl.UNSUPPORTED),
        ("127.0.0.1:0", {"EnableUseFabricMem": "0"}, hixl.SUCCESS),
        ("127.0.0.1:0", {"GlobalResourceConfig": "[1]"}, hixl.PARAM_INVALID),
        ("127.0.0.1:0", {"GlobalResourceConfig": '{"connect_pool.thread_num": "0"}'}, hixl.PARAM_INVALID),
        ("127.0.0.1:0", {"GlobalResourceConfig": '{"connect_pool.thread_num": 3}'}, hixl.SUCCESS),
        ("127.0.0.1:0", {"LocalCommRes": "{"}, hixl.FAILED),
        # The client/server engine (LocalCommRes version 1.3): no fabric memory, no buffer pool.
        ("127.0.0.1:0", {"LocalCommRes": CS, "BufferPool": "4:8"}, hixl.PARAM_INVALID),
        ("127.0.0.1:0", {"LocalCommRes": CS, "BufferPool": "0:0"}, hixl.SUCCESS),
        ("127.0.0.1:0", {"LocalCommRes": CS, "EnableUseFabricMem": "0"}, hixl.PARAM_INVALID),
    ],
)
def test_initialize_checks_its_arguments(address: str, options: dict[str, str], expected: int) -> None:
    engine = hixl.Hixl()
    try:
        assert engine.initialize(address, options) == expected
    finally:
        engine.finalize()


def test_an_address_served_by_another_engine_is_failed() -> None:
    with local_engine("127.0.0.1:26301"):
        other = hixl.Hixl()
        assert other.initialize("127.0.0.1:26301") == hixl.FAILED
        assert other.initialize("127.0.0.1:26302") == hixl.SUCCESS  # a failed initialize can be retried
        other.finalize()


def test_registration_rules() -> None:
    with local_engine() as local:
        engine = local.engine
        addr = local.buffers.alloc(3333)
        ret, handle = engine.register_mem(hixl.MemDesc(addr, 3333), hixl.MEM_DEVICE)
        assert ret == hixl.SUCCESS and handle != 0
        # The same range again: the same handle; overlapping it: refused.
        assert engine.register_mem(hixl.MemDesc(addr, 3333), hixl.MEM_DEVICE) == (hixl.SUCCESS, handle)
        assert engine.register_mem(hixl.MemDesc(addr + 1, 10), hixl.MEM_HOST)[0] == hixl.PARAM_INVALID
        assert engine.register_mem(hixl.MemDesc(addr, 0), hixl.MEM_HOST)[0] == hixl.PARAM_INVALID
        assert engine.register_mem(hixl.MemDesc(0, 8), hixl.MEM_HOST) == (hixl.PARAM_INVALID, 0)
        # Memory this process has not mapped (page 0 and up) is no memory a peer may reach.
        assert engine.register_mem(hixl.MemDesc(4096, 4096), hixl.MEM_HOST)[0] == hixl.PARAM_INVALID
        assert engine.deregister_mem(0) == hixl.PARAM_INVALID
        assert engine.deregister_mem(handle + 12345) == hixl.SUCCESS  # unknown: nothing to do
        assert engine.deregister_mem(handle) == hixl.SUCCESS
        assert engine.deregister_mem(handle) == hixl.SUCCESS
        # Free again: a part of it registers now.
        assert engine.register_mem(hixl.MemDesc(addr + 1, 10), hixl.MEM_HOST)[0] == hixl.SUCCESS


def test_status_queries_without_transfers() -> None:
    with local_engine() as local:
        engine = local.engine
        assert engine.get_transfer_status(0) == (hixl.FAILED, hixl.TransferStatus.FAILED)
        assert engine.get_transfer_status(77) == (hixl.PARAM_INVALID, hixl.TransferStatus.FAILED)
        # The default engine does not answer for all requests; the client/server engine does.
        assert engine.get_all_transfer_status() == (hixl.UNSUPPORTED, [])
        assert engine.get_notifies() == (hixl.SUCCESS, [])
        assert engine.get_async_connect_status("127.0.0.1:9") == (hixl.SUCCESS, hixl.NOT_CONNECT)
    config = json.dumps({"comm_resource_config.protocol_desc": ["roce:device"]})
    with local_engine(options={hixl.OPTION_GLOBAL_RESOURCE_CONFIG: config}) as local:
        assert local.engine.get_all_transfer_status() == (hixl.SUCCESS, [])
    assert hixl.get_capability(hixl.AUTO_CONNECT) == (hixl.SUCCESS, hixl.FEATURE_SUPPORTED)
    assert hixl.get_capability(hixl.CLIENT_SERVER_COMM) == (hixl.SUCCESS, hixl.FEATURE_SUPPORTED)


def test_two_engines_of_one_process_read_and_write_each_other() -> None:
    with local_engine("127.0.0.1:26301") as server, local_engine() as client:
        remote, _ = server.register(3333, seed=5)
        here, _ = client.register(3333)
        assert client.engine.connect("127.0.0.1:26301") == hixl.SUCCESS
        assert client.engine.connect("127.0.0.1:26301") == hixl.ALREADY_CONNECTED
        assert client.engine.connect("127.0.0.1:26301".replace("26301", "026301")) == hixl.ALREADY_CONNECTED
        op = hixl.TransferOpDesc(here, remote, 3333)
        assert client.engine.transfer_sync("127.0.0.1:26301", hixl.READ, [op]) == hixl.SUCCESS
        assert ctypes.string_at(here, 3333) == ctypes.string_at(remote, 3333)
        ctypes.memset(here, 0x5A, 3333)
        assert client.engine.transfer_sync("127.0.0.1:26301", hixl.WRITE, [op]) == hixl.SUCCESS
        assert ctypes.string_at(remote, 3333) == b"\x5a" * 3333
        # An engine does not connect to itself.
        assert server.engine.connect("127.0.0.1:26301") == hixl.PARAM_INVALID


def test_an_engine_never_finalized_is_finalized_when_collected() -> None:
    engine = hixl.Hixl()
    assert engine.initialize("127.0.0.1:26301") == hixl.SUCCESS
    runtime = os.environ["LLM_DATADIST_RUNTIME_DIR"]
    assert os.path.exists(os.path.join(runtime, "127.0.0.1_26301.sock"))
    del engine
    gc.collect()
    assert not os.path.exists(os.path.join(runtime, "127.0.0.1_26301.sock"))


def _child_after_fork(pipe: Connection, addr: int) -> None:
    """In the forked child: the parent's engine answers FAILED; one of the child's own works."""
    inherited = _INHERITED[0]
    results = [
        inherited.connect("127.0.0.1:26301") == hixl.FAILED,
        inherited.register_mem(hixl.MemDesc(addr, 64), hixl.MEM_HOST)[0] == hixl.FAILED,
        inherited.get_notifies() == (hixl.FAILED, []),
    ]
    inherited.finalize()  # touches nothing of the parent's
    own = hixl.Hixl()
    results.append(own.initialize("127.0.0.1:26302") == hixl.SUCCESS)
    results.append(own.connect("127.0.0.1:26301", 2000) == hixl.SUCCESS)
    own.finalize()
    pipe.send(results)


_INHERITED: list[hixl.Hixl] = []


def test_a_child_forked_after_initialize() -> None:
    with local_engine("127.0.0.1:26301") as local:
        addr, _ = local.register(3333, seed=3)
        _INHERITED[:] = [local.engine]
        ctx = mp.get_context("fork")
        ours, theirs = ctx.Pipe()
        child = ctx.Process(target=_child_after_fork, args=(theirs, addr))
        child.start()
        try:
            assert ours.poll(30), "the child did not report"
            assert ours.recv() == [True] * 5
        finally:
            child.join(10)
            if child.is_alive():
                child.kill()
                child.join(10)
            _INHERITED.clear()
        assert child.exitcode == 0
        # The parent's engine still serves: a client connects and reads.
        with local_engine() as client:
            here, _ = client.register(3333)
            assert client.engine.connect("127.0.0.1:26301", 2000) == hixl.SUCCESS
            op = hixl.TransferOpDesc(here, addr, 3333)
            assert client.engine.transfer_sync("127.0.0.1:26301", hixl.READ, [op]) == hixl.SUCCESS
            assert ctypes.string_at(here, 3333) == ctypes.string_at(addr, 3333)
