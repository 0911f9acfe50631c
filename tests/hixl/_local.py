"""The test process's own engine and memory, made and finalized around a test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import hixl

from ._peer import Buffers

SERVER = "127.0.0.1:26300"


class Local:
    """A `Hixl` of the test process and the buffers it registered."""

    def __init__(self, engine: hixl.Hixl) -> None:
        self.engine = engine
        self.buffers = Buffers()

    def register(self, nbytes: int, seed: int | None = None) -> tuple[int, int]:
        """(address, handle) of a new buffer registered with the engine."""
        addr = self.buffers.alloc(nbytes, seed)
        ret, handle = self.engine.register_mem(hixl.MemDesc(addr, nbytes), hixl.MemType.MEM_HOST)
        assert ret == hixl.SUCCESS, ret
        return addr, handle


@contextlib.contextmanager
def local_engine(address: str = "127.0.0.1:0", options: dict[str, str] | None = None) -> Iterator[Local]:
    engine = hixl.Hixl()
    assert engine.initialize(address, options or {}) == hixl.SUCCESS
    try:
        yield Local(engine)
    finally:
        engine.finalize()
