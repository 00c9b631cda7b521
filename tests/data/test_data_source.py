from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_aio.config import DataConfig
from miles_aio.data import DataSource, PromptRecord, read_prompt_jsonl
from miles_aio.errors import ConfigError

pytestmark = pytest.mark.pure


def source(n: int = 5, *, shuffle: bool = True, seed: int = 1) -> DataSource:
    return DataSource(
        [PromptRecord(f"p{i}") for i in range(n)], n_samples_per_prompt=3, seed=seed, shuffle=shuffle
    )


def test_each_epoch_is_a_seeded_permutation_and_group_ids_encode_epoch_and_prompt() -> None:
    a, b = source(), source()
    ids_a = [a.next_group()[0].group_index for _ in range(10)]
    ids_b = [b.next_group()[0].group_index for _ in range(10)]
    assert ids_a == ids_b  # deterministic
    assert sorted(i % 5 for i in ids_a[:5]) == list(range(5))
    assert all(i // 5 == 1 for i in ids_a[5:])  # second epoch
    assert [i % 5 for i in ids_a[:5]] != [i % 5 for i in ids_a[5:]]  # reshuffled
    assert a.location(ids_a[7]) == (1, ids_a[7] % 5)


def test_groups_have_n_samples_with_stable_indices() -> None:
    g = source(shuffle=False).next_group()
    assert [s.index for s in g] == [0, 1, 2]
    assert {s.group_index for s in g} == {0}


def test_retry_serves_recycled_prompts_before_fresh_ones() -> None:
    s = source(shuffle=False)
    first, second = s.next_group(), s.next_group()
    first[0].response = "garbage"
    s.recycle(second)
    s.recycle(first)
    assert s.next_group()[0].group_index == 1
    again = s.next_group()
    assert again[0].group_index == 0 and again[0].response == ""
    assert s.next_group()[0].group_index == 2


def test_state_dict_resumes_the_same_stream() -> None:
    s = source()
    for _ in range(7):
        s.next_group()
    s.recycle(source().make_group(3))
    state = json.loads(json.dumps(s.state_dict()))
    t = source()
    t.load_state_dict(state)
    assert [t.next_group()[0].group_index for _ in range(6)] == [
        s.next_group()[0].group_index for _ in range(6)
    ]


def test_jsonl_errors_name_file_and_line(tmp_path: Path) -> None:
    cfg = DataConfig()
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "label": 1}\n\n{"text": "b"}\n')
    with pytest.raises(ConfigError, match=r"d\.jsonl:3: missing key 'prompt'") as e:
        read_prompt_jsonl(p, cfg)
    assert "--prompt-data" in e.value.flags
    p.write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(ConfigError, match=r"d\.jsonl:1: not UTF-8"):
        read_prompt_jsonl(p, cfg)
    p.write_text('{"prompt": ""}\n')
    with pytest.raises(ConfigError, match="empty"):
        read_prompt_jsonl(p, cfg)
    with pytest.raises(ConfigError, match="does not exist"):
        read_prompt_jsonl(tmp_path / "missing.jsonl", cfg)
    p.write_text('{"prompt": "a", "label": 1, "meta": {"k": 2}}\n')
    [rec] = read_prompt_jsonl(p, DataConfig(metadata_key="meta"))
    assert (rec.prompt, rec.label, rec.metadata) == ("a", 1, {"k": 2})
