"""Which address ranges this process has mapped, and with what access (`/proc/self/maps`): the check that
memory a caller registers is really there before peers are allowed to read and write it.

Rules: a range is accepted only when every byte of it lies in mappings of this process that allow what will
be done to it (read, and write for memory that pulls or peers' pushes land in); read fresh at each call, so
memory mapped or unmapped since is seen. Nothing here touches the memory itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from ._errors import StatusError
from .status import LLMStatusCode

__all__ = ["Mapping", "mappings", "require_mapped"]

_MAPS = "/proc/self/maps"


class Mapping(NamedTuple):
    start: int
    end: int  # one past the last byte
    readable: bool
    writable: bool


def mappings() -> list[Mapping]:
    """This process's mappings, in address order (as the kernel lists them)."""
    found = []
    with open(_MAPS, encoding="ascii", errors="replace") as maps:
        for line in maps:
            span, perms = line.split(maxsplit=2)[:2]
            start, end = span.split("-")
            found.append(Mapping(int(start, 16), int(end, 16), perms[0] == "r", perms[1] == "w"))
    return found


def require_mapped(ranges: Iterable[tuple[int, int]], *, what: str, writable: bool) -> None:
    """StatusError(LLM_PARAM_INVALID) naming the first of `ranges` ((address, nbytes) pairs) that is not
    wholly inside mapped memory of this process that can be read (and written, with `writable`)."""
    maps = mappings()
    need = "readable and writable" if writable else "readable"
    for index, (address, nbytes) in enumerate(ranges):
        at, end = address, address + nbytes
        for mapping in maps:  # in address order: walk the run of mappings that covers [address, end)
            if mapping.end <= at:
                continue
            if mapping.start > at or not mapping.readable or (writable and not mapping.writable):
                break
            at = mapping.end
            if at >= end:
                break
        if at < end:
            raise StatusError(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"{what} {index} ({nbytes} bytes at {address:#x}) is not all {need} memory of this "
                f"process (from {at:#x} on it is not): register memory the caller owns, as large as its "
                "description says",
            )
