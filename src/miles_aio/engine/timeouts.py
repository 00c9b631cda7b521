"""Request timeouts and the scheduler watchdog, as SGLang has them.

SGLang's rules (0.5.23; `srt/managers/scheduler.py` `_poll_timeout_aborts`, `srt/environ.py`,
`srt/utils/watchdog.py`, `scheduler_components/invariant_checker.py` `create_scheduler_watchdog`):

- `SGLANG_REQ_WAITING_TIMEOUT` (seconds; <= 0 or unset: off): a request in the scheduler's waiting queue
  for longer than this is aborted with `{"type": "abort", "status_code": 503, "message": "Request waiting
  timeout reached."}`. The clock is `wait_queue_entry_time`: restarted when a retracted request re-enters
  the queue. A request sent while the engine is paused is held by SGLang's tokenizer manager, outside the
  queue, so its clock starts at `/continue_generation`.
- `SGLANG_REQ_RUNNING_TIMEOUT`: a request in the running batch for longer than this (from its first
  forward, `forward_entry_time`, kept across retractions) is aborted with `FINISH_ABORT("Request running
  timeout reached.", 503)`. While paused no forward runs, so the abort lands at the next forward after
  `/continue_generation`: here, running timeouts are not enforced while paused.
  A non-streaming client of either gets HTTP 503 `{"object": "error", "message": ..., "type": "503",
  "param": null, "code": 503}`.
- `--watchdog-timeout` (default 300 s): while the scheduler has a current batch and no new forward
  started for longer than this, it logs `Scheduler watchdog timeout (...)`, dumps the stacks and the
  server is killed (SIGKILL). A current batch stays set through an `in_place` pause that froze running
  requests, so such a pause longer than the timeout kills the server; `retract`/`abort` pauses leave no
  batch. `--soft-watchdog-timeout` (default off) only logs and dumps, again every timeout while stuck.

Here: `overdue` and `watchdog_deadline` decide (pure), `Supervisor` acts: one task in the server's
TaskGroup that sleeps until the nearest deadline, woken early by `LocalEngine.deadlines_changed`.
No polling: when nothing has a deadline it waits for the event alone.
"""

from __future__ import annotations

import asyncio
import faulthandler
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Generic, Protocol, TypeVar

import structlog

__all__ = [
    "RUNNING_TIMEOUT_MESSAGE",
    "WAITING_TIMEOUT_MESSAGE",
    "Limits",
    "Supervised",
    "Supervisor",
    "Timed",
    "Verdict",
    "overdue",
    "running_timeout_reason",
    "waiting_timeout_reason",
    "watchdog_deadline",
]

_log = structlog.get_logger(__name__)

WAITING_TIMEOUT_MESSAGE: Final = "Request waiting timeout reached."
RUNNING_TIMEOUT_MESSAGE: Final = "Request running timeout reached."
_SERVICE_UNAVAILABLE: Final = 503
WAITING_TIMEOUT_ENV: Final = "SGLANG_REQ_WAITING_TIMEOUT"
RUNNING_TIMEOUT_ENV: Final = "SGLANG_REQ_RUNNING_TIMEOUT"
DEFAULT_WATCHDOG_TIMEOUT_S: Final = 300.0
"""SGLang's `--watchdog-timeout` default."""


def waiting_timeout_reason() -> dict[str, Any]:
    """The finish_reason SGLang gives a request aborted in the waiting queue (its dict, key order kept)."""
    return {"type": "abort", "status_code": _SERVICE_UNAVAILABLE, "message": WAITING_TIMEOUT_MESSAGE}


def running_timeout_reason() -> dict[str, Any]:
    """`FINISH_ABORT("Request running timeout reached.", 503).to_json()`."""
    return {
        "type": "abort",
        "message": RUNNING_TIMEOUT_MESSAGE,
        "status_code": _SERVICE_UNAVAILABLE,
        "err_type": None,
    }


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """Request timeouts in seconds; None: off."""

    waiting_s: float | None = None
    running_s: float | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Limits:
        """SGLang's `EnvFloat(-1)` reading: unset, <= 0, or not a number (warned) is off."""
        return cls(
            waiting_s=_env_seconds(env, WAITING_TIMEOUT_ENV), running_s=_env_seconds(env, RUNNING_TIMEOUT_ENV)
        )

    @property
    def enabled(self) -> bool:
        return self.waiting_s is not None or self.running_s is not None


def _env_seconds(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        _log.warning(f'Invalid value for {name}: "{raw}" is not a valid float value, using default "-1"')
        return None
    return value if value > 0 and math.isfinite(value) else None


class Timed(Protocol):
    """What `overdue` reads of a request: `queued_s` is when it entered the waiting queue (None: not in
    it: running, or held by a pause), `started_s` when it first ran (None: never)."""

    @property
    def queued_s(self) -> float | None: ...

    @property
    def started_s(self) -> float | None: ...


T = TypeVar("T", bound=Timed)


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict(Generic[T]):
    waiting: list[T] = field(default_factory=list)
    """Over the waiting timeout: abort with `waiting_timeout_reason()`."""
    running: list[T] = field(default_factory=list)
    """Over the running timeout: abort with `running_timeout_reason()`."""
    next_deadline: float | None = None
    """The earliest deadline among the others (> now); None: none of them has one."""


def overdue(now: float, requests: Iterable[T], limits: Limits, *, paused: bool) -> Verdict[T]:
    """Which unfinished `requests` are past their deadline at `now` (SGLang's rules, module docstring).

    A request with `queued_s` is waiting: deadline `queued_s + waiting_s`. One without `queued_s` but with
    `started_s` is running: deadline `started_s + running_s`, not enforced while `paused`. Neither: held
    by a pause, no deadline. Due at the deadline itself (`now >= deadline`), so a timer woken there acts.
    """
    waiting: list[T] = []
    running: list[T] = []
    nearest = math.inf
    for req in requests:
        if req.queued_s is not None:
            if limits.waiting_s is None:
                continue
            deadline, bucket = req.queued_s + limits.waiting_s, waiting
        elif req.started_s is not None and not paused:
            if limits.running_s is None:
                continue
            deadline, bucket = req.started_s + limits.running_s, running
        else:
            continue
        if now >= deadline:
            bucket.append(req)
        else:
            nearest = min(nearest, deadline)
    return Verdict(waiting=waiting, running=running, next_deadline=None if nearest == math.inf else nearest)


def watchdog_deadline(*, active: bool, last_progress_s: float, timeout_s: float | None) -> float | None:
    """When the watchdog fires if nothing progresses: only while the scheduler has a current batch."""
    if not active or timeout_s is None:
        return None
    return last_progress_s + timeout_s


class Supervised(Protocol):
    """The engine, as the supervisor sees it (`LocalEngine`)."""

    @property
    def closed(self) -> bool: ...

    @property
    def is_paused(self) -> bool: ...

    @property
    def deadlines_changed(self) -> asyncio.Event: ...

    @property
    def last_step_start_s(self) -> float:
        """When the latest step (forward) started: the watchdog's progress counter."""
        ...

    def timed_requests(self) -> list[Any]:
        """The unfinished requests, waiting and running (each `Timed`)."""
        ...

    def watchdog_active(self) -> bool:
        """SGLang's `cur_batch_for_debug is not None`: a step in flight, or running requests on KV."""
        ...

    def expire(self, requests: list[Any], reason: dict[str, Any]) -> None:
        """Finish `requests` now with `reason` (keeping their output)."""
        ...


def _fatal_watchdog() -> None:
    """SGLang's hard watchdog: the whole server is SIGKILLed (after the log and the stack dump)."""
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(kw_only=True)
class Supervisor:
    """Enforces `limits` and the watchdog on `engine`. Run `run()` in the server's TaskGroup."""

    engine: Supervised
    limits: Limits
    watchdog_timeout_s: float | None = DEFAULT_WATCHDOG_TIMEOUT_S
    soft_watchdog_timeout_s: float | None = None
    on_fatal: Callable[[], None] = _fatal_watchdog
    clock: Callable[[], float] = time.monotonic
    fired: list[tuple[float, bool]] = field(default_factory=list)
    """(when, soft) of every watchdog firing."""
    _soft_fired_s: float = -math.inf

    async def run(self) -> None:
        """Until the engine closes: act on what is due, then sleep until the next deadline or a change."""
        if (
            not self.limits.enabled
            and self.watchdog_timeout_s is None
            and self.soft_watchdog_timeout_s is None
        ):
            return
        engine = self.engine
        while not engine.closed:
            engine.deadlines_changed.clear()  # before reading: a change from here on wakes the wait below
            deadline = self.check(self.clock())
            try:
                async with asyncio.timeout_at(deadline):
                    await engine.deadlines_changed.wait()
            except TimeoutError:
                pass

    def check(self, now: float) -> float | None:
        """Act on everything due at `now`; return the next deadline (None: wait for a change)."""
        engine = self.engine
        deadlines: list[float] = []
        if self.limits.enabled:
            verdict = overdue(now, engine.timed_requests(), self.limits, paused=engine.is_paused)
            if verdict.waiting:
                _log.warning("engine.request_waiting_timeout", rids=[r.rid for r in verdict.waiting])
                engine.expire(verdict.waiting, waiting_timeout_reason())
            if verdict.running:
                _log.warning("engine.request_running_timeout", rids=[r.rid for r in verdict.running])
                engine.expire(verdict.running, running_timeout_reason())
            if verdict.next_deadline is not None:
                deadlines.append(verdict.next_deadline)
        active = engine.watchdog_active()
        progress = engine.last_step_start_s
        hard = watchdog_deadline(active=active, last_progress_s=progress, timeout_s=self.watchdog_timeout_s)
        if hard is not None and now >= hard:
            self._fire(soft=False, timeout_s=self.watchdog_timeout_s)
            self.on_fatal()
            return None
        soft = watchdog_deadline(
            active=active,
            last_progress_s=max(progress, self._soft_fired_s),
            timeout_s=self.soft_watchdog_timeout_s,
        )
        if soft is not None and now >= soft:
            self._fire(soft=True, timeout_s=self.soft_watchdog_timeout_s)
            self._soft_fired_s = now  # SGLang's soft watchdog re-arms: it fires again a timeout later
            soft = watchdog_deadline(
                active=active, last_progress_s=now, timeout_s=self.soft_watchdog_timeout_s
            )
        deadlines += [d for d in (hard, soft) if d is not None]
        return min(deadlines) if deadlines else None

    def _fire(self, *, soft: bool, timeout_s: float | None) -> None:
        self.fired.append((self.clock(), soft))
        requests = self.engine.timed_requests()
        _log.error(
            "Scheduler debug info",
            running=[r.rid for r in requests if r.queued_s is None and r.started_s is not None],
            waiting=len([r for r in requests if r.queued_s is not None]),
            paused=self.engine.is_paused,
        )
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (AttributeError, ValueError, OSError):  # a stderr without a file descriptor
            _log.error("no stack dump: stderr has no file descriptor")
        # SGLang's line: f"{self.debug_name} watchdog timeout ({self.watchdog_timeout=}, {self.soft=})"
        _log.error(f"Scheduler watchdog timeout (self.watchdog_timeout={timeout_s}, self.soft={soft})")
