"""Many Prompt crashes in a row leave nothing behind: after each SIGKILL the Decoder gets its error at
once and, seeing its peer dead, removes the segments and socket it left; no descriptor leaks either."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from llm_datadist import CacheDesc, CacheKey, DataType, LLMException, LLMStatusCode
from llm_datadist._shm.names import parse_segment_name
from llm_datadist.ext import tensor_views
from tests._peer import PromptPeer, decoder

CYCLES = 5


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _segments_of(pids: set[int]) -> list[str]:
    names = []
    for name in os.listdir("/dev/shm"):
        owner = parse_segment_name(name)
        if owner is not None and owner.pid in pids:
            names.append(name)
    return names


def test_prompt_crash_cycles_leak_nothing(seed: int, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    dead: set[int] = set()
    with decoder(sync_kv_timeout_ms=30000) as dd:
        kvm = dd.kv_cache_manager
        dst = kvm.allocate_cache(CacheDesc(2, [1, 4096], DataType.DT_FLOAT16))
        fds_after: list[int] = []
        for cycle in range(CYCLES):
            peer = PromptPeer(1, 21000 + cycle, seed + cycle)
            try:
                info = peer.cluster_info()
                assert dd.link_clusters([info])[0] == LLMStatusCode.LLM_SUCCESS
                cache_id = peer.alloc(2, [1, 4096], [(1, 1)])
                kvm.pull_cache(CacheKey(1, 1), dst)
                for t, view in enumerate(tensor_views(dst)):
                    np.testing.assert_array_equal(
                        view.view(np.uint8).reshape(-1), peer.expected(cache_id, t, 8192)
                    )
                peer.kill()
                dead.add(peer.pid)
                started = time.monotonic()
                with pytest.raises(LLMException) as exc_info:
                    kvm.pull_cache(CacheKey(1, 1), dst)
                assert exc_info.value.status_code in (
                    LLMStatusCode.LLM_LINK_FAILED,
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                )
                assert time.monotonic() - started < 5  # at once, not after the 30 s timeout
                # The survivor, having seen the Prompt die, already removed what it left.
                assert not _segments_of({peer.pid}), "the dead Prompt's segments are still there"
                assert not (_runtime_dir / f"127.0.0.1_{21000 + cycle}.sock").exists()
                assert dd.unlink_clusters([info])[0] == LLMStatusCode.LLM_SUCCESS
            finally:
                peer.close()
            fds_after.append(_fds())
            if cycle == 0:
                first_targets = set(_fd_targets())
        assert not _segments_of(dead)
        assert not list(_runtime_dir.glob("127.0.0.1_*.sock"))
        # The first cycle may start multiprocessing's own helper (the resource tracker) and its pipe; a
        # descriptor may also stay open for a moment after a cycle (the server thread probing the runtime
        # directory's sockets, an index mapping closed at the next housekeeping). A leak stays: one per
        # crash would leave four more after the last cycle than after the first, whatever the timing.
        settle_deadline = time.monotonic() + 10
        while _fds() > fds_after[0] and time.monotonic() < settle_deadline:
            time.sleep(0.05)
        assert _fds() <= fds_after[0], (fds_after, sorted(set(_fd_targets()) - first_targets))


def _fd_targets() -> list[str]:
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            continue
    return targets
