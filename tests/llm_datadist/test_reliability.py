"""Long-lived processes: what an owner does to its caches while peers hold leases never stops its server,
a peer restarted at the same address is a new peer, pullers unmap what owners retired, and every bound
(replies unread, leases, links, table size) has a clear error. Real processes, sockets and shared memory."""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)
from llm_datadist._errors import PeerGone, StatusError
from llm_datadist._keys import KEY_BLOCKS
from llm_datadist._owner import leases as _leases
from llm_datadist._owner.leases import Leases
from llm_datadist._owner.service import CacheService, NodeHooks
from llm_datadist._owner.table import CacheTable
from llm_datadist._protocol.frames import encode_frame
from llm_datadist._protocol.messages import (
    PROTOCOL_VERSION,
    RULES_V1,
    RULES_V2,
    Hello,
    Location,
    Ping,
    PinRequest,
    Pong,
    Release,
    Table,
    TableRequest,
)
from llm_datadist._puller import links as _links
from llm_datadist._shm.pool import Pool
from llm_datadist._wire import conn as _conn
from llm_datadist._wire.client import ClientLink
from llm_datadist._wire.server import Server
from llm_datadist.ext import tensor_views
from tests._peer import PROMPT_IP, PromptPeer, decoder, tensor_views_v2

P, D = 1, 2
_ports = itertools.count(24100)


def _v2_extra(*, page_shift: int = 16, sync_kv_timeout_ms: int | None = None) -> dict[str, str]:
    extra = {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.MemPoolConfig": json.dumps({"memory_size": 64 << 20, "page_shift": page_shift}),
    }
    if sync_kv_timeout_ms is not None:
        extra["llm.SyncKvCacheWaitTime"] = str(sync_kv_timeout_ms)
    return extra


class _V2:
    """This process as a v2 instance with remote cache access and a pool; finalized on exit."""

    def __init__(self) -> None:
        self.dd = LLMDataDist(LLMRole.DECODER, D)
        config = LLMConfig()
        config.device_id = 0
        config.sync_kv_timeout = 5000
        options = dict(config.generate_options())
        options.update(_v2_extra())
        self.dd.init(options)

    def __enter__(self) -> LLMDataDist:
        return self.dd

    def __exit__(self, *exc: object) -> None:
        self.dd.finalize()


def _cluster(port: int) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = P
    info.append_local_ip_info(PROMPT_IP, 0)
    info.append_remote_ip_info(PROMPT_IP, port)
    return info


def _blocks(dd: LLMDataDist, num_blocks: int, block_elems: int) -> tuple[list[np.ndarray], Cache]:
    desc = CacheDesc(2, [num_blocks, block_elems], DataType.DT_FLOAT16)
    cache = dd.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(D, 0))
    return [view.reshape(num_blocks, -1) for view in tensor_views_v2(cache)], cache


def _raw_link(runtime: Path, port: int) -> ClientLink:
    return ClientLink.connect(
        runtime / f"{PROMPT_IP}_{port}.sock",
        cluster_id=77,
        remote_cluster_id=P,
        role=2,
        deadline=time.monotonic() + 5,
        incarnation=77,
    )


def _ping(link: ClientLink) -> None:
    seq = link.next_seq()
    assert isinstance(link.request(Ping(seq), seq, time.monotonic() + 5), Pong)


# ---------------------------------------------------------------------------- the owner's server survives


def test_unregister_waits_for_a_peers_lease_and_the_server_keeps_serving(
    seed: int, _runtime_dir: Path
) -> None:
    port = next(_ports)
    with PromptPeer(P, port, seed, extra=_v2_extra(sync_kv_timeout_ms=3000)) as peer:
        cache_id = peer.call("v2_register_blocks", (2, [8, 64], 5, True))
        holder = _raw_link(_runtime_dir, port)
        try:
            seq = holder.next_seq()
            request = PinRequest(seq, KEY_BLOCKS, 0, 5, 0, 0, 2, True, 0, 0, False, False, RULES_V2)
            location = holder.request(request, seq, time.monotonic() + 5)
            assert isinstance(location, Location)
            # The owner unregisters while we hold the lease: it waits for us (its caller reuses the memory
            # as soon as the call returns) instead of letting our Release meet a cache it forgot.
            peer.call_start("v2_unregister", cache_id)
            time.sleep(0.3)
            holder.send_only(Release(location.lease_id, True), time.monotonic() + 5)
            assert peer.call_finish() is None
            _ping(holder)  # the server thread is alive and serves this very connection
            seq = holder.next_seq()
            again = PinRequest(seq, KEY_BLOCKS, 0, 5, 0, 0, 2, True, 0, 0, False, False, RULES_V2)
            with pytest.raises(StatusError) as info:
                holder.request(again, seq, time.monotonic() + 5)
            assert info.value.code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        finally:
            holder.close(say_bye=True)
        assert peer.stats()["leases"] == 0


def test_unregister_times_out_while_a_lease_is_held_and_a_dead_holder_frees_it(
    seed: int, _runtime_dir: Path
) -> None:
    port = next(_ports)
    with PromptPeer(P, port, seed, extra=_v2_extra(sync_kv_timeout_ms=300)) as peer:
        cache_id = peer.call("v2_register_blocks", (2, [8, 64], 5, True))
        holder = _raw_link(_runtime_dir, port)
        seq = holder.next_seq()
        location = holder.request(
            PinRequest(seq, KEY_BLOCKS, 0, 5, 0, 0, 2, True, 0, 0, False, False, RULES_V2),
            seq,
            time.monotonic() + 5,
        )
        assert isinstance(location, Location)
        with pytest.raises(RuntimeError, match="LLM_TIMEOUT"):
            peer.call("v2_unregister", cache_id)
        # The holder goes away without releasing: its connection's leases go with it, and the owner's
        # server is unharmed by the cache having lost its keys meanwhile.
        holder.close(say_bye=False)
        deadline = time.monotonic() + 5
        while peer.call("stats")["leases"] and time.monotonic() < deadline:
            time.sleep(0.01)
        peer.call("v2_unregister", cache_id)
        again = _raw_link(_runtime_dir, port)
        _ping(again)
        again.close(say_bye=True)


def test_a_release_for_a_deallocated_cache_and_a_dropped_connection_leave_the_server_up(
    seed: int, _runtime_dir: Path
) -> None:
    port = next(_ports)
    with PromptPeer(P, port, seed, extra=_v2_extra()) as peer:
        for round_index in range(3):
            cache_id = peer.call("v2_alloc", (2, [8, 64], [], 7))
            holder = _raw_link(_runtime_dir, port)
            seq = holder.next_seq()
            location = holder.request(
                PinRequest(seq, KEY_BLOCKS, 0, 7, 0, 0, 2, True, 0, 0, False, False, RULES_V2),
                seq,
                time.monotonic() + 5,
            )
            assert isinstance(location, Location)
            peer.call("v2_dealloc_blocks", cache_id)  # deferred: the lease keeps the memory
            if round_index % 2:
                holder.send_only(Release(location.lease_id, True), time.monotonic() + 5)
                _ping(holder)
                holder.close(say_bye=True)
            else:
                holder.close(say_bye=False)  # the server drops the lease with the connection
        stats = peer.stats()
        assert stats["leases"] == 0 and stats["caches"] == 0 and stats["pool_used_nbytes"] == 0


class _ExplodingHooks(NodeHooks):
    def is_pushing_to(self, cluster_id: int) -> bool:
        raise RuntimeError("a bug while handling one message")


def test_an_exception_while_handling_one_message_drops_only_that_connection(tmp_path: Path) -> None:
    table = CacheTable({1: Pool(capacity_nbytes=1 << 20)}, oom_code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY)
    server = Server(
        cluster_id=P, role=1, service=CacheService(Leases(table), _ExplodingHooks()), incarnation=5
    )
    path = tmp_path / "s.sock"
    try:
        server.start()
        server.listen(path)
        bystander = ClientLink.connect(
            path, cluster_id=3, remote_cluster_id=P, role=2, deadline=time.monotonic() + 5, incarnation=3
        )
        victim = ClientLink.connect(
            path, cluster_id=4, remote_cluster_id=P, role=2, deadline=time.monotonic() + 5, incarnation=4
        )
        assert victim.peer.incarnation == 5

        seq = victim.next_seq()
        with pytest.raises(PeerGone):
            victim.request(
                PinRequest(seq, 1, 1, 0, 0, 0, 1, False, 8, 0, True, False, RULES_V1),
                seq,
                time.monotonic() + 5,
            )
        _ping(bystander)
        server.check_alive()
        bystander.close(say_bye=True)
        victim.close(say_bye=False)
    finally:
        server.close()
        table.close()


def test_api_calls_fail_at_once_if_the_server_thread_died() -> None:
    with decoder(D) as dd:
        core = dd._core
        assert core is not None
        core.server._selector.close()  # the loop's next select fails: the thread dies
        core.server._wake()
        deadline = time.monotonic() + 5
        while core.server.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.server.failure is not None
        started = time.monotonic()
        with pytest.raises(LLMException) as info:
            dd.link_clusters([_cluster(1)], 5000)
        assert info.value.status_code == LLMStatusCode.LLM_FAILED
        assert "server thread" in str(info.value)
        assert time.monotonic() - started < 1.0


# ---------------------------------------------------------------------------- restarts and identities


def test_a_pull_after_the_owner_restarted_at_the_same_address_reads_the_new_owner(seed: int) -> None:
    port = next(_ports)
    with _V2() as dd:
        local, cache = _blocks(dd, 8, 96)
        with PromptPeer(P, port, seed, extra=_v2_extra()) as first:
            cache_id = first.call("v2_alloc", (2, [8, 96], [], 0))
            assert dd.link_clusters([_cluster(port)], 5000)[0] == LLMStatusCode.LLM_SUCCESS
            dd.cache_manager.pull_blocks(BlocksCacheKey(P, 0), cache, [3], [1])
            expected = first.expected(cache_id, 0, 8 * 192).reshape(8, 192)
            np.testing.assert_array_equal(local[0][1], expected[3])
            first.kill()
        with PromptPeer(P, port, seed + 1, extra=_v2_extra()) as second:
            # The same cache id and model id at the same address, with other bytes.
            assert second.call("v2_alloc", (2, [8, 96], [], 0)) == cache_id
            with pytest.raises(LLMException) as info:
                dd.cache_manager.pull_blocks(BlocksCacheKey(P, 0), cache, [3], [1])
            assert info.value.status_code in (LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_NOT_YET_LINK)
            assert dd.unlink_clusters([_cluster(port)], 5000, force=True)[0] == LLMStatusCode.LLM_SUCCESS
            assert dd.link_clusters([_cluster(port)], 5000)[0] == LLMStatusCode.LLM_SUCCESS
            for _round in range(2):
                dd.cache_manager.pull_blocks(BlocksCacheKey(P, 0), cache, [3, 5], [1, 2])
                expected = second.expected(cache_id, 1, 8 * 192).reshape(8, 192)
                np.testing.assert_array_equal(local[1][[1, 2]], expected[[3, 5]])


# ---------------------------------------------------------------------------- mappings follow segments


def _mapped_shm(pid: int) -> set[str]:
    names = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            if "/dev/shm/" in line:
                names.add(line.split("/dev/shm/")[1].split()[0])
    return names


def test_a_puller_unmaps_the_segments_its_owner_retired(seed: int) -> None:
    port = next(_ports)
    big = 70 << 20  # more than the growing pool's 64 MiB chunk: a segment of its own
    with PromptPeer(P, port, seed) as peer, decoder(D) as dd:
        info = peer.cluster_info()
        assert dd.link_clusters([info], 5000)[0] == LLMStatusCode.LLM_SUCCESS
        manager = dd.kv_cache_manager
        desc = CacheDesc(1, [1, big // 2], DataType.DT_FLOAT16)
        local = manager.allocate_cache(desc)
        try:
            cache_id = peer.alloc(1, [1, big // 2], [(P, 0)])
            peer.alloc(1, [1, 1024], [])  # a newer segment, so the big one is not the pool's last
            manager.pull_cache(CacheKey(P, 0), local, 0)
            got = tensor_views(local)[0].view(np.uint8).reshape(-1)
            np.testing.assert_array_equal(got, peer.expected(cache_id, 0, big))
            index = peer.call("index_name").lstrip("/")  # the owner's index stays mapped: it is live
            owner_segments = {n for n in _mapped_shm(os.getpid()) if f".{peer.pid}." in n} - {index}
            assert len(owner_segments) == 1
            peer.call("dealloc", cache_id)  # its segment falls empty and the owner unlinks it
            deadline = time.monotonic() + 5
            while owner_segments & _mapped_shm(os.getpid()) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not any(os.path.exists(f"/dev/shm/{name}") for name in owner_segments)
            assert not owner_segments & _mapped_shm(os.getpid()), "the puller still maps a retired segment"
        finally:
            manager.deallocate_cache(local)


# ---------------------------------------------------------------------------- bounds


def test_a_table_of_thousands_of_caches_comes_in_pages(seed: int, _runtime_dir: Path) -> None:
    """The one-sided table of 4,201 caches: read from the owner's index by a puller, and asked for over the
    socket (what a puller does when the index could not hold every cache) in pages that each fit a frame."""
    port = next(_ports)
    with PromptPeer(P, port, seed, extra=_v2_extra(page_shift=12)) as peer, _V2() as dd:
        count = 4200  # more than one Table frame may carry (4096 entries)
        peer.call("v2_alloc_many", (count, [1, 8]))
        cache_id = peer.call("v2_alloc", (2, [8, 96], [], 0))
        assert cache_id == count + 1
        local, cache = _blocks(dd, 8, 96)
        assert dd.link_clusters([_cluster(port)], 5000)[0] == LLMStatusCode.LLM_SUCCESS
        handled = peer.call("handled")
        dd.cache_manager.pull_blocks(BlocksCacheKey(P, 0), cache, [7], [0])
        np.testing.assert_array_equal(local[1][0], peer.expected(cache_id, 1, 8 * 192).reshape(8, 192)[7])
        assert peer.call("handled") == handled  # no message: the table came from the owner's index
        link = _raw_link(_runtime_dir, port)
        try:
            ids: list[int] = []
            start = 1
            pages = 0
            while True:
                seq = link.next_seq()
                page = link.request(TableRequest(seq, start), seq, time.monotonic() + 5)
                assert isinstance(page, Table) and page.entries
                ids.extend(entry[0] for entry in page.entries)
                pages += 1
                if not page.next_cache_id:
                    break
                start = page.next_cache_id
            assert pages >= 2 and ids == list(range(1, count + 2))
        finally:
            link.close(say_bye=True)


def test_a_peer_that_never_reads_its_replies_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_conn, "MAX_OUTBUF_NBYTES", 64 << 10)
    table = CacheTable({1: Pool(capacity_nbytes=1 << 20)}, oom_code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY)
    server = Server(cluster_id=P, role=1, service=CacheService(Leases(table)), incarnation=5)
    path = tmp_path / "s.sock"
    try:
        server.start()
        server.listen(path)
        flood = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        flood.settimeout(5)
        flood.connect(os.fspath(path))
        flood.sendall(encode_frame(Hello(PROTOCOL_VERSION, 9, P, 2, os.getpid(), 9).to_wire()))
        pings = b"".join(encode_frame(Ping(i).to_wire()) for i in range(1, 20001))
        dropped = False
        try:
            for _ in range(100):  # the server answers every ping; we read none of it
                flood.sendall(pings)
        except (BrokenPipeError, ConnectionResetError):
            dropped = True
        if not dropped:
            flood.settimeout(1)
            with pytest.raises((ConnectionResetError, BrokenPipeError, TimeoutError)):
                while flood.recv(1 << 20):
                    pass
        flood.close()
        other = ClientLink.connect(
            path, cluster_id=3, remote_cluster_id=P, role=2, deadline=time.monotonic() + 5, incarnation=3
        )
        _ping(other)
        other.close(say_bye=True)
        server.check_alive()
    finally:
        server.close()
        table.close()


def test_leases_per_connection_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_leases, "MAX_LEASES_PER_OWNER", 3)
    table = CacheTable({1: Pool(capacity_nbytes=1 << 20)}, oom_code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY)
    leases = Leases(table)
    request = PinRequest(1, KEY_BLOCKS, 0, 0, 0, 0, 1, True, 0, 0, False, False, RULES_V1)
    try:
        record = table.allocate(num_tensors=1, tensor_nbytes=4096, batch_size=1, keys=[], is_blocks=True)
        table.bind_blocks_key(0, record.cache_id)
        owner, other = object(), object()
        grants = [leases.resolve(request, owner) for _ in range(3)]
        with pytest.raises(StatusError) as info:
            leases.resolve(request, owner)
        assert info.value.code == LLMStatusCode.LLM_FAILED and "limit" in info.value.detail
        leases.resolve(request, other)
        leases.release(grants[0].lease_id, ok=True, owner=owner)
        leases.resolve(request, owner)
        assert leases.drop_owner(owner) == 3 and leases.drop_owner(other) == 1
        assert not leases.holds(owner)
    finally:
        table.close()


def test_a_failed_generation_slot_gives_the_pool_block_back() -> None:
    from llm_datadist._shm.generations import GenerationTable

    pool = Pool(capacity_nbytes=1 << 20)
    table = CacheTable({1: pool}, oom_code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY)
    try:
        table.generations.close()
        table.generations = GenerationTable(capacity=2)  # the version word and one slot
        table.allocate(num_tensors=1, tensor_nbytes=4096, batch_size=1, keys=[])
        used = pool.used_nbytes
        with pytest.raises(StatusError) as info:
            table.allocate(num_tensors=1, tensor_nbytes=4096, batch_size=1, keys=[])
        assert info.value.code == LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
        assert pool.used_nbytes == used
    finally:
        table.close()


def test_links_per_process_are_bounded(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_links, "MAX_LINKS", 0)
    with PromptPeer(P, next(_ports), seed) as peer, decoder(D) as dd:
        assert dd.link_clusters([peer.cluster_info()], 5000)[1] == [LLMStatusCode.LLM_LINK_FAILED]


# ---------------------------------------------------------------------------- sockets and listening


def test_init_removes_sockets_of_dead_processes(_runtime_dir: Path) -> None:
    _runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    stale = _runtime_dir / "127.0.0.1_24999.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(os.fspath(stale))
    sock.close()  # bound, never unlinked: what a SIGKILLed listener leaves
    assert stale.exists()
    with decoder(D):
        assert not stale.exists()


def test_switching_role_back_and_forth_on_the_same_address_never_finds_it_taken() -> None:
    config = LLMConfig()
    config.device_id = 0
    config.enable_switch_role = True
    options = dict(config.generate_options())
    dd = LLMDataDist(LLMRole.DECODER, D)
    dd.init(options)
    address = {"llm.listenIpInfo": f"{PROMPT_IP}:{next(_ports)}"}
    try:
        for _ in range(30):
            dd.switch_role(LLMRole.PROMPT, address)
            dd.switch_role(LLMRole.DECODER)
    finally:
        dd.finalize()


def test_many_threads_initialising_one_instance_make_one_core() -> None:
    config = LLMConfig()
    config.device_id = 0
    dd = LLMDataDist(LLMRole.DECODER, D)
    errors: list[BaseException] = []

    def init() -> None:
        try:
            dd.init(dict(config.generate_options()))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=init) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    try:
        assert not errors
        assert dd._core is not None
    finally:
        dd.finalize()


@pytest.mark.parametrize("memory", ["registered", "pool"])
def test_a_one_sided_pull_from_a_killed_owner_is_a_link_failure(seed: int, memory: str) -> None:
    port = next(_ports)
    with _V2() as dd, PromptPeer(P, port, seed, extra=_v2_extra()) as peer:
        if memory == "registered":
            cache_id = peer.call("v2_register_blocks", (2, [8, 96], 0, True))
        else:
            cache_id = peer.call("v2_alloc", (2, [8, 96], [], 0))
        local, cache = _blocks(dd, 8, 96)
        assert dd.link_clusters([_cluster(port)], 5000)[0] == LLMStatusCode.LLM_SUCCESS
        dd.cache_manager.pull_blocks(BlocksCacheKey(P, 0), cache, [2], [2])
        np.testing.assert_array_equal(local[0][2], peer.expected(cache_id, 0, 8 * 192).reshape(8, 192)[2])
        peer.kill()
        for _attempt in range(2):  # the first notices, the second finds the link broken
            with pytest.raises(LLMException) as info:
                dd.cache_manager.pull_blocks(BlocksCacheKey(P, 0), cache, [2], [2])
            assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED, info.value
    from llm_datadist._shm.reaper import reap

    reap()


def test_pulls_while_the_owner_registers_and_unregisters_in_a_loop(seed: int) -> None:
    """The issue's first scenario through the public API: leased pulls (no remote access) of a blocks
    cache its owner keeps unregistering and registering again. Every pull gets the bytes or
    LLM_KV_CACHE_NOT_EXIST; the owner's server keeps serving throughout and holds no lease at the end."""
    port = next(_ports)
    extra = {"llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "0"}
    with PromptPeer(P, port, seed, extra=extra) as peer:
        dd = LLMDataDist(LLMRole.DECODER, D)
        config = LLMConfig()
        config.device_id = 0
        config.enable_cache_manager = True
        config.sync_kv_timeout = 5000
        dd.init(config.generate_options())
        try:
            arrays = [np.zeros(8 * 96, dtype=np.float16) for _ in range(2)]
            desc = CacheDesc(2, [8, 96], DataType.DT_FLOAT16)
            local = dd.cache_manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays])
            assert dd.link_clusters([_cluster(port)], 5000)[0] == LLMStatusCode.LLM_SUCCESS
            expected = [peer.expected(0, t, 8 * 192).reshape(8, 192) for t in range(2)]
            peer.call_start("v2_churn_blocks", (150, 2, [8, 96], 4))
            outcomes = {"ok": 0, "gone": 0}
            deadline = time.monotonic() + 60
            while not peer._pipe.poll(0) and time.monotonic() < deadline:
                for array in arrays:
                    array[:] = 0
                try:
                    dd.cache_manager.pull_blocks(BlocksCacheKey(P, 4), local, [5, 1], [0, 7])
                except LLMException as exc:
                    assert exc.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, exc
                    outcomes["gone"] += 1
                    continue
                for t, array in enumerate(arrays):
                    np.testing.assert_array_equal(
                        array.view(np.uint8).reshape(8, 192)[[0, 7]], expected[t][[5, 1]]
                    )
                outcomes["ok"] += 1
            assert peer.call_finish() == 150
            print(f"pulls during the churn: {outcomes}")
            assert outcomes["ok"] + outcomes["gone"] > 0
            peer.call("v2_register_blocks", (2, [8, 96], 4, None))
            dd.cache_manager.pull_blocks(BlocksCacheKey(P, 4), local, [1], [1])  # still served
            assert peer.stats()["leases"] == 0
        finally:
            dd.finalize()


def test_a_one_sided_puller_follows_a_model_id_bound_to_a_newer_cache(seed: int) -> None:
    """Reference §6.4: a newer blocks cache with the same model_id takes the index over. A puller holding
    the owner's table from before must read (and write) the newer cache, though the older one still lives."""
    port = next(_ports)
    with PromptPeer(P, port, seed, extra=_v2_extra()) as peer, _V2() as dd:
        older = peer.call("v2_alloc", (2, [8, 96], [], 0))
        local, cache = _blocks(dd, 8, 96)
        assert dd.link_clusters([_cluster(port)], 5000)[0] == LLMStatusCode.LLM_SUCCESS
        dd.cache_manager.pull_blocks(BlocksCacheKey(P, 0), cache, [6], [0])
        np.testing.assert_array_equal(local[0][0], peer.expected(older, 0, 8 * 192).reshape(8, 192)[6])
        newer = peer.call("v2_alloc", (2, [8, 96], [], 0))
        dd.cache_manager.pull_blocks(BlocksCacheKey(P, 0), cache, [6], [0])
        np.testing.assert_array_equal(local[0][0], peer.expected(newer, 0, 8 * 192).reshape(8, 192)[6])
        local[1][3] = 7
        dd.cache_manager.push_blocks(BlocksCacheKey(P, 0), cache, [3], [2], range(0, 1), range(0, 1))
        written = np.frombuffer(peer.call("v2_bytes", (newer, 1)), dtype=np.uint8).reshape(8, 192)
        np.testing.assert_array_equal(written[2], local[1][3].view(np.uint8))
        untouched = np.frombuffer(peer.call("v2_bytes", (older, 1)), dtype=np.uint8).reshape(8, 192)
        np.testing.assert_array_equal(untouched, peer.expected(older, 1, 8 * 192).reshape(8, 192))


def test_a_finalized_instance_is_freed_without_the_cycle_collector() -> None:
    """A process that initialises and finalizes again and again (an owner restarted in place) must not
    keep each finalized instance until a full garbage collection happens to run: nothing may form a
    reference cycle through the instance's core once it is closed."""
    import gc
    import weakref

    from llm_datadist import CacheDesc, CacheKey, DataType, LLMConfig, LLMDataDist, LLMRole

    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        datadist = LLMDataDist(LLMRole.PROMPT, 1)
        config = LLMConfig()
        config.device_id = 0
        config.listen_ip_info = "127.0.0.1:26557"
        datadist.init(config.generate_options())
        manager = datadist.kv_cache_manager
        cache = manager.allocate_cache(CacheDesc(2, [1, 4096], DataType.DT_INT8), [CacheKey(1, req_id=1)])
        manager.deallocate_cache(cache)
        del cache
        core = datadist._core
        parts = [weakref.ref(part) for part in (core, core.table, core.server, core.comms, core.copier)]
        del core
        datadist.finalize()
        assert [ref() is None for ref in parts] == [True] * len(parts)
    finally:
        if enabled:
            gc.enable()
