"""`python -m benchmarks.engine --quick`: a real (tiny) engine-vs-HF run writes every cell to its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.engine import left_pad, mixed_lengths
from benchmarks.report import engine_section

ROOT = Path(__file__).resolve().parents[2]


def test_mixed_lengths_are_long_tailed_and_deterministic() -> None:
    lengths = mixed_lengths(4096, p50=24, p99=240, cap=256, seed=0)
    assert lengths == mixed_lengths(4096, p50=24, p99=240, cap=256, seed=0)
    ranked = sorted(lengths)
    p50, p99 = ranked[len(ranked) // 2], ranked[int(len(ranked) * 0.99)]
    assert 20 <= p50 <= 28 and 200 <= p99 <= 256 and min(lengths) >= 1 and max(lengths) <= 256


def test_left_pad_right_aligns_prompts() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_quick_run_writes_every_cell(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", "--quick", "--output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(out.read_text())
    cells = d["cells"]
    assert {(c["mode"], c["batch"]) for c in cells} == {(m, b) for m in ("equal", "mixed") for b in (1, 4)}
    for c in cells:
        assert c["engine_tokens_per_s"] > 0 and c["hf_tokens_per_s"] > 0
        assert abs(c["ratio"] - c["engine_tokens_per_s"] / c["hf_tokens_per_s"]) < 1e-9
        assert len(c["engine_wall_s"]) == len(c["hf_wall_s"]) == c["repeats"]
        if c["mode"] == "equal":
            assert c["useful_tokens"] == c["hf_computed_tokens"] == c["batch"] * d["new_tokens"]
        else:
            # waves x B requests, at most B in flight; HF: one static batch of B per wave, to its longest
            assert c["waves"] == d["mixed"]["waves"] == 2
            assert c["useful_tokens"] <= c["hf_computed_tokens"] <= c["waves"] * c["batch"] * c["longest"]
    text = "\n".join(engine_section(d))
    assert text.count("| 8 | 4 |") == 2  # both modes' tables, prompt 8, batch 4
