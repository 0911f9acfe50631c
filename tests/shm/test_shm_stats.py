"""The stats segment (shm/stats.py): what a writer adds to its rows a reader sums, in this process or in
another, without waking the writer; a closed or dead writer's segment is not listed (and a dead one is
reaped); a forked child never writes into its parent's figures. The thread rows are `_stats`'s
(tests/llm_datadist/test_stats.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from llm_datadist._shm.reaper import reap
from llm_datadist._shm.segment import Segment
from llm_datadist._shm.stats import _HEADER, MAGIC, BadStats, StatsSegment, list_stats, read_stats

SLOTS = ("pulls", "bytes", "failures")
GAUGES = ("caches", "pool_bytes")


def test_adds_and_gauges_are_read_back_with_whose_they_are() -> None:
    stats = StatsSegment.create(SLOTS, GAUGES, role=2, cluster_id=7, created_ns=123, rows=3)
    try:
        words, first, last = stats.words, stats.row_word(0), stats.row_word(2)
        words[first] += 1
        words[first + 1] += 4096
        words[last + 1] += 10  # rows are summed
        stats.set_gauge(1, 1 << 40)
        reading = read_stats(stats.name)
        assert reading is not None
        assert reading.slots == {"pulls": 1, "bytes": 4106, "failures": 0}
        assert reading.gauges == {"caches": 0, "pool_bytes": 1 << 40}
        assert (reading.pid, reading.role, reading.cluster_id, reading.created_ns) == (os.getpid(), 2, 7, 123)
        assert reading.open
        assert stats.name in [r.name for r in list_stats()]
    finally:
        stats.close()
    assert read_stats(stats.name) is None  # unlinked
    assert stats.name not in [r.name for r in list_stats()]
    stats.close()  # again: nothing


def _read_in_child(name: str, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    reading = read_stats(name)
    queue.put(None if reading is None else (reading.pid, reading.slots["pulls"]))


def test_another_process_reads_what_the_writer_added() -> None:
    stats = StatsSegment.create(SLOTS)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    row = stats.row_word(0)
    try:
        readings = []
        for added in (5, 7):
            stats.words[row] += added
            child = ctx.Process(target=_read_in_child, args=(stats.name, queue))
            child.start()
            readings.append(queue.get(timeout=60))
            child.join(timeout=30)
            assert child.exitcode == 0
        assert readings == [(os.getpid(), 5), (os.getpid(), 12)]
    finally:
        stats.close()
        queue.close()


def _write_and_wait(pipe: mp.connection.Connection) -> None:  # type: ignore[name-defined]
    stats = StatsSegment.create(SLOTS)
    stats.words[stats.row_word(0)] += 5
    pipe.send(stats.name)
    time.sleep(600)  # killed here


def test_a_killed_writers_segment_is_not_listed_and_is_reaped() -> None:
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=_write_and_wait, args=(child_end,), daemon=True)
    child.start()
    try:
        assert parent.poll(60)
        name = parent.recv()
        listed = {r.name: r for r in list_stats()}
        assert listed[name].slots["pulls"] == 5
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(timeout=30)
        assert name not in [r.name for r in list_stats()]
        assert name in reap()
        assert read_stats(name) is None
    finally:
        if child.is_alive():
            child.kill()
            child.join(timeout=30)


def test_a_forked_child_adds_only_to_its_own_memory() -> None:
    stats = StatsSegment.create(SLOTS)
    row = stats.row_word(0)
    try:
        stats.words[row] += 1
        pid = os.fork()
        if pid == 0:  # the child: its adds and its close must not touch the parent's segment
            code = 0
            try:
                stats.words[row] += 1000
                stats.close()
            except BaseException:
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        reading = read_stats(stats.name)
        assert reading is not None and reading.slots["pulls"] == 1
    finally:
        stats.close()


def test_what_is_not_a_stats_segment_reads_as_none() -> None:
    plain = Segment.create(4096)
    try:
        assert read_stats(plain.name) is None  # zeros
        plain.array[:8] = memoryview(MAGIC)
        assert read_stats(plain.name) is None  # the magic, but no layout behind it
        # A header that claims more rows than the file holds is refused before anything is read: a stats
        # segment that is not sound (tests/shm/test_stats_readers.py has the rest).
        schema = b'{"slots": ["a"], "gauges": []}'
        header = _HEADER.pack(MAGIC, 1, 1 << 31, 1, 0, os.getpid(), 1, 1, 0, 1, len(schema))
        plain.array[: len(header)] = memoryview(header)
        plain.array[64 : 64 + len(schema)] = memoryview(schema)
        with pytest.raises(BadStats, match="rows"):
            read_stats(plain.name)
    finally:
        plain.close()
    assert read_stats("/llmdd.0.1.2.0123456789abcdef") is None  # no such file


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(Exception, match="at least one slot"):
        StatsSegment.create(())
    with pytest.raises(Exception, match="at least one slot"):
        StatsSegment.create(SLOTS, rows=0)
    stats = StatsSegment.create(SLOTS, rows=2)
    try:
        with pytest.raises(Exception, match="outside"):
            stats.row_word(2)
    finally:
        stats.close()
