"""Bad engine answers, fuzzed: the SGLang stub server (a FAKE over real HTTP, `SGLangStubServer`) answers
`/generate` as hypothesis scripts it, one fault per request (invalid JSON, missing fields, wrong types,
logprob/token/version mismatches, 4xx/5xx, slow answers, bodies cut mid-way, reset connections,
timeouts), and the real client, the rollout pool and a whole controller run must turn every answer into
a valid output or a clear error: `EngineUnavailable` (5xx, lost connection, timeout) or
`EngineBadResponse` (the answer breaks the contract), an ABORTED sample, a counted aborted group, and
never a corrupted sample in front of the trainer or a crashed controller.

One server and one event loop serve every example of the module (hypothesis runs examples one by one).
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_aio.controller import Controller
from miles_aio.errors import EngineBadResponse, EngineError, EngineUnavailable
from miles_aio.inference.client import ClientTimeouts, SGLangClient
from miles_aio.inference.router import EngineRouter, RouterPolicy
from miles_aio.inference.wire import MAX_TOKEN_ID
from miles_aio.ledger import check_conservation, read_ledger
from miles_aio.plugins import resolve_plugins
from miles_aio.rollout.context import RolloutContext
from miles_aio.rollout.pool import RolloutPool
from miles_aio.rollout.single_turn import generate as single_turn_generate
from miles_aio.testing import FakeTokenizer, FakeTrainer
from miles_aio.testing.sglang_stub_server import SGLangStubServer
from miles_aio.types import GenerateOutput, Sample, Status
from tests.helpers import length_reward, make_config, make_source

pytestmark = pytest.mark.procs

NESTED = b"<nested>"
"""A body marker the server sends as JSON nested too deep for any decoder (kept short in reprs)."""
DEEP = b"[" * 50_000 + b"]" * 50_000
GENERATE_TIMEOUT_S = 0.5  # a good answer must never hit it, even on a loaded machine
SLOW_OK_S, SLOW_TIMEOUT_S = 0.02, 0.8
MAX_NEW = 4  # token positions the mutations aim at (requests here ask for 3)
FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# ---- what the server answers ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    """One scripted answer to `/generate`. `expect`: the client error it must cause; None: a valid
    output; "either": a valid output or EngineBadResponse (a mutation may be harmless)."""

    kind: str  # good | mutated | raw | slow | cut | reset
    expect: type[EngineError] | str | None
    status: int = 200
    body: bytes = b""
    mutation: tuple[Any, ...] = ()
    delay_s: float = 0.0


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)
FIELDS = [
    "text",
    "output_ids",
    "meta_info",
    "meta_info.finish_reason",
    "meta_info.finish_reason.type",
    "meta_info.prompt_tokens",
    "meta_info.cached_tokens",
    "meta_info.output_token_logprobs",
    "meta_info.weight_version",
    "meta_info.weight_versions",
]
MUTATIONS = st.one_of(
    st.tuples(st.just("delete"), st.sampled_from(FIELDS)),
    st.tuples(st.just("set"), st.sampled_from(FIELDS), JSON_VALUES),
    st.tuples(st.just("logprob_count"), st.sampled_from([-1, 1])),
    st.tuples(
        st.just("token"), st.integers(0, MAX_NEW - 1), JSON_VALUES | st.sampled_from([-1, MAX_TOKEN_ID])
    ),
    st.tuples(st.just("logprob_id"), st.integers(0, MAX_NEW - 1), JSON_VALUES),
    st.tuples(st.just("logprob"), st.integers(0, MAX_NEW - 1), JSON_VALUES),
    st.tuples(
        st.just("spans"),
        st.lists(
            st.fixed_dictionaries({"version": JSON_VALUES, "start": JSON_VALUES, "end": JSON_VALUES}),
            max_size=2,
        ),
    ),
    st.tuples(st.just("spans_huge")),
    st.tuples(st.just("too_many_tokens")),
    st.tuples(st.just("nested_deep")),
)
RAW_BODIES = st.one_of(
    st.binary(max_size=40),
    st.just(NESTED),
    st.just(b'{"error": {"message": "boom"}}'),
    st.builds(lambda v: json.dumps(v).encode(), JSON_VALUES),
)
ANSWERS = st.one_of(
    st.just(Answer("good", None)),
    st.builds(lambda m: Answer("mutated", "either", mutation=m), MUTATIONS),
    st.builds(lambda b: Answer("raw", EngineBadResponse, body=b), RAW_BODIES),
    st.builds(
        lambda s, b: Answer("raw", EngineUnavailable if s >= 500 else EngineBadResponse, status=s, body=b),
        st.sampled_from([400, 401, 404, 413, 422, 500, 502, 503]),
        RAW_BODIES,
    ),
    st.sampled_from(
        [
            Answer("slow", None, delay_s=SLOW_OK_S),
            Answer("slow", EngineUnavailable, delay_s=SLOW_TIMEOUT_S),
            Answer("cut", EngineUnavailable),
            Answer("reset", EngineUnavailable),
        ]
    ),
)


def mutate(body: dict[str, Any], mutation: tuple[Any, ...]) -> object:
    """The stub's good answer `body`, broken as `mutation` says (bytes: a raw body to send)."""
    kind, *args = mutation
    meta, ids, entries = body["meta_info"], body["output_ids"], body["meta_info"]["output_token_logprobs"]
    if kind in ("delete", "set"):
        *parents, last = args[0].split(".")
        obj = body
        for p in parents:
            obj = obj[p]
        if kind == "delete":
            obj.pop(last, None)
        else:
            obj[last] = args[1]
    elif kind == "logprob_count":
        entries.append([-1.0, 1, None]) if args[0] > 0 else entries.pop()
    elif kind == "token" and args[0] < len(ids):
        ids[args[0]] = args[1]
    elif kind == "logprob_id" and args[0] < len(entries):
        entries[args[0]][1] = args[1]
    elif kind == "logprob" and args[0] < len(entries):
        entries[args[0]][0] = args[1]
    elif kind == "spans":
        meta["weight_versions"] = args[0]
    elif kind == "spans_huge":
        meta["weight_versions"] = [{"version": "1", "start": 0, "end": 10**12}]
    elif kind == "too_many_tokens":
        ids.extend(ids[:1] * (MAX_NEW + 1))
        entries.extend(entries[:1] * (MAX_NEW + 1))
    elif kind == "nested_deep":
        return DEEP
    return body


def fault(answer: Answer) -> dict[str, Any]:
    """The stub fault that makes its next `/generate` answer `answer`."""
    if answer.kind == "mutated":
        return {"kind": "mutate", "apply": lambda out: mutate(out, answer.mutation)}
    if answer.kind == "raw":
        return {
            "kind": "raw",
            "status": answer.status,
            "body": DEEP if answer.body == NESTED else answer.body,
        }
    if answer.kind == "slow":
        return {"kind": "delay", "delay_s": answer.delay_s}
    return {"kind": {"good": "ok", "cut": "cut", "reset": "reset"}[answer.kind]}


@dataclass
class Env:
    loop: asyncio.AbstractEventLoop
    server: SGLangStubServer
    client: SGLangClient = field(init=False)
    script: list[Answer] = field(default_factory=list)
    generates_before: int = 0

    def load(self, answers: list[Answer]) -> None:
        """The next `/generate` requests answer `answers`, in order (then good answers)."""
        self.server.clear_faults()
        self.server.add_faults([fault(a) for a in answers])
        self.script, self.generates_before = list(answers), self.server.counts["/generate"]

    @property
    def served(self) -> list[Answer]:
        """The answers given since `load`, in order."""
        n = self.server.counts["/generate"] - self.generates_before
        return self.script[:n] + [Answer("good", None)] * max(0, n - len(self.script))


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    loop = asyncio.new_event_loop()
    server = SGLangStubServer(check_schema=False)  # answers are under test here, not request bodies
    loop.run_until_complete(server.start())
    e = Env(loop, server)
    e.client = SGLangClient(server.url, timeouts=ClientTimeouts(generate_s=GENERATE_TIMEOUT_S, health_s=2.0))
    try:
        yield e
    finally:
        loop.run_until_complete(e.client.aclose())
        loop.run_until_complete(server.stop())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


# ---- invariants -----------------------------------------------------------------------------------------
def check_output(out: GenerateOutput, max_new: int) -> None:
    n = len(out.output_ids)
    assert n <= max_new
    assert len(out.output_log_probs) == n and len(out.weight_versions) == n
    assert all(type(t) is int and 0 <= t < MAX_TOKEN_ID for t in out.output_ids)
    assert all(type(lp) is float and not math.isnan(lp) for lp in out.output_log_probs)
    assert all(v is None or type(v) is int for v in out.weight_versions)
    assert out.finish_reason in ("stop", "length", "abort")


def check_trainable(s: Sample) -> None:
    """What may reach the trainer: a finished sample whose per-token lists all line up."""
    assert s.status in (Status.COMPLETED, Status.TRUNCATED), s.status
    s.validate()
    assert all(type(t) is int and 0 <= t < MAX_TOKEN_ID for t in s.tokens)
    assert all(type(lp) is float and not math.isnan(lp) for lp in s.rollout_log_probs)
    assert all(v is None or type(v) is int for v in s.weight_versions)  # an engine may answer "default"


# ---- the client ---------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@FUZZ
@given(answers=st.lists(ANSWERS, min_size=1, max_size=3))
def test_client_turns_every_answer_into_a_valid_output_or_the_right_error(
    env: Env, answers: list[Answer]
) -> None:
    async def main() -> None:
        env.load(answers)
        for answer in answers:
            out, error = None, None
            try:
                out = await env.client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 3})
            except EngineError as e:
                error = e
            if out is not None:
                assert answer.expect in (None, "either"), f"{answer} gave {out}"
                check_output(out, 3)
            else:
                want = EngineBadResponse if answer.expect == "either" else answer.expect
                assert isinstance(want, type) and isinstance(error, want), (answer, error)
                assert len(str(error)) < 1000  # readable whatever the server sent

    env.loop.run_until_complete(asyncio.wait_for(main(), 20))


# Answers that once escaped as TypeError/RecursionError/ValueError/MemoryError or passed as valid output.
REGRESSIONS = [
    Answer("mutated", EngineBadResponse, mutation=("set", "meta_info.finish_reason.type", [])),
    Answer("mutated", EngineBadResponse, mutation=("spans_huge",)),
    Answer("mutated", EngineBadResponse, mutation=("set", "meta_info.weight_version", "9" * 5000)),
    Answer("mutated", EngineBadResponse, mutation=("token", 0, -1)),
    Answer("mutated", EngineBadResponse, mutation=("token", 0, 2**64)),
    Answer("mutated", EngineBadResponse, mutation=("too_many_tokens",)),
    Answer("mutated", EngineBadResponse, mutation=("nested_deep",)),
    Answer("raw", EngineBadResponse, status=400, body=NESTED),
    Answer("raw", EngineUnavailable, status=503, body=NESTED),
]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("answer", REGRESSIONS, ids=lambda a: f"{a.kind}-{a.status}-{a.mutation[:2]}")
def test_answers_that_broke_the_client_are_clear_errors(env: Env, answer: Answer) -> None:
    async def main() -> None:
        env.load([answer])
        with pytest.raises(answer.expect) as e:  # type: ignore[arg-type]
            await env.client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 3})
        assert len(str(e.value)) < 1000

    env.loop.run_until_complete(asyncio.wait_for(main(), 10))


# ---- the rollout pool -------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@FUZZ
@given(answers=st.lists(ANSWERS, min_size=1, max_size=6))
def test_pool_marks_each_failed_engine_call_aborted_and_keeps_the_rest_valid(
    env: Env, answers: list[Answer]
) -> None:
    cfg = make_config(rollout_max_response_len=3)
    ctx = RolloutContext(
        engine=env.client, tokenizer=FakeTokenizer(), config=cfg, log=structlog.get_logger("fuzz")
    )
    pool = RolloutPool(ctx=ctx, generate_fn=single_turn_generate, reward_fn=length_reward)
    group = make_source(n=len(answers)).next_group()
    done: list[int] = []

    async def main() -> list[Sample]:
        env.load(answers)
        return await pool.run_group(group, on_sample_done=lambda: done.append(1))

    out = env.loop.run_until_complete(asyncio.wait_for(main(), 20))
    assert len(out) == len(answers) == len(done)
    aborted = [s for s in out if s.status == Status.ABORTED]
    for s in aborted:
        assert s.metadata["error"].startswith(("EngineBadResponse", "EngineUnavailable"))
    for s in out:
        if s.status != Status.ABORTED:
            s.validate()
            assert all(v is None or type(v) is int for v in s.weight_versions)  # "default" is None
            assert len(s.tokens) == s.prompt_length + s.response_length
    must_fail = sum(a.expect not in (None, "either") for a in answers)
    may_fail = sum(a.expect == "either" for a in answers)
    assert must_fail <= len(aborted) <= must_fail + may_fail


# ---- a whole controller run -----------------------------------------------------------------------------
@pytest.mark.timeout(60)
@settings(FUZZ, max_examples=6)
@given(answers=st.lists(ANSWERS, min_size=1, max_size=10))
def test_controller_run_survives_bad_answers_and_trains_only_valid_samples(
    env: Env, answers: list[Answer]
) -> None:
    cfg_kw: dict[str, Any] = {
        "num_rollout": 3,
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 2,
        "rollout_max_response_len": 3,
        "async_unused_samples_handler": "drop",
        "stall_warning_s": 30.0,
    }
    policy = RouterPolicy(retry_backoff_s=0.001, health_check_interval_s=0.01, unavailable_deadline_s=10)
    timeouts = ClientTimeouts(generate_s=GENERATE_TIMEOUT_S, health_s=2.0)

    async def main(run_dir: Path) -> tuple[Controller, FakeTrainer]:
        env.load(answers)
        trainer = FakeTrainer(step_time_s=0.0)
        async with EngineRouter.open([env.server.url], policy=policy, timeouts=timeouts) as router:
            cfg = make_config(run_dir, **cfg_kw)
            controller = Controller(
                cfg,
                engine=router,
                trainer=trainer,
                source=make_source(n=2),
                plugins=resolve_plugins(cfg),
                tokenizer=FakeTokenizer(),
            )
            summary = await controller.run()
        assert summary.steps == 3
        return controller, trainer

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        _, trainer = env.loop.run_until_complete(asyncio.wait_for(main(run_dir), 30))
        events = read_ledger(run_dir / "ledger.jsonl")
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    check_conservation(events)
    trained = [s for _, batch in trainer.steps for g in batch for s in g]
    assert len(trained) == 3 * 2 * 2
    for s in trained:
        check_trainable(s)
    aborted_groups = sum(1 for e in events if e.get("reason") == "aborted")
    counted = sum(m["rollout/fully_async/aborted_groups_filtered"] for m in lines)
    assert counted <= aborted_groups  # groups aborted after the last step's metrics are not in them
    bad = sum(a.expect is EngineBadResponse for a in env.served)  # never retried: one sample each
    assert aborted_groups <= sum(a.expect is not None for a in env.served)
    if bad and not any(e["fate"] == "pending_at_exit" for e in events):
        assert aborted_groups >= 1
        assert all("perf/wasted_tokens/aborted" in m for m in lines)
