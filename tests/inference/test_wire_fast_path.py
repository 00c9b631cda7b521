"""`decode_generate_response` (typed msgspec decoding) is `parse_generate_response` over
`decode_json_object`, only faster: for good answers of every length and for every answer
`test_fuzz_engine`'s mutations break, both give the same output or the same `EngineBadResponse`."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_aio.errors import EngineBadResponse
from miles_aio.inference.wire import decode_generate_response, decode_json_object, parse_generate_response
from miles_aio.types import GenerateOutput
from tests.inference.test_fuzz_engine import MUTATIONS, RAW_BODIES, mutate

pytestmark = pytest.mark.pure

WHERE = "http://engine/generate rid=r"


def good_answer(n: int, *, spans: bool, cached: bool) -> dict[str, Any]:
    """An answer as SGLang gives it (`return_logprob`), `n` tokens, versions as one or two spans."""
    tokens = [(31 * i + 7) % 50_000 for i in range(n)]
    meta: dict[str, Any] = {
        "id": "r",
        "finish_reason": {"type": "length", "length": n},
        "prompt_tokens": 12,
        "completion_tokens": n,
        "weight_version": "4",
        "e2e_latency": 0.25,
        "output_token_logprobs": [[-(t % 7 + 1) / 10 if t % 3 else -1, t, None] for t in tokens],
    }
    if cached:
        meta["cached_tokens"] = 5
    if spans and n:
        meta["weight_versions"] = [
            {"version": "3", "start": 0, "end": n // 2},
            {"version": "4", "start": n // 2, "end": n},
        ]
    return {"text": " ".join(map(str, tokens)), "output_ids": tokens, "meta_info": meta}


def both(body: bytes) -> tuple[GenerateOutput | str, GenerateOutput | str]:
    """Each path's output, or its error message."""

    def run(parse: Any) -> GenerateOutput | str:
        try:
            out: GenerateOutput = parse()
        except EngineBadResponse as e:
            return f"EngineBadResponse: {e}"
        return out

    fast = run(lambda: decode_generate_response(body, where=WHERE))
    slow = run(lambda: parse_generate_response(decode_json_object(body, WHERE), where=WHERE))
    return fast, slow


@pytest.mark.parametrize("n", [0, 1, 3, 200, 1000])
@pytest.mark.parametrize("spans", [False, True])
@pytest.mark.parametrize("cached", [False, True])
def test_good_answers_decode_the_same(n: int, spans: bool, cached: bool) -> None:
    fast, slow = both(json.dumps(good_answer(n, spans=spans, cached=cached)).encode())
    assert isinstance(fast, GenerateOutput) and fast == slow
    assert all(type(lp) is float for lp in fast.output_log_probs)  # JSON's -1 comes out a float
    assert "output_token_logprobs" not in fast.meta and "weight_versions" not in fast.meta
    assert fast.meta["e2e_latency"] == 0.25 and fast.cached_tokens == (5 if cached else 0)


@settings(max_examples=400, deadline=None, database=None)
@given(n=st.integers(0, 4), mutations=st.lists(MUTATIONS, min_size=1, max_size=3))
def test_broken_answers_fail_or_pass_the_same(n: int, mutations: list[tuple[Any, ...]]) -> None:
    body: object = copy.deepcopy(good_answer(n, spans=n > 1, cached=False))
    for m in mutations:
        if isinstance(body, bytes) or not isinstance(body, dict):
            break
        try:
            body = mutate(body, m)
        except (KeyError, TypeError, AttributeError, IndexError):
            break  # a mutation aimed at a field an earlier one removed or retyped
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    fast, slow = both(raw)
    assert fast == slow


@settings(max_examples=200, deadline=None, database=None)
@given(raw=RAW_BODIES)
def test_raw_bodies_fail_the_same(raw: bytes) -> None:
    fast, slow = both(raw if raw != b"<nested>" else b"[" * 50_000 + b"]" * 50_000)
    assert fast == slow and isinstance(fast, str)


@pytest.mark.parametrize("depth", [10, 1_000, 50_000])
def test_deep_nesting_inside_meta_info_fails_or_passes_the_same(depth: int) -> None:
    """A value nested deep inside `meta_info` (which the typed path keeps as plain JSON): at a depth
    msgspec or `json` refuses, both paths give the same error, not a RecursionError out of the client."""
    answer = good_answer(3, spans=False, cached=False)
    body = json.dumps(answer).encode()
    nested = b"[" * depth + b"]" * depth
    body = body.replace(b'"meta_info": {', b'"meta_info": {"deep": ' + nested + b", ", 1)
    fast, slow = both(body)
    assert fast == slow
    if depth == 10:
        assert isinstance(fast, GenerateOutput) and fast.meta["deep"] == [[[[[[[[[[]]]]]]]]]]
    if depth == 50_000:
        assert isinstance(fast, str)


def test_a_stream_chunk_nested_too_deep_is_a_bad_response_not_a_recursion_error() -> None:
    """`StreamDecoder` checks a whole chunk's JSON first (then, from the second chunk on, decodes only the
    ids and log-probs it adds): a value nested too deep anywhere in it is the engine's bad answer."""
    from miles_aio.inference.wire import StreamDecoder

    deep = b"[" * 50_000 + b"]" * 50_000

    def chunk(ids: bytes, lps: bytes, extra: bytes = b"") -> bytes:
        fields = b'"output_token_logprobs":' + lps + b',"finish_reason":null,"weight_version":"1"'
        meta = b"{" + extra + fields + b"}"
        return b'{"text":"a","output_ids":' + ids + b',"meta_info":' + meta + b"}"

    with pytest.raises(EngineBadResponse, match="invalid stream chunk"):
        StreamDecoder(where=WHERE).feed(chunk(b"[1]", b"[[-0.1,1,null]]", b'"deep":' + deep + b","))
    dec = StreamDecoder(where=WHERE)
    first, _ = dec.feed(chunk(b"[1]", b"[[-0.1,1,null]]"))
    assert first.output_ids == [1]
    with pytest.raises(EngineBadResponse):
        dec.feed(chunk(b"[1," + deep + b"]", b"[[-0.1,1,null],[-0.2,2,null]]"))
