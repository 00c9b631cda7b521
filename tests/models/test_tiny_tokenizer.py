"""The tiny model's tokenizer: a character outside the alphabet is `<unk>`, not silently dropped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from miles_aio.models.tiny import CHAT_TOKENS, EOS_TOKEN, UNK_TOKEN, build_tiny_llama, load_tokenizer
from miles_aio.tasks.arithmetic import ALPHABET

pytestmark = pytest.mark.pure

SHAPE: dict[str, Any] = {"hidden_size": 32, "num_heads": 2, "num_kv_heads": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", alphabet=ALPHABET, **SHAPE)


def tokenizers(model_dir: Path) -> list[Any]:
    from transformers import AutoTokenizer

    return [AutoTokenizer.from_pretrained(model_dir), load_tokenizer(model_dir)]  # as recipes, as tasks


def test_unknown_characters_encode_to_unk_one_each(model_dir: Path) -> None:
    for tok in tokenizers(model_dir):
        unk = tok.unk_token_id
        assert tok.unk_token == UNK_TOKEN and unk == len(tok) - 1  # the last id
        assert tok.encode("?hint", add_special_tokens=False) == [unk] * 5
        assert tok.encode("1?2", add_special_tokens=False) == [tok.convert_tokens_to_ids("1"), unk, 5]
        assert tok.decode(tok.encode("?1")) == "<unk>1"  # visible where it was
        assert tok.decode(tok.encode("?1"), skip_special_tokens=True) == "1"


def test_known_ids_are_unchanged(model_dir: Path) -> None:
    """<pad> <s> </s>, then the alphabet in order: what every checkpoint built before <unk> has."""
    tok = load_tokenizer(model_dir)
    assert tok.convert_tokens_to_ids(["<pad>", "<s>", EOS_TOKEN]) == [0, 1, 2]
    assert tok.encode(ALPHABET) == list(range(3, 3 + len(ALPHABET)))


def test_unk_follows_the_alphabet_and_the_chat_tokens_follow_unk(tmp_path: Path) -> None:
    # the chat model's vocabulary extends the default one (tests/engine/test_openai.py checks the weights)
    tok = load_tokenizer(build_tiny_llama(tmp_path / "chat", alphabet=ALPHABET, chat_tokens=True, **SHAPE))
    unk = 3 + len(ALPHABET)
    assert tok.unk_token_id == unk
    assert tok.convert_tokens_to_ids(list(CHAT_TOKENS)) == list(range(unk + 1, unk + 1 + len(CHAT_TOKENS)))
    assert len(tok) == unk + 1 + len(CHAT_TOKENS)


def test_the_model_has_a_row_for_unk(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.config.vocab_size == len(tok)
    logits = model(input_ids=torch.tensor([tok.encode("12?=")])).logits
    assert logits.shape == (1, 4, len(tok)) and torch.isfinite(logits).all()


def test_a_prompt_with_unknown_characters_warns_once(model_dir: Path) -> None:
    """The runtime's prompt encoding says which characters became <unk> (once per tokenizer, not per
    prompt): a character-level vocabulary would otherwise lose a prompt's meaning without a word."""
    from structlog.testing import capture_logs

    from miles_aio.data.source import encode_prompt

    tok = load_tokenizer(model_dir)
    with capture_logs() as logs:
        assert encode_prompt(tok, "12+34=") == tok.encode("12+34=")  # all known: no warning
        ids = encode_prompt(tok, "what is 1?")
        encode_prompt(tok, "and 2?")
    assert ids.count(tok.unk_token_id) == len("what is ?")
    warned = [e for e in logs if "does not know" in e["event"]]
    assert len(warned) == 1 and warned[0]["characters"] == " ?ahistw" and warned[0]["log_level"] == "warning"
