"""The engine's OpenAI-compatible routes, driven by the official `openai` client against a real engine.

The served model is the tiny Llama with chat tokens (`build_tiny_llama(chat_tokens=True)`): role markers
and the end-of-turn `<|end|>` are special tokens, so a rendered chat encodes to their ids. Its random
weights produce arbitrary characters; the tests therefore compare the routes with each other, with the
native /generate and with transformers' `apply_chat_template`, never with expected text.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from miles_aio.models import build_tiny_llama, load_tokenizer
from tests.engine.helpers import ALPHABET, EngineProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

CONTEXT = 2048
# A realistic prompt: ~700 characters, one token each.
LONG = " ".join(f"step {i} adds {i % 7} to the total and then checks the sum again." for i in range(12))
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "you are a careful calculator."},
    {"role": "user", "content": LONG},
    {
        "role": "assistant",
        "content": "let me call the tool.",
        "tool_calls": [
            {"id": "call0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
        ],
    },
    {"role": "tool", "content": "3", "tool_call_id": "call0"},
    {"role": "user", "content": "so what is the total"},
]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    }
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(
        tmp_path_factory.mktemp("chat") / "m",
        alphabet=ALPHABET,
        chat_tokens=True,
        max_position_embeddings=CONTEXT,
    )


@pytest.fixture(scope="module")
def chat_engine(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    proc = EngineProcess(chat_model, log_dir=tmp_path_factory.mktemp("logs"))
    yield proc
    assert proc.stop() == 0, proc.stderr()


@pytest.fixture(scope="module")
def oai(chat_engine: EngineProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=chat_engine.url + "/v1", api_key="x", max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def vocab(chat_model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(chat_model / "tokenizer.json"))


def _ids(vocab: Tokenizer, tokens: list[str]) -> list[int]:
    """Token texts (from logprobs) back to ids: one token per character or special token."""
    ids = [vocab.token_to_id(t) for t in tokens]
    assert None not in ids, tokens
    return [i for i in ids if i is not None]


def _template_ids(chat_model: Path, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """transformers' own rendering and encoding of MESSAGES (with `tools`) through the model's template."""
    from transformers import BatchEncoding

    encoded = load_tokenizer(chat_model).apply_chat_template(
        MESSAGES, tools=None if tools is None else [*tools], add_generation_prompt=True, return_dict=True
    )
    assert isinstance(encoded, BatchEncoding)
    return list(encoded["input_ids"])


def _greedy_chat(oai: openai.OpenAI, **kw: Any) -> Any:
    args: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 24}
    return oai.chat.completions.create(**(args | kw))


def test_chat_tokens_only_append_to_the_default_model(tmp_path: Path) -> None:
    # Recipes depend on the default vocab and weights: chat_tokens adds ids and rows, changes nothing else.
    kw: dict[str, Any] = {
        "alphabet": "0123456789+=",
        "hidden_size": 32,
        "num_heads": 2,
        "num_kv_heads": 1,
        "seed": 4,
    }
    base = build_tiny_llama(tmp_path / "base", **kw)
    chat = build_tiny_llama(tmp_path / "chat", chat_tokens=True, **kw)
    base_vocab = Tokenizer.from_file(str(base / "tokenizer.json")).get_vocab(with_added_tokens=True)
    chat_vocab = Tokenizer.from_file(str(chat / "tokenizer.json")).get_vocab(with_added_tokens=True)
    added = {t: i for t, i in chat_vocab.items() if t not in base_vocab}
    assert chat_vocab.items() >= base_vocab.items()
    assert sorted(added.values()) == list(range(len(base_vocab), len(base_vocab) + 5))
    wb, wc = load_file(base / "model.safetensors"), load_file(chat / "model.safetensors")
    assert wb.keys() == wc.keys()
    for name, tensor in wb.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert wc[name].shape[0] == tensor.shape[0] + 5
            assert torch.equal(wc[name][: tensor.shape[0]], tensor), name
        else:
            assert torch.equal(wc[name], tensor), name
    eos = json.loads((chat / "generation_config.json").read_text())["eos_token_id"]
    assert eos == [base_vocab["</s>"], added["<|end|>"]]
    assert json.loads((base / "generation_config.json").read_text())["eos_token_id"] == base_vocab["</s>"]


def test_models(oai: openai.OpenAI, chat_model: Path) -> None:
    (card,) = oai.models.list().data
    assert card.id == str(chat_model)
    assert card.model_extra is not None
    assert card.model_extra["max_model_len"] == CONTEXT
    assert oai.models.retrieve(str(chat_model)).id == str(chat_model)
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_chat_prompt_is_transformers_rendering_and_logprobs_are_native(
    oai: openai.OpenAI, chat_engine: EngineProcess, chat_model: Path, vocab: Tokenizer
) -> None:
    # The prompt the engine renders and encodes is exactly transformers' apply_chat_template ids: the
    # greedy reply and every chosen-token logprob equal the native /generate's on those ids.
    hf_ids = _template_ids(chat_model, tools=TOOLS)
    assert len(hf_ids) > 700
    special = {
        vocab.token_to_id(t)
        for t in ("<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>")
    }
    assert special <= set(hf_ids)  # the markers are single special tokens, not characters
    with httpx.Client(base_url=chat_engine.url, timeout=30) as http:
        assert http.post("/flush_cache").status_code == 200
        chat = _greedy_chat(oai, tools=TOOLS, logprobs=True, max_tokens=32)
        assert http.post("/flush_cache").status_code == 200
        native = http.post(
            "/generate",
            json={
                "input_ids": hf_ids,
                "sampling_params": {"temperature": 0, "max_new_tokens": 32},
                "return_logprob": True,
            },
        ).json()
    (choice,) = chat.choices
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == len(hf_ids)
    content = choice.logprobs.content
    assert _ids(vocab, [e.token for e in content]) == native["output_ids"]
    assert [e.logprob for e in content] == [e[0] for e in native["meta_info"]["output_token_logprobs"]]
    assert choice.message.content == native["text"]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == native["meta_info"]["finish_reason"]["type"]
    assert chat.usage.completion_tokens == len(native["output_ids"]) == len(content)
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    assert chat.object == "chat.completion"
    assert chat.model == "tiny"


def test_tools_reach_the_template(oai: openai.OpenAI, chat_model: Path) -> None:
    tool_block = len(_template_ids(chat_model, tools=TOOLS)) - len(_template_ids(chat_model))
    assert tool_block > 20
    plain = _greedy_chat(oai, max_tokens=1).usage
    with_tools = _greedy_chat(oai, max_tokens=1, tools=TOOLS).usage
    tools_off = _greedy_chat(oai, max_tokens=1, tools=TOOLS, tool_choice="none").usage
    assert with_tools.prompt_tokens - plain.prompt_tokens == tool_block
    assert tools_off.prompt_tokens == plain.prompt_tokens


def test_chat_stream_assembles_to_the_non_streamed_reply(
    oai: openai.OpenAI, chat_engine: EngineProcess
) -> None:
    async def run() -> tuple[Any, list[Any]]:
        async with openai.AsyncOpenAI(base_url=chat_engine.url + "/v1", api_key="x", max_retries=0) as client:
            args: dict[str, Any] = {
                "model": "tiny",
                "messages": MESSAGES,
                "temperature": 1.0,
                "seed": 11,
                "n": 3,
                "max_tokens": 40,
                "logprobs": True,
                "top_logprobs": 2,
            }
            full = await client.chat.completions.create(**args)
            stream = await client.chat.completions.create(
                **args, stream=True, stream_options={"include_usage": True}
            )
            return full, [chunk async for chunk in stream]

    full, chunks = asyncio.run(run())
    *body, usage_chunk = chunks
    assert usage_chunk.choices == []
    assert usage_chunk.usage == full.usage
    assert {c.id for c in chunks} == {chunks[0].id}
    for choice in full.choices:
        mine = [c.choices[0] for c in body if c.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant"
        assert mine[0].delta.content == ""
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [c.finish_reason for c in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1].finish_reason == choice.finish_reason
        streamed = [e for c in mine if c.logprobs is not None for e in c.logprobs.content or []]
        assert streamed == choice.logprobs.content
    assert len({c.message.content for c in full.choices}) == 3  # n independent generators


def test_sse_wire_format(chat_engine: EngineProcess) -> None:
    body = {"messages": MESSAGES[:2], "max_tokens": 3, "temperature": 0, "stream": True}
    with (
        httpx.Client(base_url=chat_engine.url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert chunks[0]["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"][0]["delta"] == {"reasoning_content": None}
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "default" for c in chunks)
    assert "usage" not in chunks[-1]  # no include_usage: no usage chunk


def test_completions_prompt_forms_n_and_usage(oai: openai.OpenAI, vocab: Tokenizer) -> None:
    text = LONG[:300]
    ids = vocab.encode(text, add_special_tokens=False).ids
    args: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "temperature": 0}
    as_text = oai.completions.create(prompt=text, **args)
    as_ids = oai.completions.create(prompt=ids, **args)
    assert as_text.choices[0].text == as_ids.choices[0].text
    assert as_text.usage is not None
    assert as_text.usage.prompt_tokens == len(ids) == 300
    assert as_text.choices[0].finish_reason == "length"
    assert as_text.usage.completion_tokens == 12
    assert as_text.object == "text_completion"
    # Two prompts × n=2 sampled: choices are prompt-major, prompts are counted once each.
    batch = oai.completions.create(prompt=[text, "12+34="], n=2, seed=5, **(args | {"temperature": 1.0}))
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == 300 + 6
    assert batch.usage.completion_tokens == 4 * 12
    again = oai.completions.create(prompt=[text, "12+34="], n=2, seed=5, **(args | {"temperature": 1.0}))
    assert [c.text for c in again.choices] == [c.text for c in batch.choices]  # seeded
    alone = oai.completions.create(prompt=text, seed=5, **(args | {"temperature": 1.0}))
    assert alone.choices[0].text == batch.choices[0].text  # choice 0 samples with the seed itself
    assert batch.choices[0].text != batch.choices[1].text
    echoed = oai.completions.create(prompt=text, echo=True, **args)
    assert echoed.choices[0].text == text + as_text.choices[0].text


def test_completion_stream_and_logprobs(oai: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": "tiny",
        "prompt": LONG,
        "max_tokens": 20,
        "temperature": 0,
        "logprobs": 3,
    }
    full = oai.completions.create(**args)
    lp = full.choices[0].logprobs
    assert lp is not None
    assert lp.token_logprobs is not None
    assert lp.tokens is not None
    assert lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == 20
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3
        assert max(top.values()) == top[token] == logprob  # greedy: the chosen token is the most likely
    chunks = list(oai.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    *body, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in body) == full.choices[0].text
    assert [t for c in body for t in (c.choices[0].logprobs.tokens or [])] == lp.tokens
    assert body[-1].choices[0].finish_reason == "length"
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 20


def test_chat_top_logprobs_shape(oai: openai.OpenAI) -> None:
    chat = _greedy_chat(oai, logprobs=True, top_logprobs=4, max_tokens=10)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 10
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 4
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob
    assert _greedy_chat(oai, max_tokens=2).choices[0].logprobs is None


def test_stop_strings_and_length(oai: openai.OpenAI) -> None:
    # Seeded sampling replays the same tokens up to the stop. Special tokens stay in the text here, so the
    # text a stop string is matched against (SGLang keeps specials there) is the text the reply shows.
    args: dict[str, Any] = {
        "temperature": 1.0,
        "seed": 3,
        "max_tokens": 40,
        "extra_body": {"skip_special_tokens": False, "ignore_eos": True},
    }
    free = _greedy_chat(oai, logprobs=True, **args)
    assert free.choices[0].finish_reason == "length"
    assert free.usage.completion_tokens == 40
    tokens = [e.token for e in free.choices[0].logprobs.content]
    text = "".join(tokens)
    assert free.choices[0].message.content == text
    i = next(i for i in range(8, len(tokens) - 1) if len(tokens[i]) == len(tokens[i + 1]) == 1)
    stop = tokens[i] + tokens[i + 1]
    cut = text[: text.find(stop)]
    stopped = _greedy_chat(oai, stop=[stop, "never there"], **args)
    assert stopped.choices[0].message.content == cut
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra is not None
    assert stopped.choices[0].model_extra["matched_stop"] == stop
    streamed = list(_greedy_chat(oai, stop=stop, stream=True, **args))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut  # nothing of the stop leaks
    assert streamed[-1].choices[0].finish_reason == "stop"
    kept = _greedy_chat(
        oai, stop=stop, **(args | {"extra_body": args["extra_body"] | {"no_stop_trim": True}})
    )
    assert kept.choices[0].message.content.startswith(cut + stop)


def test_end_of_turn_token_stops_the_reply(oai: openai.OpenAI, vocab: Tokenizer) -> None:
    end = vocab.token_to_id("<|end|>")
    chat = _greedy_chat(oai, logit_bias={str(end): 100.0})
    choice = chat.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra is not None
    assert choice.model_extra["matched_stop"] == end
    assert choice.message.content == ""  # the special token is not text
    assert chat.usage.completion_tokens == 1


def test_weight_version_in_metadata(oai: openai.OpenAI, chat_engine: EngineProcess) -> None:
    resp = httpx.post(
        chat_engine.url + "/update_weight_version",
        json={"new_version": "v-openai", "abort_all_requests": False},
    )
    assert resp.status_code == 200
    chat = _greedy_chat(oai, max_tokens=3)
    meta: Any = chat.metadata  # the client types it dict[str, str]; SGLang's weight_versions is a list
    assert meta["weight_version"] == "v-openai"
    assert meta["weight_versions"] == [{"version": "v-openai", "start": 0, "end": 3}]
    done = oai.completions.create(model="tiny", prompt="1+1=", max_tokens=2)
    assert done.model_extra is not None
    assert done.model_extra["metadata"]["weight_version"] == "v-openai"


def test_errors_arrive_as_openai_exceptions(oai: openai.OpenAI) -> None:
    # Unknown fields are ignored, as SGLang; fields it knows but the engine cannot honour are refused.
    assert _greedy_chat(oai, extra_body={"frobnicate": 1, "store": False}).choices[0].finish_reason
    with pytest.raises(openai.BadRequestError) as bad_field:
        _greedy_chat(oai, extra_body={"regex": "a+"})
    assert bad_field.value.status_code == 400
    assert isinstance(bad_field.value.body, dict)
    assert bad_field.value.body["param"] == "regex"
    assert bad_field.value.body["object"] == "error"
    assert bad_field.value.body["code"] == 400
    assert "regex" in bad_field.value.message
    with pytest.raises(openai.BadRequestError, match="longer than the model's context length"):
        oai.completions.create(model="tiny", prompt="a" * (CONTEXT + 10), max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="Requested token count exceeds"):
        _greedy_chat(oai, max_tokens=CONTEXT - 10)
    with pytest.raises(openai.BadRequestError) as wrong_type:
        _greedy_chat(oai, temperature="hot")
    assert isinstance(wrong_type.value.body, dict)
    assert wrong_type.value.body["type"] == "Bad Request"
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        _greedy_chat(oai, tools=TOOLS, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="role"):
        oai.chat.completions.create(model="tiny", messages=[{"role": "narrator", "content": "x"}])  # type: ignore[list-item,misc]
    with pytest.raises(openai.BadRequestError, match="top_p"):
        _greedy_chat(oai, top_p=0.0)
    with pytest.raises(openai.BadRequestError, match="Messages cannot be empty"):
        oai.chat.completions.create(model="tiny", messages=[])


def test_stream_disconnect_aborts_the_request(oai: openai.OpenAI, chat_engine: EngineProcess) -> None:
    # 50 ms per step: the request would run for 50 s unless leaving the stream aborts it.
    with httpx.Client(base_url=chat_engine.url, timeout=10) as http:
        http.post("/slow_down", json={"forward_sleep_time": 0.05})
        try:
            # special tokens shown: every generated token is a chunk, whichever the random model repeats
            extra = {"ignore_eos": True, "skip_special_tokens": False}
            stream = _greedy_chat(oai, max_tokens=1000, stream=True, extra_body=extra)
            seen = []
            for chunk in stream:
                seen.append(chunk)
                if len(seen) == 4:
                    break
            assert http.get("/server_info").json()["internal_states"][0]["num_running_reqs"] == 1
            stream.close()
            assert all(c.choices[0].finish_reason is None for c in seen)
            deadline = time.monotonic() + 5
            while http.get("/server_info").json()["internal_states"][0]["num_running_reqs"]:
                assert time.monotonic() < deadline, "the abandoned stream's request is still running"
                time.sleep(0.05)
        finally:
            http.post("/slow_down", json={"forward_sleep_time": None})


def test_api_key_and_a_model_without_chat_template(tmp_path: Path) -> None:
    model = build_tiny_llama(
        tmp_path / "plain", alphabet=ALPHABET, hidden_size=32, num_heads=2, num_kv_heads=1
    )
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    proc = EngineProcess(model, "--api-key", "k", log_dir=tmp_path)
    try:
        with openai.OpenAI(base_url=proc.url + "/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError) as denied:
                bad.models.list()
            assert denied.value.status_code == 401
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model="m", prompt="abc", max_tokens=1)
        with openai.OpenAI(base_url=proc.url + "/v1", api_key="k", max_retries=0) as good:
            assert good.models.list().data[0].id == str(model)
            assert good.completions.create(model="m", prompt="abc", max_tokens=2).usage.completion_tokens == 2  # type: ignore[union-attr]
            with pytest.raises(openai.BadRequestError, match="no chat template"):
                good.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    finally:
        assert proc.stop() == 0, proc.stderr()
