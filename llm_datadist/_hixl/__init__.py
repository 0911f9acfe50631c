"""The engine behind the `hixl` face: one `Engine` per initialised `hixl.Hixl`, on a `Core` of this library,
so that bytes move as `llm_datadist`'s do (shared memory, cross-memory attach, Mooncake across hosts).

Reading order: `codes`, `config` (initialize's arguments), `node` (the `Core` and its notifies),
`regions` (registered memory by address), `moves` (one transfer), `requests` and `connects` (the
asynchronous ones), `engine` (each API call, returning a status).
"""

from __future__ import annotations

from .engine import Engine, start_engine
from .moves import OpDesc

__all__ = ["Engine", "OpDesc", "start_engine"]
