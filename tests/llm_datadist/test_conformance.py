"""The argument checks docs/conformance.md lists as fixed: each test pins the exception type (and status code)
the real Python layer raises for the same input, in one process unless a peer is needed."""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Iterator

import numpy as np
import pytest

import llm_datadist
from llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCache,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    MemInfo,
    Memtype,
    Placement,
    TransferConfig,
)
from tests._peer import PROMPT_IP, _Synchronizer

PI = LLMStatusCode.LLM_PARAM_INVALID
POOL = json.dumps({"memory_size": 16 << 20, "page_shift": 16})
U64_MAX = 2**64 - 1


def _base(**extra: str) -> dict[str, str]:
    config = LLMConfig()
    config.device_id = 0
    return {**config.generate_options(), **extra}


def _v2(**extra: str) -> dict[str, str]:
    return _base(
        **{
            "llm.EnableCacheManager": "1",
            "llm.EnableRemoteCacheAccessible": "0",
            "llm.MemPoolConfig": POOL,
            "llm.HostMemPoolConfig": POOL,
            **extra,
        }
    )


@contextlib.contextmanager
def _running(role: LLMRole, options: dict[str, str], cluster_id: int = 2) -> Iterator[LLMDataDist]:
    dd = LLMDataDist(role, cluster_id)
    dd.init(options)
    try:
        yield dd
    finally:
        dd.finalize()


def _code(exc_info: pytest.ExceptionInfo[LLMException]) -> LLMStatusCode:
    return exc_info.value.status_code


# ----------------------------------------------------------------------------- LLMDataDist.init


def test_second_instance_is_refused_before_its_options_are_read() -> None:
    with _running(LLMRole.DECODER, _base()):
        for options in ("not a dict", {"ge.exec.deviceId": "x"}, {}):
            with pytest.raises(LLMException) as exc_info:
                LLMDataDist(LLMRole.DECODER, 3).init(options)  # type: ignore[arg-type]
            assert _code(exc_info) == LLMStatusCode.LLM_FAILED
            assert str(exc_info.value) == "Cannot init multiple LLMDataDists"


def test_local_comm_res_needs_cache_manager_mode() -> None:
    dd = LLMDataDist(LLMRole.DECODER, 2)
    with pytest.raises(LLMException) as exc_info:
        dd.init(_base(**{"llm.LocalCommRes": "{}", "llm.EnableCacheManager": "0"}))
    assert _code(exc_info) == PI
    assert LLMDataDist.llm_engine_instance is None
    with _running(LLMRole.DECODER, _base(**{"llm.LocalCommRes": ""})) as dd:
        dd.cache_manager  # noqa: B018 (LocalCommRes alone turns cache-manager mode on)


@pytest.mark.parametrize(
    ("listen", "error", "code"),
    [
        (f"{PROMPT_IP}:http", ValueError, None),  # int(port)
        (f"{PROMPT_IP}:", ValueError, None),
        (PROMPT_IP, LLMException, PI),  # one part
        ("", LLMException, PI),  # "" is one part too
        (f"{PROMPT_IP}:1:2", LLMException, PI),
    ],
)
def test_v2_listen_ip_info_checks(listen: str, error: type[Exception], code: LLMStatusCode | None) -> None:
    with pytest.raises(error) as exc_info:
        LLMDataDist(LLMRole.PROMPT, 1).init(_v2(**{"llm.listenIpInfo": listen}))
    if code is not None:
        assert isinstance(exc_info.value, LLMException) and exc_info.value.status_code == code
    assert LLMDataDist.llm_engine_instance is None


@pytest.mark.parametrize(
    ("devices", "listen", "error", "code"),
    [
        ("0", f"{PROMPT_IP}:28501;{PROMPT_IP}:28502", LLMException, PI),  # one entry per device
        ("0;1", f"{PROMPT_IP}:28501", LLMException, PI),
        ("0;1", f"{PROMPT_IP}:28501;{PROMPT_IP}", LLMException, PI),  # every entry in two parts
        ("0;1", f"{PROMPT_IP}:28501;{PROMPT_IP}:x", ValueError, None),  # every port an int
        ("0", f"{PROMPT_IP}:x", ValueError, None),
        ("0", "", LLMException, PI),
        ("0;1", f"{PROMPT_IP}:28501;localhost:28502", RuntimeError, None),  # trans_str_ip
        ("0", "1.2.3.4.5:28501", RuntimeError, None),
    ],
)
def test_v1_prompt_listen_ip_info_checks(
    devices: str, listen: str, error: type[Exception], code: LLMStatusCode | None
) -> None:
    options = {"ge.exec.deviceId": devices, "llm.listenIpInfo": listen}
    with pytest.raises(error) as exc_info:
        LLMDataDist(LLMRole.PROMPT, 1).init(options)
    if code is None:
        assert not isinstance(exc_info.value, LLMException)
    else:
        assert isinstance(exc_info.value, LLMException) and exc_info.value.status_code == code
    if error is RuntimeError:
        assert str(exc_info.value).startswith("Can not parse ip str:")
    assert LLMDataDist.llm_engine_instance is None


def test_v1_prompt_serves_on_its_first_entry(_runtime_dir) -> None:  # type: ignore[no-untyped-def]
    options = {"ge.exec.deviceId": "0;1", "llm.listenIpInfo": "127.1:28503;127.0.0.1:28504"}
    with _running(LLMRole.PROMPT, options, cluster_id=1):
        assert (_runtime_dir / "127.0.0.1_28503.sock").exists()  # the ip as a dotted quad


# ----------------------------------------------------------------------------- LLMDataDist methods


def test_link_checks_in_v2() -> None:
    with _running(LLMRole.DECODER, _v2()) as dd:
        for comm_id in (-1, 2**64):
            with pytest.raises(ValueError):
                dd.unlink(comm_id)
            with pytest.raises(ValueError):
                dd.query_register_mem_status(comm_id)
        with pytest.raises(TypeError):
            dd.unlink("1")  # type: ignore[arg-type]
        for comm_id in (2**63, U64_MAX):  # uint64: passes the check, names no link
            with pytest.raises(LLMException) as exc_info:
                dd.unlink(comm_id)
            assert _code(exc_info) == PI
        unset = LLMClusterInfo()
        unset.append_local_ip_info(PROMPT_IP, 0)
        unset.append_remote_ip_info(PROMPT_IP, 28505)
        with pytest.raises(TypeError):
            dd.link_clusters([unset])  # remote_cluster_id unset
        with pytest.raises(TypeError):
            dd.unlink_clusters([unset])
        with pytest.raises(LLMException) as exc_info:
            dd.check_link_status(-1)  # the mode is checked before the argument
        assert _code(exc_info) == PI


def test_unlink_clusters_checks_ids_in_v1() -> None:
    with _running(LLMRole.DECODER, _base()) as dd:
        unset = LLMClusterInfo()
        unset.append_remote_ip_info(PROMPT_IP, 28506)
        with pytest.raises(TypeError):
            dd.unlink_clusters([unset])
        # v1 link_clusters reports an unset id in the result list (the real v1 hands it to the engine).
        code, codes = dd.link_clusters([unset])
        assert code == LLMStatusCode.LLM_LINK_FAILED and codes == [LLMStatusCode.LLM_LINK_FAILED]
        with pytest.raises(ValueError):
            dd.check_link_status(-1)


def test_switch_role_checks_in_v2() -> None:
    with _running(LLMRole.DECODER, _v2()) as dd:
        with pytest.raises(ValueError):
            dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"{PROMPT_IP}:port"})
        for listen in ("", PROMPT_IP):
            with pytest.raises(LLMException) as exc_info:
                dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": listen})
            assert _code(exc_info) == PI


def test_switch_role_checks_in_v1() -> None:
    # Without llm.EnableSwitchRole: every Python check of the real v1 comes before that (engine) check.
    with _running(LLMRole.DECODER, _base()) as dd:
        with pytest.raises(LLMException) as exc_info:
            dd.switch_role(LLMRole.DECODER)
        assert _code(exc_info) == PI  # role not changed
        with pytest.raises(LLMException) as exc_info:
            dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"{PROMPT_IP}"})
        assert _code(exc_info) == PI
        with pytest.raises(RuntimeError, match=r"^Can not parse ip str:localhost$"):
            dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "localhost:28507"})
        with pytest.raises(ValueError):
            dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"{PROMPT_IP}:x"})
        with pytest.raises(LLMException) as exc_info:
            dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"{PROMPT_IP}:28507"})
        assert _code(exc_info) == LLMStatusCode.LLM_FEATURE_NOT_ENABLED


# ----------------------------------------------------------------------------- KvCacheManager roles


def test_mix_is_neither_prompt_nor_decoder_in_v1() -> None:
    desc = CacheDesc(2, [1, 8], DataType.DT_FLOAT16)
    with _running(LLMRole.MIX, _base()) as dd:
        kvm = dd.kv_cache_manager
        cache = kvm.allocate_cache(desc)
        for call in (
            lambda: kvm.allocate_cache(desc, [CacheKey(2, 1)]),
            lambda: kvm.remove_cache_key(CacheKey(2, 1)),
            lambda: kvm.pull_cache(CacheKey(1, 1), cache),
            lambda: kvm.pull_blocks(BlocksCacheKey(1, 0), cache, [0], [0]),
            lambda: kvm.transfer_cache_async(cache, _Synchronizer("go", None), []),
        ):
            with pytest.raises(LLMException) as exc_info:
                call()
            assert _code(exc_info) == PI
        # Only a DECODER is refused a blocks key.
        blocks = kvm.allocate_blocks_cache(CacheDesc(2, [4, 8], DataType.DT_FLOAT16), BlocksCacheKey(2, 0))
        kvm.deallocate_cache(blocks)


def test_role_is_checked_before_the_arguments_in_v1() -> None:
    with _running(LLMRole.DECODER, _base()) as dd:
        kvm = dd.kv_cache_manager
        for call in (
            lambda: kvm.remove_cache_key("key"),
            lambda: kvm.transfer_cache_async("cache", "sync", "configs"),
        ):
            with pytest.raises(LLMException) as exc_info:
                call()
            assert _code(exc_info) == PI
    with _running(LLMRole.PROMPT, _base(**{"llm.listenIpInfo": f"{PROMPT_IP}:28508"}), 1) as dd:
        kvm = dd.kv_cache_manager
        for call in (
            lambda: kvm.pull_cache("key", "cache", batch_index="x"),
            lambda: kvm.pull_blocks("key", "cache", "blocks", None),
        ):
            with pytest.raises(LLMException) as exc_info:
                call()
            assert _code(exc_info) == PI


def test_check_cache_key_static_methods() -> None:
    from llm_datadist.v1.kv_cache_manager import KvCacheManager
    from llm_datadist.v2.cache_manager import CacheManager

    for manager in (KvCacheManager, CacheManager):
        manager.check_cache_key(CacheKey(1, 5))
        manager.check_cache_key(CacheKey(1, U64_MAX, 0, 7))
        for key in (CacheKey(1, U64_MAX), CacheKey(1, 5, 0, 7)):
            with pytest.raises(LLMException) as exc_info:
                manager.check_cache_key(key)
            assert _code(exc_info) == PI
    with pytest.raises(LLMException, match=r"req id:5, prefix id:7\.$"):
        CacheManager.check_cache_key(CacheKey(1, 5, 0, 7))
    with pytest.raises(LLMException, match=r"req id:5, prefix id7\.$"):
        KvCacheManager.check_cache_key(CacheKey(1, 5, 0, 7))


# ----------------------------------------------------------------------------- transfer_cache_async


def test_an_empty_transfer_config_list_reports_success() -> None:
    desc = CacheDesc(2, [1, 8], DataType.DT_FLOAT16)
    with _running(LLMRole.PROMPT, _base(**{"llm.listenIpInfo": f"{PROMPT_IP}:28509"}), 1) as dd:
        cache = dd.kv_cache_manager.allocate_cache(desc)
        task = dd.kv_cache_manager.transfer_cache_async(cache, _Synchronizer("go", None), [])
        assert task.synchronize(5000) == LLMStatusCode.LLM_SUCCESS
        assert task.get_results(5000) == []
        assert isinstance(task, llm_datadist.CacheTask)
    with _running(LLMRole.PROMPT, _v2()) as dd:
        cache = dd.cache_manager.allocate_cache(desc)
        task = dd.cache_manager.transfer_cache_async(cache, _Synchronizer("go", None), ())
        assert task.synchronize(5000) == LLMStatusCode.LLM_SUCCESS
        assert task.get_results() == []


# ----------------------------------------------------------------------------- CacheManager


def test_v2_pull_arguments() -> None:
    with _running(LLMRole.DECODER, _v2()) as dd:
        cm = dd.cache_manager
        plain = cm.allocate_cache(CacheDesc(2, [1, 8], DataType.DT_FLOAT16))
        blocks = cm.allocate_blocks_cache(CacheDesc(2, [4, 8], DataType.DT_FLOAT16))
        with pytest.raises(ValueError):
            cm.pull_cache(CacheKey(1, 1), plain, src_layer_range=range(2**32, 2**32 + 1))
        with pytest.raises(ValueError):
            cm.pull_blocks(BlocksCacheKey(1, 0), blocks, [0], [0], dst_layer_range=range(0, 2**32 + 1))
        # Unknown kwargs (v1's offsets too) are ignored: the pull goes ahead and finds no link.
        for call in (
            lambda: cm.pull_cache(CacheKey(1, 1), plain, no_such_option=1, src_cache_offset=-1),
            lambda: cm.pull_blocks(BlocksCacheKey(1, 0), blocks, [0], [0], dst_cache_offset=-1, x=2),
        ):
            with pytest.raises(LLMException) as exc_info:
                call()
            assert _code(exc_info) == LLMStatusCode.LLM_NOT_YET_LINK


def test_remap_registered_memory_checks() -> None:
    with _running(LLMRole.DECODER, _v2()) as dd:
        cm = dd.cache_manager
        device = MemInfo(Memtype.MEM_TYPE_DEVICE, 0x1000, 64)
        host = MemInfo(Memtype.MEM_TYPE_HOST, 0x1000, 64)
        # The engine's checks after the argument checks: something to remap, then a link (a remap with a
        # link is in tests/hixl/test_backend.py).
        for bad in ((device,), None, [device, "x"], [host], [MemInfo(Memtype.MEM_TYPE_DEVICE, 0, 64)], []):
            with pytest.raises(LLMException) as exc_info:
                cm.remap_registered_memory(bad)  # type: ignore[arg-type]
            assert _code(exc_info) == PI
        for good in (device, [device, device]):
            with pytest.raises(LLMException) as exc_info:
                cm.remap_registered_memory(good)
            assert _code(exc_info) == LLMStatusCode.LLM_NOT_YET_LINK


def test_swap_blocks_follows_the_placements() -> None:
    with _running(LLMRole.DECODER, _v2()) as dd:
        cm = dd.cache_manager
        device = cm.allocate_blocks_cache(CacheDesc(2, [4, 33], DataType.DT_FLOAT16))
        host = cm.allocate_blocks_cache(CacheDesc(2, [3, 33], DataType.DT_FLOAT16, Placement.HOST))
        plain = cm.allocate_cache(CacheDesc(2, [4, 33], DataType.DT_FLOAT16))
        buffers = [np.zeros(2 * 66, dtype=np.uint8) for _ in range(2)]
        cpu = Cache.create_cpu_cache(
            CacheDesc(2, [2, 33], DataType.DT_FLOAT16, Placement.HOST), [b.ctypes.data for b in buffers]
        )
        views = [np.ctypeslib.as_array(_bytes_at(addr, 4 * 66)) for addr in device.tensor_addrs]
        rng = np.random.default_rng(7)
        for view in views:
            view[:] = rng.integers(0, 256, view.nbytes, dtype=np.uint8)
        # A HOST pool blocks cache and a DEVICE one swap both ways; so does a cpu cache.
        cm.swap_blocks(device, host, {3: 0, 1: 2})
        cm.swap_blocks(host, device, {0: 0})
        cm.swap_blocks(device, cpu, {2: 1})
        for view, buffer in zip(views, buffers, strict=True):
            blocks = view.reshape(4, 66)
            np.testing.assert_array_equal(blocks[0], blocks[3])
            np.testing.assert_array_equal(buffer.reshape(2, 66)[1], blocks[2])
        for src, dst, mapping in (
            (plain, host, {0: 0}),  # not a blocks cache
            (device, plain, {0: 0}),
            (device, host, {-1: 0}),  # negative indices are out of range, not a ValueError
            (device, host, {0: -1}),
            (device, host, {0: 3}),
            (cpu, host, {0: 0}),  # HOST to HOST
            (device, device, {0: 1}),  # DEVICE to DEVICE
        ):
            with pytest.raises(LLMException) as exc_info:
                cm.swap_blocks(src, dst, mapping)
            assert _code(exc_info) == PI
        with pytest.raises(TypeError):
            cm.swap_blocks(device, host, {"0": 0})  # type: ignore[dict-item]


def _bytes_at(addr: int, nbytes: int):  # type: ignore[no-untyped-def]
    import ctypes

    return (ctypes.c_ubyte * nbytes).from_address(addr)


# ----------------------------------------------------------------------------- value classes


def test_cpu_cache_check_order_and_element_kinds() -> None:
    device_desc = CacheDesc(2, [2, 8], DataType.DT_FLOAT16)
    host_desc = CacheDesc(2, [2, 8], DataType.DT_FLOAT16, Placement.HOST)
    with pytest.raises(TypeError):
        Cache.create_cpu_cache(device_desc, "addrs")  # type: ignore[arg-type]  # the list before placement
    with pytest.raises(TypeError):
        Cache.create_cpu_cache(device_desc, [0x1000, "x"])  # type: ignore[list-item]
    with pytest.raises(LLMException) as exc_info:
        Cache.create_cpu_cache(device_desc, [0x1000, 0x2000])
    assert _code(exc_info) == PI
    with pytest.raises(LLMException) as exc_info:
        KvCache.create_cpu_cache(device_desc, "addrs")  # type: ignore[arg-type]  # placement first
    assert _code(exc_info) == PI
    for mixed in ([[0x1000, 0x2000], 0x3000], [0x1000, [0x2000, 0x3000]]):
        with pytest.raises(LLMException, match="should be consistent") as exc_info:
            KvCache.create_cpu_cache(host_desc, mixed)  # type: ignore[arg-type]
        assert _code(exc_info) == PI
    with pytest.raises(TypeError):
        KvCache.create_cpu_cache(host_desc, [[0x1000, 0x2000], "x"])  # type: ignore[list-item]
    cache = KvCache.create_cpu_cache(host_desc, [[0x1000, 0x2000], [0x3000, 0x4000]])
    assert cache.per_device_tensor_addrs == [[0x1000, 0x2000], [0x3000, 0x4000]]


def test_legacy_tensor_classes() -> None:
    from llm_datadist import Tensor, TensorDesc

    desc = TensorDesc(DataType.DT_FLOAT, [2, 3])
    assert desc.shape == [2, 3] and desc.dtype is DataType.DT_FLOAT
    with pytest.raises(TypeError):
        TensorDesc(0, [2, 3])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        TensorDesc(DataType.DT_FLOAT, [2, "3"])  # type: ignore[list-item]
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = Tensor(data, desc)
    np.testing.assert_array_equal(tensor.numpy(), data)
    np.testing.assert_array_equal(Tensor(tensor).numpy(copy=True), data)
    assert Tensor(np.zeros(4, dtype=np.int8)).tensor_desc.dtype is DataType.DT_INT8
    with pytest.raises(TypeError):
        Tensor([1, 2])
    with pytest.raises(TypeError):
        Tensor(data, "desc")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        tensor.numpy(copy=1)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        Tensor(data, TensorDesc(DataType.DT_FLOAT, [3, 2]))  # shape mismatch
    with pytest.raises(RuntimeError):
        Tensor(data, TensorDesc(DataType.DT_INT32, [2, 3]))  # dtype mismatch
    with pytest.raises(RuntimeError):
        Tensor(np.zeros((3, 4), dtype=np.float32)[:, 1])  # not C-contiguous
    with pytest.raises(RuntimeError):
        Tensor(np.zeros(2, dtype=np.complex64))  # no DataType
    strings = Tensor(np.array(["ab", "c"]))
    assert strings.tensor_desc.dtype is DataType.DT_STRING
    with pytest.raises(RuntimeError):
        strings.numpy()  # a string tensor needs copy=True
    with pytest.raises(LLMException) as exc_info:
        Tensor(5, desc)
    assert _code(exc_info) == LLMStatusCode.LLM_FEATURE_NOT_ENABLED


# ----------------------------------------------------------------------------- module paths


def test_module_paths_of_the_real_package() -> None:
    real_all = [
        "LLMClusterInfo", "LLMStatusCode", "LLMException", "LLMRole", "LlmConfig", "LLMConfig", "DataType",
        "Status", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "Cache", "BlocksCacheKey",
        "LLMDataDist", "Placement", "RegisterMemStatus", "LayerSynchronizer", "TransferConfig", "CacheTask",
        "TransferWithCacheKeyConfig", "Memtype", "MemInfo", "TensorDesc", "Tensor", "KvCacheManager",
    ]  # fmt: skip
    assert sorted(llm_datadist.__all__) == sorted(real_all)
    assert sorted(llm_datadist.v2_list) == sorted(real_all[:-3])
    for name in real_all:
        assert getattr(llm_datadist, name) is not None
    with pytest.raises(AttributeError):
        _ = llm_datadist.NoSuchName  # type: ignore[attr-defined]

    from llm_datadist.v2 import llm_types
    from llm_datadist.v2.cache import Cache as CacheClass
    from llm_datadist.v2.llm_types import Cache as TypesCache
    from llm_datadist.v2.llm_types import CacheTask as TypesTask
    from llm_datadist.v2.llm_types import KvCache as TypesKvCache

    assert TypesCache is CacheClass is llm_datadist.Cache
    assert TypesKvCache is llm_datadist.KvCache and TypesTask is llm_datadist.CacheTask
    for name in ("CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "BlocksCacheKey", "Placement",
                 "CacheTask", "TransferConfig", "LayerSynchronizer", "Cache"):  # fmt: skip
        assert name in llm_types.__all__


def test_the_validators_meet_the_vendors_2026_bounds_and_types() -> None:
    """hixl 2026 `test_parameter_validation.py` (02ffb84), in our words: each integer check takes its exact
    bounds and refuses one past them and any arbitrary-precision overflow (ValueError), and refuses a
    non-integer with a TypeError naming the argument; list checks take tuples and empty lists and find a
    bad element anywhere; `check_positive_or_set_default` keeps 0 and uses its `default` only for None;
    `check_isinstance` returns what it was given."""
    from llm_datadist.utils import utils

    bounds = {
        "uint8": (0, 2**8 - 1),
        "uint16": (0, 2**16 - 1),
        "uint32": (0, 2**32 - 1),
        "uint64": (0, 2**64 - 1),
        "int32": (-(2**31), 2**31 - 1),
        "int64": (-(2**63), 2**63 - 1),
    }
    for name, (low, high) in bounds.items():
        check = getattr(utils, f"check_{name}")
        for good in (low, high, 0, low + 1, high - 1):
            assert check("value", good) is None
        for bad in (low - 1, high + 1, -(2**128), 2**128):
            with pytest.raises(ValueError):
                check("value", bad)
        for wrong in (None, "1", 1.0, [], {}, object()):
            with pytest.raises(TypeError, match="device_id"):
                check("device_id", wrong)
    for name in ("int32", "int64", "uint64"):
        low, high = bounds[name]
        check = getattr(utils, f"check_list_{name}")
        values = [low, 0, high]
        assert check("ids", values) is None and values == [low, 0, high]
        for ok in ([], (), (low, high)):
            assert check("ids", ok) is None
        for bad in ([0, low - 1], [0, high + 1]):
            with pytest.raises(ValueError, match="ids"):
                check("ids", bad)
        for wrong in (None, "1", 1.0, []):
            for at in range(3):
                items: list[object] = [0, 1, 2]
                items[at] = wrong
                with pytest.raises(TypeError, match="ids"):
                    check("ids", items)
    assert utils.check_positive_or_set_default("size", None, default=128) == 128
    assert utils.check_positive_or_set_default("size", 0, default=128) == 0
    assert utils.check_positive_or_set_default("size", 2**63 - 1) == 2**63 - 1
    for bad in (-(2**63) - 1, 2**63):
        with pytest.raises(ValueError):
            utils.check_positive_or_set_default("size", bad)
    values = [1, 2]
    assert utils.check_isinstance("values", values, list) is values
    assert utils.check_isinstance("values", values, list, inner_class=int) is values


def test_utils_utils_has_the_real_signatures() -> None:
    from llm_datadist.utils import utils

    signatures = {
        "check_inner": ["arg_name", "arg_value", "inner_class"],
        "check_dict": ["arg_name", "arg_value", "k_class", "v_class", "v_inner_class"],
        "check_isinstance": ["arg_name", "arg_value", "classes", "inner_class", "extra_fmt", "allow_none"],
        "check_positive_or_set_default": ["arg_name", "arg_value", "default"],
    }
    for name in ("uint64", "int64", "int32", "uint32", "list_int32", "list_int64", "list_uint64", "uint16"):
        signatures[f"check_{name}"] = ["arg_name", "arg_value"]
    signatures["check_uint8"] = ["arg_name", "arg_value"]
    for name, params in signatures.items():
        assert list(inspect.signature(getattr(utils, name)).parameters) == params, name
    assert utils.check_isinstance("x", None, int) is None  # None passes unless allow_none=False
    with pytest.raises(TypeError):
        utils.check_isinstance("x", None, [int], allow_none=False)
    with pytest.raises(TypeError, match=r"^x inner type only support"):
        utils.check_isinstance("x", [1, "2"], [list, tuple], int)
    with pytest.raises(TypeError):
        utils.check_dict("d", {1: [1, "2"]}, int, list, int)
    assert utils.check_positive_or_set_default("n", None) == -1
    assert utils.check_positive_or_set_default("n", 5) == 5
    with pytest.raises(ValueError, match=r"^n's value:-2 is invalid, should be >= 0$"):
        utils.check_positive_or_set_default("n", -2)
    with pytest.raises(ValueError, match=r"^n's value is out of range,256 is not a uint8 value\.$"):
        utils.check_uint8("n", 256)


def test_transfer_config_import_path_is_unchanged() -> None:
    # Sanity: the classes user code builds for transfer_cache_async are the package's.
    assert TransferConfig is llm_datadist.v2.llm_types.TransferConfig
    assert CacheKeyByIdAndIndex is llm_datadist.CacheKeyByIdAndIndex


def test_find_caller_has_the_real_signature_and_answers_at_a_threads_stack_top() -> None:
    import threading

    from llm_datadist.utils.log import _find_caller

    def here() -> tuple[str, int, str, str | None]:
        return _find_caller()

    file_name, line, function, stack = here()
    assert file_name == __file__ and function == "here" and line > 0 and stack is None
    assert _find_caller(stack_info=True)[3].startswith("Stack (most recent call last):")  # type: ignore[union-attr]
    results: list[tuple[str, int, str, str | None]] = []
    thread = threading.Thread(target=lambda: results.append(_find_caller()))
    thread.start()
    thread.join(10)
    assert len(results) == 1
