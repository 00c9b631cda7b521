"""Bad prompt data: every kind of broken line is an error naming the file and line (exit 2 from the CLI),
or, with --skip-invalid-prompts, skipped and counted; over-long prompts (--rollout-max-prompt-len) are
skipped when first drawn and counted, also in a whole controller run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from miles_aio.config import DataConfig
from miles_aio.controller import Controller
from miles_aio.data import DataSource, PromptRecord, read_prompt_jsonl
from miles_aio.data.source import SKIP_REASONS, PromptRecords, encode_prompt, prompt_problem
from miles_aio.errors import ConfigError
from miles_aio.plugins import resolve_plugins
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency
from tests.helpers import make_config

pytestmark = pytest.mark.vtime

GOOD = b'{"prompt": "fine", "label": 1}\n'
BAD_LINES: list[tuple[str, bytes, str, str]] = [
    # (case, line, reason, message)
    ("missing_key", b'{"text": "b"}\n', "missing_key", "missing key 'prompt'"),
    ("empty_prompt", b'{"prompt": ""}\n', "bad_prompt", "empty or non-text prompt"),
    ("blank_prompt", b'{"prompt": "  \\n "}\n', "bad_prompt", "only whitespace"),
    ("number_prompt", b'{"prompt": 3}\n', "bad_prompt", "empty or non-text prompt"),
    ("null_prompt", b'{"prompt": null}\n', "bad_prompt", "empty or non-text prompt"),
    ("empty_chat", b'{"prompt": []}\n', "bad_prompt", "empty or non-text prompt"),
    ("bad_chat", b'{"prompt": ["hi"]}\n', "bad_prompt", "not a list of messages"),
    ("not_utf8", b'{"prompt": "\xff\xfe"}\n', "not_utf8", "not UTF-8"),
    ("truncated_json", b'{"prompt": "a"\n', "invalid_json", "invalid JSON"),
    ("not_json", b"prompt: a\n", "invalid_json", "invalid JSON"),
    ("json_array", b'["a"]\n', "invalid_json", "expected a JSON object, got list"),
    ("json_string", b'"a"\n', "invalid_json", "expected a JSON object, got str"),
    ("nested_deep", b"[" * 100_000 + b"]" * 100_000 + b"\n", "invalid_json", "invalid JSON"),
]


@pytest.mark.parametrize(("case", "line", "reason", "message"), BAD_LINES, ids=[c[0] for c in BAD_LINES])
def test_each_bad_line_is_an_error_naming_file_and_line(
    tmp_path: Path, case: str, line: bytes, reason: str, message: str
) -> None:
    p = tmp_path / "prompts.jsonl"
    p.write_bytes(GOOD + b"\n" + line + GOOD)  # a blank line is skipped silently and still counted
    with pytest.raises(ConfigError, match=r"prompts\.jsonl:3: ") as e:
        read_prompt_jsonl(p, DataConfig())
    assert message in str(e.value)
    assert "--skip-invalid-prompts" in str(e.value)
    assert e.value.flags[0] == "--prompt-data"
    assert ("--input-key" in e.value.flags) == (reason in ("missing_key", "bad_prompt"))


def test_skip_invalid_prompts_keeps_the_good_lines_and_counts_the_rest_by_reason(tmp_path: Path) -> None:
    p = tmp_path / "prompts.jsonl"
    p.write_bytes(GOOD + b"".join(line for _, line, _, _ in BAD_LINES) + GOOD)
    records = read_prompt_jsonl(p, DataConfig(skip_invalid_prompts=True))
    assert isinstance(records, PromptRecords)
    assert [(r.prompt, r.label, r.where) for r in records] == [
        ("fine", 1, f"{p}:1"),
        ("fine", 1, f"{p}:{len(BAD_LINES) + 2}"),
    ]
    expected: dict[str, int] = {}
    for _, _, reason, _ in BAD_LINES:
        expected[reason] = expected.get(reason, 0) + 1
    assert dict(records.skipped) == expected
    assert set(expected) <= set(SKIP_REASONS)
    source = DataSource(records, n_samples_per_prompt=2, seed=0, shuffle=False)
    assert source.get_metrics() == {f"rollout/skipped_prompts/{r}": float(c) for r, c in expected.items()}
    assert source.dataset_size == 2


def test_a_file_of_only_bad_lines_still_fails_when_skipping(tmp_path: Path) -> None:
    p = tmp_path / "prompts.jsonl"
    p.write_bytes(b'{"text": 1}\n\xff\n')
    with pytest.raises(ConfigError, match="holds no prompts"):
        read_prompt_jsonl(p, DataConfig(skip_invalid_prompts=True))


def test_prompt_problem_is_a_pure_decision() -> None:
    cfg = DataConfig(input_key="q")
    assert prompt_problem({"q": "x"}, cfg) is None
    assert prompt_problem({"q": [{"role": "user", "content": "x"}]}, cfg) is None
    assert prompt_problem({"prompt": "x"}, cfg) == ("missing_key", "missing key 'q'")
    assert prompt_problem(None, cfg) == ("invalid_json", "expected a JSON object, got NoneType")
    assert prompt_problem({"q": [{"content": "x"}]}, cfg) is not None


class ChatTokenizer(FakeTokenizer):
    """A FAKE tokenizer with a chat template: `<role>content` bytes plus one generation-prompt token."""

    def apply_chat_template(self, messages: list[dict[str, Any]], **_: Any) -> dict[str, list[int]]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return {"input_ids": [*self.encode(text), 1]}


def test_encode_prompt_handles_text_and_chat() -> None:
    tok = ChatTokenizer()
    assert encode_prompt(tok, "ab") == [97, 98]
    assert len(encode_prompt(tok, [{"role": "user", "content": "ab"}])) == len("<user>ab") + 1
    with pytest.raises(RuntimeError, match="apply_chat_template"):
        encode_prompt(FakeTokenizer(), [{"role": "user", "content": "ab"}])


def long_and_short(n_short: int = 4, n_long: int = 3) -> list[PromptRecord]:
    short = [PromptRecord(f"s{i}", where=f"f.jsonl:{i + 1}") for i in range(n_short)]  # 2 tokens
    long = [PromptRecord("x" * 50 + str(i), where=f"f.jsonl:{n_short + i + 1}") for i in range(n_long)]
    return [r for pair in zip(short, long, strict=False) for r in pair] + short[len(long) :]


def test_over_long_prompts_are_skipped_once_counted_once_and_never_served() -> None:
    records = long_and_short()
    source = DataSource(records, n_samples_per_prompt=2, seed=3, shuffle=True)
    assert source.bind_tokenizer(FakeTokenizer(), 10) is source
    served = [source.next_group() for _ in range(4 * 5)]  # five epochs of the four short prompts
    assert all(len(g) == 2 for g in served)
    assert {len(str(records[g[0].group_index % 7].prompt)) for g in served} == {2}
    epochs = [source.location(g[0].group_index)[0] for g in served]
    assert epochs == sorted(epochs) and epochs[-1] == 4  # group ids still encode epoch and prompt
    assert source.get_metrics() == {"rollout/skipped_prompts/too_long": 3.0}


def test_chat_prompts_are_measured_through_the_chat_template() -> None:
    chat = [{"role": "user", "content": "hi"}]  # 9 tokens with the template
    source = DataSource(
        [PromptRecord(chat), PromptRecord("a" * 8)], n_samples_per_prompt=1, seed=0, shuffle=False
    )
    source.bind_tokenizer(ChatTokenizer(), 8)
    assert [source.next_group()[0].group_index for _ in range(2)] == [1, 3]
    assert source.get_metrics() == {"rollout/skipped_prompts/too_long": 1.0}


def test_every_prompt_too_long_is_a_config_error_not_a_hang() -> None:
    source = DataSource([PromptRecord("x" * 20)] * 3, n_samples_per_prompt=1, seed=0, shuffle=False)
    source.bind_tokenizer(FakeTokenizer(), 5)
    with pytest.raises(ConfigError, match="--rollout-max-prompt-len: every prompt is longer than 5"):
        source.next_group()
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        source.bind_tokenizer(None, 5)
    assert source.bind_tokenizer(None, None) is source  # no limit: no tokenizer needed


def test_max_prompt_len_must_leave_room_in_the_context() -> None:
    with pytest.raises(ConfigError, match="--rollout-max-prompt-len, --rollout-max-context-len"):
        make_config(rollout_max_prompt_len=64, rollout_max_context_len=64)
    with pytest.raises(ConfigError, match="--rollout-max-prompt-len"):
        make_config(rollout_max_prompt_len=0)
    assert make_config(rollout_max_prompt_len=63, rollout_max_context_len=64).rollout.rollout_max_prompt_len


@pytest.mark.timeout(30)
def test_a_controller_run_never_trains_an_over_long_prompt_and_logs_the_count(
    vrun: Any, tmp_path: Path
) -> None:
    records = long_and_short(n_short=6, n_long=4)
    cfg = make_config(tmp_path / "run", num_rollout=4, rollout_batch_size=2, rollout_max_prompt_len=10)
    trainer = FakeTrainer(step_time_s=1.0)
    controller = Controller(
        cfg,
        engine=FakeLatencyEngine(LogNormalLatency(1.0, 5.0), tokens_per_s=20.0, seed=1),
        trainer=trainer,
        source=DataSource(records, n_samples_per_prompt=2, seed=0, shuffle=True),
        plugins=resolve_plugins(cfg),
        tokenizer=FakeTokenizer(),
    )
    summary = vrun(controller.run())
    assert summary.steps == 4
    trained = [s for _, batch in trainer.steps for g in batch for s in g]
    assert trained and all(len(str(s.prompt)) == 2 for s in trained)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["rollout/skipped_prompts/too_long"] == 4.0


def test_the_cli_exits_2_naming_file_and_line_or_skips_with_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from miles_aio.recipe import main
    from recipes.quickstart import RECIPE

    p = tmp_path / "prompts.jsonl"
    p.write_bytes(GOOD + b'{"prompt": ""}\n')
    argv = ["--prompt-data", str(p), "--dry-run", "--run-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as e:
        main(RECIPE, argv)
    assert e.value.code == 2
    assert f"{p}:2: empty or non-text prompt" in capsys.readouterr().err
    assert main(RECIPE, [*argv, "--skip-invalid-prompts"]) is None
    out = capsys.readouterr().out  # the skip warnings, then the plan
    assert "skipped invalid prompt line" in out
    assert json.loads(out[out.index("{\n") :])["prompts"] == 1
