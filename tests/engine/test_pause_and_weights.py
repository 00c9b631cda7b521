"""Pause modes, weight updates mid-request and per-token version spans, on a real engine process.

Requests are slowed with SGLang's `/slow_down` test hook so they are mid-flight when the test acts; the
slowdown is lifted as soon as the test has paused, so the rest runs at full speed. Every test puts the
served weights back to m1 on exit, so test order does not matter.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from tests.engine.helpers import (
    EngineProcess,
    Models,
    check_response,
    generate,
    logprobs,
    reference_logprobs,
    token_versions,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

ATOL = 1e-4
PROMPT = [5, 6, 7, 8, 9, 10]
STEP_SLEEP_S = 0.03
MID_FLIGHT_S = 0.3  # ~10 tokens in at STEP_SLEEP_S per step


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as p:
        yield p


@pytest.fixture(autouse=True)
def _restore(client: httpx.Client, models: Models) -> Iterator[None]:
    yield
    client.post("/slow_down", json={"forward_sleep_time": None})
    client.post("/continue_generation", json={})
    resp = client.post(
        "/update_weights_from_disk", json={"model_path": str(models.m1), "weight_version": "m1"}
    )
    assert resp.json()["success"], resp.text


def _submit(
    pool: ThreadPoolExecutor, url: str, api_types: ModuleType, body: dict[str, Any]
) -> Future[dict[str, Any]]:
    """POST /generate from a worker thread; body and answer are checked against SGLang's schema."""
    api_types.GenerateRequest.from_json_value(body)

    def run() -> dict[str, Any]:
        resp = httpx.post(f"{url}/generate", json=body, timeout=60.0)
        assert resp.status_code == 200, resp.text
        data: dict[str, Any] = resp.json()
        check_response(api_types, data)
        return data

    return pool.submit(run)


def _body(n: int, *, temperature: float = 1.0, seed: int = 0, prompt: list[int] = PROMPT) -> dict[str, Any]:
    return {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {
            "max_new_tokens": n,
            "temperature": temperature,
            "sampling_seed": seed,
            "ignore_eos": True,
        },
    }


def _state(client: httpx.Client) -> dict[str, Any]:
    state: dict[str, Any] = client.get("/server_info").json()["internal_states"][0]
    return state


def _update(client: httpx.Client, path: Path, version: str, **extra: Any) -> dict[str, Any]:
    resp = client.post(
        "/update_weights_from_disk", json={"model_path": str(path), "weight_version": version, **extra}
    )
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()
    return data


def _pause_mid_flight(client: httpx.Client, mode: str) -> None:
    time.sleep(MID_FLIGHT_S)
    assert client.post("/pause_generation", json={"mode": mode}).json()["status"] == "ok"
    client.post("/slow_down", json={"forward_sleep_time": None})


def test_pause_abort_returns_partial_output_and_queues_new_requests(
    client: httpx.Client, api_types: ModuleType, engine: EngineProcess, pool: ThreadPoolExecutor
) -> None:
    client.post("/slow_down", json={"forward_sleep_time": STEP_SLEEP_S})
    running = _submit(pool, engine.url, api_types, _body(200))
    _pause_mid_flight(client, "abort")
    data = running.result(timeout=5)  # pause(abort) returned only once the request had answered
    check_response(api_types, data)
    assert data["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(data["output_ids"]) < 200
    assert len(logprobs(data)) == len(data["output_ids"])

    queued = _submit(pool, engine.url, api_types, _body(5))
    time.sleep(0.3)
    assert not queued.done()
    state = _state(client)
    assert state["paused"] is True
    assert state["num_waiting_reqs"] == 1
    assert client.post("/continue_generation", json={}).json()["status"] == "ok"
    assert queued.result(timeout=10)["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_retract_reprefills_under_new_weights_with_version_spans(
    client: httpx.Client,
    api_types: ModuleType,
    engine: EngineProcess,
    models: Models,
    pool: ThreadPoolExecutor,
) -> None:
    _update(client, models.m1, "1")
    client.post("/slow_down", json={"forward_sleep_time": STEP_SLEEP_S})
    running = _submit(pool, engine.url, api_types, _body(40, seed=11))
    _pause_mid_flight(client, "retract")
    state = _state(client)
    assert state["num_running_reqs"] == 0  # retracted: its KV is dropped ...
    assert state["num_waiting_reqs"] == 1  # ... and it waits at the front of the queue
    assert client.post("/flush_cache").status_code == 200  # nothing holds KV now (SGLang allows this too)
    assert _update(client, models.m2, "2")["num_paused_requests"] == 1
    client.post("/continue_generation", json={})
    data = running.result(timeout=20)

    check_response(api_types, data)
    assert data["meta_info"]["finish_reason"]["type"] == "length"
    assert data["meta_info"]["num_retractions"] == 1
    versions = token_versions(data)
    k = versions.index("2")
    assert 0 < k < 40
    assert versions == ["1"] * k + ["2"] * (40 - k)
    assert data["meta_info"]["weight_versions"] == [
        {"version": "1", "start": 0, "end": k},
        {"version": "2", "start": k, "end": 40},
    ]
    # Tokens before the swap came from m1; after it, from m2 recomputing the whole context (retract).
    out = data["output_ids"]
    assert logprobs(data)[:k] == pytest.approx(reference_logprobs(models.m1, PROMPT, out)[:k], abs=ATOL)
    assert logprobs(data)[k:] == pytest.approx(reference_logprobs(models.m2, PROMPT, out)[k:], abs=ATOL)


def test_in_place_resumes_on_old_kv_and_old_kv_is_never_served_to_new_requests(
    client: httpx.Client,
    api_types: ModuleType,
    engine: EngineProcess,
    models: Models,
    pool: ThreadPoolExecutor,
) -> None:
    # 1. Relabel only (update_weight_version): in-place resumption is bit-for-bit the unpaused run.
    baseline = generate(client, api_types, _body(30, temperature=0.0))
    client.post("/slow_down", json={"forward_sleep_time": STEP_SLEEP_S})
    running = _submit(pool, engine.url, api_types, _body(30, temperature=0.0))
    _pause_mid_flight(client, "in_place")
    assert _state(client)["num_running_reqs"] == 1  # frozen on its KV
    assert client.post("/flush_cache").status_code == 400  # SGLang refuses while requests hold KV
    client.post("/update_weight_version", json={"new_version": "relabelled", "abort_all_requests": False})
    client.post("/continue_generation", json={})
    data = running.result(timeout=20)
    check_response(api_types, data)
    assert data["output_ids"] == baseline["output_ids"]
    assert logprobs(data) == pytest.approx(logprobs(baseline), abs=ATOL)
    spans = data["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["m1", "relabelled"]

    # 2. A real weight swap during an in-place pause, with flush_cache false: the frozen request keeps
    # its old KV, but a new request with the same prompt must not reuse any of it.
    client.post("/slow_down", json={"forward_sleep_time": STEP_SLEEP_S})
    running = _submit(pool, engine.url, api_types, _body(30, temperature=0.0))
    _pause_mid_flight(client, "in_place")
    _update(client, models.m2, "m2", flush_cache=False)
    fresh = _submit(pool, engine.url, api_types, _body(10, temperature=0.0))
    client.post("/continue_generation", json={})
    frozen, new = running.result(timeout=20), fresh.result(timeout=20)
    check_response(api_types, frozen)
    assert [s["version"] for s in frozen["meta_info"]["weight_versions"]] == ["relabelled", "m2"]
    assert new["meta_info"]["cached_tokens"] == 0
    assert token_versions(new) == ["m2"] * 10
    assert logprobs(new) == pytest.approx(reference_logprobs(models.m2, PROMPT, new["output_ids"]), abs=ATOL)


def test_prefix_cache_is_invalidated_by_weight_updates_even_without_flush(
    client: httpx.Client, api_types: ModuleType, models: Models
) -> None:
    body = _body(8, temperature=0.0, prompt=[20, 21, 22, 23, 24, 25, 26])
    generate(client, api_types, body)
    assert generate(client, api_types, body)["meta_info"]["cached_tokens"] == 6  # warm under m1
    _update(client, models.m2, "m2", flush_cache=False)
    after = generate(client, api_types, body)
    assert after["meta_info"]["cached_tokens"] == 0
    assert logprobs(after) == pytest.approx(
        reference_logprobs(models.m2, body["input_ids"], after["output_ids"]), abs=ATOL
    )
    assert generate(client, api_types, body)["meta_info"]["cached_tokens"] == 6  # warm again, under m2


def test_unpaused_update_waits_for_inflight_requests(
    client: httpx.Client,
    api_types: ModuleType,
    engine: EngineProcess,
    models: Models,
    pool: ThreadPoolExecutor,
) -> None:
    """As SGLang's model_update_lock: in-flight requests finish on the old weights; later ones wait."""
    client.post("/slow_down", json={"forward_sleep_time": STEP_SLEEP_S})
    old = _submit(pool, engine.url, api_types, _body(20, temperature=0.0))
    time.sleep(MID_FLIGHT_S)
    update = pool.submit(_update, client, models.m2, "after")
    time.sleep(0.1)
    later = _submit(pool, engine.url, api_types, _body(5, temperature=0.0))
    old_data = old.result(timeout=20)
    assert update.result(timeout=20)["success"]
    later_data = later.result(timeout=20)
    check_response(api_types, old_data)
    assert len(old_data["meta_info"]["weight_versions"]) == 1
    assert old_data["meta_info"]["weight_version"] != "after"
    assert token_versions(later_data) == ["after"] * 5
    assert logprobs(later_data) == pytest.approx(
        reference_logprobs(models.m2, PROMPT, later_data["output_ids"]), abs=ATOL
    )


@pytest.mark.parametrize(
    ("path_of", "needle"),
    [
        (lambda m: m.outside, "outside"),
        (lambda m: m.root / "does-not-exist", "not a directory"),
        (lambda m: m.root.parent, "outside"),
        (lambda m: m.wrong_shape, "shape mismatch"),
        (lambda m: m.root / "escape", "outside"),  # a symlink under the root that points out of it
    ],
)
def test_bad_weight_updates_are_refused_and_weights_unchanged(
    client: httpx.Client, api_types: ModuleType, models: Models, path_of: Any, needle: str
) -> None:
    escape = models.root / "escape"
    if not escape.exists():
        escape.symlink_to(models.outside, target_is_directory=True)
    before = generate(client, api_types, _body(6, temperature=0.0))
    path = path_of(models)
    resp = client.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": "bad"})
    assert resp.status_code == 400
    assert resp.json()["success"] is False
    assert needle in resp.json()["message"]
    after = generate(client, api_types, _body(6, temperature=0.0))
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]
    assert client.get("/model_info").json()["model_path"] == str(models.m1)


def test_unsupported_load_format_is_refused(client: httpx.Client, models: Models) -> None:
    resp = client.post(
        "/update_weights_from_disk", json={"model_path": str(models.m2), "load_format": "gguf"}
    )
    assert resp.status_code == 400
    assert "gguf" in resp.json()["message"]
