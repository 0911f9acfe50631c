"""`DataType` (real path: `llm_datadist.data_type`): tensor element types, valued as GE's `ge::DataType`.

Element sizes are a fixed table here (no numpy needed to size a cache). numpy is imported lazily, only by the
numpy helpers: `numpy_dtype` (BF16 as a real 2-byte bfloat16 where possible) and the legacy maps
`dtype_to_np_dtype` / `np_dtype_to_dtype` / `valid_np_dtypes`, built on first access like the real ones.
"""

from __future__ import annotations

import functools
from enum import Enum
from typing import TYPE_CHECKING, Any

from llm_datadist.status import LLMException, LLMStatusCode

if TYPE_CHECKING:
    import numpy as np

__all__ = ["DataType", "dtype_itemsize", "numpy_dtype"]


class DataType(Enum):
    """Element types; each value is the GE `ge::DataType` integer the native engine uses.

    A plain `Enum`, as in the real package (so `DataType.DT_FLOAT16 != 1`).
    """

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_STRING = 13
    DT_BF16 = 27


# DT_STRING has no fixed size: the real native size helper fails for it, so it is absent here.
_ITEMSIZE: dict[DataType, int] = {
    DataType.DT_FLOAT: 4,
    DataType.DT_FLOAT16: 2,
    DataType.DT_INT8: 1,
    DataType.DT_INT32: 4,
    DataType.DT_UINT8: 1,
    DataType.DT_INT16: 2,
    DataType.DT_UINT16: 2,
    DataType.DT_UINT32: 4,
    DataType.DT_INT64: 8,
    DataType.DT_UINT64: 8,
    DataType.DT_DOUBLE: 8,
    DataType.DT_BOOL: 1,
    DataType.DT_BF16: 2,
}


def dtype_itemsize(dt: DataType) -> int:
    """Bytes per element of `dt`. DT_STRING (variable size) raises LLMException(LLM_PARAM_INVALID).

    Not in the real package, which asks its native `calc_tensor_size`.
    """
    try:
        return _ITEMSIZE[dt]
    except KeyError:
        raise LLMException(
            f"data type {dt} has no fixed element size", status_code=LLMStatusCode.LLM_PARAM_INVALID
        ) from None


@functools.cache
def _bf16_numpy_dtype() -> np.dtype[Any]:
    import numpy as np

    try:
        import ml_dtypes
    except ImportError:
        # Same width, so byte copies and views stay right; only the arithmetic meaning is lost.
        return np.dtype(np.uint16)
    bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return bf16


def numpy_dtype(dt: DataType) -> np.dtype[Any]:
    """The numpy dtype whose items have exactly `dt`'s size and meaning, for viewing cache bytes.

    DT_BF16 is `ml_dtypes.bfloat16` when ml_dtypes is importable (extra `bf16`), else `np.uint16` (the raw
    2-byte pattern). Unlike the legacy `dtype_to_np_dtype` map, BF16 is never float16. DT_STRING raises
    LLMException(LLM_PARAM_INVALID). Not in the real package.
    """
    import numpy as np

    if dt is DataType.DT_BF16:
        return _bf16_numpy_dtype()
    if dt is DataType.DT_STRING:
        dtype_itemsize(dt)  # raises
    result: np.dtype[Any] = np.dtype(_np_type_map(np)[dt])
    return result


def _np_type_map(np: Any) -> dict[DataType, Any]:
    return {
        DataType.DT_FLOAT: np.float32,
        DataType.DT_FLOAT16: np.float16,
        DataType.DT_BF16: np.float16,  # real quirk: the legacy maps call bf16 float16
        DataType.DT_INT8: np.int8,
        DataType.DT_INT16: np.int16,
        DataType.DT_UINT16: np.uint16,
        DataType.DT_UINT8: np.uint8,
        DataType.DT_INT32: np.int32,
        DataType.DT_INT64: np.int64,
        DataType.DT_UINT32: np.uint32,
        DataType.DT_UINT64: np.uint64,
        DataType.DT_BOOL: np.bool_,
        DataType.DT_DOUBLE: np.double,
        DataType.DT_STRING: np.bytes_,
    }


_lazy: dict[str, Any] = {}


def _legacy_maps() -> dict[str, Any]:
    import numpy as np

    to_np = _np_type_map(np)
    return {
        "dtype_to_np_dtype": to_np,
        # A list with float16 twice (FLOAT16 and BF16), exactly as the real module builds it.
        "valid_np_dtypes": list(to_np.values()),
        "np_dtype_to_dtype": {np.dtype(t): dt for dt, t in to_np.items() if dt is not DataType.DT_BF16},
    }


def __getattr__(name: str) -> Any:
    """Build the legacy numpy maps on first access (backward compatibility; the real module does the same).

    `dtype_to_np_dtype`: DataType -> numpy scalar type (DT_BF16 -> np.float16, a real quirk);
    `np_dtype_to_dtype`: np.dtype -> DataType (no BF16 entry); `valid_np_dtypes`: the map's values.
    """
    if name in ("dtype_to_np_dtype", "np_dtype_to_dtype", "valid_np_dtypes"):
        if name not in _lazy:
            # One dict.update of a finished dict: a concurrent reader never sees a half-built set.
            _lazy.update(_legacy_maps())
        return _lazy[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
