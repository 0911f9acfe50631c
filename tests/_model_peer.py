"""Driven `LLMDataDist` processes for the model-based test (tests/llm_datadist/test_model.py).

A `Node` is a spawned child running one real `LLMDataDist` (v1 or v2, owner or puller), driven over a pipe
with small commands. Every reply is an `Outcome`: ("ok", value) or ("llm", status code) for an
`LLMException`; any other exception in the child fails the test with its traceback. Every wait has a
timeout, and `close` reaps the child (SIGKILL as the last resort).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

IP = "127.0.0.1"
CALL_TIMEOUT_S = 20.0
START_TIMEOUT_S = 60.0
DTYPE_NBYTES = 2  # DT_FLOAT16
LOCAL_ID = 1 << 30  # the "cache id" in the pattern of a puller's push source


def pattern(seed: int, tag: int, cache_id: int, tensor_index: int, nbytes: int) -> np.ndarray:
    """The bytes an owner writes into tensor `tensor_index` of its cache `cache_id`; `tag` names the owner's
    incarnation (or a later rewrite), so bytes of an old incarnation never pass for a new one's."""
    rng = np.random.default_rng([seed, tag, cache_id, tensor_index])
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


@dataclass(frozen=True)
class Outcome:
    """What a command did: `code` is None on success (then `value` is its result), else the status code
    (an int) of the LLMException it raised."""

    code: int | None
    value: Any = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.code is None


def _views(cache: Any) -> list[np.ndarray]:
    """uint8 views of a cache's tensors through their (real) addresses: v1 KvCache or v2 Cache."""
    addrs = cache.tensor_addrs if hasattr(cache, "tensor_addrs") else cache.per_device_tensor_addrs[0]
    nbytes = cache.cache_desc.size
    return [np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(a)) for a in addrs]


class _Child:
    """The child's side: one LLMDataDist at a time (`init` / `finalize` let one process serve many
    examples), its caches, and the numpy memory it registered."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.dd: Any = None
        self.v2 = False
        self.tag = 0
        self.caches: dict[int, Any] = {}
        self.arrays: dict[int, list[np.ndarray]] = {}
        self.local: dict[str, Any] = {}
        self.blocks_ids: set[int] = set()

    # ------------------------------------------------------------------ lifecycle

    def do_init(self, role: str, cluster_id: int, options: dict[str, str], tag: int) -> None:
        from llm_datadist import LLMDataDist, LLMRole

        self.do_finalize()
        self.dd = LLMDataDist(LLMRole.PROMPT if role == "prompt" else LLMRole.DECODER, cluster_id)
        self.dd.init(options)
        self.v2 = options.get("llm.EnableCacheManager") == "1"
        self.tag = tag

    def do_finalize(self) -> None:
        self.caches.clear()
        self.blocks_ids.clear()
        self.local.clear()
        if self.dd is not None:
            self.dd.finalize()
            self.dd = None
        self.arrays.clear()

    @property
    def manager(self) -> Any:
        return self.dd.cache_manager if self.v2 else self.dd.kv_cache_manager

    # ------------------------------------------------------------------ owner side

    def _fill(self, cache: Any) -> None:
        for t, view in enumerate(_views(cache)):
            view[:] = pattern(self.seed, self.tag, cache.cache_id, t, view.nbytes)

    def do_alloc(
        self, num_tensors: int, shape: list[int], keys: list[tuple[int, int, int, int]], model_id: int | None
    ) -> int:
        """A pool cache: continuous with `keys` (cluster, req, model, prefix), or, with `model_id` not None,
        a blocks cache under BlocksCacheKey(model_id) (-1: a blocks cache with no key)."""
        from llm_datadist import BlocksCacheKey, CacheDesc, CacheKey, DataType

        desc = CacheDesc(num_tensors, list(shape), DataType.DT_FLOAT16)
        if model_id is None:
            cache = self.manager.allocate_cache(desc, [CacheKey(*key) for key in keys])
        else:
            key = None if model_id < 0 else BlocksCacheKey(self.dd.cluster_id, model_id)
            cache = self.manager.allocate_blocks_cache(desc, key)
        self._fill(cache)
        self.caches[cache.cache_id] = cache
        if model_id is not None:
            self.blocks_ids.add(cache.cache_id)
        return int(cache.cache_id)

    def do_register(self, num_tensors: int, shape: list[int], model_id: int | None) -> int:
        """v2: numpy memory of this process, registered (continuous with model_id None, else blocks)."""
        from llm_datadist import BlocksCacheKey, CacheDesc, DataType

        desc = CacheDesc(num_tensors, list(shape), DataType.DT_FLOAT16)
        nbytes = int(np.prod(shape)) * DTYPE_NBYTES
        arrays = [np.zeros(nbytes, dtype=np.uint8) for _ in range(num_tensors)]
        addrs = [a.ctypes.data for a in arrays]
        if model_id is None:
            cache = self.manager.register_cache(desc, addrs, remote_accessible=True)
        else:
            key = None if model_id < 0 else BlocksCacheKey(self.dd.cluster_id, model_id)
            cache = self.manager.register_blocks_cache(desc, addrs, key, True)
        self.arrays[cache.cache_id] = arrays
        self._fill(cache)
        self.caches[cache.cache_id] = cache
        if model_id is not None:
            self.blocks_ids.add(cache.cache_id)
        return int(cache.cache_id)

    def do_unregister(self, cache_id: int) -> None:
        self.manager.unregister_cache(cache_id)
        self.caches.pop(cache_id, None)
        # The numpy memory stays until the test ends: a peer that still maps it must not see it reused.

    def do_dealloc(self, cache_id: int) -> None:
        cache = self.caches[cache_id]
        if self.v2 and cache_id in self.blocks_ids:
            self.manager.deallocate_blocks_cache(cache)
        else:
            self.manager.deallocate_cache(cache)

    def do_remove_key(self, key: tuple[int, int, int, int]) -> None:
        from llm_datadist import CacheKey

        self.manager.remove_cache_key(CacheKey(*key))

    def do_rewrite(self, cache_id: int, tag: int) -> None:
        """New data in the same memory, as `pattern` with `tag`."""
        for t, view in enumerate(_views(self.caches[cache_id])):
            view[:] = pattern(self.seed, tag, cache_id, t, view.nbytes)

    def do_bytes(self, cache_id: int) -> list[bytes]:
        return [bytes(view) for view in _views(self.caches[cache_id])]

    def do_stats(self, timeout_s: float = 10.0) -> dict[str, int]:
        """The table's counters once no lease is held (a puller releases one way, so the owner may still be
        about to process a release when the puller's call has returned)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats: dict[str, int] = self.dd._require_core().leases.stats()
            if stats["leases"] == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.005)

    def do_peers(self) -> list[int]:
        return sorted(peer.cluster_id for peer in self.dd._require_core().server.peers())

    def do_wait_peers(self, expected: list[int], timeout_s: float = 10.0) -> list[int]:
        """The server's peers once they are `expected` (a peer's unlink reaches the server asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while True:
            peers = self.do_peers()
            if peers == sorted(expected) or time.monotonic() > deadline:
                return peers
            time.sleep(0.005)

    def do_transfer(self, cache_id: int, dst_cluster_id: int, dst_addrs: list[int], batch: int) -> list[int]:
        """v1 transfer_cache_async of the whole cache (slot `batch`) into a Decoder's addresses."""
        from llm_datadist import TransferConfig

        from ._peer import _Synchronizer

        config = TransferConfig(dst_cluster_id, list(dst_addrs), None, batch)
        task = self.manager.transfer_cache_async(self.caches[cache_id], _Synchronizer("go", None), [config])
        code = int(task.synchronize(int(CALL_TIMEOUT_S * 1000)))
        results = [None if r is None else int(r) for r in task.get_results(int(CALL_TIMEOUT_S * 1000))]
        return [code, *results]

    # ------------------------------------------------------------------ puller side

    def do_make_local(self, name: str, num_tensors: int, shape: list[int], blocks: bool) -> list[int]:
        """A destination (and push source) cache of this process; returns its tensor addresses."""
        from llm_datadist import CacheDesc, DataType

        desc = CacheDesc(num_tensors, list(shape), DataType.DT_FLOAT16)
        allocate = self.manager.allocate_blocks_cache if blocks else self.manager.allocate_cache
        cache = allocate(desc)
        self.local[name] = cache
        return [int(a) for a in (cache.tensor_addrs if self.v2 else cache.per_device_tensor_addrs[0])]

    def do_local_bytes(self, name: str) -> list[bytes]:
        return [bytes(view) for view in _views(self.local[name])]

    def do_local_fill(self, name: str, tag: int) -> None:
        for t, view in enumerate(_views(self.local[name])):
            view[:] = pattern(self.seed, tag, LOCAL_ID, t, view.nbytes)

    def do_zero_local(self, name: str) -> None:
        for view in _views(self.local[name]):
            view[:] = 0

    @staticmethod
    def _cluster_info(cluster_id: int, port: int) -> Any:
        from llm_datadist import LLMClusterInfo

        info = LLMClusterInfo()
        info.remote_cluster_id = cluster_id
        info.append_local_ip_info(IP, 0)
        info.append_remote_ip_info(IP, port)
        return info

    def do_link(self, cluster_id: int, port: int, timeout_ms: int = 5000) -> list[int]:
        ret, codes = self.dd.link_clusters([self._cluster_info(cluster_id, port)], timeout_ms)
        return [int(ret), *(int(c) for c in codes)]

    def do_unlink(self, cluster_id: int, port: int, force: bool) -> list[int]:
        ret, codes = self.dd.unlink_clusters([self._cluster_info(cluster_id, port)], 5000, force)
        return [int(ret), *(int(c) for c in codes)]

    def do_check_link(self, cluster_id: int) -> None:
        self.dd.check_link_status(cluster_id)

    def do_pull_cache(
        self, key: tuple[Any, ...], layers: tuple[int, int] | None, zero_first: bool = True
    ) -> list[bytes]:
        """Pull into the local "cont" cache (slot 0); key ("req", cluster, req, model, prefix) or
        ("id", cluster, cache_id, batch_index). Returns the local tensors' bytes afterwards."""
        from llm_datadist import CacheKey, CacheKeyByIdAndIndex

        dst = self.local["cont"]
        if zero_first:
            self.do_zero_local("cont")
        cache_key = CacheKey(*key[1:]) if key[0] == "req" else CacheKeyByIdAndIndex(*key[1:])
        kwargs = {}
        if layers is not None:
            kwargs = {"src_layer_range": range(*layers), "dst_layer_range": range(*layers)}
        self.manager.pull_cache(cache_key, dst, 0, -1, **kwargs)
        return self.do_local_bytes("cont")

    def do_pull_blocks(
        self, cluster_id: int, model_id: int, src_blocks: list[int], dst_blocks: list[int]
    ) -> list[bytes]:
        from llm_datadist import BlocksCacheKey

        self.do_zero_local("blocks")
        self.manager.pull_blocks(
            BlocksCacheKey(cluster_id, model_id), self.local["blocks"], src_blocks, dst_blocks
        )
        return self.do_local_bytes("blocks")

    def do_push_cache(
        self, cluster_id: int, cache_id: int, slot: int, layers: tuple[int, int] | None
    ) -> None:
        from llm_datadist import CacheKeyByIdAndIndex

        layer_range = None if layers is None else range(*layers)
        self.manager.push_cache(
            CacheKeyByIdAndIndex(cluster_id, cache_id, slot), self.local["cont"], 0, layer_range, layer_range
        )

    def do_push_blocks(
        self, cluster_id: int, model_id: int, src_blocks: list[int], dst_blocks: list[int]
    ) -> None:
        from llm_datadist import BlocksCacheKey

        self.manager.push_blocks(
            BlocksCacheKey(cluster_id, model_id), self.local["blocks"], src_blocks, dst_blocks
        )


def _node_main(pipe: Connection, seed: int) -> None:
    from llm_datadist import LLMException

    child = _Child(seed)
    pipe.send(("ok", os.getpid()))
    while True:
        try:
            command, args = pipe.recv()
        except EOFError:
            break
        if command == "stop":
            with contextlib.suppress(Exception):
                child.do_finalize()
            pipe.send(("ok", None))
            break
        try:
            result = getattr(child, f"do_{command}")(*args)
            pipe.send(("ok", result))
        except LLMException as exc:
            pipe.send(("llm", (int(exc.status_code), str(exc))))
        except Exception:
            pipe.send(("err", traceback.format_exc()))
    with contextlib.suppress(Exception):
        child.do_finalize()


class Node:
    """A driven child process. The constructor returns at once and `ready` waits for the child, so that
    several start in parallel."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        ctx = mp.get_context("spawn")
        self._pipe, child_pipe = ctx.Pipe()
        self.process = ctx.Process(target=_node_main, args=(child_pipe, seed), daemon=True, name=name)
        self.process.start()
        child_pipe.close()
        self.pid: int | None = None

    def ready(self, timeout_s: float = START_TIMEOUT_S) -> Node:
        if self.pid is not None:
            return self
        status, value = self._recv(timeout_s)
        if status != "ok":
            raise RuntimeError(f"{self.name} failed to start:\n{value}")
        self.pid = value
        return self

    def _recv(self, timeout_s: float) -> tuple[str, Any]:
        if not self._pipe.poll(timeout_s):
            raise TimeoutError(f"{self.name} did not answer within {timeout_s} s")
        status, value = self._pipe.recv()
        return status, value

    def call(self, command: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Outcome:
        self._pipe.send((command, args))
        status, value = self._recv(timeout_s)
        if status == "ok":
            return Outcome(None, value)
        if status == "llm":
            code, message = value
            return Outcome(code, None, message)
        raise RuntimeError(f"{self.name}: {command}{args} raised:\n{value}")

    def ok(self, command: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """`call` that must succeed."""
        outcome = self.call(command, *args, timeout_s=timeout_s)
        if not outcome.ok:
            raise AssertionError(f"{self.name}: {command}{args} failed: {outcome.message}")
        return outcome.value

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                self._pipe.send(("stop", ()))
                self._recv(10)
            self.process.join(10)
        if self.process.is_alive():
            self.kill()
        self._pipe.close()


def probe(port: int, remote_cluster_id: int, probe_cluster_id: int, timeout_s: float = 10.0) -> str | None:
    """Whether the server at `port` still serves: a fresh link's handshake and one ping. None when it
    answered, else why not."""
    from llm_datadist._protocol.messages import Ping, Pong
    from llm_datadist._runtime import socket_path
    from llm_datadist._wire.client import ClientLink

    deadline = time.monotonic() + timeout_s
    try:
        link = ClientLink.connect(
            socket_path(IP, port),
            cluster_id=probe_cluster_id,
            remote_cluster_id=remote_cluster_id,
            role=2,
            deadline=deadline,
        )
    except Exception as exc:
        return f"probe link failed: {exc!r}"
    try:
        seq = link.next_seq()
        reply = link.request(Ping(seq), seq, deadline)
        if not isinstance(reply, Pong):
            return f"probe got {type(reply).__name__}, not Pong"
        return None
    except Exception as exc:
        return f"probe ping failed: {exc!r}"
    finally:
        link.close(say_bye=True)
