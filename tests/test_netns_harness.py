"""Tests of the two-host harness (tests/_netns.py) itself: real namespaces, a real veth pair, real TCP
between the two hosts' addresses. Skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from llm_datadist._tools.netns import remove_stale_namespaces
from tests._netns import HostError, HostPair, HostProcess, netns_list, require_netns


@pytest.fixture
def pair() -> Iterator[HostPair]:
    require_netns()
    with HostPair() as made:
        yield made


LISTEN = """
import socket
srv = socket.socket()
srv.bind((ip, 0))
srv.listen()
srv.settimeout(5)
result = srv.getsockname()[1]
"""

CONNECT = """
import socket
cli = socket.create_connection((ip, port), timeout=5)
cli.settimeout(5)
cli.sendall(data)
"""

ACCEPT_ECHO = """
conn, peer = srv.accept()
conn.settimeout(5)
got = conn.recv(100)
conn.sendall(b"pong:" + got)
result = (got, peer[0])
"""

TRY_CONNECT = """
import socket
try:
    socket.create_connection((ip, port), timeout=1).close()
    result = "connected"
except OSError as exc:
    result = repr(exc)
"""


def test_hosts_exchange_bytes_over_the_veth(pair: HostPair) -> None:
    a, b = pair.host("a"), pair.host("b")
    port = b.run(LISTEN, ip=pair.ip_b)
    a.run(CONNECT, ip=pair.ip_b, port=port, data=b"ping")
    got, peer = b.run(ACCEPT_ECHO)
    assert got == b"ping"
    assert peer == pair.ip_a  # the connection came over the veth, from A's address
    assert a.run("result = cli.recv(100)") == b"pong:ping"
    # Each host lives in its own namespace: only its own address can be bound there.
    own_ns = os.readlink("/proc/self/ns/net")
    ns_a = a.run("import os; result = os.readlink('/proc/self/ns/net')")
    ns_b = b.run("import os; result = os.readlink('/proc/self/ns/net')")
    assert len({own_ns, ns_a, ns_b}) == 3
    bind = "import socket\nwith socket.socket() as s:\n    s.bind((ip, 0))\nresult = 'bound'"
    assert a.run(bind, ip=pair.ip_a) == "bound"
    with pytest.raises(HostError, match="Cannot assign requested address"):
        a.run(bind, ip=pair.ip_b)


def test_drop_link_cuts_and_restore_link_heals(pair: HostPair) -> None:
    a, b = pair.host("a"), pair.host("b")
    port = b.run(LISTEN, ip=pair.ip_b)
    a.run(CONNECT, ip=pair.ip_b, port=port, data=b"before")
    assert b.run(ACCEPT_ECHO)[0] == b"before"
    assert a.run("result = cli.recv(100)") == b"pong:before"

    pair.drop_link()
    assert a.run(TRY_CONNECT, ip=pair.ip_b, port=port) != "connected"
    # In-flight TCP stalls: what A sends now does not reach B while the link is down.
    a.run("cli.sendall(b'during')")
    stalled = "import socket\ntry:\n    result = conn.recv(100)\nexcept TimeoutError:\n    result = None"
    assert b.run("conn.settimeout(0.3)\n" + stalled) is None

    pair.restore_link()
    # The stalled bytes arrive once TCP retransmits over the healed link, on the same connection.
    assert b.run("conn.settimeout(5)\n" + stalled) == b"during"
    assert a.run(TRY_CONNECT, ip=pair.ip_b, port=port) == "connected"


def test_an_added_address_is_routed_both_ways_and_survives_a_dropped_link(pair: HostPair) -> None:
    a, b = pair.host("a"), pair.host("b")
    extra = pair.add_address("b")
    assert extra not in (pair.ip_a, pair.ip_b)
    port = a.run(LISTEN, ip=pair.ip_a)
    connect_from = CONNECT.replace("timeout=5)", "timeout=5, source_address=(from_ip, 0))")
    b.run(connect_from, ip=pair.ip_a, port=port, from_ip=extra, data=b"from")
    assert a.run(ACCEPT_ECHO) == (b"from", extra)  # A sees B's second address
    port_b = b.run(LISTEN, ip=extra)
    a.run(CONNECT, ip=extra, port=port_b, data=b"to")
    assert b.run(ACCEPT_ECHO) == (b"to", pair.ip_a)
    pair.drop_link()
    pair.restore_link()
    assert a.run(TRY_CONNECT, ip=extra, port=port_b) == "connected"


def test_state_env_and_errors(pair: HostPair, _runtime_dir: object) -> None:
    host = pair.host("a", env={"LLM_DATADIST_SECRET": "s3cret"})
    assert host.pid != os.getpid()
    assert host.run("import os; result = os.getpid()") == host.pid
    # Environment: the parent's plus `env`; the runtime dir is the namespace's own, below the parent's (a
    # host sees no other host's sockets).
    assert host.run("result = os.environ['LLM_DATADIST_RUNTIME_DIR']") == f"{_runtime_dir}/{pair.ns_a}"
    assert host.run("result = os.environ['LLM_DATADIST_SECRET']") == "s3cret"
    # State carries over between calls; `result` is per call.
    host.run("counter = 41")
    assert host.run("counter += 1\nresult = counter") == 42
    assert host.run("x = 1") is None
    with pytest.raises(HostError) as info:
        host.run("def inner():\n    raise ValueError('boom from the child')\ninner()")
    assert "ValueError: boom from the child" in info.value.traceback
    assert "inner" in info.value.traceback
    with pytest.raises(HostError, match="pickle"):
        host.run("result = lambda: 0")
    assert host.run("result = counter") == 42  # still serving after errors


def test_timeout_raises_and_the_child_is_still_reaped(pair: HostPair) -> None:
    host = pair.host("b")
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        host.run("import time; time.sleep(60)", timeout_s=0.3)
    assert time.monotonic() - started < 5
    started = time.monotonic()
    host.stop()
    assert time.monotonic() - started < 5  # a hung child is killed, not waited for
    assert not host.process.is_alive()
    assert host.process.exitcode is not None


def test_late_reply_after_timeout_is_not_mistaken_for_the_next(pair: HostPair) -> None:
    with HostProcess(pair.ns_a) as host:
        with pytest.raises(TimeoutError):
            host.run("import time; time.sleep(0.5); result = 'late'", timeout_s=0.1)
        assert host.run("result = 'next'") == "next"
    assert host.process.exitcode == 0


def test_child_exits_on_pipe_eof(pair: HostPair) -> None:
    host = pair.host("a")
    host._conn.close()  # what the child sees when the test process dies
    host.process.join(5)
    assert host.process.exitcode == 0


def test_namespaces_are_deleted_even_when_the_body_raises() -> None:
    require_netns()
    with pytest.raises(RuntimeError, match="body failed"), HostPair() as made:
        names = {made.ns_a, made.ns_b}
        assert names <= netns_list()
        made.host("a")
        raise RuntimeError("body failed")
    assert not names & netns_list()
    assert not any(name.startswith(f"llmdd-{os.getpid()}-") for name in netns_list())


def test_unavailable_gives_a_reason_and_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    import tests._netns as netns

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    netns.netns_unavailable.cache_clear()
    try:
        assert netns.netns_unavailable() == "network namespaces need root (euid is not 0)"
        with pytest.raises(pytest.skip.Exception, match="need root"):
            require_netns()
    finally:
        netns.netns_unavailable.cache_clear()  # the next caller probes the real machine again


def test_namespaces_of_a_dead_run_are_removed_and_a_live_ones_kept() -> None:
    require_netns()
    dead_pid = 1 << 23  # above the largest pid_max Linux allows: never a live process
    dead, live = f"llmdd-{dead_pid}-abcdef-a", f"llmdd-{os.getpid()}-fedcba-b"
    for name in (dead, live):
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        assert remove_stale_namespaces() == [dead]
        assert live in netns_list() and dead not in netns_list()
    finally:
        for name in (dead, live):
            subprocess.run(["ip", "netns", "delete", name], timeout=10, check=False, capture_output=True)
