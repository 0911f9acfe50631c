"""Bytes between hosts: one Mooncake Transfer Engine per process (the `multihost` extra).

Rules: the engine starts on first use (a TCP link made or served) in P2PHANDSHAKE mode, no metadata
service; peers learn each other's engine address in the link handshake. Memory is registered with it only
when a transfer needs it (our pool segments and registered caches a remote peer was granted; over RDMA our
own destinations and sources too) and unregistered before it is unmapped or handed back to the user. A
transfer is one batch per at most `MAX_DESCRIPTORS` runs, run by a long-lived worker thread so that the
caller's deadline and the peer's death are noticed on time; the worker pins the local memory until the
engine lets go of it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ._errors import StatusError, TransferTimeout
from ._signals import held, hold_here
from .status import LLMStatusCode
from .utils.log import log

ENV_PROTOCOL = "LLM_DATADIST_MOONCAKE_PROTOCOL"
ENV_DEVICES = "LLM_DATADIST_MOONCAKE_DEVICES"
EXTRA_HINT = "pip install 'llm-datadist-host[multihost]' (Mooncake also needs Debian's libibverbs1)"
# Mooncake refuses a batch of a few thousand descriptors, and a refused batch can leave the engine failing
# every later transfer to that peer: stay well below.
MAX_DESCRIPTORS = 1024
# How long the engine waits for progress on a TCP transfer before it fails it (Mooncake's default is 30 s);
# bounds how long a worker can outlive a call that timed out.
DEFAULT_PROGRESS_TIMEOUT_S = 5
# Set unless the user set them: Mooncake logs errors only (it still prints one harmless "Local segment
# descriptor not found" when it starts), and a stalled TCP transfer fails after this long.
_ENGINE_ENV_DEFAULTS = {
    "MC_LOG_LEVEL": "ERROR",
    "MC_TCP_PROGRESS_TIMEOUT_SEC": str(DEFAULT_PROGRESS_TIMEOUT_S),
}
_POLL_S = 0.02  # how often a waiting caller looks at its deadline and at the peer
_WORKERS = 4  # transfers in flight at once (to different peers, or the same one from several threads)


class MissingExtra(StatusError):
    """Mooncake Transfer Engine cannot be imported here."""


def _import_engine() -> Any:
    for name, value in _ENGINE_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)  # read when the library loads
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as exc:  # OSError: a shared library (libibverbs) is missing
        raise MissingExtra(
            LLMStatusCode.LLM_LINK_FAILED,
            f"a link to another host moves bytes with Mooncake Transfer Engine, which cannot be imported "
            f"({type(exc).__name__}: {exc}); {EXTRA_HINT}",
        ) from exc
    return TransferEngine


def engine_available() -> str | None:
    """None when an engine can be started here, else why not (naming the extra)."""
    try:
        _import_engine()
    except MissingExtra as exc:
        return exc.detail
    return None


_shared: RemoteEngine | None = None
_shared_lock = threading.Lock()


def _forget_in_child() -> None:
    """The parent's engine did not come along into a forked child (its threads stay with the parent)."""
    global _shared, _shared_lock
    _shared = None
    _shared_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def shared_engine(local_ip: str) -> RemoteEngine:
    """This process's engine, started on `local_ip` at the first call. One per process: Mooncake has no way
    to stop an engine, so a later instance (after `finalize` and `init`) uses the same one."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = RemoteEngine(local_ip)
        elif _shared.local_ip != local_ip:
            log.info(
                "transfer engine: using %s for %s too (one engine per process)", _shared.address, local_ip
            )
        return _shared


class RemoteEngine:
    """This process's transfer engine: its address ("ip:port", the Mooncake session id peers use), the
    memory registered with it, and transfers to and from peers' engines. Thread-safe."""

    def __init__(self, local_ip: str) -> None:
        engine_class = _import_engine()
        # TCP unless the user asks for RDMA (and names the NICs Mooncake may use, e.g. "mlx5_0,mlx5_1").
        protocol = os.environ.get(ENV_PROTOCOL, "tcp") or "tcp"
        devices = os.environ.get(ENV_DEVICES, "")
        if protocol not in ("tcp", "rdma"):
            raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"{ENV_PROTOCOL}={protocol!r}: tcp or rdma")
        # Its threads, made in here, leave SIGTERM and SIGINT to the program's main thread (`_signals`).
        with held():
            self._engine = engine_class()
            code = self._engine.initialize(local_ip, "P2PHANDSHAKE", protocol, devices)
        if code != 0:
            raise StatusError(
                LLMStatusCode.LLM_LINK_FAILED,
                f"the transfer engine did not start on {local_ip} (code {code})",
            )
        self.local_ip = local_ip
        self.protocol = protocol
        self.address = f"{local_ip}:{self._engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}  # address -> nbytes
        self._workers = 0  # transfers still running in the engine
        self._orphans = 0  # of those, the ones whose call gave up (see `_wait_for_orphans`)
        self._idle = threading.Condition(self._lock)
        # Long-lived workers: Mooncake keeps per-thread state, and a small read from a thread that never
        # transferred before costs it about 200 us more than one from a thread that did.
        self._pool = ThreadPoolExecutor(
            max_workers=_WORKERS, thread_name_prefix="llmdd-remote", initializer=hold_here
        )
        log.info("transfer engine at %s (%s)", self.address, protocol)

    def register(self, addr: int, nbytes: int) -> None:
        """Make [addr, addr + nbytes) transferable (once; the same range again is a no-op)."""
        with self._lock:
            known = self._registered.get(addr)
            if known is not None and known >= nbytes:
                return
            if known is not None:
                self._engine.unregister_memory(addr)
                del self._registered[addr]
            code = self._engine.register_memory(addr, nbytes)
            if code != 0:
                raise StatusError(
                    LLMStatusCode.LLM_FAILED, f"the transfer engine refused {nbytes} bytes at {addr:#x}"
                )
            self._registered[addr] = nbytes

    def unregister(self, addr: int) -> None:
        """Withdraw what `register` made transferable at `addr` (before it is unmapped or handed back)."""
        with self._lock:
            if self._registered.pop(addr, None) is not None:
                code = self._engine.unregister_memory(addr)
                if code != 0:
                    log.warning("the transfer engine did not unregister %#x (code %d)", addr, code)

    def registered(self, addr: int) -> bool:
        with self._lock:
            return addr in self._registered

    def transfer(
        self,
        peer: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
        *,
        write: bool,
        deadline: float,
        timeout_code: LLMStatusCode,
        check_peer: Callable[[], None],
        hold: Callable[[], Callable[[], None]],
    ) -> None:
        """Read (or `write`) runs between our memory and the engine at `peer`, in batches of at most
        `MAX_DESCRIPTORS`. Returns when all landed; TransferTimeout(`timeout_code`) at `deadline`;
        whatever `check_peer` raises (the link says the peer is gone) at once. `hold()` pins the local
        memory and returns its release, called when the engine is done with it, which may be after this
        call gave up."""
        if not lengths:
            return
        self._wait_for_orphans(deadline, timeout_code)
        outcome: list[BaseException | None] = []
        done = threading.Event()
        orphaned = threading.Event()  # set when this call gave up while the engine still works
        release = hold()
        batches = [
            (
                list(local_addrs[i : i + MAX_DESCRIPTORS]),
                list(remote_addrs[i : i + MAX_DESCRIPTORS]),
                list(lengths[i : i + MAX_DESCRIPTORS]),
            )
            for i in range(0, len(lengths), MAX_DESCRIPTORS)
        ]
        run = self._engine.batch_transfer_sync_write if write else self._engine.batch_transfer_sync_read

        def work() -> None:
            error: BaseException | None = None
            try:
                for local, remote, nbytes in batches:
                    code = run(peer, local, remote, nbytes)
                    if code != 0:
                        # The engine gave up on the peer (unreachable, reset, refused): the link is broken.
                        error = StatusError(
                            LLMStatusCode.LLM_LINK_FAILED,
                            f"the transfer engine failed a {'write to' if write else 'read from'} {peer} "
                            f"(code {code})",
                        )
                        break
            except BaseException as exc:  # reported to the caller, never lost in this thread
                error = exc
            finally:
                release()
                outcome.append(error)
                with self._lock:
                    done.set()
                    self._workers -= 1
                    if orphaned.is_set():
                        self._orphans -= 1
                    self._idle.notify_all()

        with self._lock:
            self._workers += 1
        self._pool.submit(work)
        try:
            while not done.wait(min(_POLL_S, max(deadline - time.monotonic(), 0.0))):
                check_peer()
                if time.monotonic() >= deadline:
                    raise TransferTimeout(timeout_code, f"the transfer with {peer} did not finish in time")
        except BaseException:
            with self._lock:
                if not done.is_set():
                    orphaned.set()
                    self._orphans += 1
            raise
        error = outcome[0]
        if error is not None:
            raise error

    def _wait_for_orphans(self, deadline: float, timeout_code: LLMStatusCode) -> None:
        """A transfer whose call gave up (a timeout, a dead link) may still land bytes when the network
        comes back, until the engine's own progress timeout: no new transfer starts before it ended, so
        that nothing it writes late overwrites what a later transfer wrote."""
        with self._lock:
            while self._orphans:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeout(
                        timeout_code,
                        "a transfer that failed earlier is still running in the transfer engine "
                        f"(it ends within {os.environ.get('MC_TCP_PROGRESS_TIMEOUT_SEC', '30')} s)",
                    )
                self._idle.wait(remaining)

    def drain(self, timeout_s: float = DEFAULT_PROGRESS_TIMEOUT_S + 1.0) -> None:
        """Wait (bounded) until no transfer is left in the engine (one that outlived its call holds local
        memory until then)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._workers and (remaining := deadline - time.monotonic()) > 0:
                self._idle.wait(remaining)
