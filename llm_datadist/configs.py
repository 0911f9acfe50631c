"""Configuration values (real path: `llm_datadist.configs`): `LLMRole`, `LLMClusterInfo`, `LlmConfig`.

`LlmConfig` only validates and renders option strings (§3 of the reference); which mode `init` picks is
decided later from those strings, never from attributes. Setters validate as the real ones do: TypeError for
a wrong type, ValueError for an int out of its C range, LLMException(LLM_PARAM_INVALID) for semantic checks.
IPv4 addresses travel as ints: `inet_aton` bytes read little-endian ("192.3.153.208" -> 3499688896).
"""

from __future__ import annotations

import json
import socket
from enum import IntEnum

from llm_datadist._validate import (
    U32_MAX,
    check_dict,
    check_int32,
    check_isinstance,
    check_items,
    check_uint16,
    check_uint32,
    check_uint64,
)
from llm_datadist.status import LLMStatusCode, make_error, raise_if_false

__all__ = ["LLMClusterInfo", "LLMConfig", "LLMRole", "LlmConfig", "ip_int_to_str", "trans_str_ip"]


class LLMRole(IntEnum):
    """Role label of an LLMDataDist: PROMPT=1, DECODER=2, MIX=3; `str()` gives "LLMRole.PROMPT".

    An IntEnum as in current hixl (a plain Enum before 2026-05); `format()` with a spec formats the number
    (f"{role:d}" is "1"). The engine sees it as the `llm.Role` option "Prompt" / "Decoder" / "Mix".
    """

    PROMPT = 1
    DECODER = 2
    MIX = 3

    def __str__(self) -> str:
        return f"{self.__class__.__name__}.{self.name}"

    def __format__(self, format_spec: str) -> str:
        # As on Python 3.11+ (status.LLMStatusCode says why): "" gives str(), any other spec the number.
        return int.__format__(self, format_spec)


def trans_str_ip(ip: str | int) -> int:
    """An IPv4 address as the engine's int: `inet_aton` bytes read little-endian; an int passes through.

    A string `inet_aton` cannot parse raises RuntimeError("Can not parse ip str:<ip>"), as in the real helper.
    inet_aton's forms are accepted too ("127.1", "0x7f.1"), as there.
    """
    if isinstance(ip, str):
        try:
            packed = socket.inet_aton(ip)
        except (OSError, ValueError):  # ValueError: an embedded NUL
            raise RuntimeError(f"Can not parse ip str:{ip}") from None
        return int.from_bytes(packed, byteorder="little")
    return ip


def ip_int_to_str(ip: int) -> str:
    """The dotted quad for an int made by `trans_str_ip` (its inverse): 3499688896 -> "192.3.153.208".

    TypeError unless an int, ValueError unless a uint32. Not in the real package.
    """
    check_uint32("ip", ip)
    return socket.inet_ntoa(ip.to_bytes(4, byteorder="little"))


def parse_v1_listen_ip_info(api: str, text: str, *, device_count: int | None = None) -> tuple[str, int]:
    """A v1 `llm.listenIpInfo` checked as the real v1 code does; returns the (dotted ip, port) to serve on.

    `init` of a PROMPT (`device_count` given, the real `gen_cluster_info_if_not_exist`): one "ip:port" per
    device joined with ';' (LLM_PARAM_INVALID), each in two ':'-parts (LLM_PARAM_INVALID) with an `int()`
    port (ValueError), then every ip through `trans_str_ip` (RuntimeError). `switch_role` (no count, the
    real `EngineConfig.parse_listen_ip_info`): two parts, the ip, then the port. One host serves on the
    first entry, whose port must fit 16 bits (LLM_PARAM_INVALID; the real engine checks it natively).
    Not in the real package.
    """
    entries = [text] if device_count is None else text.split(";")
    if device_count is not None and len(entries) != device_count:
        raise make_error(
            api,
            LLMStatusCode.LLM_PARAM_INVALID,
            f"listen ip info num:{len(entries)} in llm.listenIpInfo is not equal to "
            f"device num:{device_count}",
        )
    split: list[tuple[str, str]] = []
    for entry in entries:
        parts = entry.split(":")
        if len(parts) != 2:
            raise make_error(
                api,
                LLMStatusCode.LLM_PARAM_INVALID,
                f'llm.listenIpInfo "{entry}" is invalid, format should be "ip:port"',
            )
        if device_count is None:
            trans_str_ip(parts[0])  # switch_role reads the ip before the port
        split.append((parts[0], parts[1]))
    ports = [int(port_text) for _, port_text in split]  # ValueError, as the real int()
    parsed = [(trans_str_ip(ip), port) for (ip, _), port in zip(split, ports, strict=True)]
    ip_int, port = parsed[0]
    if not 0 <= port <= 0xFFFF:
        raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, f"port {port} out of range in {text!r}")
    return ip_int_to_str(ip_int), port


class LLMClusterInfo:
    """One peer for `link_clusters` / `unlink_clusters`. `LLMClusterInfo()` takes no arguments.

    `remote_cluster_id` is the peer's LLMDataDist cluster_id (uint64). The ip lists hold `(int_ip, port)`
    tuples. Unlike the real class, an int ip must be a uint32 and None is not accepted as an ip.
    """

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: LLMRole | int | None = None
        self._local_ip_info_list: list[tuple[int, int]] = []
        self._remote_ip_info_list: list[tuple[int, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        """The peer's cluster id; None until set."""
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, remote_cluster_id: int) -> None:
        check_uint64("remote_cluster_id", remote_cluster_id)
        self._remote_cluster_id = remote_cluster_id

    @property
    def remote_role_type(self) -> LLMRole | int | None:
        """The peer's role (LLMRole or int). Stored, never used, as in the real library."""
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, remote_role_type: LLMRole | int | None) -> None:
        check_isinstance("remote_role_type", remote_role_type, [LLMRole, int], allow_none=True)
        self._remote_role_type = remote_role_type

    @property
    def local_ip_info_list(self) -> list[tuple[int, int]]:
        """`(int_ip, port)` tuples added by `append_local_ip_info` (the live list, as in the real class)."""
        return self._local_ip_info_list

    @property
    def remote_ip_info_list(self) -> list[tuple[int, int]]:
        """`(int_ip, port)` tuples added by `append_remote_ip_info` (the live list)."""
        return self._remote_ip_info_list

    @staticmethod
    def _check_inputs(ip: str | int, port: int) -> int:
        check_isinstance("ip", ip, [str, int])
        check_uint16("port", port)
        if isinstance(ip, int):
            check_uint32("ip", ip)
        return trans_str_ip(ip)

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        """Add a local address. TypeError/ValueError for a port that is not a uint16; RuntimeError for a
        string ip that cannot be parsed."""
        self._local_ip_info_list.append((self._check_inputs(ip, port), port))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        """Add a remote address (v1: the Prompt's listen port). Same checks as `append_local_ip_info`."""
        self._remote_ip_info_list.append((self._check_inputs(ip, port), port))

    def __repr__(self) -> str:
        return (
            f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, "
            f"remote_role_type={self._remote_role_type}, "
            f"local_ip_info_list={self._local_ip_info_list}, "
            f"remote_ip_info_list={self._remote_ip_info_list})"
        )


DeviceId = int | list[int] | tuple[int, ...]


class LlmConfig:
    """Builds the `Dict[str, str]` of options for `LLMDataDist.init`. `LlmConfig()` takes no arguments.

    Set properties, then call `generate_options()` (alias `gen_options()`). As in the real class, the dict
    returned is the same object on every call and only accumulates: keys are added or overwritten, never
    removed. `ge_options` is merged first, so explicit properties win. `llm.MemoryUtilization` (default 0.95)
    is always emitted. Setters that the real class lets take None as "unset" accept None here too.
    """

    def __init__(self) -> None:
        self._options: dict[str, str] = {}
        self._listen_ip_info = ""
        self._device_id: DeviceId | None = None
        self._sync_kv_timeout: int | str | None = None
        self._deploy_res_path = ""
        self._ge_options: dict[str, str] = {}
        self._enable_switch_role = False
        self._link_total_time: int | None = None
        self._link_retry_count: int | None = None
        self._cluster_info = ""
        self._output_max_size: int | None = None
        self._mem_utilization = 0.95
        self._buf_pool_cfg = ""
        self._mem_pool_cfg = ""
        self._host_mem_pool_cfg = ""
        self._enable_cache_manager: bool | None = None
        self._enable_remote_cache_accessible: bool | None = None
        self._rdma_traffic_class: int | None = None
        self._rdma_service_level: int | None = None
        self._local_comm_res: str | None = None
        self._transfer_backend: str | None = None
        self._global_resource_config: str | None = None

    # -- rendering ---------------------------------------------------------------------------------------

    def generate_options(self) -> dict[str, str]:
        """Render the set properties into the (accumulating) options dict and return it."""
        return self.gen_options()

    def gen_options(self) -> dict[str, str]:
        """Alias of `generate_options`."""
        opts = self._options
        if self._ge_options:
            opts.update(self._ge_options)
        if self._device_id is not None:
            if isinstance(self._device_id, int):
                opts["ge.exec.deviceId"] = str(self._device_id)
                opts["ge.session_device_id"] = str(self._device_id)
            else:
                opts["ge.session_device_id"] = str(self._device_id[0])
                opts["ge.exec.deviceId"] = ";".join(str(dev) for dev in self._device_id)
        if self._sync_kv_timeout is not None:
            opts["llm.SyncKvCacheWaitTime"] = str(self._sync_kv_timeout)
        if self._deploy_res_path:
            opts["llm.deployResPath"] = self._deploy_res_path
        # memory
        if self._buf_pool_cfg:
            opts["llm.BufPoolCfg"] = self._buf_pool_cfg
        if self._mem_pool_cfg:
            opts["llm.MemPoolConfig"] = self._mem_pool_cfg
        if self._host_mem_pool_cfg:
            opts["llm.HostMemPoolConfig"] = self._host_mem_pool_cfg
        if self._enable_cache_manager is not None:
            opts["llm.EnableCacheManager"] = "1" if self._enable_cache_manager else "0"
        if self._enable_remote_cache_accessible is not None:
            opts["llm.EnableRemoteCacheAccessible"] = "1" if self._enable_remote_cache_accessible else "0"
        # connection
        if self._listen_ip_info:
            opts["llm.listenIpInfo"] = self._listen_ip_info
        if self._link_total_time is not None:
            opts["llm.LinkTotalTime"] = str(self._link_total_time)
        if self._link_retry_count is not None:
            opts["llm.LinkRetryCount"] = str(self._link_retry_count)
        if self._rdma_traffic_class is not None:
            opts["llm.RdmaTrafficClass"] = str(self._rdma_traffic_class)
        if self._rdma_service_level is not None:
            opts["llm.RdmaServiceLevel"] = str(self._rdma_service_level)
        # Emitted once set, even to "": its mere presence switches init to cache-manager mode.
        if self._local_comm_res is not None:
            opts["llm.LocalCommRes"] = self._local_comm_res
        if self._transfer_backend is not None:
            opts["llm.TransferBackend"] = self._transfer_backend
        if self._global_resource_config is not None:
            opts["llm.GlobalResourceConfig"] = self._global_resource_config
        # legacy (v1)
        if self._cluster_info:
            opts["llm.ClusterInfo"] = self._cluster_info
        if self._output_max_size is not None:
            opts["llm.OutputMaxSize"] = str(self._output_max_size)
        if self._enable_switch_role:
            opts["llm.EnableSwitchRole"] = "1"
        opts["llm.MemoryUtilization"] = str(self._mem_utilization)
        return opts

    @property
    def options(self) -> dict[str, str]:
        """The accumulated options dict (read-only property; the dict itself is the live object)."""
        return self._options

    # -- properties --------------------------------------------------------------------------------------

    @property
    def ge_options(self) -> dict[str, str]:
        """Raw `str -> str` options merged verbatim before the others (kept by reference). Default {}."""
        return self._ge_options

    @ge_options.setter
    def ge_options(self, ge_options: dict[str, str]) -> None:
        check_dict("ge_options", ge_options, str, str)
        self._ge_options = ge_options

    @property
    def device_id(self) -> DeviceId | None:
        """Device id: an int, or a list/tuple of ints (v1 multi-device); each in [0, 2**31). None if unset.

        Emits `ge.exec.deviceId` ("0" or "0;1") and `ge.session_device_id` (the first id). A negative id
        raises LLMException(PARAM_INVALID); above int32, ValueError. An empty list raises
        LLMException(PARAM_INVALID) here (the real setter accepts it and `gen_options` fails with IndexError).
        """
        return self._device_id

    @device_id.setter
    def device_id(self, device_id: DeviceId | None) -> None:
        check_isinstance("device_id", device_id, [list, tuple, int], allow_none=True)
        if isinstance(device_id, (list, tuple)):
            check_items("device_id", device_id, int)
            raise_if_false(len(device_id) > 0, "device_id should not be empty.")
            for dev_id in device_id:
                raise_if_false(dev_id >= 0, "device_id should be greater than or equal to zero.")
            for dev_id in device_id:
                check_int32("device_id", dev_id)
        elif device_id is not None:
            raise_if_false(device_id >= 0, "device_id should be greater than or equal to zero.")
            check_int32("device_id", device_id)
        self._device_id = device_id

    @property
    def sync_kv_timeout(self) -> int | str | None:
        """Transfer timeout in ms (`llm.SyncKvCacheWaitTime`), as given: an int or a string of digits.

        None when unset (the engine then uses 1000). Must be > 0 (LLMException) and an int32 (ValueError);
        a string with a non-digit raises LLMException.
        """
        return self._sync_kv_timeout

    @sync_kv_timeout.setter
    def sync_kv_timeout(self, sync_kv_timeout: int | str) -> None:
        check_isinstance("sync_kv_timeout", sync_kv_timeout, [int, str])
        if isinstance(sync_kv_timeout, str):
            # isdecimal, not isdigit: "²" is a digit that int() rejects.
            raise_if_false(sync_kv_timeout.isdecimal(), "sync_kv_timeout must be digit.")
        raise_if_false(int(sync_kv_timeout) > 0, "sync_kv_timeout should be greater than zero.")
        check_int32("sync_kv_timeout", int(sync_kv_timeout))
        self._sync_kv_timeout = sync_kv_timeout

    @property
    def listen_ip_info(self) -> str:
        """`"ip:port"` this side listens on (`llm.listenIpInfo`; v1 may join several with ";"). Default ""."""
        return self._listen_ip_info

    @listen_ip_info.setter
    def listen_ip_info(self, listen_ip_info: str | None) -> None:
        check_isinstance("listen_ip_info", listen_ip_info, str, allow_none=True)
        self._listen_ip_info = listen_ip_info or ""

    @property
    def deploy_res_path(self) -> str:
        """v1 internals (`llm.deployResPath`, emitted when non-empty). Default ""."""
        return self._deploy_res_path

    @deploy_res_path.setter
    def deploy_res_path(self, deploy_res_path: str | None) -> None:
        check_isinstance("deploy_res_path", deploy_res_path, str, allow_none=True)
        self._deploy_res_path = deploy_res_path or ""

    @property
    def buf_pool_cfg(self) -> str:
        """v1 memory tiers JSON (`llm.BufPoolCfg`, emitted when non-empty). Default ""."""
        return self._buf_pool_cfg

    @buf_pool_cfg.setter
    def buf_pool_cfg(self, buf_pool_cfg: str | None) -> None:
        check_isinstance("buf_pool_cfg", buf_pool_cfg, str, allow_none=True)
        self._buf_pool_cfg = buf_pool_cfg or ""

    @property
    def mem_pool_cfg(self) -> str:
        """v2 device pool JSON `{"memory_size": n, "page_shift": 16}` (`llm.MemPoolConfig`). Default ""."""
        return self._mem_pool_cfg

    @mem_pool_cfg.setter
    def mem_pool_cfg(self, mem_pool_cfg: str | None) -> None:
        check_isinstance("mem_pool_cfg", mem_pool_cfg, str, allow_none=True)
        self._mem_pool_cfg = mem_pool_cfg or ""

    @property
    def host_mem_pool_cfg(self) -> str:
        """v2 host pool JSON, same format (`llm.HostMemPoolConfig`). Default ""."""
        return self._host_mem_pool_cfg

    @host_mem_pool_cfg.setter
    def host_mem_pool_cfg(self, host_mem_pool_cfg: str | None) -> None:
        check_isinstance("host_mem_pool_cfg", host_mem_pool_cfg, str, allow_none=True)
        self._host_mem_pool_cfg = host_mem_pool_cfg or ""

    @property
    def mem_utilization(self) -> float:
        """v1 fraction of the pool (`llm.MemoryUtilization`, always emitted). A float in [0, 1]; default 0.95.

        An int (even 1) raises TypeError, as in the real setter; out of range (or NaN) raises LLMException.
        """
        return self._mem_utilization

    @mem_utilization.setter
    def mem_utilization(self, mem_utilization: float) -> None:
        check_isinstance("mem_utilization", mem_utilization, float)
        raise_if_false(
            0.0 <= mem_utilization <= 1.0,
            f"mem_utilization must be in range [0,1], current:{mem_utilization}",
        )
        self._mem_utilization = mem_utilization

    @property
    def enable_switch_role(self) -> bool:
        """v1 `switch_role` support; emits `llm.EnableSwitchRole="1"` only when True. Default False."""
        return self._enable_switch_role

    @enable_switch_role.setter
    def enable_switch_role(self, enable_switch_role: bool | None) -> None:
        check_isinstance("enable_switch_role", enable_switch_role, bool, allow_none=True)
        self._enable_switch_role = bool(enable_switch_role)

    @property
    def enable_cache_manager(self) -> bool:
        """Cache-manager (v2) mode: `llm.EnableCacheManager` "1"/"0", emitted only once set. Default False."""
        return bool(self._enable_cache_manager)

    @enable_cache_manager.setter
    def enable_cache_manager(self, enable_cache_manager: bool | None) -> None:
        check_isinstance("enable_cache_manager", enable_cache_manager, bool, allow_none=True)
        self._enable_cache_manager = enable_cache_manager

    @property
    def enable_remote_cache_accessible(self) -> bool:
        """One-sided access (`llm.EnableRemoteCacheAccessible` "1"/"0", emitted once set); default False."""
        return bool(self._enable_remote_cache_accessible)

    @enable_remote_cache_accessible.setter
    def enable_remote_cache_accessible(self, enable_remote_cache_accessible: bool | None) -> None:
        check_isinstance(
            "enable_remote_cache_accessible", enable_remote_cache_accessible, bool, allow_none=True
        )
        self._enable_remote_cache_accessible = enable_remote_cache_accessible

    @property
    def link_total_time(self) -> int:
        """v2 link total timeout in seconds (`llm.LinkTotalTime`); int in [0, 2**32-1], else LLMException.

        The getter gives 0 when unset (0: the engine uses env HCCL_CONNECT_TIMEOUT).
        """
        return 0 if self._link_total_time is None else self._link_total_time

    @link_total_time.setter
    def link_total_time(self, link_total_time: int) -> None:
        check_isinstance("link_total_time", link_total_time, int)
        raise_if_false(
            0 <= link_total_time <= U32_MAX,
            f"link_total_time should be an integer between [0, 2^32-1], given value is {link_total_time}",
        )
        self._link_total_time = link_total_time

    @property
    def link_retry_count(self) -> int:
        """v2 link retries (`llm.LinkRetryCount`); int in [1, 100], else LLMException. Getter default 1."""
        return 1 if self._link_retry_count is None else self._link_retry_count

    @link_retry_count.setter
    def link_retry_count(self, link_retry_count: int) -> None:
        check_isinstance("link_retry_count", link_retry_count, int)
        raise_if_false(
            1 <= link_retry_count <= 100,
            f"link_retry_count should be an integer between [1, 100], given value is {link_retry_count}",
        )
        self._link_retry_count = link_retry_count

    @property
    def rdma_traffic_class(self) -> int | None:
        """`llm.RdmaTrafficClass`, a uint32 (the docs say 0..255, a multiple of 4; not checked, as in the real
        setter). None when unset (the engine default is 132)."""
        return self._rdma_traffic_class

    @rdma_traffic_class.setter
    def rdma_traffic_class(self, rdma_traffic_class: int) -> None:
        check_uint32("rdma_traffic_class", rdma_traffic_class)
        self._rdma_traffic_class = rdma_traffic_class

    @property
    def rdma_service_level(self) -> int | None:
        """`llm.RdmaServiceLevel`, a uint32 (docs: 0..7; not checked). None when unset (engine default 4)."""
        return self._rdma_service_level

    @rdma_service_level.setter
    def rdma_service_level(self, rdma_service_level: int) -> None:
        check_uint32("rdma_service_level", rdma_service_level)
        self._rdma_service_level = rdma_service_level

    @property
    def local_comm_res(self) -> str:
        """v2 local communication resource JSON (`llm.LocalCommRes`), emitted once set, even when "".

        Setting it (even to "") makes `init` default to cache-manager mode with remote-cache access.
        The getter gives "" when unset; setting None unsets it.
        """
        return "" if self._local_comm_res is None else self._local_comm_res

    @local_comm_res.setter
    def local_comm_res(self, local_comm_res: str | None) -> None:
        check_isinstance("local_comm_res", local_comm_res, str, allow_none=True)
        self._local_comm_res = local_comm_res

    @property
    def transfer_backend(self) -> str:
        """v2 transfer backend, e.g. "hixl" (`llm.TransferBackend`, emitted once set). Getter default ""."""
        return "" if self._transfer_backend is None else self._transfer_backend

    @transfer_backend.setter
    def transfer_backend(self, transfer_backend: str | None) -> None:
        check_isinstance("transfer_backend", transfer_backend, str, allow_none=True)
        self._transfer_backend = transfer_backend

    @property
    def global_resource_config(self) -> str:
        """JSON handed to HIXL unchanged (`llm.GlobalResourceConfig`, emitted once set). Getter default ""."""
        return "" if self._global_resource_config is None else self._global_resource_config

    @global_resource_config.setter
    def global_resource_config(self, global_resource_config: str | None) -> None:
        check_isinstance("global_resource_config", global_resource_config, str, allow_none=True)
        self._global_resource_config = global_resource_config

    @property
    def cluster_info(self) -> str:
        """v1 internals: cluster JSON (`llm.ClusterInfo`, emitted when non-empty). Default "".

        The setter parses the JSON (json.JSONDecodeError, a ValueError, when malformed), turns every
        `listen_ip_info[].ip` string into its int form, and stores the re-dumped JSON.
        """
        return self._cluster_info

    @cluster_info.setter
    def cluster_info(self, cluster_info: str) -> None:
        check_isinstance("cluster_info", cluster_info, str)
        parsed = json.loads(cluster_info)
        if isinstance(parsed, dict) and "listen_ip_info" in parsed:
            for ip_info in parsed["listen_ip_info"]:
                ip_info["ip"] = trans_str_ip(ip_info["ip"])
        self._cluster_info = json.dumps(parsed)

    @property
    def output_max_size(self) -> int | None:
        """Legacy engine option (`llm.OutputMaxSize`, emitted once set). None when unset."""
        return self._output_max_size

    @output_max_size.setter
    def output_max_size(self, output_max_size: int | None) -> None:
        check_isinstance("output_max_size", output_max_size, int, allow_none=True)
        self._output_max_size = output_max_size


LLMConfig = LlmConfig
"""Alias of `LlmConfig` (both names are public in the real package)."""
