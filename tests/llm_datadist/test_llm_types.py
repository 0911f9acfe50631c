"""The v2 value types (CacheDesc, keys, transfer configs, small enums) and the shared argument checkers."""

from __future__ import annotations

from typing import Any

import pytest

from llm_datadist._validate import (
    check_dict,
    check_int32,
    check_int64,
    check_isinstance,
    check_layer_range,
    check_list_of,
    check_list_uint64,
    check_range_step1,
    check_uint8,
    check_uint16,
    check_uint32,
    check_uint64,
)
from llm_datadist.data_type import DataType
from llm_datadist.status import LLMException, LLMStatusCode
from llm_datadist.v2.llm_types import (
    U64_MAX,
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
    slot_nbytes,
)


def param_invalid(fn: Any, *args: Any, **kwargs: Any) -> LLMException:
    with pytest.raises(LLMException) as info:
        fn(*args, **kwargs)
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    return info.value


def test_u64_max() -> None:
    assert U64_MAX == 2**64 - 1 == 18446744073709551615


# -- small enums and MemInfo --------------------------------------------------------------------------------


def test_placement() -> None:
    assert [(p.name, p.value) for p in Placement] == [("HOST", 0), ("DEVICE", 1)]
    assert str(Placement.HOST) == "Placement.HOST"
    assert f"{Placement.DEVICE}" == "Placement.DEVICE"
    assert Placement.DEVICE == 1


def test_register_mem_status_and_memtype_are_plain_enums() -> None:
    assert [(s.name, s.value) for s in RegisterMemStatus] == [("OK", 0), ("PREPARING", 1), ("FAILED", 2)]
    assert [(m.name, m.value) for m in Memtype] == [("MEM_TYPE_DEVICE", 0), ("MEM_TYPE_HOST", 1)]
    assert RegisterMemStatus.OK != 0
    assert Memtype.MEM_TYPE_HOST != 1


def test_mem_info() -> None:
    info = MemInfo(Memtype.MEM_TYPE_DEVICE, 0x1000, 4096)
    assert (info.mem_type, info.addr, info.size) == (Memtype.MEM_TYPE_DEVICE, 0x1000, 4096)
    assert repr(info) == "MemInfo(mem_type=Memtype.MEM_TYPE_DEVICE, addr=4096, size=4096)"
    for args in [(0, 1, 1), (Memtype.MEM_TYPE_HOST, "1", 1), (Memtype.MEM_TYPE_HOST, 1, 1.0), (None, 1, 1)]:
        with pytest.raises(TypeError):
            MemInfo(*args)


# -- CacheDesc ----------------------------------------------------------------------------------------------


def test_cache_desc_defaults_and_properties() -> None:
    shape = [4, 16, 8, 128]
    desc = CacheDesc(80, shape, DataType.DT_FLOAT16)
    assert desc.num_tensors == 80
    assert desc.shape is shape
    assert desc.data_type is DataType.DT_FLOAT16
    assert desc.placement is Placement.DEVICE
    assert desc.batch_dim == 0
    assert desc.batch_size == 4
    assert desc.seq_len_dim_index == -1
    assert desc.kv_tensor_format is None
    assert desc._is_blocks is False
    assert not hasattr(desc, "batch_dim_index")


def test_cache_desc_all_arguments() -> None:
    shape = (3, 5, 7)
    desc = CacheDesc(2, shape, DataType.DT_INT8, Placement.HOST, 1, 2, "ND")
    assert desc.shape is shape
    assert desc.placement is Placement.HOST
    assert desc.batch_dim == 1
    assert desc.batch_size == 5
    assert desc.seq_len_dim_index == 2
    assert desc.kv_tensor_format == "ND"


@pytest.mark.parametrize(
    ("data_type", "shape", "nbytes"),
    [
        (DataType.DT_FLOAT16, [3, 7, 11], 3 * 7 * 11 * 2),
        (DataType.DT_BF16, [2, 4097], 2 * 4097 * 2),
        (DataType.DT_FLOAT, [1, 3333], 3333 * 4),
        (DataType.DT_INT8, [5], 5),
        (DataType.DT_UINT8, (13, 1, 1), 13),
        (DataType.DT_INT16, [9, 3], 54),
        (DataType.DT_UINT16, [1], 2),
        (DataType.DT_INT32, [7, 7, 7], 343 * 4),
        (DataType.DT_UINT32, [17, 3], 51 * 4),
        (DataType.DT_INT64, [3, 5, 7], 105 * 8),
        (DataType.DT_UINT64, [2, 2], 32),
        (DataType.DT_DOUBLE, [4097], 4097 * 8),
        (DataType.DT_BOOL, [17], 17),
        (DataType.DT_FLOAT16, [2, 0, 4], 0),
    ],
)
def test_cache_desc_size_is_bytes_per_tensor(data_type: DataType, shape: list[int], nbytes: int) -> None:
    desc = CacheDesc(3, shape, data_type)
    assert desc.size == nbytes
    assert desc.size == nbytes  # cached


def test_cache_desc_size_errors() -> None:
    string_desc = CacheDesc(1, [4], DataType.DT_STRING)  # constructing is fine; sizing is not
    param_invalid(lambda: string_desc.size)
    dynamic = CacheDesc(1, [4, -1], DataType.DT_FLOAT16)
    exc = param_invalid(lambda: dynamic.size)
    assert "Failed to calc tensor size" in str(exc)


def test_update_dim_mutates_the_shape_and_resets_size() -> None:
    shape = [4, 10, 8]
    desc = CacheDesc(2, shape, DataType.DT_FLOAT16)
    assert desc.size == 4 * 10 * 8 * 2
    desc.update_dim(1, 33)
    assert shape == [4, 33, 8]
    assert desc.shape is shape
    assert desc.size == 4 * 33 * 8 * 2
    desc.update_dim(0, 9)
    assert desc.batch_size == 4  # fixed at construction
    assert desc.size == 9 * 33 * 8 * 2


def test_update_dim_errors() -> None:
    with pytest.raises(TypeError):
        CacheDesc(1, (4, 4), DataType.DT_FLOAT).update_dim(0, 2)
    desc = CacheDesc(1, [4, 4], DataType.DT_FLOAT)
    with pytest.raises(IndexError):
        desc.update_dim(5, 2)
    with pytest.raises(TypeError):
        desc.update_dim(0, "2")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        desc.update_dim(0, 2**63)
    assert desc.shape == [4, 4]


def test_cache_desc_type_and_range_checks() -> None:
    fp16 = DataType.DT_FLOAT16
    for bad in (-1, 2**32):
        with pytest.raises(ValueError, match="num_tensors"):
            CacheDesc(bad, [1], fp16)
    for wrong in ("2", 2.0, None, True):
        with pytest.raises(TypeError, match="num_tensors only support"):
            CacheDesc(wrong, [1], fp16)  # type: ignore[arg-type]
    for wrong_shape in ("abc", 4, None, {1: 2}):
        with pytest.raises(TypeError, match="shape only support"):
            CacheDesc(1, wrong_shape, fp16)  # type: ignore[arg-type]
    for wrong_items in ([1, "2"], [1.0], [True]):
        with pytest.raises(TypeError, match="shape inner type"):
            CacheDesc(1, wrong_items, fp16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="int64"):
        CacheDesc(1, [2**63], fp16)
    for wrong_dtype in (1, "DT_FLOAT16", None):
        with pytest.raises(TypeError, match="data_type only support"):
            CacheDesc(1, [1], wrong_dtype)  # type: ignore[arg-type]
    for wrong_placement in (1, "DEVICE", None):
        with pytest.raises(TypeError, match="placement only support"):
            CacheDesc(1, [1], fp16, wrong_placement)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="batch_dim_index only support"):
        CacheDesc(1, [1], fp16, batch_dim_index="0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seq_len_dim_index only support"):
        CacheDesc(1, [1], fp16, seq_len_dim_index=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="int32"):
        CacheDesc(1, [1], fp16, seq_len_dim_index=2**31)
    with pytest.raises(TypeError, match="kv_tensor_format only support"):
        CacheDesc(1, [1], fp16, kv_tensor_format=5)  # type: ignore[arg-type]


def test_cache_desc_semantic_checks() -> None:
    fp16 = DataType.DT_FLOAT16
    for bdi in (2, -1, 10):
        exc = param_invalid(CacheDesc, 1, [4, 4], fp16, batch_dim_index=bdi)
        assert str(exc) == f"batch_dim_index {bdi} out of range, [0, 2)"
    param_invalid(CacheDesc, 1, [], fp16)  # no dim to be the batch dim
    for sldi in (-2, 2, 7):
        exc = param_invalid(CacheDesc, 1, [4, 4], fp16, seq_len_dim_index=sldi)
        assert "seq_len_dim_index" in str(exc)
    assert CacheDesc(1, [4, 4], fp16, seq_len_dim_index=1).seq_len_dim_index == 1


def test_cache_desc_repr() -> None:
    desc = CacheDesc(2, [4, 8], DataType.DT_BF16, Placement.HOST, 0, 1, "ND")
    assert repr(desc) == (
        "CacheDesc(num_tensors=2, shape=[4, 8], data_type=DataType.DT_BF16, placement=Placement.HOST, "
        "batch_dim_index=0, seq_len_dim_index=1,kv_tensor_format=ND)"
    )


def test_slot_nbytes_uses_dim_zero() -> None:
    assert slot_nbytes(CacheDesc(2, [4, 3, 5], DataType.DT_FLOAT16)) == 30
    assert slot_nbytes(CacheDesc(2, [7, 3333], DataType.DT_INT8)) == 3333
    # batch_dim_index is ignored by the engine: still dim 0.
    assert slot_nbytes(CacheDesc(2, [3, 8, 2], DataType.DT_FLOAT, batch_dim_index=1)) == 64
    param_invalid(slot_nbytes, CacheDesc(2, [0, 8], DataType.DT_FLOAT))


# -- CacheKey -----------------------------------------------------------------------------------------------


def test_cache_key_positional_forms() -> None:
    key = CacheKey(1, 42)
    assert (key.cluster_id, key.prompt_cluster_id, key.req_id, key.model_id, key.prefix_id) == (
        1,
        1,
        42,
        0,
        U64_MAX,
    )
    key = CacheKey(1, 42, 3)
    assert key.model_id == 3 and key.prefix_id == U64_MAX
    key = CacheKey(1, U64_MAX, 3, 9)
    assert (key.req_id, key.model_id, key.prefix_id) == (U64_MAX, 3, 9)


def test_cache_key_keyword_forms() -> None:
    key = CacheKey(prompt_cluster_id=7, req_id=8)
    assert key.cluster_id == key.prompt_cluster_id == 7
    key = CacheKey(cluster_id=7, req_id=8, model_id=1, prefix_id=5)
    assert (key.cluster_id, key.req_id, key.model_id, key.prefix_id) == (7, 8, 1, 5)
    key = CacheKey(7, req_id=8, prefix_id=5)
    assert (key.cluster_id, key.req_id, key.prefix_id) == (7, 8, 5)
    # As in the real class: cluster_id wins over prompt_cluster_id, a positional value over its keyword.
    assert CacheKey(prompt_cluster_id=1, cluster_id=2, req_id=3).cluster_id == 2
    assert CacheKey(5, 6, model_id=9).model_id == 9


def test_cache_key_repr() -> None:
    assert repr(CacheKey(1, 2)) == f"CacheKey(cluster_id=1, req_id=2, prefix_id={U64_MAX}, model_id=0)"
    assert repr(CacheKey(prompt_cluster_id=3, req_id=4, model_id=5, prefix_id=6)) == (
        "CacheKey(cluster_id=3, req_id=4, prefix_id=6, model_id=5)"
    )


def test_cache_key_argument_errors() -> None:
    assert str(param_invalid(CacheKey, 1, 2, 3, 4, 5)) == "Param num is over limit"
    param_invalid(CacheKey, 1, 2, 3, 4, model_id=1)
    assert str(param_invalid(CacheKey, 1, 2, batch=3)) == "Unsupported param:batch"
    assert "cluster_id is required" in str(param_invalid(CacheKey, req_id=2))
    assert str(param_invalid(CacheKey, 1)) == "Param req_id is required"
    assert str(param_invalid(CacheKey, cluster_id=1)) == "Param req_id is required"
    param_invalid(CacheKey)


@pytest.mark.parametrize("field", ["cluster_id", "req_id", "model_id", "prefix_id"])
def test_cache_key_values_are_uint64(field: str) -> None:
    base: dict[str, Any] = {"cluster_id": 1, "req_id": 2, "model_id": 3, "prefix_id": 4}
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match=f"{field}'s value is out of range"):
            CacheKey(**{**base, field: bad})
    for wrong in ("1", 1.0, None, True):
        with pytest.raises(TypeError, match=f"{field} only support"):
            CacheKey(**{**base, field: wrong})
    assert getattr(CacheKey(**{**base, field: U64_MAX}), field) == U64_MAX


def test_prompt_cluster_id_is_checked_as_cluster_id() -> None:
    with pytest.raises(ValueError, match="cluster_id"):
        CacheKey(prompt_cluster_id=-1, req_id=1)


def test_cache_key_has_no_value_equality() -> None:
    a, b = CacheKey(1, 2), CacheKey(1, 2)
    assert a != b
    assert a == a
    assert len({a, b}) == 2
    assert CacheKey.__eq__ is object.__eq__
    assert CacheKey.__hash__ is object.__hash__


# -- CacheKeyByIdAndIndex -----------------------------------------------------------------------------------


def test_cache_key_by_id_and_index() -> None:
    key = CacheKeyByIdAndIndex(5, 1)
    assert (key.cluster_id, key.cache_id, key.batch_index) == (5, 1, 0)
    key = CacheKeyByIdAndIndex(U64_MAX, -1, 2**32 - 1)
    assert (key.cluster_id, key.cache_id, key.batch_index) == (U64_MAX, -1, 2**32 - 1)
    assert (
        repr(CacheKeyByIdAndIndex(5, 2, 3)) == "CacheKeyByIdAndIndex(cluster_id=5, cache_id=2, batch_index=3)"
    )
    assert CacheKeyByIdAndIndex(1, 1) != CacheKeyByIdAndIndex(1, 1)


def test_cache_key_by_id_and_index_checks() -> None:
    for args, pattern in [
        ((-1, 1), "uint64"),
        ((2**64, 1), "uint64"),
        ((1, 2**63), "int64"),
        ((1, -(2**63) - 1), "int64"),
        ((1, 1, -1), "uint32"),
        ((1, 1, 2**32), "uint32"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            CacheKeyByIdAndIndex(*args)
    for args in [("1", 1), (1, 1.0), (1, 1, "0"), (True, 1), (1, None)]:
        with pytest.raises(TypeError):
            CacheKeyByIdAndIndex(*args)  # type: ignore[arg-type]


# -- BlocksCacheKey -----------------------------------------------------------------------------------------


def test_blocks_cache_key_forms_and_repr() -> None:
    key = BlocksCacheKey(3)
    assert (key.cluster_id, key.prompt_cluster_id, key.model_id) == (3, 3, 0)
    assert repr(key) == "BlocksCacheKey(cluster_id=3, model_id=0)"
    key = BlocksCacheKey(3, 1)
    assert key.model_id == 1
    key = BlocksCacheKey(prompt_cluster_id=4, model_id=2)
    assert (key.cluster_id, key.model_id) == (4, 2)
    assert repr(key) == "BlocksCacheKey(prompt_cluster_id=4, model_id=2)"
    key = BlocksCacheKey(cluster_id=4)
    assert repr(key) == "BlocksCacheKey(cluster_id=4, model_id=0)"
    assert repr(BlocksCacheKey(5, model_id=1)) == "BlocksCacheKey(cluster_id=5, model_id=1)"


def test_blocks_cache_key_only_checks_int() -> None:
    # No range check, as in the real class.
    key = BlocksCacheKey(-5, 2**70)
    assert (key.cluster_id, key.model_id) == (-5, 2**70)
    with pytest.raises(TypeError, match="The first param cluster_id only support"):
        BlocksCacheKey("1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="The second param model_id only support"):
        BlocksCacheKey(1, "0")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        BlocksCacheKey(prompt_cluster_id=None)  # type: ignore[arg-type]


def test_blocks_cache_key_argument_errors() -> None:
    assert str(param_invalid(BlocksCacheKey, 1, 2, 3)) == "Param num is over limit"
    param_invalid(BlocksCacheKey, 1, model_id=2, prompt_cluster_id=3)
    assert str(param_invalid(BlocksCacheKey, 1, req_id=2)) == "Unsupported param:req_id"
    assert "cluster_id is required" in str(param_invalid(BlocksCacheKey, model_id=2))
    param_invalid(BlocksCacheKey)


def test_blocks_cache_key_has_no_value_equality() -> None:
    assert BlocksCacheKey(1) != BlocksCacheKey(1)


# -- LayerSynchronizer --------------------------------------------------------------------------------------


def test_layer_synchronizer_is_abstract() -> None:
    with pytest.raises(TypeError):
        LayerSynchronizer()  # type: ignore[abstract]

    class Ready(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return layer_index < 2

    sync = Ready()
    assert sync.synchronize_layer(0, None) is True
    assert sync.synchronize_layer(2, None) is False


# -- TransferConfig -----------------------------------------------------------------------------------------


def test_transfer_config_defaults_and_repr() -> None:
    cfg = TransferConfig(9, [0x10, 0x20])
    assert cfg.dst_cluster_id == 9
    assert cfg.dst_addrs == [0x10, 0x20]
    assert cfg.src_layer_range is None
    assert cfg.src_batch_index == 0
    assert cfg.dst_layer_range is None
    assert (
        repr(cfg)
        == "TransferConfig(dst_cluster_id=9, dst_addrs=[16, 32], src_layer_range=None, src_batch_index=0)"
    )
    cfg = TransferConfig(9, (1, 2, 3, 4), range(1, 3), 5)
    assert cfg.src_layer_range == range(1, 3)
    assert cfg.src_batch_index == 5
    cfg.dst_layer_range = range(0, 2)  # a plain attribute, no check
    assert cfg.dst_layer_range == range(0, 2)


def test_transfer_config_checks() -> None:
    with pytest.raises(ValueError):
        TransferConfig(-1, [1])
    with pytest.raises(TypeError):
        TransferConfig("9", [1])  # type: ignore[arg-type]
    for wrong in (1, None, {1}, "12"):
        with pytest.raises(TypeError, match="dst_addrs only support"):
            TransferConfig(9, wrong)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dst_addrs inner type"):
        TransferConfig(9, [1, "2"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="dst_addrs"):
        TransferConfig(9, [1, -2])
    with pytest.raises(ValueError, match="dst_addrs"):
        TransferConfig(9, [2**64])
    with pytest.raises(TypeError, match="src_layer_range only support"):
        TransferConfig(9, [1], [0, 1])  # type: ignore[arg-type]
    for bad_range in (range(0, 4, 2), range(2, 2), range(3, 1), range(-1, 2), range(3, 0, -1)):
        param_invalid(TransferConfig, 9, [1], bad_range)
    for bad_index in (-1, 2**32):
        with pytest.raises(ValueError, match="src_batch_index"):
            TransferConfig(9, [1], None, bad_index)


def test_transfer_config_setters_check_too() -> None:
    cfg = TransferConfig(9, [1, 2])
    cfg.dst_cluster_id = 10
    cfg.dst_addrs = [3, 4, 5, 6]
    cfg.src_layer_range = range(0, 2)
    cfg.src_batch_index = 1
    assert (cfg.dst_cluster_id, cfg.dst_addrs, cfg.src_layer_range, cfg.src_batch_index) == (
        10,
        [3, 4, 5, 6],
        range(0, 2),
        1,
    )
    cfg.src_layer_range = None
    assert cfg.src_layer_range is None
    with pytest.raises(ValueError):
        cfg.dst_cluster_id = 2**64
    with pytest.raises(TypeError):
        cfg.dst_addrs = [1.0]  # type: ignore[list-item]
    param_invalid(setattr, cfg, "src_layer_range", range(0, 4, 2))
    with pytest.raises(ValueError):
        cfg.src_batch_index = -1
    assert (cfg.dst_cluster_id, cfg.dst_addrs, cfg.src_batch_index) == (10, [3, 4, 5, 6], 1)


# -- TransferWithCacheKeyConfig -----------------------------------------------------------------------------


def test_transfer_with_cache_key_config() -> None:
    key = CacheKeyByIdAndIndex(11, 2, 1)
    cfg = TransferWithCacheKeyConfig(key, range(0, 2), range(3, 5), 4)
    assert cfg.cache_key is key
    assert cfg.src_layer_range == range(0, 2)
    assert cfg.dst_layer_range == range(3, 5)
    assert cfg.src_batch_index == 4
    assert cfg.dst_cluster_id == 11
    assert repr(cfg) == (
        "TransferWithCacheKeyConfig(cache_key=CacheKeyByIdAndIndex(cluster_id=11, cache_id=2, "
        "batch_index=1), src_layer_range=range(0, 2), dst_layer_range=range(3, 5), src_batch_index=4)"
    )
    blocks = TransferWithCacheKeyConfig(BlocksCacheKey(12, 1), range(1, 4), range(1, 4))
    assert blocks.dst_cluster_id == 12
    assert blocks.src_batch_index == 0


def test_transfer_with_cache_key_config_needs_both_ranges() -> None:
    key = BlocksCacheKey(1)
    with pytest.raises(TypeError, match="src_layer_range only support"):
        TransferWithCacheKeyConfig(key)
    with pytest.raises(TypeError, match="src_layer_range only support"):
        TransferWithCacheKeyConfig(key, None, range(0, 1))
    with pytest.raises(TypeError, match="dst_layer_range only support"):
        TransferWithCacheKeyConfig(key, range(0, 1))
    with pytest.raises(TypeError, match="dst_layer_range only support"):
        TransferWithCacheKeyConfig(key, range(0, 1), [0])  # type: ignore[arg-type]


def test_transfer_with_cache_key_config_checks() -> None:
    by_id = CacheKeyByIdAndIndex(1, 1)
    blocks = BlocksCacheKey(1)
    with pytest.raises(TypeError, match="cache_key only support"):
        TransferWithCacheKeyConfig(CacheKey(1, 1), range(0, 1), range(0, 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cache_key only support"):
        TransferWithCacheKeyConfig(None, range(0, 1), range(0, 1))  # type: ignore[arg-type]
    exc = param_invalid(TransferWithCacheKeyConfig, by_id, range(0, 2), range(0, 3))
    assert "src_layer_range size should be equal to dst_layer_range size" in str(exc)
    param_invalid(TransferWithCacheKeyConfig, by_id, range(0, 4, 2), range(0, 2))
    param_invalid(TransferWithCacheKeyConfig, by_id, range(0, 2), range(2, 2))
    param_invalid(TransferWithCacheKeyConfig, by_id, range(-1, 1), range(0, 2))
    exc = param_invalid(TransferWithCacheKeyConfig, blocks, range(0, 1), range(0, 1), 1)
    assert str(exc) == "src_batch_index should be 0 when cache_key is BlocksCacheKey."
    with pytest.raises(ValueError):
        TransferWithCacheKeyConfig(by_id, range(0, 1), range(0, 1), -1)
    with pytest.raises(TypeError):
        TransferWithCacheKeyConfig(by_id, range(0, 1), range(0, 1), "0")  # type: ignore[arg-type]


def test_transfer_with_cache_key_config_setters() -> None:
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, 1), range(0, 2), range(0, 2), 3)
    cfg.src_layer_range = range(2, 4)
    cfg.dst_layer_range = range(5, 7)
    assert (cfg.src_layer_range, cfg.dst_layer_range) == (range(2, 4), range(5, 7))
    with pytest.raises(TypeError):
        cfg.src_layer_range = None  # type: ignore[assignment]
    param_invalid(setattr, cfg, "dst_layer_range", range(0, 6, 3))
    cfg.src_batch_index = 7
    assert cfg.src_batch_index == 7
    with pytest.raises(ValueError):
        cfg.src_batch_index = 2**32
    new_key = BlocksCacheKey(prompt_cluster_id=8)
    with pytest.raises(TypeError):
        cfg.cache_key = CacheKey(8, 1)  # type: ignore[assignment]
    cfg.cache_key = new_key
    assert cfg.cache_key is new_key
    assert cfg.dst_cluster_id == 8
    exc = param_invalid(setattr, cfg, "src_batch_index", 1)
    assert str(exc) == "src_batch_index should be 0 when cache_key is BlocksCacheKey."
    cfg.src_batch_index = 0
    assert cfg.src_batch_index == 0


# -- shared checkers ----------------------------------------------------------------------------------------


def test_check_isinstance_messages() -> None:
    check_isinstance("x", 1, int)
    check_isinstance("x", None, int, allow_none=True)
    check_isinstance("x", [1, 2], [list, tuple], inner=int)
    with pytest.raises(TypeError) as info:
        check_isinstance("device_id", "0", [list, tuple, int])
    assert str(info.value) == "device_id only support ['list', 'tuple', 'int'], but got <class 'str'>."
    with pytest.raises(TypeError) as info:
        check_isinstance("x", None, int)
    assert str(info.value) == "x only support ['int'], but got <class 'NoneType'>."
    with pytest.raises(TypeError) as info:
        check_isinstance("cluster_id", "1", int, extra_fmt="The first param ")
    assert str(info.value) == "The first param cluster_id only support ['int'], but got <class 'str'>."
    with pytest.raises(TypeError) as info:
        check_isinstance("shape", [1, "2"], list, inner=int)
    assert str(info.value) == "shape inner type only support ['int'], but got <class 'str'>."


def test_bool_is_not_an_int_unless_listed() -> None:
    with pytest.raises(TypeError):
        check_isinstance("x", True, int)
    check_isinstance("x", True, bool)
    check_isinstance("x", True, [int, bool])
    check_isinstance("x", True, object)
    with pytest.raises(TypeError):
        check_uint32("x", False)
    with pytest.raises(TypeError):
        check_list_of("x", [1, True], int)


@pytest.mark.parametrize(
    ("check", "low", "high", "c_type"),
    [
        (check_uint8, 0, 2**8 - 1, "uint8"),
        (check_uint16, 0, 2**16 - 1, "uint16"),
        (check_uint32, 0, 2**32 - 1, "uint32"),
        (check_uint64, 0, 2**64 - 1, "uint64"),
        (check_int32, -(2**31), 2**31 - 1, "int32"),
        (check_int64, -(2**63), 2**63 - 1, "int64"),
    ],
)
def test_int_range_checks(check: Any, low: int, high: int, c_type: str) -> None:
    check("v", low)
    check("v", high)
    for bad in (low - 1, high + 1):
        with pytest.raises(ValueError) as info:
            check("v", bad)
        assert str(info.value) == f"v's value is out of range,{bad} is not a {c_type} value."
    for wrong in ("1", 1.0, None, True):
        with pytest.raises(TypeError, match="v only support"):
            check("v", wrong)


def test_list_and_dict_checks() -> None:
    check_list_uint64("addrs", [0, U64_MAX])
    with pytest.raises(ValueError):
        check_list_uint64("addrs", [0, -1])
    check_list_of("ids", (1, 2), int)
    with pytest.raises(TypeError, match="ids only support"):
        check_list_of("ids", {1, 2}, int)
    check_dict("opts", {"a": "b"}, str, str)
    with pytest.raises(TypeError, match="opts only support"):
        check_dict("opts", [("a", "b")], str, str)


def test_range_checks() -> None:
    check_range_step1("r", range(0, 3))
    check_range_step1("r", range(2, 2))  # empty is left to the consumer
    check_range_step1("r", None, allow_none=True)
    with pytest.raises(TypeError, match="r only support"):
        check_range_step1("r", None)
    with pytest.raises(TypeError):
        check_range_step1("r", [0, 1])
    param_invalid(check_range_step1, "r", range(0, 4, 2))
    param_invalid(check_range_step1, "r", range(-1, 2))
    check_layer_range("r", None)
    check_layer_range("r", range(1, 2))
    with pytest.raises(TypeError):
        check_layer_range("r", None, allow_none=False)
    param_invalid(check_layer_range, "r", range(2, 2))
    param_invalid(check_layer_range, "r", range(0, 3, 2))
