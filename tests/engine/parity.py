"""Shared pieces of the SGLang-parity suites (`test_parity*.py`, `test_long_context.py`).

The parity suites talk HTTP only, so they run unchanged against the embedded engine (the default) or a
real SGLang server (`MILES_AIO_SGLANG_URL=http://host:port`). Token ids always come from the served
model's own tokenizer (`/generate` with `text` and `return_prompt_token_ids`), so they are valid for
whatever model is behind the URL. What needs this machine's files (HF reference forwards, checkpoints
under the weights root) is only checked where the server is the embedded engine, or where
`MILES_AIO_SGLANG_UPDATE_MODEL` names a second checkpoint the real server can load.

Expected values follow SGLang's source (paths relative to `sglang/srt/`), cited next to each assertion.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import torch

from tests.engine.helpers import EngineProcess, check_response, hf_model

SGLANG_URL_ENV = "MILES_AIO_SGLANG_URL"
SGLANG_UPDATE_MODEL_ENV = "MILES_AIO_SGLANG_UPDATE_MODEL"
ATOL = 1e-4
"""Logprob tolerance (float32 on both sides; observed differences ~1e-6)."""
EOS_ID = 2
"""`</s>` of `build_tiny_llama`'s tokenizer (<pad>=0, <s>=1, </s>=2)."""
_WORD_CHARS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True, kw_only=True)
class ParityServer:
    url: str
    engine: EngineProcess | None
    """The embedded engine process; None for a real SGLang server."""
    base_model: str
    """The served checkpoint (`/model_info` model_path): what puts the served weights back."""
    update_model: str | None
    """A checkpoint of the same shape, for update_weights_from_disk; None: weight tests skip."""
    local_base: Path | None = None
    """`base_model` on this machine (embedded only): the HF reference forward reads it."""
    local_update: Path | None = None

    @property
    def embedded(self) -> bool:
        return self.engine is not None

    def require_update_model(self) -> str:
        if self.update_model is None:
            pytest.skip(
                f"real SGLang server without {SGLANG_UPDATE_MODEL_ENV}: set it to a checkpoint of the served "
                "model's shape (loadable by the server) to run the weight-update tests"
            )
        return self.update_model

    def require_local_tokenizer(self) -> Any:
        if self.local_base is None:
            pytest.skip("the EOS id / per-token decoding is known only for the embedded engine's tiny model")
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.local_base / "tokenizer.json"))


# ---- requests ----


def post_generate(client: httpx.Client, api_types: ModuleType, body: dict[str, Any]) -> Any:
    """POST /generate with a body SGLang's schema accepts; check the answer (one dict, or a list for a
    batch / n > 1, as `http_server.generate_request`) against SGLang's schema and the version spans."""
    api_types.GenerateRequest.from_json_value(body)
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    for item in data if isinstance(data, list) else [data]:
        check_response(api_types, item)
    return data


def stream_generate(url: str, api_types: ModuleType, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST /generate with stream: true; return the JSON chunks. SGLang's framing (`entrypoints/
    http_server.py` serve_generate_request): `data: <json>\\n\\n` per chunk, then `data: [DONE]`."""
    api_types.GenerateRequest.from_json_value(body)
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=120.0) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert raw.endswith("\n\n")
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks
    for chunk in chunks:
        api_types.GenerateResponse.from_json_value(chunk)
    return chunks


def make_text(n_chars: int, seed: int) -> str:
    """Seeded lowercase words and spaces: encodable by the tiny char-level model and by any real one."""
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < n_chars:
        word = "".join(rng.choice(_WORD_CHARS) for _ in range(rng.randint(2, 9)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:n_chars]


def tokenize(client: httpx.Client, api_types: ModuleType, text: str) -> list[int]:
    """The served tokenizer's ids for `text` (a 0-token generation that echoes its prompt ids)."""
    body = {"text": text, "sampling_params": {"max_new_tokens": 0}, "return_prompt_token_ids": True}
    ids: list[int] = post_generate(client, api_types, body)["prompt_token_ids"]
    return ids


def prompt_ids(client: httpx.Client, api_types: ModuleType, n: int, *, seed: int) -> list[int]:
    """Exactly `n` valid token ids of the served model (seeded text, tokenized by the server)."""
    chars = n + 8
    while True:
        ids = tokenize(client, api_types, make_text(chars, seed))
        if len(ids) >= n:
            return ids[:n]
        chars *= 3


def lps(entries: list[list[Any]]) -> list[float]:
    """The logprob of each [logprob, token_id, text] triple."""
    return [e[0] for e in entries]


def server_state(client: httpx.Client) -> dict[str, Any]:
    state: dict[str, Any] = client.get("/server_info").json()["internal_states"][0]
    return state


# ---- references (HF transformers, embedded engine only) ----


def reference_greedy(
    model_path: Path,
    prompt: list[int],
    max_new_tokens: int,
    *,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: dict[int, float] | None = None,
    min_new_tokens: int = 0,
    stop_token_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
) -> list[int]:
    """Greedy decoding with SGLang's logit transforms, on HF's LlamaForCausalLM.

    As `sampling/penaltylib`: frequency/presence penalties subtract per *output* occurrence / presence,
    the repetition penalty divides positive and multiplies negative logits of output tokens, and
    min_new_tokens adds -inf to the stop tokens (stop_token_ids and EOS) while fewer than it are out; then
    logit_bias is added (`sampling_batch_info._apply_post_grammar_logits_transforms`). Decoding stops
    after a stop token (kept in the output), unless ignore_eos (`schedule_batch._check_token_based_finish`).
    """
    model = hf_model(model_path)
    vocab = model.config.vocab_size
    counts = torch.zeros(vocab)
    bias = torch.zeros(vocab)
    for tok, b in (logit_bias or {}).items():
        bias[tok] = b
    stops = [*stop_token_ids, EOS_ID]
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float().clone()
            seen = counts > 0
            logits -= frequency_penalty * counts + presence_penalty * seen.float()
            if repetition_penalty != 1.0:
                scaled = torch.where(logits < 0, logits * repetition_penalty, logits / repetition_penalty)
                logits = torch.where(seen, scaled, logits)
            if len(out) < min_new_tokens:
                logits[stops] = float("-inf")
            logits += bias
            tok = int(logits.argmax())
            out.append(tok)
            counts[tok] += 1
            if tok in stops and not ignore_eos:
                break
    return out


def reference_input_logprobs(model_path: Path, ids: list[int], start: int) -> list[float | None]:
    """What SGLang answers in `input_token_logprobs` for logprob_start_len=start: one entry per token
    ids[start:], the first None, then log_softmax(logits[j - 1])[ids[j]]
    (`managers/scheduler_components/logprob_result_processor._process_input_token_logprobs`)."""
    with torch.no_grad():
        logits = hf_model(model_path)(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    rest = [float(logprobs[j - 1, ids[j]]) for j in range(start + 1, len(ids))]
    return [None, *rest]
