"""Exceptions raised by miles_aio.

MilesAioError
 ├── ConfigError            invalid flags or combinations; the CLI exits 2 and names the flags
 ├── PluginError            an import path (pkg.mod:attr) that does not resolve
 ├── BufferClosed           put()/get() on a closed DataBuffer
 ├── RolloutWorkerDied      the rollout worker stopped; raised by the next drain
 ├── LedgerError            ledger.jsonl holds a line that is not an event (other than one torn last line)
 └── EngineError            an inference engine call failed after the client's retry policy
      ├── EngineUnavailable  no healthy engine / connection refused or reset
      └── EngineBadResponse  the engine answered with something that breaks the contract
"""

from __future__ import annotations

from collections.abc import Sequence

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
    """The rollout worker is gone, so the drain can never complete."""


class LedgerError(MilesAioError):
    """ledger.jsonl cannot be read or appended to: a line that is not an event, other than a torn last
    line (which a crash or a full disk leaves, and which is tolerated); the message names file:line."""


class EngineError(MilesAioError):
    """An engine call failed (after retries)."""


class EngineUnavailable(EngineError):
    """No engine could take the request (refused, reset, unhealthy, timed out)."""


class EngineBadResponse(EngineError):
    """The engine's answer broke the /generate contract (bad JSON, missing fields, length mismatch)."""


def primary_error(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups, for a readable traceback."""
    import asyncio

    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)]
        exc = (inner or list(exc.exceptions))[0]
    return exc
