"""What happens to a group the buffer does not hand to the trainer: the buffer's callbacks.

`GroupFates.on_unused` is `--async-unused-samples-handler`: aborted and stale groups are recycled
(`retry`: the pristine prompt group is served again before fresh prompts, under the same group id) or
dropped. Groups whose user code raised ("failed") follow `--rollout-failure-policy` instead: `retry`
recycles them, `drop` records the fate `failed`. `on_filtered` handles dynamic-filter rejects, which
are always dropped (they carry no usable gradient signal; recycling them would just resample the same
easy or hopeless prompt).
Either way the scheduler stops counting the group, the ledger records its fate and its tokens are
counted as wasted. A group recycled `--max-group-recycles` times is dropped instead (reason
"<why>, recycled N times"): a prompt the engines keep failing on must not circulate forever. The count
lives in memory until the group is trained (`forget`); a resumed run starts counting again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

from miles_aio.buffer.base import FilterDecision
from miles_aio.data.source import DataSource
from miles_aio.ledger import Ledger
from miles_aio.observability.accounting import StepAccounting
from miles_aio.types import BufferItem, Group

__all__ = ["GroupFates", "normalize_filter"]


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

    def on_unused(self, item: BufferItem, reason: str) -> None:
        gid = item.group_index
        self._discard(gid)
        self._accounting.add_wasted(reason, item.group)
        if reason == "failed" and self._failure_policy != "retry":
            self._ledger.record("failed", gid, reason="user code raised")
        elif self._recycled[gid] >= self._max_recycles:
            self._ledger.record("dropped", gid, reason=f"{reason}, recycled {self._recycled.pop(gid)} times")
        elif self._handler == "retry" or reason == "failed":
            self._recycled[gid] += 1
            self._ledger.record("recycled", gid, reason=reason)
            self._source.recycle(item.prompt_group)
        else:
            self._ledger.record("dropped", gid, reason=reason)

    def forget(self, gid: int) -> None:
        """The group was consumed for training: its recycle count is done with."""
        self._recycled.pop(gid, None)

    def on_filtered(self, item: BufferItem, reason: str) -> None:
        self._discard(item.group_index)
        self._accounting.add_wasted("filtered", item.group)
        self._ledger.record("filtered", item.group_index, reason=reason)


def normalize_filter(fn: Any | None, ctx: Any) -> Callable[[Group], FilterDecision] | None:
    """A user's `fn(ctx, group) -> bool | (keep, reason) | FilterDecision` as `group -> FilterDecision`."""
    if fn is None:
        return None

    def decide(group: Group) -> FilterDecision:
        out = fn(ctx, group)
        if isinstance(out, FilterDecision):
            return out
        if isinstance(out, tuple):
            return FilterDecision(bool(out[0]), str(out[1]))
        return FilterDecision(bool(out))

    return decide
