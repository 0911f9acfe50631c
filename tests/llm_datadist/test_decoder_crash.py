"""A Decoder killed in the middle of a layer-wise push: the Prompt's task reports the failure for that
destination, its source cache is unpinned, and the Prompt keeps serving."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection

from llm_datadist import (
    CacheDesc,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    TransferConfig,
)

P, D = 1, 2
PORT = 20700


def _decoder_main(pipe: Connection, runtime: str) -> None:
    os.environ["LLM_DATADIST_RUNTIME_DIR"] = runtime
    dd = LLMDataDist(LLMRole.DECODER, D)
    try:
        config = LLMConfig()
        config.device_id = 0
        dd.init(config.generate_options())
        info = LLMClusterInfo()
        info.remote_cluster_id = P
        info.append_remote_ip_info("127.0.0.1", PORT)
        assert dd.link_clusters([info], timeout=10000)[0] == LLMStatusCode.LLM_SUCCESS
        dst = dd.kv_cache_manager.allocate_cache(CacheDesc(4, [1, 4096], DataType.DT_FLOAT16))
        pipe.send(("ok", dst.per_device_tensor_addrs[0]))
        pipe.poll(600)  # killed while waiting here
    except Exception:
        pipe.send(("error", traceback.format_exc()))
    finally:
        dd.finalize()


class _Gate(LayerSynchronizer):
    def __init__(self) -> None:
        self.released = [threading.Event(), threading.Event()]

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return self.released[layer_index].wait(30)


def test_decoder_killed_mid_push(_runtime_dir) -> None:  # type: ignore[no-untyped-def]
    prompt = LLMDataDist(LLMRole.PROMPT, P)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = f"127.0.0.1:{PORT}"
    config.sync_kv_timeout = 20000
    prompt.init(config.generate_options())
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    decoder = ctx.Process(target=_decoder_main, args=(child, os.fspath(_runtime_dir)), daemon=True)
    decoder.start()
    child.close()
    try:
        assert pipe.poll(60)
        status, addrs = pipe.recv()
        assert status == "ok", addrs
        kvm = prompt.kv_cache_manager
        source = kvm.allocate_cache(CacheDesc(4, [1, 4096], DataType.DT_FLOAT16))
        gate = _Gate()
        task = kvm.transfer_cache_async(source, gate, [TransferConfig(D, addrs)])
        gate.released[0].set()  # layer 0 goes through (usually before the kill; either way the job
        time.sleep(0.2)  # then meets a dead Decoder)
        os.kill(decoder.pid, signal.SIGKILL)
        decoder.join(10)
        started = time.monotonic()
        gate.released[1].set()  # layer 1 meets a dead Decoder
        code = task.synchronize(30000)
        # LINK_FAILED when the push meets the closed connection, NOT_YET_LINK when the Prompt had already
        # seen the Decoder's link go: either way the dead peer is noticed, not waited for.
        gone = (LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_NOT_YET_LINK)
        assert code in gone, code
        assert time.monotonic() - started < 10
        assert task.get_results(0) == [code]
        # The Prompt, having seen its peer die, removes the segments the Decoder left (its server thread
        # does, as it drops the connection: the job may report the dead peer a moment before that).
        from llm_datadist._shm.names import parse_segment_name

        def left() -> list[str]:
            return [
                n
                for n in os.listdir("/dev/shm")
                if (o := parse_segment_name(n)) is not None and o.pid == decoder.pid
            ]

        deadline = time.monotonic() + 5
        while left() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not left(), left()
        # The source is unpinned: deallocating it frees the memory at once.
        kvm.deallocate_cache(source)
        assert prompt._require_core().leases.stats()["caches"] == 0
    finally:
        if decoder.is_alive():
            decoder.kill()
        decoder.join(10)
        pipe.close()
        prompt.finalize()
        from llm_datadist._shm.reaper import reap

        reap()
