"""The shared secret of TCP links (`_wire.auth`) and what the TCP server does before a peer proved it
knows it: the secret's sources and their checks, the proofs, and a real `Server` listening on loopback
TCP that refuses a wrong proof, a Hello before its Challenge, an oversized frame and a peer slow to
prove itself, whose unproven connections from one address (loopback has a whole /8 of them) never keep
out a peer from another, and whose refusals make one log line per address and interval."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from llm_datadist._errors import StatusError
from llm_datadist._owner.leases import Leases
from llm_datadist._owner.service import CacheService, NodeHooks
from llm_datadist._owner.table import CacheTable
from llm_datadist._protocol.connection import Connection, ConnRole
from llm_datadist._protocol.frames import encode_frame
from llm_datadist._protocol.messages import PROTOCOL_VERSION, Challenge, Error, Hello, Message, Ping, Pong
from llm_datadist._wire import auth as _auth
from llm_datadist._wire.admission import AdmissionLimits
from llm_datadist._wire.client import ClientLink
from llm_datadist._wire.server import Server
from llm_datadist.status import LLMStatusCode
from tests._logs import warning_lines

SECRET = b"sixteen-bytes-at-least"


# ------------------------------------------------------------------ where the secret comes from


@pytest.fixture
def no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_auth.ENV_SECRET, raising=False)
    monkeypatch.delenv(_auth.ENV_SECRET_FILE, raising=False)


@pytest.mark.usefixtures("no_secret")
def test_no_secret_configured_is_none() -> None:
    assert _auth.load_secret() is None


@pytest.mark.usefixtures("no_secret")
def test_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_auth.ENV_SECRET, "x" * 16)
    assert _auth.load_secret() == b"x" * 16
    monkeypatch.setenv(_auth.ENV_SECRET, "x" * 15)
    with pytest.raises(_auth.SecretError, match="at least 16"):
        _auth.load_secret()


@pytest.mark.usefixtures("no_secret")
def test_secret_file_must_be_private(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("a-secret-in-a-file-0123\n")
    monkeypatch.setenv(_auth.ENV_SECRET_FILE, str(path))
    monkeypatch.setenv(_auth.ENV_SECRET, "the-environment-loses-to-the-file")
    for mode in (0o644, 0o640, 0o604, 0o660):
        path.chmod(mode)
        with pytest.raises(_auth.SecretError, match="chmod 600"):
            _auth.load_secret()
    for mode in (0o600, 0o400):
        path.chmod(mode)
        assert _auth.load_secret() == b"a-secret-in-a-file-0123"  # the trailing newline is not in it


@pytest.mark.usefixtures("no_secret")
def test_secret_file_problems_are_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(_auth.ENV_SECRET_FILE, str(tmp_path / "missing"))
    with pytest.raises(_auth.SecretError, match="cannot be opened"):
        _auth.load_secret()
    target = tmp_path / "target"
    target.write_text("a-secret-in-a-file-0123")
    target.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(target)
    monkeypatch.setenv(_auth.ENV_SECRET_FILE, str(link))
    with pytest.raises(_auth.SecretError, match="cannot be opened"):  # O_NOFOLLOW: no symlink games
        _auth.load_secret()
    monkeypatch.setenv(_auth.ENV_SECRET_FILE, str(tmp_path))
    with pytest.raises(_auth.SecretError):
        _auth.load_secret()


def test_proofs_bind_every_part_of_the_handshake() -> None:
    server_nonce, client_nonce = b"s" * 32, b"c" * 32
    client, server = (7, 70, "10.0.0.2:15000"), (1, 10, "10.0.0.1:15001")
    proof = _auth.client_proof(SECRET, server_nonce, client_nonce, client, 1)
    assert _auth.proofs_match(proof, _auth.client_proof(SECRET, server_nonce, client_nonce, client, 1))
    changed = [
        _auth.client_proof(b"another-secret-of-16", server_nonce, client_nonce, client, 1),
        _auth.client_proof(SECRET, b"t" * 32, client_nonce, client, 1),
        _auth.client_proof(SECRET, server_nonce, b"d" * 32, client, 1),
        _auth.client_proof(SECRET, server_nonce, client_nonce, (8, 70, "10.0.0.2:15000"), 1),
        _auth.client_proof(SECRET, server_nonce, client_nonce, (7, 71, "10.0.0.2:15000"), 1),
        _auth.client_proof(SECRET, server_nonce, client_nonce, (7, 70, "10.0.0.9:15000"), 1),
        _auth.client_proof(SECRET, server_nonce, client_nonce, client, 2),
        # The server's proof over the same fields is another value: a client's proof cannot be echoed back.
        _auth.server_proof(SECRET, server_nonce, client_nonce, client, (1, 0, "")),
        _auth.server_proof(SECRET, server_nonce, client_nonce, client, server),
    ]
    assert not any(_auth.proofs_match(proof, other) for other in changed)
    assert len({proof, *changed}) == len(changed) + 1


# ------------------------------------------------------------------ the TCP server before authentication


class _RemoteHooks(NodeHooks):
    """A server that takes proven peers on other hosts: metadata only, behind a made-up engine address."""

    def serve_remote(self, local_ip: str) -> str:
        return f"{local_ip}:1"


def _tcp_server(admission: AdmissionLimits | None = None) -> Iterator[tuple[Server, int]]:
    table = CacheTable({}, oom_code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY)
    server = Server(
        cluster_id=1, role=1, service=CacheService(Leases(table)), secret=SECRET, admission=admission
    )
    server.start()
    try:
        port = server.listen_tcp("127.0.0.1", 0)
        yield server, port
    finally:
        server.close()
        table.close()


@pytest.fixture
def tcp_server() -> Iterator[tuple[Server, int]]:
    yield from _tcp_server()


@pytest.fixture
def patient_server() -> Iterator[tuple[Server, int]]:
    """Unproven connections stay until something else closes them: only the caps are at work."""
    yield from _tcp_server(AdmissionLimits(proof_timeout_s=600.0))


class _Raw:
    """A TCP peer that speaks frames by hand (whatever a hostile client may send), from `source` (any
    address of 127.0.0.0/8 is loopback)."""

    def __init__(self, port: int, source: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
        self.conn = Connection(ConnRole.CLIENT, challenge=True, secret=SECRET)
        self.challenge: Challenge | None = None  # once `_challenged` read it

    def receive(self) -> Message | None:
        """The next message, or None once the server closed the connection."""
        while True:
            event = self.conn.next_event()
            if isinstance(event, Message):
                return event
            if event is not None:
                return None
            data = self.sock.recv(65536)
            self.conn.receive_data(data)
            if not data:
                return None

    def closed_by_server(self) -> bool:
        self.sock.settimeout(5)
        try:
            while self.sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
        return True


def test_a_tcp_connection_opens_with_a_challenge(tcp_server: tuple[Server, int]) -> None:
    _, port = tcp_server
    peer = _Raw(port)
    challenge = peer.receive()
    assert isinstance(challenge, Challenge) and challenge.version == PROTOCOL_VERSION
    assert len(challenge.nonce) == _auth.NONCE_NBYTES
    assert isinstance(_Raw(port).receive(), Challenge) and _Raw(port).receive() != challenge  # fresh nonce


def test_a_wrong_proof_is_refused_and_closed(tcp_server: tuple[Server, int]) -> None:
    server, port = tcp_server
    peer = _Raw(port)
    challenge = peer.receive()
    assert isinstance(challenge, Challenge)
    nonce = os.urandom(32)
    wrong = _auth.client_proof(b"not-the-right-secret", challenge.nonce, nonce, (2, 9, "10.0.0.2:1"), 1)
    hello = Hello(PROTOCOL_VERSION, 2, 1, 2, 4242, 9, nonce, wrong, "10.0.0.2:1")
    peer.sock.sendall(peer.conn.send(hello))
    refused = peer.receive()
    assert isinstance(refused, Error) and refused.status_code == LLMStatusCode.LLM_LINK_FAILED
    assert refused.message == "wrong shared secret"
    assert peer.closed_by_server()
    assert server.peers() == []


def test_the_right_proof_reaches_the_engine_check(tcp_server: tuple[Server, int]) -> None:
    """A Server without an engine behind it (the default hooks) refuses even a proven peer, and says why:
    the proof is checked first, then whether bytes can move."""
    server, port = tcp_server
    peer = _Raw(port)
    challenge = peer.receive()
    assert isinstance(challenge, Challenge)
    nonce = os.urandom(32)
    right = _auth.client_proof(SECRET, challenge.nonce, nonce, (2, 9, "10.0.0.2:1"), 1)
    peer.sock.sendall(peer.conn.send(Hello(PROTOCOL_VERSION, 2, 1, 2, 4242, 9, nonce, right, "10.0.0.2:1")))
    refused = peer.receive()
    assert isinstance(refused, Error) and "serves no peers on other hosts" in refused.message
    assert server.peers() == []


def test_an_unauthenticated_peer_is_held_to_small_frames(tcp_server: tuple[Server, int]) -> None:
    _, port = tcp_server
    peer = _Raw(port)
    assert isinstance(peer.receive(), Challenge)
    # A frame header announcing 64 KiB: refused before its body is read.
    peer.sock.sendall(struct.pack(">I", 64 << 10) + b"\x90" * 100)
    assert peer.closed_by_server()


def test_a_hello_of_another_protocol_version_is_refused(tcp_server: tuple[Server, int]) -> None:
    _, port = tcp_server
    peer = _challenged(port, "127.0.0.1")
    assert peer.challenge is not None
    nonce = os.urandom(32)
    right = _auth.client_proof(SECRET, peer.challenge.nonce, nonce, (2, 9, "10.0.0.2:1"), 1)
    old = PROTOCOL_VERSION - 1
    peer.sock.sendall(peer.conn.send(Hello(old, 2, 1, 2, 4242, 9, nonce, right, "10.0.0.2:1")))
    refused = peer.receive()
    assert isinstance(refused, Error) and refused.status_code == LLMStatusCode.LLM_LINK_FAILED, refused
    assert refused.message == f"protocol version {old} is not {PROTOCOL_VERSION}"


def test_a_client_names_the_servers_other_version_before_it_proves_anything() -> None:
    """The Challenge carries the version: a server of another version is refused before the Hello."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(encode_frame(Challenge(PROTOCOL_VERSION - 1, os.urandom(32)).to_wire()))
            conn.settimeout(10)
            while data := conn.recv(65536):
                received.extend(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with pytest.raises(StatusError) as info:
            ClientLink.connect_tcp(
                "127.0.0.1",
                listener.getsockname()[1],
                secret=SECRET,
                local_ip="127.0.0.1",
                engine=lambda ip: f"{ip}:2",
                callback_port=lambda ip: 0,
                cluster_id=2,
                remote_cluster_id=1,
                role=2,
                deadline=time.monotonic() + 10,
                incarnation=7,
            )
        assert info.value.code == LLMStatusCode.LLM_LINK_FAILED
        assert f"speaks protocol version {PROTOCOL_VERSION - 1}" in info.value.detail
        thread.join(10)
        assert received == b""  # no Hello, so no proof either
    finally:
        listener.close()


def test_a_unix_style_hello_without_proof_is_refused_on_tcp(tcp_server: tuple[Server, int]) -> None:
    _, port = tcp_server
    peer = _Raw(port)
    assert isinstance(peer.receive(), Challenge)
    peer.sock.sendall(peer.conn.send(Hello(PROTOCOL_VERSION, 2, 1, 2, os.getpid(), 9)))
    refused = peer.receive()
    assert isinstance(refused, Error) and refused.message == "no proof of the shared secret"


def _challenged(port: int, source: str) -> _Raw:
    peer = _Raw(port, source)
    challenge = peer.receive()
    assert isinstance(challenge, Challenge)
    peer.challenge = challenge
    return peer


def _made_room(peer: _Raw) -> bool:
    """The server told `peer` it was closed for a newer connection, and closed it."""
    refused = peer.receive()
    assert isinstance(refused, Error) and refused.status_code == LLMStatusCode.LLM_LINK_FAILED, refused
    assert "make room" in refused.message, refused.message
    return peer.receive() is None


def _still_open(peer: _Raw) -> bool:
    peer.sock.setblocking(False)
    try:
        return peer.sock.recv(1) != b""  # any byte would be a protocol error of the server's
    except BlockingIOError:
        return True
    finally:
        peer.sock.setblocking(True)


def test_a_flood_from_one_address_closes_only_its_own(patient_server: tuple[Server, int]) -> None:
    server, port = patient_server
    limits = AdmissionLimits()
    flood = [_challenged(port, "127.0.0.2") for _ in range(limits.per_source)]
    bystander = _challenged(port, "127.0.0.3")
    for _ in range(3 * limits.total):
        flood.append(_challenged(port, "127.0.0.2"))
        assert _made_room(flood.pop(0))
    assert server.unproven_by_address() == {"127.0.0.2": limits.per_source, "127.0.0.3": 1}
    assert _still_open(bystander)


def test_a_full_pool_closes_the_oldest_of_the_busiest_address(patient_server: tuple[Server, int]) -> None:
    """127.0.0.10 holds the oldest connection, 127.0.0.11..20 three each: a newcomer from yet another
    address takes the slot of 127.0.0.11's oldest."""
    server, port = patient_server
    oldest = _challenged(port, "127.0.0.10")
    busiest = [[_challenged(port, f"127.0.0.{11 + i}") for _ in range(3)] for i in range(10)]
    last = _challenged(port, "127.0.0.21")
    assert sum(server.unproven_by_address().values()) == AdmissionLimits().total
    newcomer = _challenged(port, "127.0.0.22")
    assert _made_room(busiest[0][0])
    assert all(_still_open(peer) for peer in [oldest, last, newcomer, *busiest[0][1:], *busiest[1]])
    assert server.unproven_by_address()["127.0.0.11"] == 2


def test_a_peer_slow_to_prove_the_secret_is_refused(tcp_server: tuple[Server, int]) -> None:
    _, port = tcp_server
    slow = _challenged(port, "127.0.0.4")
    refused = slow.receive()  # within the socket's timeout (10 s)
    assert isinstance(refused, Error) and refused.status_code == LLMStatusCode.LLM_LINK_FAILED, refused
    assert refused.message == f"no proof of the shared secret within {AdmissionLimits().proof_timeout_s:g} s"
    assert slow.receive() is None


def _flood_main(port: int, source: str, count: int, closed: Any, stop: Any) -> None:
    """`count` connections from `source` that never say a word, each one the server closes replaced at
    once, until `stop` is set; `closed` counts what the server closed."""
    selector = selectors.DefaultSelector()
    missing = 0

    def open_one() -> None:
        nonlocal missing
        try:
            sock = socket.create_connection(("127.0.0.1", port), 10, (source, 0))
        except OSError:
            missing += 1  # tried again on the next round
            return
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)

    for _ in range(count):
        open_one()
    while not stop.is_set():
        for _ in range(missing):
            missing -= 1
            open_one()
        for key, _ in selector.select(0.1):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                if sock.recv(65536):
                    continue
            except BlockingIOError:
                continue
            except OSError:
                pass
            selector.unregister(sock)
            sock.close()
            with closed.get_lock():
                closed.value += 1
            open_one()


@contextlib.contextmanager
def _flood(port: int, source: str, count: int) -> Iterator[Any]:
    """A process running `_flood_main` (its own interpreter: it competes with the server thread for
    nothing but the CPU, as a flood from another host does); yields the count of closed connections."""
    ctx = multiprocessing.get_context("spawn")
    closed, stop = ctx.Value("q", 0), ctx.Event()
    process = ctx.Process(target=_flood_main, args=(port, source, count, closed, stop), daemon=True)
    process.start()
    try:
        yield closed
    finally:
        stop.set()
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(10)


def _wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_peer_that_knows_the_secret_links_through_a_flood_from_another_address() -> None:
    """The flood replaces each connection the server closes at once, so the listener's queue may never
    empty: the server still reads the proven peer's Hello and answers its requests."""
    table = CacheTable({}, oom_code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY)
    server = Server(cluster_id=1, role=1, service=CacheService(Leases(table), _RemoteHooks()), secret=SECRET)
    server.start()
    try:
        port = server.listen_tcp("127.0.0.1", 0)
        # Twice as many connections as there are slots, from one address.
        with _flood(port, "127.0.0.5", 64) as closed:
            assert _wait_for(lambda: closed.value >= 128, 60)
            link = ClientLink.connect_tcp(
                "127.0.0.1",
                port,
                secret=SECRET,
                local_ip="127.0.0.6",
                engine=lambda ip: f"{ip}:2",
                callback_port=lambda ip: 0,
                cluster_id=2,
                remote_cluster_id=1,
                role=2,
                deadline=time.monotonic() + 60,
                incarnation=7,
            )
            for _ in range(20):
                seq = link.next_seq()
                assert link.request(Ping(seq), seq, time.monotonic() + 60) == Pong(seq)
            assert server.unproven_by_address().get("127.0.0.5", 0) <= AdmissionLimits().per_source
            link.close(say_bye=True)
    finally:
        server.close()
        table.close()


def test_no_secret_no_tcp_listener() -> None:
    table = CacheTable({}, oom_code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY)
    server = Server(cluster_id=1, role=1, service=CacheService(Leases(table)))
    server.start()
    try:
        with pytest.raises(StatusError, match="no shared secret"):
            server.listen_tcp("127.0.0.1", 0)
    finally:
        server.close()
        table.close()


def test_refusals_make_one_line_per_address_and_interval(patient_server: tuple[Server, int]) -> None:
    _, port = patient_server
    with warning_lines() as warnings:
        started = time.monotonic()
        flood = [_challenged(port, "127.0.0.8") for _ in range(AdmissionLimits().per_source)]
        for _ in range(100):
            flood.append(_challenged(port, "127.0.0.8"))
            assert _made_room(flood.pop(0))
        intruder = _challenged(port, "127.0.0.9")
        nonce = os.urandom(32)
        wrong = _auth.client_proof(b"not-the-right-secret", b"x" * 32, nonce, (2, 9, "10.0.0.2:1"), 1)
        intruder.sock.sendall(intruder.conn.send(Hello(PROTOCOL_VERSION, 2, 1, 2, 1, 9, nonce, wrong, "e:1")))
        assert isinstance(intruder.receive(), Error)
        elapsed_s = time.monotonic() - started
    flooding = [line for line in warnings.lines if "127.0.0.8" in line]
    # The first at once; then at most one a 10 s interval (none unless this took that long).
    assert 1 <= len(flooding) <= 2 + elapsed_s // 10, flooding
    assert flooding[0].startswith("server 1: refusing 127.0.0.8: closed to make room"), flooding
    assert [line for line in warnings.lines if "127.0.0.9" in line] == [
        "server 1: refusing 127.0.0.9: wrong shared secret "
        "(more refusals of 127.0.0.9 are counted, one line per 10 s)"
    ]
