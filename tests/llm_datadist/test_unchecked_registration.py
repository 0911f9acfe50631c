"""Registration takes what the real library takes, and a transfer over memory that is not there fails
that transfer. The vendor's own device-free test registers a DEVICE cache at address 1: it is registered
(said once in the log); each transfer of ours that touches it raises `LLMException(LLM_PARAM_INVALID)`
naming the tensor; a peer's pull of it fails. Memory a user registered and then unmapped makes a local
copy fail the same way, never a SIGSEGV (checked in a process of its own)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llm_datadist import (
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from llm_datadist.v2 import _memory
from tests._fault_peer import FaultPeer, Transfer
from tests._logs import warning_lines

_PORTS = itertools.count(1)


def _port() -> int:
    return 30000 + (os.getpid() * 19 + next(_PORTS)) % 20000


@contextlib.contextmanager
def _v2(role: LLMRole, listen: str | None = None) -> Iterator[Any]:
    datadist = LLMDataDist(role, 1)
    config = LLMConfig()
    config.device_id = 0
    if listen is not None:
        config.listen_ip_info = listen
    options = dict(config.generate_options())
    options["llm.EnableCacheManager"] = "1"
    options["llm.MemPoolConfig"] = json.dumps({"memory_size": 16 << 20, "page_shift": 16})
    datadist.init(options)
    try:
        yield datadist.cache_manager
    finally:
        datadist.finalize()


def test_memory_that_is_not_there_is_registered_and_every_local_transfer_refuses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_memory, "_said_unchecked", [False])
    with _v2(LLMRole.DECODER) as manager, warning_lines() as logs:
        desc = CacheDesc(1, [2, 4], DataType.DT_INT8, Placement.DEVICE)
        cache = manager.register_cache(desc, [1])
        assert cache.tensor_addrs == [1]
        assert sum("Registered as the real library does" in line for line in logs.lines) == 1
        manager.register_cache(CacheDesc(1, [2, 4], DataType.DT_INT8, Placement.DEVICE), [4096])
        assert sum("Registered as the real library does" in line for line in logs.lines) == 1  # once
        pool = manager.allocate_cache(desc)
        for transfer in (
            lambda: manager.copy_cache(cache, pool),
            lambda: manager.copy_cache(pool, cache),
        ):
            with pytest.raises(LLMException) as caught:
                transfer()
            assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
            assert f"cache {cache.cache_id}: tensor 0 (8 bytes at 0x1)" in str(caught.value)
        manager.deallocate_cache(pool)
        manager.unregister_cache(cache.cache_id)


def test_a_peers_pull_of_memory_that_is_not_there_fails_that_pull(seed: int) -> None:
    port = _port()
    with _v2(LLMRole.PROMPT, f"127.0.0.1:{port}") as manager:
        desc = CacheDesc(1, [1, 4096], DataType.DT_INT8, Placement.DEVICE)
        cache = manager.register_cache(desc, [1])
        puller = FaultPeer(
            1, port, Transfer(True, "pull_by_id", 1, (1, 4096), cache_id=cache.cache_id, point="")
        )
        try:
            assert puller.expect("linked", 60) == ([0],)
            outcome = puller.expect("done", 60)
            assert outcome[0] == "failed", outcome
        finally:
            puller.close()
        manager.unregister_cache(cache.cache_id)


GONE = """
import mmap, sys
import numpy as np
from llm_datadist import *
from llm_datadist.ext import tensor_views

config = LLMConfig()
config.device_id = 0
options = dict(config.generate_options())
options["llm.EnableCacheManager"] = "1"
options["llm.MemPoolConfig"] = '{"memory_size": 16777216, "page_shift": 16}'
datadist = LLMDataDist(LLMRole.DECODER, 1)
datadist.init(options)
manager = datadist.cache_manager
desc = CacheDesc(1, [16, 65536], DataType.DT_INT8, Placement.DEVICE)
region = mmap.mmap(-1, 1 << 20)
address = np.frombuffer(region, dtype=np.uint8).ctypes.data
cache = manager.register_cache(desc, [address])
pool = manager.allocate_cache(desc)
manager.copy_cache(cache, pool)  # there: fine
import ctypes
libc = ctypes.CDLL(None)
assert libc.munmap(ctypes.c_void_p(address), 1 << 20) == 0  # the user unmaps it, still registered
for direction in ("into", "out of"):
    try:
        if direction == "into":
            manager.copy_cache(cache, pool)
        else:
            manager.copy_cache(pool, cache)
        print("NO ERROR", direction)
    except LLMException as exc:
        print("REFUSED", direction, exc.status_code.name, str(exc))
datadist.finalize()
print("ENDED")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="munmap")
def test_memory_unmapped_after_registration_fails_the_copy_not_the_process(tmp_path: Path) -> None:
    script = tmp_path / "gone.py"
    script.write_text(textwrap.dedent(GONE))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "ENDED" in lines
    refused = [line for line in lines if line.startswith("REFUSED")]
    assert len(refused) == 2, result.stdout
    assert all("LLM_PARAM_INVALID" in line and "tensor 0" in line for line in refused), result.stdout
