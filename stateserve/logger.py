"""The `stateserve` logger's default set-up, applied on the first import of the package.

Python prints records of a logger without handlers through its last-resort handler, which drops everything below
WARNING: without this module a plain script that builds an `LLM` never sees the load report. As vLLM does for its
own logger, stateserve gives the "stateserve" logger one stream handler on stdout (time, level and file:line on
each line), takes its level from STATESERVE_LOG_LEVEL and stops propagation, so an application's root handler does
not print every line a second time. STATESERVE_CONFIGURE_LOGGING=0 skips all of it: the logger then has no handler
and no level and propagates, and the application's own logging configuration decides what is shown."""
from __future__ import annotations

import logging
import sys

from stateserve import envs

LOGGER_NAME = "stateserve"
_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever `sys.stdout` is when a record is emitted, not the object it was at import: a test runner
    or an application that swaps `sys.stdout` later (and may close the old one) still gets the lines."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201 - a text stream, as StreamHandler's attribute
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001 - StreamHandler.__init__ assigns it; the property wins
        pass


_handler: logging.Handler | None = None


def configure_logging() -> None:
    """Set up the "stateserve" logger unless STATESERVE_CONFIGURE_LOGGING=0; idempotent (one handler at most).

    Raises ValueError, naming the variable and the accepted names, when STATESERVE_LOG_LEVEL is not a level."""
    global _handler
    if not envs.STATESERVE_CONFIGURE_LOGGING:
        return
    level = envs.STATESERVE_LOG_LEVEL  # parsed (and checked) before anything is changed
    logger = logging.getLogger(LOGGER_NAME)
    if _handler is None:
        _handler = _StdoutHandler()
        _handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATE_FORMAT))
        logger.addHandler(_handler)
    logger.setLevel(level)
    logger.propagate = False
