"""`python -m benchmarks.agent_sessions --quick`: a real (tiny) engine process, the session endpoint against
the same token ids sent straight to the engine, and the endpoint's CPU cost over an instant fake."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.agent_sessions import Plan, Run, Setup, check_tokens, paired_ratio, ratios, user_messages
from benchmarks.report import agent_sessions_section

ROOT = Path(__file__).resolve().parents[2]


def test_plan_prompt_lengths_follow_the_session_tokens() -> None:
    params = [{"max_new_tokens": 8}, {"max_new_tokens": 130}, {"max_new_tokens": 8}]
    plan = Plan(first_prompt=[1] * 10, appended=[[2] * 5, [3] * 7], params=params)
    assert plan.prompt_lens() == [10, 23, 160] and plan.completion_tokens == 146
    run = Run(latencies_s=[0.1] * 3, prompt_tokens=[[10, 23, 160]], completion_tokens=146)
    check_tokens(run, [plan], "agent")
    with pytest.raises(RuntimeError, match="prompt lengths"):
        check_tokens(Run([0.1] * 3, [[10, 23, 161]], 146), [plan], "agent")
    with pytest.raises(RuntimeError, match="tokens generated"):
        check_tokens(Run([0.1] * 3, [[10, 23, 160]], 145), [plan], "agent")
    assert len(user_messages(5, 3)) == 3 and user_messages(5, 3) != user_messages(6, 3)
    side = Run(by_turn={(0, 0): 1.0, (0, 1): 3.0, (1, 0): 2.2})
    direct = Run(by_turn={(0, 0): 1.0, (0, 1): 2.0, (1, 0): 2.0})
    assert paired_ratio(side, direct) == pytest.approx(1.1)  # the median of 1.0, 1.5, 1.1
    s = Setup(
        concurrency=[1], waves=1, min_sessions=8, turns=3, reply_tokens=(128, 256), repeats=1, cpu_turns=1
    )
    lens = [s.reply_len(i) for i in range(64)]
    assert min(lens) >= 128 and max(lens) <= 256 and len(set(lens)) > 30  # spread over the range


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
    assert d["quick"] and d["turns"] == 3 and d["reply_tokens"] == [12, 24]
    assert d["short"]["max_tokens"] == 4
    for cells in (d["cells"], d["short"]["cells"]):
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
                r = c["ratios"][side]
                assert {k: r[k] for k in ("latency", "p99", "throughput")} == pytest.approx(
                    ratios(c[side], c["direct"])
                )
                assert r["paired"] == c["rounds"][0]["ratios"][side]["paired"] > 0
                assert c["meets_target"][side] == (
                    c["ratios"][side]["latency"] <= d["targets"]["latency_ratio_max"]
                    and c["ratios"][side]["throughput"] >= d["targets"]["throughput_ratio_min"]
                )
    assert 12 <= d["cells"][0]["mean_reply_tokens"] <= 24 and d["short"]["cells"][0]["mean_reply_tokens"] == 4
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
    assert text.count("| 4 | ") == 3 + 3 + 1  # three sides at C = 4, twice (realistic, short), no-engine
    assert "openai agent" in text and "bare HTTP" in text and "Adversarial: 4-token replies" in text
