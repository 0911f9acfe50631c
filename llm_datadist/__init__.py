"""llm_datadist on one host: Huawei's KV-cache transfer API with no accelerator.

The names and module paths are the real package's (`llm_datadist.status`, `.configs`, `.data_type`,
`.v2.llm_datadist`, ...). Prompt and Decoder processes exchange metadata as msgpack frames over Unix
sockets; KV bytes move with one memory copy through POSIX shared memory. See README.md for what differs.
"""

from __future__ import annotations

import os as _os
from typing import TYPE_CHECKING, Any

from ._signals import held as _held

# The real package sets this on import; keep the side effect so environment-sensitive code behaves alike.
_os.environ.setdefault("AUTO_USE_UC_MEMORY", "0")

# numpy's BLAS starts its threads when numpy is first imported: they too leave SIGTERM and SIGINT to the
# program's main thread (`_signals`), when this package is what imports numpy first.
with _held():
    import numpy as _numpy  # noqa: F401

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
from .v2.llm_utils import CacheTask

if TYPE_CHECKING:
    from .v1.kv_cache_manager import KvCacheManager
    from .v1.tensor import Tensor, TensorDesc

# The real names: the v2 ones and three legacy v1 names resolved lazily below.
__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheTask",
    "DataType",
    "KvCache",
    "KvCacheManager",
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
    "Tensor",
    "TensorDesc",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
]

# The v2 public names (the real package defines this list; its own tests import it).
v2_list = [name for name in __all__ if name not in ("KvCacheManager", "Tensor", "TensorDesc")]


def __getattr__(name: str) -> Any:
    # The real package loads its legacy v1 names lazily, from llm_datadist_v1; ours live in llm_datadist.v1.
    if name == "KvCacheManager":
        from .v1.kv_cache_manager import KvCacheManager

        return KvCacheManager
    if name in ("TensorDesc", "Tensor"):
        from .v1 import tensor

        return getattr(tensor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
