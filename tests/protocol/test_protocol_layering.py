"""protocol/ stays sans-IO: it imports the standard library and msgpack only, and its package face exports
exactly what it declares."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTOCOL_DIR = REPO_ROOT / "protocol"
ALLOWED_THIRD_PARTY = {"msgpack"}
# Standard-library modules that would smuggle I/O or concurrency into a sans-IO layer.
FORBIDDEN_STDLIB = {
    "asyncio",
    "mmap",
    "multiprocessing",
    "os",
    "select",
    "selectors",
    "socket",
    "subprocess",
    "threading",
}


def _imported_top_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            # Within the package, relative imports of siblings only: it is installed as
            # llm_datadist._protocol, and nothing of it may reach above its own folder.
            if node.level:
                assert node.level == 1, f"{path.name}: a relative import above protocol/"
                continue
            assert node.module is not None
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted(PROTOCOL_DIR.glob("*.py")), ids=lambda p: p.name)
def test_protocol_imports_only_stdlib_and_msgpack(path: Path) -> None:
    names = _imported_top_names(path)
    outside = {n for n in names if n not in sys.stdlib_module_names and n not in ALLOWED_THIRD_PARTY}
    assert not outside, f"{path.name} imports {sorted(outside)}"
    assert not names & FORBIDDEN_STDLIB, f"{path.name} imports {sorted(names & FORBIDDEN_STDLIB)}"


def test_each_module_opens_with_a_docstring() -> None:
    for path in PROTOCOL_DIR.glob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc, path.name
        assert 2 <= len(doc.splitlines()) <= 6, path.name


def test_package_face() -> None:
    # In a fresh interpreter rooted at the repository, so the real package (not tests/protocol) is imported.
    code = (
        "import protocol, protocol.connection, protocol.errors, protocol.frames, protocol.integrity\n"
        "import protocol.messages\n"
        "names = set(protocol.__all__)\n"
        "declared = set()\n"
        "for mod in (protocol.connection, protocol.errors, protocol.frames, protocol.integrity,\n"
        "            protocol.messages):\n"
        "    declared |= set(mod.__all__)\n"
        "    assert all(hasattr(mod, n) for n in mod.__all__), mod.__name__\n"
        "missing = declared - names - {'FieldCheck', 'I64', 'U32', 'U64', 'MAX_SEGMENT_NAME_CHARS',\n"
        "                              'MAX_TENSORS', 'MAX_TEXT_CHARS'}\n"
        "assert not missing, missing\n"
        "assert all(getattr(protocol, n) is not None for n in names)\n"
        "import sys\n"
        "bad = {'socket', 'numpy', 'posix_ipc', 'shm', 'llm_datadist'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
