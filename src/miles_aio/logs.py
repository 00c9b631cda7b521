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
    """Writes to whatever sys.stderr is *now*, so a progress bar that redirects stderr stays intact.
    Keeps the name given to `structlog.get_logger(name)`: it is the line's `component`."""

    def __init__(self, *args: object) -> None:
        self.name = str(args[0]) if args else None

    def msg(self, message: str) -> None:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


def _add_component(
    logger: object, method: str, event: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """`component`: the logger's name without the package prefix (`miles_aio.worker` → `worker`)."""
    name = getattr(logger, "name", None)
    if name and "component" not in event:
        event["component"] = name.removeprefix("miles_aio.")
    return event


def configure_logging(fmt: Literal["console", "json"] = "console", level: str = "INFO") -> None:
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        # Plain tracebacks: rich's default shows every frame's locals, megabytes per error once tensors
        # or long token lists are in scope.
        renderer = structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_component,
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
