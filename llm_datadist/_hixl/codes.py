"""The numbers of the HIXL engine API: its status codes and the values of its enums, as plain ints (the
`hixl` face wraps the enums), and `code_of`, the one place an internal error becomes a status code.

Rules: every value is the real one (`include/hixl/hixl_types.h` of hicann/hixl); the engine returns these
ints and never raises for a condition the real API reports as a status.
"""

from __future__ import annotations

from .._errors import StatusError, TransferTimeout
from ..status import LLMStatusCode

# Status codes (hixl::Status).
SUCCESS = 0
PARAM_INVALID = 103900
TIMEOUT = 103901
NOT_CONNECTED = 103902
ALREADY_CONNECTED = 103903
NOTIFY_FAILED = 103904
UNSUPPORTED = 103905
FAILED = 503900
RESOURCE_EXHAUSTED = 203900

# A notify's name and message each, in bytes (and what one link keeps for the peer's get_notifies).
MAX_NOTIFY_NBYTES = 1024

# MemType, TransferOp, FeatureType.
MEM_DEVICE, MEM_HOST = 0, 1
READ, WRITE = 0, 1
AUTO_CONNECT, CLIENT_SERVER_COMM = 0, 1
FEATURE_SUPPORTED, FEATURE_NOT_SUPPORTED = 1, 0

# TransferStatus.
WAITING, COMPLETED, TRANSFER_TIMEOUT, TRANSFER_FAILED = 0, 1, 2, 3

# AsyncConnectStatus.
NOT_CONNECT = 0
CONNECT_PENDING = 1
CONNECTING = 2
CONNECTED = 3
CONNECT_FAILED = 4
DISCONNECT_PENDING = 5
DISCONNECTING = 6

_FROM_LLM = {
    LLMStatusCode.LLM_SUCCESS: SUCCESS,
    LLMStatusCode.LLM_PARAM_INVALID: PARAM_INVALID,
    # A remote range whose memory its owner deregistered (found so during the transfer): not registered.
    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST: PARAM_INVALID,
    LLMStatusCode.LLM_TIMEOUT: TIMEOUT,
    LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT: TIMEOUT,
    LLMStatusCode.LLM_NOT_YET_LINK: NOT_CONNECTED,
    LLMStatusCode.LLM_ALREADY_LINK: ALREADY_CONNECTED,
    LLMStatusCode.LLM_FEATURE_NOT_ENABLED: UNSUPPORTED,
    LLMStatusCode.LLM_OUT_OF_MEMORY: RESOURCE_EXHAUSTED,
    LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY: RESOURCE_EXHAUSTED,
}


def code_of_status(code: LLMStatusCode) -> int:
    """The HIXL status for an `LLMStatusCode` of the parts underneath (a broken or refused link, and
    anything without a closer match, is FAILED)."""
    return _FROM_LLM.get(code, FAILED)


def code_of(exc: StatusError) -> int:
    """The HIXL status for an internal failure."""
    if isinstance(exc, TransferTimeout):
        return TIMEOUT
    return code_of_status(exc.code)
