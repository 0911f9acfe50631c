"""A /dev/shm too small for what is asked: the public error names it, the bytes needed and free, the mount
and how to make it larger, with the out-of-memory code the API always used; nothing is left behind; a
peer's mapping adds no pages; and the demo checks before it starts (scales itself down, or says what to do)
and stops at the first failure. The small /dev/shm is a 64 MiB tmpfs in a private mount namespace
(`tests._small_shm`); those tests are skipped, with the reason, where that cannot be made."""

from __future__ import annotations

import argparse
import re
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from llm_datadist import LLMStatusCode
from llm_datadist._shm.space import ShmSpace, raise_hint
from llm_datadist._tools.demo import fit
from llm_datadist._tools.demo import run as demo_run
from llm_datadist._tools.demo.common import Setup, Shape
from tests._small_shm import MIB, run_case, run_in_small_shm, small_shm_unavailable

CLI = [sys.executable, "-m", "llm_datadist._tools.cli"]

needs_small_shm = pytest.mark.skipif(small_shm_unavailable() is not None, reason=str(small_shm_unavailable()))


def _figures(message: str) -> tuple[int, int]:
    """(bytes needed, bytes free) as the message states them."""
    needed = re.search(r"\((\d+) bytes\) more", message)
    free = re.search(r"\((\d+) bytes\) free of 64\.0 MiB \(tmpfs mounted at /dev/shm\)", message)
    assert needed and free, message
    return int(needed.group(1)), int(free.group(1))


def _says_how_to_raise(message: str) -> None:
    assert "/dev/shm" in message
    assert "--shm-size=" in message and "mount -o remount,size=" in message, message


@needs_small_shm
def test_v1_allocation_beyond_dev_shm_names_it_and_leaves_nothing() -> None:
    outcome = run_case("v1")
    assert outcome.returncode == 0, outcome.stdout + outcome.stderr
    found = outcome.result
    assert found["raised"]
    assert found["code"] == LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
    message = found["message"]
    assert message.startswith(
        "[allocate_cache] failed, error code is LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY, "
    )
    _says_how_to_raise(message)
    needed, free = _figures(message)
    assert needed == 96 * MIB
    assert 56 * MIB < free <= 64 * MIB and abs(free - found["free_nbytes"]) <= MIB
    assert "Bad address" not in message  # refused by the check, before any page was populated
    assert found["then_8_mib"]  # the refusal took nothing: a cache that fits is still allocated
    assert outcome.left == []


@needs_small_shm
def test_an_index_that_dev_shm_cannot_back_fails_init_instead_of_a_later_sigbus() -> None:
    outcome = run_case("index", size="2m")
    assert outcome.returncode == 0, outcome.stdout + outcome.stderr  # no SIGBUS
    found = outcome.result
    assert found["raised"] and found["code"] == LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY, found
    assert found["message"].startswith("[init] failed, ") and "published index" in found["message"]
    _says_how_to_raise(found["message"])
    assert outcome.left == []


@needs_small_shm
def test_v2_allocation_beyond_dev_shm_keeps_v2s_code() -> None:
    outcome = run_case("v2")
    assert outcome.returncode == 0, outcome.stdout + outcome.stderr
    found = outcome.result
    assert found["raised"] and found["code"] == LLMStatusCode.LLM_OUT_OF_MEMORY
    _says_how_to_raise(found["message"])
    assert _figures(found["message"])[0] == 80 * MIB
    assert outcome.left == []


@needs_small_shm
def test_shared_arrays_beyond_dev_shm_are_refused_before_any_page_and_leave_nothing() -> None:
    outcome = run_case("shared_arrays")
    assert outcome.returncode == 0, outcome.stdout + outcome.stderr  # no SIGBUS
    found = outcome.result
    assert found["raised"] and found["code"] == LLMStatusCode.LLM_OUT_OF_MEMORY, found
    assert found["message"].startswith("[shared_arrays] failed, ")
    _says_how_to_raise(found["message"])
    assert _figures(found["message"])[0] == 96 * MIB
    assert found["then_8_mib"] == 8 * MIB  # the refusal took nothing
    assert outcome.left == []  # and the arrays' segment went with them


@needs_small_shm
def test_a_population_that_fails_gives_its_pages_back_and_says_so() -> None:
    outcome = run_case("populate")
    assert outcome.returncode == 0, outcome.stdout + outcome.stderr
    found = outcome.result
    assert found["raised"] and found["error"] is not None  # EFAULT: the population itself failed
    assert "(Bad address when populating the pages)" in found["message"]
    _says_how_to_raise(found["message"])
    assert found["needed"] == 96 * MIB
    assert found["free"] > 60 * MIB and found["used_after"] < 4 * MIB  # the partial pages went back
    assert found["then_48_mib"] == 48 * MIB
    assert found["create_raised"] and found["create_error"] is None  # Segment.create: refused first
    _says_how_to_raise(found["create_message"])
    assert found["entries_after_create"] == []
    assert outcome.left == []


@needs_small_shm
def test_a_peers_mapping_adds_no_pages_to_a_sparse_segment() -> None:
    outcome = run_case("attach")
    assert outcome.returncode == 0, outcome.stdout + outcome.stderr
    found = outcome.result
    assert found["same"]
    assert found["after_read"] - found["before"] < MIB, found  # was the whole 56 MiB
    assert found["after_write"] - found["before"] < MIB, found
    assert outcome.left == []


@needs_small_shm
def test_demo_in_64_mib_says_what_it_needs_and_scales_down() -> None:
    outcome = run_in_small_shm([*CLI, "demo"])
    assert outcome.returncode == 0, outcome.stdout + outcome.stderr
    lines = outcome.stdout.splitlines()
    assert lines[0].startswith("/dev/shm: this run needs about 4.0 GiB at its peak"), lines[0]
    assert "free of 64.0 MiB: not enough for this size." in lines[0]
    assert lines[1].startswith("Scaling down to 4 layers x 256 tokens")
    assert "`--shm-size=5g`" in lines[1] and "mount -o remount,size=5G /dev/shm" in lines[1]
    assert "every byte verified" in outcome.stdout
    assert outcome.left == []


@needs_small_shm
def test_demo_of_a_chosen_size_that_does_not_fit_says_use_small_and_starts_nothing() -> None:
    outcome = run_in_small_shm([*CLI, "demo", "--layers", "32", "--tokens", "4096"])
    assert outcome.returncode == 2, outcome.stdout + outcome.stderr
    assert demo_run.V1_START not in outcome.stdout
    assert "free of 64.0 MiB: not enough. Run `llm-datadist demo --small`" in outcome.stderr
    _says_how_to_raise(outcome.stderr)
    assert "Traceback" not in outcome.stderr
    assert outcome.left == []


@needs_small_shm
def test_small_demo_runs_in_64_mib() -> None:
    outcome = run_in_small_shm([*CLI, "demo", "--small"])
    assert outcome.returncode == 0, outcome.stdout + outcome.stderr
    assert "every byte verified" in outcome.stdout
    assert outcome.left == []


# ------------------------------------------------------------------------ the demo's plan, without a mount


def _space(free_mib: int, size_mib: int = 64) -> ShmSpace:
    return ShmSpace("/dev/shm", size_mib * MIB, free_mib * MIB)


def test_plan_runs_what_fits_and_scales_only_an_unchosen_size() -> None:
    assert fit.plan(fit.DEFAULT, _space(8192, 8192), sized=False).shape == fit.DEFAULT
    scaled = fit.plan(fit.DEFAULT, _space(300), sized=False)
    # The tokens halved down to --small's, then the layers (the serving rows' requests take 41 MiB here).
    assert scaled.shape == Shape(layers=16, tokens=256, kv_heads=8, head_dim=128)
    assert fit.need(scaled.shape).nbytes * fit.HEADROOM <= 300 * MIB
    refused = fit.plan(fit.DEFAULT, _space(300), sized=True)
    assert refused.shape is None and "llm-datadist demo --small" in refused.refusal
    nothing = fit.plan(fit.SMALL, _space(16), sized=True)
    assert nothing.shape is None and "not even for --small" in nothing.refusal
    assert "--small`" not in nothing.refusal  # no advice to run what does not fit either


def test_raise_hint_rounds_up_to_what_docker_and_mount_take() -> None:
    assert "`--shm-size=5g`" in raise_hint(4 * 1024 * MIB + 1) and "size=5G" in raise_hint(4 * 1024 * MIB + 1)
    assert "`--shm-size=128m`" in raise_hint(65 * MIB) and "size=128M" in raise_hint(65 * MIB)


# ------------------------------------------------------------------------ the first failure ends the demo


def failing_side(pipe: Any, peer: Any, shape: Shape, setup: Setup) -> None:
    """A side that fails at once, as a v1 Prompt that cannot allocate does (spawned: defined at top level)."""
    pipe.send(("error", "LLMException: [allocate_cache] failed (a stand-in)"))


def test_demo_stops_after_the_v1_half_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo_run, "v1", SimpleNamespace(prompt=failing_side, decoder=failing_side))
    args = argparse.Namespace(
        small=True,
        layers=None,
        tokens=None,
        kv_heads=None,
        head_dim=None,
        port=0,
        timeout_ms=5000,
        hosts=False,
    )
    assert demo_run.run(args) == 1
    out, err = capsys.readouterr()
    assert demo_run.V1_START in out and demo_run.V2_START not in out
    assert "a stand-in" in err and demo_run.V1_FAILED in err
