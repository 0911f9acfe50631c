"""Hostile input against a live Prompt: random bytes, malformed and out-of-order frames, well-formed
requests with out-of-range ids, releases of leases never granted, and a flood of connections. Each
closes or answers its own connection; the server and the legitimate link keep working and no memory is
touched (the Prompt's data is checked byte for byte at the end)."""

from __future__ import annotations

import os
import socket
import struct
import time

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_datadist import CacheDesc, CacheKey, DataType, LLMStatusCode
from llm_datadist.ext import tensor_views
from protocol.frames import encode_frame
from protocol.messages import PROTOCOL_VERSION, Hello, PullRequest, Release, ResolveRequest
from tests._peer import PROMPT_IP, PromptPeer, decoder

P = 1
PORT = 21500

# Things a confused or malicious same-uid process could send after a valid handshake.
_U64 = st.integers(0, 2**64 - 1)
_U32 = st.integers(0, 2**32 - 1)
well_formed_requests = st.one_of(
    st.builds(
        PullRequest,
        _U32,
        st.sampled_from([1, 2, 3]),
        _U64,
        _U64,
        _U32,
        _U32,
        st.integers(1, 2**32 - 1),
        st.booleans(),
        st.integers(1, 2**64 - 1),
        _U64,
        st.booleans(),
    ),
    st.builds(
        ResolveRequest,
        _U32,
        st.sampled_from([1, 2, 3, 4]),
        _U64,
        _U64,
        _U32,
        _U32,
        st.integers(1, 2**32 - 1),
        st.booleans(),
        st.booleans(),
        st.booleans(),
    ),
    st.builds(Release, _U64, st.booleans()),
)
raw_payloads = st.one_of(
    st.binary(max_size=200),
    st.builds(
        lambda obj: encode_frame(obj),
        st.recursive(
            st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20),
            lambda inner: st.lists(inner, max_size=5),
            max_leaves=12,
        ),
    ),
    st.builds(lambda n: struct.pack("!I", n), st.integers(0, 2**32 - 1)),
)


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(path)
    return sock


def _handshake(sock: socket.socket) -> None:
    sock.sendall(encode_frame(Hello(PROTOCOL_VERSION, 66, P, 2, os.getpid(), 66).to_wire()))
    header = sock.recv(4, socket.MSG_WAITALL)
    (length,) = struct.unpack("!I", header)
    reply = msgpack.unpackb(sock.recv(length, socket.MSG_WAITALL))
    assert reply[0] == 2, reply  # Welcome


def _drain(sock: socket.socket) -> None:
    """Read whatever the server answers until it closes the connection or goes quiet."""
    sock.settimeout(0.2)
    try:
        while sock.recv(65536):
            pass
    except (TimeoutError, OSError):
        pass


def test_hostile_input_never_disturbs_the_server(seed: int, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    with PromptPeer(P, PORT, seed) as peer, decoder() as dd:
        assert dd.link_clusters([peer.cluster_info()])[0] == LLMStatusCode.LLM_SUCCESS
        cache_id = peer.alloc(2, [1, 512], [(P, 1)])
        path = os.fspath(_runtime_dir / f"{PROMPT_IP}_{PORT}.sock")
        tried = {"raw": 0, "requests": 0}

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.lists(raw_payloads, min_size=1, max_size=3))
        def raw(payloads: list[bytes]) -> None:
            tried["raw"] += 1
            with _connect(path) as sock:
                for payload in payloads:
                    try:
                        sock.sendall(payload)
                    except OSError:
                        break  # the server already closed this connection
                _drain(sock)

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.lists(well_formed_requests, min_size=1, max_size=4))
        def requests(messages: list[object]) -> None:
            tried["requests"] += 1
            with _connect(path) as sock:
                _handshake(sock)
                for message in messages:
                    try:
                        sock.sendall(encode_frame(message.to_wire()))  # type: ignore[attr-defined]
                    except OSError:
                        break
                _drain(sock)

        raw()
        requests()
        # The legitimate link still works, nothing leaked a lease, and the data is untouched.
        dd.check_link_status(P)
        deadline = time.monotonic() + 10
        while peer.call("stats")["leases"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert peer.call("stats")["leases"] == 0
        dst = dd.kv_cache_manager.allocate_cache(CacheDesc(2, [1, 512], DataType.DT_FLOAT16))
        dd.kv_cache_manager.pull_cache(CacheKey(P, 1), dst)
        for t, view in enumerate(tensor_views(dst)):
            np.testing.assert_array_equal(view.view(np.uint8).reshape(-1), peer.expected(cache_id, t, 1024))
        print(f"hostile inputs tried: {tried}")


def test_a_flood_of_connections_is_bounded_and_survived(seed: int, _runtime_dir) -> None:  # type: ignore[no-untyped-def]
    with PromptPeer(P, PORT + 1, seed) as peer, decoder() as dd:
        path = os.fspath(_runtime_dir / f"{PROMPT_IP}_{PORT + 1}.sock")
        flood = []
        try:
            for _ in range(600):  # more than the server's 512 connections
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(5)
                try:
                    sock.connect(path)
                except OSError:
                    sock.close()
                    continue
                flood.append(sock)
            assert peer.call("stats")["caches"] == 0  # the Prompt still answers its own control pipe
        finally:
            for sock in flood:
                sock.close()
        # Once the flood is gone, a legitimate link is served again.
        deadline = time.monotonic() + 20
        while dd.link_clusters([peer.cluster_info()], timeout=2000)[0] != LLMStatusCode.LLM_SUCCESS:
            assert time.monotonic() < deadline, "the server never recovered from the flood"
            time.sleep(0.1)
        dd.check_link_status(P)
