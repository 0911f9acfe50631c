"""The three rooms import in one direction only (docs/architecture.md): protocol/ is sans-IO, shm/ knows
nothing of the protocol or sockets, and only llm_datadist/ composes them. The tools (llm_datadist/_tools/:
the CLI, demo, soak, network namespaces) and bench/ (installed as llm_datadist._bench) use llm_datadist from
outside: they may import its public API and private modules, bench always by their installed names. The
library never imports its tools, and nothing in llm_datadist imports bench but the CLI. Walks every import
with ast."""

from __future__ import annotations

import ast
import tomllib
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
    # Installed, bench/, shm/ and protocol/ exist only as llm_datadist._bench, ._shm and ._protocol.
    "bench": {"bench", "shm", "protocol"},
}
# The folders installed under llm_datadist through the links of these names in llm_datadist/.
ROOMS = {"_shm": "shm", "_protocol": "protocol", "_bench": "bench"}
# The only modules of llm_datadist that may import bench.
IMPORTS_BENCH = {"llm_datadist/_tools/cli.py"}
TOOLS = "_tools"  # llm_datadist/_tools/: what drives the library, never what it is made of


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


def _imported_modules(path: Path, package: str) -> set[str]:
    """Absolute names a module of `package` imports, relative imports resolved; for `from X import a`
    both X and X.a (a may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _package_of(path: Path) -> str:
    """The package a module of llm_datadist/ belongs to: its folder's (an __init__.py's too)."""
    return ".".join(path.relative_to(ROOT).parent.parts)


def test_only_the_cli_imports_bench() -> None:
    files = [
        path
        for path in sorted((ROOT / "llm_datadist").rglob("*.py"))
        if path.relative_to(ROOT / "llm_datadist").parts[0] not in ROOMS
    ]
    importers = set()
    for path in files:
        names = _imported_modules(path, _package_of(path))
        if any(name == "llm_datadist._bench" or name.startswith("llm_datadist._bench.") for name in names):
            importers.add(str(path.relative_to(ROOT)))
    assert importers == IMPORTS_BENCH


def _library_modules() -> list[Path]:
    """llm_datadist's own modules: neither the rooms installed through its links nor its tools."""
    return [
        path
        for path in sorted((ROOT / "llm_datadist").rglob("*.py"))
        if path.relative_to(ROOT / "llm_datadist").parts[0] not in {*ROOMS, TOOLS}
    ]


def test_the_library_never_imports_its_tools() -> None:
    importers = []
    for path in _library_modules():
        names = _imported_modules(path, _package_of(path))
        tools = sorted(
            n for n in names if n == f"llm_datadist.{TOOLS}" or n.startswith(f"llm_datadist.{TOOLS}.")
        )
        if tools:
            importers.append(f"{path.relative_to(ROOT)} imports {tools}")
    assert not importers, "\n".join(importers)
    assert ROOT / "llm_datadist" / "_core.py" in _library_modules()
    assert not any(TOOLS in path.parts for path in _library_modules())


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import socket\nfrom shm.pool import Pool\nfrom . import sibling\n")
    assert _imported_roots(sample) == {"socket", "shm"}
    sample.write_text("from .. import _core\n")
    assert _imported_roots(sample) == {"llm_datadist"}
    sample.write_text("from .. import _bench\nfrom .._bench.suite import run\nimport llm_datadist._bench\n")
    assert _imported_modules(sample, "llm_datadist.v1") >= {
        "llm_datadist._bench",
        "llm_datadist._bench.suite",
        "llm_datadist._bench.suite.run",
    }
    sample.write_text("from . import _bench\n")
    assert "llm_datadist._bench" in _imported_modules(sample, "llm_datadist")
    sample.write_text("from .._tools.netns import in_netns\nfrom ._tools import patterns\n")
    assert "llm_datadist._tools.netns" in _imported_modules(sample, "llm_datadist.v2")
    assert "llm_datadist._tools.patterns" in _imported_modules(sample, "llm_datadist")
    assert _package_of(ROOT / "llm_datadist" / "v1" / "__init__.py") == "llm_datadist.v1"
    assert _package_of(ROOT / "llm_datadist" / "v1" / "kv_cache_manager.py") == "llm_datadist.v1"
    assert _package_of(ROOT / "llm_datadist" / "_tools" / "cli.py") == "llm_datadist._tools"


def test_the_rooms_are_installed_under_the_package() -> None:
    """shm/, protocol/ and bench/ are installed as llm_datadist._shm, ._protocol and ._bench (the links in
    llm_datadist/ point at the folders), never as top-level packages of those generic names. ruff checks
    the folders themselves, not again through the links; mypy reaches them through the links."""
    import llm_datadist._bench.suite
    import llm_datadist._protocol.messages
    import llm_datadist._shm.segment

    for link, folder in ROOMS.items():
        assert (ROOT / "llm_datadist" / link).is_symlink()
        assert (ROOT / "llm_datadist" / link).resolve() == ROOT / folder
        assert (ROOT / folder / "__init__.py").is_file()
    assert Path(llm_datadist._shm.segment.__file__).resolve().parent == ROOT / "shm"
    assert Path(llm_datadist._protocol.messages.__file__).resolve().parent == ROOT / "protocol"
    assert Path(llm_datadist._bench.suite.__file__).resolve().parent == ROOT / "bench"
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["setuptools"]["packages"]["find"]["include"] == ["llm_datadist*"]
    assert {f"llm_datadist/{link}" for link in ROOMS} <= set(config["tool"]["ruff"]["extend-exclude"])
    assert config["tool"]["mypy"]["files"] == ["llm_datadist"]
