"""Which engines a push reaches, when an engine rejoins, when a dead one restarts, when the run fails:
the pure decisions of `miles_aio.inference.availability`, exhaustively (hypothesis, no event loop)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles_aio.inference.availability import (
    EngineState,
    Rejoin,
    RestartPolicy,
    fleet_failure,
    push_members,
    rejoin_action,
    restart_delay,
)

pytestmark = pytest.mark.pure

S = EngineState
STATES = st.lists(st.sampled_from(list(EngineState)), max_size=6)
VERSIONS = st.none() | st.integers(0, 4)


@given(STATES)
def test_a_push_includes_exactly_the_engines_that_serve_or_wait_for_weights(
    states: list[EngineState],
) -> None:
    members = push_members(states)
    for i, s in enumerate(states):
        assert (i in members) == (s in (S.ACTIVE, S.STANDBY))  # OUT, RESTARTING, LOST never get a push call


@given(current=VERSIONS, engine=VERSIONS, on_disk=VERSIONS)
def test_an_engine_never_rejoins_serving_stale_weights(
    current: int | None, engine: int | None, on_disk: int | None
) -> None:
    action = rejoin_action(current=current, engine=engine, on_disk=on_disk)
    if action is Rejoin.ACTIVE:
        assert current is None or engine == current
    if action is Rejoin.RESYNC:  # only a disk copy of the *current* version is loaded
        assert current is not None and on_disk == current and engine != current
    if action is Rejoin.STANDBY:  # waits for a push only when nothing on hand brings it up to date
        assert current is not None and engine != current and on_disk != current
    # and it never waits when it could rejoin now
    if current is None or engine == current:
        assert action is Rejoin.ACTIVE


@given(max_restarts=st.integers(0, 8), base=st.floats(0, 5), cap_extra=st.floats(0, 60))
def test_restarts_are_bounded_with_exponential_backoff(
    max_restarts: int, base: float, cap_extra: float
) -> None:
    policy = RestartPolicy(max_restarts=max_restarts, backoff_s=base, backoff_max_s=base + cap_extra)
    delays = [restart_delay(policy, n) for n in range(max_restarts + 5)]
    granted = [d for d in delays if d is not None]
    assert len(granted) == max_restarts  # exactly max_restarts restarts, then give up for good
    assert all(d is None for d in delays[max_restarts:])
    assert granted == sorted(granted)  # never faster after a failure
    for n, d in enumerate(granted):
        assert d == min(policy.backoff_max_s, base * 2**n)
        assert 0 <= d <= policy.backoff_max_s


def test_restart_policy_validates() -> None:
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="backoff"):
        RestartPolicy(backoff_s=5, backoff_max_s=1)


@given(states=STATES, unavailable_for=st.none() | st.floats(0, 1000), deadline=st.floats(0.1, 500))
def test_the_run_fails_only_when_no_engine_is_left(
    states: list[EngineState], unavailable_for: float | None, deadline: float
) -> None:
    reason = fleet_failure(states, unavailable_for_s=unavailable_for, deadline_s=deadline)
    usable = any(s in (S.ACTIVE, S.STANDBY) for s in states)
    restarting = any(s is S.RESTARTING for s in states)
    all_lost = bool(states) and all(s is S.LOST for s in states)
    expected = all_lost or (
        not usable and not restarting and unavailable_for is not None and unavailable_for >= deadline
    )
    assert (reason is not None) == expected
    if reason is not None:
        assert reason.startswith("no engine left")
    if usable or restarting:  # while something serves or is coming back, never
        assert reason is None


def test_fleet_failure_over_every_small_fleet() -> None:
    """Exhaustive over fleets of up to 3 engines: time only ever turns a waiting fleet into a failure."""
    for n in range(1, 4):
        for states in itertools.product(list(EngineState), repeat=n):
            early = fleet_failure(states, unavailable_for_s=1.0, deadline_s=10.0)
            late = fleet_failure(states, unavailable_for_s=10.0, deadline_s=10.0)
            if early is not None:
                assert late is not None  # monotone in time
            only_out = all(s in (S.OUT, S.LOST) for s in states) and S.OUT in states
            assert (early is None and late is not None) == only_out
