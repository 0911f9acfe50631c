"""Where the tools' lines and the library's log lines go, so that neither ever splits the other.

Rules: the library logs to stdout (as the real one does) and the tools leave that alone for the library;
inside the demo's and the soak's own processes the library's records go to stderr: for the whole of a
child they start (`library_log_to_stderr`), for the length of the command in the process that runs it
(`library_log_on_stderr`, which puts the handlers back: a test may run a command in its own process).
Every line a tool prints itself goes out whole, in one write (`say`), and the command line makes stdout
line-buffered (`whole_lines`), so a log line of a process sharing the terminal or pipe (bench's children
keep the library's stdout) lands between two of the tool's lines, never inside one."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import TextIO

from llm_datadist.utils.log import get_logger

LOG_NOTE = (
    "The library's log lines (level from ASCEND_GLOBAL_LOG_LEVEL, ERROR by default) go to stderr in "
    "this tool's processes; the tool's own lines go to stdout."
)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Looks `sys.stderr` up at every write, as the library's handler does `sys.stdout` (test runners
    swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


def library_log_to_stderr() -> None:
    """In this process only: the library's logger writes to stderr instead of stdout (same format, same
    level). Idempotent; call it first thing in each process the tool starts."""
    logger = get_logger()
    if any(isinstance(handler, _StderrHandler) for handler in logger.handlers):
        return
    to_stderr = _StderrHandler()
    for handler in list(logger.handlers):
        if to_stderr.formatter is None:
            to_stderr.setFormatter(handler.formatter)
        logger.removeHandler(handler)
    logger.addHandler(to_stderr)


@contextlib.contextmanager
def library_log_on_stderr() -> Iterator[None]:
    """`library_log_to_stderr` until the block ends; then the library's handlers are as they were."""
    logger = get_logger()
    saved = list(logger.handlers)
    library_log_to_stderr()
    try:
        yield
    finally:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        for handler in saved:
            logger.addHandler(handler)


def whole_lines() -> None:
    """Make stdout flush at each newline (a pipe's default is 8 KiB blocks, cut anywhere)."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(line_buffering=True)


def say(text: str = "", out: TextIO | None = None) -> None:
    """Print `text` and its newline in one write, flushed."""
    stream = sys.stdout if out is None else out
    stream.write(text + "\n")
    stream.flush()
