"""`shm/` owns bytes and lifetimes only: it never imports the protocol, the public API, sockets or threads."""

from __future__ import annotations

import ast
from pathlib import Path

SHM_DIR = Path(__file__).resolve().parents[2] / "shm"
FORBIDDEN = {
    "protocol",
    "llm_datadist",
    "socket",
    "socketserver",
    "threading",
    "concurrent",
    "asyncio",
    "msgpack",
}


def test_shm_imports_stay_in_their_room() -> None:
    sources = sorted(SHM_DIR.glob("*.py"))
    assert sources
    for path in sources:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0 or node.module is not None, f"{path.name}: bare relative import"
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                assert module.split(".")[0] not in FORBIDDEN, f"{path.name} imports {module}"
        assert ast.get_docstring(tree), f"{path.name} has no module docstring"
