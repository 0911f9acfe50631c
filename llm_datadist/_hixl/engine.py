"""`Engine`: one initialised HIXL engine, the one call behind each method of `hixl.Hixl`.

Rules: every method returns the real engine's status and never raises for a condition the real API
reports; a connection is our link to the cluster the remote engine's address names, and only the side that
connected transfers over it, as in the real engine. Every wait is bounded by the call's timeout, or by
the engine's own (`ENGINE_TIMEOUT_MS`) where a call has none.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from llm_datadist._protocol.messages import Ack, Notify

from .._core import PLACEMENT_DEVICE, PLACEMENT_HOST
from .._errors import StatusError
from .._procmaps import require_mapped
from .._puller.vm import allow_peers_to_attach, cross_memory_supported
from ..status import LLMStatusCode
from ..utils.log import log
from .codes import (
    ALREADY_CONNECTED,
    FAILED,
    MEM_DEVICE,
    NOT_CONNECTED,
    NOTIFY_FAILED,
    PARAM_INVALID,
    SUCCESS,
    TIMEOUT,
    TRANSFER_FAILED,
    UNSUPPORTED,
    code_of,
    code_of_status,
)
from .config import ConfigError, EngineAddress, EngineOptions, parse_address, parse_options
from .connects import ConnectPool
from .moves import Mover, OpDesc, deadline_in
from .node import ENGINE_TIMEOUT_MS, Notifies, address_cluster_id, start_core
from .regions import Region, Regions, new_handle
from .requests import ASYNC_TIMEOUT_S, Requests, final_status

# How long an asynchronous transfer may take to connect (AUTO_CONNECT), as the real engine.
ASYNC_CONNECT_TIMEOUT_MS = 3000


class Engine:
    """An initialised engine: its `Core` (server, links, table of registered memory), the regions it
    registered, its asynchronous connects and transfers."""

    def __init__(self, local_engine: str, options: dict[str, str]) -> None:
        """Raises ConfigError (bad arguments) or StatusError (the address is served by another process)."""
        self.address: EngineAddress = parse_address(local_engine)
        self.options: EngineOptions = parse_options(options)
        self._notifies = Notifies()
        self.core = start_core(self.address, self._notifies)
        self._regions = Regions()
        self._mover = Mover(self.core, self._regions)
        self._requests = Requests()
        self._connects = ConnectPool(
            self.options.connect_threads, self.options.connect_queue, self.connect, self.disconnect
        )
        self._close_lock = threading.Lock()
        self.closed = False

    def abandon(self, parent_pid: int) -> None:
        """In a child forked after `initialize`: the engine is the parent's. Its calls answer FAILED here
        and closing it touches nothing the parent shares (`Core.abandon`). No lock: the child has one
        thread, and a lock another thread held at the fork stays held."""
        self._close_lock = threading.Lock()
        self.closed = True
        self.core.abandon(parent_pid)

    def close(self) -> None:
        """Finalize: asynchronous work stops (bounded), links say goodbye, the server stops, registered
        memory is forgotten and every segment unlinked. Idempotent."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        drain_s = ENGINE_TIMEOUT_MS / 1000.0 + 1.0
        self._connects.close(drain_s)
        self._requests.close(drain_s)
        self.core.close()

    # ------------------------------------------------------------------ memory

    def register_mem(
        self, addr: int, nbytes: int, mem_type: int, *, local_only: bool = False
    ) -> tuple[int, int]:
        """(code, handle). The same range registered again gives the same handle (as it was first
        registered); a range overlapping another is PARAM_INVALID (the table keeps registered memory
        disjoint). `local_only`: this engine's own side of transfers only, left out of the table peers
        read, so a remote engine that names it gets PARAM_INVALID."""
        if self.closed:
            return FAILED, 0
        if addr == 0 or nbytes <= 0 or addr + nbytes > 2**64:
            log.error("register_mem: addr %#x, len %d: not a memory range", addr, nbytes)
            return PARAM_INVALID, 0
        if not local_only:
            reason = cross_memory_supported()
            if reason is not None:
                log.error("register_mem: peers cannot reach memory of this process: %s", reason)
                return UNSUPPORTED, 0
            allow_peers_to_attach()
        with self._regions.registering:
            same = self._regions.exact(addr, nbytes)
            if same is not None:
                return SUCCESS, same.handle
            try:
                # Peers read and write it: every byte must be this process's own, readable and writable.
                require_mapped([(addr, nbytes)], what="memory", writable=True)
                record = self.core.table.register(
                    num_tensors=1,
                    tensor_nbytes=nbytes,
                    batch_size=1,
                    addrs=[addr],
                    keys=[],
                    is_blocks=False,
                    placement=PLACEMENT_DEVICE if mem_type == MEM_DEVICE else PLACEMENT_HOST,
                    remote_accessible=not local_only,
                )
            except StatusError as exc:
                log.error("register_mem: addr %#x, len %d: %s", addr, nbytes, exc.detail)
                return code_of(exc), 0
            region = Region(new_handle(), record.cache_id, addr, nbytes, mem_type)
            self._regions.add(region)
        return SUCCESS, region.handle

    def deregister_mem(self, handle: int) -> int:
        """Forget a registration; peers' transfers that pin it end first (up to the engine's timeout).
        An unknown handle is SUCCESS, as in the real engine; 0 is PARAM_INVALID."""
        if self.closed:
            return FAILED
        if handle == 0:
            return PARAM_INVALID
        with self._regions.registering:
            region = self._regions.get(handle)
            if region is None:
                return SUCCESS
            if self.options.cs and self.core.links.clusters():
                log.error("deregister_mem: disconnect every remote engine first (this engine's rule)")
                return FAILED
            try:
                self.core.table.unregister(region.cache_id, timeout_s=ENGINE_TIMEOUT_MS / 1000.0)
            except StatusError as exc:
                log.error("deregister_mem: handle %#x: %s", handle, exc.detail)
                return code_of(exc)
            self._regions.remove(handle)
        return SUCCESS

    # ------------------------------------------------------------------ connections

    def _remote(self, remote_engine: str) -> tuple[int, EngineAddress]:
        """(cluster id, address) of a remote engine; ConfigError(PARAM_INVALID) for a bad name or this
        engine itself."""
        address = parse_address(remote_engine)
        if address == self.address and address.serves:
            raise ConfigError(PARAM_INVALID, f"{remote_engine} is this engine: no connection with self")
        return address_cluster_id(address), address

    def connect(self, remote_engine: str, timeout_ms: int) -> int:
        if self.closed:
            return FAILED
        try:
            cluster_id, address = self._remote(remote_engine)
        except ConfigError as exc:
            log.error("connect to %s: %s", remote_engine, exc.detail)
            return exc.code
        if not address.serves:
            log.error("connect to %s: a remote engine without a port serves nothing", remote_engine)
            return FAILED
        deadline = deadline_in(timeout_ms)
        try:
            code = self.core.links.link(cluster_id, address.host, address.port, deadline)
        except StatusError as exc:
            log.error("connect to %s: %s", remote_engine, exc.detail)
            return code_of(exc)
        if code == LLMStatusCode.LLM_ALREADY_LINK:
            return ALREADY_CONNECTED
        if code != LLMStatusCode.LLM_SUCCESS and time.monotonic() >= deadline:
            return TIMEOUT
        return code_of_status(code)

    def disconnect(self, remote_engine: str, timeout_ms: int) -> int:
        """Close our link to that engine (the peer is told); a transfer still running on it ends first."""
        if self.closed:
            return FAILED
        try:
            cluster_id, _ = self._remote(remote_engine)
        except ConfigError as exc:
            return exc.code
        links = self.core.links
        with links.lock:
            link = links.forget(cluster_id)
        if link is None:
            return NOT_CONNECTED
        self._mover.forget(cluster_id)
        link.close(say_bye=True)
        return SUCCESS

    def connect_async(self, remote_engine: str, timeout_ms: int) -> int:
        return FAILED if self.closed else self._connects.submit(remote_engine, timeout_ms, connect=True)

    def disconnect_async(self, remote_engine: str, timeout_ms: int) -> int:
        return FAILED if self.closed else self._connects.submit(remote_engine, timeout_ms, connect=False)

    def async_connect_status(self, remote_engine: str) -> int:
        return self._connects.status(remote_engine)

    def async_connect_statuses(self) -> dict[str, int]:
        return self._connects.statuses()

    def _connected(self, remote_engine: str, timeout_ms: int) -> tuple[int, int]:
        """(code, cluster id) of the link a transfer to `remote_engine` takes: with AUTO_CONNECT made
        first when missing (its failure shows as NOT_CONNECTED, as in the real engine)."""
        try:
            cluster_id, _ = self._remote(remote_engine)
        except ConfigError as exc:
            return exc.code, 0
        if self.options.auto_connect and cluster_id not in self.core.links.clusters():
            self.connect(remote_engine, timeout_ms)
        if cluster_id not in self.core.links.clusters():
            return NOT_CONNECTED, 0
        return SUCCESS, cluster_id

    # ------------------------------------------------------------------ transfers

    def transfer_sync(self, remote_engine: str, op: int, descs: Sequence[OpDesc], timeout_ms: int) -> int:
        if self.closed:
            return FAILED
        if not _valid(descs):
            return PARAM_INVALID
        code, cluster_id = self._connected(remote_engine, timeout_ms)
        if code != SUCCESS:
            return code
        return self._transfer(remote_engine, cluster_id, op, descs, deadline_in(timeout_ms))

    def transfer_async(
        self, remote_engine: str, op: int, descs: Sequence[OpDesc], user_data: int
    ) -> tuple[int, int]:
        """(code, request id): the checks that need no peer come now, the transfer on a worker."""
        if self.closed:
            return FAILED, 0
        if not _valid(descs):
            return PARAM_INVALID, 0
        code, cluster_id = self._connected(remote_engine, ASYNC_CONNECT_TIMEOUT_MS)
        if code != SUCCESS:
            return code, 0
        try:
            self._mover.local_runs(descs)
        except StatusError as exc:
            log.error("transfer_async to %s: %s", remote_engine, exc.detail)
            return code_of(exc), 0
        deadline = time.monotonic() + ASYNC_TIMEOUT_S
        return self._requests.submit(
            cluster_id,
            user_data,
            lambda: final_status(self._transfer(remote_engine, cluster_id, op, descs, deadline)),
        )

    def _transfer(
        self, remote_engine: str, cluster_id: int, op: int, descs: Sequence[OpDesc], deadline: float
    ) -> int:
        try:
            self._mover.run(cluster_id, op, descs, deadline)
            return SUCCESS
        except StatusError as exc:
            code = code_of(exc)
            log.error("transfer with %s failed: %s", remote_engine, exc.detail)
        except Exception:
            log.error("transfer with %s failed with an internal error", remote_engine, exc_info=True)
            code = FAILED
        if self.options.auto_connect and code not in (PARAM_INVALID, NOT_CONNECTED):
            # As the real engine: a failed link is dropped, the next transfer connects anew.
            self.disconnect(remote_engine, ENGINE_TIMEOUT_MS)
        return code

    def transfer_status(self, req: int) -> tuple[int, int]:
        if req == 0:
            return FAILED, TRANSFER_FAILED
        return self._requests.status(req)

    def transfer_statuses(self, max_count: int, skip_waiting: bool) -> tuple[int, list[tuple[int, int, int]]]:
        """Every request's status; the communicator engine (the default) answers UNSUPPORTED."""
        if not self.options.cs:
            return UNSUPPORTED, []
        return SUCCESS, self._requests.statuses(max_count, skip_waiting)

    # ------------------------------------------------------------------ notifies

    def send_notify(self, remote_engine: str, name: str, message: str, timeout_ms: int) -> int:
        """One notify over our link to that engine, answered once the peer kept it."""
        if self.closed:
            return FAILED
        try:
            cluster_id, _ = self._remote(remote_engine)
            link = self.core.links.get(cluster_id)
        except ConfigError as exc:
            return exc.code
        except StatusError as exc:
            return code_of(exc)
        deadline = deadline_in(timeout_ms)
        try:
            with link.exclusive(deadline):
                seq = link.next_seq()
                reply = link.request(Notify(seq, name, message), seq, deadline)
        except StatusError as exc:
            log.error("send_notify to %s: %s", remote_engine, exc.detail)
            code = code_of(exc)
            return code if code in (TIMEOUT, NOT_CONNECTED) else NOTIFY_FAILED
        return SUCCESS if isinstance(reply, Ack) else NOTIFY_FAILED

    def notifies(self) -> list[tuple[str, str]]:
        """(name, message) of every notify peers sent since the last call, in arrival order."""
        return self._notifies.take_all()


def _valid(descs: Sequence[OpDesc]) -> bool:
    """The engine's first check of a transfer: descriptors given, none with a null address."""
    if not descs or any(not d.local_addr or not d.remote_addr for d in descs):
        log.error("a transfer needs descriptors, and no null address in them")
        return False
    return True


def start_engine(local_engine: str, options: dict[str, str]) -> tuple[int, Engine | None]:
    """(status, engine) of `initialize`: the real status of a refusal, said in the log."""
    try:
        return SUCCESS, Engine(local_engine, options)
    except ConfigError as exc:
        log.error("[initialize] engine %s: %s", local_engine, exc.detail)
        return exc.code, None
    except StatusError as exc:
        log.error("[initialize] engine %s: %s", local_engine, exc.detail)
        return code_of(exc), None
    except Exception as exc:  # its sockets taken by another engine of this process, an unusable runtime dir
        log.error("[initialize] engine %s: %s", local_engine, exc)
        return FAILED, None
