"""`llm-datadist stats`, `ls` and `gc` narrowed to one process (`--pid`) or cluster (`--cluster`), and a
`hixl` engine shown as what it is: role `hixl`, no made-up cluster id in the table, and its transfers
counted (the `hixl` generation's reads and writes). Real processes, the commands as a user runs them."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from typing import Any

import hixl
from llm_datadist import LLMConfig, LLMDataDist, LLMRole
from llm_datadist._shm.reaper import list_segments
from tests.hixl._local import SERVER, local_engine
from tests.hixl._peer import peer


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "llm_datadist._tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result


def _instances(*args: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = json.loads(_cli("stats", "--json", *args).stdout)["instances"]
    return items


def test_a_hixl_engine_is_shown_as_one_and_its_transfers_are_counted() -> None:
    nbytes = 8192
    with peer() as remote, local_engine() as local:
        assert remote("initialize", SERVER, {}) == hixl.SUCCESS
        there = remote("alloc", nbytes, 1)
        assert remote("register_mem", (there, nbytes), int(hixl.MEM_HOST))[0] == hixl.SUCCESS
        here, _ = local.register(nbytes)
        assert local.engine.connect(SERVER, 5000) == hixl.SUCCESS
        descs = [hixl.TransferOpDesc(here, there, nbytes)]
        for op in (hixl.READ, hixl.READ, hixl.WRITE):
            assert local.engine.transfer_sync(SERVER, op, descs) == hixl.SUCCESS
        mine = _instances("--pid", str(os.getpid()))
        assert [item["role"] for item in mine] == ["hixl"]
        counters = mine[0]["counters"]
        assert counters["hixl.read.cma.transfers"] == 2 and counters["hixl.read.cma.bytes"] == 2 * nbytes
        assert counters["hixl.write.cma.transfers"] == 1
        table = _cli("stats", "--pid", str(os.getpid())).stdout.splitlines()
        row = next(line for line in table if line.split()[0] == str(os.getpid()))
        assert row.split()[1:3] == ["hixl", "-"]


def test_stats_ls_narrowed_to_a_process_or_a_cluster() -> None:
    config = LLMConfig()
    config.device_id = 0
    datadist = LLMDataDist(LLMRole.DECODER, 77)
    datadist.init(config.generate_options())
    try:
        assert [item["cluster_id"] for item in _instances("--cluster", "77")] == [77]
        assert _instances("--cluster", "78") == []
        assert [item["pid"] for item in _instances("--pid", str(os.getpid()))] == [os.getpid()]
        assert _instances("--pid", "1") == []
        listed = _cli("ls", "--pid", str(os.getpid())).stdout
        ours = [info.name for info in list_segments() if info.owner.pid == os.getpid()]
        assert ours and all(name in listed for name in ours)
        assert "0 segment(s)" in _cli("ls", "--pid", "1").stdout
    finally:
        datadist.finalize()


def _make_segment_and_stop(pipe: Any) -> None:
    from llm_datadist._shm.segment import Segment

    segment = Segment.create(4096)
    pipe.send((os.getpid(), segment.name))  # a pipe's send is done when it returns, unlike a Queue's put
    os.kill(os.getpid(), signal.SIGSTOP)


def test_gc_of_one_dead_process_leaves_the_others() -> None:
    ctx = mp.get_context("spawn")
    made: dict[int, str] = {}
    children = []
    try:
        for _ in range(2):
            ours, theirs = ctx.Pipe()
            child = ctx.Process(target=_make_segment_and_stop, args=(theirs,))
            child.start()
            children.append(child)
            assert ours.poll(60), "the child never made its segment"
            pid, name = ours.recv()
            made[pid] = name
    finally:
        for child in children:
            os.kill(child.pid or 0, signal.SIGKILL)
            child.join(30)
    first, second = sorted(made)
    try:
        out = _cli("gc", "--pid", str(first)).stdout
        assert made[first] in out and made[second] not in out
        names = {info.name for info in list_segments()}
        assert made[first] not in names and made[second] in names
    finally:
        _cli("gc", "--pid", str(second))
