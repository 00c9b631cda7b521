"""GroupFates forgets a group's recycle count whenever the group reaches a terminal fate."""

from __future__ import annotations

import pytest

from miles_aio.buffer.fates import GroupFates
from miles_aio.ledger import Ledger
from miles_aio.observability.accounting import StepAccounting
from miles_aio.types import BufferItem, Sample
from tests.helpers import make_source

pytestmark = [pytest.mark.pure, pytest.mark.timeout(10)]


def make_fates(**kw: object) -> tuple[GroupFates, Ledger]:
    source = make_source(n_prompts=10, n=2)
    ledger = Ledger(None, dataset_size=source.dataset_size)
    fates = GroupFates(
        discard=lambda gid: None,
        ledger=ledger,
        source=source,
        accounting=StepAccounting(blocked_seconds=lambda now: {}, generated_tokens=lambda: 0),
        **kw,  # type: ignore[arg-type]
    )
    return fates, ledger


def item(gid: int) -> BufferItem:
    group = [Sample(group_index=gid, index=gid * 2 + k, prompt="p") for k in range(2)]
    return BufferItem(group=group, prompt_group=[Sample(group_index=gid, index=gid * 2, prompt="p")])


@pytest.mark.parametrize(
    ("handler", "policy", "terminal"),
    [
        ("retry", "drop", "failed"),  # recycled (aborted), then user code raised under drop
        ("retry", "fail", "failed"),
        ("retry", "retry", "filtered"),  # recycled, then rejected by the dynamic filter
        ("drop", "retry", "aborted"),  # recycled (failed under retry), then dropped as aborted
        ("drop", "retry", "stale"),
    ],
)
def test_a_recycled_group_that_ends_without_training_forgets_its_recycle_count(
    handler: str, policy: str, terminal: str
) -> None:
    fates, ledger = make_fates(handler=handler, failure_policy=policy)
    first = "failed" if handler == "drop" else "aborted"
    ledger.record("admitted", 3)
    fates.on_unused(item(3), first)
    assert fates.recycling == {3: 1} and ledger.counts["recycled"] == 1  # recycled once
    ledger.record("admitted", 3)
    if terminal == "filtered":
        fates.on_filtered(item(3), "zero_std")
    else:
        fates.on_unused(item(3), terminal)
    assert 3 not in fates.recycling


def test_the_max_recycles_drop_and_training_still_forget() -> None:
    fates, ledger = make_fates(handler="retry", max_recycles=2)
    for _ in range(3):
        ledger.record("admitted", 5)
        fates.on_unused(item(5), "aborted")
    assert 5 not in fates.recycling
    assert ledger.counts["recycled"] == 2 and ledger.counts["dropped"] == 1  # 2 = max_recycles
    ledger.record("admitted", 6)
    fates.on_unused(item(6), "aborted")
    fates.forget(6)
    assert not fates.recycling
