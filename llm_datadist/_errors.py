"""Internal errors and the one place where they become the public `LLMException`.

Rules: internal code raises `StatusError` (a condition that already has an `LLMStatusCode`) or a named
error of `shm`/`protocol`/the transport; `api_errors(api)` wraps every public call and translates them,
chaining with `from`, into `LLMException` with the real message shape. Argument errors (TypeError,
ValueError, LLMException) raised by validation pass through untouched, as does RuntimeError (the real
library's "not initialized"); anything else is a bug, logged and raised as LLMException(LLM_FAILED), so
that callers that handle `LLMException.status_code` never meet an internal type.
"""

from __future__ import annotations

from llm_datadist._protocol.errors import ProtocolError
from llm_datadist._shm.errors import OutOfPoolMemory, ShmError

from ._runtime import RuntimeDirError
from .status import LLMException, LLMStatusCode, make_error
from .utils.log import log

# What a public method may raise besides LLMException (documented, and what the real library raises).
_PUBLIC_TYPES = (LLMException, TypeError, ValueError, RuntimeError)

# What an operation of a manager whose `LLMDataDist` was finalized says (nothing is touched): the real
# managers' since 2026 (hixl `test_cache_manager_lifecycle.py`).
FINALIZED = (
    "the LLMDataDist this manager belongs to was finalized; a manager is good for one init: take the "
    "manager again from the initialised instance"
)

# What a call through an instance that a forked child inherited from its parent says.
FORK_HINT = (
    "this LLMDataDist was initialised by process {pid}, before this process was forked from it; a forked "
    "child cannot use its parent's instance: init one of its own in the child, or start children with "
    "the spawn or forkserver start method (multiprocessing.get_context('spawn'))"
)


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


class IndexBusy(StatusError):
    """The index lock could not be had within the caller's budget (a stopped process holds it, or a slow
    one): the operation changed nothing and may be tried again."""


class TransferTimeout(StatusError):
    """A transfer did not finish within `sync_kv_timeout`; the link is unusable afterwards."""


class api_errors:
    """Translate internal errors raised inside a public method named `api` into `LLMException`.

    A class rather than a generator-based context manager: every public call enters one, and this costs a
    third of what @contextmanager does."""

    __slots__ = ("api", "timeout_code")

    def __init__(
        self, api: str, *, timeout_code: LLMStatusCode = LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT
    ) -> None:
        self.api = api
        self.timeout_code = timeout_code

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self.raise_for(exc)

    def raise_for(self, exc: BaseException) -> None:
        """Raise what `exc`, raised inside the method, means to its caller; return when it goes out as it
        is (an LLMException, an argument error, RuntimeError, or what is not an Exception)."""
        if isinstance(exc, LLMException):
            return
        api = self.api
        # A StatusError's detail is the whole story, told for the user: the internal chain behind it would
        # only bury it under tracebacks (a second copy of a program got three).
        if isinstance(exc, TransferTimeout):
            raise make_error(api, self.timeout_code, exc.detail) from None
        if isinstance(exc, StatusError):
            raise make_error(api, exc.code, exc.detail) from None
        if isinstance(exc, OutOfPoolMemory):
            # A full pool, or /dev/shm that cannot back the pages (`SharedMemoryExhausted`, whose message
            # names the mount, the bytes needed and free and how to raise it): the code of a full pool.
            # Allocations arrive here already as the instance's own out-of-memory code (`CacheTable`).
            raise make_error(api, LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY, str(exc)) from exc
        if isinstance(exc, ShmError):
            raise make_error(api, LLMStatusCode.LLM_FAILED, f"shared memory: {exc}") from exc
        if isinstance(exc, ProtocolError):
            raise make_error(api, LLMStatusCode.LLM_LINK_FAILED, f"protocol error: {exc}") from exc
        if isinstance(exc, RuntimeDirError):
            raise make_error(api, LLMStatusCode.LLM_FAILED, str(exc)) from exc
        if isinstance(exc, Exception) and not isinstance(exc, _PUBLIC_TYPES):
            log.error("[%s] failed with an internal error", api, exc_info=exc)
            raise make_error(api, LLMStatusCode.LLM_FAILED, f"internal error: {exc!r}") from exc
