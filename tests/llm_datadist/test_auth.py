"""The shared secret of TCP links (`_auth`) and what the TCP server does before a peer proved it knows it:
the secret's sources and their checks, the proofs, and a real `Server` listening on loopback TCP that
refuses a wrong proof, a Hello before its Challenge, an oversized frame and one connection too many."""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llm_datadist import _auth
from llm_datadist._engine import CacheTable
from llm_datadist._errors import StatusError
from llm_datadist._protocol.connection import Connection, ConnRole
from llm_datadist._protocol.messages import PROTOCOL_VERSION, Challenge, Error, Hello, Message
from llm_datadist._transport import MAX_UNAUTHENTICATED, Server
from llm_datadist.status import LLMStatusCode

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


@pytest.fixture
def tcp_server() -> Iterator[tuple[Server, int]]:
    table = CacheTable({}, oom_code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY)
    server = Server(cluster_id=1, role=1, table=table, secret=SECRET)
    server.start()
    try:
        port = server.listen_tcp("127.0.0.1", 0)
        yield server, port
    finally:
        server.close()
        table.close()


class _Raw:
    """A TCP peer that speaks frames by hand (whatever a hostile client may send)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.conn = Connection(ConnRole.CLIENT, challenge=True)

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


def test_a_unix_style_hello_without_proof_is_refused_on_tcp(tcp_server: tuple[Server, int]) -> None:
    _, port = tcp_server
    peer = _Raw(port)
    assert isinstance(peer.receive(), Challenge)
    peer.sock.sendall(peer.conn.send(Hello(PROTOCOL_VERSION, 2, 1, 2, os.getpid(), 9)))
    refused = peer.receive()
    assert isinstance(refused, Error) and refused.message == "no proof of the shared secret"


def test_unauthenticated_connections_are_capped(tcp_server: tuple[Server, int]) -> None:
    _, port = tcp_server
    pending = [_Raw(port) for _ in range(MAX_UNAUTHENTICATED)]
    for peer in pending:
        assert isinstance(peer.receive(), Challenge)
    extra = _Raw(port)
    assert extra.receive() is None  # closed at accept, with no challenge
    pending.pop().sock.close()
    deadline = time.monotonic() + 5
    while not isinstance(_Raw(port).receive(), Challenge):  # once the server saw the close, there is room
        assert time.monotonic() < deadline, "no room after a pending connection closed"
        time.sleep(0.01)


def test_no_secret_no_tcp_listener() -> None:
    table = CacheTable({}, oom_code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY)
    server = Server(cluster_id=1, role=1, table=table)
    server.start()
    try:
        with pytest.raises(StatusError, match="no shared secret"):
            server.listen_tcp("127.0.0.1", 0)
    finally:
        server.close()
        table.close()
