"""The peers in `llm-datadist bench`: NIXL (UCX backend) and Mooncake Transfer Engine (TCP, its only transport
without RDMA), measured doing what our pulls do: a synchronous READ of registered memory that one spawned
process allocated, into registered memory of another, for the same sizes as our one-sided rows; and the
scattered-block pattern of our `pull_blocks` rows (`proc.BlockPattern`), as ONE descriptor list per read
(one transfer request: one `initialize_xfer` for NIXL, one `batch_transfer_sync_read` for Mooncake).

Rules: a peer that is not installed, or fails to start here, is a skipped row with the reason, never a failed
bench; every wait is bounded; both processes are stopped and reaped; the bytes of one READ are checked
before the timed ones.
Install both with `pip install 'llm-datadist-host[peers]'` (NIXL pulls in about 3 GB of CUDA libraries;
Mooncake needs Debian's `libibverbs1` even for TCP).
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable
from importlib import metadata, util
from multiprocessing.connection import Connection
from typing import Any, Protocol

import numpy as np

from llm_datadist._tools.patterns import unit_bytes

from .proc import BlockPattern, Child, timed

SIZES = (64 << 10, 1 << 20, 16 << 20)
_FILL = 0x5A
_CHUNK = 16 << 10  # the pool's fill pattern changes every 16 KiB: a block read from the wrong place shows
_WAIT_S = 60.0  # owner start-up, and the longest a single transfer may take


class _Recorder(Protocol):
    def add(self, group: str, name: str, nbytes: int, seconds: list[float], **extra: Any) -> None: ...
    def skip(self, group: str, name: str, reason: str, **extra: Any) -> None: ...


# What a reader sends back: the one-sided reads as (nbytes, samples); the block patterns as (block_nbytes,
# requests per read, samples or the reason that pattern failed here). Requests is 1 (the one descriptor
# list) except for Mooncake's split rows (`_MOONCAKE_SPLIT_NBYTES`).
Blocks = list[tuple[int, int, list[float] | str]]
Measured = tuple[list[tuple[int, list[float]]], Blocks]
# Mooncake 0.3.13's TCP transport fails (-1, "failed to read READ status frame") on one batch of a few
# thousand descriptors or of 64 MiB (2048 x 16 KiB passed here, 3000 x 4 KiB and 1024 x 64 KiB did not);
# a failed batch also breaks the following ones. So each pattern is read first as consecutive batches of at
# most this many bytes (a row of its own), then as the one list.
_MOONCAKE_SPLIT_NBYTES = 16 << 20


# ================================================================= the two processes of each peer
#
# Both sides run in spawned processes that leave with os._exit: NIXL 1.5 crashes in its destructors when a
# process that created an agent exits normally, and a bench must not die of it. Timing happens in the reader.
# The owner holds two registered buffers: `max(SIZES)` bytes of _FILL for the one-sided reads, and a pool
# large enough for every block pattern, filled with `_pool_fill`.


def _pool_nbytes(patterns: list[BlockPattern]) -> int:
    return max((p.tensors * p.tensor_nbytes for p in patterns), default=0)


def _pool_fill(pool: np.ndarray[Any, Any]) -> None:
    """Chunk c (16 KiB) of the pool holds the byte `unit_bytes(c)`: writes every page once (prefaulted)."""
    chunks = pool.reshape(-1, _CHUNK)
    chunks[:] = unit_bytes(np.arange(len(chunks)))[:, None]


def _descs(pattern: BlockPattern, local_addr: int, remote_addr: int) -> tuple[list[int], list[int]]:
    """The pattern as a user hands it to a peer: one (local, remote) address pair per block per tensor."""
    local, remote = [], []
    for tensor in range(pattern.tensors):
        base = tensor * pattern.tensor_nbytes
        for src, dst in zip(pattern.src_blocks, pattern.dst_blocks, strict=True):
            local.append(local_addr + base + dst * pattern.block_nbytes)
            remote.append(remote_addr + base + src * pattern.block_nbytes)
    return local, remote


def _check_blocks(pool: np.ndarray[Any, Any], pattern: BlockPattern) -> None:
    """Every destination block of every tensor holds its source block's bytes (see `_pool_fill`)."""
    per_block = pattern.block_nbytes // _CHUNK
    src = np.asarray(pattern.src_blocks, dtype=np.int64)
    dst = np.asarray(pattern.dst_blocks, dtype=np.int64)
    for tensor in range(pattern.tensors):
        base = tensor * pattern.tensor_nbytes
        region = pool[base : base + pattern.tensor_nbytes].reshape(pattern.pool_blocks, per_block, _CHUNK)
        chunks = base // _CHUNK + (src[:, None] * per_block + np.arange(per_block)[None, :])
        expected = unit_bytes(chunks)
        if not (region[dst] == expected[..., None]).all():
            raise RuntimeError(f"the block READ returned other bytes than the owner's (tensor {tensor})")


def _nixl_owner(pipe: Connection, nbytes: int, pool_nbytes: int) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    # The owner keeps NIXL's progress thread (UCX's connection set-up needs it); the reader does without it,
    # NIXL's best configuration on two cores (its busy-polling threads otherwise take turns on the CPUs).
    agent = nixl_agent("llmdd-bench-owner", nixl_agent_config())
    buffer = np.full(nbytes, _FILL, dtype=np.uint8)
    pool = np.empty(max(pool_nbytes, _CHUNK), dtype=np.uint8)
    _pool_fill(pool)
    regions = [(buffer.ctypes.data, buffer.nbytes, 0, ""), (pool.ctypes.data, pool.nbytes, 0, "")]
    agent.register_memory(agent.get_reg_descs(regions, "DRAM"))
    pipe.send(("ok", (agent.get_agent_metadata(), buffer.ctypes.data, pool.ctypes.data)))
    pipe.poll(3600)  # until told to stop (or the bench went away)


def _nixl_reader(
    info: Any, repeats: list[int], patterns: list[BlockPattern], block_repeats: list[int]
) -> Measured:
    from nixl._api import nixl_agent, nixl_agent_config

    metadata, remote_addr, remote_pool = info
    agent = nixl_agent("llmdd-bench-reader", nixl_agent_config(enable_prog_thread=False))
    local = np.zeros(max(SIZES), dtype=np.uint8)
    pool = np.zeros(max(_pool_nbytes(patterns), _CHUNK), dtype=np.uint8)
    regions = [(local.ctypes.data, local.nbytes, 0, ""), (pool.ctypes.data, pool.nbytes, 0, "")]
    agent.register_memory(agent.get_reg_descs(regions, "DRAM"))
    remote_name = agent.add_remote_agent(metadata)

    def reader(local_descs: list[tuple[int, int, int]], remote_descs: list[tuple[int, int, int]]) -> Any:
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local_descs, "DRAM"),
            agent.get_xfer_descs(remote_descs, "DRAM"),
            remote_name,
        )

        def read() -> None:
            deadline = time.monotonic() + _WAIT_S
            state = agent.transfer(handle)
            while state != "DONE":  # NIXL's synchronous use: post, then poll the handle
                if state == "ERR" or time.monotonic() > deadline:
                    raise RuntimeError(f"NIXL transfer ended in state {state}")
                state = agent.check_xfer_state(handle)

        return handle, read

    measured = []
    for nbytes, count in zip(SIZES, repeats, strict=True):
        handle, read = reader([(local.ctypes.data, nbytes, 0)], [(remote_addr, nbytes, 0)])
        measured.append((nbytes, _checked(read, local, nbytes, count)))
        agent.release_xfer_handle(handle)
    blocks: Blocks = []
    for pattern, count in zip(patterns, block_repeats, strict=True):
        try:
            mine, theirs = _descs(pattern, pool.ctypes.data, remote_pool)
            size = pattern.block_nbytes
            handle, read = reader([(a, size, 0) for a in mine], [(a, size, 0) for a in theirs])
            blocks.append((pattern.block_nbytes, 1, _checked_blocks(read, pool, pattern, count)))
            agent.release_xfer_handle(handle)
        except Exception as exc:
            blocks.append((pattern.block_nbytes, 1, _reason(exc)))
    return measured, blocks


def _mooncake_owner(pipe: Connection, nbytes: int, pool_nbytes: int) -> None:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("TransferEngine.initialize failed")
    buffer = np.full(nbytes, _FILL, dtype=np.uint8)
    pool = np.empty(max(pool_nbytes, _CHUNK), dtype=np.uint8)
    _pool_fill(pool)
    for array in (buffer, pool):
        if engine.register_memory(array.ctypes.data, array.nbytes) != 0:
            raise RuntimeError("TransferEngine.register_memory failed")
    pipe.send(("ok", (f"127.0.0.1:{engine.get_rpc_port()}", buffer.ctypes.data, pool.ctypes.data)))
    pipe.poll(3600)


def _mooncake_reader(
    info: Any, repeats: list[int], patterns: list[BlockPattern], block_repeats: list[int]
) -> Measured:
    from mooncake.engine import TransferEngine

    session, remote_addr, remote_pool = info
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("TransferEngine.initialize failed")
    local = np.zeros(max(SIZES), dtype=np.uint8)
    pool = np.zeros(max(_pool_nbytes(patterns), _CHUNK), dtype=np.uint8)
    for array in (local, pool):
        if engine.register_memory(array.ctypes.data, array.nbytes) != 0:
            raise RuntimeError("TransferEngine.register_memory failed")
    measured = []
    for nbytes, count in zip(SIZES, repeats, strict=True):

        def read(nbytes: int = nbytes) -> None:
            if engine.transfer_sync_read(session, local.ctypes.data, remote_addr, nbytes) != 0:
                raise RuntimeError("Mooncake transfer_sync_read failed")

        measured.append((nbytes, _checked(read, local, nbytes, count)))
    blocks: Blocks = []
    for pattern, count in zip(patterns, block_repeats, strict=True):
        mine, theirs = _descs(pattern, pool.ctypes.data, remote_pool)
        whole = len(mine)
        split = max(1, _MOONCAKE_SPLIT_NBYTES // pattern.block_nbytes)
        for per_request in (split, whole) if split < whole else (whole,):

            def read_blocks(
                per_request: int = per_request,
                mine: list[int] = mine,
                theirs: list[int] = theirs,
                block_nbytes: int = pattern.block_nbytes,
            ) -> None:
                for first in range(0, len(mine), per_request):
                    last = min(first + per_request, len(mine))
                    lengths = [block_nbytes] * (last - first)
                    code = engine.batch_transfer_sync_read(
                        session, mine[first:last], theirs[first:last], lengths
                    )
                    if code != 0:
                        raise RuntimeError(
                            f"batch_transfer_sync_read of {last - first} descriptors "
                            f"({(last - first) * block_nbytes >> 20} MiB) returned {code}"
                        )

            requests = -(-whole // per_request)
            try:
                blocks.append(
                    (pattern.block_nbytes, requests, _checked_blocks(read_blocks, pool, pattern, count))
                )
            except Exception as exc:
                blocks.append((pattern.block_nbytes, requests, _reason(exc)))
    return measured, blocks


def _checked(read: Callable[[], None], local: np.ndarray[Any, Any], nbytes: int, repeats: int) -> list[float]:
    """Check that one read brings the owner's bytes, then time `repeats` more."""
    local[:nbytes] = 0
    read()
    if not (local[:nbytes] == _FILL).all():
        raise RuntimeError("the READ returned other bytes than the owner's")
    return timed(read, repeats)


def _checked_blocks(
    read: Callable[[], None], pool: np.ndarray[Any, Any], pattern: BlockPattern, repeats: int
) -> list[float]:
    """Check that one read of the pattern brings the owner's blocks to their places, then time `repeats`."""
    pool[:] = 0
    read()
    _check_blocks(pool, pattern)
    return timed(read, repeats)


def _reason(exc: BaseException) -> str:
    last_line = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
    return f"installed, but failed here: {type(exc).__name__}: {last_line}"


_OWNERS: dict[str, Callable[[Connection, int, int], None]] = {
    "nixl": _nixl_owner,
    "mooncake": _mooncake_owner,
}
_READERS: dict[str, Callable[[Any, list[int], list[BlockPattern], list[int]], Measured]] = {
    "nixl": _nixl_reader,
    "mooncake": _mooncake_reader,
}


def _quiet() -> None:
    """Keep the peers' logs (NIXL and glog print informational lines from C++) out of the bench's table:
    this process's stdout and stderr go to /dev/null. A failure still reaches the bench, through the pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)


def quietly(target: Callable[..., object], *args: Any) -> None:
    """`target(*args)` with this process's stdout and stderr on /dev/null (`_quiet`): a spawned child's
    target, for children whose C++ engines log and which report failures through their pipe."""
    _quiet()
    target(*args)


def _owner_main(pipe: Connection, peer: str, nbytes: int, pool_nbytes: int) -> None:
    _quiet()
    try:
        _OWNERS[peer](pipe, nbytes, pool_nbytes)
    except Exception:
        with contextlib.suppress(OSError):
            pipe.send(("error", traceback.format_exc(limit=3)))
    finally:
        os._exit(0)


def _reader_main(
    pipe: Connection,
    peer: str,
    info: Any,
    repeats: list[int],
    patterns: list[BlockPattern],
    block_repeats: list[int],
) -> None:
    _quiet()
    try:
        pipe.send(("ok", _READERS[peer](info, repeats, patterns, block_repeats)))
    except Exception:
        with contextlib.suppress(OSError):
            pipe.send(("error", traceback.format_exc(limit=3)))
    finally:
        os._exit(0)


def _measure(
    peer: str, repeats: list[int], patterns: list[BlockPattern], block_repeats: list[int]
) -> Measured:
    owner = Child(_owner_main, peer, max(SIZES), _pool_nbytes(patterns))
    try:
        info = owner.reply(_WAIT_S)
        reader = Child(_reader_main, peer, info, repeats, patterns, block_repeats)
        try:
            measured: Measured = reader.reply(_WAIT_S * (1 + len(SIZES) + len(patterns)))
            return measured
        finally:
            reader.close()
    finally:
        owner.close()


PEERS: tuple[tuple[str, str, str, str], ...] = (
    ("NIXL", "nixl", "pip install nixl (pulls in about 3 GB of CUDA libraries)", "nixl"),
    (
        "Mooncake Transfer Engine",
        "mooncake.engine",
        "pip install mooncake-transfer-engine-non-cuda; apt install libibverbs1",
        "mooncake",
    ),
)
_SHORT = {"nixl": "NIXL", "mooncake": "Mooncake TE"}


def run(
    results: _Recorder, repeats: Callable[[int], int], patterns: list[BlockPattern] | None = None
) -> None:
    """Measure every installed peer; a row saying why for each one that is not installed or fails here.
    One-sided reads go to group "peer" (id `peer.<peer>.<nbytes>`), the block patterns to group "blocks"
    (id `blocks.<peer>.<block_nbytes>`), beside our `pull_blocks` rows of the same patterns."""
    patterns = patterns or []
    for label, module, hint, peer in PEERS:
        try:
            __import__(module)
        except Exception as exc:
            # Installed but unloadable (Mooncake without libibverbs, say) is not "not installed".
            installed = util.find_spec(module.split(".")[0]) is not None
            reason = f"{_reason(exc) if installed else f'not installed ({type(exc).__name__})'}; {hint}"
            results.skip("peer", label, reason, id=f"peer.{peer}")
            for pattern in patterns:
                results.skip(
                    "blocks", _blocks_name(_SHORT[peer], pattern), reason, id=_block_id(peer, pattern)
                )
            continue
        version = _version(module.split(".")[0])
        transport = "UCX, no reader thread" if label == "NIXL" else "TCP"
        name = f"{label} {version} READ ({transport})"
        try:
            one_sided, blocks = _measure(
                peer,
                [repeats(nbytes) for nbytes in SIZES],
                patterns,
                [repeats(pattern.nbytes) for pattern in patterns],
            )
        except Exception as exc:
            results.skip("peer", label, _reason(exc), id=f"peer.{peer}")
            for pattern in patterns:
                results.skip(
                    "blocks", _blocks_name(_SHORT[peer], pattern), _reason(exc), id=_block_id(peer, pattern)
                )
            continue
        for nbytes, samples in one_sided:
            results.add("peer", name, nbytes, samples, id=f"peer.{peer}.{nbytes}")
        by_size = {p.block_nbytes: p for p in patterns}
        for block_nbytes, requests, outcome in blocks:
            pattern = by_size[block_nbytes]
            block_name = _blocks_name(f"{_SHORT[peer]} {version}", pattern, requests)
            extra = {"id": _block_id(peer, pattern, requests), "block_nbytes": block_nbytes}
            if isinstance(outcome, str):
                results.skip("blocks", block_name, outcome, **extra)
            else:
                results.add("blocks", block_name, pattern.nbytes, outcome, **extra)


def _blocks_name(label: str, pattern: BlockPattern, requests: int = 1) -> str:
    count = pattern.tensors * pattern.table
    lists = "1 list" if requests == 1 else f"{requests} lists"
    return f"{label} READ, {lists} of {count} x {pattern.block_nbytes >> 10} KiB"


def _block_id(peer: str, pattern: BlockPattern, requests: int = 1) -> str:
    """`blocks.<peer>.<block_nbytes>` for the one descriptor list; `.split` appended for a fallback."""
    return f"blocks.{peer}.{pattern.block_nbytes}" + ("" if requests == 1 else ".split")


def _version(module: str) -> str:
    for distribution in (module, f"{module}-cu12", "mooncake-transfer-engine-non-cuda"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(distribution)
    return "?"
