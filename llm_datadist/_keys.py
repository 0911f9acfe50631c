"""What a pull names and the checks its source gets, shared by the owner (a request over the socket) and
the puller (a pin in the owner's index, `_puller.dataplane`): the same refusals with the same codes and words,
whoever makes them.

The key kinds are the protocol's (`KEY_REQ`, `KEY_PREFIX`, `KEY_CACHE_ID`, `KEY_BLOCKS`), defined once in
`protocol.messages`; a bound key is known by its `KeyId`.
"""

from __future__ import annotations

from llm_datadist._protocol.messages import KEY_BLOCKS, KEY_CACHE_ID, KEY_PREFIX, KEY_REQ

from ._errors import StatusError
from .status import LLMStatusCode

__all__ = [
    "KEY_BLOCKS",
    "KEY_CACHE_ID",
    "KEY_PREFIX",
    "KEY_REQ",
    "KeyId",
    "blocks_by_id",
    "check_batch_index",
    "check_source_bytes",
    "check_tensors",
    "key_text",
    "not_found",
    "registered_for_v1",
]

# (kind, req_id or prefix_id, model_id)
KeyId = tuple[int, int, int]


def key_text(key: KeyId) -> str:
    kind, key_id, model_id = key
    name = {KEY_REQ: "req_id", KEY_PREFIX: "prefix_id"}.get(kind, "id")
    return f"({name}={key_id}, model_id={model_id})"


def check_tensors(num_tensors: int, tensor_start: int, tensor_count: int, whole: bool) -> None:
    if whole and tensor_count != num_tensors:
        raise StatusError(
            LLMStatusCode.LLM_PARAM_INVALID,
            f"source cache has {num_tensors} tensors, destination selects {tensor_count}",
        )
    if tensor_start + tensor_count > num_tensors:
        raise StatusError(
            LLMStatusCode.LLM_PARAM_INVALID,
            f"source tensors [{tensor_start}, {tensor_start + tensor_count}) exceed "
            f"the cache's {num_tensors}",
        )


def check_source_bytes(slot_nbytes: int, src_offset: int, nbytes: int) -> None:
    if src_offset + nbytes > slot_nbytes:
        raise StatusError(
            LLMStatusCode.LLM_PARAM_INVALID,
            f"src_cache_offset {src_offset} + size {nbytes} > source slot {slot_nbytes}",
        )


def check_batch_index(batch_size: int, batch_index: int) -> None:
    if batch_index >= batch_size:
        raise StatusError(
            LLMStatusCode.LLM_PARAM_INVALID,
            f"batch index {batch_index} out of range for batch size {batch_size}",
        )


def not_found(key_kind: int, key_id: int, model_id: int) -> StatusError:
    if key_kind == KEY_BLOCKS:
        return StatusError(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"no blocks cache with model_id {model_id}")
    if key_kind == KEY_CACHE_ID:
        return StatusError(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache id {key_id} does not exist")
    key = (key_kind, key_id, model_id)
    return StatusError(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache key {key_text(key)} does not exist")


def blocks_by_id(cache_id: int) -> StatusError:
    return StatusError(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache id {cache_id} is a blocks cache")


def registered_for_v1(cache_id: int) -> StatusError:
    return StatusError(
        LLMStatusCode.LLM_PARAM_INVALID,
        f"cache {cache_id} is registered memory: only cache-manager mode transfers reach it",
    )
