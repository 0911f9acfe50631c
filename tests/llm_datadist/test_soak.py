"""A bounded soak: two Decoder processes pull concurrently from this (Prompt) process, with random shapes,
layer ranges and keys, while the Prompt keeps allocating and freeing. Every byte is verified, every key
is served exactly once, and at the end nothing is held: caches, keys, leases, segments, descriptors.

LLM_DATADIST_SOAK_SECONDS sets the duration (default 20 s; the long runs are `llm-datadist soak`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
import traceback
from multiprocessing.connection import Connection, wait

import numpy as np
import psutil

from llm_datadist import (
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
from llm_datadist._shm.names import parse_segment_name
from llm_datadist.ext import tensor_views

P = 1
PORT = 20500
SOAK_SECONDS = float(os.environ.get("LLM_DATADIST_SOAK_SECONDS", "20"))


def _segments_of(pids: set[int]) -> int:
    """How many /dev/shm entries this test's processes own (other sessions' come and go meanwhile)."""
    owners = (parse_segment_name(name) for name in os.listdir("/dev/shm"))
    return sum(1 for owner in owners if owner is not None and owner.pid in pids)


def _pattern(key: int, tensor: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng([key, tensor]).integers(0, 256, nbytes, dtype=np.uint8)


def _decoder_main(pipe: Connection, cluster_id: int, runtime: str) -> None:
    os.environ["LLM_DATADIST_RUNTIME_DIR"] = runtime
    dd = LLMDataDist(LLMRole.DECODER, cluster_id)
    pulled = 0
    try:
        config = LLMConfig()
        config.device_id = 0
        config.sync_kv_timeout = 10000
        dd.init(config.generate_options())
        info = LLMClusterInfo()
        info.remote_cluster_id = P
        info.append_remote_ip_info("127.0.0.1", PORT)
        assert dd.link_clusters([info], timeout=10000)[0] == LLMStatusCode.LLM_SUCCESS
        kvm = dd.kv_cache_manager
        rng = random.Random(cluster_id)
        pipe.send(("ready", None))
        while True:
            task = pipe.recv()
            if task is None:
                break
            key, layers, tokens = task
            dst = kvm.allocate_cache(CacheDesc(2 * layers, [1, tokens], DataType.DT_FLOAT16))
            if rng.random() < 0.5:
                kvm.pull_cache(CacheKey(P, key), dst)
            else:  # layer by layer, in a random order: the key goes only after the last one
                for layer in rng.sample(range(layers), layers):
                    kvm.pull_cache(
                        CacheKey(P, key),
                        dst,
                        src_layer_range=range(layer, layer + 1),
                        dst_layer_range=range(layer, layer + 1),
                    )
            for t, view in enumerate(tensor_views(dst)):
                if not np.array_equal(view.view(np.uint8).reshape(-1), _pattern(key, t, tokens * 2)):
                    raise AssertionError(f"key {key} tensor {t}: bytes differ")
            try:  # served once: a second pull must find nothing
                kvm.pull_cache(CacheKey(P, key), dst)
                raise AssertionError(f"key {key} was served twice")
            except LLMException as exc:
                if exc.status_code != LLMStatusCode.LLM_KV_CACHE_NOT_EXIST:
                    raise
            kvm.deallocate_cache(dst)
            pulled += 1
            pipe.send(("pulled", key))
        dd.unlink_clusters([info])
        pipe.send(("done", pulled))
    except Exception:
        pipe.send(("error", traceback.format_exc()))
    finally:
        dd.finalize()


def test_soak_two_decoders_one_prompt(seed: int, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    prompt = LLMDataDist(LLMRole.PROMPT, P)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = f"127.0.0.1:{PORT}"
    config.sync_kv_timeout = 10000
    prompt.init(config.generate_options())
    ctx = mp.get_context("spawn")
    decoders = []
    try:
        kvm = prompt.kv_cache_manager
        for cluster_id in (2, 3):
            parent, child = ctx.Pipe()
            process = ctx.Process(
                target=_decoder_main, args=(child, cluster_id, os.fspath(_runtime_dir)), daemon=True
            )
            process.start()
            child.close()
            decoders.append((process, parent))
        for _, pipe in decoders:
            assert pipe.poll(60)
            status, value = pipe.recv()
            assert status == "ready", value
        me = psutil.Process()
        pids = {os.getpid(), *(process.pid for process, _ in decoders)}
        outstanding: dict[int, Connection] = {}
        served: set[int] = set()
        next_key = 1
        samples: list[tuple[int, int, int]] = []
        deadline = time.monotonic() + SOAK_SECONDS
        while time.monotonic() < deadline or outstanding:
            # Keep each Decoder busy with up to two keys; the Prompt frees its handle at once, so every
            # cache lives on its key alone (the deferred free) until the Decoder has pulled it.
            for _, pipe in decoders:
                while time.monotonic() < deadline and sum(p is pipe for p in outstanding.values()) < 2:
                    layers, tokens = rng.randint(1, 4), rng.choice([16, 333, 1024, 4097])
                    key = next_key
                    next_key += 1
                    cache = kvm.allocate_cache(
                        CacheDesc(2 * layers, [1, tokens], DataType.DT_FLOAT16), [CacheKey(P, key)]
                    )
                    for t, view in enumerate(tensor_views(cache)):
                        view.view(np.uint8).reshape(-1)[:] = _pattern(key, t, tokens * 2)
                    kvm.deallocate_cache(cache)
                    outstanding[key] = pipe
                    pipe.send((key, layers, tokens))
            ready = wait([pipe for _, pipe in decoders], timeout=30)
            assert ready, "no Decoder answered within 30 s"
            for pipe in ready:
                status, value = pipe.recv()  # type: ignore[union-attr]
                assert status == "pulled", value
                assert value not in served
                served.add(value)
                del outstanding[value]
            if len(served) % 50 == 0:
                samples.append((me.memory_info().rss, me.num_fds(), _segments_of(pids)))
        for _, pipe in decoders:
            pipe.send(None)
        pulled = 0
        for process, pipe in decoders:
            assert pipe.poll(60)
            status, value = pipe.recv()
            assert status == "done", value
            pulled += value
            process.join(30)
        stats = prompt._require_core().leases.stats()
        print(f"soak: {SOAK_SECONDS:.0f} s, {pulled} pulls verified, {len(served)} keys served once, {stats}")
        assert pulled == len(served) == next_key - 1
        deadline = time.monotonic() + 10
        while prompt._require_core().leases.stats()["leases"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert prompt._require_core().leases.stats() == {
            "caches": 0,
            "keys": 0,
            "leases": 0,
            "pins": 0,
            "pool_used_nbytes": 0,
        }
        if len(samples) >= 2:
            first, last = samples[0], samples[-1]
            assert last[1] <= first[1] + 2, f"descriptors grew: {samples}"
            assert last[2] <= first[2] + 2, f"/dev/shm grew: {samples}"
            assert last[0] <= first[0] + (64 << 20), f"resident memory grew: {samples}"
    finally:
        for process, pipe in decoders:
            if process.is_alive():
                process.kill()
            process.join(10)
            pipe.close()
        prompt.finalize()
