"""DataType values, element sizes, the numpy helpers and the lazily built legacy maps."""

from __future__ import annotations

import ast
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import llm_datadist.data_type as data_type_module
from llm_datadist.data_type import DataType, dtype_itemsize, numpy_dtype
from llm_datadist.status import LLMException, LLMStatusCode

EXPECTED = {
    "DT_FLOAT": (0, 4),
    "DT_FLOAT16": (1, 2),
    "DT_INT8": (2, 1),
    "DT_INT32": (3, 4),
    "DT_UINT8": (4, 1),
    "DT_INT16": (6, 2),
    "DT_UINT16": (7, 2),
    "DT_UINT32": (8, 4),
    "DT_INT64": (9, 8),
    "DT_UINT64": (10, 8),
    "DT_DOUBLE": (11, 8),
    "DT_BOOL": (12, 1),
    "DT_BF16": (27, 2),
}
SIZED = [DataType[name] for name in EXPECTED]


@pytest.fixture
def fresh_bf16() -> Iterator[None]:
    data_type_module._bf16_numpy_dtype.cache_clear()
    yield
    data_type_module._bf16_numpy_dtype.cache_clear()


def test_members_and_ge_values() -> None:
    assert {m.name: m.value for m in DataType} == {
        **{name: value for name, (value, _) in EXPECTED.items()},
        "DT_STRING": 13,
    }


def test_data_type_is_a_plain_enum() -> None:
    assert not isinstance(DataType.DT_FLOAT16, int)
    assert DataType.DT_FLOAT16 != 1
    assert DataType(27) is DataType.DT_BF16
    assert str(DataType.DT_BF16) == "DataType.DT_BF16"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_itemsize(name: str) -> None:
    assert dtype_itemsize(DataType[name]) == EXPECTED[name][1]


def test_string_has_no_itemsize() -> None:
    with pytest.raises(LLMException) as info:
        dtype_itemsize(DataType.DT_STRING)
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as info:
        numpy_dtype(DataType.DT_STRING)
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID


@pytest.mark.parametrize("dt", SIZED, ids=lambda d: d.name)
def test_numpy_dtype_has_the_ge_itemsize(dt: DataType) -> None:
    assert numpy_dtype(dt).itemsize == dtype_itemsize(dt)


def test_numpy_dtype_meanings() -> None:
    assert numpy_dtype(DataType.DT_FLOAT) == np.float32
    assert numpy_dtype(DataType.DT_FLOAT16) == np.float16
    assert numpy_dtype(DataType.DT_INT64) == np.int64
    assert numpy_dtype(DataType.DT_BOOL) == np.bool_
    assert numpy_dtype(DataType.DT_DOUBLE) == np.float64
    assert isinstance(numpy_dtype(DataType.DT_UINT8), np.dtype)


def test_bf16_without_ml_dtypes_is_uint16(monkeypatch: pytest.MonkeyPatch, fresh_bf16: None) -> None:
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # makes `import ml_dtypes` raise ImportError
    assert numpy_dtype(DataType.DT_BF16) == np.dtype(np.uint16)


def test_bf16_with_ml_dtypes_uses_bfloat16(monkeypatch: pytest.MonkeyPatch, fresh_bf16: None) -> None:
    fake = types.ModuleType("ml_dtypes")
    # Any 2-byte numpy type stands in for ml_dtypes.bfloat16: the point is that it is the one used.
    fake.bfloat16 = np.int16  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ml_dtypes", fake)
    assert numpy_dtype(DataType.DT_BF16) == np.dtype(np.int16)


def test_legacy_maps_are_built_lazily_with_the_bf16_quirk() -> None:
    to_np = data_type_module.dtype_to_np_dtype
    assert to_np is data_type_module.dtype_to_np_dtype  # built once
    assert to_np[DataType.DT_BF16] is np.float16
    assert to_np[DataType.DT_FLOAT16] is np.float16
    assert to_np[DataType.DT_FLOAT] is np.float32
    assert to_np[DataType.DT_STRING] is np.bytes_
    assert set(to_np) == set(DataType)

    from_np = data_type_module.np_dtype_to_dtype
    assert from_np[np.dtype(np.float16)] is DataType.DT_FLOAT16
    assert from_np[np.dtype(np.int32)] is DataType.DT_INT32
    assert DataType.DT_BF16 not in from_np.values()
    assert len(from_np) == 13

    valid = data_type_module.valid_np_dtypes
    assert isinstance(valid, list)
    assert len(valid) == 14
    assert valid.count(np.float16) == 2


def test_from_import_of_a_legacy_map() -> None:
    from llm_datadist.data_type import np_dtype_to_dtype

    assert np_dtype_to_dtype[np.dtype(np.uint64)] is DataType.DT_UINT64


def test_unknown_module_attribute() -> None:
    with pytest.raises(AttributeError):
        _ = data_type_module.no_such_map


# The value-type modules must stay importable without numpy: no module-level numpy import.
VALUE_MODULES = ["status.py", "configs.py", "data_type.py", "_validate.py", "v2/llm_types.py", "utils/log.py"]


@pytest.mark.parametrize("relpath", VALUE_MODULES)
def test_no_top_level_numpy_import(relpath: str) -> None:
    path = Path(data_type_module.__file__).parent / relpath
    tree = ast.parse(path.read_text())
    for node in tree.body:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        assert not any(n.split(".")[0] in ("numpy", "ml_dtypes") for n in names), (relpath, names)
