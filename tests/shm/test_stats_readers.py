"""A stats segment another process of the user wrote is read as hostile input: every size bounded by the
file and by a sane maximum, every type checked. One that is not sound is left out and said once, naming
it, while every other instance shows: in `list_stats`, in `llm-datadist stats` and in every scrape of the
exporter. The cases that broke them (a header claiming 2**32-1 rows over a sparse file, a slot name that
is a list or a number, a schema nested 20,000 deep), then a fuzz of the header and the schema."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_datadist._shm.names import make_segment_name
from llm_datadist._shm.stats import _HEADER, HEADER_NBYTES, MAGIC, STATE_OPEN, StatsSegment, list_stats

SHM = "/dev/shm"
SLOTS = ("pulls", "bytes")


def _header(rows: int, slots: int, gauges: int, schema_nbytes: int, version: int = 1) -> bytes:
    return _HEADER.pack(MAGIC, version, rows, slots, gauges, os.getpid(), 2, 5, 1, STATE_OPEN, schema_nbytes)


@contextlib.contextmanager
def _segment_file(header: bytes, schema: bytes, size: int | None = None) -> Iterator[str]:
    """A file in /dev/shm named as a segment of this process (so its writer counts as alive), holding
    `header` and `schema`, made `size` bytes long (sparse) if given."""
    name = make_segment_name().lstrip("/")
    path = os.path.join(SHM, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.pwrite(fd, header.ljust(HEADER_NBYTES, b"\0") + schema, 0)
        os.ftruncate(fd, max(size or 0, HEADER_NBYTES + len(schema) + 4096))
        os.close(fd)
        yield name
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def _good() -> Iterator[StatsSegment]:
    stats = StatsSegment.create(SLOTS, ("caches",), role=1, cluster_id=9, rows=2)
    stats.words[stats.row_word(0)] += 3
    try:
        yield stats
    finally:
        stats.close()


def _schema(slots: object, gauges: object = ()) -> bytes:
    return json.dumps({"slots": slots, "gauges": gauges}).encode()


NESTED = b'{"slots": ' + b"[" * 20_000 + b"]" * 20_000 + b', "gauges": []}'
CASES = {
    "2**32-1 rows over a sparse file": (
        _header(2**32 - 1, 2, 0, len(_schema(SLOTS))),
        _schema(SLOTS),
        1 << 40,
    ),
    "a slot name that is a list": (_header(1, 2, 0, len(_schema([["a"], "b"]))), _schema([["a"], "b"]), None),
    "a slot name that is a number": (_header(1, 2, 0, len(_schema([1, "b"]))), _schema([1, "b"]), None),
    "a schema nested 20,000 deep": (_header(1, 1, 0, len(NESTED)), NESTED, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_bad_segment_is_left_out_and_said_once_while_the_others_show(case: str) -> None:
    header, schema, size = CASES[case]
    said: list[str] = []
    with _good() as good, _segment_file(header, schema, size) as bad:
        for _ in range(3):
            readings = list_stats(say=said.append)
            assert [r.name for r in readings if r.name == good.name] == [good.name]
            assert readings[[r.name for r in readings].index(good.name)].slots["pulls"] == 3
            assert f"/{bad}" not in [r.name for r in readings]
    assert len(said) == 1 and bad in said[0], said


def test_the_stats_command_shows_every_good_instance_and_names_the_bad_one() -> None:
    with _good(), contextlib.ExitStack() as stack:
        bad = [stack.enter_context(_segment_file(*CASES[case])) for case in CASES]
        for args in (["--json"], []):
            result = subprocess.run(
                [sys.executable, "-m", "llm_datadist._tools.cli", "stats", *args],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert result.returncode == 0, result.stderr
            assert str(os.getpid()) in result.stdout  # the good segment is ours
            for name in bad:
                assert result.stderr.count(name) == 1, result.stderr


@given(
    rows=st.integers(0, 2**32 - 1),
    slots=st.integers(0, 2**32 - 1),
    gauges=st.integers(0, 2**32 - 1),
    schema_nbytes=st.integers(0, 2**32 - 1),
    version=st.sampled_from([1, 1, 1, 0, 2, 2**32 - 1]),
    schema=st.one_of(
        st.binary(max_size=300),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
            lambda inner: (
                st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
            ),
            max_leaves=20,
        ).map(lambda value: json.dumps(value).encode()),
        st.lists(st.text(max_size=12), max_size=6).map(lambda names: _schema(names)),
    ),
    size=st.sampled_from([None, 1 << 12, 1 << 30, 1 << 44]),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_no_header_or_schema_breaks_the_readers(
    rows: int, slots: int, gauges: int, schema_nbytes: int, version: int, schema: bytes, size: int | None
) -> None:
    header = _header(rows, slots, gauges, schema_nbytes, version)
    with _good() as good, _segment_file(header, schema, size):
        names = [r.name for r in list_stats(say=lambda line: None)]
        assert good.name in names


def test_every_exporter_scrape_shows_the_good_instances_and_names_the_bad_one_once() -> None:
    pytest.importorskip("prometheus_client")
    import signal
    import socket
    import time
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with _good(), contextlib.ExitStack() as stack:
        bad = [stack.enter_context(_segment_file(*CASES[case])) for case in CASES]
        exporter = subprocess.Popen(
            [sys.executable, "-m", "llm_datadist._tools.cli", "exporter", "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 30
            scraped = 0
            while scraped < 3:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                        assert response.status == 200
                        text = response.read().decode()
                except OSError:
                    assert time.monotonic() < deadline, "the exporter never answered"
                    time.sleep(0.1)
                    continue
                assert f'pid="{os.getpid()}"' in text
                scraped += 1
        finally:
            exporter.send_signal(signal.SIGTERM)
            try:
                _, err = exporter.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                exporter.kill()
                _, err = exporter.communicate(timeout=30)
        assert exporter.returncode == 0, err
        for name in bad:
            assert err.count(name) == 1, err
