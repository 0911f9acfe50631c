"""What `Hixl.initialize`'s arguments mean: the engine's address and its option strings, read into frozen
values before anything is made.

Rules: pure (the one file read is `local_comm_res_path`, as the real engine reads it); every option is
checked in the real engine's order and a refusal is `ConfigError` with the status the real `initialize`
returns. Options for a device or its NICs are validated and otherwise without effect.
"""

from __future__ import annotations

import ipaddress
import json
import os
import stat
from dataclasses import dataclass

from .codes import FAILED, PARAM_INVALID, UNSUPPORTED

OPTION_ENABLE_USE_FABRIC_MEM = "EnableUseFabricMem"
OPTION_RDMA_TRAFFIC_CLASS = "RdmaTrafficClass"
OPTION_RDMA_SERVICE_LEVEL = "RdmaServiceLevel"
OPTION_BUFFER_POOL = "BufferPool"
OPTION_GLOBAL_RESOURCE_CONFIG = "GlobalResourceConfig"
OPTION_AUTO_CONNECT = "AutoConnect"
OPTION_LOCAL_COMM_RES = "LocalCommRes"
# The older ADXL spellings the engine still reads.
_ADXL = {
    OPTION_RDMA_TRAFFIC_CLASS: "adxl.RdmaTrafficClass",
    OPTION_RDMA_SERVICE_LEVEL: "adxl.RdmaServiceLevel",
    OPTION_BUFFER_POOL: "adxl.BufferPool",
    OPTION_LOCAL_COMM_RES: "adxl.LocalCommRes",
}
# What each engine accepts (the client/server engine takes no fabric-memory option).
_COMM_KEYS = frozenset(
    {
        OPTION_ENABLE_USE_FABRIC_MEM,
        OPTION_GLOBAL_RESOURCE_CONFIG,
        OPTION_AUTO_CONNECT,
        *_ADXL,
        *_ADXL.values(),
    }
)
_CS_KEYS = _COMM_KEYS - {OPTION_ENABLE_USE_FABRIC_MEM}
_BUFFER_POOL_DISABLED = "0:0"
_MAX_LOCAL_COMM_RES_NBYTES = 1 << 20
# GlobalResourceConfig fields with an integer range: name -> (low, high).
_RANGES = {
    "connect_pool.thread_num": (1, 64),
    "connect_pool.task_queue_capacity": (1, 65535),
    "comm_resource_config.listen_port": (1, 65535),
    "comm_resource_config.qos": (0, 7),
    "comm_resource_config.max_active_channels": (1, 2**32 - 1),
    "fabric_memory.max_capacity": (1, 1024),
    "fabric_memory.task_stream_num": (1, 8),
}
DEFAULT_CONNECT_THREADS = 2
DEFAULT_CONNECT_QUEUE = 128


class ConfigError(Exception):
    """`initialize` refuses its arguments: `code` is what it returns."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


@dataclass(frozen=True)
class EngineAddress:
    """An engine's identity, "ip:port", "ip", "[ipv6]:port" or "[ipv6]". A port above 0 makes the engine a
    server that peers connect to; without one (or 0) it is a client only and serves nothing."""

    host: str
    port: int

    @property
    def serves(self) -> bool:
        return self.port > 0

    @property
    def ipv6(self) -> bool:
        return ":" in self.host


def parse_address(text: str) -> EngineAddress:
    """`text` as the real engine splits it; ConfigError(PARAM_INVALID) for an ip that is not a literal
    address or a port that is not a number (or exceeds 65535)."""
    left, right = text.find("["), text.find("]")
    if 0 <= left < right:
        parts = [text[left + 1 : right]]
        colon = text.find(":", right)
        if colon >= 0:
            parts.append(text[colon + 1 :])
    else:
        parts = text.split(":")
    host = parts[0]
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(PARAM_INVALID, f"engine {text!r}: {host!r} is not an ip address") from None
    port = 0
    if len(parts) > 1:
        port_text = parts[1]
        if not port_text.lstrip("-").isdigit() or len(parts) > 2:
            raise ConfigError(PARAM_INVALID, f"engine {text!r}: port {port_text!r} is not a number")
        port = int(port_text)
        if port > 0xFFFF:
            raise ConfigError(PARAM_INVALID, f"engine {text!r}: port {port} exceeds 65535")
    return EngineAddress(host, max(port, 0))


@dataclass(frozen=True)
class EngineOptions:
    """What the options select: auto connect, and which of the real engines' rules apply. `cs`: the
    client/server engine's (LocalCommRes version 1.3, or a protocol_desc), which answers
    `get_all_transfer_status`, refuses a buffer pool and keeps registered memory while connected; else
    the communicator engine's, the default on A2/A3."""

    auto_connect: bool = False
    cs: bool = False
    connect_threads: int = DEFAULT_CONNECT_THREADS
    connect_queue: int = DEFAULT_CONNECT_QUEUE


def parse_options(options: dict[str, str]) -> EngineOptions:
    """Check and read `initialize`'s options in the real order; ConfigError with the real status."""
    for spelling, adxl in _ADXL.items():
        if spelling not in options and adxl in options:
            options = {**options, spelling: options[adxl]}
    _check_number(options, OPTION_RDMA_TRAFFIC_CLASS, 0, 255, multiple_of=4)
    _check_number(options, OPTION_RDMA_SERVICE_LEVEL, 0, 7)
    fabric = options.get(OPTION_ENABLE_USE_FABRIC_MEM, "")
    if fabric:
        _check_number(options, OPTION_ENABLE_USE_FABRIC_MEM, 0, 1)
    auto_text = options.get(OPTION_AUTO_CONNECT)
    auto_connect = False
    if auto_text is not None:
        if not auto_text:
            raise ConfigError(PARAM_INVALID, f"{OPTION_AUTO_CONNECT} value is empty, should be zero or one")
        auto_connect = _check_number(options, OPTION_AUTO_CONNECT, 0, 1) == 1
    config = _global_config(options.get(OPTION_GLOBAL_RESOURCE_CONFIG, ""))
    local_comm_res = options.get(OPTION_LOCAL_COMM_RES) or _local_comm_res_file(config)
    # The engine the options select, and that engine's own checks.
    if fabric == "1":
        raise ConfigError(UNSUPPORTED, "fabric memory needs an Ascend device's HCCS links")
    cs = bool(config.get("comm_resource_config.protocol_desc"))
    if local_comm_res:
        try:
            resources = json.loads(local_comm_res)
        except ValueError as exc:
            raise ConfigError(FAILED, f"{OPTION_LOCAL_COMM_RES} is not JSON: {exc}") from exc
        cs = isinstance(resources, dict) and resources.get("version") == "1.3"
    unsupported = sorted(set(options) - (_CS_KEYS if cs else _COMM_KEYS))
    if unsupported:
        raise ConfigError(PARAM_INVALID, f"unsupported option {unsupported[0]!r} for this engine")
    pool = options.get(OPTION_BUFFER_POOL)
    if pool is not None:
        _check_buffer_pool(pool, cs)
    return EngineOptions(
        auto_connect=auto_connect,
        cs=cs,
        connect_threads=_int_field(config, "connect_pool.thread_num", DEFAULT_CONNECT_THREADS),
        connect_queue=_int_field(config, "connect_pool.task_queue_capacity", DEFAULT_CONNECT_QUEUE),
    )


def _int_field(config: dict[str, object], name: str, default: int) -> int:
    """A ranged field of GlobalResourceConfig (`_global_config` made it an int), or its default."""
    value = config.get(name, default)
    return value if isinstance(value, int) else default


def _check_number(
    options: dict[str, str], key: str, low: int, high: int, *, multiple_of: int = 1
) -> int | None:
    text = options.get(key, "")
    if not text:
        return None
    if not text.isdigit() or not low <= int(text) <= high or int(text) % multiple_of:
        step = f", a multiple of {multiple_of}" if multiple_of > 1 else ""
        raise ConfigError(PARAM_INVALID, f"{key} is invalid: {text!r}, must be in [{low}, {high}]{step}")
    return int(text)


def _global_config(text: str) -> dict[str, object]:
    """GlobalResourceConfig: a JSON object; its integer fields in range (a number or a numeric string)."""
    if not text:
        return {}
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ConfigError(PARAM_INVALID, f"{OPTION_GLOBAL_RESOURCE_CONFIG} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(PARAM_INVALID, f"{OPTION_GLOBAL_RESOURCE_CONFIG} must be a JSON object")
    checked: dict[str, object] = dict(config)
    for name, (low, high) in _RANGES.items():
        if name not in config:
            continue
        value = config[name]
        number = value if isinstance(value, int) and not isinstance(value, bool) else None
        if isinstance(value, str) and value.lstrip("-").isdigit():
            number = int(value)
        if number is None or not low <= number <= high:
            raise ConfigError(PARAM_INVALID, f"{name} must be in [{low}, {high}], got {value!r}")
        checked[name] = number
    path = config.get("local_comm_res_path")
    if path is not None and (not isinstance(path, str) or not path):
        raise ConfigError(PARAM_INVALID, "local_comm_res_path must be a non-empty file path")
    return checked


def _local_comm_res_file(config: dict[str, object]) -> str:
    """The local communication resources a `local_comm_res_path` names (a regular file of 1 B to 1 MiB)."""
    path = config.get("local_comm_res_path")
    if not isinstance(path, str):
        return ""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(PARAM_INVALID, f"local_comm_res_path {path!r}: {exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or not 0 < info.st_size <= _MAX_LOCAL_COMM_RES_NBYTES:
            raise ConfigError(PARAM_INVALID, f"local_comm_res_path {path!r} is not a file of 1 B to 1 MiB")
        return os.read(fd, info.st_size).decode(errors="replace")
    finally:
        os.close(fd)


def _check_buffer_pool(pool: str, cs: bool) -> None:
    """ "BUFFER_NUM:BUFFER_SIZE" (MB) or "0:0" (off); the client/server engine takes "0:0" only."""
    if cs:
        if pool != _BUFFER_POOL_DISABLED:
            raise ConfigError(PARAM_INVALID, f"{OPTION_BUFFER_POOL} of this engine only supports '0:0'")
        return
    parts = pool.split(":")
    if pool != _BUFFER_POOL_DISABLED and (
        len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts)
    ):
        raise ConfigError(PARAM_INVALID, f"{OPTION_BUFFER_POOL} {pool!r}: expected BUFFER_NUM:BUFFER_SIZE")
