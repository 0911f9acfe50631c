"""`link_clusters` / `unlink_clusters` / `check_link_status` across real processes, and the addressing
rules: a socket per listen address in a private runtime directory, handshake checks."""

from __future__ import annotations

import itertools
import os
import socket
import stat
import struct
from pathlib import Path

import pytest

from llm_datadist import LLMClusterInfo, LLMException, LLMStatusCode
from llm_datadist._protocol.frames import encode_frame
from tests._peer import PROMPT_IP, PromptPeer, decoder

P = 1
_ports = itertools.count(27000)


def _info(cluster_id: int, port: int) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_local_ip_info(PROMPT_IP, 0)
    info.append_remote_ip_info(PROMPT_IP, port)
    return info


def test_link_unlink_relink(seed: int) -> None:
    with PromptPeer(P, next(_ports), seed) as peer, decoder() as dd:
        info = peer.cluster_info()
        assert dd.link_clusters([info]) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
        assert dd.link_clusters([info]) == (LLMStatusCode.LLM_ALREADY_LINK, [LLMStatusCode.LLM_ALREADY_LINK])
        dd.check_link_status(P)
        assert dd.unlink_clusters([info]) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
        assert dd.unlink_clusters([info])[1] == [LLMStatusCode.LLM_NOT_YET_LINK]
        with pytest.raises(LLMException) as exc_info:
            dd.check_link_status(P)
        assert exc_info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
        assert dd.link_clusters([info])[0] == LLMStatusCode.LLM_SUCCESS
        assert dd.unlink_clusters([info], force=True)[0] == LLMStatusCode.LLM_SUCCESS


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_a_forced_unlink_of_a_cluster_with_no_link_is_success(seed: int, v2: bool) -> None:
    """As the real `UnlinkCluster` with its force flag ("Entity not found", SUCCESS): whether or not this
    side has seen the peer finalize, a forced unlink after it succeeds; an unforced one of a cluster never
    linked stays LLM_NOT_YET_LINK."""
    v2_options = {"llm.EnableCacheManager": "1", "llm.MemPoolConfig": '{"memory_size": 16777216}'}
    extra = v2_options if v2 else None
    with decoder(extra=extra) as dd:
        for wait_for_the_end in (False, True):
            peer = PromptPeer(P, next(_ports), seed, extra=extra)
            try:
                info = peer.cluster_info()
                assert dd.link_clusters([info])[0] == LLMStatusCode.LLM_SUCCESS
            finally:
                peer.close()  # the Prompt finalizes and exits
            if wait_for_the_end:
                with pytest.raises(LLMException):
                    dd.check_link_status(P)  # this side has seen the link end
            assert dd.unlink_clusters([info], force=True) == (
                LLMStatusCode.LLM_SUCCESS,
                [LLMStatusCode.LLM_SUCCESS],
            )
        never = _info(77, next(_ports))
        assert dd.unlink_clusters([never], force=True)[0] == LLMStatusCode.LLM_SUCCESS
        assert dd.unlink_clusters([never])[1] == [LLMStatusCode.LLM_NOT_YET_LINK]


def test_a_decoder_started_before_its_prompt_is_told_so() -> None:
    from tests._logs import warning_lines

    port = next(_ports)
    with decoder() as dd, warning_lines() as logs:
        assert dd.link_clusters([_info(P, port)], timeout=1000)[0] == LLMStatusCode.LLM_LINK_FAILED
    said = [line for line in logs.lines if f"127.0.0.1:{port} failed" in line]
    assert len(said) == 1 and f"nobody listens at 127.0.0.1:{port} on this host yet" in said[0], logs.lines
    assert "Errno" not in said[0]


def test_wrong_cluster_id_nobody_listening_and_partial_results(seed: int) -> None:
    port = next(_ports)
    with PromptPeer(P, port, seed), decoder() as dd:
        ret, codes = dd.link_clusters([_info(99, port), _info(P, port), _info(3, next(_ports))], timeout=2000)
        assert ret == LLMStatusCode.LLM_LINK_FAILED
        assert codes == [
            LLMStatusCode.LLM_LINK_FAILED,
            LLMStatusCode.LLM_SUCCESS,
            LLMStatusCode.LLM_LINK_FAILED,
        ]


def test_too_many_clusters_and_bad_arguments() -> None:
    with decoder() as dd:
        infos = [_info(i, 1000 + i) for i in range(17)]
        ret, codes = dd.link_clusters(infos)
        assert ret == LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT and len(codes) == 17
        with pytest.raises(TypeError):
            dd.link_clusters(_info(1, 1))  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            dd.link_clusters(["x"])  # type: ignore[list-item]
        with pytest.raises(LLMException) as exc_info:
            dd.link_clusters([_info(1, 1)], timeout=0)
        assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        with pytest.raises(TypeError):
            dd.unlink_clusters([_info(1, 1)], force=1)  # type: ignore[arg-type]


def test_link_to_a_silent_listener_times_out(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from llm_datadist._runtime import ensure_runtime_dir, socket_path

    ensure_runtime_dir()
    port = next(_ports)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(os.fspath(socket_path(PROMPT_IP, port)))
    silent.listen(4)
    try:
        with decoder() as dd:
            _, codes = dd.link_clusters([_info(P, port)], timeout=300)
            assert codes == [LLMStatusCode.LLM_LINK_FAILED]
    finally:
        silent.close()


def test_runtime_dir_and_socket_are_private(seed: int, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    port = next(_ports)
    with PromptPeer(P, port, seed):
        assert stat.S_IMODE(os.stat(_runtime_dir).st_mode) == 0o700
        sock_path = _runtime_dir / f"{PROMPT_IP}_{port}.sock"
        assert stat.S_ISSOCK(os.stat(sock_path).st_mode)
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
    assert not sock_path.exists()  # finalize removes the socket


def test_server_survives_garbage_and_keeps_serving(seed: int, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    port = next(_ports)
    with PromptPeer(P, port, seed) as peer, decoder() as dd:
        path = os.fspath(_runtime_dir / f"{PROMPT_IP}_{port}.sock")
        for junk in (b"\xff" * 64, struct.pack("!I", 1 << 30), encode_frame([99, 1, 2]), b"\x00\x00"):
            bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            bad.settimeout(5)
            bad.connect(path)
            bad.sendall(junk)
            bad.shutdown(socket.SHUT_WR)
            assert bad.recv(4096) is not None  # the server closes (possibly after an error frame)
            bad.close()
        assert dd.link_clusters([peer.cluster_info()])[0] == LLMStatusCode.LLM_SUCCESS
        dd.check_link_status(P)


def test_stale_socket_of_a_dead_prompt_is_replaced(seed: int, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    port = next(_ports)
    first = PromptPeer(P, port, seed)
    first.kill()
    first.close()
    assert (_runtime_dir / f"{PROMPT_IP}_{port}.sock").exists()
    with PromptPeer(P, port, seed) as peer, decoder() as dd:
        assert dd.link_clusters([peer.cluster_info()])[0] == LLMStatusCode.LLM_SUCCESS
    from llm_datadist._shm.reaper import reap

    reap()


def test_second_prompt_on_a_taken_address_fails(seed: int) -> None:
    port = next(_ports)
    with PromptPeer(P, port, seed), pytest.raises(RuntimeError, match="taken"):
        PromptPeer(P + 10, port, seed)


def _hello_as(uid: int, path: str, remote_cluster_id: int, version: int | None = None) -> str:
    """Fork a child that runs as `uid`, connects, says Hello and reports what the server answered."""
    from llm_datadist._protocol.connection import Connection, ConnRole
    from llm_datadist._protocol.messages import PROTOCOL_VERSION, Hello

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        answer = "no answer"
        try:
            if uid != os.getuid():
                os.setgid(uid)
                os.setuid(uid)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            sock.connect(path)
            conn = Connection(ConnRole.CLIENT)
            hello_version = PROTOCOL_VERSION if version is None else version
            sock.sendall(conn.send(Hello(hello_version, 5, remote_cluster_id, 2, os.getpid(), 1)))
            while True:
                conn.receive_data(sock.recv(65536))
                event = conn.next_event()
                if event is not None:
                    answer = f"{type(event).__name__} {getattr(event, 'message', '')}"
                    break
        except BaseException as exc:
            answer = f"child failed: {exc!r}"
        os.write(write_fd, answer.encode())
        os._exit(0)
    os.close(write_fd)
    try:
        os.waitpid(pid, 0)
        return os.read(read_fd, 4096).decode()
    finally:
        os.close(read_fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_a_process_of_another_uid_is_refused(seed: int, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    port = next(_ports)
    nobody = 65534
    with PromptPeer(P, port, seed) as peer, decoder() as dd:
        path = _runtime_dir / f"{PROMPT_IP}_{port}.sock"
        # Open the directories and the socket up, so that only the SO_PEERCRED check stands in the way.
        opened = [
            d
            for d in [_runtime_dir, *_runtime_dir.parents]
            if d != Path("/tmp") and Path("/tmp") in d.parents
        ]
        modes = {d: stat.S_IMODE(os.stat(d).st_mode) for d in [*opened, path]}
        try:
            for directory in opened:
                os.chmod(directory, modes[directory] | 0o005)
            os.chmod(path, 0o666)
            answer = _hello_as(nobody, os.fspath(path), P)
        finally:
            for item, mode in modes.items():
                os.chmod(item, mode)
        assert answer.startswith("Error") and "uid" in answer, answer
        # The refused connection did not disturb the server.
        assert dd.link_clusters([peer.cluster_info()])[0] == LLMStatusCode.LLM_SUCCESS


def test_a_different_protocol_version_is_refused(seed: int, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    from llm_datadist._protocol.messages import PROTOCOL_VERSION

    port = next(_ports)
    with PromptPeer(P, port, seed):
        path = os.fspath(_runtime_dir / f"{PROMPT_IP}_{port}.sock")
        answer = _hello_as(os.getuid(), path, P, version=PROTOCOL_VERSION + 1)
        assert answer.startswith("Error") and "protocol version" in answer, answer
        assert _hello_as(os.getuid(), path, P).startswith("Welcome")


def test_check_link_status_and_unlink_are_busy_during_a_pull(seed: int, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    import threading
    import time

    from llm_datadist import CacheDesc, CacheKey, DataType
    from tests._peer import PROMPT_IP, start_index_holder

    with PromptPeer(P, next(_ports), seed) as peer, decoder(sync_kv_timeout_ms=3000) as dd:
        info = peer.cluster_info()
        assert dd.link_clusters([info])[0] == LLMStatusCode.LLM_SUCCESS
        peer.alloc(2, [1, 64], [(P, 1)])
        dst = dd.kv_cache_manager.allocate_cache(CacheDesc(2, [1, 64], DataType.DT_FLOAT16))
        # A process stopped while it holds the Prompt's index lock keeps our pull waiting for the lock.
        socket_file = os.fspath(_runtime_dir / f"{PROMPT_IP}_{peer.port}.sock")
        holder, pipe = start_index_holder(socket_file, P, "lock")
        errors: list[BaseException] = []
        try:

            def pull() -> None:
                try:
                    dd.kv_cache_manager.pull_cache(CacheKey(P, 1), dst)
                except BaseException as exc:
                    errors.append(exc)

            puller = threading.Thread(target=pull)
            puller.start()
            time.sleep(0.2)  # the pull is now waiting for the lock
            with pytest.raises(LLMException) as exc_info:
                dd.check_link_status(P)
            assert exc_info.value.status_code == LLMStatusCode.LLM_LINK_BUSY
            assert dd.unlink_clusters([info])[1] == [LLMStatusCode.LLM_LINK_BUSY]
        finally:
            holder.kill()  # the kernel drops the lock of a dead holder
            holder.join(10)
            pipe.close()
        puller.join(10)
        assert not errors  # the lock came free in time: the pull itself succeeded
        dd.check_link_status(P)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another uid needs root")
def test_a_runtime_directory_another_user_made_first_is_refused_with_advice(tmp_path: Path) -> None:
    """Another local user who creates the runtime directory first could intercept our sockets: `init`
    refuses it, as an LLMException that says how to choose another directory."""
    from llm_datadist import LLMConfig, LLMDataDist, LLMRole

    squatted = tmp_path / "squatted"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, 65534, 65534)  # nobody
    datadist = LLMDataDist(LLMRole.PROMPT, 1)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = f"{PROMPT_IP}:26999"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLM_DATADIST_RUNTIME_DIR", str(squatted))
        with pytest.raises(LLMException) as exc_info:
            datadist.init(config.generate_options())
    assert exc_info.value.status_code == LLMStatusCode.LLM_FAILED
    assert "belongs to uid 65534" in str(exc_info.value) and "LLM_DATADIST_RUNTIME_DIR" in str(exc_info.value)
    with pytest.raises(RuntimeError):
        _ = datadist.kv_cache_manager  # not initialised: the failed init left nothing behind
