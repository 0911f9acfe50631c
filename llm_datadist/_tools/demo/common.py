"""What the demo's parent and both pairs of sides share: the shape of the KV cache, the block tables, the
bytes the Prompt writes, the options both sides start with, and how a side reports its rows.

Rules: nothing here starts a process. A side sends its parent ("step", what it is doing) as it starts
each step that can take a while, ("progress", row) as each row is measured, then ("done", result) or
("error", traceback) once. Every name a run shares with other processes (its port, its communicator) is in
its `Setup`, unique per run.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from llm_datadist import LLMConfig

from ..patterns import golden_bytes

BLOCK_TOKENS = 16  # tokens per paged block, as vLLM's default
PAGED_MODEL_ID = 0
PAGED_SLOT = 100  # the pattern "slot" of the Prompt's paged pool
PUSHED_SLOT = 3  # the Prompt slot pushed layer by layer
PROMPT_CLUSTER = 1
DECODER_CLUSTER = 2
IP = "127.0.0.1"
U64_MAX = 2**64 - 1
# The yardstick rows the Decoder measures: the table's ratios are against the faster of the two 2-thread
# copies (numpy.copyto stores through the cache, the copy kernel streams around it, and which one wins
# depends on the machine), the best copy one process makes here.
NUMPY_COPY = "numpy.copyto, 2 threads"
# The serving rows: requests as a serving framework pulls them, each by a key object of its own, pulled
# once and consumed, timed one by one (p50, p99, the Decoder's CPU per pull). The Prompt binds SMALL_PULLS
# requests of 1 x 4 KiB (req ids from SMALL_REQ) and REQUEST_PULLS requests of every tensor x 32 KiB (from
# REQUEST_REQ).
SMALL_PULLS, SMALL_REQ, SMALL_NBYTES = 200, 1000, 4096
REQUEST_PULLS, REQUEST_REQ, REQUEST_NBYTES = 20, 2000, 32 << 10
KERNEL_COPY = "copy kernel, streaming stores, 2 threads"


@dataclass(frozen=True)
class Setup:
    """Where one run's sides meet, handed whole to each side. The port and the communicator name are the
    run's own (the parent picks them per run: other demos of this user may run at the same time)."""

    port: int  # the v1 Prompt's listen port
    comm_name: str  # the v2 two-sided link's communicator
    timeout_ms: int  # sync_kv_timeout of both sides
    prompt_ip: str = IP
    decoder_ip: str = IP


@dataclass(frozen=True)
class Shape:
    layers: int
    tokens: int
    kv_heads: int
    head_dim: int

    @property
    def num_tensors(self) -> int:
        return 2 * self.layers

    @property
    def slot_nbytes(self) -> int:
        return self.tokens * self.kv_heads * self.head_dim * 2  # fp16

    @property
    def table_blocks(self) -> int:
        """Blocks of BLOCK_TOKENS tokens that hold one request in the paged runs."""
        return max(1, self.tokens // BLOCK_TOKENS)

    @property
    def pool_blocks(self) -> int:
        """Blocks in each side's paged pool: twice the table, so the table scatters over it."""
        return 2 * self.table_blocks

    @property
    def block_nbytes(self) -> int:
        return BLOCK_TOKENS * self.kv_heads * self.head_dim * 2


def block_order(shape: Shape, which: int) -> list[int]:
    """A block table scattered over the pool (the same on both sides for a given `which`)."""
    rng = np.random.default_rng([shape.pool_blocks, which])
    return [int(b) for b in rng.permutation(shape.pool_blocks)[: shape.table_blocks]]


def expected_slot(tensor_index: int, slot: int, nbytes: int) -> np.ndarray[Any, Any]:
    """The bytes the Prompt writes into one (tensor, slot): golden bytes seeded by both, cheap to
    regenerate and different everywhere."""
    return golden_bytes(tensor_index * 1_000_003 + slot * 7_919 + 1, nbytes)


def options(listen: str | None, timeout_ms: int) -> dict[str, str]:
    """What both sides `init` with: device 0, `sync_kv_timeout`, and where the Prompt listens."""
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = timeout_ms
    if listen:
        config.listen_ip_info = listen
    return dict(config.generate_options())


def step(pipe: Connection, what: str) -> None:
    """Tell the parent what this side does now (it prints it when the side has been quiet a while)."""
    pipe.send(("step", what))


class Rows(list[dict[str, Any]]):
    """The Decoder's result rows; each is also sent to the parent as it is added, which prints it as a
    line of progress (a full-sized run takes a while)."""

    def __init__(self, pipe: Connection) -> None:
        super().__init__()
        self._pipe = pipe

    def append(self, row: dict[str, Any]) -> None:
        super().append(row)
        self._pipe.send(("progress", row))

    def step(self, what: str) -> None:
        step(self._pipe, what)
