"""A flood of connections that never prove the secret, against an owner serving TCP in one network
namespace, from a second address of the other namespace; a Decoder there with the secret links and pulls
while it runs. Real processes, real engines; traffic only between the namespaces the test makes. Skipped,
with the reason, where namespaces cannot be made or the `multihost` extra is not installed."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from llm_datadist._puller.remote import engine_available
from llm_datadist._wire.admission import AdmissionLimits
from tests._netns import HostPair, HostProcess, require_netns

SECRET = "test-secret-of-the-flood-test"
PORT = 26300
PROMPT_ID, DECODER_ID = 1, 2
FLOOD_CONNECTIONS = 64  # twice the unproven connections a server holds in all
REQUESTS = (5, 6, 7)

# The attacker: connections that never say a word, each one the server closes replaced at once.
FLOOD = """
import selectors, socket, threading

class Flood:
    def __init__(self, count):
        self.selector = selectors.DefaultSelector()
        self.stop = threading.Event()
        self.changed = threading.Condition()
        self.opened = self.closed = self.told_why = self.missing = 0
        for _ in range(count):
            self.open()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def open(self):
        try:
            sock = socket.create_connection((ip, port), timeout=5, source_address=(from_ip, 0))
        except OSError:
            self.missing += 1  # tried again on the next round
            return
        sock.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ, bytearray())
        self.opened += 1

    def run(self):
        while not self.stop.is_set():
            for key, _ in self.selector.select(0.1):
                try:
                    data = key.fileobj.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    key.data.extend(data[:4096])  # a Challenge, maybe an Error saying why
                    continue
                self.selector.unregister(key.fileobj)
                key.fileobj.close()
                with self.changed:
                    self.closed += 1
                    # Closed to make room, or (a connection that outlived the others on a slow
                    # machine) out of time: either way the owner said so before it closed.
                    self.told_why += b"make room" in key.data or b"no proof" in key.data
                    self.changed.notify_all()
                self.open()
            for _ in range(self.missing):
                self.missing -= 1
                self.open()

    def wait_closed(self, count, timeout_s):
        with self.changed:
            return self.changed.wait_for(lambda: self.closed >= count, timeout_s)

    def finish(self):
        self.stop.set()
        self.thread.join(10)
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()
        return {"opened": self.opened, "closed": self.closed, "told_why": self.told_why}

flood = Flood(count)
"""

# Both sides keep the library's log lines from WARNING on (its logger says only errors unless configured).
LINES = """
import logging
from llm_datadist.utils.log import log

class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

warnings = Lines()
log.setLevel(logging.WARNING)
log.addHandler(warnings)
"""

PROMPT = """
import numpy as np
from llm_datadist import *
from llm_datadist.ext import tensor_views

dd = LLMDataDist(LLMRole.PROMPT, prompt_id)
config = LLMConfig()
config.device_id = 0
config.listen_ip_info = f"{ip}:{port}"
config.sync_kv_timeout = 60000
dd.init(config.generate_options())
kvm = dd.kv_cache_manager
caches = []
for req_id in requests:
    desc = CacheDesc(4, [1, 3333], DataType.DT_INT8)
    cache = kvm.allocate_cache(desc, [CacheKey(prompt_id, req_id=req_id)])
    for t, view in enumerate(tensor_views(cache)):
        flat = view.view(np.uint8).reshape(-1)
        flat[:] = (np.arange(flat.size) * 7 + req_id + 31 * t) % 251
    caches.append(cache)
server = dd._require_core().server
"""

DECODER = """
import numpy as np
from llm_datadist import *
from llm_datadist.ext import tensor_views

dd = LLMDataDist(LLMRole.DECODER, decoder_id)
config = LLMConfig()
config.device_id = 0
config.sync_kv_timeout = 60000
dd.init(config.generate_options())
kvm = dd.kv_cache_manager
"""

LINK_AND_PULL = """
cluster = LLMClusterInfo()
cluster.remote_cluster_id = prompt_id
cluster.append_local_ip_info(local_ip, 0)
cluster.append_remote_ip_info(ip, port)
ret, rets = dd.link_clusters([cluster], 60000)
linked = (ret.name, [code.name for code in rets])
dst = kvm.allocate_cache(CacheDesc(4, [1, 3333], DataType.DT_INT8))
pulled = []
for req_id in requests if linked == ("LLM_SUCCESS", ["LLM_SUCCESS"]) else ():
    kvm.pull_cache(CacheKey(prompt_id, req_id=req_id), dst, 0)
    pulled.append(all(
        np.array_equal(view.view(np.uint8).reshape(-1), (np.arange(3333) * 7 + req_id + 31 * t) % 251)
        for t, view in enumerate(tensor_views(dst))
    ))
result = (linked, pulled)
"""

UNPROVEN = "result = server.unproven_by_address().get(attacker, 0)"


@pytest.fixture
def pair() -> Iterator[HostPair]:
    require_netns()
    reason = engine_available()
    if reason is not None:
        pytest.skip(reason)
    with HostPair() as made:
        yield made


# Seven processes and a flood on two cores: generous, as every deadline here (none of them is asserted on).
@pytest.mark.timeout(300)
def test_a_flood_of_unproven_connections_keeps_no_peer_that_knows_the_secret_out(pair: HostPair) -> None:
    limits = AdmissionLimits()
    attacker_ip = pair.add_address("b")
    prompt = pair.host("a", env={"LLM_DATADIST_SECRET": SECRET})
    prompt.run(LINES)
    prompt.run(PROMPT, ip=pair.ip_a, port=PORT, prompt_id=PROMPT_ID, requests=REQUESTS, timeout_s=120)
    attacker: HostProcess = pair.host("b")  # knows no secret
    # Started before the flood: on a loaded machine, spawning a host while it runs can take long.
    decoder = pair.host("b", env={"LLM_DATADIST_SECRET": SECRET})
    decoder.run(LINES)
    decoder.run(DECODER, decoder_id=DECODER_ID, timeout_s=120)
    started = time.monotonic()
    # The attacker replaces each connection the owner closes at once: the owner's listener queue may
    # never empty, and the owner must still serve everything else.
    attacker.run(FLOOD, ip=pair.ip_a, port=PORT, from_ip=attacker_ip, count=FLOOD_CONNECTIONS)
    # The flood is on once the owner has closed twice as many of its connections as it holds.
    assert attacker.run("result = flood.wait_closed(count, 60)", count=2 * FLOOD_CONNECTIONS, timeout_s=70)
    assert prompt.run(UNPROVEN, attacker=attacker_ip) <= limits.per_source
    closed_before = attacker.run("result = flood.closed")

    linked, pulled = decoder.run(
        LINK_AND_PULL,
        ip=pair.ip_a,
        port=PORT,
        local_ip=pair.ip_b,
        prompt_id=PROMPT_ID,
        requests=REQUESTS,
        timeout_s=200,
    )
    why = "result = list(warnings.lines)"  # what each side logged, should the link fail
    assert linked == ("LLM_SUCCESS", ["LLM_SUCCESS"]), (prompt.run(why), decoder.run(why))
    assert pulled == [True] * len(REQUESTS)
    assert prompt.run(UNPROVEN, attacker=attacker_ip) <= limits.per_source
    # Still flooding all along: the owner closed more of its connections meanwhile.
    assert attacker.run("result = flood.closed") > closed_before
    stats = attacker.run("result = flood.finish()", timeout_s=30)
    lines = prompt.run("result = list(warnings.lines)")
    elapsed_s = time.monotonic() - started

    # Every connection the owner closed was told why; the attacker never held more than its share.
    assert stats["closed"] >= 2 * FLOOD_CONNECTIONS and stats["told_why"] == stats["closed"], stats
    flooding = [line for line in lines if attacker_ip in line]
    # One line at once, then at most one per 10 s interval; thousands of refusals are not thousands of lines.
    assert 1 <= len(flooding) <= 2 + elapsed_s // 10, flooding
    assert flooding[0].startswith(f"server {PROMPT_ID}: refusing {attacker_ip}: closed to make room"), (
        flooding
    )
    assert all("more connections refused" in line for line in flooding[1:]), flooding
    assert not [line for line in lines if pair.ip_b in line and "refusing" in line], lines
    assert prompt.run("server.check_alive()\nresult = len(server.peers())") >= 1
    # Here rather than at exit: a host that does not stop within its few seconds is killed, and a busy
    # machine must not turn that into segments left behind.
    decoder.run("dd.finalize()", timeout_s=60)
    prompt.run("dd.finalize()", timeout_s=60)
