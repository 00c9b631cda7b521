"""The /generate sampling params: miles' (`compute_request_payload`); SGLang's own schema takes them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from miles_aio.rollout.pool import sampling_params_from_config
from miles_aio.testing.sglang_stub_server import load_sglang_api_types
from tests.helpers import make_config

pytestmark = pytest.mark.pure


def params(**cfg: Any) -> dict[str, Any]:
    ctx: Any = SimpleNamespace(config=make_config(**cfg))
    return sampling_params_from_config(ctx)


def test_response_text_is_built_as_in_miles() -> None:
    p = params(rollout_max_response_len=32, rollout_temperature=0.7)
    assert p["max_new_tokens"] == 32 and p["temperature"] == 0.7
    # miles: matched stop strings stay in the text, special tokens too (unless asked), no extra spaces
    assert p["no_stop_trim"] is True
    assert p["skip_special_tokens"] is False
    assert p["spaces_between_special_tokens"] is False
    assert "stop" not in p and "stop_token_ids" not in p
    p = params(
        rollout_stop=("</answer>", "\n\n"), rollout_stop_token_ids=(7,), rollout_skip_special_tokens=True
    )
    assert p["stop"] == ["</answer>", "\n\n"] and p["stop_token_ids"] == [7]
    assert p["skip_special_tokens"] is True


def test_sglangs_own_schema_accepts_the_payload() -> None:
    api = load_sglang_api_types()
    if api is None:
        pytest.fail("sglang's api_types.py is not installed (the test session installs sglang --no-deps)")
    p = params(rollout_stop=("</answer>",), rollout_stop_token_ids=(7,))
    body = {"input_ids": [1, 2, 3], "sampling_params": p, "return_logprob": True}
    api.GenerateRequest.from_json_value(body)
