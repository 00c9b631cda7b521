"""A prompt the tokenizer cannot encode (a chat template rejecting its messages) follows
--skip-invalid-prompts: a ConfigError naming file:line, or skipped and counted as bad_prompt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from miles_aio.data.source import DataSource, PromptRecord, read_prompt_jsonl
from miles_aio.errors import ConfigError
from miles_aio.testing import FakeTokenizer
from tests.helpers import make_config

pytestmark = [pytest.mark.pure, pytest.mark.timeout(10)]


class StrictChatTokenizer(FakeTokenizer):
    """A FAKE tokenizer whose chat template, like a Jinja one, raises on a message without string content."""

    def apply_chat_template(self, messages: list[dict[str, Any]], **_: Any) -> list[int]:
        return [
            b for m in messages for b in self.encode(f"<{m['role']}>" + m["content"])
        ]  # KeyError/TypeError


def write(tmp_path: Path) -> Path:
    rows = [
        {"prompt": [{"role": "user", "content": "hi"}]},
        {"prompt": [{"role": "user"}]},  # no content: the template raises
        {"prompt": [{"role": "user", "content": 3}]},  # non-text content: the template raises
        {"prompt": [{"role": "user", "content": "yo"}]},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_an_unencodable_prompt_is_a_config_error_naming_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path)
    records = read_prompt_jsonl(path, make_config(prompt_data=path).data)
    source = DataSource(records, n_samples_per_prompt=1, seed=0, shuffle=False)
    source.bind_tokenizer(StrictChatTokenizer(), 100)
    assert source.next_group()[0].group_index == 0
    with pytest.raises(
        ConfigError, match=rf"--prompt-data: {path}:2: the tokenizer cannot encode .*KeyError"
    ):
        source.next_group()


def test_with_skip_invalid_prompts_it_is_skipped_and_counted(tmp_path: Path) -> None:
    path = write(tmp_path)
    records = read_prompt_jsonl(path, make_config(prompt_data=path, skip_invalid_prompts=True).data)
    source = DataSource(records, n_samples_per_prompt=1, seed=0, shuffle=False)
    source.bind_tokenizer(StrictChatTokenizer(), 100)
    served = [source.next_group()[0].group_index % 4 for _ in range(6)]
    assert served == [0, 3] * 3  # the two bad prompts are never served, in any epoch
    assert source.get_metrics() == {"rollout/skipped_prompts/bad_prompt": 2.0}


def test_every_prompt_unencodable_is_a_config_error_not_a_hang() -> None:
    records = [PromptRecord([{"role": "user"}])] * 2
    source = DataSource(records, n_samples_per_prompt=1, seed=0, shuffle=False, skip_invalid_prompts=True)
    source.bind_tokenizer(StrictChatTokenizer(), 100)
    with pytest.raises(ConfigError, match="longer than 100 tokens or cannot be encoded"):
        source.next_group()
