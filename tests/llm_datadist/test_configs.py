"""LLMRole, IP conversion, LLMClusterInfo, and every LlmConfig property: validation and option strings."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from llm_datadist.configs import (
    LLMClusterInfo,
    LLMConfig,
    LlmConfig,
    LLMRole,
    ip_int_to_str,
    trans_str_ip,
)
from llm_datadist.status import LLMException, LLMStatusCode

MEM_UTIL = {"llm.MemoryUtilization": "0.95"}


def param_invalid(fn: Any) -> LLMException:
    with pytest.raises(LLMException) as info:
        fn()
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    return info.value


def set_attr(obj: object, name: str, value: object) -> Any:
    return lambda: setattr(obj, name, value)


# -- LLMRole ------------------------------------------------------------------------------------------------


def test_role_values_and_strings() -> None:
    assert [(r.name, r.value) for r in LLMRole] == [("PROMPT", 1), ("DECODER", 2), ("MIX", 3)]
    assert str(LLMRole.PROMPT) == "LLMRole.PROMPT"
    assert f"{LLMRole.DECODER}" == "LLMRole.DECODER"
    assert str(LLMRole.MIX) == "LLMRole.MIX"
    assert LLMRole.PROMPT == 1
    assert LLMRole(2) is LLMRole.DECODER


# -- IP conversion ------------------------------------------------------------------------------------------


def test_reference_ip_example() -> None:
    assert trans_str_ip("192.3.153.208") == 3499688896
    assert ip_int_to_str(3499688896) == "192.3.153.208"


@pytest.mark.parametrize(
    ("text", "value"),
    [("0.0.0.0", 0), ("127.0.0.1", 0x0100007F), ("1.2.3.4", 0x04030201), ("255.255.255.255", 2**32 - 1)],
)
def test_ip_little_endian_round_trip(text: str, value: int) -> None:
    assert trans_str_ip(text) == value
    assert ip_int_to_str(value) == text


def test_ip_int_passes_through() -> None:
    assert trans_str_ip(3499688896) == 3499688896


@pytest.mark.parametrize("bad", ["", "abc", "1.2.3.256", "::1", "1.2.3.4.5", "1.2.3.4\x00"])
def test_unparsable_ip_is_runtime_error(bad: str) -> None:
    with pytest.raises(RuntimeError, match="Can not parse ip str"):
        trans_str_ip(bad)


def test_ip_int_to_str_checks() -> None:
    with pytest.raises(ValueError):
        ip_int_to_str(-1)
    with pytest.raises(ValueError):
        ip_int_to_str(2**32)
    with pytest.raises(TypeError):
        ip_int_to_str("1.2.3.4")  # type: ignore[arg-type]


# -- LLMClusterInfo -----------------------------------------------------------------------------------------


def test_cluster_info_defaults() -> None:
    info = LLMClusterInfo()
    assert info.remote_cluster_id is None
    assert info.remote_role_type is None
    assert info.local_ip_info_list == []
    assert info.remote_ip_info_list == []


def test_cluster_info_remote_cluster_id() -> None:
    info = LLMClusterInfo()
    info.remote_cluster_id = 2**64 - 1
    assert info.remote_cluster_id == 2**64 - 1
    info.remote_cluster_id = 0
    assert info.remote_cluster_id == 0
    for bad in (-1, 2**64):
        with pytest.raises(ValueError):
            info.remote_cluster_id = bad
    for wrong in ("1", 1.0, None, True):
        with pytest.raises(TypeError, match="remote_cluster_id only support"):
            info.remote_cluster_id = wrong  # type: ignore[assignment]
    assert info.remote_cluster_id == 0


def test_cluster_info_remote_role_type() -> None:
    info = LLMClusterInfo()
    info.remote_role_type = LLMRole.PROMPT
    assert info.remote_role_type is LLMRole.PROMPT
    info.remote_role_type = 2
    assert info.remote_role_type == 2
    with pytest.raises(TypeError):
        info.remote_role_type = "PROMPT"  # type: ignore[assignment]


def test_cluster_info_append_ip_infos() -> None:
    info = LLMClusterInfo()
    info.append_local_ip_info("192.3.153.208", 0)
    info.append_local_ip_info(16777343, 26001)
    info.append_remote_ip_info("127.0.0.1", 26000)
    assert info.local_ip_info_list == [(3499688896, 0), (16777343, 26001)]
    assert info.remote_ip_info_list == [(0x0100007F, 26000)]
    assert isinstance(info.local_ip_info_list[0], tuple)


@pytest.mark.parametrize("method", ["append_local_ip_info", "append_remote_ip_info"])
def test_cluster_info_append_checks(method: str) -> None:
    info = LLMClusterInfo()
    append = getattr(info, method)
    for port in (-1, 65536):
        with pytest.raises(ValueError, match="uint16"):
            append("1.2.3.4", port)
    for port in ("80", 80.0, None, True):
        with pytest.raises(TypeError):
            append("1.2.3.4", port)
    for ip in (1.5, None, b"1.2.3.4", True):
        with pytest.raises(TypeError):
            append(ip, 80)
    for ip in (-1, 2**32):
        with pytest.raises(ValueError):
            append(ip, 80)
    with pytest.raises(RuntimeError, match="Can not parse ip str:not-an-ip"):
        append("not-an-ip", 80)
    assert info.local_ip_info_list == [] and info.remote_ip_info_list == []


# -- LlmConfig: defaults and the accumulating dict ----------------------------------------------------------


def test_llmconfig_alias() -> None:
    assert LLMConfig is LlmConfig


def test_getter_defaults() -> None:
    cfg = LlmConfig()
    assert cfg.device_id is None
    assert cfg.sync_kv_timeout is None
    assert cfg.listen_ip_info == ""
    assert cfg.deploy_res_path == ""
    assert cfg.buf_pool_cfg == ""
    assert cfg.mem_pool_cfg == ""
    assert cfg.host_mem_pool_cfg == ""
    assert cfg.mem_utilization == 0.95
    assert cfg.ge_options == {}
    assert cfg.enable_switch_role is False
    assert cfg.enable_cache_manager is False
    assert cfg.enable_remote_cache_accessible is False
    assert cfg.link_total_time == 0
    assert cfg.link_retry_count == 1
    assert cfg.rdma_traffic_class is None
    assert cfg.rdma_service_level is None
    assert cfg.local_comm_res == ""
    assert cfg.transfer_backend == ""
    assert cfg.global_resource_config == ""
    assert cfg.cluster_info == ""
    assert cfg.output_max_size is None
    assert cfg.options == {}


def test_empty_config_emits_only_mem_utilization() -> None:
    assert LlmConfig().generate_options() == MEM_UTIL
    assert LlmConfig().gen_options() == MEM_UTIL


def test_options_dict_is_shared_and_accumulates() -> None:
    cfg = LlmConfig()
    cfg.device_id = 0
    first = cfg.generate_options()
    assert first is cfg.options
    cfg.sync_kv_timeout = 5000
    second = cfg.gen_options()
    assert second is first
    assert first["llm.SyncKvCacheWaitTime"] == "5000"
    # Unsetting a property does not remove what was emitted before.
    cfg.enable_cache_manager = True
    cfg.generate_options()
    cfg.enable_cache_manager = None
    assert cfg.generate_options()["llm.EnableCacheManager"] == "1"
    # Entries written into the returned dict by the caller stay too.
    first["user.key"] = "x"
    assert cfg.generate_options()["user.key"] == "x"


def test_options_is_read_only() -> None:
    cfg = LlmConfig()
    with pytest.raises(AttributeError):
        cfg.options = {}  # type: ignore[misc]


def test_ge_options_merged_first_so_properties_win() -> None:
    cfg = LlmConfig()
    cfg.ge_options = {
        "ge.flowGraphMemMaxSize": "1024000",
        "ge.exec.deviceId": "9",
        "llm.MemoryUtilization": "0.5",
    }
    cfg.device_id = 1
    assert cfg.generate_options() == {
        "ge.flowGraphMemMaxSize": "1024000",
        "ge.exec.deviceId": "1",
        "ge.session_device_id": "1",
        "llm.MemoryUtilization": "0.95",
    }


def test_ge_options_kept_by_reference() -> None:
    cfg = LlmConfig()
    raw = {"a": "1"}
    cfg.ge_options = raw
    assert cfg.ge_options is raw


def test_ge_options_checks() -> None:
    cfg = LlmConfig()
    for wrong in ([("a", "b")], "a=b", None):
        with pytest.raises(TypeError):
            cfg.ge_options = wrong  # type: ignore[assignment]
    with pytest.raises(TypeError, match="dict key"):
        cfg.ge_options = {1: "x"}  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="dict value"):
        cfg.ge_options = {"ge.flowGraphMemMaxSize": 1024}  # type: ignore[dict-item]
    assert cfg.ge_options == {}


# -- LlmConfig: each property, option strings ---------------------------------------------------------------

EMITTED: list[tuple[str, Any, dict[str, str]]] = [
    ("device_id", 0, {"ge.exec.deviceId": "0", "ge.session_device_id": "0"}),
    ("device_id", 7, {"ge.exec.deviceId": "7", "ge.session_device_id": "7"}),
    ("device_id", [0, 1], {"ge.exec.deviceId": "0;1", "ge.session_device_id": "0"}),
    ("device_id", (3, 2, 5), {"ge.exec.deviceId": "3;2;5", "ge.session_device_id": "3"}),
    ("device_id", [2**31 - 1], {"ge.exec.deviceId": "2147483647", "ge.session_device_id": "2147483647"}),
    ("sync_kv_timeout", 5000, {"llm.SyncKvCacheWaitTime": "5000"}),
    ("sync_kv_timeout", "3000", {"llm.SyncKvCacheWaitTime": "3000"}),
    ("sync_kv_timeout", 2**31 - 1, {"llm.SyncKvCacheWaitTime": "2147483647"}),
    ("listen_ip_info", "10.0.0.1:26000", {"llm.listenIpInfo": "10.0.0.1:26000"}),
    ("listen_ip_info", "a:1;b:2", {"llm.listenIpInfo": "a:1;b:2"}),
    ("listen_ip_info", "", {}),
    ("deploy_res_path", "/opt/res", {"llm.deployResPath": "/opt/res"}),
    ("deploy_res_path", "", {}),
    ("buf_pool_cfg", '{"buf_cfg":[]}', {"llm.BufPoolCfg": '{"buf_cfg":[]}'}),
    ("buf_pool_cfg", "", {}),
    ("mem_pool_cfg", '{"memory_size": 1024}', {"llm.MemPoolConfig": '{"memory_size": 1024}'}),
    ("mem_pool_cfg", "", {}),
    ("host_mem_pool_cfg", '{"memory_size": 7}', {"llm.HostMemPoolConfig": '{"memory_size": 7}'}),
    ("host_mem_pool_cfg", "", {}),
    ("enable_cache_manager", True, {"llm.EnableCacheManager": "1"}),
    ("enable_cache_manager", False, {"llm.EnableCacheManager": "0"}),
    ("enable_remote_cache_accessible", True, {"llm.EnableRemoteCacheAccessible": "1"}),
    ("enable_remote_cache_accessible", False, {"llm.EnableRemoteCacheAccessible": "0"}),
    ("enable_switch_role", True, {"llm.EnableSwitchRole": "1"}),
    ("enable_switch_role", False, {}),
    ("link_total_time", 0, {"llm.LinkTotalTime": "0"}),
    ("link_total_time", 2**32 - 1, {"llm.LinkTotalTime": "4294967295"}),
    ("link_retry_count", 1, {"llm.LinkRetryCount": "1"}),
    ("link_retry_count", 100, {"llm.LinkRetryCount": "100"}),
    ("rdma_traffic_class", 132, {"llm.RdmaTrafficClass": "132"}),
    ("rdma_traffic_class", 0, {"llm.RdmaTrafficClass": "0"}),
    ("rdma_service_level", 4, {"llm.RdmaServiceLevel": "4"}),
    ("rdma_service_level", 2**32 - 1, {"llm.RdmaServiceLevel": "4294967295"}),
    ("local_comm_res", "", {"llm.LocalCommRes": ""}),
    ("local_comm_res", '{"version": "1.3"}', {"llm.LocalCommRes": '{"version": "1.3"}'}),
    ("transfer_backend", "hixl", {"llm.TransferBackend": "hixl"}),
    ("transfer_backend", "", {"llm.TransferBackend": ""}),
    ("global_resource_config", "{}", {"llm.GlobalResourceConfig": "{}"}),
    ("output_max_size", 1024, {"llm.OutputMaxSize": "1024"}),
    ("output_max_size", 0, {"llm.OutputMaxSize": "0"}),
    ("mem_utilization", 0.5, {"llm.MemoryUtilization": "0.5"}),
    ("mem_utilization", 0.0, {"llm.MemoryUtilization": "0.0"}),
    ("mem_utilization", 1.0, {"llm.MemoryUtilization": "1.0"}),
]


@pytest.mark.parametrize(("prop", "value", "emitted"), EMITTED)
def test_property_emits_exact_options(prop: str, value: Any, emitted: dict[str, str]) -> None:
    cfg = LlmConfig()
    setattr(cfg, prop, value)
    assert getattr(cfg, prop) == value
    assert cfg.generate_options() == {**MEM_UTIL, **emitted}


def test_device_id_checks() -> None:
    cfg = LlmConfig()
    param_invalid(set_attr(cfg, "device_id", -1))
    param_invalid(set_attr(cfg, "device_id", [0, -1]))
    param_invalid(set_attr(cfg, "device_id", (-(2**40),)))
    param_invalid(set_attr(cfg, "device_id", []))
    for too_big in (2**31, [0, 2**31]):
        with pytest.raises(ValueError, match="int32"):
            cfg.device_id = too_big
    for wrong in ("0", 0.0, True, {0: 1}):
        with pytest.raises(TypeError, match="device_id only support"):
            cfg.device_id = wrong  # type: ignore[assignment]
    for wrong_items in (["0"], [0, 1.0], (True,)):
        with pytest.raises(TypeError, match="device_id inner type only support"):
            cfg.device_id = wrong_items  # type: ignore[assignment]
    assert cfg.device_id is None
    cfg.device_id = 3
    cfg.device_id = None  # the real setter accepts None: back to unset
    assert cfg.device_id is None


def test_negative_device_id_message() -> None:
    exc = param_invalid(set_attr(LlmConfig(), "device_id", -1))
    assert str(exc) == "device_id should be greater than or equal to zero."


def test_sync_kv_timeout_checks() -> None:
    cfg = LlmConfig()
    for bad in (0, -1, "0", "abc", "-5", "", "1.5", " 5"):
        param_invalid(set_attr(cfg, "sync_kv_timeout", bad))
    for too_big in (2**31, "2147483648"):
        with pytest.raises(ValueError):
            cfg.sync_kv_timeout = too_big
    for wrong in (1.5, None, True, [1]):
        with pytest.raises(TypeError):
            cfg.sync_kv_timeout = wrong  # type: ignore[assignment]
    assert cfg.sync_kv_timeout is None


@pytest.mark.parametrize(
    "prop",
    [
        "listen_ip_info",
        "deploy_res_path",
        "buf_pool_cfg",
        "mem_pool_cfg",
        "host_mem_pool_cfg",
        "local_comm_res",
        "transfer_backend",
        "global_resource_config",
        "cluster_info",
    ],
)
def test_string_properties_reject_other_types(prop: str) -> None:
    cfg = LlmConfig()
    for wrong in (5, b"x", ["a"], {"a": "b"}):
        with pytest.raises(TypeError, match=f"{prop} only support"):
            setattr(cfg, prop, wrong)


@pytest.mark.parametrize(
    ("prop", "default"),
    [
        ("listen_ip_info", ""),
        ("deploy_res_path", ""),
        ("buf_pool_cfg", ""),
        ("mem_pool_cfg", ""),
        ("host_mem_pool_cfg", ""),
        ("local_comm_res", ""),
        ("transfer_backend", ""),
        ("global_resource_config", ""),
        ("enable_cache_manager", False),
        ("enable_remote_cache_accessible", False),
        ("enable_switch_role", False),
        ("output_max_size", None),
    ],
)
def test_none_unsets_where_the_real_setter_accepts_it(prop: str, default: object) -> None:
    cfg = LlmConfig()
    setattr(cfg, prop, None)
    assert getattr(cfg, prop) == default
    assert cfg.generate_options() == MEM_UTIL


@pytest.mark.parametrize(
    "prop", ["enable_cache_manager", "enable_remote_cache_accessible", "enable_switch_role"]
)
def test_bool_properties_are_strict(prop: str) -> None:
    cfg = LlmConfig()
    for wrong in (1, 0, "1", "true"):
        with pytest.raises(TypeError, match=f"{prop} only support"):
            setattr(cfg, prop, wrong)


def test_mem_utilization_checks() -> None:
    cfg = LlmConfig()
    for bad in (1.5, -0.1, math.nan, math.inf):
        param_invalid(set_attr(cfg, "mem_utilization", bad))
    for wrong in (1, 0, "0.5", None, True):
        with pytest.raises(TypeError, match="mem_utilization only support"):
            cfg.mem_utilization = wrong  # type: ignore[assignment]
    assert cfg.mem_utilization == 0.95
    assert cfg.generate_options()["llm.MemoryUtilization"] == "0.95"


def test_link_total_time_checks() -> None:
    cfg = LlmConfig()
    for bad in (-1, 2**32):
        exc = param_invalid(set_attr(cfg, "link_total_time", bad))
        assert "link_total_time should be an integer between [0, 2^32-1]" in str(exc)
    for wrong in ("5", 5.0, None, True):
        with pytest.raises(TypeError):
            cfg.link_total_time = wrong  # type: ignore[assignment]
    assert cfg.link_total_time == 0


def test_link_retry_count_checks() -> None:
    cfg = LlmConfig()
    for bad in (0, 101, -3):
        exc = param_invalid(set_attr(cfg, "link_retry_count", bad))
        assert "link_retry_count should be an integer between [1, 100]" in str(exc)
    for wrong in ("5", 5.0, None, False):
        with pytest.raises(TypeError):
            cfg.link_retry_count = wrong  # type: ignore[assignment]
    assert cfg.link_retry_count == 1


@pytest.mark.parametrize("prop", ["rdma_traffic_class", "rdma_service_level"])
def test_rdma_checks(prop: str) -> None:
    cfg = LlmConfig()
    for bad in (-1, 2**32):
        with pytest.raises(ValueError, match="uint32"):
            setattr(cfg, prop, bad)
    for wrong in ("4", 4.0, None, True):
        with pytest.raises(TypeError):
            setattr(cfg, prop, wrong)
    assert getattr(cfg, prop) is None


def test_output_max_size_checks() -> None:
    cfg = LlmConfig()
    for wrong in ("1", 1.0, True):
        with pytest.raises(TypeError):
            cfg.output_max_size = wrong  # type: ignore[assignment]


def test_cluster_info_converts_listen_ips() -> None:
    cfg = LlmConfig()
    raw = {
        "cluster_id": 1,
        "logic_device_id": ["0:0:0:0"],
        "listen_ip_info": [{"ip": "192.3.153.208", "port": 26000}, {"ip": 16777343, "port": 26001}],
    }
    cfg.cluster_info = json.dumps(raw)
    stored = json.loads(cfg.cluster_info)
    assert stored["listen_ip_info"] == [{"ip": 3499688896, "port": 26000}, {"ip": 16777343, "port": 26001}]
    assert stored["logic_device_id"] == ["0:0:0:0"]
    assert cfg.generate_options() == {**MEM_UTIL, "llm.ClusterInfo": cfg.cluster_info}


def test_cluster_info_without_listen_ips_and_errors() -> None:
    cfg = LlmConfig()
    cfg.cluster_info = '{"cluster_id": 3}'
    assert json.loads(cfg.cluster_info) == {"cluster_id": 3}
    with pytest.raises(ValueError):
        cfg.cluster_info = "{not json"
    with pytest.raises(RuntimeError, match="Can not parse ip str"):
        cfg.cluster_info = '{"listen_ip_info": [{"ip": "nope", "port": 1}]}'
    assert json.loads(cfg.cluster_info) == {"cluster_id": 3}


def test_local_comm_res_empty_is_emitted_once_set() -> None:
    cfg = LlmConfig()
    assert "llm.LocalCommRes" not in cfg.generate_options()
    cfg.local_comm_res = ""
    assert cfg.local_comm_res == ""
    assert cfg.generate_options()["llm.LocalCommRes"] == ""


def test_hixl_connector_style_config() -> None:
    # The options the vllm-ascend HIXL connector PR builds (§11.3).
    cfg = LLMConfig()
    cfg.device_id = 2
    cfg.local_comm_res = ""
    cfg.transfer_backend = "hixl"
    cfg.listen_ip_info = "10.1.2.3:26000"
    cfg.link_total_time = 60
    cfg.link_retry_count = 3
    cfg.sync_kv_timeout = 20000
    cfg.ge_options = {"llm.RdmaServiceLevel": "5"}
    assert cfg.generate_options() == {
        "llm.RdmaServiceLevel": "5",
        "ge.exec.deviceId": "2",
        "ge.session_device_id": "2",
        "llm.SyncKvCacheWaitTime": "20000",
        "llm.listenIpInfo": "10.1.2.3:26000",
        "llm.LinkTotalTime": "60",
        "llm.LinkRetryCount": "3",
        "llm.LocalCommRes": "",
        "llm.TransferBackend": "hixl",
        "llm.MemoryUtilization": "0.95",
    }


def test_vllm_cmgr_connector_style_config() -> None:
    # The LLMDataDistCMgrConnector's config (§11.1).
    cfg = LlmConfig()
    cfg.device_id = 0
    cfg.sync_kv_timeout = 5000
    cfg.enable_switch_role = True
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    assert cfg.generate_options() == {
        "ge.exec.deviceId": "0",
        "ge.session_device_id": "0",
        "llm.SyncKvCacheWaitTime": "5000",
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.EnableSwitchRole": "1",
        "llm.MemoryUtilization": "0.95",
    }
