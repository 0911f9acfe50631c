"""LLMStatusCode values and string forms, LLMException / Status, the status helpers and the package logger."""

from __future__ import annotations

import logging
import pickle

import pytest

from llm_datadist.status import (
    LLMException,
    LLMStatusCode,
    Status,
    code_2_status,
    handle_llm_status,
    make_error,
    raise_error,
    raise_if_false,
    raise_if_true,
)
from llm_datadist.utils import log as log_module
from llm_datadist.utils.log import level_from_env, log

# §2.4 of the reference, written out rather than derived, so a wrong constant cannot hide.
EXPECTED_CODES = {
    "LLM_SUCCESS": 0,
    "LLM_FAILED": 4294967295,
    "LLM_WAIT_PROCESS_TIMEOUT": 1343270913,
    "LLM_KV_CACHE_NOT_EXIST": 1343270914,
    "LLM_REPEAT_REQUEST": 1343270915,
    "LLM_REQUEST_ALREADY_COMPLETED": 1343270916,
    "LLM_PARAM_INVALID": 1343270917,
    "LLM_ENGINE_FINALIZED": 1343270918,
    "LLM_NOT_YET_LINK": 1343270919,
    "LLM_ALREADY_LINK": 1343270920,
    "LLM_LINK_FAILED": 1343270921,
    "LLM_UNLINK_FAILED": 1343270922,
    "LLM_NOTIFY_PROMPT_UNLINK_FAILED": 1343270923,
    "LLM_CLUSTER_NUM_EXCEED_LIMIT": 1343270924,
    "LLM_PROCESSING_LINK": 1343270925,
    "LLM_DEVICE_OUT_OF_MEMORY": 1343270926,
    "LLM_PREFIX_ALREADY_EXIST": 1343270927,
    "LLM_PREFIX_NOT_EXIST": 1343270928,
    "LLM_SEQ_LENOVERLIMIT": 1343270929,
    "LLM_NO_FREE_BLOCK": 1343270930,
    "LLM_BLOCKS_OUT_OF_MEMORY": 1343270931,
    "LLM_EXIST_LINK": 1343270936,
    "LLM_FEATURE_NOT_ENABLED": 1343270937,
    "LLM_TIMEOUT": 1343270938,
    "LLM_LINK_BUSY": 1343270939,
    "LLM_OUT_OF_MEMORY": 1343270940,
    "LLM_DEVICE_MEM_ERROR": 507053,
    "LLM_SUSPECT_REMOTE_ERROR": 507057,
    "LLM_UNKNOWN_ERROR": -1,
}


# -- LLMStatusCode ------------------------------------------------------------------------------------------


def test_status_code_members_are_exactly_the_reference_table() -> None:
    assert {m.name: m.value for m in LLMStatusCode} == EXPECTED_CODES


@pytest.mark.parametrize(("name", "value"), sorted(EXPECTED_CODES.items()))
def test_status_code_value_and_string_forms(name: str, value: int) -> None:
    code = LLMStatusCode[name]
    assert code == value
    assert int(code) == value
    assert LLMStatusCode(value) is code
    assert str(code) == f"LLMStatusCode.{name}"
    assert f"{code}" == f"LLMStatusCode.{name}"
    assert format(code) == f"LLMStatusCode.{name}"


def test_status_code_is_an_int_enum() -> None:
    assert isinstance(LLMStatusCode.LLM_SUCCESS, int)
    assert LLMStatusCode.LLM_PARAM_INVALID == 0x5010B000 + 5
    assert repr(LLMStatusCode.LLM_TIMEOUT) == "<LLMStatusCode.LLM_TIMEOUT: 1343270938>"


def test_status_code_has_no_cpp_only_members() -> None:
    for value in range(1343270932, 1343270936):
        with pytest.raises(ValueError):
            LLMStatusCode(value)


# -- LLMException / Status ----------------------------------------------------------------------------------


def test_exception_is_a_runtime_error_from_the_real_module_path() -> None:
    assert issubclass(LLMException, RuntimeError)
    assert LLMException.__module__ == "llm_datadist.status"
    assert LLMException.__qualname__ == "LLMException"


def test_exception_default_status_is_success() -> None:
    exc = LLMException("boom")
    assert exc.status_code is LLMStatusCode.LLM_SUCCESS
    assert exc.args == ("boom",)
    assert str(exc) == "boom"


def test_exception_carries_args_and_code() -> None:
    exc = LLMException("a", 2, status_code=LLMStatusCode.LLM_LINK_BUSY)
    assert exc.args == ("a", 2)
    assert exc.status_code is LLMStatusCode.LLM_LINK_BUSY


def test_exception_status_code_is_read_only() -> None:
    exc = LLMException(status_code=LLMStatusCode.LLM_TIMEOUT)
    with pytest.raises(AttributeError):
        exc.status_code = LLMStatusCode.LLM_SUCCESS  # type: ignore[misc]


def test_exception_status_code_is_keyword_only() -> None:
    exc = LLMException("msg", LLMStatusCode.LLM_TIMEOUT)
    assert exc.status_code is LLMStatusCode.LLM_SUCCESS
    assert exc.args == ("msg", LLMStatusCode.LLM_TIMEOUT)


def test_exception_pickles_with_its_code() -> None:
    exc = LLMException("gone", status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    back = pickle.loads(pickle.dumps(exc))
    assert isinstance(back, LLMException)
    assert back.args == ("gone",)
    assert back.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def test_status_wrapper() -> None:
    ok = Status(LLMStatusCode.LLM_SUCCESS)
    assert ok.is_ok()
    assert ok.status_code is LLMStatusCode.LLM_SUCCESS
    bad = Status(LLMStatusCode.LLM_FAILED)
    assert not bad.is_ok()
    assert bad.status_code is LLMStatusCode.LLM_FAILED
    assert Status(0).is_ok()
    assert not Status(5).is_ok()
    assert repr(bad) == "Status(LLMStatusCode.LLM_FAILED)"


# -- code_2_status / handle_llm_status ----------------------------------------------------------------------


@pytest.mark.parametrize("code", [c for c in LLMStatusCode if c is not LLMStatusCode.LLM_UNKNOWN_ERROR])
def test_code_2_status_maps_every_known_value(code: LLMStatusCode) -> None:
    result = code_2_status(int(code))
    assert result is code
    assert type(result) is LLMStatusCode


@pytest.mark.parametrize("raw", [-1, 1, 42, 1343270932, 1343270933, 1343270934, 1343270935, 2**40])
def test_code_2_status_maps_unknown_values_to_failed(raw: int) -> None:
    assert code_2_status(raw) is LLMStatusCode.LLM_FAILED


def test_handle_llm_status_passes_success() -> None:
    handle_llm_status(0, "[init]", "ok")
    handle_llm_status(LLMStatusCode.LLM_SUCCESS, "[init]", "ok")


def test_handle_llm_status_raises_with_the_real_message() -> None:
    with pytest.raises(LLMException) as info:
        handle_llm_status(1343270921, "[link]", {5: 0, 21: 1})
    assert info.value.status_code is LLMStatusCode.LLM_LINK_FAILED
    assert str(info.value) == "[link] failed, error code is LLMStatusCode.LLM_LINK_FAILED, {5: 0, 21: 1}."


def test_handle_llm_status_unknown_code_is_failed() -> None:
    with pytest.raises(LLMException) as info:
        handle_llm_status(1343270933, "[pull_cache]", "x")
    assert info.value.status_code is LLMStatusCode.LLM_FAILED
    assert str(info.value) == "[pull_cache] failed, error code is LLMStatusCode.LLM_FAILED, x."


# -- make_error / raise_error -------------------------------------------------------------------------------


def test_make_error_message_shape() -> None:
    exc = make_error("link", LLMStatusCode.LLM_LINK_FAILED, "{5: 0, 21: 1}")
    assert isinstance(exc, LLMException)
    assert exc.status_code is LLMStatusCode.LLM_LINK_FAILED
    assert str(exc) == "[link] failed, error code is LLMStatusCode.LLM_LINK_FAILED, {5: 0, 21: 1}."


def test_make_error_without_context() -> None:
    exc = make_error("pull_cache", LLMStatusCode.LLM_TIMEOUT)
    assert str(exc) == "[pull_cache] failed, error code is LLMStatusCode.LLM_TIMEOUT."


def test_raise_error_raises_make_error() -> None:
    with pytest.raises(LLMException) as info:
        raise_error("unlink", LLMStatusCode.LLM_LINK_BUSY, "a pull is running")
    assert info.value.status_code is LLMStatusCode.LLM_LINK_BUSY
    assert str(info.value) == "[unlink] failed, error code is LLMStatusCode.LLM_LINK_BUSY, a pull is running."


# -- raise_if_false / raise_if_true -------------------------------------------------------------------------


def test_raise_if_false() -> None:
    raise_if_false(True, "never")
    raise_if_false(1, "never")
    with pytest.raises(LLMException) as info:
        raise_if_false(0, "value {0} out of [0, {1})", 7, 4)
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    assert str(info.value) == "value 7 out of [0, 4)"


def test_raise_if_true() -> None:
    raise_if_true(False, "never")
    raise_if_true([], "never")
    with pytest.raises(LLMException) as info:
        raise_if_true(True, "bad {name}", name="x", status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
    assert info.value.status_code is LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    assert str(info.value) == "bad x"


def test_raise_helpers_leave_braces_alone_without_arguments() -> None:
    with pytest.raises(LLMException) as info:
        raise_if_false(False, "ranks {5: 0} are not ascending")
    assert str(info.value) == "ranks {5: 0} are not ascending"


def test_raise_helpers_log_the_error_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(LLMException):
        raise_if_true(True, "logged-marker-{0}", 17)
    out = capsys.readouterr().out
    assert "logged-marker-17" in out
    assert "[ERROR] LLM_DATADIST" in out


# -- logger -------------------------------------------------------------------------------------------------


def test_logger_identity() -> None:
    assert isinstance(log, logging.Logger)
    assert log.name == "LLM_DATADIST"
    assert log is logging.getLogger("LLM_DATADIST")
    assert log_module.get_logger() is log
    # The real call style: the module's functions.
    assert callable(log_module.info) and callable(log_module.error) and callable(log_module.warn)


@pytest.mark.parametrize(
    ("value", "level"),
    [
        ("0", logging.DEBUG),
        ("1", logging.INFO),
        ("2", logging.WARNING),
        ("3", logging.ERROR),
        (" 1 ", logging.INFO),
        (None, logging.ERROR),
        ("", logging.ERROR),
        ("4", logging.ERROR),
        ("debug", logging.ERROR),
    ],
)
def test_level_from_env(value: str | None, level: int) -> None:
    assert level_from_env(value) == level


def test_log_functions_write_to_current_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    log_module.error("module-style %s", "marker")
    log.error("logger-style %d", 5)
    out = capsys.readouterr().out
    assert "module-style marker" in out
    assert "logger-style 5" in out
    assert "test_status.py" in out  # the record names the caller, not log.py
