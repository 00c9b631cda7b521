"""SGLang parity of `/generate` logprobs: output and input (prompt) logprobs, top-n, asked-for token ids.

Runs against the embedded engine, or a real SGLang server with MILES_AIO_SGLANG_URL (see parity.py).
Shapes follow `managers/tokenizer_manager.py` (`add_logprob_to_meta_info`, `detokenize_logprob_tokens`:
each entry is `[logprob, token_id, text-or-None]`) and the scheduler's input-logprob layout
(`managers/scheduler_components/logprob_result_processor.py`: entries for tokens
`input_ids[logprob_start_len:]`, the first one always None). Values: `test/kits/spec_server_kits.py`
(`test_logprob_match`: a sampled response re-scored by a 0-token prefill gives its decode logprobs).
"""

from __future__ import annotations

from types import ModuleType

import httpx
import pytest

from tests.engine.helpers import reference_logprobs
from tests.engine.parity import (
    ATOL,
    ParityServer,
    lps,
    post_generate,
    prompt_ids,
    reference_input_logprobs,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _greedy(n: int) -> dict[str, object]:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def test_output_logprobs_one_triple_per_completion_token(
    server: httpx.Client, api_types: ModuleType, parity_server: ParityServer
) -> None:
    prompt = prompt_ids(server, api_types, 200, seed=1)
    params = {"max_new_tokens": 300, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}
    body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
    with_text = post_generate(server, api_types, {**body, "return_text_in_logprobs": True})
    plain = post_generate(server, api_types, body)

    for data in (with_text, plain):
        meta = data["meta_info"]
        assert meta["prompt_tokens"] == 200
        assert meta["completion_tokens"] == 300
        assert len(data["output_ids"]) == 300
        assert len(meta["output_token_logprobs"]) == 300
        assert all(len(e) == 3 for e in meta["output_token_logprobs"])
        assert [e[1] for e in meta["output_token_logprobs"]] == data["output_ids"]
        assert all(isinstance(e[0], float) and e[0] <= 0.0 for e in meta["output_token_logprobs"])
        # logprob_start_len defaults to -1: the scheduler sets it to len(prompt) (scheduler.py
        # handle_generate_request), so input_token_logprobs is present and empty.
        assert meta["input_token_logprobs"] == []
    assert plain["output_ids"] == with_text["output_ids"]  # same sampling_seed
    assert lps(plain["meta_info"]["output_token_logprobs"]) == pytest.approx(
        lps(with_text["meta_info"]["output_token_logprobs"]), abs=ATOL
    )
    assert all(e[2] is None for e in plain["meta_info"]["output_token_logprobs"])
    texts = [e[2] for e in with_text["meta_info"]["output_token_logprobs"]]
    assert all(isinstance(t, str) for t in texts)
    if parity_server.embedded:
        # tokenizer.batch_decode([[id], ...]): each token on its own, special tokens kept.
        tok = parity_server.require_local_tokenizer()
        assert texts == [tok.decode([i], skip_special_tokens=False) for i in with_text["output_ids"]]
        assert parity_server.local_base is not None
        ref = reference_logprobs(parity_server.local_base, prompt, with_text["output_ids"])
        assert lps(with_text["meta_info"]["output_token_logprobs"]) == pytest.approx(ref, abs=ATOL)


@pytest.mark.parametrize("start", [0, 1, 57, 199])
def test_input_logprobs_start_at_logprob_start_len(
    server: httpx.Client, api_types: ModuleType, parity_server: ParityServer, start: int
) -> None:
    """`run_logprob_check` (test/test_utils.py): len(input_token_logprobs) + logprob_start_len ==
    prompt_tokens; the entries are the prompt tokens from logprob_start_len on, the first with None."""
    prompt = prompt_ids(server, api_types, 200, seed=2)
    body = {
        "input_ids": prompt,
        "sampling_params": _greedy(16),
        "return_logprob": True,
        "logprob_start_len": start,
        "return_text_in_logprobs": True,
    }
    data = post_generate(server, api_types, body)
    meta = data["meta_info"]
    inp = meta["input_token_logprobs"]
    assert len(inp) + start == meta["prompt_tokens"] == 200
    assert [e[1] for e in inp] == prompt[start:]
    assert inp[0][0] is None  # [None] + logprobs[:-1], whatever the start
    assert all(e[0] is not None and e[0] <= 0.0 for e in inp[1:])
    assert all(isinstance(e[2], str) for e in inp)
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 16
    # The radix match stops at logprob_start_len so those positions are computed
    # (schedule_batch.Req._compute_max_prefix_len).
    assert meta["cached_tokens"] <= start
    if parity_server.local_base is not None:
        ref = reference_input_logprobs(parity_server.local_base, prompt, start)
        assert lps(inp)[1:] == pytest.approx(ref[1:], abs=ATOL)


def test_rescoring_a_sampled_response_gives_its_logprobs(server: httpx.Client, api_types: ModuleType) -> None:
    """spec_server_kits.test_logprob_match: decode logprobs == a 0-token prefill of prompt + response."""
    prompt = prompt_ids(server, api_types, 150, seed=3)
    params = {"max_new_tokens": 250, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}
    sample = post_generate(
        server, api_types, {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
    )
    response = sample["output_ids"]
    sampled = lps(sample["meta_info"]["output_token_logprobs"])
    assert len(response) == 250

    def score(start: int) -> dict[str, object]:
        body = {
            "input_ids": prompt + response,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": start,
        }
        data = post_generate(server, api_types, body)
        assert data["output_ids"] == []
        assert data["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        assert data["meta_info"]["output_token_logprobs"] == []
        assert data["meta_info"]["prompt_tokens"] == 400
        scored: dict[str, object] = data["meta_info"]
        return scored

    # Starting at the response: one entry per response token; the first has no logprob (SGLang never
    # scores the token at logprob_start_len), the others equal the sampled ones.
    at_response = score(len(prompt))["input_token_logprobs"]
    assert isinstance(at_response, list)
    assert [e[1] for e in at_response] == response
    assert at_response[0][0] is None
    assert lps(at_response)[1:] == pytest.approx(sampled[1:], abs=ATOL)
    # One token earlier: every response token is scored.
    one_before = score(len(prompt) - 1)["input_token_logprobs"]
    assert isinstance(one_before, list)
    assert [e[1] for e in one_before] == [prompt[-1], *response]
    assert one_before[0][0] is None
    assert lps(one_before)[1:] == pytest.approx(sampled, abs=ATOL)


def test_top_logprobs_shapes_and_order(server: httpx.Client, api_types: ModuleType) -> None:
    """run_logprob_check: len(output_top_logprobs[i]) == top_logprobs_num, input_top_logprobs covers
    the prompt from logprob_start_len (first entry None: logprob_result_processor.
    _process_input_top_logprobs); greedy: the output token is the top-1 entry. Values are torch.topk,
    sorted descending (layers/logprob_processor.get_top_logprobs_raw)."""
    prompt = prompt_ids(server, api_types, 180, seed=4)
    k, start = 5, 140
    for params in (
        _greedy(64),
        {"max_new_tokens": 64, "temperature": 1.0, "sampling_seed": 5, "ignore_eos": True},
    ):
        body = {
            "input_ids": prompt,
            "sampling_params": params,
            "return_logprob": True,
            "top_logprobs_num": k,
            "logprob_start_len": start,
        }
        meta = post_generate(server, api_types, body)["meta_info"]
        out, top = meta["output_token_logprobs"], meta["output_top_logprobs"]
        assert len(top) == len(out) == 64
        for entry, row in zip(out, top, strict=True):
            assert len(row) == k
            assert all(len(e) == 3 and e[2] is None for e in row)
            values = lps(row)
            assert values == sorted(values, reverse=True)
            assert len({e[1] for e in row}) == k
            assert entry[0] <= values[0] + 1e-6  # the sampled token is at most as likely as the top-1
            if entry[1] in {e[1] for e in row}:
                assert entry[0] == pytest.approx(dict((e[1], e[0]) for e in row)[entry[1]], abs=1e-5)
            else:
                assert entry[0] <= values[-1] + 1e-6
            if params["temperature"] == 0.0:
                assert row[0][1] == entry[1]
        inp_top = meta["input_top_logprobs"]
        assert len(inp_top) + start == 180
        assert inp_top[0] is None
        for row in inp_top[1:]:
            assert len(row) == k
            assert lps(row) == sorted(lps(row), reverse=True)
        # Each scored prompt token's logprob is consistent with its position's top-k.
        for entry, row in zip(meta["input_token_logprobs"][1:], inp_top[1:], strict=True):
            assert entry[0] <= row[0][0] + 1e-6


def test_token_ids_logprob_returns_exactly_the_asked_ids(server: httpx.Client, api_types: ModuleType) -> None:
    """get_token_ids_logprobs_raw (layers/logprob_processor.py): logprobs[pos, token_ids] for the asked
    ids, in the asked order, at every output position and at every scored prompt position (the
    first one None)."""
    prompt = prompt_ids(server, api_types, 160, seed=5)
    asked = list(dict.fromkeys(reversed(prompt)))[:4]  # four distinct valid ids, not sorted
    start = 120
    body = {
        "input_ids": prompt,
        "sampling_params": _greedy(48),
        "return_logprob": True,
        "token_ids_logprob": asked,
        "top_logprobs_num": 3,
        "logprob_start_len": start,
    }
    meta = post_generate(server, api_types, body)["meta_info"]
    rows = meta["output_token_ids_logprobs"]
    assert len(rows) == len(meta["output_token_logprobs"]) == 48
    for entry, row, top in zip(meta["output_token_logprobs"], rows, meta["output_top_logprobs"], strict=True):
        assert [e[1] for e in row] == asked
        assert all(e[0] <= 0.0 for e in row)
        if entry[1] in asked:
            assert row[asked.index(entry[1])][0] == pytest.approx(entry[0], abs=1e-5)
        for lp, tid, _ in top:  # the same distribution as the top-k
            if tid in asked:
                assert row[asked.index(tid)][0] == pytest.approx(lp, abs=1e-5)
    inp_rows = meta["input_token_ids_logprobs"]
    assert len(inp_rows) + start == 160
    assert inp_rows[0] is None
    for entry, row in zip(meta["input_token_logprobs"][1:], inp_rows[1:], strict=True):
        assert [e[1] for e in row] == asked
        if entry[1] in asked:
            assert row[asked.index(entry[1])][0] == pytest.approx(entry[0], abs=1e-5)


def test_default_valued_logprob_fields_are_no_ops(server: httpx.Client, api_types: ModuleType) -> None:
    """io_struct.GenerateReqInput._normalize_single_inputs: logprob_start_len None → -1, top_logprobs_num
    None → 0, token_ids_logprob [] → None; the tokenizer manager adds top / token-ids entries only
    when asked (top_logprobs_num > 0, token_ids_logprob not None). Without return_logprob the scheduler
    ignores logprob_start_len (scheduler.py: "When return_logprob is False, logprob_start_len should be
    ignored") and the response has no logprobs."""
    prompt = prompt_ids(server, api_types, 120, seed=6)
    base = {"input_ids": prompt, "sampling_params": _greedy(40), "return_logprob": True}
    a = post_generate(server, api_types, base)
    b = post_generate(
        server,
        api_types,
        {**base, "logprob_start_len": -1, "top_logprobs_num": 0, "token_ids_logprob": []},
    )
    assert b["output_ids"] == a["output_ids"]
    assert lps(b["meta_info"]["output_token_logprobs"]) == pytest.approx(
        lps(a["meta_info"]["output_token_logprobs"]), abs=ATOL
    )
    for meta in (a["meta_info"], b["meta_info"]):
        assert meta["input_token_logprobs"] == []
        for key in ("output_top_logprobs", "input_top_logprobs"):
            assert key not in meta
        for key in ("output_token_ids_logprobs", "input_token_ids_logprobs"):
            assert key not in meta
    no_logprob = post_generate(
        server,
        api_types,
        {"input_ids": prompt, "sampling_params": _greedy(40), "logprob_start_len": 0, "top_logprobs_num": 5},
    )
    assert no_logprob["output_ids"] == a["output_ids"]
    for key in ("output_token_logprobs", "input_token_logprobs", "output_top_logprobs", "input_top_logprobs"):
        assert key not in no_logprob["meta_info"]


def test_input_logprobs_are_not_changed_by_a_prefix_cache_hit(
    server: httpx.Client, api_types: ModuleType
) -> None:
    """A warm prompt must still be scored from logprob_start_len (the radix match is capped there)."""
    prompt = prompt_ids(server, api_types, 300, seed=7)
    assert server.post("/flush_cache").status_code == 200
    body = {
        "input_ids": prompt,
        "sampling_params": _greedy(8),
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    cold = post_generate(server, api_types, body)
    warm_plain = post_generate(server, api_types, {"input_ids": prompt, "sampling_params": _greedy(8)})
    assert warm_plain["meta_info"]["cached_tokens"] == 299  # the cache is warm ...
    warm = post_generate(server, api_types, body)
    assert warm["meta_info"]["cached_tokens"] == 0  # ... but not used below logprob_start_len 0
    assert [e[1] for e in warm["meta_info"]["input_token_logprobs"]] == prompt
    assert warm["meta_info"]["input_token_logprobs"][0][0] is None
    assert lps(warm["meta_info"]["input_token_logprobs"])[1:] == pytest.approx(
        lps(cold["meta_info"]["input_token_logprobs"])[1:], abs=ATOL
    )
    assert warm["output_ids"] == cold["output_ids"]
