"""A second HIXL engine in a spawned process, driven over a pipe: the tests' remote engine. Its memory is
ctypes buffers it allocates and fills with `pattern`; any `Hixl` method can be called on it by name.
Every wait has a timeout and the process is always reaped (SIGKILL as the last resort)."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import psutil

import hixl
from llm_datadist.ext import shared_arrays

CALL_TIMEOUT_S = 30.0


def pattern(seed: int, nbytes: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


class Buffers:
    """ctypes buffers, kept alive by address."""

    def __init__(self) -> None:
        self._buffers: dict[int, Any] = {}

    def alloc(self, nbytes: int, seed: int | None = None, library: bool = False) -> int:
        """`nbytes` of private memory, or the library's (`ext.shared_arrays`), filled with pattern(seed)."""
        buffer: Any = (
            shared_arrays(1, nbytes, np.uint8)[0] if library else ctypes.create_string_buffer(nbytes)
        )
        addr = int(buffer.ctypes.data) if library else ctypes.addressof(buffer)
        if seed is not None:
            ctypes.memmove(addr, pattern(seed, nbytes), nbytes)
        self._buffers[addr] = buffer
        return addr

    @staticmethod
    def read(addr: int, nbytes: int) -> bytes:
        return ctypes.string_at(addr, nbytes)

    @staticmethod
    def write(addr: int, data: bytes) -> None:
        ctypes.memmove(addr, data, len(data))


def _plain(value: Any) -> Any:
    """What crosses the pipe: enums as their numbers, value classes as tuples."""
    if isinstance(value, tuple | list):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, hixl.TransferStatus | hixl.AsyncConnectStatus):
        return int(value)
    if isinstance(value, hixl.NotifyDesc):
        return (value.name, value.notify_msg)
    if isinstance(value, hixl.TransferResult):
        return (value.req, value.user_data, int(value.status))
    return value


def _args(method: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Rebuild what a test spelled plainly: ops and descriptors of transfers, notifies, memory types."""
    if method in ("transfer_sync", "transfer_async"):
        remote, op, descs, *rest = args
        ops = [hixl.TransferOpDesc(*d) for d in descs]
        return (remote, hixl.TransferOp(op), ops, *rest)
    if method == "send_notify":
        remote, (name, message), *rest = args
        return (remote, hixl.NotifyDesc(name, message), *rest)
    if method == "register_mem":
        (addr, nbytes, *local_only), mem_type = args
        desc = hixl.MemDesc(addr, nbytes)
        desc.local_only = bool(local_only and local_only[0])
        return (desc, hixl.MemType(mem_type))
    return args


def _main(pipe: Connection) -> None:
    engine = hixl.Hixl()
    buffers = Buffers()
    pipe.send(("ok", os.getpid()))
    while True:
        try:
            command, args = pipe.recv()
        except EOFError:
            break
        try:
            if command == "stop":
                engine.finalize()
                pipe.send(("ok", None))
                break
            if command == "alloc":
                result: Any = buffers.alloc(*args)
            elif command == "read":
                result = buffers.read(*args)
            elif command == "write":
                buffers.write(*args)
                result = None
            else:
                result = _plain(getattr(engine, command)(*_args(command, args)))
            pipe.send(("ok", result))
        except Exception:
            pipe.send(("err", traceback.format_exc()))


class Peer:
    """The test's handle on the remote engine's process."""

    def __init__(self, process: Any, pipe: Connection, pid: int) -> None:
        self.process = process
        self.pipe = pipe
        self.pid = pid

    def __call__(self, command: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        self.pipe.send((command, args))
        if not self.pipe.poll(timeout_s):
            raise TimeoutError(f"the peer did not answer {command} within {timeout_s} s")
        status, result = self.pipe.recv()
        if status != "ok":
            raise RuntimeError(f"the peer failed {command}:\n{result}")
        return result

    def stop(self) -> None:
        with contextlib.suppress(OSError, EOFError, TimeoutError, RuntimeError):
            if self.process.is_alive():
                self("stop", timeout_s=10.0)
        self.process.join(10.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10.0)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.process.join(10.0)

    def pause(self) -> None:
        """Stop the process, and return once the kernel says it is stopped: a signal is delivered when
        the process next runs, and until then its server thread may still answer (a race under load)."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while psutil.Process(self.pid).status() != psutil.STATUS_STOPPED:
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {self.pid} did not stop")
            time.sleep(0.001)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


@contextlib.contextmanager
def peer() -> Iterator[Peer]:
    """A remote engine's process (not yet initialised: call `peer("initialize", ...)`), stopped and
    reaped at the end."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=_main, args=(theirs,), name="hixl-peer", daemon=True)
    process.start()
    theirs.close()
    handle = None
    try:
        if not ours.poll(CALL_TIMEOUT_S):
            raise TimeoutError("the peer did not start")
        _, pid = ours.recv()
        handle = Peer(process, ours, pid)
        yield handle
    finally:
        if handle is not None:
            with contextlib.suppress(ProcessLookupError):
                handle.resume()
            handle.stop()
        elif process.is_alive():
            process.kill()
        process.join(10.0)
        ours.close()
