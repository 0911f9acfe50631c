"""HCCL rank tables and the argument checks of the two-sided `link()` (reference §5.6).

`check_link_args` runs the checks of the real `LLMDataDist.link` in the real order: the Python-side ones
raise TypeError / ValueError / LLMException(LLM_PARAM_INVALID) with the real messages, then come the engine's
and HCCL's. A rank table HCCL refuses makes the real `link` fail with LLM_LINK_FAILED, and so it does here.
On one host the table is validated but its device IPs are never used: ranks only order the members.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from typing import Any

from llm_datadist._validate import U32_MAX, check_dict, check_isinstance, check_uint32, check_uint64
from llm_datadist.status import LLMStatusCode, make_error, raise_if_false, raise_if_true

__all__ = [
    "MAX_COMM_NAME_CHARS",
    "MAX_LINK_MEMBERS",
    "SUPPORTED_VERSIONS",
    "RankTable",
    "RankTableDevice",
    "RankTableError",
    "check_link_args",
    "default_rank_table",
    "parse_rank_table",
]

MAX_LINK_MEMBERS = 4  # the real `_MAX_NODE_NUM`
MAX_COMM_NAME_CHARS = 127  # the real check is `len(comm_name) < 128` (`_MAX_CLUSTER_NAME`)
SUPPORTED_VERSIONS = ("1.0", "1.2")  # the versions HCCL's "concise" parser takes; 1.2 is the super-pod form
_SUPER_POD_VERSION = "1.2"

# The engine hands the table to HcclCommInitClusterInfoMemConfig and turns any failure into LLM_LINK_FAILED
# (hixl `CommLinkManager::Link`); only the checks before that call answer LLM_PARAM_INVALID.
_TABLE_REJECTED = LLMStatusCode.LLM_LINK_FAILED

# default_rank_table lists every rank from 0 to the highest member rank; this bounds the table it writes.
_MAX_DEFAULT_RANKS = 4096


class RankTableError(ValueError):
    """What is wrong with a rank table. Internal: the public entry points turn it into `LLMException`."""


@dataclass(frozen=True)
class RankTableDevice:
    """One `device` entry of a rank table, with its server's `server_id`."""

    rank_id: int
    device_id: int
    device_ip: str | None  # as written (HCCL allows a comma-separated list); None when absent or ""
    server_id: str


@dataclass(frozen=True)
class RankTable:
    """A parsed rank table: `devices` sorted by rank_id; `raw` is the decoded JSON object, kept as given."""

    version: str
    devices: tuple[RankTableDevice, ...]
    raw: dict[str, Any] = field(compare=False, repr=False)

    def device(self, rank_id: int) -> RankTableDevice | None:
        """The device with this rank_id, or None."""
        for device in self.devices:
            if device.rank_id == rank_id:
                return device
        return None


def check_link_args(
    comm_name: object,
    cluster_rank_info: object,
    rank_table: object,
    *,
    local_cluster_id: int | None = None,
) -> tuple[str, dict[int, int], RankTable]:
    """Validate the arguments of `link(comm_name, cluster_rank_info, rank_table)` as the real one does.

    Returns `(comm_name, members, table)`: `members` is a copy of `cluster_rank_info` (in its order, plain
    ints), so later changes to the caller's dict do not reach us. With `local_cluster_id`, a dict that leaves
    the caller out is rejected, as the engine does before it reads the table.

    Raises, in this order: TypeError / ValueError / LLMException(LLM_PARAM_INVALID) for the Python-side
    checks (real messages, such as "rank in cluster_rank_info must be ordered");
    LLMException(LLM_PARAM_INVALID) for a rank given to two clusters (the real Python lets that through to
    the engine, which cannot build such a communicator) and for a missing local cluster;
    LLMException(LLM_LINK_FAILED) when HCCL would reject the table, or would not find a member's rank in it.
    """
    check_isinstance("comm_name", comm_name, str)
    assert isinstance(comm_name, str)
    raise_if_true(len(comm_name) == 0, "comm_name can not be empty")
    raise_if_false(len(comm_name) <= MAX_COMM_NAME_CHARS, "comm_name length should be smaller than 128.")
    check_isinstance("cluster_rank_info", cluster_rank_info, dict)
    check_dict("cluster_rank_info", cluster_rank_info, int, int)
    assert isinstance(cluster_rank_info, dict)
    raise_if_false(
        len(cluster_rank_info) <= MAX_LINK_MEMBERS, "cluster_rank_info size can not be greater than 4."
    )
    for cluster_id, rank in cluster_rank_info.items():
        check_uint64("cluster_rank_info key", cluster_id)
        check_uint32("cluster_rank_info value", rank)
    check_isinstance("rank_table", rank_table, str)
    assert isinstance(rank_table, str)
    ranks = [int(rank) for rank in cluster_rank_info.values()]
    raise_if_false(len(ranks) > 1, "cluster num must be bigger than 1.")
    # Non-strict, as in the real check: equal ranks pass here and are caught below.
    raise_if_false(ranks == sorted(ranks), "rank in cluster_rank_info must be ordered")
    # The real code also checks that the cluster ids are unique; dict keys always are, so nothing to do.

    members = {int(cluster_id): int(rank) for cluster_id, rank in cluster_rank_info.items()}
    context = f"cluster_rank_info = {members}"
    if len(set(ranks)) != len(ranks):
        shared = next(rank for rank in ranks if ranks.count(rank) > 1)
        raise make_error(
            "link",
            LLMStatusCode.LLM_PARAM_INVALID,
            f"{context}, rank {shared} is given to more than one cluster",
        )
    if local_cluster_id is not None and local_cluster_id not in members:
        raise make_error(
            "link",
            LLMStatusCode.LLM_PARAM_INVALID,
            f"{context}, local cluster id {local_cluster_id} does not exist in it",
        )
    try:
        table = _parse(rank_table)
        _check_members(table, members)
    except RankTableError as exc:
        raise make_error("link", _TABLE_REJECTED, f"{context}, invalid rank table: {exc}") from exc
    return comm_name, members, table


def parse_rank_table(text: str) -> RankTable:
    """Parse and validate an HCCL rank table (version 1.0, or 1.2 with `super_pod_list`).

    The rules are those of HCCL's rank-table parser that do not need hardware: a JSON object; version "1.0"
    or "1.2"; a non-empty `server_list` whose `server_count`, when present, matches its length; unique,
    non-empty `server_id`s; each server a non-empty `device` list; each device a `rank_id` and a `device_id`
    (decimal strings, or ints, up to 2**32 - 1); unique rank_ids; `device_ip`, when set, one IP or a
    comma-separated list of IPs, each used once and the same count on every device, and required on every
    device of a table with more than one server unless its server has a `host_ip`. A 1.2 table with
    `super_pod_list` must place every server in exactly one super pod and give each device a
    `super_device_id`, unique within its pod (a 1.0 table's `super_pod_list` is ignored, as HCCL does).
    `status` is not checked. Numbers the real HCCL reads as strings are also accepted as ints.

    Raises TypeError unless `text` is a str, and LLMException(LLM_LINK_FAILED) naming the fault otherwise.
    """
    check_isinstance("rank_table", text, str)
    try:
        return _parse(text)
    except RankTableError as exc:
        raise make_error("link", _TABLE_REJECTED, f"invalid rank table: {exc}") from exc


def default_rank_table(cluster_rank_info: dict[int, int]) -> str:
    """A minimal valid version 1.0 rank table for `cluster_rank_info`, for demos and tests.

    One server ("127.0.0.1") with one device per rank from 0 to the highest rank in `cluster_rank_info`
    (device_id = rank, no device_ip): HCCL needs the rank_ids below a member's rank to be present, so gaps
    are filled. TypeError / ValueError for a dict that is not cluster id -> uint32 rank, is empty, or has a
    rank of 4096 or more.
    """
    check_dict("cluster_rank_info", cluster_rank_info, int, int)
    for rank in cluster_rank_info.values():
        check_uint32("cluster_rank_info value", rank)
    if not cluster_rank_info:
        raise ValueError("cluster_rank_info must not be empty.")
    top_rank = max(cluster_rank_info.values())
    if top_rank >= _MAX_DEFAULT_RANKS:
        raise ValueError(
            f"rank {top_rank} is too large for a default rank table (limit {_MAX_DEFAULT_RANKS})."
        )
    devices = [{"device_id": str(rank), "rank_id": str(rank)} for rank in range(top_rank + 1)]
    table = {
        "version": "1.0",
        "server_count": "1",
        "server_list": [{"server_id": "127.0.0.1", "device": devices}],
        "status": "completed",
    }
    return json.dumps(table)


# ---------------------------------------------------------------------------------------------- internals


def _parse(text: str) -> RankTable:
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; deep nesting recurses
        raise RankTableError(f"not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise RankTableError(f"the top level must be a JSON object, not {_json_type(obj)}")
    version = obj.get("version")
    if not isinstance(version, str) or version not in SUPPORTED_VERSIONS:
        raise RankTableError(f"version must be one of {list(SUPPORTED_VERSIONS)}, got {version!r}")
    server_list = obj.get("server_list")
    if not isinstance(server_list, list) or not server_list:
        raise RankTableError(f"server_list must be a non-empty list, got {server_list!r}")
    if "server_count" in obj:
        server_count = _number(obj["server_count"], "server_count")
        if server_count != len(server_list):
            raise RankTableError(
                f"server_count is {server_count} but server_list has {len(server_list)} servers"
            )

    devices: list[RankTableDevice] = []
    super_device_ids: dict[int, int | None] = {}  # rank_id -> super_device_id, for the super-pod checks
    ip_counts: set[int] = set()
    seen_ips: set[str] = set()
    server_ids: list[str] = []
    for server_index, server in enumerate(server_list):
        where = f"server_list[{server_index}]"
        if not isinstance(server, dict):
            raise RankTableError(f"{where} must be an object, not {_json_type(server)}")
        server_id = server.get("server_id")
        if not isinstance(server_id, str) or not server_id:
            raise RankTableError(f"{where}.server_id must be a non-empty string, got {server_id!r}")
        if server_id in server_ids:
            raise RankTableError(f"server_id {server_id!r} is listed twice")
        server_ids.append(server_id)
        has_host_ip = "host_ip" in server
        if has_host_ip:
            _ips(server["host_ip"], f"{where}.host_ip", set())
        device_list = server.get("device")
        if not isinstance(device_list, list) or not device_list:
            raise RankTableError(f"{where}.device must be a non-empty list, got {device_list!r}")
        for device_index, device in enumerate(device_list):
            dwhere = f"{where}.device[{device_index}]"
            if not isinstance(device, dict):
                raise RankTableError(f"{dwhere} must be an object, not {_json_type(device)}")
            for key in ("rank_id", "device_id"):
                if key not in device:
                    raise RankTableError(f"{dwhere} has no {key}")
            rank_id = _number(device["rank_id"], f"{dwhere}.rank_id")
            device_id = _number(device["device_id"], f"{dwhere}.device_id")
            ips = _ips(device.get("device_ip"), f"{dwhere}.device_ip", seen_ips)
            # Across servers HCCL connects over the device NICs (or the host's, given host_ip); inside one
            # server it does not need them, which is why a one-host table may leave device_ip out.
            if not ips and len(server_list) > 1 and not has_host_ip:
                raise RankTableError(f"{dwhere} has no device_ip, which a table with several servers needs")
            ip_counts.add(max(len(ips), 1))  # HCCL counts an absent device_ip as one (invalid) address
            if rank_id in super_device_ids:
                raise RankTableError(f"rank_id {rank_id} is used by more than one device")
            super_device_ids[rank_id] = (
                _number(device["super_device_id"], f"{dwhere}.super_device_id")
                if "super_device_id" in device
                else None
            )
            device_ip = device.get("device_ip") if ips else None
            devices.append(RankTableDevice(rank_id, device_id, device_ip, server_id))
    if len(ip_counts) > 1:
        raise RankTableError("every device must list the same number of device IPs")
    if version == _SUPER_POD_VERSION and "super_pod_list" in obj:
        _check_super_pods(obj["super_pod_list"], devices, server_ids, super_device_ids)
    devices.sort(key=lambda device: device.rank_id)
    return RankTable(version=version, devices=tuple(devices), raw=obj)


def _check_super_pods(
    super_pod_list: object,
    devices: list[RankTableDevice],
    server_ids: list[str],
    super_device_ids: dict[int, int | None],
) -> None:
    if not isinstance(super_pod_list, list):
        raise RankTableError(f"super_pod_list must be a list, not {_json_type(super_pod_list)}")
    pod_of_server: dict[str, str] = {}
    pod_ids: set[str] = set()
    for pod_index, pod in enumerate(super_pod_list):
        where = f"super_pod_list[{pod_index}]"
        if not isinstance(pod, dict):
            raise RankTableError(f"{where} must be an object, not {_json_type(pod)}")
        pod_id = pod.get("super_pod_id")
        if isinstance(pod_id, int) and not isinstance(pod_id, bool):
            pod_id = str(pod_id)
        if not isinstance(pod_id, str) or not pod_id:
            raise RankTableError(f"{where}.super_pod_id must be a non-empty string, got {pod_id!r}")
        if pod_id in pod_ids:
            raise RankTableError(f"super_pod_id {pod_id!r} is listed twice")
        pod_ids.add(pod_id)
        members = pod.get("server_list")
        if not isinstance(members, list):
            raise RankTableError(f"{where}.server_list must be a list, got {members!r}")
        for member_index, member in enumerate(members):
            server_id = member.get("server_id") if isinstance(member, dict) else None
            if server_id not in server_ids:
                raise RankTableError(
                    f"{where}.server_list[{member_index}] names server_id {server_id!r}, "
                    "which is not in server_list"
                )
            assert isinstance(server_id, str)
            if server_id in pod_of_server:
                raise RankTableError(f"server_id {server_id!r} is in more than one super pod")
            pod_of_server[server_id] = pod_id
    missing = [server_id for server_id in server_ids if server_id not in pod_of_server]
    if missing:
        raise RankTableError(f"server_id {missing[0]!r} is in no super pod of super_pod_list")
    seen: set[tuple[str, int]] = set()
    for device in devices:
        super_device_id = super_device_ids[device.rank_id]
        if super_device_id is None:
            raise RankTableError(f"rank_id {device.rank_id} has no super_device_id, which super pods need")
        key = (pod_of_server[device.server_id], super_device_id)
        if key in seen:
            raise RankTableError(f"super_device_id {super_device_id} is used twice in super pod {key[0]!r}")
        seen.add(key)


def _check_members(table: RankTable, members: dict[int, int]) -> None:
    for cluster_id, rank in members.items():
        if table.device(rank) is None:
            raise RankTableError(f"rank {rank} of cluster {cluster_id} is not in the rank table")
        # HCCL sorts the devices by rank_id and takes the rank-th one as its own, so every rank below a
        # member's must be in the table too.
        if rank >= len(table.devices) or table.devices[rank].rank_id != rank:
            raise RankTableError(
                f"the rank_ids must run from 0 without gaps up to rank {rank} of cluster {cluster_id}"
            )


def _number(value: object, where: str) -> int:
    # HCCL reads these as decimal strings; ints are common in hand-written tables, so both pass. A bool is
    # never a number here, and str.isdigit alone would let non-ASCII digits ("٣") through.
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.isascii() and value.isdigit():
        number = int(value)
    else:
        raise RankTableError(f"{where} must be a decimal number, got {value!r}")
    if not 0 <= number <= U32_MAX:
        raise RankTableError(f"{where} is out of range: {number}")
    return number


def _ips(value: object, where: str, seen: set[str]) -> list[str]:
    """The addresses of a device_ip / host_ip field ([] when absent or ""), each checked and used once."""
    if value is None or value == "":
        return []
    if not isinstance(value, str):
        raise RankTableError(f"{where} must be a string, got {value!r}")
    addresses = []
    for part in value.split(","):
        try:
            address = str(ipaddress.ip_address(part))
        except ValueError:
            raise RankTableError(f"{where} {value!r} is not a valid IP address") from None
        if address in seen:
            raise RankTableError(f"{where} {address} is used by more than one device")
        seen.add(address)
        addresses.append(address)
    return addresses


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")
