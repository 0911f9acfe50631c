"""The tools' byte patterns (llm_datadist/_tools/patterns.py): each is exactly what its description says,
the chunked form equals the whole, and a check catches one wrong byte anywhere, at odd sizes and across the
1 MiB chunk boundary."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llm_datadist._tools.patterns import (
    GOLDEN,
    STAMP_NBYTES,
    body_matches,
    fill_unit,
    golden_bytes,
    golden_chunks,
    make_stamp,
    read_stamp,
    unit_bytes,
)

ODD_SIZES = (1, 7, 8, 9, 3333, 4097, (1 << 20) - 1, (1 << 20) + 1, (1 << 20) + 4096 + 3)


def _reference_words(seed: int, nbytes: int) -> np.ndarray:
    """The golden sequence written out one word at a time in Python integers, cut at `nbytes`."""
    words = -(-nbytes // 8)
    values = [(seed + i * int(GOLDEN)) % (1 << 64) for i in range(words)]
    return np.array(values, dtype="<u8").view(np.uint8)[:nbytes]


@given(seed=st.integers(0, 2**64 - 1), nbytes=st.integers(0, 5000))
def test_golden_bytes_are_the_words_seed_plus_i_golden(seed: int, nbytes: int) -> None:
    assert np.array_equal(golden_bytes(seed, nbytes), _reference_words(seed, nbytes))


@pytest.mark.parametrize("nbytes", ODD_SIZES)
def test_golden_chunks_cover_the_bytes_once_in_order_at_most_1_mib_each(nbytes: int) -> None:
    chunks = list(golden_chunks(12345, nbytes))
    assert [offset for offset, _ in chunks] == list(range(0, nbytes, 1 << 20))
    assert all(chunk.nbytes <= 1 << 20 for _, chunk in chunks)
    assert np.array_equal(np.concatenate([c for _, c in chunks]), golden_bytes(12345, nbytes))


def test_unit_bytes_differ_between_neighbours_and_are_never_zero() -> None:
    values = unit_bytes(np.arange(10_000))
    assert values.dtype == np.uint8
    assert values.min() == 1 and values.max() == 251
    assert np.all(values[1:] != values[:-1])


@pytest.mark.parametrize("nbytes", [n for n in ODD_SIZES if n >= STAMP_NBYTES] + [STAMP_NBYTES])
def test_a_stamped_unit_reads_back_and_any_flipped_byte_shows(nbytes: int) -> None:
    stamp = make_stamp(7, 3, 41, 5, 9)
    unit = np.zeros(nbytes, dtype=np.uint8)
    fill_unit(unit, stamp)
    assert read_stamp(unit) == stamp
    assert body_matches(unit, stamp)
    rng = np.random.default_rng(nbytes)
    for index in {STAMP_NBYTES, nbytes - 1, int(rng.integers(STAMP_NBYTES, nbytes + 1))}:
        if not STAMP_NBYTES <= index < nbytes:
            continue  # a unit of just a stamp has no body to flip
        bad = unit.copy()
        bad[index] ^= 0x10
        assert not body_matches(bad, stamp)
    bad = unit.copy()
    bad[0] ^= 0x01  # a stamp that names another owner: read, not a body mismatch
    assert read_stamp(bad) != stamp
    if nbytes > STAMP_NBYTES:
        assert not body_matches(unit, make_stamp(7, 3, 42, 5, 9))  # the body of another cache's unit


def test_stamps_name_tensor_and_unit_apart() -> None:
    stamps = {make_stamp(1, 1, 1, tensor, unit) for tensor in range(4) for unit in range(4)}
    assert len(stamps) == 16
