"""A Prompt process for multi-process tests: a real `LLMDataDist(PROMPT)` in a spawned child, driven
over a multiprocessing pipe. The test process is the Decoder. Every wait has a timeout and every child is
reaped (SIGKILL as the last resort)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from llm_datadist.ext import shared_arrays

PROMPT_IP = "127.0.0.1"
CALL_TIMEOUT_S = 20.0


def pattern(seed: int, cache_index: int, tensor_index: int, nbytes: int) -> np.ndarray:
    """The bytes the Prompt writes into tensor `tensor_index` of its cache number `cache_index`."""
    return np.random.default_rng([seed, cache_index, tensor_index]).integers(0, 256, nbytes, dtype=np.uint8)


def prompt_options(
    port: int, *, sync_kv_timeout_ms: int = 5000, extra: dict[str, str] | None = None
) -> dict[str, str]:
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = f"{PROMPT_IP}:{port}"
    config.sync_kv_timeout = sync_kv_timeout_ms
    options = dict(config.generate_options())
    options.update(extra or {})
    return options


class _Synchronizer(LayerSynchronizer):
    """ "go": every layer is ready at once; "queue": wait for the test to put a token per layer (a token
    "fail" makes that layer fail); "fail:<k>": layer k fails; "raise:<k>": layer k raises."""

    def __init__(self, mode: str, layer_queue: Any) -> None:
        self.mode = mode
        self.layer_queue = layer_queue

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        if self.mode == "queue":
            if not self.layer_queue.poll(CALL_TIMEOUT_S):
                return False
            return bool(self.layer_queue.recv() != "fail")
        if self.mode.startswith("fail:"):
            return layer_index != int(self.mode.split(":")[1])
        if self.mode.startswith("raise:") and layer_index == int(self.mode.split(":")[1]):
            raise RuntimeError(f"the model failed at layer {layer_index}")
        return True


def tensor_views_v2(cache: Any) -> list[np.ndarray]:
    """uint8 views of a v2 Cache's tensors, through its (real) addresses."""
    import ctypes

    nbytes = cache.cache_desc.size
    return [
        np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(addr)) for addr in cache.tensor_addrs
    ]


def _prompt_main(
    pipe: Connection, cluster_id: int, port: int, seed: int, extra: dict[str, str], layer_queue: Any = None
) -> None:
    from llm_datadist.ext import tensor_views

    datadist = LLMDataDist(LLMRole.PROMPT, cluster_id)
    try:
        datadist.init(prompt_options(port, extra=extra))
    except Exception:
        pipe.send(("err", traceback.format_exc()))
        return
    v2 = extra.get("llm.EnableCacheManager") == "1"
    manager: Any = datadist.cache_manager if v2 else datadist.kv_cache_manager
    owned: dict[int, list[np.ndarray]] = {}  # memory this process registered (v2), kept alive here
    caches: dict[int, Any] = {}
    tasks: list[Any] = []
    pipe.send(("ok", os.getpid()))
    while True:
        try:
            command, args = pipe.recv()
        except EOFError:
            break
        try:
            if command == "stop":
                pipe.send(("ok", None))
                break
            if command == "alloc":
                num_tensors, shape, keys = args
                desc = CacheDesc(num_tensors, list(shape), DataType.DT_FLOAT16)
                cache_keys = [CacheKey(*key) for key in keys]
                cache = manager.allocate_cache(desc, cache_keys)
                index = cache.cache_id
                for t, view in enumerate(tensor_views(cache)):
                    raw = view.view(np.uint8).reshape(-1)
                    raw[:] = pattern(seed, index, t, raw.nbytes)
                caches[cache.cache_id] = cache
                result: Any = cache.cache_id
            elif command == "alloc_blocks":
                num_tensors, shape, model_id = args
                desc = CacheDesc(num_tensors, list(shape), DataType.DT_FLOAT16)
                key = None if model_id is None else BlocksCacheKey(cluster_id, model_id)
                cache = manager.allocate_blocks_cache(desc, key)
                for t, view in enumerate(tensor_views(cache)):
                    raw = view.view(np.uint8).reshape(-1)
                    raw[:] = pattern(seed, cache.cache_id, t, raw.nbytes)
                caches[cache.cache_id] = cache
                result = cache.cache_id
            elif command == "transfer":
                cache_id, configs, src_blocks, dst_blocks, dst_block_nbytes, mode = args
                transfer_configs = [
                    TransferConfig(cluster, list(addrs), None if layers is None else range(*layers), batch)
                    for cluster, addrs, layers, batch in configs
                ]
                task = manager.transfer_cache_async(
                    caches[cache_id],
                    _Synchronizer(mode, layer_queue),
                    transfer_configs,
                    src_blocks,
                    dst_blocks,
                    dst_block_nbytes,
                )
                tasks.append(task)
                result = len(tasks) - 1
            elif command == "task_sync":
                index, timeout_ms = args
                result = int(tasks[index].synchronize(timeout_ms))
            elif command == "task_results":
                index, timeout_ms = args
                result = [
                    None if code is None else int(code) for code in tasks[index].get_results(timeout_ms)
                ]
            elif command == "v2_register_blocks":
                # Blocks cache over numpy memory this process owns (private, or "library": from
                # ext.shared_arrays), filled like `pattern` (cache index = the cache id the registration
                # returns).
                num_tensors, shape, model_id, remote_accessible, *memory = args
                desc = CacheDesc(num_tensors, list(shape), DataType.DT_FLOAT16)
                if memory == ["library"]:
                    arrays = shared_arrays(num_tensors, int(np.prod(shape)), np.float16)
                else:
                    arrays = [np.zeros(int(np.prod(shape)), dtype=np.float16) for _ in range(num_tensors)]
                key = None if model_id is None else BlocksCacheKey(cluster_id, model_id)
                cache = manager.register_blocks_cache(
                    desc, [a.ctypes.data for a in arrays], key, remote_accessible
                )
                for t, array in enumerate(arrays):
                    array.view(np.uint8)[:] = pattern(seed, cache.cache_id, t, array.nbytes)
                owned[cache.cache_id] = arrays
                caches[cache.cache_id] = cache
                result = cache.cache_id
            elif command == "v2_churn_blocks":
                # Register a blocks cache (filled like `pattern` with cache index 0) under `model_id` and
                # unregister it again, `rounds` times: peers pull it meanwhile.
                rounds, num_tensors, shape, model_id = args
                desc = CacheDesc(num_tensors, list(shape), DataType.DT_FLOAT16)
                for _ in range(rounds):
                    arrays = [np.zeros(int(np.prod(shape)), dtype=np.float16) for _ in range(num_tensors)]
                    for t, array in enumerate(arrays):
                        array.view(np.uint8)[:] = pattern(seed, 0, t, array.nbytes)
                    cache = manager.register_blocks_cache(
                        desc, [a.ctypes.data for a in arrays], BlocksCacheKey(cluster_id, model_id), None
                    )
                    time.sleep(0.002)
                    manager.unregister_cache(cache.cache_id)
                result = rounds
            elif command == "v2_unregister":
                manager.unregister_cache(args)
                caches.pop(args)
                result = None
            elif command == "v2_dealloc_blocks":
                manager.deallocate_blocks_cache(caches.pop(args))
                result = None
            elif command == "v2_alloc":
                num_tensors, shape, keys, blocks_model_id = args
                desc = CacheDesc(num_tensors, list(shape), DataType.DT_FLOAT16)
                if blocks_model_id is None:
                    cache = manager.allocate_cache(desc, [CacheKey(*key) for key in keys])
                else:
                    cache = manager.allocate_blocks_cache(desc, BlocksCacheKey(cluster_id, blocks_model_id))
                for t, view in enumerate(tensor_views_v2(cache)):
                    view[:] = pattern(seed, cache.cache_id, t, view.nbytes)
                caches[cache.cache_id] = cache
                result = cache.cache_id
            elif command == "v2_alloc_many":
                # Many one-tensor caches without keys (a large one-sided table); the last cache id.
                count, shape = args
                desc = CacheDesc(1, list(shape), DataType.DT_FLOAT16)
                for _ in range(count):
                    cache = manager.allocate_cache(desc, [])
                    caches[cache.cache_id] = cache
                result = cache.cache_id
            elif command == "v2_rewrite":
                # New data in the same memory (one-sided readers must see it): pattern of cache index + 1000.
                cache_id = args
                for t, view in enumerate(tensor_views_v2(caches[cache_id])):
                    view[:] = pattern(seed, cache_id + 1000, t, view.nbytes)
                result = None
            elif command == "v2_bytes":
                cache_id, tensor_index = args
                result = bytes(tensor_views_v2(caches[cache_id])[tensor_index])
            elif command == "v2_transfer":
                # TransferWithCacheKeyConfig pushes: configs are (cluster, model_id or (cache_id, slot),
                # src layer (start, stop), dst layer (start, stop)).
                cache_id, configs, src_blocks, dst_blocks = args
                key_configs = []
                for cluster, target, src_layers, dst_layers in configs:
                    key = (
                        BlocksCacheKey(cluster, target)
                        if isinstance(target, int)
                        else CacheKeyByIdAndIndex(cluster, target[0], target[1])
                    )
                    key_configs.append(
                        TransferWithCacheKeyConfig(key, range(*src_layers), range(*dst_layers))
                    )
                task = manager.transfer_cache_async(
                    caches[cache_id], _Synchronizer("go", None), key_configs, src_blocks, dst_blocks
                )
                result = int(task.synchronize(int(CALL_TIMEOUT_S * 1000)))
            elif command == "link":
                comm_name, members, table = args
                result = datadist.link(comm_name, dict(members), table)
            elif command == "query":
                result = int(datadist.query_register_mem_status(args).value)
            elif command == "remove_key":
                manager.remove_cache_key(CacheKey(*args))
                result = None
            elif command == "dealloc":
                manager.deallocate_cache(caches.pop(args))
                result = None
            elif command == "stats":
                result = datadist._require_core().leases.stats()
            elif command == "drop":
                # The serving side ends every connection from cluster `args` (clears their index rows).
                result = datadist._require_core().server.drop_cluster(args)
            elif command == "listen_tcp":
                # Serve peers on other hosts at (ip, port) too, as a non-loopback listen_ip_info would.
                ip, tcp_port = args
                datadist._require_core().listen_tcp(ip, tcp_port)
                result = None
            elif command == "handled":
                result = datadist._require_core().server.handled
            elif command == "index_name":
                result = datadist._require_core().table.index.name
            elif command == "segments":
                # The names of the files behind this owner's index, generation words and pools.
                table = datadist._require_core().table
                result = {
                    "index": table.index.name,
                    "generations": table.generations.name,
                    "pools": [segment.name for pool in table.pools() for segment in pool.segments],
                }
            elif command == "addrs":
                result = caches[args].per_device_tensor_addrs
            else:
                raise ValueError(f"unknown command {command}")
            pipe.send(("ok", result))
        except Exception:
            pipe.send(("err", traceback.format_exc()))
    caches.clear()
    datadist.finalize()


class PromptPeer:
    """Start with `with PromptPeer(...) as peer:`; the child is always reaped on exit."""

    def __init__(self, cluster_id: int, port: int, seed: int, *, extra: dict[str, str] | None = None) -> None:
        self.cluster_id = cluster_id
        self.port = port
        self.seed = seed
        ctx = mp.get_context("spawn")
        self._pipe, child_pipe = ctx.Pipe()
        # Layer tokens for a "queue" synchronizer in the child (see _Synchronizer). A pipe, not a
        # multiprocessing.Queue: a Queue's semaphore would be a /dev/shm entry of its own.
        layer_reader, self._layer_writer = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=_prompt_main,
            args=(child_pipe, cluster_id, port, seed, extra or {}, layer_reader),
            daemon=True,
        )
        self.process.start()
        child_pipe.close()
        layer_reader.close()
        try:
            self.pid: int = self._reply(CALL_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _reply(self, timeout_s: float) -> Any:
        if not self._pipe.poll(timeout_s):
            raise TimeoutError("prompt peer did not answer in time")
        status, value = self._pipe.recv()
        if status != "ok":
            raise RuntimeError(f"prompt peer failed:\n{value}")
        return value

    def call(self, command: str, args: Any = None, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        self._pipe.send((command, args))
        return self._reply(timeout_s)

    def call_start(self, command: str, args: Any = None) -> None:
        """The first half of `call`, for a command that blocks in the child; `call_finish` waits for it."""
        self._pipe.send((command, args))

    def call_finish(self, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        return self._reply(timeout_s)

    def stats(self, timeout_s: float = 10.0) -> dict[str, int]:
        """The Prompt's table counters once no lease is held: a puller releases its lease one way, so the
        owner may still be about to process the release when the puller's call has returned."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            stats: dict[str, int] = self.call("stats")
            if stats["leases"] == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.005)

    def alloc(self, num_tensors: int, shape: list[int], keys: list[tuple[int, ...]]) -> int:
        result: int = self.call("alloc", (num_tensors, shape, keys))
        return result

    def alloc_blocks(self, num_tensors: int, shape: list[int], model_id: int | None) -> int:
        result: int = self.call("alloc_blocks", (num_tensors, shape, model_id))
        return result

    def expected(self, cache_id: int, tensor_index: int, nbytes: int) -> np.ndarray:
        return pattern(self.seed, cache_id, tensor_index, nbytes)

    def cluster_info(self) -> LLMClusterInfo:
        info = LLMClusterInfo()
        info.remote_cluster_id = self.cluster_id
        info.append_local_ip_info(PROMPT_IP, 0)
        info.append_remote_ip_info(PROMPT_IP, self.port)
        return info

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                self._pipe.send(("stop", None))
                self._reply(10)
            self.process.join(10)
        if self.process.is_alive():
            self.kill()
        self._pipe.close()
        self._layer_writer.close()

    def release_layer(self, token: object) -> None:
        """Let the child's "queue" synchronizer return for one more layer ("fail" fails that layer)."""
        self._layer_writer.send(token)

    def __enter__(self) -> PromptPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def decoder(
    cluster_id: int = 2, *, sync_kv_timeout_ms: int = 5000, extra: dict[str, str] | None = None
) -> Iterator[LLMDataDist]:
    datadist = LLMDataDist(LLMRole.DECODER, cluster_id)
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = sync_kv_timeout_ms
    options = dict(config.generate_options())
    options.update(extra or {})
    datadist.init(options)
    try:
        yield datadist
    finally:
        datadist.finalize()


@contextlib.contextmanager
def linked_decoder(cluster_id: int, port: int, seed: int) -> Iterator[tuple[PromptPeer, LLMDataDist]]:
    """A Prompt at `port` and a Decoder (sync_kv_timeout 400 ms) linked to it."""
    with PromptPeer(cluster_id, port, seed) as peer, decoder(sync_kv_timeout_ms=400) as dd:
        ret, codes = dd.link_clusters([peer.cluster_info()], timeout=5000)
        assert ret == LLMStatusCode.LLM_SUCCESS and codes == [LLMStatusCode.LLM_SUCCESS]
        yield peer, dd


def _lease_holder_main(pipe: Connection, socket_file: str, remote_cluster_id: int, req_id: int) -> None:
    """A Decoder that resolves a key (taking a lease) and then hangs until it is killed."""
    import time
    from pathlib import Path

    from llm_datadist._protocol.messages import KEY_REQ, RULES_V1, PinRequest
    from llm_datadist._wire.client import ClientLink

    link = ClientLink.connect(
        Path(socket_file),
        cluster_id=77,
        remote_cluster_id=remote_cluster_id,
        role=2,
        deadline=time.monotonic() + 10,
    )
    seq = link.next_seq()
    grant = link.request(
        PinRequest(seq, KEY_REQ, req_id, 0, 0, 0, 2, True, 64, 0, True, False, RULES_V1),
        seq,
        time.monotonic() + 10,
    )
    pipe.send(("ok", type(grant).__name__))
    time.sleep(600)


def _start_holder(
    main: Any, args: tuple[Any, ...], what: str
) -> tuple[mp.process.BaseProcess, Connection, Any]:
    """Spawn `main(pipe, *args)` and wait for its first report: (process, our end of the pipe, the value
    it reported). A child that does not report in time is killed and reaped."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=main, args=(child, *args), daemon=True)
    process.start()
    child.close()
    if not parent.poll(CALL_TIMEOUT_S):
        process.kill()
        process.join(10)
        parent.close()
        raise TimeoutError(f"{what} did not report")
    status, value = parent.recv()
    assert status == "ok", value
    return process, parent, value


def start_lease_holder(socket_file: str, remote_cluster_id: int, req_id: int) -> mp.process.BaseProcess:
    """Start `_lease_holder_main` and wait until it holds its lease."""
    process, pipe, value = _start_holder(
        _lease_holder_main, (socket_file, remote_cluster_id, req_id), "lease holder"
    )
    pipe.close()
    assert value == "Location", value
    return process


def _index_holder_main(
    pipe: Connection, socket_file: str, remote_cluster_id: int, mode: str, key: tuple[int, int, int]
) -> None:
    """A Decoder process that links to a Prompt and then, through the Prompt's published index, either
    pins `key` (mode "pin", or "pin-v2" under the cache-manager rules: it unpins when told "unpin") or
    takes the index lock and stops itself (mode "lock", SIGSTOP while holding it). It waits to be
    killed."""
    import time
    from pathlib import Path

    from llm_datadist._puller.copy import Copier
    from llm_datadist._puller.dataplane import peer_index, pin, unpin
    from llm_datadist._puller.movers import HostMover
    from llm_datadist._puller.peer import Peer
    from llm_datadist._puller.source import V1, V2, SourceRef
    from llm_datadist._wire.client import ClientLink
    from llm_datadist.status import LLMStatusCode

    incarnation = 4242
    wire = ClientLink.connect(
        Path(socket_file),
        cluster_id=77,
        remote_cluster_id=remote_cluster_id,
        role=2,
        deadline=time.monotonic() + 10,
        incarnation=incarnation,
    )
    link = Peer(wire, HostMover(Copier(1)))
    index = peer_index(link, incarnation, time.monotonic() + 10, LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT)
    assert index is not None
    if mode == "lock":
        with index.locked(10.0):
            pipe.send(("ok", "locked"))
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(600)
    kind, key_id, model_id = key
    pinned = pin(
        link,
        index,
        SourceRef(kind, key_id, model_id, 0, 0, 2, True, 64, 0, True, rules=V2 if mode == "pin-v2" else V1),
        cluster_id=77,
        deadline=time.monotonic() + 10,
        timeout_code=LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
    )
    pipe.send(("ok", "pinned" if pinned is not None else "not published"))
    if pipe.poll(600) and pipe.recv() == "unpin":
        unpin(link, index, ok=True)
        pipe.send(("ok", "unpinned"))
    time.sleep(600)


def start_index_holder(
    socket_file: str, remote_cluster_id: int, mode: str, key: tuple[int, int, int] = (0, 0, 0)
) -> tuple[mp.process.BaseProcess, Connection]:
    """Start `_index_holder_main`; returns once it holds its pin or the lock (the pipe stays open)."""
    process, pipe, value = _start_holder(
        _index_holder_main, (socket_file, remote_cluster_id, mode, key), "index holder"
    )
    assert value in ("pinned", "locked"), value
    return process, pipe
