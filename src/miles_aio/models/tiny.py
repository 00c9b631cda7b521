"""Build a tiny random-init Llama with a character-level tokenizer, fully offline, in about a second.

The result is an ordinary Hugging Face model directory, so every consumer loads it the same way it loads
a real checkpoint: `transformers.AutoModelForCausalLM` / `AutoTokenizer`, SGLang, and the embedded CPU
engine (`miles_aio.engine`)::

    out_dir/
      config.json               LlamaForCausalLM (`rope_theta` and `rope_parameters`: old and new readers)
      generation_config.json    bos/eos/pad ids
      model.safetensors         float32, HF Llama tensor names
      tokenizer.json            one token per character of `alphabet`, plus <pad> <s> </s> and <unk>
      tokenizer_config.json, special_tokens_map.json   (with the chat template)

Token ids: `<pad>`=0, `<s>`=1, `</s>`=2 (the eos), then the characters of `alphabet` in order of first
appearance, then `<unk>` (the chat tokens, when there are any, come after it). Encoding adds no special
tokens; a character outside the alphabet encodes to `<unk>`, one per character, as a Hugging Face
tokenizer with an unknown token does (`encode("?1") == [unk_token_id, id("1")]`), so nothing a prompt
says is silently dropped and the response text shows `<unk>` where it was. A character-level vocabulary
keeps the model small and makes toy tasks readable, since every sampled token is one visible character.

Chat: by default the chat template only concatenates the messages' contents (the ids and weights above
stay exactly what they always were). With `chat_tokens=True` the vocabulary gains `CHAT_TOKENS`,
appended after `<unk>` (so the chat model's vocabulary extends the default one): one special token per
role (`<|system|>`, `<|user|>`, `<|assistant|>`, `<|tool|>`) and the end-of-turn `<|end|>`, which
generation_config lists as a second eos, so a reply stops there. The template then renders `<s>`, a
system turn listing `tools` (as JSON) when given, each message as `<|role|>content<|end|>`, and
`<|assistant|>` for `add_generation_prompt`; role markers are single tokens, so any alphabet can chat.
The weights are the default model's, plus embedding (and lm_head) rows for the new ids drawn from a
generator of their own; so is the row of `<unk>`, so adding it changed no other value.

Nothing here imports transformers (it costs seconds); `load_tokenizer` does, lazily.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "BOS_TOKEN",
    "CHAT_TOKENS",
    "END_OF_TURN_TOKEN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "UNK_TOKEN",
    "Init",
    "build_tiny_llama",
    "load_tokenizer",
]

PAD_TOKEN: Final = "<pad>"
BOS_TOKEN: Final = "<s>"
EOS_TOKEN: Final = "</s>"
SPECIAL_TOKENS: Final = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
UNK_TOKEN: Final = "<unk>"
"""What a character outside the alphabet encodes to; the last id of the vocabulary."""
_UNK_SEED_OFFSET: Final = 0x0BAD_C4A7
"""The row of UNK_TOKEN comes from its own generator, seeded `seed + this`."""
_INITIALIZER_RANGE: Final = 0.02
"""Std of the normal init of every matrix, as transformers' `LlamaConfig.initializer_range` default."""
Init = Literal["transformers", "torch"]
"""How `build_tiny_llama` draws the weights. `transformers`: every matrix ~ N(0, 0.02), as transformers
inits a Llama. `torch`: what torch.nn's modules draw when they are built: every linear weight
~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (about 2.5x larger at hidden 128) and the token embedding ~ N(0, 1).
Norm weights are 1 in both. On the tiny models the recipes warm-start, `torch` is what makes RL tolerate a
real learning rate: one Adam step at lr 3e-4 moves the policy by a KL of ~0.06 per token instead of ~0.3
(docs/learning.md, `benchmarks.bare_grpo --ablation`)."""
# The default chat template: the alphabet is arbitrary, so role markers could not be encoded anyway.
_CHAT_TEMPLATE: Final = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
END_OF_TURN_TOKEN: Final = "<|end|>"
CHAT_TOKENS: Final = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", END_OF_TURN_TOKEN)
"""Added by `chat_tokens=True`, after the alphabet and `<unk>`, in this order."""
_CHAT_SEED_OFFSET: Final = 0x5EED_C4A7
"""The rows of CHAT_TOKENS come from their own generator, seeded `seed + this`."""
# With chat_tokens: role markers are single special tokens; unknown roles are refused.
_ROLE_CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>{% for tool in tools %}{{ tool | tojson }}{% endfor %}<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{ message['tool_calls'] | tojson }}"
    "{% endif %}"
    "<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_llama(
    out_dir: Path,
    *,
    alphabet: str,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
    init: Init = "transformers",
    embedding_std: float | None = None,
    seed: int = 0,
    chat_tokens: bool = False,
) -> Path:
    """Write a random-init `LlamaForCausalLM` with a char-level tokenizer to `out_dir`, then return it.

    The same arguments give byte-identical weights (the init uses its own seeded `torch.Generator`).
    `intermediate_size` defaults to 2 × `hidden_size` (rounded up to a multiple of 8).
    `init`: how the weights are drawn (see `Init`); `embedding_std` overrides the std of the token
    embedding's normal init (default: the init's, 0.02 or 1.0; `benchmarks.bare_grpo --ablation` varies it).
    `chat_tokens`: add `CHAT_TOKENS` and a chat template with role markers (see the module docstring);
    every other id and tensor value stays what it is without it.
    """
    chars = list(dict.fromkeys(alphabet))  # dedupe, keep first-appearance order
    if not chars:
        raise ValueError("alphabet must contain at least one character")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"need hidden_size % num_heads == 0 and num_heads % num_kv_heads == 0, got "
            f"hidden_size={hidden_size}, num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )
    head_dim = hidden_size // num_heads
    if head_dim % 2:
        raise ValueError(f"head_dim = hidden_size / num_heads must be even for RoPE, got {head_dim}")
    inter = intermediate_size if intermediate_size is not None else 8 * math.ceil(2 * hidden_size / 8)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    base_vocab_size = len(vocab)
    vocab.setdefault(UNK_TOKEN, len(vocab))  # before the chat tokens: the chat vocabulary extends this one
    unk_vocab_size = len(vocab)
    if chat_tokens:
        for tok in CHAT_TOKENS:
            vocab.setdefault(tok, len(vocab))
    vocab_size = len(vocab)
    pad_id, bos_id, eos_id = (vocab[t] for t in SPECIAL_TOKENS)

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": inter,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": _INITIALIZER_RANGE,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    _write_json(out_dir / "config.json", config)
    eos_ids: int | list[int] = [eos_id, vocab[END_OF_TURN_TOKEN]] if chat_tokens else eos_id
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": eos_ids, "pad_token_id": pad_id},
    )
    emb_std = embedding_std if embedding_std is not None else (1.0 if init == "torch" else _INITIALIZER_RANGE)
    weights = _init_weights(
        config | {"vocab_size": base_vocab_size}, seed=seed, init=init, embedding_std=emb_std
    )
    grow = functools.partial(_append_rows, init=init, embedding_std=emb_std)
    weights = grow(weights, unk_vocab_size - base_vocab_size, seed=seed + _UNK_SEED_OFFSET)
    if chat_tokens:
        weights = grow(weights, vocab_size - unk_vocab_size, seed=seed + _CHAT_SEED_OFFSET)
    save_file(
        weights,
        str(out_dir / "model.safetensors"),
        metadata={"format": "pt"},  # transformers refuses safetensors files without this marker
    )
    _write_tokenizer(
        out_dir,
        vocab=vocab,
        model_max_length=max_position_embeddings,
        special_tokens=SPECIAL_TOKENS + (UNK_TOKEN,) + (CHAT_TOKENS if chat_tokens else ()),
        chat_template=_ROLE_CHAT_TEMPLATE if chat_tokens else _CHAT_TEMPLATE,
    )
    return out_dir


def load_tokenizer(model_dir: Path | str) -> PreTrainedTokenizerFast:
    """The model dir's tokenizer as a transformers fast tokenizer (imports transformers, ~1 s)."""
    from transformers import PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    special = json.loads((model_dir / "special_tokens_map.json").read_text())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers ships untyped
        tokenizer_file=str(model_dir / "tokenizer.json"),
        bos_token=special["bos_token"],
        eos_token=special["eos_token"],
        pad_token=special["pad_token"],
        unk_token=special.get("unk_token"),  # None in a model written before <unk> existed
        clean_up_tokenization_spaces=False,
        chat_template=config.get("chat_template", _CHAT_TEMPLATE),
    )


def _matrix(rows: int, cols: int, *, gen: torch.Generator, init: Init) -> torch.Tensor:
    """One linear weight (`cols` = fan_in), drawn as `init` says."""
    if init == "torch":  # nn.Linear's kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        return (torch.rand(rows, cols, generator=gen) * 2 - 1) / math.sqrt(cols)
    return torch.randn(rows, cols, generator=gen) * _INITIALIZER_RANGE


def _init_weights(
    config: dict[str, Any], *, seed: int, init: Init, embedding_std: float
) -> dict[str, torch.Tensor]:
    """HF Llama tensor names → float32 tensors: matrices as `init` says, norms = 1, the token embedding
    ~ N(0, embedding_std)."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd, nh, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]

    def normal(rows: int, cols: int) -> torch.Tensor:
        return _matrix(rows, cols, gen=gen, init=init)

    embed = torch.randn(v, h, generator=gen) * embedding_std
    weights: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(nh * hd, h),
            p + "self_attn.k_proj.weight": normal(nkv * hd, h),
            p + "self_attn.v_proj.weight": normal(nkv * hd, h),
            p + "self_attn.o_proj.weight": normal(h, nh * hd),
            p + "mlp.gate_proj.weight": normal(inter, h),
            p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    weights["model.norm.weight"] = torch.ones(h)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = normal(v, h)
    return weights


def _append_rows(
    weights: dict[str, torch.Tensor], n: int, *, seed: int, init: Init, embedding_std: float
) -> dict[str, torch.Tensor]:
    """Grow the vocab-sized tensors by `n` rows from their own generator (others untouched): embedding
    rows ~ N(0, embedding_std), lm_head rows as `init` draws a linear weight."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(weights)
    embed = out["model.embed_tokens.weight"]
    out["model.embed_tokens.weight"] = torch.cat(
        [embed, torch.randn(n, embed.shape[1], generator=gen) * embedding_std]
    )
    if "lm_head.weight" in out:
        head = out["lm_head.weight"]
        out["lm_head.weight"] = torch.cat([head, _matrix(n, head.shape[1], gen=gen, init=init)])
    return out


def _write_tokenizer(
    out_dir: Path,
    *,
    vocab: dict[str, int],
    model_max_length: int,
    special_tokens: tuple[str, ...],
    chat_template: str,
) -> None:
    # BPE with no merges and no pre-tokenizer splits the whole input into characters and looks each one
    # up (a character it does not know becomes <unk>); the Fuse decoder joins tokens with "" (the default
    # decoder would insert spaces). Special tokens are matched in the text before that split, so a
    # rendered chat's markers encode to their own ids.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN, fuse_unk=False))
    tok.add_special_tokens(list(special_tokens))
    tok.decoder = decoders.Fuse()
    tok.save(str(out_dir / "tokenizer.json"))
    special_map = {
        "pad_token": PAD_TOKEN,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
    }
    _write_json(out_dir / "special_tokens_map.json", special_map)
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special_map,
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False,
            "add_bos_token": False,
            "add_eos_token": False,
            "chat_template": chat_template,
        },
    )


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
