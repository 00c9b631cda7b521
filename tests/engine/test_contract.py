"""Every endpoint of the embedded engine, with SGLang's field names, checked with SGLang's schema."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from miles_aio.engine.server import stop_match_text
from miles_aio.models.tiny import build_tiny_llama
from tests.engine.helpers import EngineProcess, check_response, generate, logprobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

PROMPT = [5, 6, 7, 8, 9]


def _greedy(n: int, **extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.0, **extra}


def test_generate_contract(client: httpx.Client, api_types: ModuleType) -> None:
    body = {"input_ids": PROMPT, "sampling_params": _greedy(6), "return_logprob": True, "rid": "contract-1"}
    data = generate(client, api_types, body)
    meta = data["meta_info"]
    assert meta["id"] == "contract-1"
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["weight_version"] == "default"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    assert all(lp <= 0.0 for lp in logprobs(data))
    assert all(e[2] is None for e in meta["output_token_logprobs"])  # text only with return_text_in_logprobs
    # Without return_logprob there are no logprobs, as in SGLang.
    plain = generate(client, api_types, {"input_ids": PROMPT, "sampling_params": _greedy(6)})
    assert "output_token_logprobs" not in plain["meta_info"]
    assert plain["output_ids"] == data["output_ids"]  # greedy is deterministic


def test_text_input_and_text_in_logprobs(client: httpx.Client, api_types: ModuleType) -> None:
    body = {
        "text": "abc",
        "sampling_params": _greedy(4),
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "return_prompt_token_ids": True,
    }
    data = generate(client, api_types, body)
    assert data["prompt_token_ids"] == [3, 4, 5]  # <pad> <s> </s> then the alphabet: a=3, b=4, c=5
    entries = data["meta_info"]["output_token_logprobs"]
    assert all(isinstance(e[2], str) and len(e[2]) >= 1 for e in entries)


def test_eos_stop_token_ids_and_ignore_eos(client: httpx.Client, api_types: ModuleType) -> None:
    first = generate(client, api_types, {"input_ids": PROMPT, "sampling_params": _greedy(3)})["output_ids"][0]
    # Stopping on a stop token id: finish_reason stop, matched = the id; the token is kept (SGLang does).
    data = generate(
        client, api_types, {"input_ids": PROMPT, "sampling_params": _greedy(8, stop_token_ids=[first])}
    )
    assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert data["output_ids"] == [first]
    # ignore_eos also ignores stop_token_ids (SGLang's _check_token_based_finish).
    data = generate(
        client,
        api_types,
        {"input_ids": PROMPT, "sampling_params": _greedy(3, stop_token_ids=[first], ignore_eos=True)},
    )
    assert data["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_strings(client: httpx.Client, api_types: ModuleType) -> None:
    full = generate(client, api_types, {"input_ids": PROMPT, "sampling_params": _greedy(12, ignore_eos=True)})
    text = full["text"]
    stop = text[3:5]  # a stop string the greedy continuation produces
    cut = text.find(stop)
    data = generate(client, api_types, {"input_ids": PROMPT, "sampling_params": _greedy(12, stop=[stop])})
    assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert data["text"] == text[:cut]  # trimmed, as SGLang does unless no_stop_trim
    kept = generate(
        client, api_types, {"input_ids": PROMPT, "sampling_params": _greedy(12, stop=stop, no_stop_trim=True)}
    )
    assert kept["text"] == text[: cut + len(stop)]


def test_sampling_seed_is_deterministic(client: httpx.Client, api_types: ModuleType) -> None:
    params = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "top_k": 20, "sampling_seed": 1234}
    a = generate(client, api_types, {"input_ids": PROMPT, "sampling_params": params, "return_logprob": True})
    b = generate(client, api_types, {"input_ids": PROMPT, "sampling_params": params, "return_logprob": True})
    assert a["output_ids"] == b["output_ids"]
    assert logprobs(a) == pytest.approx(logprobs(b), abs=1e-5)


def test_max_new_tokens_zero(client: httpx.Client, api_types: ModuleType) -> None:
    data = generate(client, api_types, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}})
    assert data["output_ids"] == []
    assert data["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert data["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": 0}]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input_ids": []}, "input_ids must not be empty"),
        ({"input_ids": "abc"}, "input_ids"),
        ({"input_ids": [1, True]}, "input_ids"),
        ({"input_ids": [1, 2], "text": "ab"}, "Either text, input_ids"),
        ({"input_ids": [1, 10_000]}, "out of range"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [1], "sampling_params": {"no_such_param": 1}}, "no_such_param"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 10_000}}, "context length"),
        ({"input_ids": [1], "sampling_params": {"n": 0}}, "n must be at least 1"),
        ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "regex"),
        ({"input_ids": [1], "sampling_params": {"logit_bias": {"9999": 1.0}}}, "logit_bias must has keys"),
        ({"input_ids": [1], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, "min_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 3.0}}, "frequency_penalty"),
        ({"input_ids": [[1], []]}, "input_ids[1] must not be empty"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "as long as the batch"),
        ({"input_ids": [1], "logprob_start_len": -2}, "logprob_start_len"),
        ({"input_ids": [1], "return_logprob": True, "token_ids_logprob": [9999]}, "token_ids_logprob"),
        ([1, 2, 3], "GenerateRequest"),
    ],
)
def test_bad_generate_requests_are_400(client: httpx.Client, body: Any, needle: str) -> None:
    resp = client.post("/generate", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    message = err if isinstance(err, str) else err["message"]
    assert needle in message


def test_bad_control_requests_are_400_and_server_keeps_serving(
    client: httpx.Client, api_types: ModuleType
) -> None:
    assert client.post("/generate", content=b"{not json").status_code == 400
    resp = client.post("/pause_generation", json={"mode": "sideways"})
    assert resp.status_code == 400
    assert "sideways" in resp.json()["error"]["message"]
    resp = client.post("/update_weight_version", json={"new_version": 3})  # SGLang's type is str
    assert resp.status_code == 400
    assert resp.json()["object"] == "error"  # SGLang's validation error (ErrorResponse), not {"success"}
    resp = client.post("/update_weights_from_disk", json={})
    assert resp.status_code == 400
    assert "model_path" in resp.json()["message"]
    resp = client.post(
        "/init_weights_update_group",
        json={
            "master_address": "127.0.0.1",
            "master_port": 1,
            "rank_offset": 1,
            "world_size": 2,
            "backend": "nccl",
        },
    )
    assert resp.status_code == 400
    assert "gloo" in resp.json()["message"]
    resp = client.post(
        "/update_weights_from_distributed",
        json={"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"},
    )
    assert resp.status_code == 400
    assert "init_weights_update_group" in resp.json()["message"]
    assert client.post("/destroy_weights_update_group", json={"group_name": "nope"}).status_code == 400
    assert client.get("/no_such_route").status_code == 404
    generate(client, api_types, {"input_ids": PROMPT, "sampling_params": _greedy(2)})  # still serving


def test_info_health_and_cache_endpoints(
    client: httpx.Client, api_types: ModuleType, engine: EngineProcess
) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    info = client.get("/model_info").json()
    api_types.GetModelInfoResponse.from_json_value(info)
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert info["is_generation"] is True
    assert client.get("/get_model_info").json() == info  # SGLang's deprecated alias
    server = client.get("/server_info").json()
    api_types.GetServerInfoResponse.from_json_value(server)
    assert server["pid"] == engine.pid
    state = server["internal_states"][0]
    assert {"num_running_reqs", "num_waiting_reqs", "weight_version"} <= state.keys()
    assert client.post("/flush_cache").status_code == 200
    assert client.get("/flush_cache").text.startswith("Cache flushed")
    weights = client.post(
        "/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 3}
    ).json()
    assert weights == [1.0, 1.0, 1.0]


def test_update_weight_version_and_its_abort_flag(client: httpx.Client, api_types: ModuleType) -> None:
    try:
        resp = client.post("/update_weight_version", json={"new_version": "5", "abort_all_requests": False})
        assert resp.json() == {"success": True, "message": "Weight version updated to 5", "new_version": "5"}
        assert client.get("/model_info").json()["weight_version"] == "5"
        data = generate(client, api_types, {"input_ids": PROMPT, "sampling_params": _greedy(2)})
        assert data["meta_info"]["weight_version"] == "5"

        # SGLang's default abort_all_requests=True aborts what is in flight: honoured.
        client.post("/slow_down", json={"forward_sleep_time": 0.05})
        result: dict[str, Any] = {}
        body = {"input_ids": PROMPT, "sampling_params": _greedy(200, ignore_eos=True), "return_logprob": True}
        api_types.GenerateRequest.from_json_value(body)
        worker = threading.Thread(target=lambda: result.update(client.post("/generate", json=body).json()))
        worker.start()
        time.sleep(0.5)
        assert client.post("/update_weight_version", json={"new_version": "6"}).json()["success"]
        worker.join(timeout=10)
        check_response(api_types, result)
        assert result["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(result["output_ids"]) < 200
    finally:
        client.post("/slow_down", json={"forward_sleep_time": None})
        client.post("/update_weight_version", json={"new_version": "default", "abort_all_requests": False})


def test_abort_request_by_rid_and_all(client: httpx.Client, api_types: ModuleType) -> None:
    client.post("/slow_down", json={"forward_sleep_time": 0.05})
    results: dict[str, dict[str, Any]] = {}

    def run(rid: str) -> None:
        body = {
            "input_ids": PROMPT,
            "rid": rid,
            "sampling_params": _greedy(200, ignore_eos=True),
            "return_logprob": True,
        }
        api_types.GenerateRequest.from_json_value(body)
        results[rid] = client.post("/generate", json=body).json()

    try:
        workers = [threading.Thread(target=run, args=(rid,)) for rid in ("a1", "a2", "a3")]
        for w in workers:
            w.start()
        time.sleep(0.5)
        assert client.post("/abort_request", json={"rid": "a1"}).status_code == 200
        workers[0].join(timeout=10)
        assert "a1" in results
        assert "a2" not in results
        assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
        for w in workers:
            w.join(timeout=10)
    finally:
        client.post("/slow_down", json={"forward_sleep_time": None})
    for rid, data in results.items():
        check_response(api_types, data)
        assert data["meta_info"]["finish_reason"]["type"] == "abort", rid
        assert 0 < len(data["output_ids"]) < 200
        assert len(logprobs(data)) == len(data["output_ids"])
    state = client.get("/server_info").json()["internal_states"][0]
    assert state["num_running_reqs"] == 0
    assert state["num_waiting_reqs"] == 0


def test_client_disconnect_aborts_the_request(client: httpx.Client, engine: EngineProcess) -> None:
    """A caller that gives up (timeout, crash) must not leave its request decoding in the engine."""
    client.post("/slow_down", json={"forward_sleep_time": 0.05})
    try:
        body = {"input_ids": PROMPT, "sampling_params": _greedy(200, ignore_eos=True)}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{engine.url}/generate", json=body, timeout=0.5)
        deadline = time.monotonic() + 5
        while (
            client.get("/server_info").json()["internal_states"][0]["num_running_reqs"]
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert client.get("/server_info").json()["internal_states"][0]["num_running_reqs"] == 0
    finally:
        client.post("/slow_down", json={"forward_sleep_time": None})


def test_stop_strings_see_special_tokens(tmp_path: Path) -> None:
    """SGLang matches stop strings on text decoded with special tokens kept, so `--rollout-stop "</s>"`
    (or "<|im_end|>") can match; the response text follows skip_special_tokens on its own."""
    model = build_tiny_llama(tmp_path / "m", alphabet="ab", hidden_size=16, num_heads=2, num_kv_heads=1)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    eos = tok.token_to_id("</s>")
    assert eos is not None
    assert stop_match_text(tok, [3, eos]).endswith("</s>")
    assert "</s>" not in tok.decode([3, eos], skip_special_tokens=True)  # what the old matching saw
    assert stop_match_text(None, [3, eos]) == ""
