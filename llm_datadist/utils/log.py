"""The package logger: a `logging.Logger` named "LLM_DATADIST" that writes to stdout.

Its level comes from env ASCEND_GLOBAL_LOG_LEVEL (0 debug, 1 info, 2 warning, 3 error; anything else means
error), read once, when this module is imported (the real one reads it at first use). Two spellings work:
`from llm_datadist.utils import log; log.info(...)` (this module, as the real package uses it) and
`from llm_datadist.utils.log import log` (the configured `logging.Logger`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from typing import Any, TextIO

LOGGER_NAME = "LLM_DATADIST"
LEVEL_ENV = "ASCEND_GLOBAL_LOG_LEVEL"
LOG_FORMAT = (
    "[%(levelname)s] %(name)s(%(process)d,%(processName)s):%(asctime)s.%(msecs)03d "
    "[%(filename)s:%(lineno)d]%(thread)d %(funcName)s: %(message)s"
)

_LEVELS = {"0": logging.DEBUG, "1": logging.INFO, "2": logging.WARNING, "3": logging.ERROR}
_lock = threading.Lock()
_logger: logging.Logger | None = None


class _StdoutHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Looks `sys.stdout` up at every write instead of binding it once: test runners and daemons swap
    `sys.stdout`, and a handler holding the old (closed) stream would raise on the next record."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self) -> TextIO:
        return sys.stdout

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


def level_from_env(value: str | None) -> int:
    """The `logging` level for an ASCEND_GLOBAL_LOG_LEVEL value (unset or unknown: ERROR)."""
    return _LEVELS.get(value.strip() if value is not None else "", logging.ERROR)


def get_logger() -> logging.Logger:
    """The "LLM_DATADIST" logger, configured on first call (level from the environment, a stdout handler)."""
    global _logger
    if _logger is not None:
        return _logger
    with _lock:
        if _logger is None:
            logger = logging.getLogger(LOGGER_NAME)
            logger.setLevel(level_from_env(os.environ.get(LEVEL_ENV)))
            # Guard against a second handler when the module is reloaded.
            if not any(isinstance(h, _StdoutHandler) for h in logger.handlers):
                handler = _StdoutHandler()
                handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
                logger.addHandler(handler)
            _logger = logger
        return _logger


# stacklevel=2 makes %(filename)s/%(lineno)d name the caller, not this module (the real package patches
# findCaller for the same purpose).
def debug(msg: object, *args: object, **kwargs: Any) -> None:
    get_logger().debug(msg, *args, stacklevel=2, **kwargs)


def info(msg: object, *args: object, **kwargs: Any) -> None:
    get_logger().info(msg, *args, stacklevel=2, **kwargs)


def warning(msg: object, *args: object, **kwargs: Any) -> None:
    get_logger().warning(msg, *args, stacklevel=2, **kwargs)


warn = warning  # the real module spells it `warn`


def error(msg: object, *args: object, **kwargs: Any) -> None:
    get_logger().error(msg, *args, stacklevel=2, **kwargs)


def _find_caller(stack_info: bool = False, stack_level: int = 1) -> tuple[str, int, str, str | None]:
    """(file, line, function, stack text or None) of the nearest caller outside the logging machinery, or
    ("(unknown file)", 0, "(unknown function)", None) at the top of a thread's stack. The real package
    installs its own as `findCaller`; this one has its signature and answer, for code that calls it."""
    skip = {os.path.normcase(logging.__file__), os.path.normcase(__file__)}
    frame = sys._getframe(1)
    while frame is not None and os.path.normcase(frame.f_code.co_filename) in skip:
        frame = frame.f_back  # type: ignore[assignment]
    for _ in range(max(stack_level, 1) - 1):
        if frame is None:
            break
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "(unknown file)", 0, "(unknown function)", None
    text = "Stack (most recent call last):\n" + "".join(traceback.format_stack(frame)) if stack_info else None
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, text


log: logging.Logger = get_logger()
"""The configured "LLM_DATADIST" logger."""
