"""TCP peers that have not proved the shared secret yet: how many each source address may keep open, which
one is closed to make room for a newcomer, and how long each has to prove itself.

Rules: decisions only (no socket, no clock: the server passes connections, addresses and times in). A
newcomer always gets a slot: its own address's oldest goes when that address is at its cap, the oldest of
the address holding the most when every slot is taken, so a flood from one address closes only its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["AdmissionLimits", "make_room"]

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
