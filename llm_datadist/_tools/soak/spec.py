"""What the soak's driver and its children share: the specs a child is started with, the pipe they talk
over, the settings every child uses. The bytes every owner writes and every puller checks are the stamped
units of `_tools.patterns`.

Rules: a child gets everything it needs in its spec (frozen, pickled once at spawn); what it sends the driver
is a tuple whose first item names it ("up", "beat", "pub", "ret", "warm", "quiet", "fail", "stopped",
"done"). Nothing here starts a process or a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from llm_datadist import CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMStatusCode

from .memdebug import MemoryProbe

IP = "127.0.0.1"
PORT_RANGE = (26000, 26999)
SYNC_KV_TIMEOUT_MS = 10_000  # generous: 8 busy processes share 2 cores; a real hang still shows
LINK_TIMEOUT_MS = 10_000
HEARTBEAT_S = 0.5
START_TIMEOUT_S = 60.0  # spawn + imports + init under load
BIG_PULL_NBYTES = 8 << 20  # the copy threads start at 8 MiB: warm-up waits for one such pull
MAX_FAILURE_LINES = 20  # per puller; later ones are only counted
U64_MAX = 2**64 - 1
# The pullers' cluster ids are PULLER_CLUSTER_BASE + 0, 1, 2 (v1, v2 one-sided, v2 leased).
PULLER_CLUSTER_BASE = 11
# A restarting v2 owner unlinks one of its pullers from the serving side in about this share of its steps
# (the puller's transfer in flight, if any, ends as it would; the puller relinks).
OWNER_UNLINK_CHANCE = 0.05
# A growing v1 pool keeps its most recent segment when it falls empty, so which segment survives a
# checkpoint depends on the last allocation. Two caches larger than any the soak allocates, both held, then
# freed, leave every v1 pool in the same state at each checkpoint: one fresh segment no peer has mapped.
BALLAST_NBYTES = 128 << 20

EXPECTED_ALWAYS = frozenset({LLMStatusCode.LLM_KV_CACHE_NOT_EXIST})
LINK_CODES = frozenset(
    {
        LLMStatusCode.LLM_LINK_FAILED,
        LLMStatusCode.LLM_NOT_YET_LINK,
        LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
        LLMStatusCode.LLM_TIMEOUT,
    }
)


def memory_at(address: int, nbytes: int) -> np.ndarray[Any, Any]:
    """uint8 view of `nbytes` at a real address of this process (what `tensor_addrs` promise)."""
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(address))


# ---------------------------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class OwnerRef:
    name: str
    mode: str  # "v1" or "v2"
    cluster_id: int
    port: int
    restarting: bool
    ip: str = IP  # where it listens (its namespace's address with --hosts)


@dataclass(frozen=True)
class OwnerSpec:
    ref: OwnerRef
    incarnation: int
    seed: int
    debug_memory_s: float = 0.0  # > 0: dump where the memory is to the log this often (long-lived only)

    @property
    def label(self) -> str:
        return f"{self.ref.name}#{self.incarnation}"


@dataclass(frozen=True)
class PullerSpec:
    name: str
    mode: str
    cluster_id: int
    seed: int
    owners: tuple[OwnerRef, ...]
    ip: str = IP  # this puller's own address (its namespace's with --hosts)
    debug_memory_s: float = 0.0


@dataclass(frozen=True)
class Entry:
    """A cache an owner published: enough for a puller to name it, size its destination and check it."""

    owner: str
    cluster_id: int
    incarnation: int
    serial: int
    kind: str  # "v1" (keys), "cache" (v2, by cache id and slot), "blocks" (v2, by model id)
    num_tensors: int
    units: int  # batch slots or blocks
    unit_elems: int  # fp16 elements per unit
    keys: tuple[tuple[int, bool, int], ...] = ()  # v1: (slot, is prefix key, key id)
    cache_id: int = 0
    model_id: int = 0

    @property
    def unit_nbytes(self) -> int:
        return 2 * self.unit_elems


def options(mode: str, listen: tuple[str, int] | None) -> dict[str, str]:
    """v1; v2 (cache manager, one-sided); v2-leased (cache manager, every pull asks the owner for a lease)."""
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = SYNC_KV_TIMEOUT_MS
    if listen is not None:
        config.listen_ip_info = f"{listen[0]}:{listen[1]}"
    if mode.startswith("v2"):
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = mode == "v2"
    return dict(config.generate_options())


def settle_pool(kvm: Any) -> None:
    desc = CacheDesc(1, [1, BALLAST_NBYTES // 2], DataType.DT_FLOAT16)
    first = kvm.allocate_cache(desc)  # takes the segment kept from before, or a new one
    second = kvm.allocate_cache(desc)  # always a new segment: the first is full
    kvm.deallocate_cache(first)  # that segment falls empty and is not the newest: unlinked
    kvm.deallocate_cache(second)  # the newest segment is kept, empty


def cluster_info(ref: OwnerRef, local_ip: str) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = ref.cluster_id
    if ref.mode == "v2":
        info.append_local_ip_info(local_ip, 0)
    info.append_remote_ip_info(ref.ip, ref.port)
    return info


class ChildPipe:
    """The child's end of its pipe to the driver; sends are serialized (library threads report too)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, *message: object) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            self.conn.send(message)


def report_thread_deaths(pipe: ChildPipe, label: str) -> None:
    """A library thread that dies (say, a server thread on a KeyError) is a failure, reported at once."""

    def hook(args: threading.ExceptHookArgs) -> None:
        text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        name = args.thread.name if args.thread is not None else "?"
        pipe.send("fail", f"{label}: thread {name!r} died: {text.strip()}")

    threading.excepthook = hook


def redirect_output(log_path: str) -> None:
    """The library logs expected link failures at error level: into the child's log file, not the table."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def memory_probe(label: str, interval_s: float) -> MemoryProbe | None:
    """`--debug-memory`: the probe that dumps this child's memory every `interval_s` (0: none)."""
    if interval_s <= 0:
        return None
    return MemoryProbe(label, interval_s)
