"""Argument checkers shared by the public classes, raising what the real package raises (§1.3).

A wrong Python type raises `TypeError` ("<name> only support ['int'], but got <class 'str'>."), an integer out
of its C range raises `ValueError` ("<name>'s value is out of range,<v> is not a uint64 value."), a semantic
check raises `LLMException(LLM_PARAM_INVALID)`. Two deliberate differences from the real `utils.utils`:
`bool` is not accepted where an int is asked for, and None is rejected unless the caller opts in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from llm_datadist.status import raise_if_false

U8_MAX = 2**8 - 1
U16_MAX = 2**16 - 1
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1

TypeSpec = type | Sequence[type]


def _as_tuple(types: TypeSpec) -> tuple[type, ...]:
    return (types,) if isinstance(types, type) else tuple(types)


def _type_names(types: tuple[type, ...]) -> list[str]:
    return [t.__name__ for t in types]


def _is_instance(value: object, types: tuple[type, ...]) -> bool:
    # bool is an int subclass; True is never a valid id, size or port, so it only passes where bool itself
    # (or a bool-accepting type such as `object`) is listed. The real checker lets it through.
    if isinstance(value, bool) and int in types and bool not in types and object not in types:
        return False
    return isinstance(value, types)


def check_isinstance(
    name: str,
    value: object,
    types: TypeSpec,
    *,
    inner: TypeSpec | None = None,
    allow_none: bool = False,
    extra_fmt: str = "",
) -> None:
    """TypeError unless `value` is one of `types` (and, with `inner`, each of its items is one of `inner`).

    `allow_none=True` lets None through, which the real checker does by default; here callers opt in where
    None means "unset". `extra_fmt` prefixes the message (the real BlocksCacheKey says "The first param ...").
    """
    if inner is None and (type(value) is types or (type(types) is tuple and type(value) in types)):
        return  # an exact listed type: the common case (a bool is exact only where bool is listed)
    if value is None and allow_none:
        return
    classes = _as_tuple(types)
    if not _is_instance(value, classes):
        raise TypeError(f"{extra_fmt}{name} only support {_type_names(classes)}, but got {type(value)}.")
    if inner is not None:
        check_items(name, value, inner)  # type: ignore[arg-type]


def check_items(name: str, values: Iterable[object], item_types: TypeSpec) -> None:
    """TypeError unless every item of `values` is one of `item_types`."""
    classes = _as_tuple(item_types)
    for item in values:
        if not _is_instance(item, classes):
            raise TypeError(f"{name} inner type only support {_type_names(classes)}, but got {type(item)}.")


def check_list_of(
    name: str,
    value: object,
    item_types: TypeSpec,
    *,
    seq_types: TypeSpec = (list, tuple),
    allow_none: bool = False,
) -> None:
    """TypeError unless `value` is a list or tuple (or `seq_types`) whose items are all `item_types`."""
    check_isinstance(name, value, seq_types, inner=item_types, allow_none=allow_none)


def check_dict(name: str, value: object, key_types: TypeSpec, value_types: TypeSpec) -> None:
    """TypeError unless `value` is a dict with keys of `key_types` and values of `value_types`."""
    check_isinstance(name, value, dict)
    assert isinstance(value, dict)
    keys, vals = _as_tuple(key_types), _as_tuple(value_types)
    for k, v in value.items():
        if not _is_instance(k, keys):
            raise TypeError(f"{name} dict key only support {_type_names(keys)}, but got {type(k)}.")
        if not _is_instance(v, vals):
            raise TypeError(f"{name} dict value only support {_type_names(vals)}, but got {type(v)}.")


def _check_int_range(name: str, value: object, low: int, high: int, c_type: str) -> None:
    if type(value) is int and low <= value <= high:
        return  # the common case, inline
    check_isinstance(name, value, int)
    assert isinstance(value, int)
    if not low <= value <= high:
        raise ValueError(f"{name}'s value is out of range,{value} is not a {c_type} value.")


def check_uint8(name: str, value: object) -> None:
    """TypeError unless a (non-bool) int; ValueError unless in [0, 2**8 - 1]."""
    _check_int_range(name, value, 0, U8_MAX, "uint8")


def check_uint16(name: str, value: object) -> None:
    """TypeError unless a (non-bool) int; ValueError unless in [0, 2**16 - 1]."""
    _check_int_range(name, value, 0, U16_MAX, "uint16")


def check_uint32(name: str, value: object) -> None:
    """TypeError unless a (non-bool) int; ValueError unless in [0, 2**32 - 1]."""
    _check_int_range(name, value, 0, U32_MAX, "uint32")


def check_uint64(name: str, value: object) -> None:
    """TypeError unless a (non-bool) int; ValueError unless in [0, 2**64 - 1]."""
    _check_int_range(name, value, 0, U64_MAX, "uint64")


def check_int32(name: str, value: object) -> None:
    """TypeError unless a (non-bool) int; ValueError unless in [-2**31, 2**31 - 1]."""
    _check_int_range(name, value, I32_MIN, I32_MAX, "int32")


def check_int64(name: str, value: object) -> None:
    """TypeError unless a (non-bool) int; ValueError unless in [-2**63, 2**63 - 1]."""
    _check_int_range(name, value, I64_MIN, I64_MAX, "int64")


def check_positive_or_set_default(name: str, value: object, default: int = -1) -> int:
    """None gives `default`; otherwise `check_int64` (TypeError/ValueError), then ValueError("<name>'s
    value:<v> is invalid, should be >= 0") for a negative value, as the real helper (v1 pull offsets)."""
    if value is None:
        return default
    check_int64(name, value)
    assert isinstance(value, int)
    if value < 0:
        raise ValueError(f"{name}'s value:{value} is invalid, should be >= 0")
    return value


def check_list_uint64(name: str, values: Iterable[Any]) -> None:
    """`check_uint64` on every item."""
    for value in values:
        check_uint64(name, value)


def check_list_int64(name: str, values: Iterable[Any]) -> None:
    """`check_int64` on every item."""
    for value in values:
        check_int64(name, value)


def check_list_int32(name: str, values: Iterable[Any]) -> None:
    """`check_int32` on every item."""
    for value in values:
        check_int32(name, value)


def check_range_step1(name: str, value: object, *, allow_none: bool = False) -> None:
    """A layer range as pull/push kwargs take it: TypeError unless a `range`; LLMException(PARAM_INVALID)
    unless its step is 1 and its start >= 0. An empty range passes (the consumer checks the tensor counts)."""
    check_isinstance(name, value, range, allow_none=allow_none)
    if value is None:
        return
    assert isinstance(value, range)
    raise_if_false(value.step == 1, "check {0}.step == 1 failed, {0} = {1}", name, value)
    raise_if_false(value.start >= 0, "check {0}.start >= 0 failed, {0} = {1}", name, value)


def check_layer_range(name: str, value: object, *, allow_none: bool = True) -> None:
    """A layer range as TransferConfig / TransferWithCacheKeyConfig take it (the real `check_layer_range`):
    TypeError unless a `range` (None passes with `allow_none`); LLMException(PARAM_INVALID) unless
    step == 1 and 0 <= start < stop."""
    check_isinstance(name, value, range, allow_none=allow_none)
    if value is None:
        return
    assert isinstance(value, range)
    raise_if_false(value.step == 1, "check {0}.step == 1 failed", name)
    raise_if_false(
        0 <= value.start < value.stop, "check 0 <= range.start < range.stop failed, {0} = {1}", name, value
    )


def check_index_lists(**lists: object) -> None:
    """Block or batch index lists: each a list or tuple (TypeError) of uint64 values (TypeError/ValueError);
    None is allowed and means "not given"."""
    for name, values in lists.items():
        if values is None:
            continue
        check_isinstance(name, values, (list, tuple))
        assert isinstance(values, (list, tuple))
        if all(type(value) is int for value in values) and (
            not values or (min(values) >= 0 and max(values) <= U64_MAX)
        ):
            continue  # exact ints in range: one pass in C instead of a call per index
        for value in values:
            check_uint64(name, value)
