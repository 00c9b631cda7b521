"""The ledger: every admitted prompt group's fate, one JSON line per event, for exactly-once accounting.

Fates: `admitted`; then exactly one of `trained` (with step), `filtered` (dynamic filter, with reason),
`dropped` (unused handler `drop`, with reason), `recycled` (unused handler `retry`: the same group_id is
admitted again later), `failed` (user code raised under a drop policy); or, when the run stops,
`checkpointed_pending` / `pending_at_exit` for groups still in flight or buffered.

The file is append-only, so a resumed run continues the same ledger. `Ledger.open_groups()` and
`check_conservation()` are what the tests use to prove nothing is lost or duplicated.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import IO, Any, Literal

__all__ = ["Fate", "Ledger", "check_conservation", "read_ledger"]

Fate = Literal[
    "admitted",
    "trained",
    "filtered",
    "dropped",
    "recycled",
    "failed",
    "checkpointed_pending",
    "pending_at_exit",
]
TERMINAL: frozenset[str] = frozenset({"trained", "filtered", "dropped", "recycled", "failed"})
PENDING_MARKS: frozenset[str] = frozenset({"checkpointed_pending", "pending_at_exit"})


class Ledger:
    """Records fates; holds the set of groups admitted but not yet settled."""

    def __init__(self, path: Path | None, *, dataset_size: int) -> None:
        self._dataset_size = dataset_size
        self._open: set[int] = set()
        self.counts: Counter[str] = Counter()
        self._file: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")

    def record(
        self, fate: Fate, group_id: int, *, step: int | None = None, reason: str | None = None
    ) -> None:
        if fate == "admitted":
            if group_id in self._open:
                raise RuntimeError(f"ledger: group {group_id} admitted while still open")
            self._open.add(group_id)
        elif fate in TERMINAL:
            if group_id not in self._open:
                raise RuntimeError(f"ledger: group {group_id} settled as {fate!r} but is not open")
            self._open.discard(group_id)
        self.counts[fate] += 1
        if self._file is not None:
            epoch, prompt_index = divmod(group_id, self._dataset_size)
            event: dict[str, Any] = {
                "group_id": group_id,
                "prompt_index": prompt_index,
                "epoch": epoch,
                "fate": fate,
            }
            if step is not None:
                event["step"] = step
            if reason is not None:
                event["reason"] = reason
            self._file.write(json.dumps(event) + "\n")

    def open_groups(self) -> frozenset[int]:
        return frozenset(self._open)

    def mark_pending(
        self, fate: Literal["checkpointed_pending", "pending_at_exit"], *, step: int | None
    ) -> None:
        for gid in sorted(self._open):
            self.record(fate, gid, step=step)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_ledger(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def check_conservation(events: list[dict[str, Any]]) -> dict[str, int]:
    """Raise AssertionError unless every admission has exactly one terminal fate or is marked pending.

    Returns the per-fate counts. Works across a resume: a group pending at a checkpoint may be admitted
    again by the resumed run.
    """
    open_: set[int] = set()
    pending: set[int] = set()
    trained_in_epoch: set[tuple[int, int]] = set()
    counts: Counter[str] = Counter()
    for e in events:
        gid, fate = int(e["group_id"]), e["fate"]
        counts[fate] += 1
        if fate == "admitted":
            assert gid not in open_, f"group {gid} admitted twice without a fate in between"
            open_.add(gid)
            pending.discard(gid)
        elif fate in TERMINAL:
            assert gid in open_, f"group {gid} got fate {fate!r} without being admitted"
            open_.discard(gid)
            if fate == "trained":
                key = (gid, int(e["epoch"]))
                assert key not in trained_in_epoch, f"group {gid} trained twice in epoch {e['epoch']}"
                trained_in_epoch.add(key)
        elif fate in PENDING_MARKS:
            assert gid in open_, f"group {gid} marked {fate!r} without being open"
            open_.discard(gid)
            pending.add(gid)
        else:
            raise AssertionError(f"unknown fate {fate!r}")
    assert not open_, f"groups admitted with no fate and not marked pending: {sorted(open_)[:10]}"
    return dict(counts)
