"""The values of the HIXL engine API: status codes, option names, enums and value classes, with the real
names, numbers and defaults (hicann/hixl `include/hixl/hixl_types.h`, `src/python/hixl_py/hixl_py.cc`).

Rules: arguments are converted as the real binding converts them: TypeError for a wrong type or an integer
out of its C type's range, strings cut at the first NUL as the engine's C strings are. The enums of C++
plain enums equal their numbers; those of `enum class`es equal only themselves (`int()` gives the number).
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable
from typing import Generic, TypeVar, overload

from llm_datadist._hixl import codes as _codes
from llm_datadist._hixl import config as _config

SUCCESS = _codes.SUCCESS
PARAM_INVALID = _codes.PARAM_INVALID
TIMEOUT = _codes.TIMEOUT
NOT_CONNECTED = _codes.NOT_CONNECTED
ALREADY_CONNECTED = _codes.ALREADY_CONNECTED
NOTIFY_FAILED = _codes.NOTIFY_FAILED
UNSUPPORTED = _codes.UNSUPPORTED
FAILED = _codes.FAILED
RESOURCE_EXHAUSTED = _codes.RESOURCE_EXHAUSTED

OPTION_ENABLE_USE_FABRIC_MEM = _config.OPTION_ENABLE_USE_FABRIC_MEM
OPTION_RDMA_TRAFFIC_CLASS = _config.OPTION_RDMA_TRAFFIC_CLASS
OPTION_RDMA_SERVICE_LEVEL = _config.OPTION_RDMA_SERVICE_LEVEL
OPTION_BUFFER_POOL = _config.OPTION_BUFFER_POOL
OPTION_GLOBAL_RESOURCE_CONFIG = _config.OPTION_GLOBAL_RESOURCE_CONFIG
OPTION_AUTO_CONNECT = _config.OPTION_AUTO_CONNECT
OPTION_LOCAL_COMM_RES = _config.OPTION_LOCAL_COMM_RES

FEATURE_SUPPORTED = _codes.FEATURE_SUPPORTED
FEATURE_NOT_SUPPORTED = _codes.FEATURE_NOT_SUPPORTED

U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
_I32 = (-(2**31), 2**31 - 1)


# ====================================================================== enums


class _PlainEnum(enum.IntEnum):
    """A C++ plain enum as the binding exports it: equal to its number, `str()` "Type.NAME"."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __format__(self, format_spec: str) -> str:
        return str(self) if not format_spec else int.__format__(self.value, format_spec)


class _ScopedEnum(enum.Enum):
    """A C++ `enum class` as the binding exports it: `int()` gives its number, but it equals only
    itself."""

    def __int__(self) -> int:
        return int(self.value)

    def __index__(self) -> int:
        return int(self.value)

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class MemType(_PlainEnum):
    MEM_DEVICE = _codes.MEM_DEVICE
    MEM_HOST = _codes.MEM_HOST


class TransferOp(_PlainEnum):
    READ = _codes.READ
    WRITE = _codes.WRITE


class FeatureType(_PlainEnum):
    AUTO_CONNECT = _codes.AUTO_CONNECT
    CLIENT_SERVER_COMM = _codes.CLIENT_SERVER_COMM


class TransferStatus(_ScopedEnum):
    WAITING = _codes.WAITING
    COMPLETED = _codes.COMPLETED
    TIMEOUT = _codes.TRANSFER_TIMEOUT
    FAILED = _codes.TRANSFER_FAILED


class AsyncConnectStatus(_ScopedEnum):
    NOT_CONNECT = _codes.NOT_CONNECT
    CONNECT_PENDING = _codes.CONNECT_PENDING
    CONNECTING = _codes.CONNECTING
    CONNECTED = _codes.CONNECTED
    CONNECT_FAILED = _codes.CONNECT_FAILED
    DISCONNECT_PENDING = _codes.DISCONNECT_PENDING
    DISCONNECTING = _codes.DISCONNECTING


# The binding exports these enums' values at module level (TransferStatus's would shadow status codes).
MEM_DEVICE, MEM_HOST = MemType.MEM_DEVICE, MemType.MEM_HOST
READ, WRITE = TransferOp.READ, TransferOp.WRITE
AUTO_CONNECT, CLIENT_SERVER_COMM = FeatureType.AUTO_CONNECT, FeatureType.CLIENT_SERVER_COMM
NOT_CONNECT = AsyncConnectStatus.NOT_CONNECT
CONNECT_PENDING = AsyncConnectStatus.CONNECT_PENDING
CONNECTING = AsyncConnectStatus.CONNECTING
CONNECTED = AsyncConnectStatus.CONNECTED
CONNECT_FAILED = AsyncConnectStatus.CONNECT_FAILED
DISCONNECT_PENDING = AsyncConnectStatus.DISCONNECT_PENDING
DISCONNECTING = AsyncConnectStatus.DISCONNECTING


# ====================================================================== argument conversion


def uint(name: str, value: object, high: int = _U64_MAX) -> int:
    """An integer argument of an unsigned C type, as the binding converts it (no float, no negative)."""
    if isinstance(value, float):
        raise TypeError(f"{name}: incompatible type float, an integer is required")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name}: incompatible type {type(value).__name__}, an integer is required") from None
    if not 0 <= number <= high:
        raise TypeError(f"{name}: {number} is out of range for an unsigned integer of its C type")
    return number


def timeout_ms(value: object) -> int:
    if isinstance(value, float):
        raise TypeError("timeout_in_millis: incompatible type float, an int32 is required")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"timeout_in_millis: incompatible type {type(value).__name__}") from None
    if not _I32[0] <= number <= _I32[1]:
        raise TypeError(f"timeout_in_millis: {number} is out of range for an int32")
    return number


def text(name: str, value: object) -> str:
    """A std::string argument: a str (or bytes); the engine's C string ends at the first NUL."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if not isinstance(value, str):
        raise TypeError(f"{name}: incompatible type {type(value).__name__}, a str is required")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise TypeError(f"{name}: not encodable as UTF-8: {exc}") from None
    return value.split("\0", 1)[0]


def instance(name: str, value: object, cls: type) -> None:
    if not isinstance(value, cls):
        raise TypeError(f"{name}: incompatible type {type(value).__name__}, {cls.__name__} is required")


# ====================================================================== value classes

_T = TypeVar("_T")


class _Field(Generic[_T]):
    """An attribute converted as the binding converts it, at every assignment (kept in the slot
    `_<name>`)."""

    def __init__(self, convert: Callable[[str, object], _T]) -> None:
        self._convert = convert
        self._name = self._slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name, self._slot = name, f"_{name}"

    @overload
    def __get__(self, obj: None, objtype: type) -> _Field[_T]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> _T: ...

    def __get__(self, obj: object, objtype: type | None = None) -> _T | _Field[_T]:
        if obj is None:
            return self
        value: _T = getattr(obj, self._slot)
        return value

    def __set__(self, obj: object, value: object) -> None:
        setattr(obj, self._slot, self._convert(self._name, value))


def _u32(name: str, value: object) -> int:
    return uint(name, value, U32_MAX)


def _bool(name: str, value: object) -> bool:
    instance(name, value, bool)
    return bool(value)


class MemDesc:
    """`MemDesc(addr, len)`: memory to register, `len` bytes at address `addr`. `local_only` (read and
    write, default False): the memory is this engine's own side of its transfers only, not exposed to
    remote engines (they cannot name it), as `hixl_types.h` and the HIXL data-structure page say."""

    __slots__ = ("_addr", "_len", "_local_only")
    addr = _Field(uint)
    len = _Field(uint)
    local_only = _Field(_bool)

    def __init__(self, addr: int, len: int) -> None:
        self.addr = addr
        self.len = len
        self.local_only = False

    def __repr__(self) -> str:
        return f"MemDesc(addr={self.addr:#x}, len={self.len}, local_only={self.local_only})"


class TransferOpDesc:
    """`TransferOpDesc(local_addr, remote_addr, len)`: `len` bytes between `local_addr` here and
    `remote_addr` in the remote engine's process."""

    __slots__ = ("_len", "_local_addr", "_remote_addr")
    local_addr = _Field(uint)
    remote_addr = _Field(uint)
    len = _Field(uint)

    def __init__(self, local_addr: int, remote_addr: int, len: int) -> None:
        self.local_addr = local_addr
        self.remote_addr = remote_addr
        self.len = len

    def __repr__(self) -> str:
        return (
            f"TransferOpDesc(local_addr={self.local_addr:#x}, remote_addr={self.remote_addr:#x}, "
            f"len={self.len})"
        )


class TransferArgs:
    """`TransferArgs()`: `user_data` (an integer, 0 by default) comes back in `TransferResult`."""

    __slots__ = ("_user_data",)
    user_data = _Field(uint)

    def __init__(self) -> None:
        self.user_data = 0


class GetTransferStatusArgs:
    """`GetTransferStatusArgs(max_query_count=4294967295, skip_waiting=False)`."""

    __slots__ = ("_max_query_count", "_skip_waiting")
    max_query_count = _Field(_u32)
    skip_waiting = _Field(_bool)

    def __init__(self, max_query_count: int = U32_MAX, skip_waiting: bool = False) -> None:
        self.max_query_count = max_query_count
        self.skip_waiting = skip_waiting


class TransferResult:
    """One request's status from `get_all_transfer_status`: `req`, `user_data`, `status` (read-only)."""

    __slots__ = ("_req", "_status", "_user_data")
    req = _Field(uint)
    user_data = _Field(uint)

    def __init__(self) -> None:
        self.req = 0
        self.user_data = 0
        self._status = TransferStatus.WAITING

    @property
    def status(self) -> TransferStatus:
        return self._status


class NotifyDesc:
    """`NotifyDesc(name, notify_msg)`: a notify for a remote engine's `get_notifies`."""

    __slots__ = ("_name", "_notify_msg")
    name = _Field(text)
    notify_msg = _Field(text)

    def __init__(self, name: str, notify_msg: str) -> None:
        self.name = name
        self.notify_msg = notify_msg

    def __repr__(self) -> str:
        return f"NotifyDesc(name={self.name!r}, notify_msg={self.notify_msg!r})"


def transfer_result(req: int, user_data: int, status: TransferStatus) -> TransferResult:
    """A `TransferResult` as `get_all_transfer_status` fills it (its status is read-only to callers)."""
    result = TransferResult()
    result.req = req
    result.user_data = user_data
    result._status = status
    return result
