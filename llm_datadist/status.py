"""Status codes and the public exception (real path: `llm_datadist.status`).

`LLMStatusCode` carries the engine's numeric values (`0x5010B000 + n`, §2.4 of the reference); every failure a
caller can see is an `LLMException` with one of them. Native-style integer codes become members through
`code_2_status` (unknown ones: LLM_FAILED). Error messages have the real shape
"[<api>] failed, error code is LLMStatusCode.<NAME>, <context>." (`make_error` / `raise_error`).
"""

from __future__ import annotations

from enum import IntEnum
from typing import NoReturn

from llm_datadist.utils import log

__all__ = [
    "LLMException",
    "LLMStatusCode",
    "Status",
    "code_2_status",
    "handle_llm_status",
    "make_error",
    "raise_error",
    "raise_if_false",
    "raise_if_true",
]

_ENGINE_BASE = 0x5010B000  # GE_ERRORNO_DEFINE(1, 1, 0, 8, 11, NAME, n) == _ENGINE_BASE + n


class LLMStatusCode(IntEnum):
    """Result codes, with the numeric values the native engine uses.

    An `IntEnum` whose `str()` (and so f-string) form is "LLMStatusCode.NAME", as in current hixl (it was a
    plain `Enum` before 2026-05; an IntEnum compares equal to itself either way); `format()` with a spec
    formats the number (f"{code:#x}"), on every Python. Engine codes 20-23
    (CACHE_INCOMPATIBLE ...) have no member, as in the real package; `code_2_status` maps them to LLM_FAILED.
    """

    LLM_SUCCESS = 0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROCESS_TIMEOUT = _ENGINE_BASE + 1  # C++ name: LLM_WAIT_PROC_TIMEOUT
    LLM_KV_CACHE_NOT_EXIST = _ENGINE_BASE + 2
    LLM_REPEAT_REQUEST = _ENGINE_BASE + 3
    LLM_REQUEST_ALREADY_COMPLETED = _ENGINE_BASE + 4
    LLM_PARAM_INVALID = _ENGINE_BASE + 5
    LLM_ENGINE_FINALIZED = _ENGINE_BASE + 6
    LLM_NOT_YET_LINK = _ENGINE_BASE + 7
    LLM_ALREADY_LINK = _ENGINE_BASE + 8
    LLM_LINK_FAILED = _ENGINE_BASE + 9
    LLM_UNLINK_FAILED = _ENGINE_BASE + 10
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = _ENGINE_BASE + 11
    LLM_CLUSTER_NUM_EXCEED_LIMIT = _ENGINE_BASE + 12
    LLM_PROCESSING_LINK = _ENGINE_BASE + 13
    LLM_DEVICE_OUT_OF_MEMORY = _ENGINE_BASE + 14
    LLM_PREFIX_ALREADY_EXIST = _ENGINE_BASE + 15
    LLM_PREFIX_NOT_EXIST = _ENGINE_BASE + 16
    LLM_SEQ_LENOVERLIMIT = _ENGINE_BASE + 17  # (sic) the real Python name
    LLM_NO_FREE_BLOCK = _ENGINE_BASE + 18
    LLM_BLOCKS_OUT_OF_MEMORY = _ENGINE_BASE + 19
    LLM_EXIST_LINK = _ENGINE_BASE + 24
    LLM_FEATURE_NOT_ENABLED = _ENGINE_BASE + 25
    LLM_TIMEOUT = _ENGINE_BASE + 26
    LLM_LINK_BUSY = _ENGINE_BASE + 27
    LLM_OUT_OF_MEMORY = _ENGINE_BASE + 28
    LLM_DEVICE_MEM_ERROR = 507053  # ACL_ERROR_RT_DEVICE_MEM_ERROR
    LLM_SUSPECT_REMOTE_ERROR = 507057  # ACL_ERROR_RT_SUSPECT_REMOTE_ERROR
    LLM_UNKNOWN_ERROR = -1

    def __str__(self) -> str:
        return f"{self.__class__.__name__}.{self.name}"

    def __format__(self, format_spec: str) -> str:
        # IntEnum's format is int's from Python 3.11: an empty spec gives str() (the name above), any other
        # spec formats the number. 3.10's Enum.__format__ would format the name whenever __str__ is
        # overridden (f"{code:d}" a ValueError), so it is spelled out here, as in LLMRole and Placement.
        return int.__format__(self, format_spec)


class LLMException(RuntimeError):
    """The library's error: `LLMException(*args, status_code=LLMStatusCode.LLM_SUCCESS)`.

    As in the real package the default code is LLM_SUCCESS, so always pass one. `status_code` is read-only.
    It pickles with its code (useful across processes); the real class does too, through `__dict__`.
    """

    def __init__(self, *args: object, status_code: LLMStatusCode = LLMStatusCode.LLM_SUCCESS) -> None:
        super().__init__(*args)
        self._status_code = status_code

    @property
    def status_code(self) -> LLMStatusCode:
        """The error code carried by this exception."""
        return self._status_code


class Status:
    """A status code wrapper: `Status(code)`; `is_ok()` is true when the code equals LLM_SUCCESS."""

    def __init__(self, status: LLMStatusCode | int) -> None:
        self._status_code = status

    def is_ok(self) -> bool:
        return self._status_code == LLMStatusCode.LLM_SUCCESS

    @property
    def status_code(self) -> LLMStatusCode | int:
        """The code given to the constructor, unchanged."""
        return self._status_code

    def __repr__(self) -> str:
        return f"Status({self._status_code})"


# LLM_UNKNOWN_ERROR (-1) is deliberately absent: the real mapping never produces it.
_CODE_TO_STATUS: dict[int, LLMStatusCode] = {
    int(code): code for code in LLMStatusCode if code is not LLMStatusCode.LLM_UNKNOWN_ERROR
}


def code_2_status(status: int) -> LLMStatusCode:
    """Map a native integer code to its `LLMStatusCode`; a code with no member becomes LLM_FAILED."""
    return _CODE_TO_STATUS.get(status, LLMStatusCode.LLM_FAILED)


def handle_llm_status(status: int, func_name: str, other_info: object) -> None:
    """Raise for a non-zero native return code, as the real helper does.

    The message is `f"{func_name} failed, error code is {code}, {other_info}."`; the real callers pass
    `func_name` already bracketed (`"[link]"`). `make_error` builds the same message from a bare api name.
    """
    if status != LLMStatusCode.LLM_SUCCESS:
        code = code_2_status(status)
        raise LLMException(f"{func_name} failed, error code is {code}, {other_info}.", status_code=code)


def make_error(api: str, code: LLMStatusCode, context: str = "") -> LLMException:
    """`LLMException(code)` with message "[<api>] failed, error code is LLMStatusCode.<NAME>, <context>."

    With an empty `context` the message ends after the code ("... LLMStatusCode.<NAME>."), where the real
    helper would print a dangling ", .".
    """
    tail = f", {context}." if context else "."
    return LLMException(f"[{api}] failed, error code is {code}{tail}", status_code=code)


def raise_error(api: str, code: LLMStatusCode, context: str = "") -> NoReturn:
    """Raise `make_error(api, code, context)`."""
    raise make_error(api, code, context)


def _format(fmt: str, args: tuple[object, ...], kwargs: dict[str, object]) -> str:
    # Only format when there is something to substitute: the real helper always calls str.format, so an
    # already-formatted message containing braces (a dict repr) raised KeyError/IndexError instead.
    return fmt.format(*args, **kwargs) if args or kwargs else fmt


def raise_if_false(
    pred: object,
    fmt: str,
    *args: object,
    status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID,
    **kwargs: object,
) -> None:
    """If `pred` is falsy, log and raise `LLMException(fmt.format(*args, **kwargs), status_code=status_code)`.

    The real signature: a semantic argument check, PARAM_INVALID unless told otherwise.
    """
    if not pred:
        message = _format(fmt, args, kwargs)
        log.error(message)
        raise LLMException(message, status_code=status_code)


def raise_if_true(
    pred: object,
    fmt: str,
    *args: object,
    status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID,
    **kwargs: object,
) -> None:
    """If `pred` is truthy, log and raise `LLMException(fmt.format(*args, **kwargs), status_code=...)`."""
    if pred:
        message = _format(fmt, args, kwargs)
        log.error(message)
        raise LLMException(message, status_code=status_code)
