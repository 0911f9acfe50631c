"""Small shared utilities of the public package; `log` is the package logger module (real path:
`llm_datadist.utils.log`, used as `log.info(...)`, `log.error(...)`)."""

from __future__ import annotations

from llm_datadist.utils import log

__all__ = ["log"]
