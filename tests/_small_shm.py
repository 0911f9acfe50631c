"""Programs that run with a small /dev/shm: a fresh tmpfs mounted over it in a private mount namespace
(`unshare -m`, as root), so a test can fill it without touching the machine's. `run_in_small_shm` runs a
command there and reports what /dev/shm held once the command ended; `python -m tests._small_shm <case>`
runs one of the cases below in it and prints its findings as one JSON line after RESULT.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
AFTER = "SHM-AFTER:"
RESULT = "RESULT "
MIB = 1 << 20


@functools.cache
def small_shm_unavailable() -> str | None:
    """Why a tmpfs cannot be mounted over /dev/shm in a private mount namespace here (None: it can)."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "a small /dev/shm needs unshare and mount (util-linux), not installed here"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if probe.returncode != 0:
        why = (probe.stderr or probe.stdout).strip() or f"exit code {probe.returncode}"
        return (
            f"a small /dev/shm needs root to mount a tmpfs in a private mount namespace (unshare -m): {why}"
        )
    return None


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str  # the command's, without the listing of /dev/shm
    stderr: str
    left: list[str]  # what /dev/shm held once the command ended

    @property
    def result(self) -> dict[str, Any]:
        line = next(line for line in self.stdout.splitlines() if line.startswith(RESULT))
        value: dict[str, Any] = json.loads(line[len(RESULT) :])
        return value


def run_in_small_shm(argv: list[str], size: str = "64m", timeout_s: float = 300) -> Outcome:
    """Run `argv` with a fresh tmpfs of `size` on /dev/shm (in a mount namespace of its own, from the
    repository's root), then list what is left there."""
    script = (
        f'mount -t tmpfs -o size={size} tmpfs /dev/shm || exit 99; "$@"; code=$?; '
        f"echo {AFTER}; ls -A /dev/shm; exit $code"
    )
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode != 99, f"could not mount the tmpfs: {done.stderr}"
    stdout, _, listing = done.stdout.rpartition(AFTER + "\n")
    return Outcome(done.returncode, stdout, done.stderr, listing.split())


def run_case(case: str, size: str = "64m") -> Outcome:
    return run_in_small_shm([sys.executable, "-m", "tests._small_shm", case], size)


# ------------------------------------------------------------------------------ the cases (in the namespace)


def _free_nbytes() -> int:
    info = os.statvfs("/dev/shm")
    return info.f_bavail * info.f_frsize


def _used_nbytes() -> int:
    info = os.statvfs("/dev/shm")
    return (info.f_blocks - info.f_bfree) * info.f_frsize


def case_v1() -> dict[str, Any]:
    """A v1 Prompt allocates 96 MiB (more than the 64 MiB there), then 8 MiB, and finalizes."""
    from llm_datadist import CacheDesc, CacheKey, DataType, LLMConfig, LLMDataDist, LLMException, LLMRole

    datadist = LLMDataDist(LLMRole.PROMPT, 1)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = "127.0.0.1:26901"
    datadist.init(config.generate_options())
    manager = datadist.kv_cache_manager
    found: dict[str, Any] = {}
    try:
        manager.allocate_cache(CacheDesc(2, [1, 48 * MIB], DataType.DT_UINT8), [CacheKey(1, 1)])
        found["raised"] = False
    except LLMException as exc:
        found.update(raised=True, code=int(exc.status_code), message=str(exc), free_nbytes=_free_nbytes())
    cache = manager.allocate_cache(CacheDesc(2, [1, 4 * MIB], DataType.DT_UINT8), [CacheKey(1, 2)])
    found["then_8_mib"] = True
    manager.deallocate_cache(cache)
    datadist.finalize()
    return found


def case_v2() -> dict[str, Any]:
    """A v2 instance whose device pool (96 MiB) is larger than /dev/shm allocates 80 MiB from it."""
    from llm_datadist import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMException, LLMRole

    datadist = LLMDataDist(LLMRole.DECODER, 2)
    config = LLMConfig()
    config.device_id = 0
    options = dict(config.generate_options())
    options.update(
        {
            "llm.EnableCacheManager": "1",
            "llm.EnableRemoteCacheAccessible": "1",
            "llm.MemPoolConfig": json.dumps({"memory_size": 96 * MIB, "page_shift": 16}),
        }
    )
    datadist.init(options)
    found: dict[str, Any] = {}
    try:
        datadist.cache_manager.allocate_cache(CacheDesc(1, [1, 80 * MIB], DataType.DT_UINT8))
        found["raised"] = False
    except LLMException as exc:
        found.update(raised=True, code=int(exc.status_code), message=str(exc), free_nbytes=_free_nbytes())
    datadist.finalize()
    return found


def case_populate() -> dict[str, Any]:
    """Without the check (as when another process fills /dev/shm between it and the population), a pool's
    population fails part way: the pages it did populate are given back before the error says what is free.
    And a prefaulted Segment.create larger than /dev/shm is refused by its check, creating nothing."""
    from llm_datadist._shm import pool as pool_module
    from llm_datadist._shm.errors import SharedMemoryExhausted
    from llm_datadist._shm.pool import Pool
    from llm_datadist._shm.segment import Segment

    found: dict[str, Any] = {}
    pool_module.check_space = lambda needed_nbytes, what: None  # type: ignore[assignment]
    pool = Pool(capacity_nbytes=128 * MIB)
    try:
        pool.allocate(96 * MIB)
        found["raised"] = False
    except SharedMemoryExhausted as exc:
        found.update(raised=True, error=exc.error, message=str(exc), used_after=_used_nbytes())
        found.update(needed=exc.needed_nbytes, free=exc.free_nbytes, free_now=_free_nbytes())
    block = pool.allocate(48 * MIB)  # fits only if the failed attempt's pages were given back
    found["then_48_mib"] = block.nbytes
    pool.free(block)
    pool.close()
    try:
        Segment.create(96 * MIB)
        found["create_raised"] = False
    except SharedMemoryExhausted as exc:
        found.update(create_raised=True, create_error=exc.error, create_message=str(exc))
    found["entries_after_create"] = os.listdir("/dev/shm")
    return found


def case_attach() -> dict[str, Any]:
    """A peer mapping a pool's sparse segment (64 MiB, 4 MiB of it used) adds no pages to /dev/shm."""
    from llm_datadist._shm.segment import Segment

    owner = Segment.create(56 * MIB, prefault=False)
    owner.prefault(0, 4 * MIB)
    owner.array[: 4 * MIB] = 7
    before = _used_nbytes()
    reader = Segment.attach(owner.name)
    after_read = _used_nbytes()
    writer = Segment.attach(owner.name, writable=True)
    after_write = _used_nbytes()
    same = bool((reader.array[: 4 * MIB] == 7).all())
    reader.close()
    writer.close()
    owner.close()
    return {"before": before, "after_read": after_read, "after_write": after_write, "same": same}


def case_index() -> dict[str, Any]:
    """A v1 Prompt's init where /dev/shm cannot back even its published index (2 MiB of tmpfs)."""
    from llm_datadist import LLMConfig, LLMDataDist, LLMException, LLMRole

    datadist = LLMDataDist(LLMRole.PROMPT, 1)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = "127.0.0.1:26902"
    try:
        datadist.init(config.generate_options())
    except LLMException as exc:
        return {"raised": True, "code": int(exc.status_code), "message": str(exc)}
    datadist.finalize()
    return {"raised": False}


def case_shared_arrays() -> dict[str, Any]:
    """ext.shared_arrays of 96 MiB (more than the 64 MiB there), then of 8 MiB."""
    from llm_datadist import LLMException
    from llm_datadist.ext import shared_arrays

    found: dict[str, Any] = {"raised": False}
    try:
        shared_arrays(4, 24 * MIB, "uint8")
    except LLMException as exc:
        found = {"raised": True, "code": int(exc.status_code), "message": str(exc)}
    found["then_8_mib"] = sum(a.nbytes for a in shared_arrays(2, 4 * MIB, "uint8"))
    return found


if __name__ == "__main__":
    cases = {
        "shared_arrays": case_shared_arrays,
        "v1": case_v1,
        "v2": case_v2,
        "populate": case_populate,
        "attach": case_attach,
        "index": case_index,
    }
    outcome = cases[sys.argv[1]]()
    print(RESULT + json.dumps(outcome), flush=True)
