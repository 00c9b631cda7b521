"""The embedded engine at real lengths: contexts up to 2048 positions under concurrency, with prefix-cache
hits, KV growth mid-batch, retract / in_place pauses and weight loads in several orders.

One engine (64 running requests) serves a tiny Llama (hidden 64, 2 layers) with max_position_embeddings
2048; the KV pool starts at 256 positions per slot and grows while requests run. Outputs are checked
against the same request run alone (same sampling_seed, or greedy) and against transformers' forward.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from tests.engine.helpers import (
    ALPHABET,
    EngineProcess,
    ModelPair,
    model_pair,
    reference_logprobs,
    token_versions,
)
from tests.engine.parity import ATOL, lps, post_generate, reference_input_logprobs, server_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CONTEXT = 2048
VOCAB_LO, VOCAB_HI = 3, 3 + len(ALPHABET)  # the alphabet's ids; 0-2 are <pad> <s> </s>


@pytest.fixture(scope="module")
def long_models(tmp_path_factory: pytest.TempPathFactory) -> ModelPair:
    root = tmp_path_factory.mktemp("long-weights")
    return model_pair(
        root, seeds=(20, 21), alphabet=ALPHABET, hidden_size=64, max_position_embeddings=CONTEXT
    )


def _start(models: ModelPair, log_dir: Path) -> EngineProcess:
    return EngineProcess(
        models.m1, "--weights-root", str(models.root), "--max-running-requests", "64", log_dir=log_dir
    )


@pytest.fixture(scope="module")
def long_engine(long_models: ModelPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    proc = _start(long_models, tmp_path_factory.mktemp("long-logs"))
    yield proc
    assert proc.stop() == 0, proc.stderr()


@pytest.fixture
def lc(long_engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=long_engine.url, timeout=120.0) as c:
        yield c


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(40) as p:
        yield p


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


def _greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def _sampled(n: int, seed: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": True}


def _body(prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
    return {"input_ids": prompt, "sampling_params": params, "return_logprob": True}


def _submit(
    pool: ThreadPoolExecutor, url: str, api_types: ModuleType, body: dict[str, Any]
) -> Future[dict[str, Any]]:
    def run() -> dict[str, Any]:
        with httpx.Client(base_url=url, timeout=120.0) as c:
            data: dict[str, Any] = post_generate(c, api_types, body)
            return data

    return pool.submit(run)


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["output_ids"] == b["output_ids"]
    assert lps(a["meta_info"]["output_token_logprobs"]) == pytest.approx(
        lps(b["meta_info"]["output_token_logprobs"]), abs=ATOL
    )


@pytest.mark.parametrize("prompt_len", [40, 250, 700])
def test_same_prompt_8_8_300_8_8_new_tokens(lc: httpx.Client, api_types: ModuleType, prompt_len: int) -> None:
    """The repro: once a sequence outgrew the first 256 KV positions, the next prefix-cache hit crashed."""
    assert lc.post("/flush_cache").status_code == 200
    prompt = _ids(prompt_len, seed=prompt_len)
    outs = [post_generate(lc, api_types, _body(prompt, _greedy(n))) for n in (8, 8, 300, 8, 8)]
    assert [len(o["output_ids"]) for o in outs] == [8, 8, 300, 8, 8]
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * 5
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0] + [prompt_len - 1] * 4
    for o in (outs[1], outs[3], outs[4]):
        _same(o, outs[0])
    assert outs[2]["output_ids"][:8] == outs[0]["output_ids"]


def test_grpo_groups_in_flight(
    lc: httpx.Client,
    api_types: ModuleType,
    long_engine: EngineProcess,
    long_models: ModelPair,
    pool: ThreadPoolExecutor,
) -> None:
    """4 groups x 8 samples of one ~400-token prompt each, all 32 in flight, 300-1,500 new tokens."""
    assert lc.post("/flush_cache").status_code == 200
    prompts = [_ids(380 + 10 * g, seed=100 + g) for g in range(4)]
    lengths = [300 + (j * 431) % 1200 for j in range(32)]
    bodies = [_body(prompts[j // 8], _sampled(lengths[j], seed=j)) for j in range(32)]
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        with httpx.Client(base_url=long_engine.url, timeout=30.0) as c:
            while not stop.is_set():
                peak = max(peak, server_state(c)["num_running_reqs"])
                time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = [
            f.result(timeout=110) for f in [_submit(pool, long_engine.url, api_types, b) for b in bodies]
        ]
    finally:
        stop.set()
        watcher.join()
    assert peak >= 32
    for j, data in enumerate(results):
        assert data["meta_info"]["finish_reason"] == {"type": "length", "length": lengths[j]}
        assert data["meta_info"]["prompt_tokens"] == len(prompts[j // 8])
        assert len(data["meta_info"]["output_token_logprobs"]) == lengths[j]
    for g in range(4):
        assert len({tuple(results[j]["output_ids"][:300]) for j in range(8 * g, 8 * g + 8)}) == 8
    for j in (0, 13, 31):  # a sample decoded in the crowd == the same request alone
        _same(results[j], post_generate(lc, api_types, bodies[j]))
    for j in (13, 22):
        ref = reference_logprobs(long_models.m1, prompts[j // 8], results[j]["output_ids"])
        assert lps(results[j]["meta_info"]["output_token_logprobs"]) == pytest.approx(ref, abs=ATOL)


def test_prefix_cache_hits_at_long_lengths(lc: httpx.Client, api_types: ModuleType) -> None:
    prompt = _ids(1200, seed=7)
    for params in (_greedy(300), _sampled(300, seed=5)):
        assert lc.post("/flush_cache").status_code == 200
        miss = post_generate(lc, api_types, _body(prompt, params))
        hit = post_generate(lc, api_types, _body(prompt, params))
        assert miss["meta_info"]["cached_tokens"] == 0
        assert hit["meta_info"]["cached_tokens"] == 1199
        _same(hit, miss)
    greedy = post_generate(lc, api_types, _body(prompt, _greedy(300)))
    ext = post_generate(lc, api_types, _body(prompt + greedy["output_ids"][:200], _greedy(100)))
    assert ext["meta_info"]["cached_tokens"] >= 1200
    assert ext["output_ids"] == greedy["output_ids"][200:]
    assert lps(ext["meta_info"]["output_token_logprobs"]) == pytest.approx(
        lps(greedy["meta_info"]["output_token_logprobs"])[200:], abs=ATOL
    )


def test_kv_growth_in_the_middle_of_a_running_batch(
    api_types: ModuleType, long_models: ModelPair, tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """A fresh engine (pool at 256 positions) decoding 6 short requests is joined by a 1,500-token
    prompt (the pool must grow under them) and then by a prompt that hits its cached KV."""
    proc = _start(long_models, tmp_path)
    try:
        with httpx.Client(base_url=proc.url, timeout=120.0) as c:
            short = [
                _body(_ids(30, seed=200 + i), _greedy(700) if i % 2 else _sampled(700, seed=i))
                for i in range(6)
            ]
            long_prompt = _ids(1500, seed=300)
            late = [
                _body(long_prompt, _sampled(300, seed=1)),
                _body(long_prompt[:1000] + _ids(200, seed=301), _sampled(300, seed=2)),
            ]
            c.post("/slow_down", json={"forward_sleep_time": 0.002})
            try:
                futures = [_submit(pool, proc.url, api_types, b) for b in short]
                time.sleep(0.4)  # the short ones are ~150 positions in, well under the pool's 256
                futures.append(_submit(pool, proc.url, api_types, late[0]))
                time.sleep(0.6)
                futures.append(_submit(pool, proc.url, api_types, late[1]))
                together = [f.result(timeout=110) for f in futures]
            finally:
                c.post("/slow_down", json={"forward_sleep_time": None})
            shared = next(
                i for i, (a, b) in enumerate(zip(long_prompt, late[1]["input_ids"], strict=False)) if a != b
            )
            assert shared >= 1000
            assert together[-1]["meta_info"]["cached_tokens"] == shared
            for body, data in zip([*short, *late], together, strict=True):
                assert data["meta_info"]["completion_tokens"] == body["sampling_params"]["max_new_tokens"]
                _same(data, post_generate(c, api_types, body))
    finally:
        assert proc.stop() == 0, proc.stderr()


def _update(c: httpx.Client, path: Path, version: str, **extra: Any) -> None:
    resp = c.post(
        "/update_weights_from_disk", json={"model_path": str(path), "weight_version": version, **extra}
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["success"], resp.text


ORDERS = {
    "retract-update": ["retract", "update", "continue"],
    "in_place-update": ["in_place", "update", "continue"],
    "retract-update-then-in_place-update": [
        "retract",
        "update",
        "continue",
        "in_place",
        "update",
        "continue",
    ],
    "in_place-then-retract-update": ["in_place", "continue", "retract", "update", "continue"],
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_pauses_and_weight_updates_at_long_lengths(
    lc: httpx.Client,
    api_types: ModuleType,
    long_engine: EngineProcess,
    long_models: ModelPair,
    pool: ThreadPoolExecutor,
    order: str,
) -> None:
    steps = ORDERS[order]
    shared = _ids(600, seed=400)
    prompts = [shared, shared, _ids(650, seed=401), _ids(700, seed=402)]
    n_new = 600
    # Weights alternate m2, m1, ...; labels v2, v3, ...
    updates = [
        (long_models.m2 if i % 2 == 0 else long_models.m1, f"v{i + 2}") for i in range(steps.count("update"))
    ]
    _update(lc, long_models.m1, "v1")
    try:
        lc.post("/slow_down", json={"forward_sleep_time": 0.004})
        futures = [
            _submit(pool, long_engine.url, api_types, _body(p, _sampled(n_new, seed=i)))
            for i, p in enumerate(prompts)
        ]
        time.sleep(0.5)
        pending = iter(updates)
        paused_mode = None
        for step in steps:
            if step in ("retract", "in_place"):
                assert lc.post("/pause_generation", json={"mode": step}).json()["status"] == "ok"
                paused_mode = step
                state = server_state(lc)
                assert state["paused"] is True
                if step == "retract":
                    assert (state["num_running_reqs"], state["num_waiting_reqs"]) == (0, 4)
                else:
                    assert state["num_running_reqs"] == 4
            elif step == "update":
                path, version = next(pending)
                _update(lc, path, version, flush_cache=paused_mode == "retract")
            else:
                assert lc.post("/continue_generation", json={}).json()["status"] == "ok"
                time.sleep(0.4)  # let every request decode some tokens before the next step
        lc.post("/slow_down", json={"forward_sleep_time": None})
        results = [f.result(timeout=110) for f in futures]
    finally:
        lc.post("/slow_down", json={"forward_sleep_time": None})
        lc.post("/continue_generation", json={})
    labels = ["v1", *(v for _, v in updates)]
    for data in results:
        meta = data["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": n_new}
        assert meta["num_retractions"] == steps.count("retract")
        assert [s["version"] for s in meta["weight_versions"]] == labels  # every update landed mid-request
        assert meta["weight_version"] == labels[-1]
    if order == "retract-update":
        # Retracted before the only update: tokens [0, k) come from m1, [k, n) from m2 recomputing everything.
        for prompt, data in zip(prompts, results, strict=True):
            k = token_versions(data).index("v2")
            got, out = lps(data["meta_info"]["output_token_logprobs"]), data["output_ids"]
            assert got[:k] == pytest.approx(reference_logprobs(long_models.m1, prompt, out)[:k], abs=ATOL)
            assert got[k:] == pytest.approx(reference_logprobs(long_models.m2, prompt, out)[k:], abs=ATOL)
    # The engine keeps serving, on the last weights, and never reuses KV from before the update (a hit
    # on KV recomputed after it, by a retracted request, is fine: the logprobs tell).
    final_model = updates[-1][0]
    fresh = post_generate(lc, api_types, _body(shared, _greedy(200)))
    again = post_generate(lc, api_types, _body(shared, _greedy(200)))
    assert again["meta_info"]["cached_tokens"] == 599
    assert token_versions(fresh) == [labels[-1]] * 200
    ref = reference_logprobs(final_model, shared, fresh["output_ids"])
    assert lps(fresh["meta_info"]["output_token_logprobs"]) == pytest.approx(ref, abs=ATOL)
    _same(again, fresh)
    _update(lc, long_models.m1, "default")


def test_logprobs_at_long_lengths_match_reference(
    lc: httpx.Client, api_types: ModuleType, long_models: ModelPair
) -> None:
    prompt = _ids(1000, seed=500)
    sample = post_generate(lc, api_types, _body(prompt, _sampled(800, seed=3)))
    out = sample["output_ids"]
    assert len(out) == 800
    ref = reference_logprobs(long_models.m1, prompt, out)
    assert lps(sample["meta_info"]["output_token_logprobs"]) == pytest.approx(ref, abs=ATOL)
    greedy_prompt = _ids(1500, seed=501)
    greedy = post_generate(lc, api_types, _body(greedy_prompt, _greedy(540)))
    ref = reference_logprobs(long_models.m1, greedy_prompt, greedy["output_ids"])
    assert lps(greedy["meta_info"]["output_token_logprobs"]) == pytest.approx(ref, abs=ATOL)
    # Scoring the whole 1,800-token sequence: every position from 1 on, the response part == the sample.
    scored = post_generate(
        lc,
        api_types,
        {
            "input_ids": prompt + out,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    inp = scored["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in inp] == prompt + out
    assert inp[0][0] is None
    expected = reference_input_logprobs(long_models.m1, prompt + out, 0)
    assert lps(inp)[1:] == pytest.approx(expected[1:], abs=ATOL)
    assert lps(inp)[1000:] == pytest.approx(lps(sample["meta_info"]["output_token_logprobs"]), abs=ATOL)
