"""What happens to a group the buffer does not hand to the trainer: the buffer's callbacks.

`GroupFates.on_unused` is `--async-unused-samples-handler`: aborted and stale groups are recycled
(`retry`: the pristine prompt group is served again before fresh prompts, under the same group id) or
dropped. Groups whose user code raised ("failed") follow `--rollout-failure-policy` instead: `retry`
recycles them, `drop` records the fate `failed`. `on_filtered` handles dynamic-filter rejects, which
are always dropped (they carry no usable gradient signal; recycling them would just resample the same
easy or hopeless prompt); a filter that raises rejects the group as `filter_crashed` unless the
failure policy is `fail` (`normalize_filter`).
Either way the scheduler stops counting the group, the ledger records its fate and its tokens are
counted as wasted. A group recycled `--max-group-recycles` times is dropped instead (reason
"<why>, recycled N times"): a prompt the engines keep failing on must not circulate forever. The count
lives in memory until the group is trained (`forget`); a resumed run starts counting again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

import structlog

from miles_aio.buffer.base import FilterDecision
from miles_aio.data.source import DataSource
from miles_aio.ledger import Ledger
from miles_aio.observability.accounting import StepAccounting
from miles_aio.types import BufferItem, Group

__all__ = ["FILTER_CRASHED", "GroupFates", "normalize_filter"]

_log = structlog.get_logger("miles_aio.buffer")


class GroupFates:
    def __init__(
        self,
        *,
        handler: Literal["retry", "drop"],
        failure_policy: Literal["fail", "drop", "retry"] = "fail",
        discard: Callable[[int], None],
        ledger: Ledger,
        source: DataSource,
        accounting: StepAccounting,
        max_recycles: int = 8,
    ) -> None:
        self._handler = handler
        self._max_recycles = max_recycles
        self._recycled: Counter[int] = Counter()
        self._failure_policy = failure_policy
        self._discard = discard
        self._ledger = ledger
        self._source = source
        self._accounting = accounting

    @property
    def recycling(self) -> dict[int, int]:
        """Group id → times recycled so far, for each group still being recycled (a copy)."""
        return dict(self._recycled)

    def on_unused(self, item: BufferItem, reason: str) -> None:
        gid = item.group_index
        self._discard(gid)
        self._accounting.add_wasted(reason, item.group)
        # every terminal branch pops the group's recycle count: a group recycled once and then failed,
        # dropped or filtered must not keep its entry (memory growth on long runs)
        if reason == "failed" and self._failure_policy != "retry":
            self._recycled.pop(gid, None)
            self._ledger.record("failed", gid, reason="user code raised")
        elif self._recycled[gid] >= self._max_recycles:
            self._ledger.record("dropped", gid, reason=f"{reason}, recycled {self._recycled.pop(gid)} times")
        elif self._handler == "retry" or reason == "failed":
            self._recycled[gid] += 1
            self._ledger.record("recycled", gid, reason=reason)
            self._source.recycle(item.prompt_group)
        else:
            self._recycled.pop(gid, None)
            self._ledger.record("dropped", gid, reason=reason)

    def forget(self, gid: int) -> None:
        """The group was consumed for training: its recycle count is done with."""
        self._recycled.pop(gid, None)

    def on_filtered(self, item: BufferItem, reason: str) -> None:
        self._discard(item.group_index)
        self._recycled.pop(item.group_index, None)
        self._accounting.add_wasted("filtered", item.group)
        self._ledger.record("filtered", item.group_index, reason=reason)


FILTER_CRASHED = "filter_crashed"
"""The reason of a group whose dynamic filter raised (rollout/dynamic_filter/drop_filter_crashed)."""


def normalize_filter(
    fn: Any | None, ctx: Any, *, failure_policy: Literal["fail", "drop", "retry"] | None = None
) -> Callable[[Group], FilterDecision] | None:
    """A user's `fn(ctx, group) -> bool | (keep, reason) | FilterDecision` as `group -> FilterDecision`.

    A filter that raises (or returns a malformed tuple) follows `--rollout-failure-policy` (taken from
    `ctx.config` unless `failure_policy` is given): `fail` propagates the user's exception, stopping
    the run; `drop` and `retry` log the traceback and reject the group with reason `filter_crashed`
    (rollout/dynamic_filter/drop_filter_crashed). Cancellation is never swallowed.
    """
    if fn is None:
        return None
    policy = failure_policy
    if policy is None:
        policy = getattr(
            getattr(getattr(ctx, "config", None), "rollout", None), "rollout_failure_policy", "fail"
        )
    log: Any = getattr(ctx, "log", None) or _log

    def call(group: Group) -> FilterDecision:
        out = fn(ctx, group)
        if isinstance(out, FilterDecision):
            return out
        if isinstance(out, tuple):
            if len(out) != 2:
                raise TypeError(f"a dynamic filter tuple must be (keep, reason), got {len(out)} items")
            return FilterDecision(bool(out[0]), str(out[1]))
        return FilterDecision(bool(out))

    def decide(group: Group) -> FilterDecision:
        try:
            return call(group)
        except Exception as e:
            if policy == "fail":
                raise
            log.error(
                "dynamic filter raised; group rejected",
                group=group[0].group_index if group else None,
                reason=FILTER_CRASHED,
                error=f"{type(e).__name__}: {e}",
                exc_info=True,
            )
            return FilterDecision(False, FILTER_CRASHED)

    return decide
