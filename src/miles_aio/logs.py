"""structlog set-up: a readable console renderer for people, JSON lines with `--log-format json`.

Logs go to stderr so stdout stays free for machine-readable output (the engine's ready line,
`--dry-run` plans). Components bind their name: `structlog.get_logger("miles_aio.worker")`.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

__all__ = ["configure_logging"]


class _StderrLogger:
    """Writes to whatever sys.stderr is *now*, so a progress bar that redirects stderr stays intact."""

    def __init__(self, *args: object) -> None:
        pass

    def msg(self, message: str) -> None:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


def configure_logging(fmt: Literal["console", "json"] = "console", level: str = "INFO") -> None:
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info
            if fmt == "json"
            else structlog.processors.StackInfoRenderer(),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=_StderrLogger,
        cache_logger_on_first_use=False,
    )
