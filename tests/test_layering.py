"""The three rooms import in one direction only (docs/architecture.md): protocol/ is sans-IO, shm/ knows
nothing of the protocol or sockets, and only llm_datadist/ composes them. The tools (llm_datadist/_tools/:
the CLI, demo, soak, network namespaces) and bench/ (installed as llm_datadist._bench) use llm_datadist from
outside: they may import its public API and private modules, bench always by their installed names. The
library never imports its tools, and nothing in llm_datadist imports bench but the CLI. Walks every import
with ast."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # the test extra installs tomli, its origin, on 3.10
    import tomli as tomllib

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
    assert config["tool"]["setuptools"]["packages"]["find"]["include"] == ["llm_datadist*", "hixl*"]
    assert {f"llm_datadist/{link}" for link in ROOMS} <= set(config["tool"]["ruff"]["extend-exclude"])
    assert config["tool"]["mypy"]["files"] == ["llm_datadist", "hixl"]


# ------------------------------------------------------------------ the layers inside llm_datadist/
# (docs/architecture.md, "Rules of each layer")

WIRE = {"_wire"}
OWNER = {"_owner"}
PULLER = {"_puller"}
# Leaves both sides use: _errors, _keys, _runtime, _unpins (the owed unpins a link's index mapping waits
# for), _library (the memory ext.shared_arrays hands out), status, utils. They import none of the layers
# above.
NODE = {"_core", "_comm", "_hixl"}
LEAVES = {
    "_errors",
    "_keys",
    "_runtime",
    "_unpins",
    "_procmaps",
    "_signals",
    "_native",
    "_alarms",
    "_library",
    "status",
    "utils",
}
FACES = {"v1", "v2"}


def _layer_of(name: str) -> str:
    """The first component under llm_datadist of a module name ("" for the package itself)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "llm_datadist" else ""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer_violations(members: set[str], forbidden: set[str]) -> list[str]:
    found = []
    for path in _library_modules():
        if _layer_of(_module_name(path)) not in members:
            continue
        bad = sorted({n for n in _imported_modules(path, _package_of(path)) if _layer_of(n) in forbidden})
        if bad:
            found.append(f"{path.relative_to(ROOT)} imports {bad}")
    return found


def test_the_wire_imports_no_owner_and_no_node_code() -> None:
    assert not _layer_violations(WIRE, OWNER | PULLER | NODE | FACES)


def test_the_owner_imports_neither_the_pullers_side_nor_the_faces() -> None:
    assert not _layer_violations(OWNER, PULLER | NODE | FACES)


def test_the_leaves_import_no_layer() -> None:
    assert not _layer_violations(LEAVES, WIRE | OWNER | PULLER | NODE | FACES)


def test_the_hixl_engine_imports_no_face() -> None:
    assert not _layer_violations({"_hixl"}, FACES | {"_comm", TOOLS})
    found = []
    for path in _library_modules():
        names = {n for n in _imported_modules(path, _package_of(path)) if n.split(".")[0] == "hixl"}
        if names:
            found.append(f"{path.relative_to(ROOT)} imports {sorted(names)}")
    assert not found, "\n".join(found)  # the library never imports the face


def test_the_hixl_face_reaches_the_library_through_its_engine_only() -> None:
    found = []
    for path in sorted((ROOT / "hixl").rglob("*.py")):
        names = _imported_modules(path, _package_of(path))
        bad = sorted(n for n in names if n.split(".")[0] == "llm_datadist" and _layer_of(n) != "_hixl")
        if bad:
            found.append(f"{path.relative_to(ROOT)} imports {bad}")
    assert not found, "\n".join(found)
    assert (ROOT / "hixl" / "hixl.py").is_file()


def test_transfers_and_movers_never_import_the_faces() -> None:
    assert not _layer_violations(PULLER, NODE | FACES)


def test_faces_reach_shm_and_protocol_only_through_the_library() -> None:
    found = []
    for path in _library_modules():
        rel = str(path.relative_to(ROOT))
        face = _layer_of(_module_name(path)) in FACES or rel == "llm_datadist/_transfer.py"
        if not face:
            continue
        bad = sorted(
            n for n in _imported_modules(path, _package_of(path)) if _layer_of(n) in {"_shm", "_protocol"}
        )
        if bad:
            found.append(f"{rel} imports {bad}")
    assert not found, "\n".join(found)


def _module_level_imports(path: Path) -> set[str]:
    """The llm_datadist modules `path` imports when it is imported: no import inside a function or under
    `if TYPE_CHECKING:`; `from . import mod` imports `mod`, not the package."""
    package = _package_of(path)
    modules = {_module_name(p) for p in _library_modules()}
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if (
                isinstance(child, ast.If)
                and isinstance(child.test, ast.Name)
                and child.test.id == "TYPE_CHECKING"
            ):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                parts = package.split(".")
                base = parts[: len(parts) - child.level + 1] if child.level else []
                module = ".".join(base + ([child.module] if child.module else []))
                subs = {f"{module}.{alias.name}" for alias in child.names}
                found.update(subs & modules or {module})
            visit(child)

    visit(tree)
    resolved = set()
    for name in found:
        if _layer_of(name) in ROOMS:
            continue  # shm/ and protocol/ import nothing of the library (their own rooms' rule)
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            resolved.add(name)
    return resolved - {_module_name(path)}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def test_no_import_cycle_inside_the_library() -> None:
    graph = {_module_name(path): _module_level_imports(path) for path in _library_modules()}
    assert graph.get("llm_datadist._core")
    assert not _cycles(graph)


def test_the_layer_checks_see_violations(tmp_path: Path) -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    sample = ROOT / "llm_datadist" / "_owner" / "table.py"
    imported = _module_level_imports(sample)
    assert "llm_datadist._owner.mirror" in imported and "llm_datadist.status" in imported
    assert _layer_of("llm_datadist._owner.table") == "_owner" and _layer_of("llm_datadist") == ""


# Imports inside functions: only of what is optional (the C copy kernel, Mooncake, ml_dtypes, the Prometheus
# client) or what the
# real package loads lazily (numpy for its tensors), and the PEP 562 `__getattr__` of names the real module
# paths put where ours would make a cycle (docs/architecture.md, "Cycles"). Never to dodge a cycle.
LAZY_MODULES = {
    "llm_datadist._shm._copykernel",
    "mooncake.engine",
    "ml_dtypes",
    "numpy",
    "prometheus_client",
    "prometheus_client.core",
}


def _function_level_imports(path: Path) -> list[tuple[str, str]]:
    """(enclosing function, imported module) of every import inside a function of `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                found.extend((function.name, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                found.append((function.name, "." * node.level + (node.module or "")))
    return found


def test_imports_inside_functions_are_for_optional_modules_or_real_module_paths() -> None:
    found = [
        f"{path.relative_to(ROOT)}: {function} imports {module}"
        for path in _library_modules()
        for function, module in _function_level_imports(path)
        if function != "__getattr__" and module not in LAZY_MODULES
    ]
    assert not found, "\n".join(found)
    sample = ROOT / "llm_datadist" / "_puller" / "remote.py"
    assert ("_import_engine", "mooncake.engine") in _function_level_imports(sample)
