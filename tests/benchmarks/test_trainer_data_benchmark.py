"""`benchmarks.trainer_data`: the real actor against simulated ranks (a smoke test of the benchmark; what it
asserts is the data path's arithmetic, never a time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.procs, pytest.mark.timeout(180)]


def test_each_shard_goes_once_to_its_tp_group(tmp_path: Path) -> None:
    out = tmp_path / "td.json"
    samples, prompt, response = 16, 64, 128
    args = [
        "--layouts",
        "4x1,4x2",
        "--send",
        "source,every",
        "--samples",
        str(samples),
        "--n",
        "4",
        "--prompt-len",
        str(prompt),
    ]
    args += ["--response-len", str(response), "--steps", "2", "--output", str(out)]
    printed = subprocess.run(
        [sys.executable, "-m", "benchmarks.trainer_data", *args], capture_output=True, text=True, check=True
    ).stdout
    assert "ranks" in printed and "ctl CPU s" in printed
    # Per sample: int64 ids of prompt + response, float32 mask and log-probs per response token, and four
    # 8-byte scalars (length, response length, advantage, optimizer step).
    per_sample = 8 * (prompt + response) + 8 * response + 4 * 8
    runs = {(r["ranks"], r["tp"], r["send"]): r for r in json.loads(out.read_text())["layouts"]}
    assert set(runs) == {(4, 1, "source"), (4, 2, "source"), (4, 2, "every")}  # 4x1 every = 4x1 source
    assert runs[(4, 1, "source")]["bytes"] == samples * per_sample  # dp 4: the batch once, split four ways
    # dp 2: the runtime sends each shard once, to its TP group's first rank, ...
    assert runs[(4, 2, "source")]["bytes"] == samples * per_sample
    # ... where sending every rank its own copy would send each shard to both TP peers
    assert runs[(4, 2, "every")]["bytes"] == 2 * samples * per_sample
    for r in runs.values():
        assert r["bytes_per_rank"] * r["ranks"] == r["bytes"]
        assert len(r["steps"]) == 2 and 0 < r["first_rank_s"] <= r["last_rank_s"] <= r["step_s"]
