"""The controller's half of a checkpoint: everything needed to resume without losing a prompt group.

    <save>/step_<s>/controller_state.json   this state (the trainer writes its own files beside it)
    <save>/latest                           the newest complete step, written last (atomic rename)

What is saved at step s (after its weight push): the data source position and recycle queue, the
buffer's own state, the batch already drained for step s+1 (`carry`: trained first on resume), and
the prompt groups still in flight (re-submitted first on resume). miles keeps only the data source
position, so its buffered and in-flight groups are lost across a restart (radixark/miles#2254).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_aio.types import BufferItem, Group, Sample

__all__ = [
    "ControllerState",
    "buffered_items",
    "latest_checkpoint",
    "read_controller_state",
    "step_dir",
    "write_controller_state",
]

STATE_FILE = "controller_state.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class ControllerState:
    step: int  # the last trained step
    version: int  # the policy version pushed after it
    data_source: dict[str, Any]
    buffer: dict[str, Any]
    carry: list[BufferItem]
    in_flight: list[Group]


def step_dir(save_dir: Path, step: int) -> Path:
    return save_dir / f"step_{step}"


def write_controller_state(save_dir: Path, state: ControllerState) -> Path:
    directory = step_dir(save_dir, state.step)
    directory.mkdir(parents=True, exist_ok=True)
    doc = {
        "step": state.step,
        "version": state.version,
        "data_source": state.data_source,
        "buffer": state.buffer,
        "carry": [it.to_dict() for it in state.carry],
        "in_flight": [[s.to_dict() for s in g] for g in state.in_flight],
    }
    tmp = directory / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(doc), encoding="utf-8")
    os.replace(tmp, directory / STATE_FILE)
    latest = save_dir / "latest.tmp"
    latest.write_text(str(state.step), encoding="utf-8")
    os.replace(latest, save_dir / "latest")  # only now is the checkpoint complete
    return directory


def has_checkpoint(load: Path) -> bool:
    """Whether `--load` names a step directory or a save directory with a `latest` step."""
    return (load / STATE_FILE).is_file() or (load / "latest").is_file()


def latest_checkpoint(load: Path) -> Path:
    """`--load` may name a save directory (its `latest` step is used) or one step directory."""
    if (load / STATE_FILE).is_file():
        return load
    latest = load / "latest"
    if not latest.is_file():
        raise FileNotFoundError(f"{load} holds no checkpoint (no {STATE_FILE} and no 'latest' file)")
    return step_dir(load, int(latest.read_text(encoding="utf-8").strip()))


def read_controller_state(directory: Path) -> ControllerState:
    doc = json.loads((directory / STATE_FILE).read_text(encoding="utf-8"))
    return ControllerState(
        step=int(doc["step"]),
        version=int(doc["version"]),
        data_source=doc["data_source"],
        buffer=doc["buffer"],
        carry=[BufferItem.from_dict(d) for d in doc["carry"]],
        in_flight=[[Sample.from_dict(s) for s in g] for g in doc["in_flight"]],
    )


def buffered_items(buffer_state: dict[str, Any]) -> list[BufferItem]:
    """The groups inside a DefaultDataBuffer state (a custom buffer's state is opaque: none known)."""
    items = buffer_state.get("items", [])
    return [BufferItem.from_dict(d) for d in items] if isinstance(items, list) else []
