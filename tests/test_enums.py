"""Every public enum (of `llm_datadist` and `hixl`) prints the same on Python 3.10 to 3.13: `str()`, `repr()`,
`format()` with and without a spec, f-strings, `str.format` and %-formatting. Python 3.11 changed IntEnum's
`str()` and `format()`, so the forms are written out here, never derived from the running Python's enum
module. A public enum added later fails `test_every_public_enum_is_listed` until its forms are chosen and
listed here."""

from __future__ import annotations

import enum
import importlib
import pkgutil
from types import ModuleType

import pytest

import hixl
import llm_datadist
from hixl import AsyncConnectStatus, FeatureType, MemType, TransferOp, TransferStatus
from llm_datadist.configs import LLMRole
from llm_datadist.data_type import DataType
from llm_datadist.status import LLMStatusCode, make_error
from llm_datadist.v2.llm_types import Memtype, Placement, RegisterMemStatus

# IntEnums (as in current hixl; hixl's C++ plain enums): str() is "Class.NAME", a format spec formats the
# number, as an int's does.
INT_ENUMS: tuple[type[enum.IntEnum], ...] = (
    LLMStatusCode,
    LLMRole,
    Placement,
    MemType,
    TransferOp,
    FeatureType,
)
# Plain Enums (as in the real packages; hixl's C++ `enum class`es): str() is "Class.NAME", a format spec
# formats that string.
PLAIN_ENUMS: tuple[type[enum.Enum], ...] = (
    DataType,
    RegisterMemStatus,
    Memtype,
    TransferStatus,
    AsyncConnectStatus,
)
PACKAGES = (llm_datadist, hixl)


def _public_modules(package: ModuleType) -> list[str]:
    names = [package.__name__]
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names


def test_every_public_enum_is_listed() -> None:
    """Enums a public module offers under a public name, wherever in the package they are defined."""
    found = set()
    for package in PACKAGES:
        for module_name in _public_modules(package):
            module = importlib.import_module(module_name)
            for attribute, value in vars(module).items():
                if attribute.startswith("_") or not isinstance(value, enum.EnumMeta):
                    continue
                if value.__module__.split(".")[0] == package.__name__:
                    found.add(value)
    assert found == set(INT_ENUMS) | set(PLAIN_ENUMS)


def _members(classes: tuple[type[enum.Enum], ...]) -> list[object]:
    return [pytest.param(m, id=f"{cls.__name__}.{m.name}") for cls in classes for m in cls]


def _plain_forms(member: enum.Enum) -> str:
    """The forms every public enum shares; returns "Class.NAME"."""
    name = f"{type(member).__name__}.{member.name}"
    assert str(member) == name
    assert repr(member) == f"<{name}: {member.value!r}>"
    assert format(member) == name
    assert format(member, "") == name
    assert f"{member}" == name
    assert f"{member!s}" == name
    assert f"{member!r}" == repr(member)
    assert f"{[member]}" == f"[{member!r}]"
    assert "{}".format(member) == name  # noqa: UP032 (str.format is what is tested)
    assert "%s" % member == name  # noqa: UP031 (%-formatting is what is tested)
    assert "%r" % member == repr(member)  # noqa: UP031
    return name


@pytest.mark.parametrize("member", _members(INT_ENUMS))
def test_int_enum_forms(member: enum.IntEnum) -> None:
    _plain_forms(member)
    value = int(member.value)
    assert f"{member:d}" == str(value)
    assert f"{member:>16}" == str(value).rjust(16)
    assert f"{member:#x}" == hex(value)
    assert "{:d}".format(member) == str(value)  # noqa: UP032
    assert "%d" % member == str(value)  # noqa: UP031
    with pytest.raises(ValueError):
        format(member, "s")


@pytest.mark.parametrize("member", _members(PLAIN_ENUMS))
def test_plain_enum_forms(member: enum.Enum) -> None:
    name = _plain_forms(member)
    assert f"{member:>40}" == name.rjust(40)
    assert f"{member:s}" == name
    with pytest.raises(ValueError):
        format(member, "d")


def test_forms_written_out() -> None:
    """A few forms as literals, so that a change in both the code and the helpers above still shows."""
    assert str(LLMStatusCode.LLM_TIMEOUT) == "LLMStatusCode.LLM_TIMEOUT"
    assert f"{LLMStatusCode.LLM_TIMEOUT}" == "LLMStatusCode.LLM_TIMEOUT"
    assert f"{LLMStatusCode.LLM_TIMEOUT:#x}" == "0x5010b01a"
    assert f"{LLMStatusCode.LLM_UNKNOWN_ERROR:d}" == "-1"
    assert repr(LLMStatusCode.LLM_UNKNOWN_ERROR) == "<LLMStatusCode.LLM_UNKNOWN_ERROR: -1>"
    assert f"{LLMRole.PROMPT!s:>16}" == "  LLMRole.PROMPT"
    assert f"{LLMRole.PROMPT:>3}" == "  1"
    assert f"{Placement.DEVICE:d}" == "1"
    assert f"{DataType.DT_BF16:>20}" == "    DataType.DT_BF16"
    assert repr(Memtype.MEM_TYPE_HOST) == "<Memtype.MEM_TYPE_HOST: 1>"
    assert f"{MemType.MEM_HOST} {MemType.MEM_HOST:d}" == "MemType.MEM_HOST 1"
    assert f"{TransferStatus.WAITING:>24}" == "  TransferStatus.WAITING"
    assert str(make_error("pull_cache", LLMStatusCode.LLM_TIMEOUT, "after 5000 ms")) == (
        "[pull_cache] failed, error code is LLMStatusCode.LLM_TIMEOUT, after 5000 ms."
    )
