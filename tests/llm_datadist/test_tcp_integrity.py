"""A host on the path of a TCP link, on loopback: a relay between a real ClientLink and a real Server that
changes, repeats or drops one frame after the handshake. The tags give it away: that connection ends,
its lease is dropped as any dropped connection's is (the key comes back), the server logs why, and
another link to the same server is served on as if nothing happened."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from llm_datadist._errors import PeerGone
from llm_datadist._keys import KEY_REQ
from llm_datadist._owner.leases import Leases
from llm_datadist._owner.service import CacheService, NodeHooks
from llm_datadist._owner.table import CacheTable
from llm_datadist._protocol.frames import HEADER_NBYTES
from llm_datadist._protocol.integrity import TAG_NBYTES
from llm_datadist._protocol.messages import RULES_V1, Location, Ping, PinRequest, Pong, Release
from llm_datadist._shm.pool import Pool
from llm_datadist._wire.client import ClientLink
from llm_datadist._wire.server import Server
from llm_datadist.status import LLMStatusCode
from tests._logs import WarningLines, warning_lines

SECRET = b"the-secret-of-the-integrity-test"
OWNER = 1
C2S, S2C = "client->server", "server->client"
# Frames before the tags begin: the Hello one way, the Challenge and the Welcome the other.
_UNTAGGED = {C2S: 1, S2C: 2}
_WAIT_S = 10.0


class _RemoteHooks(NodeHooks):
    def serve_remote(self, local_ip: str) -> str:
        return f"{local_ip}:1"  # metadata only: no bytes move in this test


class _Relay:
    """Forwards one connection to `target` frame by frame; `arm(direction, action)` applies `action`
    ("flip" the tag's last bit, "replay" the frame, "drop" it) to the next frame going that way."""

    def __init__(self, target: int) -> None:
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._armed: dict[str, str] = {}
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._accepted = threading.Thread(target=self._accept, name="relay-accept", daemon=True)
        self._accepted.start()

    def arm(self, direction: str, action: str) -> None:
        with self._lock:
            self._armed[direction] = action

    def _accept(self) -> None:
        self._listener.settimeout(_WAIT_S)
        client, _ = self._listener.accept()
        server = socket.create_connection(("127.0.0.1", self._target), _WAIT_S)
        self._socks += [client, server]
        for source, sink, direction in ((client, server, C2S), (server, client, S2C)):
            thread = threading.Thread(target=self._pump, args=(source, sink, direction), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _pump(self, source: socket.socket, sink: socket.socket, direction: str) -> None:
        buffer, frames = bytearray(), 0
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                buffer += data
                while len(buffer) >= HEADER_NBYTES:
                    tag_nbytes = TAG_NBYTES if frames >= _UNTAGGED[direction] else 0
                    end = HEADER_NBYTES + int.from_bytes(buffer[:HEADER_NBYTES], "big") + tag_nbytes
                    if len(buffer) < end:
                        break
                    frame, buffer = bytes(buffer[:end]), buffer[end:]
                    frames += 1
                    sink.sendall(self._apply(direction, frame) if tag_nbytes else frame)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def _apply(self, direction: str, frame: bytes) -> bytes:
        with self._lock:
            action = self._armed.pop(direction, "")
        if action == "flip":
            return frame[:-1] + bytes([frame[-1] ^ 1])
        if action == "replay":
            return frame + frame
        if action == "drop":
            return b""
        return frame

    def close(self) -> None:
        self._accepted.join(_WAIT_S)
        for sock in [self._listener, *self._socks]:
            sock.close()
        for thread in self._threads:
            thread.join(_WAIT_S)


@pytest.fixture
def warnings() -> Iterator[WarningLines]:
    with warning_lines() as handler:
        yield handler


def _link(port: int, cluster_id: int) -> ClientLink:
    return ClientLink.connect_tcp(
        "127.0.0.1",
        port,
        secret=SECRET,
        local_ip="127.0.0.1",
        engine=lambda ip: f"{ip}:2",
        callback_port=lambda ip: 0,
        cluster_id=cluster_id,
        remote_cluster_id=OWNER,
        role=2,
        deadline=time.monotonic() + _WAIT_S,
        incarnation=cluster_id,
    )


def _ping(link: ClientLink) -> None:
    seq = link.next_seq()
    assert link.request(Ping(seq), seq, time.monotonic() + _WAIT_S) == Pong(seq)


def _pull(link: ClientLink) -> Location:
    """Pin key 1 of the owner (consumed once the pull ends well)."""
    seq = link.next_seq()
    request = PinRequest(seq, KEY_REQ, 1, 0, 0, 0, 2, True, 3333, 0, True, False, RULES_V1)
    grant = link.request(request, seq, time.monotonic() + _WAIT_S)
    assert isinstance(grant, Location)
    return grant


def _wait_for_no_lease(leases: Leases) -> None:
    deadline = time.monotonic() + _WAIT_S
    while leases.stats()["leases"]:
        assert time.monotonic() < deadline, leases.stats()
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("direction", "action"),
    [(C2S, "flip"), (C2S, "replay"), (C2S, "drop"), (S2C, "flip"), (S2C, "replay")],
)
def test_a_frame_changed_on_the_path_ends_only_that_connection(
    direction: str, action: str, warnings: WarningLines
) -> None:
    table = CacheTable({1: Pool(capacity_nbytes=1 << 20)}, oom_code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY)
    table.allocate(num_tensors=2, tensor_nbytes=3333, batch_size=1, keys=[(KEY_REQ, 1, 0)])
    leases = Leases(table)
    server = Server(cluster_id=OWNER, role=1, service=CacheService(leases, _RemoteHooks()), secret=SECRET)
    server.start()
    relay: _Relay | None = None
    try:
        port = server.listen_tcp("127.0.0.1", 0)
        relay = _Relay(port)
        victim, bystander = _link(relay.port, 2), _link(port, 3)
        _ping(victim)
        grant = _pull(victim)
        assert leases.stats()["leases"] == 1

        relay.arm(direction, action)
        if action == "drop":  # the Release is lost: the Ping after it gives that away
            victim.send_only(Release(grant.lease_id, True), time.monotonic() + _WAIT_S)
        with pytest.raises(PeerGone):
            # A replayed reply is noticed at the next one: up to two requests may go through first.
            for _ in range(3):
                _ping(victim)
        assert victim.broken is not None
        if direction == S2C:  # the client saw it (not, say, a reply out of order after a replay)
            assert "does not carry its tag" in victim.broken, victim.broken

        # The lease died with the connection and the key came back: the other link pulls it.
        _wait_for_no_lease(leases)
        _ping(bystander)
        assert _pull(bystander).segment == grant.segment
        server.check_alive()
        assert [peer.cluster_id for peer in server.peers()] == [3]
        if direction == C2S:  # the server saw it, and said so
            assert any("does not carry its tag" in line for line in warnings.lines), warnings.lines
        victim.close(say_bye=False)
        bystander.close(say_bye=True)
    finally:
        if relay is not None:
            relay.close()
        server.close()
        table.close()
