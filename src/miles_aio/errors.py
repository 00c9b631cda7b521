"""Exceptions raised by miles_aio.

MilesAioError
 ├── ConfigError            invalid flags or combinations; the CLI exits 2 and names the flags
 ├── PluginError            an import path (pkg.mod:attr) that does not resolve
 ├── BufferClosed           put()/get() on a closed DataBuffer
 ├── RolloutWorkerDied      the rollout worker stopped (no longer raised: the drain re-raises its own error)
 ├── LedgerError            ledger.jsonl holds a line that is not an event (other than one torn last line)
 └── EngineError            an inference engine call failed after the client's retry policy
      ├── EngineUnavailable  no healthy engine / connection refused or reset
      └── EngineBadResponse  the engine answered with something that breaks the contract

`primary_error(exc)` is the one error to report for an exception group (a TaskGroup's failure): its
first real leaf, with every other one attached as a note and logged, so none is dropped silently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import structlog

__all__ = [
    "BufferClosed",
    "ConfigError",
    "EngineBadResponse",
    "EngineError",
    "EngineUnavailable",
    "LedgerError",
    "MilesAioError",
    "PluginError",
    "RolloutWorkerDied",
    "primary_error",
]

_log = structlog.get_logger("miles_aio.errors")


class MilesAioError(Exception):
    """Base class of every error miles_aio raises on purpose."""


class ConfigError(MilesAioError):
    """An invalid configuration. `flags` names the command-line flags involved."""

    def __init__(self, message: str, *, flags: Sequence[str]) -> None:
        self.flags = tuple(flags)
        super().__init__(f"{', '.join(self.flags)}: {message}" if self.flags else message)


class PluginError(MilesAioError):
    """A user plug-in path (`pkg.mod:attr`) could not be imported or has the wrong shape."""


class BufferClosed(MilesAioError):
    """The DataBuffer was closed; no more items will be accepted or returned."""


class RolloutWorkerDied(MilesAioError):
    """The rollout worker is gone, so the drain can never complete.

    Not raised any more: a drain the dead worker can never fill re-raises the worker's own error (the
    user's exception type, with a note naming the step), so `except MyError` around a run works. Kept
    so that code importing it still imports."""


class LedgerError(MilesAioError):
    """ledger.jsonl cannot be read or appended to: a line that is not an event, other than a torn last
    line (which a crash or a full disk leaves, and which is tolerated); the message names file:line."""


class EngineError(MilesAioError):
    """An engine call failed (after retries)."""


class EngineUnavailable(EngineError):
    """No engine could take the request (refused, reset, unhealthy, timed out)."""


class EngineBadResponse(EngineError):
    """The engine's answer broke the /generate contract (bad JSON, missing fields, length mismatch)."""


def primary_error(
    exc: BaseException, *, prefer: Callable[[BaseException], bool] | None = None
) -> BaseException:
    """The one error to report for `exc`: `exc` itself unless it is an exception group; else the group's
    first leaf (depth first) that is not a cancellation — the first one `prefer` accepts, if any.

    Nothing is dropped silently: every other distinct leaf that is not a cancellation is attached to the
    primary as a note ("also raised: ...") and logged with its traceback. Calling it again on the same
    group adds and logs nothing twice. The primary keeps its own traceback and cause chain: re-raise it
    with `raise primary_error(eg)  # noqa: B904`.
    """
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves = _leaves(exc)
    real = [e for e in leaves if not isinstance(e, asyncio.CancelledError)]
    candidates = real or leaves
    primary = next((e for e in candidates if prefer(e)), candidates[0]) if prefer else candidates[0]
    for other in real:
        if other is primary:
            continue
        note = f"also raised: {type(other).__qualname__}: {other}"
        if note in getattr(primary, "__notes__", ()):
            continue
        primary.add_note(note)
        _log.error(
            "an error raised alongside the reported one",
            reported=repr(primary),
            error=repr(other),
            exc_info=other,
        )
    return primary


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions that are not groups inside (nested) groups, depth first, each object once."""
    out: list[BaseException] = []
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if isinstance(e, BaseExceptionGroup):
            stack.extend(reversed(e.exceptions))
        elif id(e) not in seen:
            seen.add(id(e))
            out.append(e)
    return out
