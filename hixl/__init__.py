"""The HIXL engine API (`import hixl`), as hicann/hixl's Python package names it, for a host without an
NPU: a face over `llm_datadist`'s data plane (shared memory and cross-memory attach on one host, Mooncake
Transfer Engine across hosts). docs/hixl.md says what is supported and how it differs.
"""

# The real package's `__init__` re-exports its binding, `hixl.hixl`, name for name: so does this one.
from hixl.hixl import *  # noqa: F403
from hixl.hixl import __all__ as __all__
