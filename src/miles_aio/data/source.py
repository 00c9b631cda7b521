"""Where prompt groups come from: a dataset walked in seeded per-epoch shuffles, recycled groups first.

The source is synchronous and cheap (the whole prompt set is in memory), so the rollout worker calls it
directly on the event loop. Every prompt group gets a stable `group_index`:
`epoch * len(dataset) + prompt_index`, so recycling a group and resuming a run keep its identity, and
the ledger can prove that no prompt is trained twice within an epoch.
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_aio.config import DataConfig
from miles_aio.errors import ConfigError
from miles_aio.types import Group, Sample

__all__ = ["DataSource", "PromptRecord", "read_prompt_jsonl"]


@dataclass(frozen=True, slots=True)
class PromptRecord:
    prompt: str | list[dict[str, Any]]
    label: Any = None
    metadata: dict[str, Any] | None = None


def read_prompt_jsonl(path: Path, cfg: DataConfig) -> list[PromptRecord]:
    """Read prompts; a bad line raises ConfigError naming the file and line number."""
    if not path.is_file():
        raise ConfigError(f"prompt data file {str(path)!r} does not exist", flags=["--prompt-data"])
    records: list[PromptRecord] = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise ConfigError(f"{where}: not UTF-8 ({e.reason})", flags=["--prompt-data"]) from e
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: invalid JSON ({e.msg})", flags=["--prompt-data"]) from e
            if not isinstance(row, dict) or cfg.input_key not in row:
                raise ConfigError(
                    f"{where}: missing key {cfg.input_key!r}", flags=["--prompt-data", "--input-key"]
                )
            prompt = row[cfg.input_key]
            if not isinstance(prompt, str | list) or not prompt:
                raise ConfigError(
                    f"{where}: empty or non-text prompt", flags=["--prompt-data", "--input-key"]
                )
            if cfg.apply_chat_template and isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            label = row.get(cfg.label_key) if cfg.label_key else None
            meta = row.get(cfg.metadata_key) if cfg.metadata_key else None
            records.append(PromptRecord(prompt, label, meta if isinstance(meta, dict) else None))
    if not records:
        raise ConfigError(f"prompt data file {str(path)!r} holds no prompts", flags=["--prompt-data"])
    return records


class DataSource:
    """Yields prompt groups: recycled ones first (FIFO), then the next prompt of the current epoch.

    `state_dict()` captures the epoch, the position in it and the recycle queue, so a resumed run
    continues exactly where the checkpoint left off.
    """

    def __init__(
        self, records: Sequence[PromptRecord], *, n_samples_per_prompt: int, seed: int, shuffle: bool
    ):
        if not records:
            raise ValueError("a DataSource needs at least one prompt")
        self._records = list(records)
        self._n = n_samples_per_prompt
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._pos = 0
        self._order = self._epoch_order(0)
        self._recycled: deque[Group] = deque()

    @property
    def dataset_size(self) -> int:
        return len(self._records)

    @property
    def epoch(self) -> int:
        return self._epoch

    def location(self, group_index: int) -> tuple[int, int]:
        """(epoch, prompt_index) of a group index."""
        return divmod(group_index, len(self._records))

    def next_group(self) -> Group:
        """A fresh list of `n_samples_per_prompt` PENDING samples (recycled groups come first)."""
        if self._recycled:
            return self._recycled.popleft()
        if self._pos == len(self._order):
            self._epoch += 1
            self._pos = 0
            self._order = self._epoch_order(self._epoch)
        prompt_index = self._order[self._pos]
        self._pos += 1
        return self.make_group(self._epoch * len(self._records) + prompt_index)

    def make_group(self, group_index: int) -> Group:
        record = self._records[group_index % len(self._records)]
        return [
            Sample(
                group_index=group_index,
                index=group_index * self._n + k,
                prompt=record.prompt,
                label=record.label,
                metadata=dict(record.metadata or {}),
            )
            for k in range(self._n)
        ]

    def recycle(self, prompt_group: Group) -> None:
        """Serve this group again before any fresh prompt (same group_index)."""
        for s in prompt_group:
            s.reset_for_retry()
        self._recycled.append(prompt_group)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "pos": self._pos,
            "recycled": [g[0].group_index for g in self._recycled],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch = int(state["epoch"])
        self._pos = int(state["pos"])
        self._order = self._epoch_order(self._epoch)
        self._recycled = deque(self.make_group(int(i)) for i in state["recycled"])

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._records)))
        if self._shuffle:
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
        return order
