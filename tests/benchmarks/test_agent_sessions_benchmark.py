"""`python -m benchmarks.agent_sessions --quick`: a real (tiny) engine process, the session endpoint against
the same token ids sent straight to the engine, and the endpoint's CPU cost over an instant fake."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.agent_sessions import Plan, Run, check_tokens, ratios, user_messages
from benchmarks.report import agent_sessions_section

ROOT = Path(__file__).resolve().parents[2]


def test_plan_prompt_lengths_follow_the_session_tokens() -> None:
    plan = Plan(first_prompt=[1] * 10, appended=[[2] * 5, [3] * 7], params=[{}, {}, {}])
    assert plan.prompt_lens(max_tokens=8) == [10, 23, 38]
    run = Run(latencies_s=[0.1] * 3, prompt_tokens=[[10, 23, 38]], completion_tokens=24)
    check_tokens(run, [plan], 8, "agent")
    with pytest.raises(RuntimeError, match="prompt lengths"):
        check_tokens(Run([0.1] * 3, [[10, 23, 39]], 24), [plan], 8, "agent")
    with pytest.raises(RuntimeError, match="tokens generated"):
        check_tokens(Run([0.1] * 3, [[10, 23, 38]], 23), [plan], 8, "agent")
    assert len(user_messages(5, 3)) == 3 and user_messages(5, 3) != user_messages(6, 3)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_run_measures_every_side(tmp_path: Path) -> None:
    out = tmp_path / "agent_sessions.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.agent_sessions", "--quick", "--output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["quick"] and d["turns"] == 3
    cells = d["cells"]
    assert [c["concurrency"] for c in cells] == [1, 4]
    for c in cells:
        assert c["turns"] == c["sessions"] * d["turns"]
        assert c["sessions"] >= c["concurrency"]
        for side in ("agent", "http", "direct"):
            v = c[side]
            assert 0 < v["p50_ms"] <= v["p99_ms"] and v["turns_per_s"] > 0
        assert len(c["rounds"]) == d["repeats"] == 1
        for side in ("agent", "http"):
            # one round: the ratios are that round's
            assert c["ratios"][side] == pytest.approx(ratios(c[side], c["direct"]))
            assert c["meets_target"][side] == (
                c["ratios"][side]["latency"] <= d["targets"]["latency_ratio_max"]
                and c["ratios"][side]["throughput"] >= d["targets"]["throughput_ratio_min"]
            )
    for c in d["no_engine"]:
        # the endpoint does real work per turn (HTTP, template, tokenizer); a direct call on the fake is a
        # limiter slot; the session's own share is what the endpoint costs above the bare aiohttp floor
        assert c["endpoint_cpu_us_per_turn"] > 10 * c["direct_cpu_us_per_turn"] > 0
        assert c["floor_cpu_us_per_turn"] > 0 and c["agent_cpu_us_per_turn"] > 0
        assert c["session_cpu_us_per_turn"] == pytest.approx(
            c["endpoint_cpu_us_per_turn"] - c["floor_cpu_us_per_turn"]
        )
        assert c["turns"] >= 3 * c["concurrency"] and c["endpoint_turns_per_s"] > 0
    text = "\n".join(agent_sessions_section(d))
    assert text.count("| 4 | ") == 3 + 1  # three sides at C = 4, and the no-engine row
    assert "openai agent" in text and "bare HTTP" in text
