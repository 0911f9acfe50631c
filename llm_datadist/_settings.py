"""What `init`'s option strings mean: `parse_options` turns them into a frozen `Settings`.

Rules: parsing is pure (no resources, no I/O besides reading the strings) and checks every option before
any is used; a bad option is `LLMException` from `make_error("init", ...)`, a non-string one `TypeError`,
as the real `init` raises them. Defaults are the real library's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ._runtime import parse_listen_ip_info
from .configs import LLMRole, parse_v1_listen_ip_info
from .status import LLMStatusCode, make_error

DEFAULT_SYNC_KV_TIMEOUT_MS = 1000
DEFAULT_MEM_UTILIZATION = 0.95


@dataclass(frozen=True)
class PoolConfig:
    """A v2 memory pool (`mem_pool_cfg` / `host_mem_pool_cfg`): `{"memory_size": N, "page_shift": S}`."""

    memory_nbytes: int
    page_shift: int


HOST_POOL_LIMIT_NBYTES = 20 << 30  # the documented limit of host_mem_pool_cfg


@dataclass(frozen=True)
class Settings:
    """What `init`'s option strings mean here."""

    role: LLMRole
    cluster_id: int
    device_ids: tuple[int, ...]
    sync_kv_timeout_ms: int
    listen: tuple[str, int] | None
    pool_capacity_nbytes: int | None
    enable_switch_role: bool
    cache_manager_mode: bool
    remote_cache_accessible: bool = False
    device_pool: PoolConfig | None = None
    host_pool: PoolConfig | None = None
    local_comm_res: str | None = None
    link_total_time_s: int = 0
    # "hixl": the real library moves bytes with the HIXL engine then, and answers two-sided links, a
    # switch_role to another address and link_clusters with other than one remote ip as that backend does.
    transfer_backend: str | None = None

    @property
    def timeout_code(self) -> LLMStatusCode:
        """v1 reports a transfer timeout as LLM_WAIT_PROCESS_TIMEOUT, v2 as LLM_TIMEOUT."""
        return (
            LLMStatusCode.LLM_TIMEOUT if self.cache_manager_mode else LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT
        )


def _pool_config(api: str, key: str, text: str | None, limit_nbytes: int | None) -> PoolConfig | None:
    if text is None:
        return None
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, f"{key} is not JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, f"{key} must be a JSON object")
    size = parsed.get("memory_size")
    shift = parsed.get("page_shift", 16)
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise make_error(
            api, LLMStatusCode.LLM_PARAM_INVALID, f"{key}.memory_size must be a positive integer"
        )
    if limit_nbytes is not None and size > limit_nbytes:
        raise make_error(
            api, LLMStatusCode.LLM_PARAM_INVALID, f"{key}.memory_size exceeds {limit_nbytes} bytes"
        )
    if not isinstance(shift, int) or isinstance(shift, bool) or not 10 <= shift <= 30:
        raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, f"{key}.page_shift must be in [10, 30]")
    return PoolConfig(size, shift)


def parse_options(role: LLMRole, cluster_id: int, options: dict[str, str]) -> Settings:
    """Read the option keys `LLMConfig.generate_options()` emits (or a raw dict a caller wrote)."""
    api = "init"
    for key, value in options.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"`options` only support [Dict[str, str]], but got {key!r}: {type(value).__name__}"
            )
    # The real init's mode switch: llm.EnableCacheManager, which llm.LocalCommRes turns on by default.
    local_comm_res = options.get("llm.LocalCommRes")
    enable_text = options.get("llm.EnableCacheManager", "1" if local_comm_res is not None else "0")
    cache_manager_mode = enable_text == "1"
    if local_comm_res is not None and not cache_manager_mode:
        raise make_error(
            api,
            LLMStatusCode.LLM_PARAM_INVALID,
            "llm.LocalCommRes is not supported when llm.EnableCacheManager is not configured",
        )
    remote_text = options.get("llm.EnableRemoteCacheAccessible")
    backend = options.get("llm.TransferBackend")
    if remote_text is None and (local_comm_res is not None or backend is not None):
        remote_text = "1"
    if backend is not None:
        # The real init's checks and messages, in its order; then its engine takes "hixl" only.
        for needed, option, state in (
            (cache_manager_mode, "llm.EnableCacheManager", "configured"),
            (remote_text == "1", "llm.EnableRemoteCacheAccessible", "enable"),
            ("llm.listenIpInfo" in options, "llm.listenIpInfo", "configured"),
        ):
            if not needed:
                raise make_error(
                    api,
                    LLMStatusCode.LLM_PARAM_INVALID,
                    f"llm.TransferBackend is not supported when {option} is not {state}",
                )
        if backend != "hixl":
            raise make_error(
                api, LLMStatusCode.LLM_PARAM_INVALID, f"Transfer backend:{backend} is not supported"
            )
    link_total_text = options.get("llm.LinkTotalTime", "0")
    if not link_total_text.isdigit():
        raise make_error(
            api, LLMStatusCode.LLM_PARAM_INVALID, f"invalid llm.LinkTotalTime {link_total_text!r}"
        )

    pool_capacity: int | None = None
    if "ge.flowGraphMemMaxSize" in options:
        text = options["ge.flowGraphMemMaxSize"]
        if not text.isdigit():
            raise make_error(
                api, LLMStatusCode.LLM_PARAM_INVALID, f"ge.flowGraphMemMaxSize must be digits: {text!r}"
            )
        utilization = DEFAULT_MEM_UTILIZATION
        if "llm.MemoryUtilization" in options:
            try:
                utilization = float(options["llm.MemoryUtilization"])
            except ValueError as exc:
                raise make_error(
                    api, LLMStatusCode.LLM_PARAM_INVALID, "llm.MemoryUtilization must be a float"
                ) from exc
            if not 0.0 < utilization <= 1.0:
                raise make_error(
                    api, LLMStatusCode.LLM_PARAM_INVALID, "llm.MemoryUtilization must be in (0, 1]"
                )
        pool_capacity = int(int(text) * utilization)
        if pool_capacity <= 0:
            raise make_error(
                api, LLMStatusCode.LLM_PARAM_INVALID, "ge.flowGraphMemMaxSize leaves an empty pool"
            )

    device_text = options.get("ge.exec.deviceId")
    if device_text is None:
        raise make_error(
            api, LLMStatusCode.LLM_PARAM_INVALID, "ge.exec.deviceId is required (set LLMConfig.device_id)"
        )
    try:
        device_ids = tuple(int(part) for part in device_text.split(";") if part.strip())
    except ValueError as exc:
        raise make_error(
            api, LLMStatusCode.LLM_PARAM_INVALID, f"invalid ge.exec.deviceId {device_text!r}"
        ) from exc
    if not device_ids or any(d < 0 for d in device_ids):
        raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, f"invalid ge.exec.deviceId {device_text!r}")

    timeout_text = options.get("llm.SyncKvCacheWaitTime", str(DEFAULT_SYNC_KV_TIMEOUT_MS))
    if not timeout_text.isdigit() or int(timeout_text) <= 0:
        raise make_error(
            api, LLMStatusCode.LLM_PARAM_INVALID, f"invalid llm.SyncKvCacheWaitTime {timeout_text!r}"
        )

    listen: tuple[str, int] | None = None
    listen_text = options.get("llm.listenIpInfo")
    if cache_manager_mode:
        if listen_text is not None:
            listen = parse_listen_ip_info(listen_text)  # "" is one part: PI, as in the real v2
    elif role == LLMRole.PROMPT:
        if listen_text is None:
            raise make_error(
                api, LLMStatusCode.LLM_PARAM_INVALID, "a PROMPT needs llm.listenIpInfo (listen_ip_info)"
            )
        listen = parse_v1_listen_ip_info(api, listen_text, device_count=len(device_ids))
    elif listen_text:
        # The real v1 reads no listen address on a DECODER; one given here serves too (its first entry).
        listen = parse_listen_ip_info(listen_text.split(";")[0])

    return Settings(
        role=role,
        cluster_id=cluster_id,
        device_ids=device_ids,
        sync_kv_timeout_ms=int(timeout_text),
        listen=listen,
        pool_capacity_nbytes=pool_capacity,
        enable_switch_role=options.get("llm.EnableSwitchRole") == "1",
        cache_manager_mode=cache_manager_mode,
        remote_cache_accessible=cache_manager_mode and remote_text == "1",
        device_pool=_pool_config(api, "llm.MemPoolConfig", options.get("llm.MemPoolConfig"), None),
        host_pool=_pool_config(
            api, "llm.HostMemPoolConfig", options.get("llm.HostMemPoolConfig"), HOST_POOL_LIMIT_NBYTES
        ),
        local_comm_res=local_comm_res,
        link_total_time_s=int(link_total_text),
        transfer_backend=backend,
    )
