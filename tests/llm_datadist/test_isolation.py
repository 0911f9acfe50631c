"""Two programs of one user that pick the same listen address or the same communicator name: the second is
refused at once with an error that says what is shared and how to keep jobs apart, and leaves nothing
behind; with a runtime directory of its own (`LLM_DATADIST_RUNTIME_DIR`) it runs beside the first."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from llm_datadist import LLMConfig, LLMDataDist, LLMException, LLMRole, LLMStatusCode
from llm_datadist.ext import local_rank_table

MEMBERS = {1: 0, 2: 1}


def _port() -> int:
    return 28000 + os.getpid() % 1000


def _v1_prompt(port: int) -> LLMDataDist:
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = f"127.0.0.1:{port}"
    dd.init(config.generate_options())
    return dd


def _v2(cluster_id: int) -> LLMDataDist:
    dd = LLMDataDist(LLMRole.PROMPT, cluster_id)
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.link_total_time = 5
    dd.init(config.generate_options())
    return dd


def _first_program(control: Connection, kind: str, port: int) -> None:
    """The other program: holds the address (or rank 0 of the communicator) until told to go."""
    if kind == "address":
        dd = _v1_prompt(port)
    else:
        dd = _v2(1)
        dd.link("shared_comm", MEMBERS, local_rank_table(MEMBERS))
    control.send("ready")
    control.recv()
    dd.finalize()


@pytest.fixture
def first(request: pytest.FixtureRequest) -> Iterator[str]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=_first_program, args=(theirs, request.param, _port()))
    process.start()
    try:
        assert ours.poll(60) and ours.recv() == "ready"
        yield request.param
    finally:
        ours.send("go")
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join(10)
        assert process.exitcode == 0


def _entries(runtime: Path) -> set[str]:
    return {p.name for p in runtime.iterdir()} if runtime.exists() else set()


@pytest.mark.parametrize("first", ["address"], indirect=True)
def test_a_listen_address_taken_by_another_program(
    first: str, _runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _entries(_runtime_dir)
    with pytest.raises(LLMException) as info:
        _v1_prompt(_port())
    assert info.value.status_code == LLMStatusCode.LLM_FAILED
    assert f"127.0.0.1:{_port()} is taken" in str(info.value)
    assert "LLM_DATADIST_RUNTIME_DIR" in str(info.value)
    # One error, not three chained tracebacks: the message is the whole story.
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert _entries(_runtime_dir) == before  # the refused init left nothing
    # A job of its own runs beside the first, at the same address.
    monkeypatch.setenv("LLM_DATADIST_RUNTIME_DIR", str(tmp_path / "own"))
    _v1_prompt(_port()).finalize()


@pytest.mark.parametrize("first", ["comm"], indirect=True)
def test_a_comm_rank_taken_by_another_program(
    first: str, _runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dd = _v2(1)
    try:
        before = _entries(_runtime_dir)
        with pytest.raises(LLMException) as info:
            dd.link("shared_comm", MEMBERS, local_rank_table(MEMBERS))
        assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
        assert "rank 0 of 'shared_comm' is taken" in str(info.value)
        assert "LLM_DATADIST_RUNTIME_DIR" in str(info.value)
        assert _entries(_runtime_dir) == before
    finally:
        dd.finalize()
    monkeypatch.setenv("LLM_DATADIST_RUNTIME_DIR", str(tmp_path / "own"))
    dd = _v2(1)
    try:
        dd.link("shared_comm", MEMBERS, local_rank_table(MEMBERS))  # its rank 0 is free there
    finally:
        dd.finalize()
