"""When eval points fall: before training, every --eval-interval steps, and after the last step (miles)."""

from __future__ import annotations

from typing import Any

import pytest

from miles_aio.eval.dispatcher import EvalDispatcher
from miles_aio.eval.snapshot_dispatcher import SnapshotEvalDispatcher

pytestmark = pytest.mark.pure

UNUSED: Any = None  # due() reads only the schedule


def test_points_fall_every_interval_and_after_the_last_step() -> None:
    shared = EvalDispatcher(UNUSED, interval=3, final_step=7)
    snapshots = SnapshotEvalDispatcher(UNUSED, UNUSED, interval=3, final_step=7)
    for d in (shared, snapshots):
        assert [s for s in range(8) if d.due(s)] == [0, 3, 6, 7]
    aligned = EvalDispatcher(UNUSED, interval=3, final_step=6, before_train=False)
    assert [s for s in range(7) if aligned.due(s)] == [3, 6]
    assert not any(EvalDispatcher(UNUSED, interval=None, final_step=7).due(s) for s in range(1, 8))
