"""SGLang parity of `/generate` request shapes and server behaviour: n > 1, batch input, streaming,
prefix-cache accounting, abort-all, and pause modes combined with weight updates mid-generation.

Runs against the embedded engine, or a real SGLang server with MILES_AIO_SGLANG_URL (see parity.py;
weight-update tests need MILES_AIO_SGLANG_UPDATE_MODEL there). Shapes: `managers/io_struct.py`
(`GenerateReqInput.normalize_batch_and_arguments`: batch of input_ids/text, per-item sampling_params,
rid lists, `n` → parallel_sample_num), `managers/tokenizer_manager.py` (`_handle_batch_request`: one
answer per prompt x sample, prompt-major, after a shared 0-token prefill of each prompt; streaming
chunks are cumulative unless --incremental-streaming-output), `entrypoints/http_server.py` (SSE framing).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import Any

import httpx
import pytest

from tests.engine.helpers import check_response, reference_logprobs, token_versions
from tests.engine.parity import (
    ATOL,
    ParityServer,
    lps,
    make_text,
    post_generate,
    prompt_ids,
    server_state,
    stream_generate,
    tokenize,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _sampled(n: int, seed: int | None = None, **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True, **extra}
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def _greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(12) as p:
        yield p


def _submit(
    pool: ThreadPoolExecutor, url: str, api_types: ModuleType, body: dict[str, Any]
) -> Future[dict[str, Any]]:
    def run() -> dict[str, Any]:
        with httpx.Client(base_url=url, timeout=120.0) as c:
            data: dict[str, Any] = post_generate(c, api_types, body)
            return data

    return pool.submit(run)


# ---- n > 1 and batch input ----


def test_n_samples_of_one_prompt(server: httpx.Client, api_types: ModuleType) -> None:
    prompt = prompt_ids(server, api_types, 200, seed=40)
    assert server.post("/flush_cache").status_code == 200
    body = {"input_ids": prompt, "sampling_params": {"n": 4, **_sampled(64)}, "return_logprob": True}
    data = post_generate(server, api_types, body)
    assert isinstance(data, list)
    assert len(data) == 4
    assert len({tuple(d["output_ids"]) for d in data}) == 4  # independent samples
    assert len({d["meta_info"]["id"] for d in data}) == 4  # regenerate_rid: one rid per sample
    for d in data:
        meta = d["meta_info"]
        assert meta["prompt_tokens"] == 200
        assert meta["completion_tokens"] == len(meta["output_token_logprobs"]) == 64
        assert meta["finish_reason"] == {"type": "length", "length": 64}
        # The prompt is prefilled once (a max_new_tokens=0 copy) and every sample reuses its KV.
        assert meta["cached_tokens"] == 199
    text = make_text(150, seed=41)
    by_text = post_generate(
        server,
        api_types,
        {"text": text, "sampling_params": {"n": 3, **_sampled(16)}, "return_prompt_token_ids": True},
    )
    assert [d["prompt_token_ids"] for d in by_text] == [tokenize(server, api_types, text)] * 3


def test_batch_with_n_is_prompt_major(server: httpx.Client, api_types: ModuleType) -> None:
    p0 = prompt_ids(server, api_types, 100, seed=42)
    p1 = prompt_ids(server, api_types, 140, seed=43)
    body = {"input_ids": [p0, p1], "sampling_params": {"n": 3, **_sampled(24)}}
    data = post_generate(server, api_types, body)
    assert [d["meta_info"]["prompt_tokens"] for d in data] == [100, 100, 100, 140, 140, 140]
    assert all(d["meta_info"]["completion_tokens"] == 24 for d in data)
    assert len({tuple(d["output_ids"]) for d in data}) == 6


def test_batch_input_ids_keep_order_and_per_item_params(server: httpx.Client, api_types: ModuleType) -> None:
    prompts = [prompt_ids(server, api_types, n, seed=s) for n, s in ((120, 44), (180, 45), (240, 46))]
    params = [_greedy(20), _greedy(40), _sampled(60, seed=7)]
    solo = [
        post_generate(server, api_types, {"input_ids": p, "sampling_params": sp, "return_logprob": True})
        for p, sp in zip(prompts, params, strict=True)
    ]
    batch = post_generate(
        server,
        api_types,
        {"input_ids": prompts, "sampling_params": params, "return_logprob": True, "rid": ["b0", "b1", "b2"]},
    )
    assert isinstance(batch, list)
    assert len(batch) == 3
    for i, (b, s) in enumerate(zip(batch, solo, strict=True)):
        assert b["meta_info"]["id"] == f"b{i}"
        assert b["meta_info"]["prompt_tokens"] == len(prompts[i])
        assert b["output_ids"] == s["output_ids"]
        assert lps(b["meta_info"]["output_token_logprobs"]) == pytest.approx(
            lps(s["meta_info"]["output_token_logprobs"]), abs=ATOL
        )
    # One sampling_params dict applies to every item; a rid string becomes rid_0, rid_1, ...
    shared = post_generate(
        server, api_types, {"input_ids": prompts, "sampling_params": _greedy(40), "rid": "sh"}
    )
    assert [d["meta_info"]["id"] for d in shared] == ["sh_0", "sh_1", "sh_2"]
    assert [d["meta_info"]["completion_tokens"] for d in shared] == [40, 40, 40]
    assert shared[0]["output_ids"][:20] == solo[0]["output_ids"]
    assert shared[1]["output_ids"] == solo[1]["output_ids"]


def test_batch_text_keeps_order(server: httpx.Client, api_types: ModuleType) -> None:
    texts = [make_text(n, seed=s) for n, s in ((90, 47), (260, 48), (170, 49))]
    body = {"text": texts, "sampling_params": _greedy(30), "return_prompt_token_ids": True}
    batch = post_generate(server, api_types, body)
    assert len(batch) == 3
    for t, b in zip(texts, batch, strict=True):
        solo = post_generate(server, api_types, {"text": t, "sampling_params": _greedy(30)})
        assert b["prompt_token_ids"] == tokenize(server, api_types, t)
        assert b["meta_info"]["prompt_tokens"] == len(b["prompt_token_ids"])
        assert b["output_ids"] == solo["output_ids"]
        assert b["text"] == solo["text"]


# ---- streaming ----


def test_stream_chunks_add_up_to_the_non_stream_answer(
    server: httpx.Client, api_types: ModuleType, server_url: str
) -> None:
    prompt = prompt_ids(server, api_types, 150, seed=50)
    body = {"input_ids": prompt, "sampling_params": _sampled(120, seed=13), "return_logprob": True}
    full = post_generate(server, api_types, body)
    chunks = stream_generate(server_url, api_types, {**body, "stream": True})
    assert len(chunks) > 1
    *partial, last = chunks
    assert all(c["meta_info"]["finish_reason"] is None for c in partial)
    assert last["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    check_response(api_types, last)
    if server.get("/server_info").json().get("incremental_streaming_output", False):
        ids = [t for c in chunks for t in c["output_ids"]]
        text = "".join(c["text"] for c in chunks)
        entries = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    else:
        # Default: every chunk carries everything so far (tokenizer_manager._handle_batch_output).
        for prev, cur in itertools.pairwise(chunks):
            assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
            assert len(cur["output_ids"]) > len(prev["output_ids"])
            assert cur["text"].startswith(prev["text"])
        for c in chunks:
            assert c["meta_info"]["completion_tokens"] == len(c["output_ids"])
            assert [e[1] for e in c["meta_info"]["output_token_logprobs"]] == c["output_ids"]
        ids, text = last["output_ids"], last["text"]
        entries = last["meta_info"]["output_token_logprobs"]
    assert ids == full["output_ids"]
    assert text == full["text"]
    assert lps(entries) == pytest.approx(lps(full["meta_info"]["output_token_logprobs"]), abs=ATOL)


def test_stream_stops_on_a_stop_string_like_non_stream(
    server: httpx.Client, api_types: ModuleType, server_url: str
) -> None:
    prompt = prompt_ids(server, api_types, 120, seed=51)
    text = post_generate(server, api_types, {"input_ids": prompt, "sampling_params": _greedy(200)})["text"]
    stop = text[150:152]
    body = {"input_ids": prompt, "sampling_params": {**_greedy(200), "stop": stop}}
    full = post_generate(server, api_types, body)
    last = stream_generate(server_url, api_types, {**body, "stream": True})[-1]
    assert full["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert last["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    if not server.get("/server_info").json().get("incremental_streaming_output", False):
        assert last["output_ids"] == full["output_ids"]
        assert last["text"] == full["text"] == text[: text.find(stop)]


# ---- prefix cache ----


def test_cached_tokens_on_repeated_and_extended_prompts(server: httpx.Client, api_types: ModuleType) -> None:
    """cache_hit_kit: a repeated prompt reuses all but its last token (the radix match is capped at
    len - 1 so one token is fed, Req._compute_max_prefix_len); outputs are unchanged by the hit."""
    prompt = prompt_ids(server, api_types, 400, seed=52)
    assert server.post("/flush_cache").status_code == 200
    body = {"input_ids": prompt, "sampling_params": _greedy(100), "return_logprob": True}
    first = post_generate(server, api_types, body)
    second = post_generate(server, api_types, body)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == 399
    assert second["output_ids"] == first["output_ids"]
    assert lps(second["meta_info"]["output_token_logprobs"]) == pytest.approx(
        lps(first["meta_info"]["output_token_logprobs"]), abs=ATOL
    )
    ext = post_generate(
        server,
        api_types,
        {
            "input_ids": prompt + first["output_ids"][:50],
            "sampling_params": _greedy(50),
            "return_logprob": True,
        },
    )
    assert ext["meta_info"]["cached_tokens"] >= 400
    assert ext["output_ids"] == first["output_ids"][50:]
    assert lps(ext["meta_info"]["output_token_logprobs"]) == pytest.approx(
        lps(first["meta_info"]["output_token_logprobs"])[50:], abs=ATOL
    )


# ---- abort and pause ----


def test_abort_all_answers_running_and_waiting_requests(
    server: httpx.Client,
    api_types: ModuleType,
    server_url: str,
    parity_server: ParityServer,
    pool: ThreadPoolExecutor,
) -> None:
    prompt = prompt_ids(server, api_types, 100, seed=53)
    n_req, n_new = 10, 400  # the embedded engine runs 8 at a time: 2 wait
    server.post("/slow_down", json={"forward_sleep_time": 0.01})
    try:
        futures = [
            _submit(
                pool,
                server_url,
                api_types,
                {"input_ids": prompt, "sampling_params": _sampled(n_new, seed=i), "return_logprob": True},
            )
            for i in range(n_req)
        ]
        deadline = time.monotonic() + 20
        state: dict[str, Any] = {}
        if parity_server.embedded:
            while time.monotonic() < deadline:
                state = server_state(server)
                if (state["num_running_reqs"], state["num_waiting_reqs"]) == (8, 2):
                    break
                time.sleep(0.05)
            assert (state["num_running_reqs"], state["num_waiting_reqs"]) == (8, 2)
        time.sleep(0.5)
        assert server.post("/abort_request", json={"abort_all": True}).status_code == 200
        results = [f.result(timeout=30) for f in futures]
    finally:
        server.post("/slow_down", json={"forward_sleep_time": None})
    for data in results:
        assert data["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(data["output_ids"]) < n_new
        assert len(data["meta_info"]["output_token_logprobs"]) == len(data["output_ids"])
    if parity_server.embedded:
        assert sorted(len(d["output_ids"]) > 0 for d in results) == [False] * 2 + [True] * 8
        state = server_state(server)
        assert (state["num_running_reqs"], state["num_waiting_reqs"]) == (0, 0)
    after = post_generate(server, api_types, {"input_ids": prompt, "sampling_params": _greedy(5)})
    assert after["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def _update(client: httpx.Client, path: str, version: str, **extra: Any) -> None:
    resp = client.post(
        "/update_weights_from_disk", json={"model_path": path, "weight_version": version, **extra}
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["success"], resp.text


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_update_continue_mid_generation(
    server: httpx.Client,
    api_types: ModuleType,
    server_url: str,
    parity_server: ParityServer,
    pool: ThreadPoolExecutor,
    mode: str,
) -> None:
    """pause_generation_kit + the weight-version spans (utils/weight_versions.py): tokens sampled before
    the update carry the old version, those after it the new one, as contiguous [start, end) spans."""
    update_model = parity_server.require_update_model()
    prompts = [prompt_ids(server, api_types, 200, seed=60 + i) for i in range(3)]
    n_new = 240
    _update(server, parity_server.base_model, "v1")
    try:
        server.post("/slow_down", json={"forward_sleep_time": 0.01})
        running = [
            _submit(
                pool,
                server_url,
                api_types,
                {"input_ids": p, "sampling_params": _sampled(n_new, seed=i), "return_logprob": True},
            )
            for i, p in enumerate(prompts)
        ]
        time.sleep(0.6)
        resp = server.post("/pause_generation", json={"mode": mode})
        assert resp.status_code == 200
        assert resp.json()["status"] == "ok"
        server.post("/slow_down", json={"forward_sleep_time": None})
        if mode == "abort":
            aborted = [f.result(timeout=10) for f in running]  # answered by the pause itself
            for data in aborted:
                assert data["meta_info"]["finish_reason"]["type"] == "abort"
                assert 0 < len(data["output_ids"]) < n_new
                assert set(token_versions(data)) == {"v1"}
        _update(server, update_model, "v2", flush_cache=mode != "in_place")
        assert server.post("/continue_generation", json={}).status_code == 200
        if mode != "abort":
            for prompt, future in zip(prompts, running, strict=True):
                data = future.result(timeout=60)
                meta = data["meta_info"]
                assert meta["finish_reason"] == {"type": "length", "length": n_new}
                versions = token_versions(data)
                k = versions.index("v2")
                assert 0 < k < n_new
                assert meta["weight_versions"] == [
                    {"version": "v1", "start": 0, "end": k},
                    {"version": "v2", "start": k, "end": n_new},
                ]
                assert meta["weight_version"] == "v2"
                if mode == "retract":
                    assert meta["num_retractions"] == 1
                    if parity_server.local_base is not None and parity_server.local_update is not None:
                        # Retracted: the whole context is recomputed under the new weights.
                        out, got = data["output_ids"], lps(meta["output_token_logprobs"])
                        old = reference_logprobs(parity_server.local_base, prompt, out)
                        new = reference_logprobs(parity_server.local_update, prompt, out)
                        assert got[:k] == pytest.approx(old[:k], abs=ATOL)
                        assert got[k:] == pytest.approx(new[k:], abs=ATOL)
        fresh_prompt = prompt_ids(server, api_types, 150, seed=69)
        fresh = post_generate(
            server,
            api_types,
            {"input_ids": fresh_prompt, "sampling_params": _greedy(20), "return_logprob": True},
        )
        assert fresh["meta_info"]["weight_versions"] == [{"version": "v2", "start": 0, "end": 20}]
        if parity_server.local_update is not None:
            ref = reference_logprobs(parity_server.local_update, fresh_prompt, fresh["output_ids"])
            assert lps(fresh["meta_info"]["output_token_logprobs"]) == pytest.approx(ref, abs=ATOL)
    finally:
        server.post("/slow_down", json={"forward_sleep_time": None})
        server.post("/continue_generation", json={})
        _update(server, parity_server.base_model, "default")
