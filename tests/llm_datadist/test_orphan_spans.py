"""The memory an orphan (a transfer whose call gave up while the engine still runs it) holds back: the
runs of a transfer merged into spans, and the overlap test between two transfers' spans, against a
byte-by-byte reference."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from llm_datadist._puller.peer_engine import overlap, spans_of

runs = st.lists(st.tuples(st.integers(0, 200), st.integers(1, 40)), min_size=1, max_size=12)


def _bytes(pairs: list[tuple[int, int]]) -> set[int]:
    return {addr for start, nbytes in pairs for addr in range(start, start + nbytes)}


@given(runs)
def test_spans_cover_exactly_the_runs_sorted_and_disjoint(pairs: list[tuple[int, int]]) -> None:
    spans = spans_of([a for a, _ in pairs], [n for _, n in pairs])
    assert _bytes([(start, end - start) for start, end in spans]) == _bytes(pairs)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(spans))  # sorted, apart, merged


@given(runs, runs)
def test_overlap_is_a_shared_byte(first: list[tuple[int, int]], second: list[tuple[int, int]]) -> None:
    a = spans_of([x for x, _ in first], [n for _, n in first])
    b = spans_of([x for x, _ in second], [n for _, n in second])
    assert overlap(a, b) == bool(_bytes(first) & _bytes(second))
    assert overlap(a, b) == overlap(b, a)


def test_adjacent_runs_do_not_overlap() -> None:
    assert not overlap(spans_of([0], [4096]), spans_of([4096], [1]))
    assert overlap(spans_of([0], [4097]), spans_of([4096], [1]))
