"""Field checks: what one field of a message may hold, and the hard limit of every size on the wire.

A `FieldCheck` takes one decoded value and returns it normalized (lists become tuples) or raises
`MalformedFrame`; `messages.py` declares one next to each field (`Annotated[int, U32]`). Checks see one value
and never the message around it (cross-field rules are the message's own). Nothing here changes the wire.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

from .errors import MalformedFrame

__all__ = [
    "ADDRESSES",
    "ADDRESS_NAMES",
    "BOOL",
    "ENGINE",
    "I64",
    "MAX_ADDRESS_NAMES",
    "MAX_NOTIFY_NBYTES",
    "MAX_SEGMENT_NAME_CHARS",
    "MAX_TABLE_ENTRIES",
    "MAX_TENSORS",
    "MAX_TEXT_CHARS",
    "NONCE",
    "NONCE_MAX_NBYTES",
    "NONCE_MIN_NBYTES",
    "NOTIFY_TEXT",
    "OFFSETS",
    "OPT_NONCE",
    "OPT_PROOF",
    "OPT_SEGMENT",
    "PROOF_NBYTES",
    "ROLE",
    "SEGMENT",
    "SEGMENTS",
    "SOCKET_NAME",
    "TABLE_ENTRIES",
    "TEXT",
    "U32",
    "U32_POSITIVE",
    "U64",
    "U64_POSITIVE",
    "FieldCheck",
    "int_in",
    "is_int",
    "short_repr",
]

# Hello/Welcome.role carries llm_datadist's LLMRole value: PROMPT = 1, DECODER = 2, MIX = 3.
_ROLES = frozenset({1, 2, 3})

_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1
MAX_SEGMENT_NAME_CHARS = 255
MAX_TEXT_CHARS = 4096
MAX_NOTIFY_NBYTES = 1024  # a HIXL notify's name and message each (the real engine's limit, in bytes)
MAX_TENSORS = 65536
MAX_TABLE_ENTRIES = 4096
MAX_ADDRESS_NAMES = 64
# fullmatch, not `$`: `$` would also accept a name that ends in a newline.
_SEGMENT_NAME = re.compile(r"/?[A-Za-z0-9._-]+")
_SOCKET_NAME_RE = re.compile(r"(?:[A-Za-z0-9_-][A-Za-z0-9._-]*)?")
# A transfer engine's address ("ip:port", a Mooncake session id), "" when the side runs none.
_ENGINE_RE = re.compile(r"[0-9A-Za-z.:_\[\]-]{0,128}")

# Link authentication over TCP (`Challenge`, Hello/Welcome `nonce` and `proof`): a nonce is 16..64 random
# bytes, a proof an HMAC-SHA256 (32 bytes); both are empty on a Unix socket, where the kernel says who the
# peer is.
NONCE_MIN_NBYTES, NONCE_MAX_NBYTES = 16, 64
PROOF_NBYTES = 32

_REPR_CHARS = 80  # error messages quote at most this much of a hostile value


def short_repr(value: object) -> str:
    """repr(value), cut to a length an error message may quote."""
    text = repr(value)
    return text if len(text) <= _REPR_CHARS else text[: _REPR_CHARS - 3] + "..."


def is_int(value: object) -> TypeGuard[int]:
    """An int on the wire: bool is an int subclass, but True is never a valid count or id."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class FieldCheck:
    """Validates one field value and returns it normalized (lists become tuples); raises MalformedFrame.

    `int_range` (low, high) or `is_bool` let `Message.__post_init__` accept the common case inline, without
    a call per field (a small pull validates four messages on its path); `check` still decides the rest."""

    describe: str
    check: Callable[[object], object | None]
    int_range: tuple[int, int] | None = None
    is_bool: bool = False

    def __call__(self, where: str, value: object) -> object:
        normalized = self.check(value)
        if normalized is None:
            raise MalformedFrame(f"{where}: expected {self.describe}, got {short_repr(value)}")
        return normalized


def _int_range(low: int, high: int, describe: str) -> FieldCheck:
    def check(value: object) -> object | None:
        return value if is_int(value) and low <= value <= high else None

    return FieldCheck(describe, check, (low, high))


def int_in(allowed: frozenset[int], describe: str) -> FieldCheck:
    """An int that is one of `allowed` (the message kinds build their key_kind checks with it)."""

    def check(value: object) -> object | None:
        return value if is_int(value) and value in allowed else None

    # The inline range is only a shortcut: it must not admit what `allowed` refuses.
    low, high = min(allowed), max(allowed)
    contiguous = len(allowed) == high - low + 1
    return FieldCheck(describe, check, (low, high) if contiguous else None)


def _text(max_chars: int) -> FieldCheck:
    def check(value: object) -> object | None:
        return value if isinstance(value, str) and len(value) <= max_chars else None

    return FieldCheck(f"str of at most {max_chars} chars", check)


def _check_notify_text(value: object) -> object | None:
    if not isinstance(value, str) or len(value) > MAX_NOTIFY_NBYTES:
        return None
    try:
        return value if len(value.encode()) <= MAX_NOTIFY_NBYTES else None
    except UnicodeEncodeError:  # a lone surrogate: no UTF-8 text
        return None


def _check_segment_name(value: object) -> object | None:
    if isinstance(value, str) and len(value) <= MAX_SEGMENT_NAME_CHARS and _SEGMENT_NAME.fullmatch(value):
        return value
    return None


def _check_offsets(value: object) -> object | None:
    if not isinstance(value, list | tuple) or not 1 <= len(value) <= MAX_TENSORS:
        return None
    # One pass for the types, then min/max in C: a grant of 64 offsets is on every pull's path.
    if not all(type(v) is int or is_int(v) for v in value):
        return None
    if min(value) < 0 or max(value) > _U64_MAX:
        return None
    return tuple(value)


def _check_segment_names(value: object) -> object | None:
    if not isinstance(value, list | tuple) or not 1 <= len(value) <= MAX_TENSORS:
        return None
    if all(_check_segment_name(v) is not None for v in value):
        return tuple(value)
    return None


def _check_socket_name(value: object) -> object | None:
    # A bare file name in the runtime directory: no path separators, so it cannot point anywhere else.
    if isinstance(value, str) and len(value) <= MAX_SEGMENT_NAME_CHARS and _SOCKET_NAME_RE.fullmatch(value):
        return value
    return None


def _check_table_entry(value: object) -> tuple[object, ...] | None:
    if not isinstance(value, list | tuple) or len(value) != 10:
        return None
    cache_id, is_blocks, model_ids, segment, segment_nbytes, bases, unit_nbytes, num_units, slot, gen = value
    if not (is_int(slot) and 0 <= slot <= _U32_MAX and is_int(gen) and 1 <= gen <= _U64_MAX):
        return None
    if not (is_int(cache_id) and 0 <= cache_id <= _U64_MAX and isinstance(is_blocks, bool)):
        return None
    if not isinstance(model_ids, list | tuple) or len(model_ids) > MAX_TABLE_ENTRIES:
        return None
    if not all(is_int(m) and 0 <= m <= _U64_MAX for m in model_ids):
        return None
    if OPT_SEGMENT.check(segment) is None or not (is_int(segment_nbytes) and 0 <= segment_nbytes <= _U64_MAX):
        return None
    checked_bases = _check_offsets(bases)
    if checked_bases is None or not isinstance(checked_bases, tuple):
        return None
    if not (
        is_int(unit_nbytes)
        and 1 <= unit_nbytes <= _U64_MAX
        and is_int(num_units)
        and 1 <= num_units <= _U64_MAX
    ):
        return None
    if segment and max(checked_bases) + unit_nbytes * num_units > segment_nbytes:
        return None
    return (
        cache_id,
        is_blocks,
        tuple(model_ids),
        segment,
        segment_nbytes,
        checked_bases,
        unit_nbytes,
        num_units,
        slot,
        gen,
    )


def _check_table(value: object) -> object | None:
    if not isinstance(value, list | tuple) or len(value) > MAX_TABLE_ENTRIES:
        return None
    entries = [_check_table_entry(entry) for entry in value]
    if any(entry is None for entry in entries):
        return None
    return tuple(entries)


def _check_nonce(value: object) -> object | None:
    if isinstance(value, bytes) and NONCE_MIN_NBYTES <= len(value) <= NONCE_MAX_NBYTES:
        return value
    return None


def _check_opt_nonce(value: object) -> object | None:
    return value if value == b"" else _check_nonce(value)


def _check_opt_proof(value: object) -> object | None:
    return value if isinstance(value, bytes) and len(value) in (0, PROOF_NBYTES) else None


def _check_address_names(value: object) -> object | None:
    if not isinstance(value, list | tuple) or not 1 <= len(value) <= MAX_ADDRESS_NAMES:
        return None
    return tuple(value) if all(_check_segment_name(v) is not None for v in value) else None


def _check_addresses(value: object) -> object | None:
    if not isinstance(value, list | tuple) or not 1 <= len(value) <= MAX_ADDRESS_NAMES:
        return None
    return tuple(value) if all(is_int(v) and 0 <= v <= _U64_MAX for v in value) else None


U32 = _int_range(0, _U32_MAX, "U32")
U64 = _int_range(0, _U64_MAX, "U64")
I64 = _int_range(-(1 << 63), (1 << 63) - 1, "I64")
U32_POSITIVE = _int_range(1, _U32_MAX, "U32 >= 1")
U64_POSITIVE = _int_range(1, _U64_MAX, "U64 >= 1")
ROLE = int_in(_ROLES, "role in {1, 2, 3}")
BOOL = FieldCheck("bool", lambda v: v if isinstance(v, bool) else None, is_bool=True)
TEXT = _text(MAX_TEXT_CHARS)
NOTIFY_TEXT = FieldCheck(f"str of at most {MAX_NOTIFY_NBYTES} UTF-8 bytes", _check_notify_text)
SEGMENT = FieldCheck(
    f"segment name of 1..{MAX_SEGMENT_NAME_CHARS} chars matching /?[A-Za-z0-9._-]+", _check_segment_name
)
OPT_SEGMENT = FieldCheck("empty or a segment name", lambda v: v if v == "" else _check_segment_name(v))
SEGMENTS = FieldCheck(f"array of 1..{MAX_TENSORS} segment names", _check_segment_names)
OFFSETS = FieldCheck(f"array of 1..{MAX_TENSORS} U64", _check_offsets)
TABLE_ENTRIES = FieldCheck(f"array of at most {MAX_TABLE_ENTRIES} cache table entries", _check_table)
SOCKET_NAME = FieldCheck(
    "socket file name matching [A-Za-z0-9_-][A-Za-z0-9._-]* or empty", _check_socket_name
)
NONCE = FieldCheck(f"bytes of {NONCE_MIN_NBYTES}..{NONCE_MAX_NBYTES}", _check_nonce)
OPT_NONCE = FieldCheck(f"empty or bytes of {NONCE_MIN_NBYTES}..{NONCE_MAX_NBYTES}", _check_opt_nonce)
OPT_PROOF = FieldCheck(f"empty or bytes of {PROOF_NBYTES}", _check_opt_proof)
ENGINE = FieldCheck(
    "engine address of at most 128 chars of [0-9A-Za-z.:_[]-]",
    lambda v: v if isinstance(v, str) and _ENGINE_RE.fullmatch(v) else None,
)
ADDRESS_NAMES = FieldCheck(f"array of 1..{MAX_ADDRESS_NAMES} segment names", _check_address_names)
ADDRESSES = FieldCheck(f"array of 1..{MAX_ADDRESS_NAMES} U64", _check_addresses)
