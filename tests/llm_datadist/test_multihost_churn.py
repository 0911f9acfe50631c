"""Across hosts, owners that come and go (issue 29, item 6): a transfer to an owner that stopped or died
holds back only transfers into its own memory; the engine connections to an owner we no longer reach are
closed; no thread of a transfer outlives the unlink or the finalize. Owners on host a, the Decoder on host
b (two network namespaces joined by a veth pair), real processes and real engines; skipped, with the
reason, where namespaces cannot be made or the `multihost` extra is missing."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from llm_datadist._puller.remote import engine_available
from llm_datadist._shm.reaper import reap
from tests._netns import HostPair, HostProcess, require_netns

SECRET = "test-secret-of-the-churn-suite"
PORT_X, PORT_Y = 26140, 26141
X_ID, Y_ID, DECODER_ID = 1, 3, 2
WAIT_S = 30.0  # every poll below gives up after this long

COMMON = """
import os, signal, socket, threading, time
import numpy as np
from llm_datadist import *
from llm_datadist.ext import tensor_views
from llm_datadist._puller.peer_engine import ORPHANS

def fill(cache, base):
    for t, view in enumerate(tensor_views(cache)):
        flat = view.view(np.uint8).reshape(-1)
        flat[:] = (np.arange(flat.size) * 7 + base + 31 * t) % 251

def holds(cache, base):
    return all(
        np.array_equal(view.view(np.uint8).reshape(-1), (np.arange(view.nbytes) * 7 + base + 31 * t) % 251)
        for t, view in enumerate(tensor_views(cache))
    )

def tcp_to(ip, skip_ports):
    '''This process's TCP connections to `ip` but to `skip_ports` (our links): the transfer engines'
    connections; (all of them, those in CLOSE_WAIT: the peer closed its end and ours is still open).'''
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    want = socket.inet_aton(ip)[::-1].hex().upper()
    total = stale = 0
    with open("/proc/self/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            remote_ip, remote_port = fields[2].split(":")
            if fields[9] in inodes and remote_ip == want and int(remote_port, 16) not in skip_ports:
                total += 1
                stale += fields[3] == "08"
    return total, stale

def threads():
    return len(os.listdir("/proc/self/task"))

def settle(probe, want, seconds):
    '''Poll `probe()` until it returns `want` or `seconds` passed; returns its last value.'''
    deadline = time.monotonic() + seconds
    while (got := probe()) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got
"""

PROMPT = """
dd = LLMDataDist(LLMRole.PROMPT, cluster_id)
config = LLMConfig()
config.device_id = 0
config.listen_ip_info = f"{ip}:{port}"
config.sync_kv_timeout = 5000
dd.init(config.generate_options())
kvm = dd.kv_cache_manager
caches = {}
for req_id in req_ids:
    caches[req_id] = kvm.allocate_cache(desc, [CacheKey(cluster_id, req_id=req_id)])
    fill(caches[req_id], base + req_id)
"""

DECODER = """
dd = LLMDataDist(LLMRole.DECODER, decoder_id)
config = LLMConfig()
config.device_id = 0
config.sync_kv_timeout = timeout_ms
dd.init(config.generate_options())
kvm = dd.kv_cache_manager
core = dd._require_core()
clusters = {}

def link(cluster_id, port):
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = cluster_id
    cluster.append_local_ip_info(local_ip, 0)
    cluster.append_remote_ip_info(ip, port)
    clusters[cluster_id] = cluster
    ret, rets = dd.link_clusters([cluster], 5000)
    assert ret == LLMStatusCode.LLM_SUCCESS, (ret, rets)

def unlink(cluster_id):
    dd.unlink_clusters([clusters.pop(cluster_id)], 5000, force=True)

def pull(cluster_id, req_id, dst):
    try:
        kvm.pull_cache(CacheKey(cluster_id, req_id=req_id), dst, 0)
        return "LLM_SUCCESS"
    except LLMException as exc:
        return exc.status_code.name
"""


@pytest.fixture
def pair() -> Iterator[HostPair]:
    require_netns()
    reason = engine_available()
    if reason is not None:
        pytest.skip(reason)
    with HostPair() as made:
        yield made
    reap()  # what the owners killed here left in /dev/shm (the two "hosts" share it)


def _host(pair: HostPair, side: str, **env: str) -> HostProcess:
    host = pair.host("a" if side == "a" else "b", env={"LLM_DATADIST_SECRET": SECRET, **env})
    host.run(COMMON)
    return host


def _prompt(pair: HostPair, cluster_id: int, port: int, req_ids: list[int], desc: str) -> HostProcess:
    prompt = _host(pair, "a")
    prompt.run(
        f"desc = {desc}\n" + PROMPT,
        ip=pair.ip_a,
        port=port,
        cluster_id=cluster_id,
        req_ids=req_ids,
        base=10 * cluster_id,
    )
    return prompt


def _decoder(pair: HostPair, timeout_ms: int, **env: str) -> HostProcess:
    decoder = _host(pair, "b", **env)
    decoder.run(DECODER, ip=pair.ip_a, local_ip=pair.ip_b, decoder_id=DECODER_ID, timeout_ms=timeout_ms)
    return decoder


BIG = "CacheDesc(12, [1, 4 << 20], DataType.DT_INT8)"  # 48 MiB: a read that takes a while


def test_an_owner_that_stops_mid_read_holds_back_only_transfers_into_that_memory(pair: HostPair) -> None:
    """Owner X stops (SIGSTOP) while the Decoder reads 48 MiB from it: the read fails at its deadline and
    stays in the engine (an orphan: Mooncake cannot cancel it, and its progress timeout is set long here).
    Meanwhile a pull from owner Y into other memory succeeds; one into the orphan's memory waits for it
    (and fails at its own deadline); once X is killed the orphan ends, and that memory takes Y's bytes.
    Before the fix every transfer of the process waited for the orphan."""
    x = _prompt(pair, X_ID, PORT_X, [1, 2, 3], BIG)
    _prompt(pair, Y_ID, PORT_Y, [1, 2, 3], BIG)
    decoder = _decoder(pair, 2000, MC_TCP_PROGRESS_TIMEOUT_SEC="120")
    decoder.run(
        f"""
link(x_id, port_x)
link(y_id, port_y)
dst_x = kvm.allocate_cache({BIG})
dst_y = kvm.allocate_cache({BIG})
outcome = {{}}
""",
        x_id=X_ID,
        y_id=Y_ID,
        port_x=PORT_X,
        port_y=PORT_Y,
    )
    # A first read from X connects the engine to it, so that the next one is all bytes.
    warm = decoder.run("result = (pull(x_id, 1, dst_x), holds(dst_x, 10 * x_id + 1))", x_id=X_ID)
    assert warm == ("LLM_SUCCESS", True), warm
    stopped = False
    try:
        # The Decoder itself stops X the moment its read is handed to the engine (one PID namespace).
        for req_id in (2, 3):
            stopped = True
            code = decoder.run(
                """
outcome = {}
worker = threading.Thread(target=lambda: outcome.update(code=pull(x_id, req_id, dst_x)))
worker.start()
deadline = time.monotonic() + 30
while not core.cross.peer_engines()[1] and "code" not in outcome and time.monotonic() < deadline:
    time.sleep(0)
os.kill(x_pid, signal.SIGSTOP)
worker.join(30)
result = outcome.get("code")
""",
                x_id=X_ID,
                x_pid=x.pid,
                req_id=req_id,
                timeout_s=40,
            )
            if code != "LLM_SUCCESS":
                break
            os.kill(x.pid, signal.SIGCONT)
            stopped = False
        else:
            pytest.skip("every 48 MiB read ended before the owner could be stopped on this machine")
        assert code in ("LLM_WAIT_PROCESS_TIMEOUT", "LLM_LINK_FAILED"), code
        orphans = decoder.run("result = len(ORPHANS)")
        assert orphans == 1, "the read that gave up is no longer running in the engine"
        # Other memory, another owner: not held back.
        other = decoder.run(
            "result = (pull(y_id, 1, dst_y), holds(dst_y, 10 * y_id + 1), len(ORPHANS))", y_id=Y_ID
        )
        assert other == ("LLM_SUCCESS", True, 1), other
        # The orphan's memory: whatever it still writes must not land over a later pull's bytes. (Its
        # deadline spent, the pull cannot tell Y it gave the key up: the link is broken, as after any
        # timeout, and made again.)
        same = decoder.run(
            "result = (pull(y_id, 2, dst_x), len(ORPHANS))\nunlink(y_id)\nlink(y_id, port_y)",
            y_id=Y_ID,
            port_y=PORT_Y,
        )
        assert same == ("LLM_WAIT_PROCESS_TIMEOUT", 1), same
        # The owner is killed: the orphan ends, its memory is free for the next pull.
        x.kill()
        stopped = False
        after = decoder.run(
            "ended = settle(lambda: len(ORPHANS), 0, 60)\n"
            "result = (ended, pull(y_id, 3, dst_x), holds(dst_x, 10 * y_id + 3))",
            y_id=Y_ID,
            timeout_s=90,
        )
        assert after == (0, "LLM_SUCCESS", True), after
    finally:
        if stopped:
            x.kill()  # SIGKILL ends a stopped process too


SMALL = "CacheDesc(2, [1, 3333], DataType.DT_INT8)"


@pytest.mark.parametrize("ending", ["finalize", "SIGKILL", "unlink"])
def test_connections_and_threads_of_an_owner_gone_or_unlinked_end(pair: HostPair, ending: str) -> None:
    """The Decoder reads from owner X, which then ends (a clean finalize, or SIGKILL), or which the Decoder
    unlinks: the engine connections to X's engine close (none stays in CLOSE_WAIT, as Mooncake's pool
    kept them before), and the Decoder is back to the threads it had before it first read from X.
    Before the fix each gone owner left up to 4 connections, and the first read left threads, for good."""
    x = _prompt(pair, X_ID, PORT_X, [1, 2], SMALL)
    decoder = _decoder(pair, 5000)
    before = decoder.run(
        f"""
link(x_id, port_x)
dst = kvm.allocate_cache({SMALL})
base_threads = threads()
code = pull(x_id, 1, dst)
result = (code, holds(dst, 10 * x_id + 1), tcp_to(ip, [port_x]), threads() > base_threads)
""",
        x_id=X_ID,
        port_x=PORT_X,
    )
    assert before[:2] == ("LLM_SUCCESS", True), before
    assert before[2][0] > 0, "the read made no engine connection to the owner's host"
    if ending == "finalize":
        x.run("dd.finalize()")
    elif ending == "SIGKILL":
        x.kill()
    if ending != "unlink":
        # The Decoder learns it at its next pull (or at once, through the link's hang-up).
        code = decoder.run("result = pull(x_id, 2, dst)", x_id=X_ID)
        assert code == "LLM_LINK_FAILED", code
    after = decoder.run(
        """
unlink(x_id)
conns = settle(lambda: tcp_to(ip, [port_x]), (0, 0), 30)
left = settle(threads, base_threads, 30)
result = (conns, left, base_threads, core.cross.peer_engines())
""",
        x_id=X_ID,
        port_x=PORT_X,
        timeout_s=70,
    )
    conns, left, base_threads, engines = after
    assert conns == (0, 0), f"engine connections to the owner's host (all, in CLOSE_WAIT): {conns}"
    assert left == base_threads, f"{left - base_threads} thread(s) left over after the unlink"
    assert engines == (0, 0), engines


def test_no_thread_of_a_transfer_outlives_finalize(pair: HostPair) -> None:
    """Two instances one after the other in one Decoder process, each linked to the owner; only the second
    reads. After each finalize the process has the same threads and no engine connection to the owner's
    host: what the read started (an engine, its worker, its connections) ended with the instance."""
    _prompt(pair, X_ID, PORT_X, [1], SMALL)
    decoder = _host(pair, "b")
    source = (
        DECODER
        + f"""
link(x_id, port_x)
dst = kvm.allocate_cache({SMALL})
code = pull(x_id, 1, dst) if read else "not read"
kvm.deallocate_cache(dst)
dd.finalize()
result = (code, settle(lambda: tcp_to(ip, [port_x])[0], 0, 30))
"""
    )
    values: dict[str, Any] = {
        "ip": pair.ip_a,
        "local_ip": pair.ip_b,
        "decoder_id": DECODER_ID,
        "timeout_ms": 5000,
        "x_id": X_ID,
        "port_x": PORT_X,
    }
    first = decoder.run(source, read=False, **values)
    assert first == ("not read", 0), first
    without = decoder.run("result = threads()")
    second = decoder.run(source, read=True, **values, timeout_s=60)
    assert second == ("LLM_SUCCESS", 0), second
    left = decoder.run("result = settle(threads, without, 30)", without=without, timeout_s=40)
    assert left == without, f"{left - without} thread(s) left over after finalize"
