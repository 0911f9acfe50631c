"""Internal errors and the one place where they become the public `LLMException`.

Rules: internal code raises `StatusError` (a condition that already has an `LLMStatusCode`) or a named
error of `shm`/`protocol`/the transport; `api_errors(api)` wraps every public call and translates them,
chaining with `from`, into `LLMException` with the real message shape. Argument errors (TypeError,
ValueError, LLMException) raised by validation pass through untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from protocol.errors import ProtocolError
from shm.errors import OutOfPoolMemory, ShmError

from .status import LLMException, LLMStatusCode, make_error


class StatusError(Exception):
    """An internal failure whose public status code is already known."""

    def __init__(self, code: LLMStatusCode, detail: str) -> None:
        super().__init__(f"{code.name}: {detail}")
        self.code = code
        self.detail = detail


class PeerGone(StatusError):
    """The peer closed the connection or died: noticed at once through EOF on the socket."""

    def __init__(self, detail: str) -> None:
        super().__init__(LLMStatusCode.LLM_LINK_FAILED, detail)


class TransferTimeout(StatusError):
    """A transfer did not finish within `sync_kv_timeout`; the link is unusable afterwards."""


@contextmanager
def api_errors(
    api: str, *, timeout_code: LLMStatusCode = LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT
) -> Iterator[None]:
    """Translate internal errors raised inside a public method named `api` into `LLMException`."""
    try:
        yield
    except LLMException:
        raise
    except TransferTimeout as exc:
        raise make_error(api, timeout_code, exc.detail) from exc
    except StatusError as exc:
        raise make_error(api, exc.code, exc.detail) from exc
    except OutOfPoolMemory as exc:
        raise make_error(api, LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY, str(exc)) from exc
    except ShmError as exc:
        raise make_error(api, LLMStatusCode.LLM_FAILED, f"shared memory: {exc}") from exc
    except ProtocolError as exc:
        raise make_error(api, LLMStatusCode.LLM_LINK_FAILED, f"protocol error: {exc}") from exc
