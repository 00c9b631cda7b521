"""`decide_limit` is a pure function: its properties are checked exhaustively, with no event loop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_aio.scheduler.adaptive import (
    AdaptiveMemory,
    AdaptiveParams,
    EngineLoad,
    Observation,
    congested,
    decide_limit,
)

pytestmark = [pytest.mark.pure, pytest.mark.timeout(30)]


@st.composite
def params(draw: st.DrawFn) -> AdaptiveParams:
    group = draw(st.integers(1, 16))
    lo = draw(st.integers(group, 512))
    hi = draw(st.integers(lo, 4096))
    return AdaptiveParams(
        lo=lo,
        hi=hi,
        group_size=group,
        growth=draw(st.floats(1.01, 3.0)),
        shrink=draw(st.floats(0.1, 0.99)),
    )


loads = st.one_of(
    st.none(), st.builds(EngineLoad, st.floats(0, 5000, allow_nan=False), st.floats(0, 5000, allow_nan=False))
)
observations = st.builds(
    Observation,
    load=loads,
    capacity_blocked_ratio=st.floats(0, 1),
    throughput=st.floats(0, 1e6, allow_nan=False),
    retracted=st.integers(0, 100),
)
memories = st.builds(
    AdaptiveMemory, st.one_of(st.none(), st.floats(0, 1e6, allow_nan=False)), st.sampled_from([-1, 0, 1])
)


@settings(max_examples=2000, deadline=None)
@given(params(), st.integers(-10, 10_000), memories, observations)
def test_bounds_always_respected(
    p: AdaptiveParams, limit: int, mem: AdaptiveMemory, obs: Observation
) -> None:
    new, mem2, reason = decide_limit(p, limit, mem, obs)
    assert p.lo <= new <= p.hi
    assert reason in {"congested", "not_binding", "throughput_fell", "grow", "at_max"}
    assert mem2.last_throughput == obs.throughput
    assert decide_limit(p, limit, mem, obs) == (new, mem2, reason)  # pure: same inputs, same answer


@settings(max_examples=1000, deadline=None)
@given(
    params(),
    st.integers(1, 4096),
    st.floats(0, 1e6, allow_nan=False),
    st.floats(0, 5000, allow_nan=False),
    st.floats(0.5, 1.0),
)
def test_grows_while_engines_keep_up(
    p: AdaptiveParams, limit: int, tput: float, running: float, blocked: float
) -> None:
    """No queue, no retraction, the bound binds, throughput did not fall: the limit grows (to hi)."""
    limit = p.clamp(limit)
    obs = Observation(load=EngineLoad(running, 0.0), capacity_blocked_ratio=blocked, throughput=tput)
    for mem in (AdaptiveMemory(), AdaptiveMemory(tput, 1), AdaptiveMemory(tput * 2, -1)):
        new, mem2, _ = decide_limit(p, limit, mem, obs)
        if limit < p.hi:
            assert new >= min(p.hi, limit + p.group_size) and mem2.last_direction == 1
        else:
            assert new == p.hi


@settings(max_examples=1000, deadline=None)
@given(params(), st.integers(1, 4096), memories, st.floats(0, 2000), st.floats(0, 1), st.integers(0, 5))
def test_shrinks_when_queues_grow(
    p: AdaptiveParams, limit: int, mem: AdaptiveMemory, running: float, blocked: float, retracted: int
) -> None:
    limit = p.clamp(limit)
    queued = p.queue_tolerance * max(1.0, running) + 1.0  # beyond the tolerance
    obs = Observation(
        load=EngineLoad(running, queued), capacity_blocked_ratio=blocked, throughput=1.0, retracted=retracted
    )
    assert congested(p, obs)
    new, _, reason = decide_limit(p, limit, mem, obs)
    assert reason == "congested"
    assert new < limit if limit > p.lo else new == p.lo


@settings(max_examples=500, deadline=None)
@given(params(), st.integers(1, 4096), memories, st.floats(0, 0.49), loads)
def test_holds_when_the_bound_does_not_bind(
    p: AdaptiveParams, limit: int, mem: AdaptiveMemory, blocked: float, load: EngineLoad | None
) -> None:
    obs = Observation(load=load, capacity_blocked_ratio=blocked, throughput=1.0)
    new, _, reason = decide_limit(p, limit, mem, obs)
    if not congested(p, obs):
        assert (new, reason) == (p.clamp(limit), "not_binding")


def test_steps_back_when_throughput_falls_after_growing() -> None:
    p = AdaptiveParams(lo=8, hi=1024, group_size=8)
    obs = Observation(load=EngineLoad(100, 0), capacity_blocked_ratio=1.0, throughput=70.0)
    new, mem, reason = decide_limit(p, 200, AdaptiveMemory(100.0, 1), obs)
    assert reason == "throughput_fell" and new < 200 and mem.last_direction == -1


def test_converges_on_an_engine_with_a_queue_beyond_its_batch() -> None:
    """A closed loop on a toy engine that queues beyond 256 running: the limit settles near 256."""
    p = AdaptiveParams(lo=8, hi=4096, group_size=8)
    limit, mem, seen = 16, AdaptiveMemory(), []
    for _ in range(60):
        running, queued = min(limit, 256), max(0, limit - 256)
        obs = Observation(load=EngineLoad(running, queued), capacity_blocked_ratio=1.0, throughput=running)
        limit, mem, _ = decide_limit(p, limit, mem, obs)
        seen.append(limit)
    assert all(250 <= x <= 280 for x in seen[-20:]), seen


def test_params_validate() -> None:
    with pytest.raises(ValueError, match="bounds"):
        AdaptiveParams(lo=10, hi=5)
    with pytest.raises(ValueError, match="growth"):
        AdaptiveParams(lo=1, hi=5, growth=1.0)
