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
first real leaf, with every other distinct one attached as a note and logged, so none is dropped
silently, and none is reported twice (the same bug in every sample of a batch is one error).
`format_run_error(exc)` is how a run that failed reports it (`miles_aio.recipe.main`): a short plain
traceback (no locals, no interpreter or CLI frames), the notes, and the cause on the last line.
"""

from __future__ import annotations

import asyncio
import sysconfig
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

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
    "format_run_error",
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
    primary as a note ("also raised: ...") and logged with its traceback, once per distinct error (its
    type and message): the same error from many tasks (one bug, every sample) is one note saying how
    often, and an error like the primary only counts in the primary's note. Calling it again on the same
    group adds and logs nothing twice. The primary keeps its own traceback and cause chain: re-raise it
    with `raise primary_error(eg)  # noqa: B904`.
    """
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves = _leaves(exc)
    real = [e for e in leaves if not isinstance(e, asyncio.CancelledError)]
    candidates = real or leaves
    primary = next((e for e in candidates if prefer(e)), candidates[0]) if prefer else candidates[0]
    distinct: dict[str, list[BaseException]] = {}
    for e in real:
        distinct.setdefault(_describe(e), []).append(e)
    notes = getattr(primary, "__notes__", ())
    for what, same in distinct.items():
        if primary in same:
            note = f"raised {len(same)} times in all (one traceback shown)"
            if len(same) > 1 and not any(
                n.startswith("raised ") and n.endswith("(one traceback shown)") for n in notes
            ):
                primary.add_note(note)
            continue
        note = f"also raised: {what}" + (f" ({len(same)} times)" if len(same) > 1 else "")
        if any(n.startswith(f"also raised: {what}") for n in notes):
            continue
        primary.add_note(note)
        _log.error(
            "an error raised alongside the reported one",
            reported=repr(primary),
            error=repr(same[0]),
            times=len(same),
            exc_info=same[0],
        )
    return primary


def _describe(e: BaseException) -> str:
    return f"{type(e).__qualname__}: {e}"


def _is_runtime_frame(f: traceback.FrameSummary) -> bool:
    """The interpreter's and the standard library's frames (runpy, asyncio's loop): never the bug."""
    name = f.filename
    return name.startswith("<frozen ") or any(Path(name).is_relative_to(d) for d in _STDLIB_DIRS)


_STDLIB_DIRS = tuple(
    Path(d) for d in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]} if d
)


def _shorten(te: traceback.TracebackException) -> None:
    """Drop the frames no bug is in: the interpreter's and the standard library's, and the command
    line's own path down to `Controller.run` (every run's error passes through those)."""
    frames = [f for f in te.stack if not _is_runtime_frame(f)]
    entry = [i for i, f in enumerate(frames) if f.name == "run" and Path(f.filename).name == "controller.py"]
    if entry and entry[-1] + 1 < len(frames):
        frames = frames[entry[-1] + 1 :]
    te.stack = traceback.StackSummary.from_list(frames)
    for chained in (te.__cause__, te.__context__):
        if chained is not None:
            _shorten(chained)


def format_run_error(exc: BaseException) -> str:
    """The report of the error a run failed with: a short traceback (the frames of the code that
    failed: no locals, no interpreter, asyncio or command-line frames), its cause chain, its notes, and
    the error itself on the last line."""
    notes = list(getattr(exc, "__notes__", ()))
    te = traceback.TracebackException.from_exception(exc, capture_locals=False)
    te.__notes__ = None  # written before the last line, below
    _shorten(te)
    lines = list(te.format())
    only = list(te.format_exception_only())
    body = "".join(lines[: len(lines) - len(only)])
    return body + "".join(f"{n}\n" for n in notes) + "".join(only)


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
