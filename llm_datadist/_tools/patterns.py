"""Known bytes: what the demo, the soak and the bench write into memory before a transfer and check after
it, so that a torn copy, a wrong offset or another cache's bytes show. Three patterns, cheapest first:

- `unit_bytes(index)`: a unit (a row, a block, a 16 KiB chunk) holds one byte, `index % 251 + 1`; neighbours
  differ, so a unit from or into the wrong place shows (bench: it fills gigabytes, and checks units).
- `golden_bytes(seed, nbytes)`: the 64-bit words `seed + i * GOLDEN`, i = 0, 1, ... (little-endian, the last
  one cut at `nbytes`); every word differs, so a shift by any number of bytes shows (the demo's requests).
- stamped units (`make_stamp`, `fill_unit`, `read_stamp`, `body_matches`): a 32-byte stamp naming the owner,
  its incarnation, the cache and (tensor, unit), then golden bytes seeded by the stamp (the soak: a puller
  tells a stale catalogue entry, whose stamp is another cache's, from a bad copy, whose body is wrong).

Rules: pure functions of their arguments (numpy only); the check compares every byte; no temporary larger
than 1 MiB for the soak's units, which can be large.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / the golden ratio: consecutive words share no pattern
_CHUNK_WORDS = 1 << 17  # 1 MiB of pattern at a time


def unit_bytes(index: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The byte each unit `index` holds (any integer array): `index % 251 + 1`, never 0 (so a unit left
    zeroed shows too)."""
    return (index % 251 + 1).astype(np.uint8)


def golden_chunks(seed: int, nbytes: int) -> Iterator[tuple[int, np.ndarray[Any, Any]]]:
    """`golden_bytes(seed, nbytes)` as (offset, bytes) in chunks of at most 1 MiB."""
    words = -(-nbytes // 8)
    for first in range(0, words, _CHUNK_WORDS):
        values = np.arange(first, min(words, first + _CHUNK_WORDS), dtype=np.uint64)
        values *= GOLDEN
        values += np.uint64(seed)
        offset = first * 8
        yield offset, values.view(np.uint8)[: nbytes - offset]


def golden_bytes(seed: int, nbytes: int) -> np.ndarray[Any, Any]:
    """The first `nbytes` of the words `seed + i * GOLDEN` (mod 2**64), as uint8."""
    out = np.empty(nbytes, dtype=np.uint8)
    for offset, chunk in golden_chunks(seed, nbytes):
        out[offset : offset + chunk.nbytes] = chunk
    return out


# ---------------------------------------------------------------------------------------- stamped units
# A unit starts with a stamp of four little-endian 64-bit words: a magic ORed with the owner's cluster id,
# the owner's incarnation, the cache's serial number, and (tensor << 32) | unit. The rest of the unit is
# golden bytes seeded by a hash of the stamp.

STAMP_NBYTES = 32
_MAGIC = 0x50AC_0000_0000_0000
_MASK64 = (1 << 64) - 1
Stamp = tuple[int, int, int, int]


def make_stamp(cluster_id: int, incarnation: int, serial: int, tensor: int, unit: int) -> Stamp:
    return (_MAGIC | cluster_id, incarnation, serial, (tensor << 32) | unit)


def _stamp_seed(stamp: Stamp) -> int:
    value = 0
    for word in stamp:
        value = ((value ^ word) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    return value


def _body_chunks(stamp: Stamp, nbytes: int) -> Iterator[tuple[int, np.ndarray[Any, Any]]]:
    """(offset in the unit, expected bytes) after the stamp, in chunks of at most 1 MiB."""
    for offset, chunk in golden_chunks(_stamp_seed(stamp), nbytes - STAMP_NBYTES):
        yield STAMP_NBYTES + offset, chunk


def fill_unit(unit: np.ndarray[Any, Any], stamp: Stamp) -> None:
    """Write `stamp` and its body over all of `unit` (uint8, at least STAMP_NBYTES long)."""
    unit[:STAMP_NBYTES] = np.array(stamp, dtype="<u8").view(np.uint8)
    for offset, chunk in _body_chunks(stamp, unit.nbytes):
        unit[offset : offset + chunk.nbytes] = chunk


def read_stamp(unit: np.ndarray[Any, Any]) -> Stamp:
    a, b, c, d = (int(w) for w in unit[:STAMP_NBYTES].copy().view("<u8"))
    return (a, b, c, d)


def body_matches(unit: np.ndarray[Any, Any], stamp: Stamp) -> bool:
    """Every byte of `unit` after its stamp is the body `stamp` seeds."""
    return all(
        np.array_equal(unit[offset : offset + chunk.nbytes], chunk)
        for offset, chunk in _body_chunks(stamp, unit.nbytes)
    )
