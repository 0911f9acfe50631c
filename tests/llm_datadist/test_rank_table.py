"""`link()` argument checks and HCCL rank-table parsing: every rule, its order, and its exact exception."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from llm_datadist._rank_table import (
    MAX_COMM_NAME_CHARS,
    MAX_LINK_MEMBERS,
    RankTable,
    RankTableDevice,
    RankTableError,
    check_link_args,
    default_rank_table,
    parse_rank_table,
)
from llm_datadist.status import LLMException, LLMStatusCode

PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID
LINK_FAILED = LLMStatusCode.LLM_LINK_FAILED

TWO = {1: 0, 2: 1}


def _v10_table() -> dict[str, Any]:
    """A version 1.0 table as the hixl samples write it: two servers, string numbers, device IPs."""
    return {
        "version": "1.0",
        "server_count": "2",
        "status": "completed",
        "server_list": [
            {
                "server_id": "1",
                "host_ip": "10.0.0.1",
                "device": [{"device_id": "3", "device_ip": "192.168.1.3", "rank_id": "0"}],
            },
            {
                "server_id": "2",
                "host_ip": "10.0.0.2",
                "device": [{"device_id": "5", "device_ip": "192.168.2.5", "rank_id": "1"}],
            },
        ],
    }


def _vllm_ascend_table(*, same_server: bool, same_pod: bool, a3: bool = True) -> dict[str, Any]:
    """What vllm-ascend's LLMDataDistCMgrConnector.add_remote_agent builds: version 1.2, prefill rank 0,
    decode rank 1, one server entry when both sit on one server, `super_pod_list` on A3 only."""
    prefill = {"server_id": "10.0.0.1", "device_id": "0", "device_ip": "192.168.1.10", "super_device_id": "0"}
    decode = {
        "server_id": "10.0.0.1" if same_server else "10.0.0.2",
        "device_id": "1" if same_server else "0",
        "device_ip": "192.168.1.11",
        "super_device_id": "1" if same_server else "65536",
    }
    prefill_pod, decode_pod = "0", "0" if same_pod else "1"

    def entry(meta: dict[str, str], rank_id: str) -> dict[str, str]:
        keys = ("device_id", "device_ip", "super_device_id") if a3 else ("device_id", "device_ip")
        return {**{key: meta[key] for key in keys}, "rank_id": rank_id}

    servers: list[dict[str, Any]] = [{"device": [entry(prefill, "0")], "server_id": prefill["server_id"]}]
    if same_server:
        servers[0]["device"].append(entry(decode, "1"))
    else:
        servers.append({"device": [entry(decode, "1")], "server_id": decode["server_id"]})
    table: dict[str, Any] = {
        "version": "1.2",
        "server_count": "1" if same_server else "2",
        "status": "completed",
        "server_list": servers,
    }
    if a3:
        pods: list[dict[str, Any]] = [
            {"super_pod_id": prefill_pod, "server_list": [{"server_id": prefill["server_id"]}]}
        ]
        if same_pod and not same_server:
            pods[0]["server_list"].append({"server_id": decode["server_id"]})
        elif not same_pod:
            pods.append({"super_pod_id": decode_pod, "server_list": [{"server_id": decode["server_id"]}]})
        table["super_pod_list"] = pods
    return table


def _link(
    comm_name: object = "pd_comm",
    cluster_rank_info: object = None,
    rank_table: object = None,
    **kwargs: Any,
) -> tuple[str, dict[int, int], RankTable]:
    members = dict(TWO) if cluster_rank_info is None else cluster_rank_info
    table = json.dumps(_v10_table()) if rank_table is None else rank_table
    return check_link_args(comm_name, members, table, **kwargs)


def _status(exc_info: pytest.ExceptionInfo[LLMException]) -> LLMStatusCode:
    return exc_info.value.status_code


def _bad_table(table: dict[str, Any] | list[Any] | str, fragment: str) -> None:
    """parse_rank_table and check_link_args both reject the table: LINK_FAILED, naming `fragment`."""
    text = table if isinstance(table, str) else json.dumps(table)
    with pytest.raises(LLMException) as exc_info:
        parse_rank_table(text)
    assert _status(exc_info) is LINK_FAILED
    message = str(exc_info.value)
    assert message.startswith(
        "[link] failed, error code is LLMStatusCode.LLM_LINK_FAILED, invalid rank table: "
    )
    assert fragment in message
    assert isinstance(exc_info.value.__cause__, RankTableError)
    with pytest.raises(LLMException) as exc_info:
        _link(rank_table=text)
    assert _status(exc_info) is LINK_FAILED
    assert f"cluster_rank_info = {TWO}, invalid rank table: " in str(exc_info.value)
    assert fragment in str(exc_info.value)


# ------------------------------------------------------------------------------------------------ comm_name


@pytest.mark.parametrize("comm_name", [None, 7, b"pd_comm", ["pd_comm"]])
def test_comm_name_must_be_str(comm_name: object) -> None:
    with pytest.raises(TypeError, match=r"comm_name only support \['str'\]"):
        _link(comm_name=comm_name)


def test_comm_name_empty_is_param_invalid() -> None:
    with pytest.raises(LLMException, match=r"^comm_name can not be empty$") as exc_info:
        _link(comm_name="")
    assert _status(exc_info) is PARAM_INVALID


def test_comm_name_of_128_chars_is_param_invalid_and_127_pass() -> None:
    assert MAX_COMM_NAME_CHARS == 127
    with pytest.raises(LLMException, match=r"^comm_name length should be smaller than 128\.$") as exc_info:
        _link(comm_name="c" * 128)
    assert _status(exc_info) is PARAM_INVALID
    name, _, _ = _link(comm_name="c" * 127)
    assert name == "c" * 127


def test_comm_name_is_checked_before_anything_else() -> None:
    with pytest.raises(TypeError, match="comm_name"):
        check_link_args(None, "not a dict", 5)
    with pytest.raises(LLMException, match="comm_name can not be empty"):
        check_link_args("", "not a dict", 5)


# --------------------------------------------------------------------------------------- cluster_rank_info


@pytest.mark.parametrize("value", [[(1, 0), (2, 1)], ((1, 0),), "1:0,2:1", 5])
def test_cluster_rank_info_must_be_a_dict(value: object) -> None:
    with pytest.raises(TypeError, match=r"cluster_rank_info only support \['dict'\]"):
        _link(cluster_rank_info=value)


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        ({"1": 0, 2: 1}, "dict key"),
        ({1.0: 0, 2: 1}, "dict key"),
        ({True: 0, 2: 1}, "dict key"),  # bool is not an int in this project (the real checker lets it pass)
        ({1: "0", 2: 1}, "dict value"),
        ({1: 0, 2: False}, "dict value"),
        ({1: 0, 2: 1.0}, "dict value"),
    ],
)
def test_cluster_rank_info_items_must_be_ints(value: dict[object, object], pattern: str) -> None:
    with pytest.raises(TypeError, match=f"cluster_rank_info {pattern} only support"):
        _link(cluster_rank_info=value)


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        ({-1: 0, 2: 1}, "cluster_rank_info key's value is out of range,-1 is not a uint64 value."),
        ({2**64: 0, 2: 1}, f"cluster_rank_info key's value is out of range,{2**64} is not a uint64 value."),
        ({1: -1, 2: 1}, "cluster_rank_info value's value is out of range,-1 is not a uint32 value."),
        ({1: 0, 2: 2**32}, f"cluster_rank_info value's value is out of range,{2**32} is not a uint32 value."),
    ],
)
def test_cluster_rank_info_ranges_raise_value_error(value: dict[int, int], pattern: str) -> None:
    with pytest.raises(ValueError) as exc_info:
        _link(cluster_rank_info=value)
    assert str(exc_info.value) == pattern
    assert not isinstance(exc_info.value, LLMException)


def test_extreme_ids_in_range_pass() -> None:
    table = default_rank_table({0: 0, 2**64 - 1: 1})
    _, members, _ = _link(cluster_rank_info={0: 0, 2**64 - 1: 1}, rank_table=table)
    assert members == {0: 0, 2**64 - 1: 1}


def test_five_members_is_param_invalid() -> None:
    five = {cluster: rank for rank, cluster in enumerate(range(10, 15))}
    with pytest.raises(
        LLMException, match=r"^cluster_rank_info size can not be greater than 4\.$"
    ) as exc_info:
        _link(cluster_rank_info=five, rank_table=default_rank_table(five))
    assert _status(exc_info) is PARAM_INVALID


def test_size_is_checked_before_the_ranges() -> None:
    # The real order: the member count comes before the uint64/uint32 checks.
    five = {1: 0, 2: 1, 3: 2, 4: 3, 5: 2**40}
    with pytest.raises(LLMException, match="greater than 4"):
        _link(cluster_rank_info=five)


def test_four_members_pass() -> None:
    four = {40: 0, 30: 1, 20: 2, 10: 3}
    assert len(four) == MAX_LINK_MEMBERS
    _, members, table = _link(cluster_rank_info=four, rank_table=default_rank_table(four))
    assert list(members.items()) == list(four.items())
    assert [device.rank_id for device in table.devices] == [0, 1, 2, 3]


@pytest.mark.parametrize("value", [{}, {7: 0}])
def test_fewer_than_two_members_is_param_invalid(value: dict[int, int]) -> None:
    with pytest.raises(LLMException, match=r"^cluster num must be bigger than 1\.$") as exc_info:
        _link(cluster_rank_info=value)
    assert _status(exc_info) is PARAM_INVALID


def test_rank_table_type_is_checked_before_the_member_count() -> None:
    with pytest.raises(TypeError, match=r"rank_table only support \['str'\]"):
        check_link_args("pd_comm", {7: 0}, {"version": "1.0"})


@pytest.mark.parametrize("rank_table", [None, b"{}", {"version": "1.0"}, 3])
def test_rank_table_must_be_str(rank_table: object) -> None:
    with pytest.raises(TypeError, match=r"rank_table only support \['str'\]"):
        check_link_args("pd_comm", TWO, rank_table)


@pytest.mark.parametrize("value", [{1: 1, 2: 0}, {1: 0, 2: 2, 3: 1}, {5: 3, 6: 0}])
def test_descending_ranks_are_param_invalid(value: dict[int, int]) -> None:
    with pytest.raises(LLMException, match=r"^rank in cluster_rank_info must be ordered$") as exc_info:
        _link(cluster_rank_info=value)
    assert _status(exc_info) is PARAM_INVALID


def test_ranks_follow_dict_order_not_cluster_id_order() -> None:
    # Cluster ids need not be sorted; only the ranks, in insertion order.
    value = {21: 0, 5: 1}
    _, members, _ = _link(cluster_rank_info=value)
    assert list(members) == [21, 5]


def test_duplicate_ranks_are_param_invalid() -> None:
    # The real Python ordering check is non-strict, so [0, 0] passes it; the rule is caught afterwards.
    with pytest.raises(LLMException) as exc_info:
        _link(cluster_rank_info={1: 0, 2: 0})
    assert _status(exc_info) is PARAM_INVALID
    assert str(exc_info.value) == (
        "[link] failed, error code is LLMStatusCode.LLM_PARAM_INVALID, "
        "cluster_rank_info = {1: 0, 2: 0}, rank 0 is given to more than one cluster."
    )


def test_local_cluster_must_be_a_member() -> None:
    with pytest.raises(LLMException, match="local cluster id 3 does not exist") as exc_info:
        _link(local_cluster_id=3)
    assert _status(exc_info) is PARAM_INVALID
    _, members, _ = _link(local_cluster_id=2)
    assert members == TWO


def test_local_cluster_is_checked_before_the_table() -> None:
    with pytest.raises(LLMException) as exc_info:
        _link(rank_table="not json", local_cluster_id=3)
    assert _status(exc_info) is PARAM_INVALID


def test_members_are_a_plain_copy() -> None:
    given = dict(TWO)
    _, members, _ = _link(cluster_rank_info=given)
    assert members == given
    assert members is not given
    given[3] = 2
    assert members == TWO


# ------------------------------------------------------------------------------------ ranks against table


def test_rank_missing_from_table_is_link_failed() -> None:
    with pytest.raises(LLMException) as exc_info:
        _link(cluster_rank_info={1: 0, 2: 2})
    assert _status(exc_info) is LINK_FAILED
    assert str(exc_info.value) == (
        "[link] failed, error code is LLMStatusCode.LLM_LINK_FAILED, cluster_rank_info = {1: 0, 2: 2}, "
        "invalid rank table: rank 2 of cluster 2 is not in the rank table."
    )


def test_rank_ids_below_a_member_rank_must_all_be_present() -> None:
    # HCCL takes the rank-th device after sorting by rank_id: a table with ranks {0, 5} cannot host rank 5.
    table = _v10_table()
    table["server_list"][1]["device"][0]["rank_id"] = "5"
    with pytest.raises(LLMException, match="without gaps up to rank 5 of cluster 2") as exc_info:
        _link(cluster_rank_info={1: 0, 2: 5}, rank_table=json.dumps(table))
    assert _status(exc_info) is LINK_FAILED


def test_unused_devices_in_the_table_are_fine() -> None:
    _, _, table = _link(cluster_rank_info={8: 1, 9: 3}, rank_table=default_rank_table({1: 0, 2: 3}))
    assert [device.rank_id for device in table.devices] == [0, 1, 2, 3]


# --------------------------------------------------------------------------------------- table: positive


def test_v10_table_with_string_numbers() -> None:
    text = json.dumps(_v10_table())
    table = parse_rank_table(text)
    assert table.version == "1.0"
    assert table.devices == (
        RankTableDevice(rank_id=0, device_id=3, device_ip="192.168.1.3", server_id="1"),
        RankTableDevice(rank_id=1, device_id=5, device_ip="192.168.2.5", server_id="2"),
    )
    assert table.raw == _v10_table()
    assert table.device(1) == table.devices[1]
    assert table.device(2) is None


def test_integer_numbers_are_accepted() -> None:
    raw = _v10_table()
    raw["server_count"] = 2
    for server in raw["server_list"]:
        for device in server["device"]:
            device["rank_id"] = int(device["rank_id"])
            device["device_id"] = int(device["device_id"])
    assert parse_rank_table(json.dumps(raw)) == parse_rank_table(json.dumps(_v10_table()))


@pytest.mark.parametrize(("same_server", "same_pod"), [(False, False), (False, True), (True, True)])
def test_vllm_ascend_v12_table_with_super_pods(same_server: bool, same_pod: bool) -> None:
    raw = _vllm_ascend_table(same_server=same_server, same_pod=same_pod)
    prefill_cluster, decode_cluster = 1_000_001, 2_000_002
    name = "pd_comm_192.168.1.10_192.168.1.11"
    comm_name, members, table = check_link_args(
        name, {prefill_cluster: 0, decode_cluster: 1}, json.dumps(raw), local_cluster_id=decode_cluster
    )
    assert comm_name == name
    assert members == {prefill_cluster: 0, decode_cluster: 1}
    assert table.version == "1.2"
    assert [device.rank_id for device in table.devices] == [0, 1]
    assert [device.device_ip for device in table.devices] == ["192.168.1.10", "192.168.1.11"]
    assert (table.devices[0].server_id == table.devices[1].server_id) is same_server
    assert table.raw["super_pod_list"] == raw["super_pod_list"]


def test_vllm_ascend_v12_table_without_super_pods_on_a2() -> None:
    raw = _vllm_ascend_table(same_server=False, same_pod=False, a3=False)
    assert "super_pod_list" not in raw
    assert [device.device_id for device in parse_rank_table(json.dumps(raw)).devices] == [0, 0]


def test_devices_are_sorted_by_rank_id() -> None:
    raw = _v10_table()
    raw["server_list"][0]["device"][0]["rank_id"] = "1"
    raw["server_list"][1]["device"][0]["rank_id"] = "0"
    table = parse_rank_table(json.dumps(raw))
    assert [(device.rank_id, device.server_id) for device in table.devices] == [(0, "2"), (1, "1")]


def test_one_server_needs_no_device_ip() -> None:
    raw = {
        "version": "1.0",
        "server_list": [
            {
                "server_id": "local",
                "device": [
                    {"device_id": "0", "rank_id": "0"},
                    {"device_id": "1", "rank_id": "1", "device_ip": ""},
                ],
            }
        ],
    }
    table = parse_rank_table(json.dumps(raw))
    assert [device.device_ip for device in table.devices] == [None, None]


def test_several_servers_need_device_ip_unless_host_ip() -> None:
    raw = _v10_table()
    for server in raw["server_list"]:
        del server["device"][0]["device_ip"]
    assert [device.device_ip for device in parse_rank_table(json.dumps(raw)).devices] == [None, None]
    del raw["server_list"][1]["host_ip"]
    _bad_table(raw, "server_list[1].device[0] has no device_ip, which a table with several servers needs")


def test_device_ip_may_list_several_addresses_and_ipv6() -> None:
    raw = _v10_table()
    raw["server_list"][0]["device"][0]["device_ip"] = "192.168.1.3,192.168.1.4"
    raw["server_list"][1]["device"][0]["device_ip"] = "fd00::5,fd00::6"
    table = parse_rank_table(json.dumps(raw))
    assert table.devices[0].device_ip == "192.168.1.3,192.168.1.4"


def test_status_and_unknown_fields_are_ignored() -> None:
    raw = _v10_table()
    raw["status"] = "initializing"
    raw["server_list"][0]["container_ip"] = "172.17.0.2"
    raw["server_list"][0]["device"][0]["device_port"] = "16666"
    assert parse_rank_table(json.dumps(raw)).raw["status"] == "initializing"


def test_v10_table_ignores_super_pod_list() -> None:
    raw = _v10_table()
    raw["super_pod_list"] = [{"super_pod_id": "0", "server_list": [{"server_id": "nowhere"}]}]
    assert parse_rank_table(json.dumps(raw)).version == "1.0"


def test_rank_table_is_hashable_and_compares_without_raw() -> None:
    one = parse_rank_table(json.dumps(_v10_table()))
    raw = _v10_table()
    raw["status"] = "other"
    two = parse_rank_table(json.dumps(raw))
    assert one == two
    assert hash(one) == hash(two)


# ----------------------------------------------------------------------------------------- default table


@pytest.mark.parametrize("members", [TWO, {9: 0, 8: 1, 7: 2, 6: 3}, {5: 1, 6: 3}])
def test_default_rank_table_round_trip(members: dict[int, int]) -> None:
    text = default_rank_table(members)
    raw = json.loads(text)
    assert raw["version"] == "1.0"
    assert raw["server_count"] == "1"
    assert raw["status"] == "completed"
    assert [server["server_id"] for server in raw["server_list"]] == ["127.0.0.1"]
    _, checked, table = check_link_args("demo", members, text)
    assert checked == members
    top = max(members.values())
    assert table.devices == tuple(
        RankTableDevice(rank_id=rank, device_id=rank, device_ip=None, server_id="127.0.0.1")
        for rank in range(top + 1)
    )


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ({}, ValueError),
        ({1: 4096}, ValueError),
        ({1: -1}, ValueError),
        ({1: True}, TypeError),
        ([], TypeError),
    ],
)
def test_default_rank_table_rejects(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        default_rank_table(value)


# --------------------------------------------------------------------------------------- table: negative


@pytest.mark.parametrize("text", ["", "not json", "{", '{"version": "1.0",}', "[" * 100_000])
def test_non_json_text(text: str) -> None:
    _bad_table(text, "not valid JSON")


@pytest.mark.parametrize(
    ("value", "kind"), [([_v10_table()], "an array"), ("1.0", "a string"), (12, "a number"), (None, "null")]
)
def test_top_level_must_be_an_object(value: Any, kind: str) -> None:
    _bad_table(json.dumps(value), f"the top level must be a JSON object, not {kind}")


@pytest.mark.parametrize("version", ["2.0", "1.1", "1.3", "", 1.0, 1, None])
def test_unsupported_version(version: Any) -> None:
    raw = _v10_table()
    raw["version"] = version
    _bad_table(raw, f"version must be one of ['1.0', '1.2'], got {version!r}")


def test_missing_version() -> None:
    raw = _v10_table()
    del raw["version"]
    _bad_table(raw, "version must be one of")


@pytest.mark.parametrize("server_list", [[], {}, "servers", None])
def test_server_list_must_be_a_non_empty_list(server_list: Any) -> None:
    raw = _v10_table()
    raw["server_list"] = server_list
    _bad_table(raw, "server_list must be a non-empty list")


@pytest.mark.parametrize("count", ["1", "3", 3, "0"])
def test_server_count_mismatch(count: Any) -> None:
    raw = _v10_table()
    raw["server_count"] = count
    _bad_table(raw, f"server_count is {int(count)} but server_list has 2 servers")


@pytest.mark.parametrize("count", ["two", "-2", "2.0", " 2", True, 2.0, None])
def test_server_count_must_be_a_number(count: Any) -> None:
    raw = _v10_table()
    raw["server_count"] = count
    _bad_table(raw, f"server_count must be a decimal number, got {count!r}")


@pytest.mark.parametrize("key", ["rank_id", "device_id"])
def test_missing_device_field(key: str) -> None:
    raw = _v10_table()
    del raw["server_list"][1]["device"][0][key]
    _bad_table(raw, f"server_list[1].device[0] has no {key}")


@pytest.mark.parametrize("rank_id", ["-1", "1.5", "", "0x1", "\u0663", True, 1.0, None, [1]])
def test_rank_id_must_be_a_decimal_number(rank_id: Any) -> None:
    raw = _v10_table()
    raw["server_list"][0]["device"][0]["rank_id"] = rank_id
    _bad_table(raw, f"server_list[0].device[0].rank_id must be a decimal number, got {rank_id!r}")


def test_rank_id_out_of_range() -> None:
    raw = _v10_table()
    raw["server_list"][0]["device"][0]["rank_id"] = str(2**32)
    _bad_table(raw, f"server_list[0].device[0].rank_id is out of range: {2**32}")


def test_duplicate_rank_id() -> None:
    raw = _v10_table()
    raw["server_list"][1]["device"][0]["rank_id"] = 0  # an int equal to the other's "0"
    _bad_table(raw, "rank_id 0 is used by more than one device")


@pytest.mark.parametrize(
    "device_ip", ["300.1.1.1", "192.168.1", "abc", "192.168.1.3 ", "192.168.1.3,", "01.2.3.4", "::g"]
)
def test_bad_device_ip(device_ip: str) -> None:
    raw = _v10_table()
    raw["server_list"][0]["device"][0]["device_ip"] = device_ip
    _bad_table(raw, f"server_list[0].device[0].device_ip {device_ip!r} is not a valid IP address")


def test_device_ip_must_be_a_string() -> None:
    raw = _v10_table()
    raw["server_list"][0]["device"][0]["device_ip"] = 3232235779  # 192.168.1.3 as an int
    _bad_table(raw, "server_list[0].device[0].device_ip must be a string, got 3232235779")


def test_device_ip_used_twice() -> None:
    raw = _v10_table()
    raw["server_list"][1]["device"][0]["device_ip"] = "192.168.1.3"
    _bad_table(raw, "server_list[1].device[0].device_ip 192.168.1.3 is used by more than one device")


def test_device_ip_counts_must_match() -> None:
    raw = _v10_table()
    raw["server_list"][0]["device"][0]["device_ip"] = "192.168.1.3,192.168.1.4"
    _bad_table(raw, "every device must list the same number of device IPs")


def test_bad_host_ip() -> None:
    raw = _v10_table()
    raw["server_list"][0]["host_ip"] = "host-1"
    _bad_table(raw, "server_list[0].host_ip 'host-1' is not a valid IP address")


@pytest.mark.parametrize("server_id", ["", None, 1])
def test_server_id_must_be_a_non_empty_string(server_id: Any) -> None:
    raw = _v10_table()
    raw["server_list"][0]["server_id"] = server_id
    _bad_table(raw, f"server_list[0].server_id must be a non-empty string, got {server_id!r}")


def test_server_id_listed_twice() -> None:
    raw = _v10_table()
    raw["server_list"][1]["server_id"] = "1"
    _bad_table(raw, "server_id '1' is listed twice")


@pytest.mark.parametrize("server", [[], "server", None])
def test_server_must_be_an_object(server: Any) -> None:
    raw = _v10_table()
    raw["server_list"][0] = server
    _bad_table(raw, "server_list[0] must be an object")


@pytest.mark.parametrize("device_list", [[], None, {"device_id": "0", "rank_id": "0"}])
def test_device_list_must_be_a_non_empty_list(device_list: Any) -> None:
    raw = _v10_table()
    raw["server_list"][0]["device"] = device_list
    _bad_table(raw, "server_list[0].device must be a non-empty list")


def test_device_must_be_an_object() -> None:
    raw = _v10_table()
    raw["server_list"][0]["device"] = ["0"]
    _bad_table(raw, "server_list[0].device[0] must be an object, not a string")


# ----------------------------------------------------------------------------------- table: super pods (1.2)


def _a3() -> dict[str, Any]:
    return _vllm_ascend_table(same_server=False, same_pod=False)


def test_super_pod_names_an_unknown_server() -> None:
    raw = _a3()
    raw["super_pod_list"][1]["server_list"][0]["server_id"] = "10.9.9.9"
    _bad_table(
        raw, "super_pod_list[1].server_list[0] names server_id '10.9.9.9', which is not in server_list"
    )


def test_every_server_must_be_in_a_super_pod() -> None:
    raw = _a3()
    del raw["super_pod_list"][1]
    _bad_table(raw, "server_id '10.0.0.2' is in no super pod of super_pod_list")


def test_server_in_two_super_pods() -> None:
    raw = _a3()
    raw["super_pod_list"][1]["server_list"].append({"server_id": "10.0.0.1"})
    _bad_table(raw, "server_id '10.0.0.1' is in more than one super pod")


def test_duplicate_super_pod_id() -> None:
    raw = _a3()
    raw["super_pod_list"][1]["super_pod_id"] = "0"
    _bad_table(raw, "super_pod_id '0' is listed twice")


@pytest.mark.parametrize("pod_id", ["", None, True])
def test_bad_super_pod_id(pod_id: Any) -> None:
    raw = _a3()
    raw["super_pod_list"][0]["super_pod_id"] = pod_id
    _bad_table(raw, "super_pod_list[0].super_pod_id must be a non-empty string")


def test_super_pods_need_super_device_ids() -> None:
    raw = _a3()
    del raw["server_list"][1]["device"][0]["super_device_id"]
    _bad_table(raw, "rank_id 1 has no super_device_id, which super pods need")


def test_super_device_id_unique_within_a_pod() -> None:
    raw = _vllm_ascend_table(same_server=False, same_pod=True)
    raw["server_list"][1]["device"][0]["super_device_id"] = "0"
    _bad_table(raw, "super_device_id 0 is used twice in super pod '0'")
    # ... but the same number in two different pods is fine.
    other = _a3()
    other["server_list"][1]["device"][0]["super_device_id"] = "0"
    assert parse_rank_table(json.dumps(other)).version == "1.2"


def test_super_device_id_must_be_a_number() -> None:
    raw = _a3()
    raw["server_list"][0]["device"][0]["super_device_id"] = "sd0"
    _bad_table(raw, "server_list[0].device[0].super_device_id must be a decimal number, got 'sd0'")


@pytest.mark.parametrize("pods", [{}, "pods", [["0"]], [{"super_pod_id": "0", "server_list": "10.0.0.1"}]])
def test_malformed_super_pod_list(pods: Any) -> None:
    raw = _a3()
    raw["super_pod_list"] = pods
    _bad_table(raw, "super_pod_list")


def test_parse_rank_table_requires_str() -> None:
    with pytest.raises(TypeError, match=r"rank_table only support \['str'\]"):
        parse_rank_table(json.loads(json.dumps(_v10_table())))


def test_parse_does_not_touch_the_input() -> None:
    raw = _a3()
    before = copy.deepcopy(raw)
    parse_rank_table(json.dumps(raw))
    assert raw == before
