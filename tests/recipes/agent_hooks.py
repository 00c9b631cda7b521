"""Logging hooks the agent recipe's test plugs in (`--custom-rollout-log-function-path` and its eval
twin): they write what the run trained on and evaluated to JSONL files in the run directory, so the test
can check the samples themselves, not only the metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles_aio.types import Sample


def _row(s: Sample) -> dict[str, Any]:
    return {
        "status": s.status.value,
        "response_length": s.response_length,
        "loss_mask": list(s.loss_mask),
        "reward": s.reward,
        "session": s.metadata.get("session"),
        "agent": {k: s.metadata.get(k) for k in ("answer", "tool_calls", "tool_errors")},
    }


def _write(path: Path, step: int, samples: list[Sample]) -> None:
    with path.open("a", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps({"step": step, **_row(s)}) + "\n")


def log_rollout_data(rollout_id: int, args: Any, samples: list[Sample], *_: Any) -> bool:
    _write(Path(args.run_dir) / "trained_samples.jsonl", rollout_id, samples)
    return False


def log_eval_rollout_data(rollout_id: int, args: Any, data: dict[str, Any], *_: Any) -> bool:
    for name, d in data.items():
        _write(Path(args.run_dir) / f"eval_samples_{name}.jsonl", rollout_id, d["samples"])
    return False
