"""SGLang parity of `sampling_params`: seeds, top_p/top_k/min_p, logit_bias, penalties, min_new_tokens,
stop strings / stop token ids / ignore_eos.

Runs against the embedded engine, or a real SGLang server with MILES_AIO_SGLANG_URL (see parity.py).
Semantics: `sampling/sampling_params.py` (temperature 0 → top_k 1; top_k -1 → whole vocabulary),
`sampling/penaltylib/*` (penalties count output tokens only; min_new_tokens masks EOS and
stop_token_ids), `sampling/sampling_batch_info.py` (logit_bias added after the penalties, per request),
`managers/schedule_batch.py` (`_check_token_based_finish`, `_check_str_based_finish`). Where the model
is the embedded engine's, greedy outputs are also checked token for token against a transformers
reference implementing those transforms (`parity.reference_greedy`).
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

import httpx
import pytest

from tests.engine.parity import (
    ATOL,
    EOS_ID,
    ParityServer,
    lps,
    post_generate,
    prompt_ids,
    reference_greedy,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _body(prompt: list[int], **params: Any) -> dict[str, Any]:
    return {"input_ids": prompt, "sampling_params": params, "return_logprob": True}


def test_sampling_seed_is_deterministic_and_seed_dependent(
    server: httpx.Client, api_types: ModuleType
) -> None:
    prompt = prompt_ids(server, api_types, 200, seed=20)
    params = {"max_new_tokens": 300, "temperature": 1.0, "top_p": 0.95, "top_k": 30, "ignore_eos": True}
    a = post_generate(server, api_types, _body(prompt, sampling_seed=1234, **params))
    b = post_generate(server, api_types, _body(prompt, sampling_seed=1234, **params))
    c = post_generate(server, api_types, _body(prompt, sampling_seed=4321, **params))
    assert a["output_ids"] == b["output_ids"]
    assert lps(a["meta_info"]["output_token_logprobs"]) == pytest.approx(
        lps(b["meta_info"]["output_token_logprobs"]), abs=ATOL
    )
    assert c["output_ids"] != a["output_ids"]
    assert len(c["output_ids"]) == 300


def test_truncation_that_keeps_one_token_is_greedy(server: httpx.Client, api_types: ModuleType) -> None:
    """top_k 1, top_p → 0 and min_p 1 each keep only the most likely token: the greedy output, whatever
    the temperature and seed (temperature 0 itself is top_k 1 in SamplingParams.__post_init__)."""
    prompt = prompt_ids(server, api_types, 150, seed=21)
    greedy = post_generate(
        server, api_types, _body(prompt, max_new_tokens=120, temperature=0.0, ignore_eos=True)
    )
    common = {"max_new_tokens": 120, "temperature": 1.3, "ignore_eos": True}
    for truncation in ({"top_k": 1}, {"top_p": 1e-9}, {"min_p": 1.0}):
        for seed in (1, 2):
            data = post_generate(server, api_types, _body(prompt, sampling_seed=seed, **common, **truncation))
            assert data["output_ids"] == greedy["output_ids"], truncation


def test_top_k_samples_only_among_the_top_k(server: httpx.Client, api_types: ModuleType) -> None:
    """Returned logprobs are those of the untruncated distribution, so the sampled token must be one of
    the reported top-k at every step."""
    prompt = prompt_ids(server, api_types, 100, seed=22)
    body = _body(prompt, max_new_tokens=200, temperature=1.0, top_k=3, sampling_seed=9, ignore_eos=True)
    meta = post_generate(server, api_types, {**body, "top_logprobs_num": 3})["meta_info"]
    for entry, row in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert entry[1] in {e[1] for e in row}
    assert len({e[1] for e in meta["output_token_logprobs"]}) > 1  # it did sample, not argmax


def test_logit_bias_forces_a_token_and_leaves_concurrent_requests_alone(
    server: httpx.Client, api_types: ModuleType
) -> None:
    prompt = prompt_ids(server, api_types, 160, seed=23)
    forced = prompt[7]
    other = _body(prompt, max_new_tokens=200, temperature=1.0, sampling_seed=5, ignore_eos=True)
    solo = post_generate(server, api_types, other)
    assert set(solo["output_ids"]) != {forced}
    biased = _body(
        prompt,
        max_new_tokens=200,
        temperature=1.0,
        sampling_seed=6,
        ignore_eos=True,
        logit_bias={str(forced): 100.0},
    )
    results: dict[str, Any] = {}

    def run(name: str, body: dict[str, Any]) -> None:
        with httpx.Client(base_url=str(server.base_url), timeout=120.0) as c:
            results[name] = post_generate(c, api_types, body)

    server.post("/slow_down", json={"forward_sleep_time": 0.002})  # keep both in one running batch
    try:
        workers = [threading.Thread(target=run, args=a) for a in (("biased", biased), ("other", other))]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=120)
    finally:
        server.post("/slow_down", json={"forward_sleep_time": None})
    assert results["biased"]["output_ids"] == [forced] * 200
    # The bias is applied before the logprobs are taken (Sampler: logits after apply_logits_bias).
    assert all(lp > -1e-3 for lp in lps(results["biased"]["meta_info"]["output_token_logprobs"]))
    assert results["other"]["output_ids"] == solo["output_ids"]
    assert lps(results["other"]["meta_info"]["output_token_logprobs"]) == pytest.approx(
        lps(solo["meta_info"]["output_token_logprobs"]), abs=ATOL
    )
    # Per-item sampling params in one batch request: the bias stays with its item.
    batch = post_generate(
        server,
        api_types,
        {
            "input_ids": [prompt, prompt],
            "sampling_params": [other["sampling_params"], biased["sampling_params"]],
            "return_logprob": True,
        },
    )
    assert batch[0]["output_ids"] == solo["output_ids"]
    assert batch[1]["output_ids"] == [forced] * 200


def test_negative_logit_bias_bans_a_token_under_greedy(
    server: httpx.Client, api_types: ModuleType, parity_server: ParityServer
) -> None:
    prompt = prompt_ids(server, api_types, 120, seed=24)
    greedy = post_generate(
        server, api_types, _body(prompt, max_new_tokens=100, temperature=0.0, ignore_eos=True)
    )
    banned = greedy["output_ids"][0]
    data = post_generate(
        server,
        api_types,
        _body(prompt, max_new_tokens=100, temperature=0.0, ignore_eos=True, logit_bias={str(banned): -100.0}),
    )
    assert banned not in data["output_ids"]
    assert len(data["output_ids"]) == 100
    if parity_server.local_base is not None:
        ref = reference_greedy(
            parity_server.local_base, prompt, 100, logit_bias={banned: -100.0}, ignore_eos=True
        )
        assert data["output_ids"] == ref


@pytest.mark.parametrize(
    ("penalty", "value"),
    [("frequency_penalty", 2.0), ("presence_penalty", 2.0), ("repetition_penalty", 2.0)],
)
def test_penalties_discourage_repeating_output_tokens(
    server: httpx.Client, api_types: ModuleType, parity_server: ParityServer, penalty: str, value: float
) -> None:
    """Greedy with the largest penalty SGLang accepts (sampling_params.verify: [-2, 2], (0, 2]) repeats
    output tokens less than plain greedy, which loops on a random tiny model."""
    prompt = prompt_ids(server, api_types, 150, seed=25)
    n = 40
    penalty_kw: dict[str, Any] = {penalty: value}  # one of reference_greedy's float penalties
    plain = post_generate(
        server, api_types, _body(prompt, max_new_tokens=n, temperature=0.0, ignore_eos=True)
    )
    data = post_generate(
        server,
        api_types,
        _body(prompt, max_new_tokens=n, temperature=0.0, ignore_eos=True, **penalty_kw),
    )
    assert len(data["output_ids"]) == n
    assert len(set(data["output_ids"])) > len(set(plain["output_ids"]))
    if parity_server.local_base is not None:
        assert data["output_ids"] == reference_greedy(
            parity_server.local_base, prompt, n, ignore_eos=True, **penalty_kw
        )
        if penalty != "repetition_penalty":  # logits of this model span < 2: no token can repeat
            assert len(set(data["output_ids"])) == n


def test_min_new_tokens_masks_stop_token_ids(
    server: httpx.Client, api_types: ModuleType, parity_server: ParityServer
) -> None:
    """BatchedMinNewTokensPenalizer: stop_token_ids (and EOS) get -inf while fewer than min_new_tokens
    tokens are out; afterwards the stop token ends the request as usual."""
    prompt = prompt_ids(server, api_types, 120, seed=26)
    full = post_generate(
        server, api_types, _body(prompt, max_new_tokens=60, temperature=0.0, ignore_eos=True)
    )
    stop = full["output_ids"][0]
    early = post_generate(
        server, api_types, _body(prompt, max_new_tokens=60, temperature=0.0, stop_token_ids=[stop])
    )
    assert early["output_ids"] == [stop]
    assert early["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    data = post_generate(
        server,
        api_types,
        _body(prompt, max_new_tokens=60, temperature=0.0, stop_token_ids=[stop], min_new_tokens=12),
    )
    out = data["output_ids"]
    assert len(out) >= 12
    assert stop not in out[:12]
    assert stop not in out[:-1]
    if data["meta_info"]["finish_reason"]["type"] == "stop":
        assert data["meta_info"]["finish_reason"]["matched"] == out[-1]
    else:
        assert data["meta_info"]["finish_reason"] == {"type": "length", "length": 60}
    if parity_server.local_base is not None:
        assert out == reference_greedy(
            parity_server.local_base, prompt, 60, min_new_tokens=12, stop_token_ids=(stop,)
        )


def test_min_new_tokens_masks_eos_and_ignore_eos_keeps_going(
    server: httpx.Client, api_types: ModuleType, parity_server: ParityServer
) -> None:
    parity_server.require_local_tokenizer()  # the tiny model's EOS id is known; a real model's is not
    prompt = prompt_ids(server, api_types, 100, seed=27)
    to_eos = {"temperature": 0.0, "logit_bias": {str(EOS_ID): 100.0}}
    data = post_generate(server, api_types, _body(prompt, max_new_tokens=30, **to_eos))
    assert data["output_ids"] == [EOS_ID]  # EOS is kept in output_ids, cut from the text
    assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_ID}
    assert data["text"] == ""
    data = post_generate(server, api_types, _body(prompt, max_new_tokens=30, min_new_tokens=8, **to_eos))
    assert len(data["output_ids"]) == 9
    assert EOS_ID not in data["output_ids"][:8]
    assert data["output_ids"][8] == EOS_ID
    assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_ID}
    data = post_generate(server, api_types, _body(prompt, max_new_tokens=30, ignore_eos=True, **to_eos))
    assert data["output_ids"] == [EOS_ID] * 30
    assert data["meta_info"]["finish_reason"] == {"type": "length", "length": 30}
    assert data["text"] == ""  # skip_special_tokens defaults to True


def test_stop_token_ids_at_length(server: httpx.Client, api_types: ModuleType) -> None:
    prompt = prompt_ids(server, api_types, 300, seed=28)
    full = post_generate(
        server, api_types, _body(prompt, max_new_tokens=300, temperature=0.0, ignore_eos=True)
    )
    ids = full["output_ids"]
    stop = ids[250]
    first = ids.index(stop)
    data = post_generate(
        server, api_types, _body(prompt, max_new_tokens=300, temperature=0.0, stop_token_ids=[stop])
    )
    assert data["output_ids"] == ids[: first + 1]  # the stop token is kept in output_ids
    assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert lps(data["meta_info"]["output_token_logprobs"]) == pytest.approx(
        lps(full["meta_info"]["output_token_logprobs"])[: first + 1], abs=ATOL
    )
    # ignore_eos also ignores stop_token_ids (_check_token_based_finish returns False at once).
    ignoring = post_generate(
        server,
        api_types,
        _body(prompt, max_new_tokens=300, temperature=0.0, stop_token_ids=[stop], ignore_eos=True),
    )
    assert ignoring["output_ids"] == ids
    assert ignoring["meta_info"]["finish_reason"] == {"type": "length", "length": 300}


def test_stop_strings_at_length(
    server: httpx.Client, api_types: ModuleType, parity_server: ParityServer
) -> None:
    prompt = prompt_ids(server, api_types, 300, seed=29)
    params = {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True}
    full = post_generate(server, api_types, _body(prompt, **params))
    text = full["text"]
    stop = text[200:203]
    cut = text.find(stop)
    data = post_generate(server, api_types, _body(prompt, **params, stop=["never-in-this-text", stop]))
    assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert data["text"] == text[:cut]  # trimmed at the stop string (no_stop_trim false)
    out = data["output_ids"]
    assert out == full["output_ids"][: len(out)]  # output_ids keep the stop string's tokens
    if parity_server.embedded:
        tok = parity_server.require_local_tokenizer()
        assert stop in tok.decode(out, skip_special_tokens=False)
        assert stop not in tok.decode(out[:-1], skip_special_tokens=False)  # stopped as soon as it matched
    kept = post_generate(server, api_types, _body(prompt, **params, stop=stop, no_stop_trim=True))
    assert kept["text"] == text[: cut + len(stop)]
    assert kept["output_ids"] == out
