"""`CacheManager`: the v2 ("cache-manager mode") cache API.

Rules: no role checks (the role is only a label in v2). Memory comes from the configured pools
(`mem_pool_cfg` for DEVICE, `host_mem_pool_cfg` for HOST) or is the user's own, registered by address;
registered memory is reached by peers through cross-memory attach, checked when it is registered. With
`enable_remote_cache_accessible` transfers are one-sided: the peer's table of caches is read from its index
once per link, then read with no message to the peer (writes pin the destination in its index first).
Transfer timeouts raise `LLM_TIMEOUT`.

The class is the real one's, with every method; its rooms live in their own modules (`_memory`: pools,
registration, keys; `_pulls`; `_pushes`; `_copies`), each a part of the class over the shared state of
`_base`. None calls another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._core import PLACEMENT_HOST
from ._base import ManagerBase
from ._copies import Copies
from ._memory import MAX_REGISTERED_ADDRS, Memory
from ._pulls import Pulls
from ._pushes import Pushes

if TYPE_CHECKING:
    from .._core import Core


class CacheManager(Memory, Pulls, Pushes, Copies):
    """The v2 manager, reached through `LLMDataDist.cache_manager` in cache-manager mode."""

    def __init__(self, core: Core) -> None:
        ManagerBase.__init__(self, core)


__all__ = ["MAX_REGISTERED_ADDRS", "PLACEMENT_HOST", "CacheManager"]
