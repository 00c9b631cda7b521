"""`benchmarks.learning` reads a run's curve and throughput right; its bare GRPO baseline runs the loop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import bare_grpo, learning
from benchmarks.learning import Result, arm_flags, read_run, summarize
from miles_aio.models.tiny import build_tiny_llama
from miles_aio.tasks.arithmetic import ALPHABET

pytestmark = pytest.mark.pure


def _jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_runs_curve_is_placed_at_the_steps_it_evaluated_and_their_rl_seconds(tmp_path: Path) -> None:
    _jsonl(
        tmp_path / "metrics.jsonl",
        [{"step": s, "perf/step_time_s": 0.5, "rollout/samples": 256.0} for s in range(1, 5)],
    )
    _jsonl(
        tmp_path / "eval_points.jsonl",
        [
            {"step": 0, "eval/step": 0, "eval/held_out/accuracy": 0.3},
            {"step": 3, "eval/step": 2, "eval/held_out/accuracy": 0.5},  # landed one step late
            {"step": 4, "eval/step": 4, "eval/held_out/accuracy": 0.6},
        ],
    )
    r = read_run(tmp_path, "async", 0)
    assert r.curve == [(0, 0.0, 0.3), (2, 1.0, 0.5), (4, 2.0, 0.6)]
    assert r.rl_seconds == 2.0 and r.completions_per_s == 512.0
    assert r.at(3) == 0.5 and r.at(5) is None and r.final == 0.6


def test_the_summary_states_the_throughput_ratio_per_seed_and_the_failures() -> None:
    curve = [(0, 0.0, 0.3), (100, 10.0, 0.9)]
    results = [
        Result("async", 0, curve, completions_per_s=900.0, rl_seconds=10.0),
        Result("bare", 0, curve, completions_per_s=1000.0, rl_seconds=9.0),
        Result("on_policy", 0, error="exit 1: see x.log"),
    ]
    text = summarize(results, ["async", "on_policy", "bare"], [0])
    assert "| async | 0 | 30.0% | 90.0% | 10 | 900 |" in text  # step 50, final: no mark repeats the final
    assert "bare loop's, same seed: 0.90×" in text and "on_policy seed 0 failed: exit 1" in text
    assert "≥ 90%, seconds of RL: async seed 0: step 100 (10 s); bare seed 0: step 100 (10 s)" in text
    short = Result("bare", 1, [(0, 0.0, 0.3), (50, 5.0, 0.89)], completions_per_s=1.0, rl_seconds=5.0)
    assert short.first_reached(0.9) is None
    assert "bare seed 1: never" in summarize([short], ["bare"], [1])
    assert arm_flags("on_policy") == ["--max-admission-staleness", "0"] and arm_flags("lr=3e-4")[-1] == "3e-4"
    with pytest.raises(SystemExit, match="unknown arm"):
        arm_flags("sync")


def test_two_outputs_merge_into_one_table_and_figure(tmp_path: Path) -> None:
    """`--merge A B` redraws one table and figure from two earlier runs' learning.json, nothing rerun."""
    from benchmarks.learning import main, write_outputs

    curve = [(0, 0.0, 0.4), (100, 20.0, 0.8)]
    write_outputs(
        [Result("async", 0, curve, 800.0, 20.0), Result("bare", 0, curve, 1000.0, 16.0)],
        "qs",
        tmp_path / "a",
        "0",
    )
    write_outputs([Result("on_policy", 0, curve, 700.0, 23.0)], "qs", tmp_path / "b", "0")
    out = tmp_path / "merged"
    main(["--output", str(out), "--merge", str(tmp_path / "a"), str(tmp_path / "b")])
    text = (out / "learning.md").read_text()
    assert [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ") and "%" in line] == [
        "| async", "| bare", "| on_policy",
    ]  # fmt: skip
    assert "bare loop's, same seed: 0.80×" in text and (out / "learning.png").stat().st_size > 0
    assert len(json.loads((out / "learning.json").read_text())) == 3


def test_the_bare_loop_reports_its_curve_throughput_and_per_step_kl(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "m", alphabet=ALPHABET, hidden_size=32, num_heads=2, num_kv_heads=1)
    before = {k: v.clone() for k, v in _weights(model).items()}
    out = bare_grpo.run(
        model, steps=3, lr=1e-2, prompts_per_step=4, n=4, eval_interval=2, kl_steps=2, threads=1
    )
    assert [p["step"] for p in out["curve"]] == [0, 2, 3]
    assert len(out["kl_per_token"]) == 2 and all(k >= 0.0 for k in out["kl_per_token"])
    assert out["completions_per_s"] > 0 and out["rl_seconds"] > 0
    after = _weights(model)  # the baseline never writes the model it starts from
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_the_bare_loops_zero_std_filter_samples_more_and_counts_every_completion(tmp_path: Path) -> None:
    """A random-init model answers nothing right: every group's rewards are all 0, so each step samples
    its batch 1 + MAX_FILTER_ROUNDS times, and all of those completions are counted."""
    model = build_tiny_llama(tmp_path / "m", alphabet=ALPHABET, hidden_size=32, num_heads=2, num_kv_heads=1)
    out = bare_grpo.run(
        model, steps=2, lr=1e-3, prompts_per_step=4, n=4, eval_interval=2, threads=1, filter_zero_std=True
    )
    assert out["completions"] == 2 * (1 + bare_grpo.MAX_FILTER_ROUNDS) * 4 * 4
    assert [p["train_reward"] for p in out["curve"][1:]] == [0.0]
    plain = bare_grpo.run(model, steps=2, lr=1e-3, prompts_per_step=4, n=4, eval_interval=2, threads=1)
    assert plain["completions"] == 2 * 4 * 4


def test_the_bare_loops_schedule_is_the_trainers_decoupled_lr_included() -> None:
    """The baseline trains on the trainer's lr schedule: the main and the --decoupled-lr group alike."""
    from miles_aio.trainer.config import TrainConfig

    cfg = TrainConfig(
        lr=2e-4, min_lr=2e-5, decoupled_lr=2e-3, decoupled_min_lr=2e-4, lr_warmup_iters=20,
        lr_decay_style="cosine", lr_decay_iters=700,
    )  # fmt: skip
    for step in (0, 5, 20, 21, 300, 699, 700, 900):
        for decoupled, (top, low) in ((False, (2e-4, 2e-5)), (True, (2e-3, 2e-4))):
            bare = bare_grpo.lr_at(step, top=top, low=low, warmup=20, decay_steps=700)
            assert bare == pytest.approx(cfg.lr_at(step, decoupled=decoupled), rel=1e-12), (step, decoupled)
    assert cfg.lr_at(10, decoupled=True) == pytest.approx(1e-3) and cfg.lr_at(10) == pytest.approx(1e-4)


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_the_bare_loops_cached_decoding_equals_full_recompute(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from miles_aio.models.tiny import load_tokenizer
    from miles_aio.tasks.arithmetic import greedy_solve, make_splits

    model_dir = build_tiny_llama(
        tmp_path / "m", alphabet=ALPHABET, hidden_size=32, num_heads=2, num_kv_heads=1
    )
    tok, model = load_tokenizer(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    problems = make_splits()[1][:16]
    ids = torch.tensor([tok.encode(p.prompt) for p in problems])
    with torch.no_grad():
        cached = bare_grpo._sample(model, ids, 4, 0.0)
    rows = bare_grpo._until_eos(cached, tok.eos_token_id)
    answers = [tok.decode([t for t in r if t != tok.eos_token_id]) for r in rows]
    assert answers == greedy_solve(model, tok, problems)


def test_the_bare_arm_is_refused_for_a_recipe_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    """The bare loop is single-turn arithmetic: on tool_use's model (trained to call the calculator) it
    scores near 0, a figure that would read as a result."""
    with pytest.raises(SystemExit) as e:
        learning.main(["--recipe", "tool_use", "--arms", "async,bare"])
    assert e.value.code == 2
    assert "quickstart only" in capsys.readouterr().err


def test_the_bare_arm_follows_the_runs_lr_filter_batch_and_step_flags() -> None:
    flt = learning.NONZERO_STD_FILTER
    assert learning._bare_overrides(
        ["--lr", "2e-4", "--dynamic-sampling-filter-path", flt, "--seed", "3"]
    ) == {
        "lr": "2e-4",
        "dynamic_sampling_filter_path": flt,
    }
    assert learning._bare_overrides(["--lr=3e-4", "--eval-interval", "5"]) == {"lr": "3e-4"}
    assert learning._bare_overrides(["--lr"]) == {}  # a flag without its value: the recipe run says so
    shape = ["--rollout-batch-size", "32", "--n-samples-per-prompt=8", "--num-rollout", "1000"]
    assert learning._bare_overrides([*shape, "--lr-decay-iters", "1000"]) == {
        "rollout_batch_size": "32", "n_samples_per_prompt": "8",
        "num_rollout": "1000", "lr_decay_iters": "1000",
    }  # fmt: skip


def test_the_bare_loops_sampling_log_probs_are_the_policys(tmp_path: Path) -> None:
    """What `steps_per_rollout` > 1 clips its PPO ratio against: each sampled token's log-prob, as a full
    forward of the same weights gives it (so the first update's ratio is 1)."""
    from transformers import AutoModelForCausalLM

    from miles_aio.models.tiny import load_tokenizer
    from miles_aio.tasks.arithmetic import make_splits

    model_dir = build_tiny_llama(
        tmp_path / "m", alphabet=ALPHABET, hidden_size=32, num_heads=2, num_kv_heads=1
    )
    tok, model = load_tokenizer(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([tok.encode(p.prompt) for p in make_splits()[1][:8]]).repeat_interleave(4, 0)
    logps: list[torch.Tensor] = []
    with torch.no_grad():
        gen = bare_grpo._sample(model, ids, 4, 1.0, logps)
        logits = model(input_ids=torch.cat([ids, gen], 1)).logits[:, ids.shape[1] - 1 : -1]
    full = torch.log_softmax(logits.float(), -1).gather(-1, gen.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(torch.cat(logps, 1), full, atol=1e-5)
    out = bare_grpo.run(
        model_dir, steps=2, lr=1e-3, prompts_per_step=4, n=4, eval_interval=2, threads=1, steps_per_rollout=2,
        std_normalization=False,
    )  # fmt: skip
    assert out["completions"] == 2 * 4 * 4 and [p["step"] for p in out["curve"]] == [0, 2]
