"""TCP peers that have not proved the shared secret yet: how many each source address may keep open, which
one is closed to make room for a newcomer, how long each has to prove itself, and how refusals are logged.

Rules: decisions only (no socket, no clock: the server passes connections, addresses and times in). A
newcomer always gets a slot: its own address's oldest goes when that address is at its cap, the oldest of
the address holding the most when every slot is taken. Refusals make one line per address per interval.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["AdmissionLimits", "Refusal", "RefusalLog", "make_room"]

C = TypeVar("C")


@dataclass(frozen=True)
class AdmissionLimits:
    """`per_source`: unproven connections one source address may hold at once; `total`: all addresses
    together; `proof_timeout_s`: how long a peer has, from accept, to prove the secret (a client sends its
    Hello as soon as the Challenge arrives, one round trip)."""

    per_source: int = 4
    total: int = 32
    proof_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if not 1 <= self.per_source <= self.total:
            raise ValueError(f"need 1 <= per_source <= total, got {self.per_source} and {self.total}")
        if not self.proof_timeout_s > 0:
            raise ValueError(f"proof_timeout_s must be positive, got {self.proof_timeout_s}")


def make_room(pending: Sequence[tuple[str, C]], source: str, limits: AdmissionLimits) -> C | None:
    """The connection to close so that a newcomer from `source` fits, or None when it fits as things are.

    `pending`: the unproven connections as (source address, connection), oldest first. At its address's
    cap, the newcomer replaces that address's oldest; with every slot taken, the oldest connection of the
    addresses holding the most goes (the newcomer counted for its own), which is never the only
    connection of an address while another address holds two.
    """
    counts = Counter(address for address, _ in pending)
    if counts[source] >= limits.per_source:
        return next(conn for address, conn in pending if address == source)
    if len(pending) < limits.total:
        return None
    counts[source] += 1
    most = max(counts.values())
    return next(conn for address, conn in pending if counts[address] == most)


class Refusal(enum.Enum):
    """Why an unproven TCP connection was closed, as counted in the log."""

    MADE_ROOM = "closed to make room"
    OUT_OF_TIME = "out of time"
    HANDSHAKE = "handshake refused"
    PROTOCOL = "broke the protocol"
    FULL = "server full"


@dataclass
class _Window:
    ends_at: float
    counts: Counter[Refusal] = field(default_factory=Counter)


class RefusalLog:
    """Refusals of unproven TCP peers, at most one line per source address per `interval_s`: an address's
    first refusal at once, with its reason; the ones after it counted by kind and reported in one line when
    the interval ends, and again at the end of each interval while they go on. An address quiet for a
    whole interval starts afresh. At most `max_addresses` are told apart; the rest are counted together.
    `emit(text)` writes one line."""

    OTHERS = "other addresses"

    def __init__(
        self, emit: Callable[[str], None], *, interval_s: float = 10.0, max_addresses: int = 64
    ) -> None:
        self._emit = emit
        self._interval_s = interval_s
        self._max_addresses = max_addresses
        self._windows: dict[str, _Window] = {}

    def refused(self, address: str, reason: str, kind: Refusal, now: float) -> None:
        key = address
        if key not in self._windows and len(self._windows) >= self._max_addresses:
            key = self.OTHERS
        window = self._windows.get(key)
        if window is not None and now >= window.ends_at:
            self._end(key, window, now)
            window = self._windows.get(key)
        if window is not None:
            window.counts[kind] += 1
            return
        self._windows[key] = _Window(now + self._interval_s)
        if key == self.OTHERS:
            counted = (
                f"refusals from more than {self._max_addresses} addresses: the others are counted together"
            )
        else:
            counted = f"more refusals of {address} are counted"
        self._emit(f"refusing {address}: {reason} ({counted}, one line per {self._interval_s:g} s)")

    def flush(self, now: float) -> None:
        """Report the intervals that ended by `now` (call it now and then, refusals or not)."""
        for key, window in list(self._windows.items()):
            if now >= window.ends_at:
                self._end(key, window, now)

    def _end(self, key: str, window: _Window, now: float) -> None:
        """One line for an interval that counted refusals, and a new interval after it; an interval without
        any ends the address's entry."""
        if not window.counts:
            del self._windows[key]
            return
        total = sum(window.counts.values())
        kinds = ", ".join(f"{n} {kind.value}" for kind, n in window.counts.most_common())
        elapsed_s = now - (window.ends_at - self._interval_s)
        self._emit(f"{key}: {total} more connections refused in the last {elapsed_s:.0f} s ({kinds})")
        self._windows[key] = _Window(now + self._interval_s)
