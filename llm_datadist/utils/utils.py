"""The real package's argument checkers (real path: `llm_datadist.utils.utils`), with their signatures.

A thin layer over `llm_datadist._validate`, which the package itself uses: same exceptions (TypeError for a
type, ValueError for a range) and messages. As in the real module `check_isinstance` lets None through
unless `allow_none=False`; unlike it, a bool is not accepted where an int is asked for (see
docs/conformance.md §1).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from llm_datadist import _validate
from llm_datadist._validate import TypeSpec

__all__ = [
    "check_dict",
    "check_inner",
    "check_int32",
    "check_int64",
    "check_isinstance",
    "check_list_int32",
    "check_list_int64",
    "check_list_uint64",
    "check_positive_or_set_default",
    "check_uint8",
    "check_uint16",
    "check_uint32",
    "check_uint64",
]


def check_inner(arg_name: str, arg_value: Iterable[object], inner_class: TypeSpec) -> None:
    """TypeError unless every item of `arg_value` is an `inner_class`."""
    _validate.check_items(arg_name, arg_value, inner_class)


def check_dict(
    arg_name: str,
    arg_value: object,
    k_class: TypeSpec,
    v_class: TypeSpec,
    v_inner_class: TypeSpec | None = None,
) -> None:
    """TypeError unless a dict of `k_class` keys and `v_class` values (whose items are `v_inner_class`)."""
    _validate.check_dict(arg_name, arg_value, k_class, v_class)
    if v_inner_class is not None:
        assert isinstance(arg_value, dict)
        for value in arg_value.values():
            _validate.check_items("dict value", value, v_inner_class)


def check_isinstance(
    arg_name: str,
    arg_value: Any,
    classes: TypeSpec,
    inner_class: TypeSpec | None = None,
    extra_fmt: str = "",
    allow_none: bool = True,
) -> Any:
    """TypeError unless `arg_value` is one of `classes` (and its items `inner_class`); returns the value."""
    _validate.check_isinstance(
        arg_name, arg_value, classes, inner=inner_class, allow_none=allow_none, extra_fmt=extra_fmt
    )
    return arg_value


def check_uint64(arg_name: str, arg_value: object) -> None:
    _validate.check_uint64(arg_name, arg_value)


def check_int64(arg_name: str, arg_value: object) -> None:
    _validate.check_int64(arg_name, arg_value)


def check_positive_or_set_default(arg_name: str, arg_value: object, default: int = -1) -> int:
    """None gives `default`; else int64 (TypeError/ValueError) and >= 0 (ValueError)."""
    return _validate.check_positive_or_set_default(arg_name, arg_value, default)


def check_int32(arg_name: str, arg_value: object) -> None:
    _validate.check_int32(arg_name, arg_value)


def check_uint32(arg_name: str, arg_value: object) -> None:
    _validate.check_uint32(arg_name, arg_value)


def check_list_int32(arg_name: str, arg_value: Iterable[Any]) -> None:
    _validate.check_list_int32(arg_name, arg_value)


def check_list_int64(arg_name: str, arg_value: Iterable[Any]) -> None:
    _validate.check_list_int64(arg_name, arg_value)


def check_list_uint64(arg_name: str, arg_value: Iterable[Any]) -> None:
    _validate.check_list_uint64(arg_name, arg_value)


def check_uint16(arg_name: str, arg_value: object) -> None:
    _validate.check_uint16(arg_name, arg_value)


def check_uint8(arg_name: str, arg_value: object) -> None:
    _validate.check_uint8(arg_name, arg_value)
