"""`benchmarks.group_prefill`: it runs both thresholds and reports them (a smoke test; asserts no figure)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]


def test_it_times_both_thresholds_and_prints_their_ratio() -> None:
    args = ["--groups", "4", "--n", "4", "--repeats", "1"]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.group_prefill", *args], capture_output=True, text=True, check=True
    ).stdout
    assert "threshold sglang (32)" in out and "threshold embedded (2)" in out
    assert "ratio embedded / sglang:" in out
