"""`llm-datadist bench`, installed as `llm_datadist._bench` (the link of that name in llm_datadist/ points
here, as for shm/ and protocol/), so the command runs from any install: `main` is its command line, `suite`
measures (its `serving` group, the pulls real clients make, in `serving`), `report` prints the table, the
targets and the JSON, `hosts` is `bench --hosts` (two network namespaces), `peers` drives NIXL and Mooncake
between two spawned processes; `ours` sets up our engine's owner and measuring sides, and `proc` holds the
rows of a run, the timing loop, memcpy and the spawned helper, for all of them.

Rules: bench imports llm_datadist's public API and, where it measures internals, its private modules, always
by absolute name; its own modules relatively. Nothing in llm_datadist imports bench except `_tools/cli.py`.
"""

from .main import add_arguments, run

__all__ = ["add_arguments", "run"]
