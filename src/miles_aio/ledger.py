"""The ledger: every admitted prompt group's fate, one JSON line per event, for exactly-once accounting.

Fates: `admitted`; then exactly one of `trained` (with step), `filtered` (dynamic filter, with reason),
`dropped` (unused handler `drop`, with reason), `recycled` (unused handler `retry`: the same group_id is
admitted again later), `failed` (user code raised under a drop policy); or `pending_at_exit` for
groups still in flight or buffered when the run stops.

Checkpoints and resume: a save writes a `{"event": "checkpoint", "step": s}` line followed by one
`checkpointed_pending` line per open group (in flight, buffered, or drained but not yet trained). A
resumed run writes `{"event": "resume", "from_step": s}`: everything after checkpoint s in the ledger
is void (that progress was lost with the process, and the model was rolled back with it), the open
groups are those pending at the checkpoint, and those that were in flight are `resubmitted`.

The file is append-only, so a resumed run continues the same ledger. `check_conservation()` is what
the tests use to prove that nothing is lost or duplicated, across kills and resumes.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import IO, Any, Literal

__all__ = ["Fate", "Ledger", "check_conservation", "read_ledger"]

Fate = Literal[
    "admitted",
    "resubmitted",
    "trained",
    "filtered",
    "dropped",
    "recycled",
    "failed",
    "checkpointed_pending",
    "pending_at_exit",
]
TERMINAL: frozenset[str] = frozenset({"trained", "filtered", "dropped", "recycled", "failed"})


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
        elif fate in TERMINAL or fate == "pending_at_exit":
            if group_id not in self._open:
                raise RuntimeError(f"ledger: group {group_id} settled as {fate!r} but is not open")
            self._open.discard(group_id)
        elif group_id not in self._open:  # resubmitted, checkpointed_pending: informational, must be open
            raise RuntimeError(f"ledger: group {group_id} marked {fate!r} but is not open")
        self.counts[fate] += 1
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
        self._write(event)

    def open_groups(self) -> frozenset[int]:
        return frozenset(self._open)

    def mark_pending(
        self, fate: Literal["checkpointed_pending", "pending_at_exit"], *, step: int | None
    ) -> None:
        for gid in sorted(self._open):
            self.record(fate, gid, step=step)

    def checkpoint(self, step: int) -> None:
        """Mark a checkpoint: the open groups at this point are the ones a resume starts from."""
        self._write({"event": "checkpoint", "step": step})
        self.mark_pending("checkpointed_pending", step=step)
        self.flush()

    def resume(self, from_step: int, open_groups: set[int]) -> None:
        """A resumed run starts here, with the groups pending at checkpoint `from_step` open."""
        self._write({"event": "resume", "from_step": from_step})
        self._open = set(open_groups)

    def _write(self, event: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(event) + "\n")

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
    """Raise AssertionError unless every admission has exactly one terminal fate or is pending at exit.

    A `resume` event rolls the accounting back to its checkpoint (what happened after it was lost with
    the killed process), so a group may be trained again after a resume, but never twice in one history.
    Returns the per-fate counts.
    """
    open_: set[int] = set()
    trained: set[int] = set()
    snapshots: dict[int, tuple[set[int], set[int]]] = {}
    counts: Counter[str] = Counter()
    for e in events:
        if "event" in e:
            if e["event"] == "checkpoint":
                snapshots[int(e["step"])] = (set(open_), set(trained))
            elif e["event"] == "resume":
                step = int(e["from_step"])
                assert step in snapshots, f"resume from step {step}, which has no checkpoint in the ledger"
                open_, trained = set(snapshots[step][0]), set(snapshots[step][1])
            continue
        gid, fate = int(e["group_id"]), e["fate"]
        counts[fate] += 1
        if fate == "admitted":
            assert gid not in open_, f"group {gid} admitted twice without a fate in between"
            open_.add(gid)
        elif fate in ("resubmitted", "checkpointed_pending"):
            assert gid in open_, f"group {gid} {fate} but not open"
        elif fate in TERMINAL or fate == "pending_at_exit":
            assert gid in open_, f"group {gid} got fate {fate!r} without being admitted"
            open_.discard(gid)
            if fate == "trained":
                assert gid not in trained, f"group {gid} (epoch {e['epoch']}) trained twice"
                trained.add(gid)
        else:
            raise AssertionError(f"unknown fate {fate!r}")
    assert not open_, f"groups admitted with no fate and not pending at exit: {sorted(open_)[:10]}"
    return dict(counts)
