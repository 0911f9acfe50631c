"""Transfer statistics (docs/metrics.md): an owner and two pullers in three processes move known bytes; the
counters each of them should move, read through `ext.stats()`, from another process (`list_stats`) and
through `llm-datadist stats` (table and JSON); a killed puller's stats segment is not listed and is reaped;
counting switched off leaves no segment."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from llm_datadist import (
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
from llm_datadist._shm.reaper import reap
from llm_datadist._shm.stats import list_stats
from llm_datadist.ext import stats
from tests._peer import PROMPT_IP, PromptPeer, decoder

P, A, B = 1, 2, 3
U64 = 2**64 - 1
PREFIX = (P, U64, 0, 5)
SHAPE = [1, 2048]  # 4 KiB a tensor
TENSOR_NBYTES = 4096


def _port() -> int:
    return 32000 + (os.getpid() * 7) % 20000


def _cluster(port: int) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = P
    info.append_local_ip_info(PROMPT_IP, 0)
    info.append_remote_ip_info(PROMPT_IP, port)
    return info


def _puller_main(pipe: Connection, port: int, pulls: int) -> None:
    """Puller B: `pulls` pulls of the prefix key's 2 tensors, one of a key that does not exist, then waits
    (killed, or told to stop)."""
    datadist = LLMDataDist(LLMRole.DECODER, B)
    try:
        config = LLMConfig()
        config.device_id = 0
        datadist.init(config.generate_options())
        assert datadist.link_clusters([_cluster(port)], 5000)[0] == LLMStatusCode.LLM_SUCCESS
        manager = datadist.kv_cache_manager
        dst = manager.allocate_cache(CacheDesc(2, SHAPE, DataType.DT_FLOAT16))
        for _ in range(pulls):
            manager.pull_cache(CacheKey(*PREFIX), dst)
        try:
            manager.pull_cache(CacheKey(P, 999), dst)
        except LLMException as exc:
            assert exc.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        pipe.send(("ok", os.getpid()))
        pipe.poll(600)
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
    finally:
        datadist.finalize()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llm_datadist._tools.cli", "stats", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_an_owner_and_two_pullers_count_what_they_moved(seed: int, tmp_path: Path) -> None:
    port = _port()
    ctx = mp.get_context("spawn")
    with PromptPeer(P, port, seed) as peer, decoder(A) as dd:
        cache_id = peer.alloc(2, SHAPE, [PREFIX])
        assert dd.link_clusters([_cluster(port)], 5000)[0] == LLMStatusCode.LLM_SUCCESS
        ours, child_end = ctx.Pipe()
        puller = ctx.Process(target=_puller_main, args=(child_end, port, 7), daemon=True)
        puller.start()
        try:
            manager = dd.kv_cache_manager
            dst = manager.allocate_cache(CacheDesc(2, SHAPE, DataType.DT_FLOAT16))
            before = stats()
            for _ in range(3):
                manager.pull_cache(CacheKey(*PREFIX), dst)
            with pytest.raises(LLMException):
                manager.pull_cache(CacheKey(P, 999), dst)
            moved = stats().since(before)
            counters = moved.counters
            assert counters["v1.pull.shm.transfers"] == 3
            assert counters["v1.pull.shm.bytes"] == 3 * 2 * TENSOR_NBYTES
            assert counters["v1.pull.shm.runs"] == 3 * 2
            assert counters["v1.pull.failures"] == 1
            assert counters["status.LLM_KV_CACHE_NOT_EXIST"] == 1
            histogram = sum(v for k, v in counters.items() if k.startswith("v1.pull.under_") or "over_" in k)
            assert histogram == 3  # every success in one bucket
            assert counters["v1.pull.seconds_sum_ns"] > 0
            assert moved.totals()["pull"] == {
                "transfers": 3.0,
                "bytes": 3.0 * 2 * TENSOR_NBYTES,
                "seconds": counters["v1.pull.seconds_sum_ns"] / 1e9,
                "failures": 1.0,
            }
            assert moved.gauges["caches"] == 1 and moved.gauges["links"] >= 1
            assert not any(v for k, v in counters.items() if k.startswith("v2.") or ".push." in k)

            # The Prompt pushes the cache into ours, layer by layer (1 layer of K and V).
            task = peer.call(
                "transfer", (cache_id, [(A, dst.per_device_tensor_addrs[0], None, 0)], None, None, None, "go")
            )
            assert peer.call("task_sync", (task, 20000)) == int(LLMStatusCode.LLM_SUCCESS)

            assert ours.poll(120)
            status, puller_pid = ours.recv()
            assert status == "ok", puller_pid
            # Every instance of this user, read from their segments by another process.
            result = _cli("--json")
            assert result.returncode == 0, result.stderr
            instances = {item["pid"]: item for item in json.loads(result.stdout)["instances"]}
            mine, theirs = instances[os.getpid()], instances[puller_pid]
            prompt = instances[peer.process.pid]
            assert (mine["role"], mine["cluster_id"]) == ("decoder", A)
            assert (theirs["role"], theirs["cluster_id"]) == ("decoder", B)
            assert (prompt["role"], prompt["cluster_id"]) == ("prompt", P)
            assert mine["counters"]["v1.pull.shm.transfers"] == 3 and mine["failures"] == 1
            assert theirs["counters"]["v1.pull.shm.transfers"] == 7
            assert theirs["bytes"] == 7 * 2 * TENSOR_NBYTES and theirs["failures"] == 1
            assert theirs["counters"]["events.links_made"] == 1
            assert prompt["counters"]["v1.push.shm.transfers"] == 1  # one layer
            assert prompt["counters"]["v1.push.shm.bytes"] == 2 * TENSOR_NBYTES
            assert prompt["transfers"] == 1 and prompt["failures"] == 0
            # The table: one line each.
            result = _cli()
            assert result.returncode == 0, result.stderr
            lines = result.stdout.splitlines()
            for pid, role in (
                (os.getpid(), "decoder"),
                (puller_pid, "decoder"),
                (peer.process.pid, "prompt"),
            ):
                assert any(line.split()[:2] == [str(pid), role] for line in lines), result.stdout
            result = _cli("--watch", "0.2", "--count", "2")
            assert result.returncode == 0, result.stderr
            assert result.stdout.count("live instance(s)") == 2
            picture = tmp_path / "stats.png"
            result = _cli("--watch", "0.2", "--count", "3", "--plot", str(picture))
            assert result.returncode == 0, result.stderr
            assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert _cli("--plot", str(picture)).returncode == 2  # a plot needs a watch

            # A killed puller's segment is not listed, and the reaper removes it.
            os.kill(puller_pid, signal.SIGKILL)
            puller.join(30)
            name = theirs["segment"]
            assert name not in [reading.name for reading in list_stats()]
            assert name in reap() or not os.path.exists("/dev/shm/" + name.lstrip("/"))
        finally:
            if puller.is_alive():
                puller.kill()
                puller.join(30)
            ours.close()
    reap()


def test_counting_switched_off_leaves_no_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_DATADIST_STATS", "0")
    before = {reading.name for reading in list_stats()}
    with decoder(A) as dd:
        assert dd._require_core().stats.name is None
        assert {reading.name for reading in list_stats()} == before


def test_a_finalized_instance_takes_its_segment_with_it() -> None:
    with decoder(A) as dd:
        name = dd._require_core().stats.name
        assert name in [reading.name for reading in list_stats()]
    assert name not in [reading.name for reading in list_stats()]
    assert not os.path.exists("/dev/shm/" + str(name).lstrip("/"))


@pytest.mark.parametrize("seconds", [0.0, 999e-9, 1e-6, 3.5e-6, 0.005, 2.0, 1e6])
def test_the_c_kernels_count_is_the_python_count(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """`_copykernel.count_transfer` and the pure-Python adds put every figure, the histogram bucket
    included, in the same words."""
    from llm_datadist import _stats

    if _stats._count_transfer is None:
        pytest.skip("the C kernel is not built here (or LLM_DATADIST_NO_EXTENSION is set)")
    readings = []
    for kernel in (_stats._count_transfer, None):
        monkeypatch.setattr(_stats, "_count_transfer", kernel)
        counting = _stats.Stats.create(role=2, cluster_id=9)
        try:
            counting.transfer(_stats.GEN_V2, _stats.READ, _stats.CMA, 65536, 3, seconds)
            counting.transfer(_stats.GEN_V1, _stats.PUSH, _stats.MOONCAKE, 7, 1, seconds)
            reading = counting.reading()
            assert reading is not None
            readings.append(reading.slots)
        finally:
            counting.close()
    assert readings[0] == readings[1]
    assert readings[0]["v2.read.cma.bytes"] == 65536 and readings[0]["v1.push.mooncake.runs"] == 1
    assert sum(v for k, v in readings[0].items() if k.startswith("v2.read.") and "us" in k) == 1


@pytest.mark.parametrize("rows", [2, 64])
def test_no_count_is_lost_between_threads(rows: int) -> None:
    """Threads count into rows of their own without a lock; with more threads than rows, the last row is
    shared under a lock. Either way every count is there."""
    import threading

    from llm_datadist import _stats

    counting = _stats.Stats.create(role=2, cluster_id=9, rows=rows)
    threads, transfers = 8, 5000
    start = threading.Barrier(threads)

    def work() -> None:
        start.wait(timeout=30)
        for _ in range(transfers):
            counting.transfer(_stats.GEN_V1, _stats.PULL, _stats.SHM, 10, 2, 5e-6)
            counting.failed(_stats.GEN_V1, _stats.PULL, LLMStatusCode.LLM_LINK_FAILED)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=120)
        assert not any(worker.is_alive() for worker in workers)
        reading = counting.reading()
        assert reading is not None
        slots, total = reading.slots, threads * transfers
        assert slots["v1.pull.shm.transfers"] == total and slots["v1.pull.shm.bytes"] == 10 * total
        assert slots["v1.pull.shm.runs"] == 2 * total and slots["v1.pull.under_8us"] == total
        assert slots["v1.pull.failures"] == total and slots["status.LLM_LINK_FAILED"] == total
    finally:
        counting.close()


def _scrape(url: str, deadline_s: float = 30.0) -> str:
    import time
    import urllib.request

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return str(response.read().decode())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_the_exporter_serves_every_instance_on_loopback(seed: int) -> None:
    """`llm-datadist exporter`, a process of its own, scraped over loopback and read with the client's
    own parser: this Decoder's pulls and failure, its Prompt's gauges, labelled by pid, role and cluster."""
    pytest.importorskip("prometheus_client")
    import socket
    import time

    port = _port() + 3
    with PromptPeer(P, port, seed) as peer, decoder(A) as dd:
        peer.alloc(2, SHAPE, [PREFIX])
        assert dd.link_clusters([_cluster(port)], 5000)[0] == LLMStatusCode.LLM_SUCCESS
        manager = dd.kv_cache_manager
        dst = manager.allocate_cache(CacheDesc(2, SHAPE, DataType.DT_FLOAT16))
        for _ in range(4):
            manager.pull_cache(CacheKey(*PREFIX), dst)
        with pytest.raises(LLMException):
            manager.pull_cache(CacheKey(P, 999), dst)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            http_port = probe.getsockname()[1]
        exporter = subprocess.Popen(
            [sys.executable, "-m", "llm_datadist._tools.cli", "exporter", "--port", str(http_port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            text = _scrape(f"http://127.0.0.1:{http_port}/metrics")
            samples = _samples(text)
            mine = (("cluster_id", str(A)), ("pid", str(os.getpid())), ("role", "decoder"))
            kind = (("generation", "v1"), ("operation", "pull"), ("transport", "shm"))
            assert samples[("llm_datadist_transfers_total", tuple(sorted(mine + kind)))] == 4
            assert samples[("llm_datadist_bytes_total", tuple(sorted(mine + kind)))] == 4 * 2 * TENSOR_NBYTES
            timing = tuple(sorted(mine + kind[:2]))
            assert samples[("llm_datadist_transfer_seconds_count", timing)] == 4
            assert (
                samples[("llm_datadist_transfer_seconds_bucket", tuple(sorted((*timing, ("le", "+Inf")))))]
                == 4
            )
            assert samples[("llm_datadist_transfer_seconds_sum", timing)] > 0
            assert samples[("llm_datadist_transfer_failures_total", timing)] == 1
            status = tuple(sorted((*mine, ("status", "LLM_KV_CACHE_NOT_EXIST"))))
            assert samples[("llm_datadist_failures_total", status)] == 1
            assert samples[("llm_datadist_links_made_total", mine)] == 1
            prompt = (("cluster_id", str(P)), ("pid", str(peer.process.pid)), ("role", "prompt"))
            deadline = time.monotonic() + 10  # the Prompt's gauges are written about twice a second
            while samples[("llm_datadist_caches", prompt)] != 1:
                assert time.monotonic() < deadline, "the Prompt's cache never showed"
                time.sleep(0.2)
                samples = _samples(_scrape(f"http://127.0.0.1:{http_port}/metrics"))
            assert samples[("llm_datadist_keys_published_total", prompt)] == 1
            secret = tuple(sorted((*prompt, ("cause", "secret"))))
            assert samples[("llm_datadist_links_refused_total", secret)] == 0
        finally:
            exporter.send_signal(signal.SIGTERM)
            try:
                out, err = exporter.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                exporter.kill()
                out, err = exporter.communicate(timeout=30)
        assert exporter.returncode == 0, err
        assert f"127.0.0.1:{http_port}/metrics" in out


def test_an_application_serves_its_own_figures_through_its_registry(seed: int) -> None:
    """`ext.register_prometheus`: this process's instances only, into the application's own registry."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from llm_datadist.ext import register_prometheus

    registry = prometheus_client.CollectorRegistry()
    with decoder(A):
        register_prometheus(registry)
        samples = _samples(prometheus_client.generate_latest(registry).decode())
        pids = {
            dict(labels).get("pid") for name, labels in samples if name == "llm_datadist_links_made_total"
        }
        assert pids == {str(os.getpid())}
        assert (
            samples[
                (
                    "llm_datadist_caches",
                    (("cluster_id", str(A)), ("pid", str(os.getpid())), ("role", "decoder")),
                )
            ]
            == 0
        )


def test_an_owner_counts_its_keys_and_the_links_it_refused(seed: int) -> None:
    """The Prompt's side: keys published, removed by its user and consumed by a pull; a link it refused
    (the Decoder named another cluster id at its address), by cause."""
    import time

    port = _port() + 5
    with PromptPeer(P, port, seed) as peer, decoder(A) as dd:
        peer.alloc(2, SHAPE, [PREFIX])
        peer.alloc(2, SHAPE, [(P, 42)])  # a req key: a pull consumes it
        assert dd.link_clusters([_cluster(port)], 5000)[0] == LLMStatusCode.LLM_SUCCESS
        dst = dd.kv_cache_manager.allocate_cache(CacheDesc(2, SHAPE, DataType.DT_FLOAT16))
        dd.kv_cache_manager.pull_cache(CacheKey(P, 42), dst)
        peer.call("remove_key", PREFIX)
        wrong = _cluster(port)
        wrong.remote_cluster_id = 77
        ret, codes = dd.link_clusters([wrong], 5000)
        assert codes == [LLMStatusCode.LLM_LINK_FAILED], (ret, codes)

        def events() -> dict[str, int]:
            prompt = next(r for r in list_stats() if r.pid == peer.process.pid)
            return {k.removeprefix("events."): v for k, v in prompt.slots.items() if k.startswith("events.")}

        # The Prompt learns of the consumed key when it next looks at its index (a call, or its
        # housekeeping about twice a second).
        deadline = time.monotonic() + 10
        while events()["keys_consumed"] != 1:
            assert time.monotonic() < deadline, events()
            time.sleep(0.1)
        seen = events()
        assert (seen["keys_published"], seen["keys_removed"], seen["keys_consumed"]) == (2, 1, 1)
        assert seen["links_refused_cluster"] == 1
        assert sum(v for k, v in seen.items() if k.startswith("links_refused_")) == 1


def test_a_peer_that_restarted_is_seen_when_linked_to_again(seed: int) -> None:
    """A Prompt killed and started again at its address: the Decoder that links to it again counts a
    restart seen (its incarnation changed), a first link counts none."""
    port = _port() + 7
    with decoder(A) as dd:
        before = stats()
        for _ in range(2):
            with PromptPeer(P, port, seed) as peer:
                ret, codes = dd.link_clusters([_cluster(port)], 5000)
                assert codes == [LLMStatusCode.LLM_SUCCESS], (ret, codes)
                peer.kill()
            ret, codes = dd.unlink_clusters([_cluster(port)], 5000, force=True)
        seen = stats().since(before).counters
        assert seen["events.links_made"] == 2
        assert seen["events.peer_restarts_seen"] == 1
    reap()  # what the killed Prompts left


def test_a_forked_child_counts_nothing_into_its_parents_figures() -> None:
    """A thread that counted before the fork keeps its row in the child: the child's counts go to private
    memory, with the C kernel or without."""
    from llm_datadist import _stats

    counting = _stats.Stats.create(role=2, cluster_id=9)
    try:
        counting.transfer(_stats.GEN_V1, _stats.PULL, _stats.SHM, 10, 1, 1e-6)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                for _ in range(100):
                    counting.transfer(_stats.GEN_V1, _stats.PULL, _stats.SHM, 10, 1, 1e-6)
                counting.event(_stats.LINKS_BROKEN)
                counting.close()
            except BaseException:
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        reading = counting.reading()
        assert reading is not None
        assert reading.slots["v1.pull.shm.transfers"] == 1 and reading.slots["events.links_broken"] == 0
    finally:
        counting.close()


def test_v2_writes_count_their_layers_and_their_failures(seed: int) -> None:
    """v2 with remote cache access: `push_cache` counts each layer it wrote, and a push to a cache the
    owner does not hold counts as a failed write with its code."""
    import json

    from llm_datadist import CacheKeyByIdAndIndex

    extra = {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.MemPoolConfig": json.dumps({"memory_size": 16 << 20, "page_shift": 16}),
    }
    port = _port() + 9
    with PromptPeer(P, port, seed, extra=extra) as peer, decoder(A, extra=extra) as dd:
        remote = peer.call("v2_alloc", (4, [1, 2048], [], None))  # 2 layers of K and V
        assert dd.link_clusters([_cluster(port)], 5000)[0] == LLMStatusCode.LLM_SUCCESS
        manager = dd.cache_manager
        local = manager.allocate_cache(CacheDesc(4, [1, 2048], DataType.DT_FLOAT16))
        before = stats()
        manager.push_cache(CacheKeyByIdAndIndex(P, remote, 0), local)
        with pytest.raises(LLMException) as exc_info:
            manager.push_cache(CacheKeyByIdAndIndex(P, remote + 100, 0), local)
        code = exc_info.value.status_code
        counters = stats().since(before).counters
        written = sum(counters[f"v2.write.{t}.transfers"] for t in ("shm", "cma", "mooncake"))
        assert written == 2  # a layer each
        assert counters["v2.write.failures"] == 1
        assert counters[f"status.{code.name}"] == 1
