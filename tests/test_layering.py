"""The three rooms import in one direction only (STYLE.md): protocol/ is sans-IO, shm/ knows nothing of
the protocol or sockets, and only llm_datadist/ composes them. Walks every import with ast."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FORBIDDEN = {
    "protocol": {
        "shm",
        "llm_datadist",
        "numpy",
        "posix_ipc",
        "psutil",
        "socket",
        "selectors",
        "threading",
        "concurrent",
        "multiprocessing",
        "asyncio",
        "mmap",
    },
    "shm": {"protocol", "llm_datadist", "socket", "selectors", "threading", "concurrent", "asyncio"},
}


def _imported_roots(path: Path) -> set[str]:
    """Top-level names a module imports; a relative import that climbs above its own folder counts as
    importing `llm_datadist` (where shm/ and protocol/ are installed, as _shm and _protocol)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level > 1:
            roots.add("llm_datadist")
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_stay_in_their_room(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules found in {package}/"
    violations = []
    for path in files:
        bad = _imported_roots(path) & FORBIDDEN[package]
        if bad:
            violations.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not violations, "\n".join(violations)


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import socket\nfrom shm.pool import Pool\nfrom . import sibling\n")
    assert _imported_roots(sample) == {"socket", "shm"}
    sample.write_text("from .. import _core\n")
    assert _imported_roots(sample) == {"llm_datadist"}


def test_the_rooms_are_installed_under_the_package() -> None:
    """shm/ and protocol/ are installed as llm_datadist._shm and llm_datadist._protocol (the links in
    llm_datadist/ point at the folders), never as top-level packages of those generic names."""
    import llm_datadist._protocol.messages
    import llm_datadist._shm.segment

    assert (ROOT / "llm_datadist" / "_shm").resolve() == ROOT / "shm"
    assert (ROOT / "llm_datadist" / "_protocol").resolve() == ROOT / "protocol"
    assert Path(llm_datadist._shm.segment.__file__).resolve().parent == ROOT / "shm"
    assert Path(llm_datadist._protocol.messages.__file__).resolve().parent == ROOT / "protocol"
    text = (ROOT / "pyproject.toml").read_text()
    assert 'include = ["llm_datadist*"]' in text
