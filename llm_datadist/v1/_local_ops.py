"""Local copies of v1: copy_cache, copy_blocks, swap_blocks (to be written)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..status import LLMStatusCode, make_error
from ..v2.cache import KvCache

if TYPE_CHECKING:
    from .._core import Core


def copy_cache(
    api: str,
    core: Core,
    dst: KvCache,
    src: KvCache,
    dst_batch_index: int,
    src_batch_index: int,
    offset: int,
    size: int,
    req_id: int | None,
) -> None:
    raise make_error(api, LLMStatusCode.LLM_FEATURE_NOT_ENABLED, "not implemented yet")


def copy_blocks(api: str, core: Core, cache: KvCache, copy_block_info: dict[int, list[int]]) -> None:
    raise make_error(api, LLMStatusCode.LLM_FEATURE_NOT_ENABLED, "not implemented yet")


def swap_blocks(api: str, core: Core, src: KvCache, dst: KvCache, src_to_dst: dict[int, int]) -> None:
    raise make_error(api, LLMStatusCode.LLM_FEATURE_NOT_ENABLED, "not implemented yet")
