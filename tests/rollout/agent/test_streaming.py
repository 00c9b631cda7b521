"""Streaming, piece by piece: the content deltas a streamed reply may show (hypothesis), SGLang's stream
chunks as the client reads them, the router's retries before the first chunk, and streamed turns against
a scripted FAKE engine that hands out one token per chunk (the official `openai` client reads them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Hashable, Mapping
from typing import Any, cast

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessageParam

from miles_aio.errors import EngineBadResponse, EngineUnavailable
from miles_aio.inference.base import ChunkSink, GenerateChunk
from miles_aio.inference.client import SGLangClient
from miles_aio.inference.router import EngineRouter
from miles_aio.inference.wire import StreamDecoder
from miles_aio.rollout.agent import generate
from miles_aio.rollout.agent.parsers import ParsedReply, parse_none, parse_qwen25, streamable_length
from miles_aio.rollout.agent.streaming import ContentStream
from miles_aio.types import GenerateOutput, Sample, Status
from tests.rollout.agent import agents
from tests.rollout.agent.conftest import serving
from tests.rollout.agent.test_sessions_scripted import CALL, PARAMS, ScriptedEngine, config

pytestmark = pytest.mark.timeout(60)

# ---- what a reply being generated may show ----------------------------------------------------------------

PIECES = ["a", "b", " ", "\n", "é", "€", "<tool_call>", "</tool_call>", '{"name": "f", "arguments": {}}']
PIECES += ["<tool", "_call>", "<", "ab", "\n\n", "x y"]


def byte_decode(ids: list[int]) -> str:
    """A byte-level tokenizer: a character split over tokens decodes to U+FFFD until it is complete."""
    return bytes(ids).decode("utf-8", errors="replace")


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=14),
    cuts=st.lists(st.integers(1, 5), min_size=1, max_size=8),
    parser=st.sampled_from([parse_qwen25, parse_none, None]),
    stops=st.sampled_from([[], ["\n\n"], ["ab"], ["</tool_call>", "x"]]),
)
def test_streamed_deltas_add_up_to_the_final_content(
    pieces: list[str], cuts: list[int], parser: Any, stops: list[str]
) -> None:
    text = "".join(pieces)
    matched = min(((text.find(s), s) for s in stops if s in text), default=None)
    if matched is not None:  # generation stops at the first stop string; the reply has it cut
        text = text[: matched[0] + len(matched[1])]
    final = text[: -len(matched[1])] if matched is not None else text
    content = parser(final).content if parser is not None else (final or None)
    ids = list(text.encode())
    stream = ContentStream(decode=byte_decode, parser=parser, stops=stops)
    shown, i, k = "", 0, 0
    while i < len(ids):
        n = cuts[k % len(cuts)]
        shown += stream.push(ids[i : i + n])
        assert "\ufffd" not in shown
        i, k = i + n, k + 1
    assert shown == stream.sent
    rest = stream.finish(content)
    assert rest is not None, (text, shown, content)
    assert shown + rest == (content or "")


def test_qwen25_shows_the_text_before_a_call_and_nothing_of_the_call() -> None:
    stream = ContentStream(decode=byte_decode, parser=parse_qwen25)
    reply = 'let me compute. <tool_call>{"name": "calc", "arguments": {"e": "1+2"}}</tool_call>'
    shown = [stream.push(list(c.encode())) for c in reply]
    assert "".join(shown) == "let me compute."
    assert sum(1 for s in shown if s) > 5  # piece by piece, not at the end
    assert stream.finish(parse_qwen25(reply).content) == ""
    # a reply that starts with whitespace: stripped if a call follows, so nothing shows until the end
    assert streamable_length(parse_qwen25, "  hello") == 0
    assert streamable_length(parse_qwen25, "hello <tool") == len("hello")
    assert streamable_length(lambda t: ParsedReply(t), "custom parsers show nothing early") == 0


# ---- SGLang's stream chunks, as the client reads them ------------------------------------------------------


def chunk(ids: list[int], finish: Any = None) -> dict[str, Any]:
    meta = {
        "finish_reason": finish,
        "prompt_tokens": 3,
        "weight_versions": [{"version": "1", "start": 0, "end": len(ids)}] if ids else [],
        "weight_version": "1",
        "output_token_logprobs": [[-0.5, t, None] for t in ids],
    }
    return {"text": "", "output_ids": ids, "meta_info": meta}


def enc(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_stream_chunks_are_cumulative_and_give_the_new_tokens() -> None:
    d = StreamDecoder("w")
    got, out = d.feed(enc(chunk([5])))
    assert got == GenerateChunk([5], [-0.5], [1]) and out is None
    got, out = d.feed(enc(chunk([5, 6, 7])))  # the arrays extend the last chunk's: only the tail is decoded
    assert got == GenerateChunk([6, 7], [-0.5, -0.5], [1, 1]) and out is None
    spaced = json.dumps(chunk([5, 6, 7, 8]), indent=1).encode()  # spelled differently: decoded whole
    got, out = d.feed(spaced)
    assert got.output_ids == [8] and out is None
    got, out = d.feed(enc(chunk([5, 6, 7, 8], {"type": "length"})))
    assert got.output_ids == [] and out is not None and out.output_ids == [5, 6, 7, 8]
    assert out.finish_reason == "length" and out.weight_versions == [1] * 4


def test_a_stream_chunk_that_breaks_the_contract_is_a_bad_response() -> None:
    d = StreamDecoder("w")
    d.feed(enc(chunk([5, 6, 7])))
    with pytest.raises(EngineBadResponse, match="cumulative"):  # --incremental-streaming-output
        d.feed(enc(chunk([8])))
    bad = chunk([5, 6])
    bad["meta_info"]["output_token_logprobs"][1][1] = 9
    with pytest.raises(EngineBadResponse, match=r"output_token_logprobs\[1\]"):
        StreamDecoder("w").feed(enc(bad))
    d = StreamDecoder("w")
    d.feed(enc(chunk([5, 6])))
    last = chunk([5, 6, 7], {"type": "stop"})
    last["meta_info"]["output_token_logprobs"][0][0] = -0.25  # the past rewritten in the last chunk
    with pytest.raises(EngineBadResponse, match="not the chunks before it joined"):
        d.feed(enc(last))
    with pytest.raises(EngineUnavailable, match="boom"):
        StreamDecoder("w").feed(enc({"error": {"message": "boom", "code": 503}}))


class PiecesStream(httpx.AsyncByteStream):
    """An answer body that arrives in the given pieces (SSE events split anywhere)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for p in self.pieces:
            yield p


def sse(*events: object) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events
    )


def stream_over(body: bytes, split: int, status: int = 200) -> Any:
    """An SGLangClient whose transport answers every /generate with `body`, in pieces of `split` bytes."""
    pieces = [body[i : i + split] for i in range(0, len(body), split)]

    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["stream"] is True
        return httpx.Response(status, stream=PiecesStream(pieces))

    return SGLangClient("http://stub", transport=httpx.MockTransport(handler))


@pytest.mark.parametrize("split", [1, 7, 10_000])
def test_the_client_reads_sse_chunks_split_anywhere(split: int) -> None:
    body = sse(chunk([5]), chunk([5, 6]), chunk([5, 6, 7], {"type": "length"}), b"[DONE]")

    async def main() -> tuple[GenerateOutput, list[GenerateChunk]]:
        got: list[GenerateChunk] = []

        async def sink(c: GenerateChunk) -> None:
            got.append(c)

        async with stream_over(body, split) as client:
            out = await client.generate_stream(input_ids=[1], sampling_params={}, on_chunk=sink)
        return out, got

    out, got = asyncio.run(main())
    assert [t for c in got for t in c.output_ids] == [5, 6, 7] and all(c.output_ids for c in got)
    if split == 1:  # events one by one: a chunk each; read together, the last covers the others
        assert [c.output_ids for c in got] == [[5], [6], [7]]
    assert out.output_ids == [5, 6, 7] and out.finish_reason == "length" and out.weight_versions == [1, 1, 1]


@pytest.mark.parametrize(
    ("body", "error", "match"),
    [
        (sse(chunk([5])), EngineUnavailable, "ended before the generation finished"),
        (sse(chunk([5]), {"error": {"message": "boom", "code": 500}}), EngineUnavailable, "boom"),
        (sse({"error": {"message": "bad sampling params"}}), EngineBadResponse, "bad sampling params"),
        (sse(chunk([5]), b"[DONE]"), EngineBadResponse, "before a chunk with a finish reason"),
    ],
)
def test_a_stream_that_breaks_is_an_engine_error(body: bytes, error: type[Exception], match: str) -> None:
    async def main() -> None:
        async def sink(c: GenerateChunk) -> None:
            pass

        async with stream_over(body, 5) as client:
            await client.generate_stream(input_ids=[1], sampling_params={}, on_chunk=sink)

    with pytest.raises(error, match=match):
        asyncio.run(main())


# ---- the router: retried only before the first chunk -------------------------------------------------------


class FakeStreamingClient:
    """A FAKE engine client for the router: streams `n` one-token chunks, then fails if told to."""

    def __init__(self, url: str, *, chunks: int, fail: bool) -> None:
        self.url, self.continuations = url, 0
        self.chunks, self.fail, self.calls = chunks, fail, 0

    async def generate_stream(
        self,
        *,
        input_ids: list[int],
        sampling_params: Mapping[str, Any],
        on_chunk: ChunkSink,
        routing_key: Hashable | None = None,
    ) -> GenerateOutput:
        self.calls += 1
        ids = list(range(self.chunks))
        for t in ids:
            await on_chunk(GenerateChunk([t], [-0.1], [1]))
        if self.fail:
            raise EngineUnavailable(f"{self.url}: connection reset")
        return GenerateOutput(
            text="", output_ids=ids, output_log_probs=[-0.1] * len(ids), weight_versions=[1] * len(ids),
            finish_reason="length",
        )  # fmt: skip

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("chunks_before_failing", [0, 2])
def test_router_retries_a_stream_only_before_its_first_chunk(chunks_before_failing: int) -> None:
    async def main() -> tuple[list[FakeStreamingClient], list[int], BaseException | GenerateOutput]:
        specs = {"a": (chunks_before_failing, True), "b": (3, False)}
        clients: list[FakeStreamingClient] = []

        def factory(url: str) -> Any:
            clients.append(FakeStreamingClient(url, chunks=specs[url][0], fail=specs[url][1]))
            return clients[-1]

        router = EngineRouter(["a", "b"], client_factory=factory)
        got: list[int] = []

        async def sink(c: GenerateChunk) -> None:
            got.extend(c.output_ids)

        try:
            result: BaseException | GenerateOutput = await router.generate_stream(
                input_ids=[1], sampling_params={}, on_chunk=sink, routing_key="s"
            )
        except EngineUnavailable as e:
            result = e
        await router.aclose()
        return clients, got, result

    clients, got, result = asyncio.run(main())
    assert clients[0].calls == 1
    if chunks_before_failing == 0:  # nothing reached the consumer: retried on the other engine
        assert isinstance(result, GenerateOutput) and result.output_ids == got == [0, 1, 2]
        assert clients[1].calls == 1
    else:  # the consumer holds tokens of the failed attempt: not retried
        assert isinstance(result, EngineUnavailable) and "not retried" in str(result)
        assert got == [0, 1] and clients[1].calls == 0


# ---- streamed turns over a scripted engine -----------------------------------------------------------------


class StreamingScriptedEngine(ScriptedEngine):
    """The scripted FAKE engine, streaming: one token per chunk, each after the previous was consumed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chunks = 0

    async def generate_stream(
        self,
        *,
        input_ids: list[int],
        sampling_params: Mapping[str, Any],
        on_chunk: ChunkSink,
        routing_key: Hashable | None = None,
    ) -> GenerateOutput:
        params, key = sampling_params, routing_key
        out = await self.generate(input_ids=input_ids, sampling_params=params, routing_key=key)
        for t, lp, v in zip(out.output_ids, out.output_log_probs, out.weight_versions, strict=True):
            self.chunks += 1
            await on_chunk(GenerateChunk([t], [lp], [v]))
            await asyncio.sleep(0)
        return out


def test_streamed_turns_are_the_non_streamed_turns_token_for_token(tokenizer: Any) -> None:
    """The same scripted replies (a tool call, text, a tool call), streamed and not: the same sample, the
    same history (so no turn is rolled back), and the streamed text came in pieces."""
    script = [CALL, "it is 42, and that is all", CALL]

    def run(stream: bool) -> tuple[Sample, ScriptedEngine]:
        engine = (StreamingScriptedEngine if stream else ScriptedEngine)(tokenizer, list(script))
        sample = Sample(group_index=0, index=0, prompt="12+30", metadata={"turns": 3, "stream": stream})

        async def main() -> Sample:
            async with serving(config(), engine, tokenizer) as (ctx, _):
                return await generate(ctx, sample, dict(PARAMS))

        return asyncio.run(main()), engine

    streamed, engine = run(True)
    plain, _ = run(False)
    assert isinstance(engine, StreamingScriptedEngine) and engine.chunks == sum(
        len(tokenizer.encode(r, add_special_tokens=False)) + 1 for r in script
    )
    assert streamed.status == plain.status == Status.COMPLETED
    for field in ("tokens", "loss_mask", "rollout_log_probs", "weight_versions", "response"):
        assert getattr(streamed, field) == getattr(plain, field), field
    assert streamed.metadata["final_history"] == plain.metadata["final_history"]
    assert streamed.metadata["finish_reasons"] == ["tool_calls", "stop", "tool_calls"]
    assert streamed.metadata["session"] == plain.metadata["session"]
    assert streamed.metadata["session"]["rollbacks"] == 0


def test_a_streamed_reply_shows_its_content_in_pieces_and_its_call_at_the_end(tokenizer: Any) -> None:
    engine = StreamingScriptedEngine(tokenizer, ["let me see " + CALL, "it is 42"])

    async def main() -> tuple[list[Any], list[Any], int]:
        async with (
            serving(config(), engine, tokenizer) as (ctx, server),
            server.session(ctx, dict(PARAMS)) as session,
        ):
            c = openai.AsyncOpenAI(base_url=session.base_url, api_key="x", max_retries=0)
            msgs: list[dict[str, Any]] = [{"role": "user", "content": "12+30"}]
            out = []
            for _ in range(2):
                history = cast(
                    "list[ChatCompletionMessageParam]", msgs
                )  # plain dicts, as an agent keeps them
                events = await c.chat.completions.create(
                    model="m", messages=history, tools=agents.TOOLS, stream=True,
                    stream_options={"include_usage": True}, logprobs=True,
                )  # fmt: skip
                out.append([e async for e in events])
                # the message the agent assembles from the deltas, as tests.rollout.agent.agents.ask does
                calls = [
                    tc.model_dump() for e in out[-1] for ch in e.choices for tc in ch.delta.tool_calls or []
                ]
                reply = {"role": "assistant", "content": "".join(_contents(out[-1])) or None}
                msgs.append(
                    {**reply, "tool_calls": [{k: v for k, v in tc.items() if k != "index"} for tc in calls]}
                )
                msgs.append({"role": "tool", "tool_call_id": "call_0", "content": "42"})
            await c.close()
            return out, session.turns, session.rollbacks

    (first, second), turns, rollbacks = asyncio.run(main())
    assert len(turns) == 2 and rollbacks == 0  # the assembled reply is the one the session stored
    content = _contents(first)
    assert "".join(content) == "let me see"  # the text before the call, as the non-streamed reply has it
    assert len([c for c in content if c]) > 3
    calls = [tc for e in first for ch in e.choices for tc in ch.delta.tool_calls or []]
    assert [(tc.index, tc.id, tc.function.name) for tc in calls] == [(0, "call_0", "calc")]
    assert [ch.finish_reason for e in first for ch in e.choices if ch.finish_reason] == ["tool_calls"]
    assert first[-1].choices == [] and first[-1].usage.completion_tokens == len(turns[0].tokens.output_ids)
    # one log-prob per token the engine produced, in order, across the chunks
    lps = [lp.logprob for e in first for ch in e.choices if ch.logprobs for lp in ch.logprobs.content or []]
    assert lps == list(turns[0].tokens.log_probs)
    assert "".join(_contents(second)) == "it is 42"


def _contents(events: list[Any]) -> list[str]:
    return [ch.delta.content for e in events for ch in e.choices if ch.delta.content is not None]


def test_an_engine_failure_mid_stream_is_an_error_event(tokenizer: Any) -> None:
    class FailingMidStream(StreamingScriptedEngine):
        async def generate_stream(self, *, on_chunk: ChunkSink, **kw: Any) -> GenerateOutput:
            await on_chunk(GenerateChunk([self.end_id], [-0.1], [1]))
            raise EngineUnavailable("the engine went away")

    engine = FailingMidStream(tokenizer, ["unused"])

    async def main() -> tuple[str, Any]:
        async with (
            serving(config(), engine, tokenizer) as (ctx, server),
            server.session(ctx, dict(PARAMS)) as session,
        ):
            c = openai.AsyncOpenAI(base_url=session.base_url, api_key="x", max_retries=0)
            events = await c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "q"}], stream=True
            )
            with contextlib.suppress(openai.APIError):
                async for _ in events:
                    pass
                return "no error", session
            await c.close()
            return "error", session

    outcome, session = asyncio.run(main())
    assert outcome == "error"
    assert session.turns == [] and "went away" in str(session.engine_error)
