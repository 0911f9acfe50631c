"""The peers in `llm-datadist bench`: NIXL (UCX backend) and Mooncake Transfer Engine (TCP, its only transport
without RDMA), measured doing what our one-sided pull does: a synchronous READ of registered memory that one
spawned process allocated, into registered memory of another, for the same sizes as our one-sided rows.

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
from multiprocessing.connection import Connection
from typing import Any, Protocol

import numpy as np

from ._bench_proc import Child, timed

SIZES = (64 << 10, 1 << 20, 16 << 20)
_FILL = 0x5A
_WAIT_S = 60.0  # owner start-up, and the longest a single transfer may take


class _Recorder(Protocol):
    def add(self, group: str, name: str, nbytes: int, seconds: list[float], **extra: Any) -> None: ...
    def skip(self, group: str, name: str, reason: str) -> None: ...


# ================================================================= the two processes of each peer
#
# Both sides run in spawned processes that leave with os._exit: NIXL 1.5 crashes in its destructors when a
# process that created an agent exits normally, and a bench must not die of it. Timing happens in the reader.


def _nixl_owner(pipe: Connection, nbytes: int) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    # The owner keeps NIXL's progress thread (UCX's connection set-up needs it); the reader does without it,
    # NIXL's best configuration on two cores (its busy-polling threads otherwise take turns on the CPUs).
    agent = nixl_agent("llmdd-bench-owner", nixl_agent_config())
    buffer = np.full(nbytes, _FILL, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(buffer.ctypes.data, nbytes, 0, "")], "DRAM"))
    pipe.send(("ok", (agent.get_agent_metadata(), buffer.ctypes.data)))
    pipe.poll(3600)  # until told to stop (or the bench went away)


def _nixl_reader(info: Any, repeats: list[int]) -> list[tuple[int, list[float]]]:
    from nixl._api import nixl_agent, nixl_agent_config

    metadata, remote_addr = info
    agent = nixl_agent("llmdd-bench-reader", nixl_agent_config(enable_prog_thread=False))
    local = np.zeros(max(SIZES), dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(local.ctypes.data, local.nbytes, 0, "")], "DRAM"))
    remote_name = agent.add_remote_agent(metadata)
    measured = []
    for nbytes, count in zip(SIZES, repeats, strict=True):
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs([(local.ctypes.data, nbytes, 0)], "DRAM"),
            agent.get_xfer_descs([(remote_addr, nbytes, 0)], "DRAM"),
            remote_name,
        )

        def read(handle: Any = handle) -> None:
            deadline = time.monotonic() + _WAIT_S
            state = agent.transfer(handle)
            while state != "DONE":  # NIXL's synchronous use: post, then poll the handle
                if state == "ERR" or time.monotonic() > deadline:
                    raise RuntimeError(f"NIXL transfer ended in state {state}")
                state = agent.check_xfer_state(handle)

        measured.append((nbytes, _checked(read, local, nbytes, count)))
        agent.release_xfer_handle(handle)
    return measured


def _mooncake_owner(pipe: Connection, nbytes: int) -> None:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("TransferEngine.initialize failed")
    buffer = np.full(nbytes, _FILL, dtype=np.uint8)
    if engine.register_memory(buffer.ctypes.data, nbytes) != 0:
        raise RuntimeError("TransferEngine.register_memory failed")
    pipe.send(("ok", (f"127.0.0.1:{engine.get_rpc_port()}", buffer.ctypes.data)))
    pipe.poll(3600)


def _mooncake_reader(info: Any, repeats: list[int]) -> list[tuple[int, list[float]]]:
    from mooncake.engine import TransferEngine

    session, remote_addr = info
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("TransferEngine.initialize failed")
    local = np.zeros(max(SIZES), dtype=np.uint8)
    if engine.register_memory(local.ctypes.data, local.nbytes) != 0:
        raise RuntimeError("TransferEngine.register_memory failed")
    measured = []
    for nbytes, count in zip(SIZES, repeats, strict=True):

        def read(nbytes: int = nbytes) -> None:
            if engine.transfer_sync_read(session, local.ctypes.data, remote_addr, nbytes) != 0:
                raise RuntimeError("Mooncake transfer_sync_read failed")

        measured.append((nbytes, _checked(read, local, nbytes, count)))
    return measured


def _checked(read: Callable[[], None], local: np.ndarray, nbytes: int, repeats: int) -> list[float]:
    """Check that one read brings the owner's bytes, then time `repeats` more."""
    local[:nbytes] = 0
    read()
    if not (local[:nbytes] == _FILL).all():
        raise RuntimeError("the READ returned other bytes than the owner's")
    return timed(read, repeats)


_OWNERS: dict[str, Callable[[Connection, int], None]] = {"nixl": _nixl_owner, "mooncake": _mooncake_owner}
_READERS: dict[str, Callable[[Any, list[int]], list[tuple[int, list[float]]]]] = {
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


def _owner_main(pipe: Connection, peer: str, nbytes: int) -> None:
    _quiet()
    try:
        _OWNERS[peer](pipe, nbytes)
    except Exception:
        with contextlib.suppress(OSError):
            pipe.send(("error", traceback.format_exc(limit=3)))
    finally:
        os._exit(0)


def _reader_main(pipe: Connection, peer: str, info: Any, repeats: list[int]) -> None:
    _quiet()
    try:
        pipe.send(("ok", _READERS[peer](info, repeats)))
    except Exception:
        with contextlib.suppress(OSError):
            pipe.send(("error", traceback.format_exc(limit=3)))
    finally:
        os._exit(0)


def _measure(peer: str, repeats: list[int]) -> list[tuple[int, list[float]]]:
    owner = Child(_owner_main, peer, max(SIZES))
    try:
        info = owner.reply(_WAIT_S)
        reader = Child(_reader_main, peer, info, repeats)
        try:
            measured: list[tuple[int, list[float]]] = reader.reply(_WAIT_S * (1 + len(SIZES)))
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


def run(results: _Recorder, repeats: Callable[[int], int]) -> None:
    """Measure every installed peer; a row saying why for each one that is not installed or fails here."""
    for label, module, hint, peer in PEERS:
        try:
            __import__(module)
        except Exception as exc:
            results.skip("peer", label, f"not installed ({type(exc).__name__}); {hint}")
            continue
        version = _version(module.split(".")[0])
        transport = "UCX, no reader thread" if label == "NIXL" else "TCP"
        name = f"{label} {version} READ ({transport})"
        try:
            measured = _measure(peer, [repeats(nbytes) for nbytes in SIZES])
        except Exception as exc:
            last_line = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
            results.skip("peer", label, f"installed, but failed here: {type(exc).__name__}: {last_line}")
            continue
        for nbytes, samples in measured:
            results.add("peer", name, nbytes, samples)


def _version(module: str) -> str:
    from importlib import metadata

    for distribution in (module, f"{module}-cu12", "mooncake-transfer-engine-non-cuda"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(distribution)
    return "?"
