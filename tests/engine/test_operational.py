"""SGLang's operational behaviour in the embedded engine: duplicate rids, abort messages, request timeouts,
the scheduler watchdog, `/server_info`, weight-request coercion and the flattened-bucket broadcast.

Each rule is SGLang 0.5.23's, read in its source (named at each test). The pure parts (timeout decisions,
pydantic's lax coercions, the bucket layout) are checked exhaustively here; the rest over HTTP against
real engine processes: one for most tests, one with short timeouts (env vars), one with a short watchdog.
Models have a 2048-token context; prompts are 300 tokens.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import signal
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from miles_aio.engine.protocol import lax_bool, lax_int
from miles_aio.engine.timeouts import (
    Limits,
    Supervisor,
    overdue,
    running_timeout_reason,
    waiting_timeout_reason,
    watchdog_deadline,
)
from miles_aio.weight_broadcast import (
    broadcast_flattened_bucket,
    bucket_layout,
    destroy_process_group,
    flatten_bucket,
    init_custom_process_group,
)
from tests.conftest import run_virtual
from tests.engine.helpers import (
    ALPHABET,
    EngineProcess,
    ModelPair,
    check_response,
    logprobs,
    model_pair,
    reference_logprobs,
)

pytestmark = [pytest.mark.timeout(90)]
slow = pytest.mark.slow

PROMPT = [3 + (i * 7) % 40 for i in range(300)]
SLOW_STEP_S = 0.05
WAITING_S, RUNNING_S, SOFT_WATCHDOG_S, WATCHDOG_S = 1.5, 3.0, 1.0, 2.0
CACHE_NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_IN_QUEUE = {"type": "abort", "message": "Abort in waiting queue"}


def _error_response(message: str, code: int, kind: str) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code}


# ---- pure: the timeout decision (SGLang's scheduler._poll_timeout_aborts) ----


@dataclass
class _Req:
    rid: str
    queued_s: float | None
    started_s: float | None


_times = st.none() | st.floats(0, 1000, allow_nan=False)
_limit = st.none() | st.floats(0.001, 500, allow_nan=False)
_reqs = st.lists(st.builds(_Req, rid=st.uuids().map(str), queued_s=_times, started_s=_times), max_size=12)


def _deadline(r: _Req, limits: Limits, paused: bool) -> tuple[str, float] | None:
    if r.queued_s is not None:
        return None if limits.waiting_s is None else ("waiting", r.queued_s + limits.waiting_s)
    if r.started_s is not None and not paused and limits.running_s is not None:
        return "running", r.started_s + limits.running_s
    return None


@settings(max_examples=400, deadline=None)
@given(now=st.floats(0, 2000, allow_nan=False), reqs=_reqs, w=_limit, r=_limit, paused=st.booleans())
def test_overdue_is_exactly_sglangs_rule(
    now: float, reqs: list[_Req], w: float | None, r: float | None, paused: bool
) -> None:
    limits = Limits(waiting_s=w, running_s=r)
    verdict = overdue(now, reqs, limits, paused=paused)
    timed = [(q, d) for q in reqs if (d := _deadline(q, limits, paused)) is not None]
    # Waiting requests (in the queue) against the waiting limit; running ones against the running limit,
    # not while paused; held ones (neither clock) never. Due at the deadline; input order kept.
    assert verdict.waiting == [q for q, (kind, at) in timed if kind == "waiting" and now >= at]
    assert verdict.running == [q for q, (kind, at) in timed if kind == "running" and now >= at]
    pending = [at for _, (_, at) in timed if now < at]
    assert verdict.next_deadline == (min(pending) if pending else None)
    if verdict.next_deadline is not None:  # the timer wakes only when something becomes due
        later = overdue(verdict.next_deadline, reqs, limits, paused=paused)
        assert len(later.waiting) + len(later.running) > len(verdict.waiting) + len(verdict.running)


@settings(max_examples=200, deadline=None)
@given(
    now=st.floats(0, 1000, allow_nan=False),
    dt=st.floats(0, 1000, allow_nan=False),
    reqs=_reqs,
    w=_limit,
    r=_limit,
)
def test_overdue_is_monotone_in_time_and_pausing_only_spares_running(
    now: float, dt: float, reqs: list[_Req], w: float | None, r: float | None
) -> None:
    limits = Limits(waiting_s=w, running_s=r)
    a, b = overdue(now, reqs, limits, paused=False), overdue(now + dt, reqs, limits, paused=False)
    assert {id(q) for q in a.waiting} <= {id(q) for q in b.waiting}
    assert {id(q) for q in a.running} <= {id(q) for q in b.running}
    p = overdue(now, reqs, limits, paused=True)
    assert p.waiting == a.waiting and p.running == []
    off = overdue(now, reqs, Limits(), paused=False)
    assert (off.waiting, off.running, off.next_deadline) == ([], [], None)


def test_watchdog_deadline() -> None:
    assert watchdog_deadline(active=True, last_progress_s=10.0, timeout_s=300.0) == 310.0
    assert watchdog_deadline(active=False, last_progress_s=10.0, timeout_s=300.0) is None
    assert watchdog_deadline(active=True, last_progress_s=10.0, timeout_s=None) is None


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [
        (None, None),
        ("-1", None),
        ("0", None),
        ("2.5", 2.5),
        (" 3 ", 3.0),
        ("abc", None),
        ("inf", None),
        ("nan", None),
    ],
)
def test_limits_read_sglangs_env_vars(raw: str | None, seconds: float | None) -> None:
    env = {} if raw is None else {"SGLANG_REQ_WAITING_TIMEOUT": raw, "SGLANG_REQ_RUNNING_TIMEOUT": raw}
    assert Limits.from_env(env) == Limits(waiting_s=seconds, running_s=seconds)


def test_timeout_finish_reasons_are_sglangs() -> None:
    # scheduler._poll_timeout_aborts: the queue's dict as written there; a running one via FINISH_ABORT.
    assert waiting_timeout_reason() == {
        "type": "abort",
        "status_code": 503,
        "message": "Request waiting timeout reached.",
    }
    assert list(waiting_timeout_reason()) == ["type", "status_code", "message"]
    assert running_timeout_reason() == {
        "type": "abort", "message": "Request running timeout reached.", "status_code": 503, "err_type": None,
    }  # fmt: skip


# ---- the supervisor on virtual time: it acts at the deadlines and sleeps in between (no polling) ----


class _FakeEngine:
    def __init__(self, reqs: list[_Req]) -> None:
        self.reqs = reqs
        self.closed = False
        self.is_paused = False
        self.deadlines_changed = asyncio.Event()
        self.last_step_start_s = 0.0
        self.active = False
        self.expired: list[tuple[float, str, str]] = []
        self.checks = 0

    def timed_requests(self) -> list[_Req]:
        self.checks += 1
        return list(self.reqs)

    def watchdog_active(self) -> bool:
        return self.active

    def expire(self, requests: list[Any], reason: dict[str, Any]) -> None:
        for r in requests:
            self.reqs.remove(r)
            self.expired.append((asyncio.get_running_loop().time(), r.rid, reason["message"]))


def test_supervisor_expires_at_the_deadlines_and_is_woken_by_changes() -> None:
    async def main() -> _FakeEngine:
        loop = asyncio.get_running_loop()
        engine = _FakeEngine(
            [_Req("w", queued_s=0.0, started_s=None), _Req("r", queued_s=None, started_s=2.0)]
        )
        sup = Supervisor(
            engine=engine,
            limits=Limits(waiting_s=5.0, running_s=20.0),
            watchdog_timeout_s=None,
            clock=loop.time,
        )
        async with asyncio.TaskGroup() as tg:
            tg.create_task(sup.run())
            await asyncio.sleep(10.0)
            engine.reqs.append(_Req("late", queued_s=10.0, started_s=None))  # due at 15, before "r" (22)
            engine.deadlines_changed.set()
            await asyncio.sleep(20.0)
            engine.closed = True
            engine.deadlines_changed.set()
        return engine

    engine = run_virtual(main())
    assert [(round(t, 6), rid) for t, rid, _ in engine.expired] == [(5.0, "w"), (15.0, "late"), (22.0, "r")]
    assert [m for *_, m in engine.expired] == ["Request waiting timeout reached."] * 2 + [
        "Request running timeout reached."
    ]
    assert engine.checks <= 6  # start, 5, the change, 15, 22, close: one look per event, none in between


def test_supervisor_watchdogs_soft_repeats_and_hard_is_fatal() -> None:
    async def main() -> tuple[list[float], float | None]:
        loop = asyncio.get_running_loop()
        engine = _FakeEngine([])
        fatal: list[float] = []
        sup = Supervisor(
            engine=engine, limits=Limits(), watchdog_timeout_s=10.0, soft_watchdog_timeout_s=3.0,
            on_fatal=lambda: fatal.append(loop.time()), clock=loop.time,
        )  # fmt: skip
        async with asyncio.TaskGroup() as tg:
            tg.create_task(sup.run())
            await asyncio.sleep(1.0)
            engine.active = True  # a step starts at t=1 and never ends
            engine.last_step_start_s = 1.0
            engine.deadlines_changed.set()
            await asyncio.sleep(15.0)
            engine.closed = True
            engine.deadlines_changed.set()
        assert sup.fired[-1] == (fatal[0], False)
        return [t for t, is_soft in sup.fired if is_soft], fatal[0] if fatal else None

    soft, fatal_at = run_virtual(main())
    assert [round(t, 6) for t in soft] == [4.0, 7.0, 10.0]  # SGLang's soft watchdog fires again every timeout
    assert fatal_at == pytest.approx(11.0)


# ---- pure: pydantic's lax coercions (SGLang validates control bodies with pydantic, lax mode) ----

_text = st.text(alphabet=" \t\n\xa0\x1c+-_.0123456789eEtrufalsyonTRUEFALS", max_size=8)
_values = (
    st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.booleans() | st.none() | _text
    | st.just([1])
    | st.sampled_from(["29500", " 7 ", "1_000", "1.00", "1.", "yes", "Off", "2", "-0.0", "9" * 25])
)  # fmt: skip


def _outcome(fn: Callable[[], object], error: type[Exception]) -> tuple[str, object]:
    try:
        value = fn()
    except error as exc:
        return "error", exc
    return "ok", value


@settings(max_examples=1500, deadline=None)
@given(value=_values)
def test_lax_int_and_bool_match_pydantic(value: object) -> None:
    pydantic = pytest.importorskip("pydantic")
    for ours, kind in ((lax_int, int), (lax_bool, bool)):
        expected = _outcome(
            functools.partial(pydantic.TypeAdapter(kind).validate_python, value), pydantic.ValidationError
        )
        got = _outcome(functools.partial(ours, value), ValueError)
        if expected[0] == "error":
            assert got[0] == "error", (value, got)
            assert str(got[1]) == expected[1].errors()[0]["msg"], value  # type: ignore[attr-defined]
        else:
            assert got == expected and type(got[1]) is type(expected[1]), value


# ---- pure: the flattened bucket, byte for byte SGLang's (srt/weight_sync/tensor_bucket.py) ----


@pytest.fixture(scope="module")
def sglang_bucket() -> ModuleType:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip(
            "sglang is not installed (pip install --no-deps sglang): cannot compare the bucket layout"
        )
    path = Path(spec.origin).parent / "srt" / "weight_sync" / "tensor_bucket.py"
    mod_spec = importlib.util.spec_from_file_location("sglang_tensor_bucket_for_tests", path)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.float64]


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 4), max_size=3)), min_size=1, max_size=6
    ),
    seed=st.integers(0, 2**16),
)
def test_flattened_bucket_is_sglangs_byte_for_byte(
    sglang_bucket: ModuleType, specs: list[Any], seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    named = [
        (
            f"t{i}",
            (
                torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
                if dtype == torch.bool
                else torch.randn(shape, generator=g)
            ).to(dtype),
        )
        for i, (dtype, shape) in enumerate(specs)
    ]
    flat, entries = flatten_bucket(named)
    theirs = sglang_bucket.FlattenedTensorBucket(named_tensors=named)
    assert torch.equal(flat, theirs.get_flattened_tensor())
    assert [(e.name, e.shape, e.dtype, e.start, e.end) for e in entries] == [
        (m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx) for m in theirs.get_metadata()
    ]
    names, dtypes, shapes = (
        [n for n, _ in named],
        [t.dtype for _, t in named],
        [list(t.shape) for _, t in named],
    )
    layout, error = bucket_layout(names, dtypes, shapes)
    kind, theirs_empty = _outcome(
        lambda: sglang_bucket.FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu"), ValueError
    )
    if kind == "error":  # the receiver refuses what SGLang's refuses, with its message
        assert error == str(theirs_empty)
    else:
        assert error is None
        assert [(e.start, e.end) for e in layout] == [(e.start, e.end) for e in entries]


# ---- engines ----


@pytest.fixture(scope="module")
def long_models(tmp_path_factory: pytest.TempPathFactory) -> ModelPair:
    root = tmp_path_factory.mktemp("ops-weights")
    return model_pair(root, seeds=(21, 22), alphabet=ALPHABET, hidden_size=64, max_position_embeddings=2048)


def _start(models: ModelPair, log_dir: Path, *args: str, env: dict[str, str] | None = None) -> EngineProcess:
    return EngineProcess(models.m1, "--weights-root", str(models.root), *args, log_dir=log_dir, env=env)


@pytest.fixture(scope="module")
def ops(long_models: ModelPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    proc = _start(long_models, tmp_path_factory.mktemp("ops-logs"), "--max-running-requests", "3")
    yield proc
    assert proc.stop() == 0, proc.stderr()


@pytest.fixture(scope="module")
def timed(long_models: ModelPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    env = {"SGLANG_REQ_WAITING_TIMEOUT": str(WAITING_S), "SGLANG_REQ_RUNNING_TIMEOUT": str(RUNNING_S)}
    proc = _start(
        long_models, tmp_path_factory.mktemp("timed-logs"),
        "--max-running-requests", "1", "--soft-watchdog-timeout", str(SOFT_WATCHDOG_S), env=env,
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0, proc.stderr()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(6) as p:
        yield p


def _reset(url: str) -> None:
    """What every engine test leaves behind: nothing slowed, paused or running."""
    with httpx.Client(base_url=url, timeout=30.0) as c:
        c.post("/slow_down", json={"forward_sleep_time": None})
        c.post("/continue_generation", json={})
        c.post("/abort_request", json={"abort_all": True})


@pytest.fixture
def ops_client(ops: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=ops.url, timeout=30.0) as c:
        yield c
    _reset(ops.url)


@pytest.fixture
def timed_client(timed: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=timed.url, timeout=30.0) as c:
        yield c
    _reset(timed.url)


def _body(rid: str, n: int, **extra: Any) -> dict[str, Any]:
    params = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    return {"rid": rid, "input_ids": PROMPT, "sampling_params": params, **extra}


def _post(pool: ThreadPoolExecutor, url: str, body: dict[str, Any]) -> Future[httpx.Response]:
    return pool.submit(lambda: httpx.post(f"{url}/generate", json=body, timeout=60.0))


def _state(c: httpx.Client) -> dict[str, Any]:
    state: dict[str, Any] = c.get("/server_info").json()["internal_states"][0]
    return state


def _until(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _running(c: httpx.Client, n: int, waiting: int = 0) -> None:
    _until(lambda: (s := _state(c))["num_running_reqs"] == n and s["num_waiting_reqs"] == waiting)


def _ok(f: Future[httpx.Response], api_types: ModuleType) -> dict[str, Any]:
    resp = f.result(timeout=60)
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()
    check_response(api_types, data)
    return data


@slow
def test_duplicate_rid_is_refused_like_sglang(
    ops_client: httpx.Client, ops: EngineProcess, pool: ThreadPoolExecutor, api_types: ModuleType
) -> None:
    # tokenizer_manager._init_req_state raises ValueError("Duplicate request ID detected: <rid>") while the
    # rid is live; serve_generate_request answers it 400 {"error": {"message": ...}} (_create_error_response).
    ops_client.post("/slow_down", json={"forward_sleep_time": SLOW_STEP_S})
    first = _post(pool, ops.url, _body("dup", 400))
    _running(ops_client, 1)
    resp = ops_client.post("/generate", json=_body("dup", 4))
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": "Duplicate request ID detected: dup"}}
    assert _state(ops_client)["num_running_reqs"] == 1  # the first one is untouched
    ops_client.post("/abort_request", json={"rid": "dup"})
    assert _ok(first, api_types)["meta_info"]["finish_reason"] == ABORTED
    ops_client.post("/slow_down", json={"forward_sleep_time": None})
    assert (
        _ok(_post(pool, ops.url, _body("dup", 4)), api_types)["meta_info"]["finish_reason"]["type"]
        == "length"
    )


@slow
def test_abort_messages_running_queued_and_by_prefix(
    ops_client: httpx.Client, ops: EngineProcess, pool: ThreadPoolExecutor, api_types: ModuleType
) -> None:
    # scheduler.abort_request: queued requests are popped and reported by the tokenizer manager's
    # _handle_abort_req as {"type": "abort", "message": "Abort in waiting queue"}; running ones get
    # FINISH_ABORT() ("Aborted"); both answer 200 with what they produced. A live rid aborts every rid it
    # prefixes (startswith); a rid that is not live aborts nothing.
    ops_client.post("/slow_down", json={"forward_sleep_time": SLOW_STEP_S})
    futures = {rid: _post(pool, ops.url, _body(rid, 400)) for rid in ("solo", "grp", "grp_1")}
    _running(ops_client, 3)
    queued = _post(pool, ops.url, _body("queued", 400))
    _running(ops_client, 3, waiting=1)
    time.sleep(0.2)
    assert ops_client.post("/abort_request", json={"rid": "queued"}).status_code == 200
    data = _ok(queued, api_types)
    assert data["meta_info"]["finish_reason"] == ABORTED_IN_QUEUE
    assert data["output_ids"] == [] and data["meta_info"]["completion_tokens"] == 0
    assert ops_client.post("/abort_request", json={"rid": "solo"}).status_code == 200
    solo = _ok(futures["solo"], api_types)
    assert solo["meta_info"]["finish_reason"] == ABORTED
    assert 0 < len(solo["output_ids"]) < 400
    assert ops_client.post("/abort_request", json={"rid": "gr"}).status_code == 200  # not a live rid
    time.sleep(0.2)
    assert _state(ops_client)["num_running_reqs"] == 2
    assert ops_client.post("/abort_request", json={"rid": "grp"}).status_code == 200  # grp and grp_1
    for rid in ("grp", "grp_1"):
        assert _ok(futures[rid], api_types)["meta_info"]["finish_reason"] == ABORTED


@slow
def test_pause_abort_messages_and_requests_held_by_the_pause(
    ops_client: httpx.Client, ops: EngineProcess, pool: ThreadPoolExecutor, api_types: ModuleType
) -> None:
    # tokenizer_manager.pause_generation(mode abort) is abort_request(abort_all=True): the same two
    # messages; requests sent while paused wait (is_pause_cond) and run after continue_generation.
    ops_client.post("/slow_down", json={"forward_sleep_time": SLOW_STEP_S})
    running = [_post(pool, ops.url, _body(f"run{i}", 400)) for i in range(3)]
    _running(ops_client, 3)
    queued = _post(pool, ops.url, _body("queued", 400))
    _running(ops_client, 3, waiting=1)
    assert ops_client.post("/pause_generation", json={"mode": "abort"}).json()["status"] == "ok"
    for f in running:
        assert _ok(f, api_types)["meta_info"]["finish_reason"] == ABORTED
    assert _ok(queued, api_types)["meta_info"]["finish_reason"] == ABORTED_IN_QUEUE
    ops_client.post("/slow_down", json={"forward_sleep_time": None})
    held = _post(pool, ops.url, _body("held", 8))
    _running(ops_client, 0, waiting=1)
    assert not held.done()
    ops_client.post("/continue_generation", json={})
    assert _ok(held, api_types)["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


@slow
def test_server_info_has_the_fields_sglang_clients_read(
    ops_client: httpx.Client, ops: EngineProcess, api_types: ModuleType
) -> None:
    # http_server.server_info: resolved server args + scheduler info + internal_states + version.
    from packaging.version import Version

    info = ops_client.get("/server_info").json()
    api_types.GetServerInfoResponse.from_json_value(info)
    assert info["page_size"] == 1
    assert info["context_length"] == info["max_context_length"] == 2048
    assert info["max_running_requests"] == 3
    assert info["max_total_num_tokens"] == 3 * 2048
    assert info["max_req_input_len"] == 2047
    assert info["weight_version"] == "default"
    assert info["disable_radix_cache"] is False
    assert info["watchdog_timeout"] == 300.0 and info["soft_watchdog_timeout"] is None
    assert (info["tp_size"], info["dp_size"], info["status"], info["frontend"]) == (1, 1, "ready", "python")
    assert Version(info["version"]) >= Version("0.1")  # a version clients can parse: miles_aio's
    assert info["engine"] == "miles_aio-embedded" and Version(info["sglang_api_version"]) >= Version("0.5.23")
    assert info["pid"] == ops.pid
    assert info["request_timeouts"] == {
        "SGLANG_REQ_WAITING_TIMEOUT": None,
        "SGLANG_REQ_RUNNING_TIMEOUT": None,
    }
    state = info["internal_states"][0]
    assert {
        "last_gen_throughput",
        "effective_max_running_requests_per_dp",
        "num_running_reqs",
        "weight_version",
    } <= state.keys()
    assert "api_key" not in info  # SGLang lists its api_key; this engine never echoes it
    assert ops_client.get("/get_server_info").json().keys() == info.keys()


@slow
def test_in_place_check_skips_the_embedded_engine(ops: EngineProcess) -> None:
    # inference/engines.py refuses in_place on SGLang servers with the radix cache on; the embedded engine
    # reports its prefix cache (disable_radix_cache: false) and its marker, and is not refused.
    from miles_aio.inference.engines import _ask_in_place_prefix_cache

    class _Client:
        url = ops.url

        async def server_info(self) -> dict[str, Any]:
            async with httpx.AsyncClient() as c:
                data: dict[str, Any] = (await c.get(f"{ops.url}/server_info")).json()
                return data

    class _Router:
        def __init__(self) -> None:
            self.clients = [_Client()]

    asyncio.run(_ask_in_place_prefix_cache(_Router()))  # type: ignore[arg-type]


@slow
def test_weight_request_bodies_are_validated_like_sglang(ops_client: httpx.Client) -> None:
    # FastAPI validates these msgspec structs with pydantic (lax): strings of digits are ints, "false"
    # is a bool; a body that breaks the schema is RequestValidationError → 400 ErrorResponse.
    def refused(path: str, body: dict[str, Any], field: str) -> None:
        resp = ops_client.post(path, json=body)
        assert resp.status_code == 400, resp.text
        data = resp.json()
        assert data.keys() == {"object", "message", "type", "param", "code"}
        assert (data["object"], data["type"], data["code"]) == ("error", "Bad Request", 400)
        assert f"\n{field}\n" in data["message"], data["message"]

    refused("/update_weight_version", {"new_version": 3}, "new_version")
    refused("/abort_request", {"abort_all": "maybe"}, "abort_all")
    refused("/destroy_weights_update_group", {"group_name": None}, "group_name")
    refused("/update_weights_from_disk", {}, "model_path")
    group = {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2, "backend": "gloo"}
    refused("/init_weights_update_group", {**group, "master_port": "29x"}, "master_port")
    refused(
        "/update_weights_from_distributed",
        {"names": ["x"], "dtypes": ["float32"], "shapes": [["a"]]},
        "shapes.0.0",
    )
    assert ops_client.post("/abort_request", json={"rid": "nobody", "abort_all": "off"}).status_code == 200
    resp = ops_client.post("/update_weight_version", json={"new_version": "v", "abort_all_requests": "false"})
    assert resp.json() == {"success": True, "message": "Weight version updated to v", "new_version": "v"}
    ops_client.post("/update_weight_version", json={"new_version": "default", "abort_all_requests": 0})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@slow
def test_flattened_bucket_update_with_a_string_master_port(
    ops_client: httpx.Client,
    ops: EngineProcess,
    pool: ThreadPoolExecutor,
    long_models: ModelPair,
    api_types: ModuleType,
) -> None:
    # InitWeightsUpdateGroupReqInput.master_port is an int: pydantic takes "29500" (and rank_offset "1",
    # world_size 2.0). load_format "flattened_bucket": one uint8 broadcast of every tensor's bytes
    # (weight_updater._receive_bucketed_weights_from_distributed).
    port, group = _free_port(), "ops_bucket_group"
    body = {
        "master_address": "127.0.0.1",
        "master_port": str(port),
        "rank_offset": "1",
        "world_size": 2.0,
        "group_name": group,
        "backend": "gloo",
    }
    joined = pool.submit(ops_client.post, "/init_weights_update_group", json=body, timeout=60.0)
    pg = init_custom_process_group(
        backend="gloo", master_address="127.0.0.1", master_port=port, world_size=2, rank=0, group_name=group
    )
    assert joined.result().json() == {
        "success": True,
        "message": "Succeeded to initialize custom process group.",
    }
    try:
        before = _ok(_post(pool, ops.url, _body("before", 24, return_logprob=True)), api_types)

        def push(named: list[tuple[str, torch.Tensor]], **extra: Any) -> httpx.Response:
            meta = {
                "names": [n for n, _ in named],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named],
                "group_name": group, "load_format": "flattened_bucket", **extra,
            }  # fmt: skip
            answer = pool.submit(ops_client.post, "/update_weights_from_distributed", json=meta, timeout=60.0)
            broadcast_flattened_bucket(named, group=pg)  # returns: the engine took part in the broadcast
            return answer.result()

        # Mixed dtypes in one bucket (norms in bf16: all 1.0, exact), cast into the float32 engine.
        b = sorted(load_file(str(long_models.m2 / "model.safetensors")).items())
        b = [(n, t.bfloat16() if n.endswith("norm.weight") else t) for n, t in b]
        resp = push(b, weight_version="b")
        assert resp.json() == {
            "success": True,
            "message": "Succeeded to update parameter online. Weight version updated to b.",
        }
        after = _ok(_post(pool, ops.url, _body("after", 24, return_logprob=True)), api_types)
        assert after["meta_info"]["weight_version"] == "b"
        assert logprobs(after) == pytest.approx(
            reference_logprobs(long_models.m2, PROMPT, after["output_ids"]), abs=1e-4
        )
        assert logprobs(after) != pytest.approx(logprobs(before), abs=1e-3)
        # A layout SGLang's receiver refuses: its message, and the served weights stay as they are.
        bad = [
            ("model.norm.weight", torch.zeros(3, dtype=torch.bfloat16)),
            ("model.layers.0.input_layernorm.weight", torch.zeros(64)),
        ]
        resp = push(bad)
        assert resp.status_code == 400
        assert resp.json() == {
            "success": False,
            "message": "Failed to receive weights: Unaligned received tensor "
            "model.layers.0.input_layernorm.weight: byte offset 6, dtype torch.float32",
        }
        again = _ok(_post(pool, ops.url, _body("again", 24, return_logprob=True)), api_types)
        assert again["output_ids"] == after["output_ids"]
    finally:
        assert ops_client.post("/destroy_weights_update_group", json={"group_name": group}).json()["success"]
        destroy_process_group(pg)
        ops_client.post(
            "/update_weights_from_disk", json={"model_path": str(long_models.m1), "weight_version": "default"}
        )


@slow
def test_flush_on_update_is_refused_while_in_place_requests_hold_kv(
    ops_client: httpx.Client,
    ops: EngineProcess,
    pool: ThreadPoolExecutor,
    long_models: ModelPair,
    api_types: ModuleType,
) -> None:
    # scheduler weight_updater.flush_cache_after_weight_update: the weights are loaded, then a flush that
    # requests holding KV prevent fails the call (400) with this message. With flush_cache false it passes.
    ops_client.post("/slow_down", json={"forward_sleep_time": SLOW_STEP_S})
    frozen = _post(pool, ops.url, _body("frozen", 400))
    _running(ops_client, 1)
    time.sleep(0.2)
    ops_client.post("/pause_generation", json={"mode": "in_place"})
    resp = ops_client.post(
        "/update_weights_from_disk", json={"model_path": str(long_models.m2), "weight_version": "b"}
    )
    assert resp.status_code == 400
    assert resp.json() == {"success": False, "message": CACHE_NOT_FLUSHED, "num_paused_requests": 1}
    norm = ops_client.post(
        "/get_weights_by_name", json={"name": "model.layers.0.self_attn.q_proj.weight", "truncate_size": 1}
    ).json()
    q_b = load_file(str(long_models.m2 / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    assert norm[0] == pytest.approx(q_b[0].tolist())  # applied all the same
    resp = ops_client.post(
        "/update_weights_from_disk",
        json={"model_path": str(long_models.m1), "weight_version": "default", "flush_cache": "false"},
    )
    assert resp.json() == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to default.",
        "num_paused_requests": 1,
    }
    ops_client.post("/continue_generation", json={})
    ops_client.post("/abort_request", json={"rid": "frozen"})
    data = _ok(frozen, api_types)
    assert data["meta_info"]["finish_reason"] == ABORTED
    assert [s["version"] for s in data["meta_info"]["weight_versions"]] == ["default"]


@slow
def test_waiting_timeout_while_paused_held_requests_and_running_timeout_at_resume(
    timed_client: httpx.Client, timed: EngineProcess, pool: ThreadPoolExecutor, api_types: ModuleType
) -> None:
    # scheduler._poll_timeout_aborts runs while paused too (ingest_requests): a queued request times out
    # (503, "Request waiting timeout reached."); a request sent during the pause is held by the tokenizer
    # manager, outside the queue, with no clock; a running one frozen in place is aborted at the next forward
    # ("Request running timeout reached."). A non-streaming client gets HTTP 503 with SGLang's ErrorResponse.
    timed_client.post("/slow_down", json={"forward_sleep_time": SLOW_STEP_S})
    t0 = time.monotonic()
    frozen = _post(pool, timed.url, _body("frozen", 400))
    _running(timed_client, 1)
    queued_at = time.monotonic()
    queued = _post(pool, timed.url, _body("queued", 400))
    _running(timed_client, 1, waiting=1)
    timed_client.post("/pause_generation", json={"mode": "in_place"})
    held_at = time.monotonic()
    held = _post(pool, timed.url, _body("held", 8))
    resp = queued.result(timeout=30)
    assert time.monotonic() - queued_at >= WAITING_S
    assert resp.status_code == 503
    assert resp.json() == _error_response("Request waiting timeout reached.", 503, "503")
    time.sleep(max(0.0, held_at + WAITING_S + 0.5 - time.monotonic()))
    assert not held.done()  # no waiting clock while held
    time.sleep(max(0.0, t0 + RUNNING_S + 0.3 - time.monotonic()))
    assert not frozen.done()  # past its running deadline, but frozen: no forward, no abort yet
    assert timed.proc.poll() is None  # the soft watchdog only logs (below)
    assert (
        f"Scheduler watchdog timeout (self.watchdog_timeout={SOFT_WATCHDOG_S}, self.soft=True)"
        in timed.stderr()
    )
    timed_client.post("/slow_down", json={"forward_sleep_time": None})
    timed_client.post("/continue_generation", json={})
    resp = frozen.result(timeout=30)
    assert resp.status_code == 503
    assert resp.json() == _error_response("Request running timeout reached.", 503, "503")
    assert _ok(held, api_types)["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


@slow
def test_retracted_request_times_out_waiting_and_a_long_one_running(
    timed_client: httpx.Client, timed: EngineProcess, pool: ThreadPoolExecutor
) -> None:
    # A retracted request re-enters the queue (set_wait_queue_entry_time): its waiting clock restarts.
    # Streaming, SGLang sends the aborted chunk itself (finish_reason with status_code 503), then [DONE].
    timed_client.post("/slow_down", json={"forward_sleep_time": SLOW_STEP_S})

    def stream() -> list[Any]:
        with httpx.stream(
            "POST", f"{timed.url}/generate", json=_body("retracted", 400, stream=True), timeout=30
        ) as r:
            assert r.status_code == 200
            return [
                json.loads(line[6:]) if line != "data: [DONE]" else line for line in r.iter_lines() if line
            ]

    chunks = pool.submit(stream)
    _running(timed_client, 1)
    time.sleep(0.3)
    retracted_at = time.monotonic()  # before the call: the engine's waiting clock starts inside it
    timed_client.post("/pause_generation", json={"mode": "retract"})
    out = chunks.result(timeout=30)
    assert time.monotonic() - retracted_at >= WAITING_S
    assert out[-1] == "data: [DONE]"
    last = out[-2]
    assert last["meta_info"]["finish_reason"] == waiting_timeout_reason()
    assert len(last["output_ids"]) > 0  # it had run before the retraction
    timed_client.post("/continue_generation", json={})
    started = time.monotonic()
    resp = _post(pool, timed.url, _body("long", 400)).result(timeout=30)
    assert time.monotonic() - started >= RUNNING_S
    assert resp.status_code == 503
    assert resp.json() == _error_response("Request running timeout reached.", 503, "503")


@slow
def test_hard_watchdog_kills_an_engine_frozen_in_place(
    long_models: ModelPair, tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    # utils/watchdog.py + invariant_checker.create_scheduler_watchdog: active while a batch is current
    # (cur_batch_for_debug), counter forward_ct. A retract pause leaves no batch (no kill); an in_place pause
    # keeps it, so past --watchdog-timeout the scheduler logs, dumps, and the server is SIGKILLed.
    proc = _start(long_models, tmp_path, "--watchdog-timeout", str(WATCHDOG_S))
    try:
        with httpx.Client(base_url=proc.url, timeout=30.0) as c:
            c.post("/slow_down", json={"forward_sleep_time": SLOW_STEP_S})
            request = _post(pool, proc.url, _body("victim", 400))
            _running(c, 1)
            c.post("/pause_generation", json={"mode": "retract"})
            time.sleep(WATCHDOG_S + 0.7)
            assert proc.proc.poll() is None  # retracted: nothing in the running batch
            c.post("/continue_generation", json={})
            _running(c, 1)
            paused_at = time.monotonic()
            c.post("/pause_generation", json={"mode": "in_place"})
        assert proc.proc.wait(timeout=30) == -signal.SIGKILL
        assert time.monotonic() - paused_at >= WATCHDOG_S - 0.1
        assert (
            f"Scheduler watchdog timeout (self.watchdog_timeout={WATCHDOG_S}, self.soft=False)"
            in proc.stderr()
        )
        with pytest.raises(httpx.TransportError):
            request.result(timeout=30)
    finally:
        proc.stop()
