"""Which engines a weight push reaches, when an engine rejoins, when a dead one is restarted and when the
run must fail: pure functions of the engines' states (no I/O, no event loop; tested exhaustively).

An engine behind the `EngineRouter` is in one `EngineState`:

  ACTIVE      in rotation: takes requests and every weight push
  STANDBY     answers, but lacks the current weights, which only a push can bring (broadcast mode): joins
              the next push and is ACTIVE after it
  OUT         failed a call, or a call of a push, or missed --engine-admin-timeout-s: gets no requests; the
              health checker probes it and, once it has the current weights, it rejoins
  RESTARTING  its process died (a launched engine); the supervisor is starting a new one
  LOST        dead, and --engine-max-restarts are spent: it never comes back

The run fails only when no engine is left: every engine LOST, or none ACTIVE or STANDBY (and none being
restarted) for `deadline_s` (the router's `unavailable_deadline_s`: engines given by URL, which nothing
here can restart, that stay down or keep failing their resync).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "EngineState",
    "Rejoin",
    "RestartPolicy",
    "fleet_failure",
    "push_members",
    "rejoin_action",
    "restart_delay",
]


class EngineState(enum.Enum):
    ACTIVE = "active"
    STANDBY = "standby"
    OUT = "out"
    RESTARTING = "restarting"
    LOST = "lost"


_IN_PUSH = frozenset((EngineState.ACTIVE, EngineState.STANDBY))


def push_members(states: Sequence[EngineState]) -> frozenset[int]:
    """The engines a push starting now includes: ACTIVE and STANDBY ones (everything else is excluded)."""
    return frozenset(i for i, s in enumerate(states) if s in _IN_PUSH)


class Rejoin(enum.Enum):
    ACTIVE = "active"
    """It serves the current version (or no version was pushed yet): back in rotation."""
    RESYNC = "resync"
    """Load the last `update_weights_from_disk` first (it is the current version), then decide again."""
    STANDBY = "standby"
    """No copy of the current weights on disk (they came by broadcast): wait for the next push."""


def rejoin_action(*, current: int | None, engine: int | None, on_disk: int | None) -> Rejoin:
    """What a healthy-again engine does before it takes requests. `current`: the router's policy version;
    `engine`: what the engine reports; `on_disk`: the version of the last disk update (None: none)."""
    if current is None or engine == current:
        return Rejoin.ACTIVE
    if on_disk == current:
        return Rejoin.RESYNC
    return Rejoin.STANDBY


@dataclass(frozen=True, kw_only=True, slots=True)
class RestartPolicy:
    """How often and how fast a launched engine whose process died is started again."""

    max_restarts: int = 3
    """Restarts per engine over the whole run (a crash loop ends); 0: never restart."""
    backoff_s: float = 1.0
    """Pause before the first restart; doubled for each further one."""
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError(
                f"RestartPolicy needs max_restarts >= 0, 0 <= backoff_s <= backoff_max_s: {self}"
            )


def restart_delay(policy: RestartPolicy, restarts_done: int) -> float | None:
    """Seconds to wait before restart number `restarts_done + 1` of an engine; None: give up (LOST)."""
    if restarts_done >= policy.max_restarts:
        return None
    return float(min(policy.backoff_max_s, policy.backoff_s * 2.0**restarts_done))


def fleet_failure(
    states: Sequence[EngineState], *, unavailable_for_s: float | None, deadline_s: float
) -> str | None:
    """Why the run must fail now, or None. `unavailable_for_s`: how long no engine has been ACTIVE or
    STANDBY (None: some engine is)."""
    if states and all(s is EngineState.LOST for s in states):
        return f"no engine left: all {len(states)} engines died and their restarts are spent"
    if any(s in _IN_PUSH or s is EngineState.RESTARTING for s in states):
        return None
    if unavailable_for_s is not None and unavailable_for_s >= deadline_s:
        return f"no engine left: none of {len(states)} engines has been usable for {unavailable_for_s:.1f}s"
    return None
