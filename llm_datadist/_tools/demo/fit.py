"""How much /dev/shm a demo of one shape needs at its peak, and which shape runs when that is more than is
free: the one asked for, a smaller one (when the user asked for no size), or none (then it says so, and how
to make /dev/shm larger). Nothing here starts a process; the parent checks once, before it starts any.

The peak, measured with statvfs every 50 ms: the Prompt holds 4 requests, a paged pool of 2 requests and
the serving rows' small requests while the Decoder measures memcpy between two shared-memory segments of a
request each; the Decoder's own
cache and paged pool come later and fit in those 2. The v2 half registers numpy memory: no /dev/shm.
Measured: 34 MiB for --small, 258 MiB for 8 layers x 1,024 tokens, 4,099 MiB for the default size, before
the serving rows' requests were added (6 MiB for --small, 41 MiB for the default size, by `need`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from llm_datadist._shm.space import ShmSpace, format_nbytes, raise_hint

from .common import REQUEST_NBYTES, REQUEST_PULLS, SMALL_NBYTES, SMALL_PULLS, Shape

SMALL = Shape(layers=4, tokens=256, kv_heads=8, head_dim=128)
DEFAULT = Shape(layers=32, tokens=4096, kv_heads=8, head_dim=128)
# Both sides' generation tables and published indexes (under 2 MiB measured).
OVERHEAD_NBYTES = 4 << 20
# What is free must exceed the need by this much: others use /dev/shm while the demo runs.
HEADROOM = 1.1


@dataclass(frozen=True)
class Need:
    """Bytes of /dev/shm at the demo's peak."""

    prompt_nbytes: int
    decoder_nbytes: int

    @property
    def nbytes(self) -> int:
        return self.prompt_nbytes + self.decoder_nbytes + OVERHEAD_NBYTES


def need(shape: Shape) -> Need:
    request_nbytes = shape.slot_nbytes * shape.num_tensors
    paged_nbytes = shape.pool_blocks * shape.block_nbytes * shape.num_tensors
    serving_nbytes = SMALL_PULLS * SMALL_NBYTES + REQUEST_PULLS * REQUEST_NBYTES * shape.num_tensors
    return Need(
        prompt_nbytes=4 * request_nbytes + paged_nbytes + serving_nbytes, decoder_nbytes=2 * request_nbytes
    )


def fits(shape: Shape, space: ShmSpace) -> bool:
    return need(shape).nbytes * HEADROOM <= space.free_nbytes


def smaller_shapes(shape: Shape) -> Iterator[Shape]:
    """The tokens halved down to --small's, then the layers halved down to --small's."""
    while shape.tokens > SMALL.tokens:
        shape = dataclasses.replace(shape, tokens=max(SMALL.tokens, shape.tokens // 2))
        yield shape
    while shape.layers > SMALL.layers:
        shape = dataclasses.replace(shape, layers=max(SMALL.layers, shape.layers // 2))
        yield shape


@dataclass(frozen=True)
class Plan:
    """What to run (None: nothing), the lines to print first, and why not when nothing runs."""

    shape: Shape | None
    lines: tuple[str, ...] = ()
    refusal: str = ""


def describe(shape: Shape) -> str:
    return (
        f"{shape.layers} layers x (K, V), {shape.tokens} tokens, {shape.kv_heads} KV heads x "
        f"{shape.head_dim}, fp16: {format_nbytes(shape.slot_nbytes * shape.num_tensors)} per request"
    )


def plan(shape: Shape, space: ShmSpace, *, sized: bool) -> Plan:
    """The shape to run on `space`: `shape` if it fits; else, unless the user chose the size (`sized`),
    the largest of `smaller_shapes` that fits; else none, with the reason and how to make room."""
    wanted = need(shape)
    summary = (
        f"/dev/shm: this run needs about {format_nbytes(wanted.nbytes)} at its peak (the Prompt "
        f"{format_nbytes(wanted.prompt_nbytes)}, the Decoder {format_nbytes(wanted.decoder_nbytes)}); "
        f"{format_nbytes(space.free_nbytes)} free of {format_nbytes(space.size_nbytes)}"
    )
    if fits(shape, space):
        return Plan(shape, (summary,))
    full_hint = raise_hint(space.used_nbytes + int(wanted.nbytes * HEADROOM), space.directory)
    small_nbytes = need(SMALL).nbytes
    if not fits(SMALL, space):
        return Plan(
            None,
            refusal=f"demo: {summary}: not enough, not even for --small (about "
            f"{format_nbytes(small_nbytes)}); {full_hint}",
        )
    if sized:
        return Plan(
            None,
            refusal=f"demo: {summary}: not enough. Run `llm-datadist demo --small` (about "
            f"{format_nbytes(small_nbytes)}) or ask for fewer --tokens or --layers; or, for this size, "
            f"{full_hint}",
        )
    smaller = next(candidate for candidate in smaller_shapes(shape) if fits(candidate, space))
    return Plan(
        smaller,
        (
            f"{summary}: not enough for this size.",
            f"Scaling down to {smaller.layers} layers x {smaller.tokens} tokens (about "
            f"{format_nbytes(need(smaller).nbytes)} of /dev/shm). For the full size, {full_hint}.",
        ),
    )
