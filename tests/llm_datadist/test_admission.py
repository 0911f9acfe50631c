"""What the TCP server decides about peers that have not proved the secret (`_wire.admission`), without a
socket or a clock: which unproven connection makes room for a newcomer, and how refusals are counted into
one log line per source address and interval."""

from __future__ import annotations

import pytest

from llm_datadist._wire.admission import AdmissionLimits, Refusal, RefusalLog, make_room

# ------------------------------------------------------------------ which unproven connection makes room

LIMITS = AdmissionLimits(per_source=2, total=5)


def test_a_newcomer_fits_while_its_address_and_the_pool_have_room() -> None:
    assert make_room([], "a", LIMITS) is None
    assert make_room([("a", 1), ("b", 2), ("b", 3), ("c", 4)], "a", LIMITS) is None


def test_at_its_address_cap_a_newcomer_replaces_that_address_oldest() -> None:
    pending = [("b", 1), ("a", 2), ("c", 3), ("a", 4)]
    assert make_room(pending, "a", LIMITS) == 2
    assert make_room(pending, "b", LIMITS) is None


def test_a_full_pool_gives_up_the_oldest_of_the_busiest_address() -> None:
    # "x" holds the oldest connection, but "b" holds the most: "b"'s oldest goes, never "x"'s only one.
    assert make_room([("x", 1), ("b", 2), ("c", 3), ("b", 4), ("d", 5)], "e", LIMITS) == 2
    # Two addresses hold the most: the older connection of the two goes.
    assert make_room([("x", 1), ("c", 2), ("b", 3), ("b", 4), ("c", 5)], "e", LIMITS) == 2
    # The newcomer counts for its own address: with it, "c" holds the most, so "c" pays.
    roomy = AdmissionLimits(per_source=3, total=5)
    assert make_room([("b", 1), ("c", 2), ("b", 3), ("c", 4), ("d", 5)], "c", roomy) == 2
    # One connection per address: the oldest goes.
    assert make_room([("v", 1), ("w", 2), ("x", 3), ("y", 4), ("z", 5)], "q", LIMITS) == 1


def test_admission_limits_are_checked() -> None:
    for bad in ({"per_source": 0}, {"per_source": 6, "total": 5}, {"proof_timeout_s": 0.0}):
        with pytest.raises(ValueError):
            AdmissionLimits(**bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ one log line per address and interval


class _Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, text: str) -> None:
        self.lines.append(text)


def test_the_first_refusal_of_an_address_is_logged_at_once_and_the_rest_counted() -> None:
    lines = _Lines()
    refusals = RefusalLog(lines, interval_s=10.0)
    refusals.refused("10.0.0.9", "wrong shared secret", Refusal.HANDSHAKE, 100.0)
    assert lines.lines == [
        "refusing 10.0.0.9: wrong shared secret (more refusals of 10.0.0.9 are counted, one line per 10 s)"
    ]
    for i in range(3332):
        refusals.refused("10.0.0.9", f"closed {i}", Refusal.MADE_ROOM, 100.0 + i / 1000)
    refusals.refused("10.0.0.9", "no proof", Refusal.OUT_OF_TIME, 105.0)
    refusals.flush(109.9)
    assert len(lines.lines) == 1
    refusals.flush(110.0)
    assert lines.lines[1:] == [
        "10.0.0.9: 3333 more connections refused in the last 10 s (3332 closed to make room, 1 out of time)"
    ]


def test_a_flood_makes_one_line_per_interval_and_a_quiet_address_starts_afresh() -> None:
    lines = _Lines()
    refusals = RefusalLog(lines, interval_s=10.0)
    # 100 refusals a second for 60 s, the log flushed twice a second as the server does.
    for tick in range(6000):
        now = tick / 100
        refusals.refused("10.0.0.9", "closed", Refusal.MADE_ROOM, now)
        if tick % 50 == 0:
            refusals.flush(now)
    refusals.flush(70.0)
    assert len(lines.lines) == 1 + 6
    counted = sum(int(line.split(": ")[1].split()[0]) for line in lines.lines[1:])
    assert counted == 6000 - 1  # every refusal is in a line: the first by itself, the rest counted
    refusals.flush(80.0)  # an interval without refusals ends the address's entry...
    assert len(lines.lines) == 7
    refusals.refused("10.0.0.9", "wrong shared secret", Refusal.HANDSHAKE, 81.0)
    assert lines.lines[-1].startswith(
        "refusing 10.0.0.9: wrong shared secret"
    )  # ...and its reason shows again


def test_each_address_has_its_own_line_up_to_a_limit() -> None:
    lines = _Lines()
    refusals = RefusalLog(lines, interval_s=10.0, max_addresses=2)
    for address in ("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"):
        for _ in range(3):
            refusals.refused(address, "closed", Refusal.MADE_ROOM, 1.0)
    assert [line.split(":")[0] for line in lines.lines] == [
        "refusing 10.0.0.1",
        "refusing 10.0.0.2",
        "refusing 10.0.0.3",
    ]
    assert "more than 2 addresses" in lines.lines[2]
    refusals.flush(11.0)
    assert sorted(lines.lines[3:]) == [
        "10.0.0.1: 2 more connections refused in the last 10 s (2 closed to make room)",
        "10.0.0.2: 2 more connections refused in the last 10 s (2 closed to make room)",
        "other addresses: 5 more connections refused in the last 10 s (5 closed to make room)",
    ]
