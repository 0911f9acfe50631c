"""The library's log lines from WARNING on, kept while a test looks (its logger says only errors unless
configured)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from llm_datadist.utils.log import log


class WarningLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def warning_lines() -> Iterator[WarningLines]:
    handler = WarningLines()
    level = log.level
    log.setLevel(logging.WARNING)
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
