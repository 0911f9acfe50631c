"""Named points in a transfer's life where a fault-injection test stops or kills the process.

Rules: nothing here acts unless a test set `hook` in the process under test; then `hook(point)` runs at
each point, on the transferring thread. The points, in order: "pinned" (the source or destination is
pinned, in the owner's index or by a lease, and nothing is copied yet), "copied" (the bytes moved; the pin
is still held), "released" (the pin or lease ended). And "local": a transfer of this process pinned its own
cache (the destination of a pull, the source of a push, either side of an engine's transfer or a local
copy), before it touches it. Each costs one global lookup when unarmed.
"""

from __future__ import annotations

from collections.abc import Callable

hook: Callable[[str], None] | None = None


def at(point: str) -> None:
    if hook is not None:
        hook(point)
