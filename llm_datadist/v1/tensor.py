"""The legacy v1 `TensorDesc` and `Tensor` (real path: `llm_datadist_v1.tensor`, reached lazily as
`llm_datadist.TensorDesc` / `llm_datadist.Tensor`).

Minimal host-only versions with the real argument checks: a `Tensor` holds a C-contiguous copy of a numpy
array. The real class wraps a native GE tensor; an int `data` (a native tensor id) has nothing to name here
and raises LLMException(LLM_FEATURE_NOT_ENABLED).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._validate import check_isinstance
from ..data_type import DataType, dtype_to_np_dtype, np_dtype_to_dtype, valid_np_dtypes
from ..status import LLMStatusCode, make_error

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Tensor", "TensorDesc"]


class TensorDesc:
    """`TensorDesc(dtype, shape)`: TypeError unless `dtype` is a DataType and `shape` a list/tuple of int."""

    def __init__(self, dtype: DataType, shape: list[int] | tuple[int, ...]) -> None:
        check_isinstance("dtype", dtype, DataType)
        check_isinstance("shape", shape, (list, tuple), inner=int)
        self._dtype = dtype
        self._shape = list(shape)

    @property
    def dtype(self) -> DataType:
        return self._dtype

    @property
    def shape(self) -> list[int]:
        return self._shape

    def __str__(self) -> str:
        return f"TensorDesc(dtype={self.dtype}, shape={self.shape})"


def _is_str_dtype(np: Any, dtype: Any) -> bool:
    return bool(np.issubdtype(dtype, np.str_) or np.issubdtype(dtype, np.bytes_))


class Tensor:
    """`Tensor(data, tensor_desc=None)`: `data` a numpy array (copied) or another Tensor (cloned).

    As in the real class: TypeError for another `data` type or a `tensor_desc` that is not a TensorDesc;
    RuntimeError when the array's shape or dtype differs from `tensor_desc`, when its dtype has no DataType,
    or when it is not C-contiguous.
    """

    def __init__(self, data: Any, tensor_desc: TensorDesc | None = None) -> None:
        import numpy as np

        check_isinstance("data", data, (np.ndarray, Tensor, int))
        check_isinstance("tensor_desc", tensor_desc, TensorDesc, allow_none=True)
        if isinstance(data, Tensor):
            self._tensor_desc: TensorDesc = data._tensor_desc
            self._data: np.ndarray[Any, Any] = data._data.copy()
        elif isinstance(data, int):
            raise make_error(
                "Tensor",
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                "native tensor ids do not exist on this host; build a Tensor from a numpy array",
            )
        else:
            self._init_by_ndarray(np, data, tensor_desc)

    def _init_by_ndarray(self, np: Any, data: Any, tensor_desc: TensorDesc | None) -> None:
        is_str = _is_str_dtype(np, data.dtype)
        if tensor_desc:
            if list(data.shape) != tensor_desc.shape:
                raise RuntimeError(
                    f"The shape of data:{data.shape} is not same as tensor_desc shape:{tensor_desc.shape}"
                )
            if data.dtype != dtype_to_np_dtype.get(tensor_desc.dtype):
                raise RuntimeError(
                    f"The dtype of data:{data.dtype} is not same as tensor_desc dtype:{tensor_desc.dtype}"
                )
            self._tensor_desc = tensor_desc
        elif data.dtype not in valid_np_dtypes and not is_str:
            raise RuntimeError(f"The dtype of data:{data.dtype} is not valid, only support {valid_np_dtypes}")
        elif is_str:
            self._tensor_desc = TensorDesc(DataType.DT_STRING, list(data.shape))
        else:
            self._tensor_desc = TensorDesc(np_dtype_to_dtype[data.dtype], list(data.shape))
        if is_str:
            data = np.char.add(data.astype(np.bytes_), b"\0")
        if not data.flags.c_contiguous:
            raise RuntimeError("The data is not c_contiguous")
        self._data = np.array(data, copy=True)

    @property
    def tensor_desc(self) -> TensorDesc:
        return self._tensor_desc

    def numpy(self, copy: bool = False) -> np.ndarray[Any, Any]:
        """The data as a numpy array (a copy with `copy=True`). TypeError unless `copy` is a bool; a string
        tensor needs `copy=True` (RuntimeError otherwise)."""
        check_isinstance("copy", copy, bool)
        if self._tensor_desc.dtype == DataType.DT_STRING and not copy:
            raise RuntimeError("String tensor only support when param copy is True.")
        return self._data.copy() if copy else self._data

    def __str__(self) -> str:
        return f"Tensor({self._data},tensor_desc={self._tensor_desc})"
