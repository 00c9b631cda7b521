"""The controller's half of a checkpoint: everything needed to resume without losing a prompt group.

    <save>/step_<N>/controller_state.json   this state (the trainer writes its own files beside it)
    <save>/latest                           the newest complete N, written last (atomic rename)

N counts steps done, as every step number of a run does (the metrics' `step`, `eval/step`, the ledger):
`step_N` holds the weights after N trained steps, and `--load` continues with step N+1. A checkpoint
written before this numbering (its controller_state.json has `step`, the 0-based index of the last
trained step, and no `steps_done`) is still loaded: `step_<i>` of such a run holds i+1 steps, and its
ledger marker carries i (`ControllerState.ledger_step`).

The commit order of a save (`Controller.save`), so that a crash at any instant leaves `latest` naming
a whole checkpoint that the ledger knows: (1) any stale controller_state.json of the step directory is
removed (a step directory holds one only once it is complete); (2) the trainer writes and fsyncs its
files; (3) the ledger's checkpoint marker (with a fresh id) is written and fsynced; (4)
controller_state.json (naming that id) is written, fsynced and renamed into place; (5) `latest` is
written, fsynced and renamed: the single commit point. A crash before (5) leaves the previous `latest`;
the ledger may then hold a marker that was never committed, which a resume ignores
(`miles_aio.ledger.committed_marker`).

What is saved after step N (after its weight push): the data source position and recycle queue, the
buffer's own state, the batch already drained for step N+1 (`carry`: trained first on resume), and
the prompt groups still in flight (re-submitted first on resume). miles keeps only the data source
position, so its buffered and in-flight groups are lost across a restart (radixark/miles#2254).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_aio._durable import fsync_dir, write_file_atomic
from miles_aio.types import BufferItem, Group, Sample

__all__ = [
    "ControllerState",
    "buffered_items",
    "latest_checkpoint",
    "prepare_step_dir",
    "publish_latest",
    "read_controller_state",
    "read_latest",
    "step_dir",
    "write_controller_state",
]

STATE_FILE = "controller_state.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class ControllerState:
    steps_done: int  # the steps trained: N of step_N (the last trained step is step N)
    version: int  # the policy version pushed after it
    data_source: dict[str, Any]
    buffer: dict[str, Any]
    carry: list[BufferItem]
    in_flight: list[Group]
    ledger_checkpoint: str | None = None  # the id of this save's ledger marker (None: saved before ids)
    ledger_step: int | None = None  # the step its ledger marker records, if not steps_done (an old save)

    @property
    def marker_step(self) -> int:
        """The `step` of this checkpoint's ledger marker (what a resume's `from_step` names)."""
        return self.steps_done if self.ledger_step is None else self.ledger_step


def step_dir(save_dir: Path, steps_done: int) -> Path:
    return save_dir / f"step_{steps_done}"


def prepare_step_dir(save_dir: Path, steps_done: int) -> Path:
    """The directory a save after `steps_done` steps writes into, without a controller_state.json left
    from an earlier save of the same step that was never committed (an interrupted run's): one appears
    only when the directory is complete again."""
    directory = step_dir(save_dir, steps_done)
    directory.mkdir(parents=True, exist_ok=True)
    stale = directory / STATE_FILE
    if stale.exists() and read_latest(save_dir) != steps_done:  # never un-commit what `latest` names
        stale.unlink()
        fsync_dir(directory)
    return directory


def write_controller_state(save_dir: Path, state: ControllerState) -> Path:
    """Write (and fsync) the controller's half of `step_<state.steps_done>`; `publish_latest` commits it."""
    directory = step_dir(save_dir, state.steps_done)
    directory.mkdir(parents=True, exist_ok=True)
    doc = {
        "steps_done": state.steps_done,
        "version": state.version,
        "ledger_checkpoint": state.ledger_checkpoint,
        "data_source": state.data_source,
        "buffer": state.buffer,
        "carry": [it.to_dict() for it in state.carry],
        "in_flight": [[s.to_dict() for s in g] for g in state.in_flight],
    }
    write_file_atomic(directory / STATE_FILE, json.dumps(doc).encode())
    fsync_dir(save_dir)  # the step directory's own entry
    return directory


def publish_latest(save_dir: Path, steps_done: int) -> None:
    """The commit point of a save: `latest` names `step_<steps_done>` (atomically, durably) on return."""
    write_file_atomic(save_dir / "latest", str(steps_done).encode())


def read_latest(save_dir: Path) -> int | None:
    """The N of the `step_N` that `save_dir/latest` names, or None without one."""
    latest = save_dir / "latest"
    return int(latest.read_text(encoding="utf-8").strip()) if latest.is_file() else None


def has_checkpoint(load: Path) -> bool:
    """Whether `--load` names a step directory or a save directory with a `latest` step."""
    return (load / STATE_FILE).is_file() or (load / "latest").is_file()


def latest_checkpoint(load: Path) -> Path:
    """`--load` may name a save directory (its `latest` step is used) or one step directory."""
    if (load / STATE_FILE).is_file():
        return load
    latest = read_latest(load)
    if latest is None:
        raise FileNotFoundError(f"{load} holds no checkpoint (no {STATE_FILE} and no 'latest' file)")
    return step_dir(load, latest)


def read_controller_state(directory: Path) -> ControllerState:
    doc = json.loads((directory / STATE_FILE).read_text(encoding="utf-8"))
    if "steps_done" in doc:
        steps_done, ledger_step = int(doc["steps_done"]), None
    else:  # saved before steps-done numbering: `step` is the 0-based index of the last trained step
        steps_done, ledger_step = int(doc["step"]) + 1, int(doc["step"])
    return ControllerState(
        steps_done=steps_done,
        ledger_step=ledger_step,
        version=int(doc["version"]),
        data_source=doc["data_source"],
        buffer=doc["buffer"],
        carry=[BufferItem.from_dict(d) for d in doc["carry"]],
        in_flight=[[Sample.from_dict(s) for s in g] for g in doc["in_flight"]],
        ledger_checkpoint=doc.get("ledger_checkpoint"),
    )


def buffered_items(buffer_state: dict[str, Any]) -> list[BufferItem]:
    """The groups inside a DefaultDataBuffer state (a custom buffer's state is opaque: none known)."""
    items = buffer_state.get("items", [])
    return [BufferItem.from_dict(d) for d in items] if isinstance(items, list) else []
