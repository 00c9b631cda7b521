"""Request bodies of the SGLang native API, parsed and checked into typed values (no I/O, no torch).

Field names, defaults and types follow SGLang 0.5.x: `/generate` as `sglang/api/v1/api_types.py`
(`GenerateRequest`, `SamplingParams`: unknown sampling keys rejected, unknown top-level keys ignored),
the control endpoints as the `*ReqInput` structs of `sglang/srt/managers/io_struct.py`.

The embedded engine implements what RL clients and SGLang's own tests use (batch input, n, streaming,
input/top/token-id logprobs, penalties, logit bias, min_new_tokens, stops). A request that asks for
something it cannot produce (constrained decoding, stop regexes, multimodal input, LoRA, hidden states,
...) is rejected with a 400 naming the field, rather than answered as if the option had been honoured.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar

from miles_aio.engine.sampling import TOP_K_ALL, SamplingParams

__all__ = [
    "DEFAULT_GROUP_NAME",
    "AbortReq",
    "BadRequest",
    "GenerateItem",
    "GenerateReq",
    "InitGroupReq",
    "PauseMode",
    "PauseReq",
    "UpdateFromDiskReq",
    "UpdateFromDistributedReq",
    "UpdateVersionReq",
    "is_kind",
    "parse_abort",
    "parse_generate",
    "parse_group_name",
    "parse_init_group",
    "parse_pause",
    "parse_sampling_params",
    "parse_slow_down",
    "parse_update_from_disk",
    "parse_update_from_distributed",
    "parse_update_version",
]

PauseMode = Literal["abort", "retract", "in_place"]
_PAUSE_MODES: Final = ("abort", "retract", "in_place")
DEFAULT_GROUP_NAME: Final = "weight_update_group"
T = TypeVar("T")

# SamplingParams keys SGLang accepts; the second set is accepted only at its default (None/0/1/{}/[]).
_SAMPLING_KEYS_IMPLEMENTED: Final = frozenset(
    {"max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
     "presence_penalty", "repetition_penalty", "logit_bias", "stop", "stop_token_ids", "ignore_eos",
     "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "n",
     "sampling_seed"}
)  # fmt: skip
_SAMPLING_DEFAULT_ONLY: Final[dict[str, object]] = {
    "stop_regex": None, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "custom_params": None, "beam_width": None, "watermark": None, "choice": [],
}  # fmt: skip
# Top-level /generate fields that ask for output or behaviour this engine does not have.
_GENERATE_DEFAULT_ONLY: Final[dict[str, object]] = {
    "input_embeds": None, "return_hidden_states": None, "return_routed_experts": None,
    "return_sampling_mask": None,
    "image_data": None, "video_data": None, "audio_data": None, "lora_path": None,
    "session_params": None, "custom_logit_processor": None, "mm_hashes": None, "modalities": None,
    "images_config": None, "kv_hints": None, "max_thinking_tokens": None, "require_reasoning": None,
}  # fmt: skip


class BadRequest(ValueError):
    """A request the engine refuses (HTTP 400). `contract`: it breaks the wire schema itself."""

    def __init__(self, message: str, *, contract: bool = False) -> None:
        super().__init__(message)
        self.contract = contract


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateItem:
    """One generation of a (possibly batched, possibly n > 1) /generate request."""

    rid: str | None
    input_ids: list[int] | None
    text: str | None
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    """-1: no input logprobs (SGLang's default)."""
    top_logprobs_num: int
    token_ids_logprob: tuple[int, ...]
    cache_namespace: tuple[str | None, str | None] = (None, None)
    """(`extra_key`, `cache_salt`): requests share prefix-cache entries only within one namespace."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateReq:
    items: list[GenerateItem]
    """In SGLang's order: for each prompt of the batch, its n samples (rids `<rid>_<i>` when one rid)."""
    batch: bool
    """Answer a list (batch input, or n > 1), as SGLang, instead of one object."""
    stream: bool
    return_text_in_logprobs: bool
    return_prompt_token_ids: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class AbortReq:
    rid: str
    abort_all: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class PauseReq:
    mode: PauseMode


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateFromDiskReq:
    model_path: str
    weight_version: str | None
    abort_all_requests: bool
    flush_cache: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class InitGroupReq:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateFromDistributedReq:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    weight_version: str | None
    abort_all_requests: bool
    flush_cache: bool
    flattened_bucket: bool = False
    """`load_format: "flattened_bucket"`: one broadcast of all tensors' bytes (any other format: one each)."""
    load_target: bool = True
    """False for `selector: "draft"`: there is no draft model, so SGLang receives and loads nothing."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateVersionReq:
    new_version: str
    abort_all_requests: bool


def parse_generate(body: object) -> GenerateReq:
    """SGLang's `GenerateReqInput` and its normalisation (`io_struct.py` `normalize_batch_and_arguments`):
    a single prompt, or a batch (a list of texts / of input_id lists), each expanded to
    `sampling_params.n` samples; per-item lists of sampling_params, rids and logprob fields."""
    m = _object(body, "GenerateRequest")
    for key, default in _GENERATE_DEFAULT_ONLY.items():
        if m.get(key) not in (None, default):
            raise BadRequest(f"{key}={m[key]!r} is not supported by the embedded engine")
    prompts = _prompts(m)
    single = prompts is None
    ids_or_texts: list[tuple[list[int] | None, str | None]] = (
        [_single_prompt(m)] if prompts is None else prompts
    )
    size = len(ids_or_texts)
    raw_params = m.get("sampling_params")
    if isinstance(raw_params, list):
        if single or len(raw_params) != size:
            raise BadRequest("sampling_params must be one object, or a list as long as the batch")
        params = [parse_sampling_params(p) for p in raw_params]
    else:
        params = [parse_sampling_params(raw_params)] * size
    n = params[0].n
    if any(p.n != n for p in params):
        raise BadRequest("The parallel_sample_num should be the same for all samples in sample params.")
    rids = _rids(m.get("rid"), size=size, single=single, n=n)
    per_item = {
        key: _per_item(m, key, kind, default, size=size, n=n)
        for key, kind, default in (
            ("return_logprob", bool, False),
            ("logprob_start_len", int, -1),
            ("top_logprobs_num", int, 0),
        )
    }
    token_ids = _token_ids_logprob(m.get("token_ids_logprob"), size=size, n=n)
    extra_keys = _str_per_prompt(m, "extra_key", size=size, single=single)
    salts = _str_per_prompt(m, "cache_salt", size=size, single=single)
    items: list[GenerateItem] = []
    for i, (ids, text) in enumerate(ids_or_texts):
        if per_item["top_logprobs_num"][i] < 0:
            raise BadRequest(f"top_logprobs_num must be >= 0, got {per_item['top_logprobs_num'][i]}")
        if per_item["logprob_start_len"][i] < -1:
            raise BadRequest(f"logprob_start_len must be >= -1, got {per_item['logprob_start_len'][i]}")
        for j in range(n):
            items.append(
                GenerateItem(
                    rid=rids[i * n + j],
                    input_ids=ids,
                    text=text,
                    params=params[i],
                    return_logprob=bool(per_item["return_logprob"][i]),
                    logprob_start_len=int(per_item["logprob_start_len"][i]),
                    top_logprobs_num=int(per_item["top_logprobs_num"][i]),
                    token_ids_logprob=token_ids[i],
                    cache_namespace=(extra_keys[i], salts[i]),
                )
            )
    return GenerateReq(
        items=items,
        batch=not single or n > 1,
        stream=bool(_opt(m, "stream", bool)),
        return_text_in_logprobs=bool(_opt(m, "return_text_in_logprobs", bool)),
        return_prompt_token_ids=bool(_opt(m, "return_prompt_token_ids", bool)),
    )


def _single_prompt(m: Mapping[str, Any]) -> tuple[list[int] | None, str | None]:
    ids = m.get("input_ids")
    input_ids = None if ids is None else _int_list(ids, "input_ids")
    text = _opt(m, "text", str)
    if (input_ids is None) == (text is None):
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if input_ids is not None and not input_ids:
        raise BadRequest("input_ids must not be empty")
    if text is not None and not text:
        raise BadRequest("text must not be empty")
    return input_ids, text


def _prompts(m: Mapping[str, Any]) -> list[tuple[list[int] | None, str | None]] | None:
    """The batch's prompts, or None for a single prompt."""
    text, ids = m.get("text"), m.get("input_ids")
    if isinstance(text, list):
        if ids is not None:
            raise BadRequest("Either text, input_ids or input_embeds should be provided.")
        if not text or not all(isinstance(t, str) and t for t in text):
            raise BadRequest("a batch of text must be a non-empty list of non-empty strings", contract=True)
        return [(None, t) for t in text]
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        if text is not None:
            raise BadRequest("Either text, input_ids or input_embeds should be provided.")
        out: list[tuple[list[int] | None, str | None]] = []
        for i, row in enumerate(ids):
            row_ids = _int_list(row, f"input_ids[{i}]")
            if not row_ids:
                raise BadRequest(f"input_ids[{i}] must not be empty")
            out.append((row_ids, None))
        return out
    return None


def _rids(raw: object, *, size: int, single: bool, n: int) -> list[str | None]:
    """SGLang's rid expansion: one rid for n > 1 or a batch becomes `<rid>_<i>`; a list gives one per prompt,
    whose n samples get fresh rids (SGLang's `regenerate_rid`)."""
    total = size * n
    if raw is None:
        return [None] * total
    if isinstance(raw, str):
        return [raw] if single and n == 1 else [f"{raw}_{i}" for i in range(total)]
    if isinstance(raw, list) and all(isinstance(r, str) for r in raw):
        if single or len(raw) != size:
            raise BadRequest("The specified rids length mismatch with the batch_size for batch processing.")
        return [r if n == 1 else None for r in raw for _ in range(n)]
    raise BadRequest("The rid should be a string or a list of strings.")


def _per_item(m: Mapping[str, Any], key: str, kind: type, default: object, *, size: int, n: int) -> list[Any]:
    raw = m.get(key)
    if isinstance(raw, list):
        if n > 1:
            raise BadRequest(f"Cannot use list {key} with parallel_sample_num > 1")
        if len(raw) != size:
            raise BadRequest(f"{key} must be one value, or a list as long as the batch")
        return [default if v is None else _checked(v, key, kind) for v in raw]
    return [default if raw is None else _checked(raw, key, kind)] * size


def _str_per_prompt(m: Mapping[str, Any], key: str, *, size: int, single: bool) -> list[str | None]:
    raw = m.get(key)
    if raw is None or isinstance(raw, str):
        return [raw or None] * size  # "" means none, as SGLang
    if isinstance(raw, list) and not single and len(raw) == size and all(isinstance(v, str) for v in raw):
        return [v or None for v in raw]
    raise BadRequest(f"{key} should be a string, or for a batch a list of strings as long as the batch.")


def _checked(value: object, key: str, kind: type) -> object:
    if not is_kind(value, kind):
        raise BadRequest(f"invalid type for `{key}`: {value!r}, expected {kind.__name__}", contract=True)
    return value


def _token_ids_logprob(raw: object, *, size: int, n: int) -> list[tuple[int, ...]]:
    if not raw:
        return [()] * size
    if isinstance(raw, list) and all(is_kind(t, int) for t in raw):
        return [tuple(raw)] * size
    if isinstance(raw, list) and all(isinstance(r, list) for r in raw):
        if n > 1:
            raise BadRequest("Cannot use list token_ids_logprob with parallel_sample_num > 1")
        if len(raw) != size:
            raise BadRequest("token_ids_logprob must be one list of ids, or one list per prompt")
        return [tuple(_int_list(r, "token_ids_logprob")) for r in raw]
    raise BadRequest("invalid type for `token_ids_logprob`: expected a list of integers", contract=True)


def parse_sampling_params(raw: object) -> SamplingParams:
    m = {} if raw is None else _object(raw, "SamplingParams")
    unknown = set(m) - _SAMPLING_KEYS_IMPLEMENTED - set(_SAMPLING_DEFAULT_ONLY)
    if unknown:
        raise BadRequest(f"unknown field `{sorted(unknown)[0]}` in sampling_params", contract=True)
    for key, default in _SAMPLING_DEFAULT_ONLY.items():
        if m.get(key) not in (None, default):
            raise BadRequest(f"sampling_params.{key}={m[key]!r} is not supported by the embedded engine")
    max_new = _opt(m, "max_new_tokens", int)
    min_new = _opt(m, "min_new_tokens", int)
    temperature = _opt(m, "temperature", float)
    top_p = _opt(m, "top_p", float)
    top_k = _opt(m, "top_k", int)
    min_p = _opt(m, "min_p", float)
    n = _opt(m, "n", int)
    stop_raw = m.get("stop")
    stop = (
        (stop_raw,) if isinstance(stop_raw, str) else tuple(_str_list(stop_raw, "stop")) if stop_raw else ()
    )
    stop_ids = m.get("stop_token_ids")
    params = SamplingParams(
        max_new_tokens=128 if max_new is None else max_new,
        min_new_tokens=0 if min_new is None else min_new,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=TOP_K_ALL if top_k in (None, -1) else top_k,
        min_p=0.0 if min_p is None else min_p,
        frequency_penalty=_opt(m, "frequency_penalty", float) or 0.0,
        presence_penalty=_opt(m, "presence_penalty", float) or 0.0,
        repetition_penalty=_or(_opt(m, "repetition_penalty", float), 1.0),
        logit_bias=_logit_bias(m.get("logit_bias")),
        stop=tuple(s for s in stop if s),
        stop_token_ids=frozenset(() if stop_ids is None else _int_list(stop_ids, "stop_token_ids")),
        ignore_eos=bool(_opt(m, "ignore_eos", bool)),
        skip_special_tokens=_opt(m, "skip_special_tokens", bool) is not False,
        spaces_between_special_tokens=_opt(m, "spaces_between_special_tokens", bool) is not False,
        no_stop_trim=bool(_opt(m, "no_stop_trim", bool)),
        n=1 if n is None else n,
        sampling_seed=_opt(m, "sampling_seed", int),
    )
    _opt(m, "stream_interval", int)
    # Value checks, with SGLang's wording (sampling_params.py `verify`).
    if params.max_new_tokens < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {params.max_new_tokens}.")
    if not 0 <= params.min_new_tokens <= params.max_new_tokens:
        raise BadRequest(
            f"min_new_tokens must be in [0, max_new_tokens({params.max_new_tokens})], "
            f"got {params.min_new_tokens}."
        )
    if not math.isfinite(params.temperature) or params.temperature < 0.0:
        raise BadRequest(f"temperature must be a non-negative finite number, got {params.temperature}.")
    if not 0.0 < params.top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {params.top_p}.")
    if params.top_k < 1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {params.top_k}.")
    if not 0.0 <= params.min_p <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {params.min_p}.")
    if not -2.0 <= params.frequency_penalty <= 2.0:
        raise BadRequest(f"frequency_penalty must be in [-2, 2], got {params.frequency_penalty}.")
    if not -2.0 <= params.presence_penalty <= 2.0:
        raise BadRequest(f"presence_penalty must be in [-2, 2], got {params.presence_penalty}.")
    if not 0.0 < params.repetition_penalty <= 2.0:
        raise BadRequest(
            f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {params.repetition_penalty}."
        )
    if params.n < 1:
        raise BadRequest(f"n must be at least 1, got {params.n}.")
    return params


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _logit_bias(raw: object) -> tuple[tuple[int, float], ...]:
    """SGLang's `logit_bias`: {"<token id>": bias}; keys are token ids as strings (as in OpenAI's API)."""
    if not raw:
        return ()
    if not isinstance(raw, dict):
        raise BadRequest(
            "invalid type for `logit_bias`: expected an object of token id -> bias", contract=True
        )
    out: list[tuple[int, float]] = []
    for key, bias in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias key {key!r} is not a token id") from None
        if not is_kind(bias, float):
            raise BadRequest(f"logit_bias[{key!r}] must be a number, got {bias!r}", contract=True)
        out.append((token, float(bias)))
    return tuple(sorted(out))


def parse_abort(body: object) -> AbortReq:
    f = _Lax(body, "AbortReq")
    return AbortReq(rid=f.opt_text("rid") or "", abort_all=f.flag("abort_all", False))


def parse_pause(body: object) -> PauseReq:
    m = _object(body, "PauseGenerationReqInput")
    mode = _opt(m, "mode", str) or "abort"
    if mode not in _PAUSE_MODES:
        raise BadRequest(f"unknown pause mode {mode!r}; expected one of {list(_PAUSE_MODES)}")
    return PauseReq(mode=mode)  # type: ignore[arg-type]  # narrowed by the membership check


def parse_slow_down(body: object) -> float | None:
    m = _object(body, "SlowDownReqInput")
    t = _opt(m, "forward_sleep_time", float)
    if t is not None and t < 0:
        raise BadRequest(f"forward_sleep_time must be >= 0, got {t}")
    return t


def parse_update_from_disk(body: object) -> UpdateFromDiskReq:
    f = _Lax(body, "UpdateWeightFromDiskReqInput")
    req = UpdateFromDiskReq(
        model_path=f.text("model_path"),
        weight_version=f.opt_text("weight_version"),
        abort_all_requests=f.flag("abort_all_requests", False),
        flush_cache=f.flag("flush_cache", True),
    )
    load_format = f.opt_text("load_format")
    for key in ("is_async", "torch_empty_cache", "keep_pause", "recapture_cuda_graph"):
        f.flag(key, False)  # checked as SGLang does; nothing to do for them on CPU
    f.integer("token_step", 0)
    f.opt_dict("manifest")
    _check_load_format(load_format)
    return req


def parse_init_group(body: object) -> InitGroupReq:
    f = _Lax(body, "InitWeightsUpdateGroupReqInput")
    req = InitGroupReq(
        master_address=f.text("master_address"),
        master_port=f.integer("master_port"),
        rank_offset=f.integer("rank_offset"),
        world_size=f.integer("world_size"),
        group_name=f.text("group_name", DEFAULT_GROUP_NAME),
        backend=f.text("backend", "nccl"),
    )
    if not req.group_name:
        raise BadRequest("Group name cannot be empty")  # SGLang's assertion in init_weights_update_group
    if req.backend != "gloo":
        raise BadRequest(f"backend {req.backend!r} is not available on the embedded CPU engine; use 'gloo'")
    if not 0 < req.rank_offset < req.world_size:
        raise BadRequest(f"need 0 < rank_offset < world_size (rank 0 is the trainer), got {req}")
    if not 0 < req.master_port < 65536:
        raise BadRequest(f"master_port must be in 1..65535, got {req.master_port}")
    return req


def parse_update_from_distributed(body: object) -> UpdateFromDistributedReq:
    f = _Lax(body, "UpdateWeightsFromDistributedReqInput")
    names = f.str_list("names")
    dtypes = f.str_list("dtypes")
    shapes = f.int_lists("shapes")
    group_name = f.text("group_name", DEFAULT_GROUP_NAME)
    flush_cache = f.flag("flush_cache", True)
    abort_all_requests = f.flag("abort_all_requests", False)
    weight_version = f.opt_text("weight_version")
    # SGLang reads load_format only to pick the flattened bucket; any other value means one broadcast each.
    load_format = f.opt_text("load_format")
    selector = f.choice("selector", ("target", "draft", "all"), "all")
    f.flag("torch_empty_cache", False)
    if not len(names) == len(dtypes) == len(shapes):
        raise BadRequest(
            f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}"
        )
    if not names:
        raise BadRequest("names must not be empty")
    if len(set(names)) != len(names):
        raise BadRequest("names must not repeat a tensor")
    if any(d < 0 for s in shapes for d in s):
        raise BadRequest("shapes must not have negative dimensions")
    return UpdateFromDistributedReq(
        names=names,
        dtypes=dtypes,
        shapes=shapes,
        group_name=group_name,
        weight_version=weight_version,
        abort_all_requests=abort_all_requests,
        flush_cache=flush_cache,
        flattened_bucket=load_format == "flattened_bucket",
        load_target=selector != "draft",
    )


def parse_update_version(body: object) -> UpdateVersionReq:
    f = _Lax(body, "UpdateWeightVersionReqInput")
    # SGLang's default is True (abort everything): kept for fidelity; miles_aio's client always sends False.
    return UpdateVersionReq(
        new_version=f.text("new_version"), abort_all_requests=f.flag("abort_all_requests", True)
    )


def parse_group_name(body: object) -> str:
    return _Lax(body, "DestroyWeightsUpdateGroupReqInput").text("group_name", DEFAULT_GROUP_NAME)


# ---- small typed readers; messages follow serde's style, like SGLang's contract errors ----


def _object(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(f"invalid type: expected struct {what} (a JSON object)", contract=True)
    return value


def is_kind(value: object, kind: type) -> bool:
    """A JSON value's type check as serde/msgspec do it: a bool is no int, an int is a float."""
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, int | float)
    return isinstance(value, kind)


def _opt(m: Mapping[str, Any], key: str, kind: type[T]) -> T | None:
    value = m.get(key)
    if value is None:
        return None
    if not is_kind(value, kind):
        raise BadRequest(f"invalid type for `{key}`: {value!r}, expected {kind.__name__}", contract=True)
    return float(value) if kind is float else value  # type: ignore[return-value]  # checked above


def _required(m: Mapping[str, Any], key: str, kind: type[T]) -> T:
    value = _opt(m, key, kind)
    if value is None:
        raise BadRequest(f"missing field `{key}`", contract=True)
    return value


def _int_list(value: object, key: str) -> list[int]:
    if not isinstance(value, list) or not all(is_kind(v, int) for v in value):
        raise BadRequest(f"invalid type for `{key}`: expected a list of integers", contract=True)
    return value


def _str_list(value: object, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"invalid type for `{key}`: expected a list of strings", contract=True)
    return value


def _check_load_format(fmt: str | None) -> None:
    if fmt not in (None, "auto", "safetensors"):
        raise BadRequest(
            f"load_format {fmt!r} is not supported by the embedded engine (use auto/safetensors)"
        )


# ---- SGLang's control requests: msgspec structs that FastAPI validates with pydantic in lax mode ----
# (`sglang/srt/utils/msgspec_utils.py` msgspec_struct_pydantic_core_schema: unknown keys ignored, defaults
# for missing keys, each field coerced as pydantic's lax mode does.) A value pydantic refuses is a contract
# error: SGLang answers it 400 with its RequestValidationError body, before the handler runs.

_MISSING: Final = object()
_WHITESPACE: Final = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680"
    + "".join(map(chr, range(0x2000, 0x200B)))
    + "\u2028\u2029\u202f\u205f\u3000"
)
"""What pydantic-core (Rust's `str::trim`, Unicode White_Space) strips around an integer string."""
_INT_TEXT: Final = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")
_TRUE_TEXT: Final = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_TEXT: Final = frozenset({"0", "off", "f", "false", "n", "no"})
_INT_FLOAT_LIMIT: Final = 2.0**63


def lax_int(value: object) -> int:
    """pydantic's lax `int`: ints, bools, integral floats below 2**63, and integer strings ("29500",
    " +1_000 ", "7.00"); anything else raises ValueError with pydantic's message."""
    if isinstance(value, int):  # bool included: True is 1
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("Input should be a finite number")
        if value != int(value):
            raise ValueError("Input should be a valid integer, got a number with a fractional part")
        if not -_INT_FLOAT_LIMIT < value < _INT_FLOAT_LIMIT:
            raise ValueError("Unable to parse input string as an integer, exceeded maximum size")
        return int(value)
    if isinstance(value, str):
        text = value.strip(_WHITESPACE)
        if _INT_TEXT.fullmatch(text):
            return int(text.split(".", 1)[0])
        raise ValueError("Input should be a valid integer, unable to parse string as an integer")
    raise ValueError("Input should be a valid integer")


def lax_bool(value: object) -> bool:
    """pydantic's lax `bool`: bools, 0/1 (int or float), and "true"/"no"/"1"/"off"/... any case."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        if value in (0, 1):
            return bool(value)
        # an integer (integral float) that fits i64 is read, then refused; anything else is not even read
        integral = isinstance(value, int) or (math.isfinite(value) and value == int(value))
        if integral and -(2**63) <= value < 2**63:
            raise ValueError("Input should be a valid boolean, unable to interpret input")
        raise ValueError("Input should be a valid boolean")
    if isinstance(value, str):
        if value.lower() in _TRUE_TEXT:
            return True
        if value.lower() in _FALSE_TEXT:
            return False
        raise ValueError("Input should be a valid boolean, unable to interpret input")
    raise ValueError("Input should be a valid boolean")


class _Lax:
    """Reads fields of one SGLang control struct with pydantic's lax coercions; contract BadRequest if not."""

    def __init__(self, body: object, struct: str) -> None:
        self.m = _object(body, struct)
        self.struct = struct

    def _get(self, key: str, default: object) -> object:
        if key in self.m:
            return self.m[key]
        if default is _MISSING:
            raise self._error(key, "Field required", None)
        return default

    def _error(self, key: str, msg: str, value: object) -> BadRequest:
        shown = "" if value is None and msg == "Field required" else f" [input_value={value!r}]"
        return BadRequest(f"1 validation error for {self.struct}\n{key}\n  {msg}{shown}", contract=True)

    def text(self, key: str, default: object = _MISSING) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise self._error(key, "Input should be a valid string", value)
        return value

    def opt_text(self, key: str) -> str | None:
        value = self._get(key, None)
        return None if value is None else self.text(key)

    def integer(self, key: str, default: object = _MISSING) -> int:
        value = self._get(key, default)
        try:
            return lax_int(value)
        except ValueError as exc:
            raise self._error(key, str(exc), value) from None

    def flag(self, key: str, default: object = _MISSING) -> bool:
        value = self._get(key, default)
        try:
            return lax_bool(value)
        except ValueError as exc:
            raise self._error(key, str(exc), value) from None

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        value = self._get(key, default)
        if value not in choices:
            options = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
            raise self._error(key, f"Input should be {options}", value)
        return value

    def opt_dict(self, key: str) -> dict[str, Any] | None:
        value = self._get(key, None)
        if value is not None and not isinstance(value, dict):
            raise self._error(key, "Input should be a valid dictionary", value)
        return value

    def str_list(self, key: str) -> list[str]:
        value = self._get(key, _MISSING)
        if not isinstance(value, list):
            raise self._error(key, "Input should be a valid list", value)
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise self._error(f"{key}.{i}", "Input should be a valid string", item)
        return value

    def int_lists(self, key: str) -> list[list[int]]:
        value = self._get(key, _MISSING)
        if not isinstance(value, list):
            raise self._error(key, "Input should be a valid list", value)
        out: list[list[int]] = []
        for i, row in enumerate(value):
            if not isinstance(row, list):
                raise self._error(f"{key}.{i}", "Input should be a valid list", row)
            ints: list[int] = []
            for j, item in enumerate(row):
                try:
                    ints.append(lax_int(item))
                except ValueError as exc:
                    raise self._error(f"{key}.{i}.{j}", str(exc), item) from None
            out.append(ints)
        return out
