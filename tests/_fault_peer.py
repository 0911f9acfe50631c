"""A Decoder process for fault-injection tests: a real `LLMDataDist(DECODER)` in a spawned child that links
to an owner, then makes one transfer and stops itself (SIGSTOP) at a named point of that transfer's life
(`llm_datadist._faults`), after telling the test it is there. The test then does what it wants to the
owner (unlink, finalize, free and reuse memory) and resumes (SIGCONT) or kills (SIGKILL) this process,
which reports how the transfer ended and what bytes it moved. Every wait has a timeout."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)

CALL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Transfer:
    """What the Decoder does once linked. `kind`: "pull" (v1 pull_cache by key, or v2 pull_cache by key),
    "pull_by_id" (pull_cache of slot 0 of the owner's cache by id), "pull_layer" (v1 pull_cache of layer 0
    by key), "blocks" (pull_blocks by model id),
    "push" (v2 push_cache into the owner's cache by id and slot)."""

    v2: bool
    kind: str
    num_tensors: int
    shape: tuple[int, ...]
    req_id: int = 0  # pull: the key
    model_id: int = 0  # blocks
    cache_id: int = 0  # push: the owner's cache
    fill: int = 0x33  # push: what is pushed
    point: str = "pinned"  # where to stop ("" nowhere)
    then_fail: bool = False  # once resumed at `point`, the transfer fails there (an exception at that point)
    # v1 pull: a key pulled first, hook off, from the same pool segment: the pull under test then takes
    # the C kernel's way (`_puller.fresh`) where it has one
    warm_req_id: int = 0


def _options(v2: bool, sync_kv_timeout_ms: int, remote: bool) -> dict[str, str]:
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = sync_kv_timeout_ms
    if v2:
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = remote  # pushes need it
        config.mem_pool_cfg = '{"memory_size": 67108864}'
    options = dict(config.generate_options())
    return options


def _views(cache: Any) -> list[np.ndarray]:
    nbytes = cache.cache_desc.size
    addrs = cache.tensor_addrs if hasattr(cache, "tensor_addrs") else cache.per_device_tensor_addrs[0]
    return [np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(addr)) for addr in addrs]


def _main(pipe: Connection, owner_id: int, port: int, transfer: Transfer, sync_kv_timeout_ms: int) -> None:
    from llm_datadist import _faults

    datadist = LLMDataDist(LLMRole.DECODER, 2)
    datadist.init(_options(transfer.v2, sync_kv_timeout_ms, transfer.kind == "push"))
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = owner_id
    cluster.append_remote_ip_info("127.0.0.1", port)
    if transfer.v2:
        cluster.append_local_ip_info("127.0.0.1", 0)
    _, codes = datadist.link_clusters([cluster], timeout=int(CALL_TIMEOUT_S * 1000))
    pipe.send(("linked", [int(code) for code in codes]))

    def stop_at(point: str) -> None:
        if point == transfer.point:
            if transfer.warm_req_id:  # which way the pull under test took
                way = "kernel" if any(f.name == "_copy_pinned" for f in traceback.extract_stack()) else "full"
                pipe.send(("at", point, way))
            else:
                pipe.send(("at", point))
            os.kill(os.getpid(), signal.SIGSTOP)
            if transfer.then_fail:
                raise LLMException("injected at " + point, status_code=LLMStatusCode.LLM_FAILED)

    manager: Any = datadist.cache_manager if transfer.v2 else datadist.kv_cache_manager
    desc = CacheDesc(transfer.num_tensors, list(transfer.shape), DataType.DT_FLOAT16)
    cache = manager.allocate_cache(desc) if transfer.kind != "blocks" else manager.allocate_blocks_cache(desc)
    views = _views(cache)
    for view in views:
        view[:] = transfer.fill
    outcome: tuple[Any, ...]
    if transfer.warm_req_id:
        manager.pull_cache(CacheKey(owner_id, transfer.warm_req_id), cache, 0)
        for view in views:
            view[:] = transfer.fill
    _faults.hook = stop_at
    try:
        if transfer.kind == "pull":
            manager.pull_cache(CacheKey(owner_id, transfer.req_id), cache, 0)
        elif transfer.kind == "pull_layer":
            key = CacheKey(owner_id, transfer.req_id)
            manager.pull_cache(key, cache, 0, src_layer_range=range(0, 1), dst_layer_range=range(0, 1))
        elif transfer.kind == "pull_by_id":
            from llm_datadist import CacheKeyByIdAndIndex

            manager.pull_cache(CacheKeyByIdAndIndex(owner_id, transfer.cache_id, 0), cache, 0)
        elif transfer.kind == "blocks":
            blocks = list(range(transfer.shape[0]))
            manager.pull_blocks(BlocksCacheKey(owner_id, transfer.model_id), cache, blocks, blocks)
        else:
            from llm_datadist import CacheKeyByIdAndIndex

            manager.push_cache(CacheKeyByIdAndIndex(owner_id, transfer.cache_id, 0), cache)
        outcome = ("ok", [bytes(view) for view in views])
    except LLMException as exc:
        outcome = ("failed", int(exc.status_code), str(exc))
    except Exception:
        outcome = ("error", traceback.format_exc())
    finally:
        _faults.hook = None
    pipe.send(("done", *outcome))
    # Then whatever the test asks: "again" (the same transfer, hook off), "stop".
    while pipe.poll(CALL_TIMEOUT_S):
        command = pipe.recv()
        if command == "stop":
            break
        if command == "again":
            try:
                manager.pull_cache(CacheKey(owner_id, transfer.req_id), cache, 0)
                pipe.send(("again", "ok", [bytes(view) for view in views]))
            except LLMException as exc:
                pipe.send(("again", "failed", int(exc.status_code), str(exc)))
    datadist.finalize()
    pipe.send(("finalized",))


class FaultPeer:
    """The child process and our end of its pipe."""

    def __init__(
        self, owner_id: int, port: int, transfer: Transfer, *, sync_kv_timeout_ms: int = 20_000
    ) -> None:
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_main, args=(child, owner_id, port, transfer, sync_kv_timeout_ms), daemon=True
        )
        self.process.start()
        child.close()

    def expect(self, what: str, timeout_s: float = CALL_TIMEOUT_S) -> tuple[Any, ...]:
        if not self.pipe.poll(timeout_s):
            raise TimeoutError(f"the Decoder did not report {what!r} within {timeout_s} s")
        message = self.pipe.recv()
        assert message[0] == what, message
        return tuple(message[1:])

    def wait_stopped(self, timeout_s: float = 10.0) -> None:
        """Until the kernel says the process is stopped (it sent "at" just before stopping itself)."""
        import time

        import psutil

        deadline = time.monotonic() + timeout_s
        process = psutil.Process(self.process.pid)
        while process.status() != psutil.STATUS_STOPPED:
            if time.monotonic() > deadline:
                raise TimeoutError("the Decoder did not stop")
            time.sleep(0.005)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.resume()
                self.pipe.send("stop")
            except (OSError, BrokenPipeError):
                pass
            self.process.join(20)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self.pipe.close()


def _finalize_main(pipe: Connection, owner_id: int, port: int, transfer: Transfer) -> None:
    """The Decoder finalizes on its main thread while another thread's pull waits at `transfer.point`
    (released 0.3 s later): reports the pull's outcome and whether finalize returned only after it ended."""
    import threading
    import time

    from llm_datadist import _faults

    datadist = LLMDataDist(LLMRole.DECODER, 2)
    datadist.init(_options(transfer.v2, 20_000, False))
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = owner_id
    cluster.append_remote_ip_info("127.0.0.1", port)
    if transfer.v2:
        cluster.append_local_ip_info("127.0.0.1", 0)
    datadist.link_clusters([cluster], timeout=int(CALL_TIMEOUT_S * 1000))
    manager: Any = datadist.cache_manager if transfer.v2 else datadist.kv_cache_manager
    cache = manager.allocate_cache(CacheDesc(transfer.num_tensors, list(transfer.shape), DataType.DT_FLOAT16))
    views = _views(cache)
    reached, go = threading.Event(), threading.Event()
    ended: list[float] = []
    outcome: list[Any] = []

    def wait_at(point: str) -> None:
        if point == transfer.point:
            reached.set()
            go.wait(CALL_TIMEOUT_S)

    def pull() -> None:
        try:
            manager.pull_cache(CacheKey(owner_id, transfer.req_id), cache, 0)
            outcome.extend(("ok", [bytes(view) for view in views]))
        except LLMException as exc:
            outcome.extend(("failed", int(exc.status_code)))
        ended.append(time.monotonic())

    _faults.hook = wait_at
    worker = threading.Thread(target=pull)
    worker.start()
    assert reached.wait(CALL_TIMEOUT_S)
    threading.Timer(0.3, go.set).start()
    datadist.finalize()
    finalized = time.monotonic()
    worker.join(CALL_TIMEOUT_S)
    pipe.send(("done", *outcome, bool(ended) and ended[0] <= finalized))


def finalize_during_pull(owner_id: int, port: int, transfer: Transfer) -> tuple[Any, ...]:
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    process = ctx.Process(target=_finalize_main, args=(child, owner_id, port, transfer), daemon=True)
    process.start()
    child.close()
    try:
        if not pipe.poll(CALL_TIMEOUT_S * 2):
            raise TimeoutError("the Decoder did not report")
        message = pipe.recv()
        assert message[0] == "done", message
        return tuple(message[1:])
    finally:
        process.join(CALL_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(10)
        pipe.close()


def _pusher_main(pipe: Connection, port: int, num_tensors: int, shape: tuple[int, ...], point: str) -> None:
    """A v1 Prompt that listens at `port`, waits for the Decoder to link and send its destination addresses,
    then pushes a cache of PUSHED bytes layer by layer (`transfer_cache_async`), stopping itself at `point`
    of the first layer's push; reports the task's results."""
    from llm_datadist import LayerSynchronizer, TransferConfig, _faults

    class _Go(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return True

    datadist = LLMDataDist(LLMRole.PROMPT, 1)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = f"127.0.0.1:{port}"
    config.sync_kv_timeout = 20_000
    datadist.init(config.generate_options())
    manager = datadist.kv_cache_manager
    cache = manager.allocate_cache(CacheDesc(num_tensors, list(shape), DataType.DT_FLOAT16))
    for view in _views(cache):
        view[:] = 0x33
    pipe.send(("up",))
    if not pipe.poll(CALL_TIMEOUT_S):
        return
    addrs = pipe.recv()
    stopped = [False]

    def stop_at(reached: str) -> None:
        if reached == point and not stopped[0]:
            stopped[0] = True
            pipe.send(("at", reached))
            os.kill(os.getpid(), signal.SIGSTOP)

    _faults.hook = stop_at
    task = manager.transfer_cache_async(cache, _Go(), [TransferConfig(2, addrs)])
    task.synchronize(int(CALL_TIMEOUT_S * 1000))
    _faults.hook = None
    pipe.send(("done", [None if code is None else int(code) for code in task.get_results(1000)]))
    if pipe.poll(CALL_TIMEOUT_S):
        pipe.recv()
    datadist.finalize()


class PusherPeer(FaultPeer):
    """`_pusher_main` in a child (the FaultPeer's pipe, wait and signal helpers)."""

    def __init__(self, port: int, num_tensors: int, shape: tuple[int, ...], point: str) -> None:
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_pusher_main, args=(child, port, num_tensors, shape, point), daemon=True
        )
        self.process.start()
        child.close()
