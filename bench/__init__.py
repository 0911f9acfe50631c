"""`llm-datadist bench`, installed as `llm_datadist._bench` (the link of that name in llm_datadist/ points
here, as for shm/ and protocol/), so the command runs from any install: `suite` measures and reports, `peers`
drives NIXL and Mooncake between two spawned processes, `proc` holds the timing loop and the spawned helper,
`hosts` is `bench --hosts` (two network namespaces).

Rules: bench imports llm_datadist's public API and, where it measures internals, its private modules, always
by absolute name; its own modules relatively. Nothing in llm_datadist imports bench except `_tools/cli.py`.
"""

from .suite import add_arguments, run

__all__ = ["add_arguments", "run"]
