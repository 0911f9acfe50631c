"""The values of the HIXL engine API: status codes, option names, enums and value classes, with the real
names, numbers and defaults (hicann/hixl `include/hixl/hixl_types.h`, `src/python/hixl_py/hixl_py.cc`).

Rules: arguments are converted as the real binding converts them: TypeError for a wrong type or an integer
out of its C type's range, strings cut at the first NUL as the engine's C strings are. The enums of C++
plain enums equal their numbers; those of `enum class`es equal only themselves (`int()` gives the number).
"""

from __future__ import annotations

import enum
import operator

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


class MemDesc:
    """`MemDesc(addr, len)`: memory to register, `len` bytes at address `addr`."""

    __slots__ = ("_addr", "_len")

    def __init__(self, addr: int, len: int) -> None:
        self.addr = addr
        self.len = len

    @property
    def addr(self) -> int:
        return self._addr

    @addr.setter
    def addr(self, value: int) -> None:
        self._addr = uint("addr", value)

    @property
    def len(self) -> int:
        return self._len

    @len.setter
    def len(self, value: int) -> None:
        self._len = uint("len", value)

    def __repr__(self) -> str:
        return f"MemDesc(addr={self._addr:#x}, len={self._len})"


class TransferOpDesc:
    """`TransferOpDesc(local_addr, remote_addr, len)`: `len` bytes between `local_addr` here and
    `remote_addr` in the remote engine's process."""

    __slots__ = ("_len", "_local_addr", "_remote_addr")

    def __init__(self, local_addr: int, remote_addr: int, len: int) -> None:
        self.local_addr = local_addr
        self.remote_addr = remote_addr
        self.len = len

    @property
    def local_addr(self) -> int:
        return self._local_addr

    @local_addr.setter
    def local_addr(self, value: int) -> None:
        self._local_addr = uint("local_addr", value)

    @property
    def remote_addr(self) -> int:
        return self._remote_addr

    @remote_addr.setter
    def remote_addr(self, value: int) -> None:
        self._remote_addr = uint("remote_addr", value)

    @property
    def len(self) -> int:
        return self._len

    @len.setter
    def len(self, value: int) -> None:
        self._len = uint("len", value)

    def __repr__(self) -> str:
        return (
            f"TransferOpDesc(local_addr={self._local_addr:#x}, remote_addr={self._remote_addr:#x}, "
            f"len={self._len})"
        )


class TransferArgs:
    """`TransferArgs()`: `user_data` (an integer, 0 by default) comes back in `TransferResult`."""

    __slots__ = ("_user_data",)

    def __init__(self) -> None:
        self._user_data = 0

    @property
    def user_data(self) -> int:
        return self._user_data

    @user_data.setter
    def user_data(self, value: int) -> None:
        self._user_data = uint("user_data", value)


class GetTransferStatusArgs:
    """`GetTransferStatusArgs(max_query_count=4294967295, skip_waiting=False)`."""

    __slots__ = ("_max_query_count", "_skip_waiting")

    def __init__(self, max_query_count: int = U32_MAX, skip_waiting: bool = False) -> None:
        self.max_query_count = max_query_count
        self.skip_waiting = skip_waiting

    @property
    def max_query_count(self) -> int:
        return self._max_query_count

    @max_query_count.setter
    def max_query_count(self, value: int) -> None:
        self._max_query_count = uint("max_query_count", value, U32_MAX)

    @property
    def skip_waiting(self) -> bool:
        return self._skip_waiting

    @skip_waiting.setter
    def skip_waiting(self, value: bool) -> None:
        instance("skip_waiting", value, bool)
        self._skip_waiting = value


class TransferResult:
    """One request's status from `get_all_transfer_status`: `req`, `user_data`, `status` (read-only)."""

    __slots__ = ("_req", "_status", "_user_data")

    def __init__(self) -> None:
        self._req = 0
        self._user_data = 0
        self._status = TransferStatus.WAITING

    @property
    def req(self) -> int:
        return self._req

    @req.setter
    def req(self, value: int) -> None:
        self._req = uint("req", value)

    @property
    def user_data(self) -> int:
        return self._user_data

    @user_data.setter
    def user_data(self, value: int) -> None:
        self._user_data = uint("user_data", value)

    @property
    def status(self) -> TransferStatus:
        return self._status


class NotifyDesc:
    """`NotifyDesc(name, notify_msg)`: a notify for a remote engine's `get_notifies`."""

    __slots__ = ("_name", "_notify_msg")

    def __init__(self, name: str, notify_msg: str) -> None:
        self.name = name
        self.notify_msg = notify_msg

    @property
    def name(self) -> str:
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        self._name = text("name", value)

    @property
    def notify_msg(self) -> str:
        return self._notify_msg

    @notify_msg.setter
    def notify_msg(self, value: str) -> None:
        self._notify_msg = text("notify_msg", value)

    def __repr__(self) -> str:
        return f"NotifyDesc(name={self._name!r}, notify_msg={self._notify_msg!r})"


def transfer_result(req: int, user_data: int, status: TransferStatus) -> TransferResult:
    """A `TransferResult` as `get_all_transfer_status` fills it (its status is read-only to callers)."""
    result = TransferResult()
    result.req = req
    result.user_data = user_data
    result._status = status
    return result
