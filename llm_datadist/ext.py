"""Extensions outside the real API (not in `__all__`): numpy views of a cache's tensors.

Rules: a view aliases the cache's shared memory; it is valid until the cache is freed (after that the
memory may be handed to another cache). bf16 tensors come back as `ml_dtypes.bfloat16` when ml_dtypes is
installed, as raw `uint16` otherwise.
"""

from __future__ import annotations

import numpy as np

from .data_type import numpy_dtype
from .status import LLMStatusCode, make_error
from .v2.cache import KvCache


def tensor_views(cache: KvCache) -> list[np.ndarray]:
    """One numpy array per tensor of `cache`, shaped like `cache.cache_desc.shape`, sharing its memory."""
    api = "tensor_views"
    manager = getattr(cache, "_kv_cache_manager", None)
    core = getattr(manager, "_core", None)
    record = core.table.get(cache.cache_id) if core is not None and cache._is_valid else None
    if record is None:
        raise make_error(api, LLMStatusCode.LLM_PARAM_INVALID, f"cache {cache.cache_id} is not a live cache")
    desc = cache.cache_desc
    dtype = numpy_dtype(desc.data_type)
    segment = record.pool_block.segment
    views = []
    for t in range(record.num_tensors):
        start = record.tensor_offset(t)
        raw = segment.array[start : start + record.tensor_nbytes]
        views.append(raw.view(dtype).reshape(tuple(desc.shape)))
    return views
