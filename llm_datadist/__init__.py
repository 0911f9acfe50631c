"""llm_datadist on one host: Huawei's KV-cache transfer API with no accelerator.

The names and module paths are the real package's (`llm_datadist.status`, `.configs`, `.data_type`,
`.v2.llm_datadist`, ...). Prompt and Decoder processes exchange metadata as msgpack frames over Unix
sockets; KV bytes move with one memory copy through POSIX shared memory. See README.md for what differs.
"""

from __future__ import annotations

import os as _os
from typing import Any

# The real package sets this on import; keep the side effect so environment-sensitive code behaves alike.
_os.environ.setdefault("AUTO_USE_UC_MEMORY", "0")

from .configs import LLMClusterInfo, LLMConfig, LlmConfig, LLMRole
from .data_type import DataType
from .status import LLMException, LLMStatusCode, Status
from .v2.cache import Cache, KvCache
from .v2.llm_datadist import LLMDataDist
from .v2.llm_types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    LayerSynchronizer,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "DataType",
    "KvCache",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LayerSynchronizer",
    "LlmConfig",
    "MemInfo",
    "Memtype",
    "Placement",
    "RegisterMemStatus",
    "Status",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
]


def __getattr__(name: str) -> Any:
    # The real package loads its legacy v1 names lazily; KvCacheManager is the one provided here.
    if name == "KvCacheManager":
        from .v1.kv_cache_manager import KvCacheManager

        return KvCacheManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
