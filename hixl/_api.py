"""`Hixl` and `get_capability`: the engine object of the HIXL API and its static capability query.

Rules: arguments are converted as the binding converts them (TypeError); before `initialize` and after
`finalize` every call is FAILED; then the real `Hixl`'s own checks (timeouts > 0, notify lengths), then one
call on `llm_datadist._hixl.Engine`, whose status is returned. An engine never finalized is finalized when
its `Hixl` is collected or at exit; in a child forked after `initialize` it is the parent's (FAILED there).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence

from llm_datadist._hixl import Engine, OpDesc, start_engine
from llm_datadist._hixl.codes import (
    FAILED,
    FEATURE_NOT_SUPPORTED,
    FEATURE_SUPPORTED,
    MAX_NOTIFY_NBYTES,
    PARAM_INVALID,
    SUCCESS,
)

from ._types import (
    AsyncConnectStatus,
    FeatureType,
    GetTransferStatusArgs,
    MemDesc,
    MemType,
    NotifyDesc,
    TransferArgs,
    TransferOp,
    TransferOpDesc,
    TransferResult,
    TransferStatus,
    instance,
    text,
    timeout_ms,
    transfer_result,
    uint,
)

_DEFAULT_TIMEOUT_MS = 1000


# Every engine's box, for a child forked after `initialize` to let go of them.
_BOXES: weakref.WeakSet[_Box] = weakref.WeakSet()


class _Box:
    """Holds a `Hixl`'s engine, so that collecting the `Hixl` (or exiting) can finalize it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.engine: Engine | None = None
        _BOXES.add(self)

    def forked(self) -> None:
        """In a child forked after `initialize`: the engine is the parent's (its calls answer FAILED
        here, finalizing touches nothing of it); the child may initialize one of its own."""
        self.lock = threading.Lock()
        engine, self.engine = self.engine, None
        if engine is not None and not engine.closed:
            engine.abandon(os.getppid())

    def close(self) -> None:
        with self.lock:
            engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()


def _after_fork_in_child() -> None:
    for box in list(_BOXES):
        box.forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Hixl:
    """`Hixl()`: one HIXL engine; `initialize(local_engine, options)` before anything else."""

    def __init__(self) -> None:
        self._box = _Box()
        self._finalizer = weakref.finalize(self, self._box.close)

    def _engine(self) -> Engine | None:
        engine = self._box.engine
        return None if engine is None or engine.closed else engine

    # ------------------------------------------------------------------ lifecycle

    def initialize(self, local_engine: str, options: dict[str, str] | None = None) -> int:
        """Start the engine "ip:port" (a server peers connect to when port > 0; a client only without a
        port, or with 0). A repeated call while initialised is SUCCESS and changes nothing."""
        local_engine = text("local_engine", local_engine)
        options = {} if options is None else options
        instance("options", options, dict)
        checked = {text("options key", k): text("options value", v) for k, v in options.items()}
        with self._box.lock:
            if self._box.engine is not None:
                return SUCCESS
            code, self._box.engine = start_engine(local_engine, checked)
        return code

    def finalize(self) -> None:
        """Disconnect, stop serving, forget registered memory; later calls answer FAILED (until
        `initialize` again). Finalizing twice is harmless."""
        self._box.close()

    # ------------------------------------------------------------------ memory

    def register_mem(self, mem_desc: MemDesc, mem_type: MemType, /) -> tuple[int, int]:
        """(status, handle): peers connected to this engine may read and write [addr, addr + len)."""
        instance("mem_desc", mem_desc, MemDesc)
        instance("mem_type", mem_type, MemType)
        engine = self._engine()
        if engine is None:
            return FAILED, 0
        if mem_desc.addr == 0:
            return PARAM_INVALID, 0
        return engine.register_mem(mem_desc.addr, mem_desc.len, int(mem_type), local_only=mem_desc.local_only)

    def deregister_mem(self, mem_handle: int, /) -> int:
        handle = uint("mem_handle", mem_handle)
        engine = self._engine()
        return FAILED if engine is None else engine.deregister_mem(handle)

    # ------------------------------------------------------------------ connections

    def _timed(self, remote_engine: str, timeout_in_millis: int) -> tuple[Engine | None, str, int, int]:
        """(engine, remote, timeout, code): code is FAILED without an engine, PARAM_INVALID for a
        timeout that is not > 0, else SUCCESS."""
        remote = text("remote_engine", remote_engine)
        timeout = timeout_ms(timeout_in_millis)
        engine = self._engine()
        if engine is None:
            return None, remote, timeout, FAILED
        return engine, remote, timeout, (SUCCESS if timeout > 0 else PARAM_INVALID)

    def connect(self, remote_engine: str, timeout_in_millis: int = _DEFAULT_TIMEOUT_MS) -> int:
        engine, remote, timeout, code = self._timed(remote_engine, timeout_in_millis)
        return engine.connect(remote, timeout) if engine is not None and code == SUCCESS else code

    def disconnect(self, remote_engine: str, timeout_in_millis: int = _DEFAULT_TIMEOUT_MS) -> int:
        engine, remote, timeout, code = self._timed(remote_engine, timeout_in_millis)
        return engine.disconnect(remote, timeout) if engine is not None and code == SUCCESS else code

    def connect_async(self, remote_engine: str, timeout_in_millis: int = _DEFAULT_TIMEOUT_MS) -> int:
        engine, remote, timeout, code = self._timed(remote_engine, timeout_in_millis)
        return engine.connect_async(remote, timeout) if engine is not None and code == SUCCESS else code

    def disconnect_async(self, remote_engine: str, timeout_in_millis: int = _DEFAULT_TIMEOUT_MS) -> int:
        engine, remote, timeout, code = self._timed(remote_engine, timeout_in_millis)
        return engine.disconnect_async(remote, timeout) if engine is not None and code == SUCCESS else code

    def get_async_connect_status(self, remote_engine: str, /) -> tuple[int, AsyncConnectStatus]:
        remote = text("remote_engine", remote_engine)
        engine = self._engine()
        if engine is None:
            return FAILED, AsyncConnectStatus.NOT_CONNECT
        return SUCCESS, AsyncConnectStatus(engine.async_connect_status(remote))

    def get_all_async_connect_status(self) -> tuple[int, dict[str, AsyncConnectStatus]]:
        engine = self._engine()
        if engine is None:
            return FAILED, {}
        statuses = engine.async_connect_statuses()
        return SUCCESS, {remote: AsyncConnectStatus(status) for remote, status in statuses.items()}

    # ------------------------------------------------------------------ transfers

    @staticmethod
    def _descs(op: TransferOp, op_descs: Sequence[TransferOpDesc]) -> list[OpDesc]:
        instance("op", op, TransferOp)
        if isinstance(op_descs, (str, bytes)) or not isinstance(op_descs, Sequence):
            raise TypeError(f"op_descs: incompatible type {type(op_descs).__name__}, a list is required")
        for desc in op_descs:
            instance("op_descs", desc, TransferOpDesc)
        return [OpDesc(d.local_addr, d.remote_addr, d.len) for d in op_descs]

    def transfer_sync(
        self,
        remote_engine: str,
        op: TransferOp,
        op_descs: Sequence[TransferOpDesc],
        timeout_in_millis: int = _DEFAULT_TIMEOUT_MS,
    ) -> int:
        """READ: each descriptor's remote bytes into its local bytes; WRITE: the other way. Every local
        range must lie in memory this engine registered, every remote one in memory the peer registered."""
        descs = self._descs(op, op_descs)
        engine, remote, timeout, code = self._timed(remote_engine, timeout_in_millis)
        if engine is None or code != SUCCESS:
            return code
        return engine.transfer_sync(remote, int(op), descs, timeout)

    def transfer_async(
        self,
        remote_engine: str,
        op: TransferOp,
        op_descs: Sequence[TransferOpDesc],
        args: TransferArgs | None = None,
    ) -> tuple[int, int]:
        """(status, request id): the transfer runs in the background; ask `get_transfer_status`."""
        remote = text("remote_engine", remote_engine)
        descs = self._descs(op, op_descs)
        args = TransferArgs() if args is None else args
        instance("args", args, TransferArgs)
        engine = self._engine()
        if engine is None:
            return FAILED, 0
        return engine.transfer_async(remote, int(op), descs, args.user_data)

    def get_transfer_status(self, req_id: int, /) -> tuple[int, TransferStatus]:
        """(status, transfer status) of one request; a request that ended is reported once."""
        req = uint("req_id", req_id)
        engine = self._engine()
        if engine is None:
            return FAILED, TransferStatus.FAILED
        code, status = engine.transfer_status(req)
        return code, TransferStatus(status)

    def get_all_transfer_status(
        self, args: GetTransferStatusArgs | None = None
    ) -> tuple[int, list[TransferResult]]:
        args = GetTransferStatusArgs() if args is None else args
        instance("args", args, GetTransferStatusArgs)
        engine = self._engine()
        if engine is None:
            return FAILED, []
        code, found = engine.transfer_statuses(args.max_query_count, args.skip_waiting)
        return code, [transfer_result(req, data, TransferStatus(status)) for req, data, status in found]

    # ------------------------------------------------------------------ notifies

    def send_notify(
        self, remote_engine: str, notify: NotifyDesc, timeout_in_millis: int = _DEFAULT_TIMEOUT_MS
    ) -> int:
        """Send `notify` to an engine this one connected to; SUCCESS once the peer kept it."""
        instance("notify", notify, NotifyDesc)
        engine, remote, timeout, code = self._timed(remote_engine, timeout_in_millis)
        if engine is None:
            return code
        if len(notify.name.encode()) > MAX_NOTIFY_NBYTES or code != SUCCESS:
            return PARAM_INVALID
        if len(notify.notify_msg.encode()) > MAX_NOTIFY_NBYTES:
            return PARAM_INVALID
        return engine.send_notify(remote, notify.name, notify.notify_msg, timeout)

    def get_notifies(self) -> tuple[int, list[NotifyDesc]]:
        """Every notify peers sent this engine since the last call, in arrival order."""
        engine = self._engine()
        if engine is None:
            return FAILED, []
        return SUCCESS, [NotifyDesc(name, message) for name, message in engine.notifies()]


def get_capability(feature_type: FeatureType, /) -> tuple[int, int]:
    """(SUCCESS, FEATURE_SUPPORTED) for AUTO_CONNECT and CLIENT_SERVER_COMM, as the real library; no
    engine needed."""
    instance("feature_type", feature_type, FeatureType)
    known = feature_type in (FeatureType.AUTO_CONNECT, FeatureType.CLIENT_SERVER_COMM)
    return SUCCESS, FEATURE_SUPPORTED if known else FEATURE_NOT_SUPPORTED
