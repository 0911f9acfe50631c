"""Two HIXL engines on two "hosts" (network namespaces joined by a veth pair): the client connects over
TCP with the shared secret and Mooncake Transfer Engine moves the bytes, READ and WRITE, as `llm_datadist`
does across hosts; a client without the secret is refused. Skipped, with the reason, where namespaces
cannot be made or the `multihost` extra is not installed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llm_datadist._puller.remote import engine_available
from tests._netns import HostPair, HostProcess, require_netns

SECRET = "test-secret-of-the-hixl-suite"
PORT = 26120

COMMON = """
import ctypes
import hixl

def pattern(seed, nbytes):
    return bytes((i * 7 + seed) % 251 for i in range(nbytes))

def register(engine, nbytes, seed=None):
    buffer = ctypes.create_string_buffer(pattern(seed, nbytes) if seed is not None else nbytes, nbytes)
    buffers.append(buffer)
    ret, handle = engine.register_mem(hixl.MemDesc(ctypes.addressof(buffer), nbytes), hixl.MEM_HOST)
    assert ret == hixl.SUCCESS, ret
    return ctypes.addressof(buffer)

buffers = []
engine = hixl.Hixl()
"""


@pytest.fixture
def pair() -> Iterator[HostPair]:
    require_netns()
    reason = engine_available()
    if reason is not None:
        pytest.skip(reason)
    with HostPair() as made:
        yield made


def _host(pair: HostPair, side: str, secret: str | None = SECRET) -> HostProcess:
    host = pair.host("a" if side == "a" else "b", env={"LLM_DATADIST_SECRET": secret} if secret else {})
    host.run(COMMON)
    return host


def test_read_and_write_across_hosts(pair: HostPair) -> None:
    server = _host(pair, "a")
    name = f"{pair.ip_a}:{PORT}"
    remote = server.run(
        "assert engine.initialize(name, {}) == hixl.SUCCESS\nresult = register(engine, 3333, 5)", name=name
    )
    client = _host(pair, "b")
    result = client.run(
        """
assert engine.initialize(f"{ip}:0", {}) == hixl.SUCCESS
here = register(engine, 8192)
connected = engine.connect(name, 5000)
descs = [hixl.TransferOpDesc(here, remote, 3333), hixl.TransferOpDesc(here + 4000, remote + 1000, 17)]
read = engine.transfer_sync(name, hixl.READ, descs, 5000)
got = (ctypes.string_at(here, 3333), ctypes.string_at(here + 4000, 17))
ctypes.memset(here, 0x42, 100)
written = engine.transfer_sync(name, hixl.WRITE, [hixl.TransferOpDesc(here, remote + 3233, 100)], 5000)
outside = engine.transfer_sync(name, hixl.READ, [hixl.TransferOpDesc(here, remote + 3000, 334)], 5000)
result = (connected, read, got == (pattern(5, 3333), pattern(5, 3333)[1000:1017]), written, outside)
""",
        name=name,
        ip=pair.ip_b,
        remote=remote,
    )
    assert result == (0, 0, True, 0, 103900)  # SUCCESS x2, the bytes, SUCCESS, PARAM_INVALID
    tail = server.run("result = ctypes.string_at(remote + 3233, 100) == b'\\x42' * 100", remote=remote)
    assert tail is True
    client.run("engine.finalize()")
    server.run("engine.finalize()")


def test_a_client_without_the_secret_is_refused(pair: HostPair) -> None:
    server = _host(pair, "a")
    name = f"{pair.ip_a}:{PORT}"
    server.run("assert engine.initialize(name, {}) == hixl.SUCCESS", name=name)
    client = _host(pair, "b", secret="another-secret-of-16-chars")
    refused = client.run(
        "assert engine.initialize('0.0.0.0', {}) == hixl.SUCCESS\nresult = engine.connect(name, 3000)",
        name=name,
    )
    assert refused == 503900  # FAILED
    client.run("engine.finalize()")
    server.run("engine.finalize()")
