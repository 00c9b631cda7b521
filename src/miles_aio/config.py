"""Typed, frozen configuration: one dataclass per component, one field per command-line flag.

Every field's flag is `--` + its name with `_` → `-` (miles' flag names), and its help text lives in the
field's metadata, so the CLI (`miles_aio.cli`) and the docs are generated from this file. Invalid values
raise `ConfigError` naming the flags, from `__post_init__`, so a bad config can never be constructed —
the CLI turns that into exit code 2 before any process starts.

`__post_init__` only checks values: it reads no file, looks at no environment, logs nothing and
rewrites no field, so it can run again on every copy (`RunConfig.replace`) and in every rank. The one
path from flags to components is

    flags ──cli.parse_flags──▶ values ──cli.config_from_values──▶ RunConfig (validated)
          ──resolve──▶ RunConfig (derived fields filled in, environment checked; once, in the controller)
          ──config_warnings──▶ logged once

and every component then reads that one resolved `RunConfig` (the trainer ranks its `train` part).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, TypeAlias

import structlog

from miles_aio._fields import ConfigWarning, flag, opt
from miles_aio.errors import ConfigError
from miles_aio.observability.config import ObservabilityConfig, check_observability_installed
from miles_aio.trainer.config import (
    TrainConfig,
    check_batch_arithmetic,
    check_model_layers,
    check_off_policy_correction,
    check_run_lr_decay,
    train_warnings,
    with_run_lr_decay,
)

__all__ = [
    "AUTO",
    "BufferConfig",
    "ConcurrencyBound",
    "ConfigWarning",
    "DataConfig",
    "DriverConfig",
    "EngineConfig",
    "EvalConfig",
    "ObservabilityConfig",
    "RolloutConfig",
    "RunConfig",
    "SchedulerConfig",
    "TrainConfig",
    "config_warnings",
    "flag",
    "log_config_warnings",
    "opt",
    "parse_concurrency_bound",
    "resolve",
]

log = structlog.get_logger("miles_aio.config")

_CTX: Final = "--rollout-max-context-len"
Granularity = Literal["sample", "group"]
UnusedHandler = Literal["retry", "drop"]
PauseMode = Literal["retract", "in_place", "abort"]
AUTO: Final = "auto"
ConcurrencyBound: TypeAlias = int | Literal["auto"]
"""`--async-max-concurrent-samples`: a number of samples, or `AUTO` (adapted to engine load)."""


def parse_concurrency_bound(text: str) -> ConcurrencyBound:
    """The flag's text as a `ConcurrencyBound`: `auto`, or a whole number (ValueError otherwise)."""
    text = text.strip()
    if text == AUTO:
        return AUTO
    if not text.isdigit():
        raise ValueError(f"must be a positive integer or 'auto', got {text!r}")
    return int(text)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _positive(value: float | None, name: str, *, allow_none: bool = False, zero_ok: bool = False) -> None:
    if value is None:
        if allow_none:
            return
        raise ConfigError("is required", flags=[flag(name)])
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"must be {'>= 0' if zero_ok else '> 0'}, got {value}", flags=[flag(name)])


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Where prompts come from (`miles_aio.data.DataSource`)."""

    prompt_data: Path | None = opt(None, "JSONL file of prompts, one JSON object per line.")
    input_key: str = opt("prompt", "Key of the prompt (a string or a list of chat messages) in each line.")
    label_key: str | None = opt("label", "Key of the label passed to the reward function.")
    metadata_key: str | None = opt(None, "Key of a per-prompt metadata object copied into Sample.metadata.")
    apply_chat_template: bool = opt(
        False, "Wrap text prompts as one user message, so generate applies the tokenizer's chat template."
    )
    rollout_shuffle: bool = opt(
        True, "Shuffle the prompts each epoch (seeded by --rollout-seed and the epoch)."
    )
    rollout_seed: int = opt(42, "Seed of the prompt shuffle (the trainer's is --seed).")
    skip_invalid_prompts: bool = opt(
        False, "Skip (log, count) invalid prompt lines instead of failing; rollout/skipped_prompts/<reason>."
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """What each rollout does and how many run at once."""

    rollout_batch_size: int = opt(help="Prompt groups consumed per training step.")
    n_samples_per_prompt: int = opt(1, "Samples per prompt (the group size).")
    rollout_max_response_len: int = opt(1024, "max_new_tokens of each generate call.")
    rollout_max_context_len: int | None = opt(None, "Cap on prompt + response tokens of a sample.")
    rollout_max_prompt_len: int | None = opt(
        None, "Skip prompts longer than this many tokens (counted in rollout/skipped_prompts/too_long)."
    )
    rollout_temperature: float = opt(1.0, "Sampling temperature.")
    rollout_top_p: float = opt(1.0, "Nucleus sampling threshold.")
    rollout_top_k: int = opt(-1, "Top-k sampling (-1: off).")
    rollout_stop_token_ids: tuple[int, ...] = opt((), "Extra token ids that end a response.")
    rollout_stop: tuple[str, ...] = opt(
        (), "Stop strings that end a response (kept in the response text, as miles sends no_stop_trim)."
    )
    rollout_skip_special_tokens: bool = opt(
        False, "Drop special tokens (e.g. the EOS text) from the response text (miles keeps them)."
    )
    custom_generate_function_path: str = opt(
        "miles_aio.rollout.single_turn:generate",
        "Rollout coroutine `async def generate(ctx, sample, sampling_params) -> Sample | list[Sample]`.",
        metavar="PKG.MOD:ATTR",
    )
    custom_rm_path: str | None = opt(
        None,
        "Reward coroutine `async def reward(ctx, sample) -> float | dict` "
        "(with --group-rm: `async def reward(ctx, samples) -> list`).",
        metavar="PKG.MOD:ATTR",
    )
    group_rm: bool = opt(False, "Call the reward function once per group instead of once per sample.")
    dynamic_sampling_filter_path: str | None = opt(
        None,
        "Put-time group filter `fn(ctx, group) -> bool | (keep, reason)`; rejected groups are dropped.",
        metavar="PKG.MOD:ATTR",
    )
    sglang_server_concurrency: int = opt(512, "Concurrent generate calls per engine (the limiter's size).")
    rollout_failure_policy: Literal["fail", "drop", "retry"] = opt(
        "fail",
        "When user code (generate, reward, group reward, dynamic filter) raises or returns something "
        "unusable: stop the run (fail, loudly), drop the group (counted, traceback logged), or retry its "
        "prompt later.",
    )
    # -- agent sessions (miles_aio.rollout.agent) ---------------------------------------------------------
    custom_agent_function_path: str | None = opt(
        None,
        "Agent coroutine `async def run_agent(base_url, prompt, request_kwargs, metadata, **kwargs) -> dict "
        "| None`, run per sample against an OpenAI-compatible session endpoint of its own; the tokens the "
        "model produced there become the sample (the generate function defaults to "
        "miles_aio.rollout.agent:generate).",
        metavar="PKG.MOD:ATTR",
    )
    session_message_matcher: str = opt(
        "strict",
        "How a resent message is matched against the session's (miles' names): strict, loose_tool_call, "
        "role_content_only, or a plain function PKG.MOD:FN.",
    )
    session_tool_call_parser: str = opt(
        "qwen25",
        "How tool calls are parsed out of the model's replies: qwen25 (<tool_call>{json}</tool_call>, "
        "SGLang's name), none, or a plain function PKG.MOD:FN.",
    )
    max_seq_len: int | None = opt(
        None,
        "Cap on an agent session's tokens (prompt, every reply and tool output): replies are capped to fit "
        "and the sample is cut to it.",
    )
    session_server_host: str = opt(
        "127.0.0.1", "Address of the agent session endpoint; not loopback: needs --session-server-api-key."
    )
    session_server_port: int = opt(0, "Port of the agent session endpoint (0: a free one).")
    session_server_api_key: str | None = opt(
        None, "Key the session endpoint requires (Authorization: Bearer ...); agents get it as api_key."
    )

    def __post_init__(self) -> None:
        self._check_agent_sessions()
        _positive(self.rollout_batch_size, "rollout_batch_size")
        _positive(self.n_samples_per_prompt, "n_samples_per_prompt")
        _positive(self.rollout_max_response_len, "rollout_max_response_len")
        _positive(self.rollout_max_context_len, "rollout_max_context_len", allow_none=True)
        _positive(self.rollout_max_prompt_len, "rollout_max_prompt_len", allow_none=True)
        if (p := self.rollout_max_prompt_len) is not None and p >= (self.rollout_max_context_len or p + 1):
            raise ConfigError("needs max prompt < max context", flags=["--rollout-max-prompt-len", _CTX])
        _positive(self.rollout_temperature, "rollout_temperature", zero_ok=True)
        _positive(self.sglang_server_concurrency, "sglang_server_concurrency")
        if not 0 < self.rollout_top_p <= 1:
            raise ConfigError(f"must be in (0, 1], got {self.rollout_top_p}", flags=["--rollout-top-p"])

    def _check_agent_sessions(self) -> None:
        _positive(self.max_seq_len, "max_seq_len", allow_none=True)
        if not 0 <= self.session_server_port <= 65535:
            raise ConfigError(
                f"must be in [0, 65535], got {self.session_server_port}", flags=["--session-server-port"]
            )
        if not _is_loopback(self.session_server_host) and not self.session_server_api_key:
            raise ConfigError(
                f"{self.session_server_host} is not a loopback address: the session endpoint would serve "
                "the policy to anyone who can reach it; set --session-server-api-key",
                flags=["--session-server-host", "--session-server-api-key"],
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """Which inference engines serve rollouts (`miles_aio.inference.engines`)."""

    rollout_backend: Literal["local", "sglang", "vllm"] = opt(
        "local",
        "Embedded CPU engines (local), or SGLang (sglang) or vLLM (vllm) servers launched by this run.",
    )
    sglang_urls: tuple[str, ...] = opt((), "Use these running SGLang servers (or one sglang-router URL).")
    vllm_urls: tuple[str, ...] = opt(
        (), "Use these running vLLM servers (VLLM_SERVER_DEV_MODE=1); needs --rollout-backend vllm."
    )
    sglang_api_key: str | None = opt(None, "API key of the SGLang servers (Authorization: Bearer).")
    rollout_num_gpus: int = opt(1, "GPUs for rollout engines (local backend: engine processes).")
    rollout_num_gpus_per_engine: int = opt(1, "GPUs per engine, i.e. its tensor-parallel size.")
    engine_num_threads: int = opt(1, "torch threads per embedded engine (local backend).")
    engine_max_running_requests: int = opt(
        64,
        "Requests each embedded engine decodes together, one KV slot each (local backend; SGLang's is "
        "--sglang-max-running-requests).",
    )
    engine_batch_generate: bool = opt(
        True,
        "Send a prompt group's /generate calls made in the same event-loop tick as one batch /generate "
        "(SGLang's list-valued input_ids; SGLang and the embedded engine, not vLLM): one HTTP round trip "
        "instead of one per sample. A batch answers when its last item finishes; "
        "--no-engine-batch-generate sends every call alone.",
    )
    engine_admin_timeout_s: float = opt(
        60.0,
        "Deadline of each engine's answer to a weight-push call (pause, flush, load, stamp, continue): an "
        "engine that fails one or misses it is excluded from the push, and rejoins once re-synced.",
    )
    engine_max_restarts: int = opt(
        3, "Restarts of each launched engine whose process died, over the run (exponential backoff)."
    )
    engine_flush_attempts: int = opt(
        6,
        "Tries of a push's /flush_cache per engine while it answers 400 (requests still running or "
        "queued); then that engine is excluded from the push. All tries share --engine-admin-timeout-s.",
    )
    engine_flush_backoff_s: float = opt(
        0.25, "Seconds before the second /flush_cache try; doubled for each further one, capped at 2 s."
    )

    def __post_init__(self) -> None:
        _positive(self.engine_admin_timeout_s, "engine_admin_timeout_s")
        _positive(self.engine_max_restarts, "engine_max_restarts", zero_ok=True)
        if self.engine_flush_attempts < 1:
            raise ConfigError(
                f"must be >= 1, got {self.engine_flush_attempts}", flags=["--engine-flush-attempts"]
            )
        _positive(self.engine_flush_backoff_s, "engine_flush_backoff_s", zero_ok=True)
        _positive(self.rollout_num_gpus, "rollout_num_gpus")
        _positive(self.rollout_num_gpus_per_engine, "rollout_num_gpus_per_engine")
        _positive(self.engine_num_threads, "engine_num_threads")
        _positive(self.engine_max_running_requests, "engine_max_running_requests")
        if self.rollout_num_gpus % self.rollout_num_gpus_per_engine:
            raise ConfigError(
                f"{self.rollout_num_gpus} GPUs do not split into engines of "
                f"{self.rollout_num_gpus_per_engine}",
                flags=["--rollout-num-gpus", "--rollout-num-gpus-per-engine"],
            )
        if self.vllm_urls and self.rollout_backend != "vllm":
            raise ConfigError(
                "vLLM servers need the vLLM client: add --rollout-backend vllm",
                flags=["--vllm-urls", "--rollout-backend"],
            )
        if self.rollout_backend == "vllm" and self.sglang_urls:
            raise ConfigError(
                "--rollout-backend vllm talks to vLLM servers: give them with --vllm-urls",
                flags=["--sglang-urls", "--rollout-backend"],
            )

    @property
    def num_engines(self) -> int:
        """len(--sglang-urls or --vllm-urls) if given, else rollout_num_gpus // rollout_num_gpus_per_engine"""
        urls = self.sglang_urls or self.vllm_urls
        return len(urls) or self.rollout_num_gpus // self.rollout_num_gpus_per_engine


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """When a new prompt group may be submitted (`miles_aio.scheduler.policy`)."""

    async_max_concurrent_samples: ConcurrencyBound | None = opt(
        None,
        "In-flight bound in samples; `auto` adapts it (and the limiter) to engine load, within "
        "--adaptive-concurrency-min/max.",
        metavar="N|auto",
        parse=parse_concurrency_bound,
        shown_default="rollout_batch_size × n_samples_per_prompt",
    )
    adaptive_concurrency_min: int = opt(8, "With `auto`: the smallest in-flight bound (samples).")
    adaptive_concurrency_max: int = opt(4096, "With `auto`: the largest in-flight bound (samples).")
    adaptive_concurrency_interval_s: float = opt(5.0, "With `auto`: seconds between two decisions.")
    rollout_submission_granularity: Granularity = opt(
        "sample", "When capacity frees: per finished sample, or when a group's slowest sample finishes."
    )
    max_admission_staleness: int | None = opt(
        None,
        "Admission pacing: admit a group only if it cannot be more than K versions old when consumed.",
        metavar="K",
    )

    def __post_init__(self) -> None:
        cap = self.async_max_concurrent_samples
        if isinstance(cap, str) and cap != AUTO:  # the CLI parses the flag; code must pass an int
            raise ConfigError(
                f"must be a positive integer or {AUTO!r}, got {cap!r}",
                flags=["--async-max-concurrent-samples"],
            )
        if not isinstance(cap, str):
            _positive(cap, "async_max_concurrent_samples", allow_none=True)
        _positive(self.adaptive_concurrency_min, "adaptive_concurrency_min")
        _positive(self.adaptive_concurrency_interval_s, "adaptive_concurrency_interval_s")
        if self.adaptive_concurrency_max < self.adaptive_concurrency_min:
            raise ConfigError(
                f"max ({self.adaptive_concurrency_max}) < min ({self.adaptive_concurrency_min})",
                flags=["--adaptive-concurrency-min", "--adaptive-concurrency-max"],
            )
        _positive(self.max_admission_staleness, "max_admission_staleness", allow_none=True, zero_ok=True)

    @property
    def adaptive(self) -> bool:
        """--async-max-concurrent-samples auto."""
        return self.async_max_concurrent_samples == AUTO


@dataclass(frozen=True, kw_only=True, slots=True)
class BufferConfig:
    """The DataBuffer between the rollout worker and the driver (`miles_aio.buffer`)."""

    async_data_buffer_capacity_factor: float = opt(
        2.0, "Buffer capacity = floor(factor × rollout_batch_size) groups; a full buffer blocks rollout."
    )
    max_weight_staleness: int | None = opt(
        None, "Consume-time filter: groups older than this many versions go to the unused handler."
    )
    async_unused_samples_handler: UnusedHandler = opt(
        "drop", "Aborted and stale groups: re-admit their prompt (retry, served first) or drop them."
    )
    custom_async_data_buffer_path: str | None = opt(
        None, "A DataBuffer subclass replacing the default buffer.", metavar="PKG.MOD:CLASS"
    )
    max_group_recycles: int = opt(
        8, "A prompt group recycled this many times (retry handler or failure policy) is dropped instead."
    )

    def __post_init__(self) -> None:
        _positive(self.max_group_recycles, "max_group_recycles")
        factor = self.async_data_buffer_capacity_factor
        if not (factor > 0 and math.isfinite(factor)):
            raise ConfigError(f"must be > 0, got {factor}", flags=["--async-data-buffer-capacity-factor"])
        _positive(self.max_weight_staleness, "max_weight_staleness", allow_none=True, zero_ok=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class DriverConfig:
    """The controller's step loop: how long to run, when to push weights, save and evaluate."""

    num_rollout: int = opt(help="Training steps (rollouts) to run.")
    update_weights_interval: int = opt(1, "Push weights to the engines every N steps.")
    pause_generation_mode: PauseMode = opt(
        "retract", "In-flight requests during a weight push: requeue (retract), freeze, or abort."
    )
    partial_rollout: bool = opt(
        False, "Continue requests aborted by a pause under the new weights, keeping their tokens."
    )
    overlap_weight_push: bool = opt(
        False,
        "With the disk transfer: once rank 0 has written the weights, the engines' pause, load and continue "
        "run alongside the next step's training (as prime-rl's trainer never waits for its inference "
        "servers). Pays where trainer and engines have their own devices; on one shared CPU they compete "
        "for it (docs/guide/fully-async.md).",
    )
    save: Path | None = opt(None, "Checkpoint directory.")
    save_interval: int | None = opt(None, "Save a checkpoint every N steps (needs --save).")
    load: Path | None = opt(None, "Resume from this checkpoint directory.")
    eval_interval: int | None = opt(None, "Evaluate every N steps, and after the last step.")
    event_loop: Literal["asyncio", "uvloop"] = opt(
        "asyncio",
        "The controller's event loop. uvloop (pip install 'miles_aio[uvloop]') runs the loop's own "
        "machinery in C: 61 instead of 70-74 us of controller CPU per sample at the ceiling "
        "(docs/guide/scaling.md); worth it from thousands of requests per second.",
    )
    stall_warning_s: float = opt(
        30.0,
        "When the drain waits this long without a group: log a warning and probe the engines "
        "(/health_generate within --engine-admin-timeout-s; one that does not answer is excluded).",
    )

    def __post_init__(self) -> None:
        _positive(self.num_rollout, "num_rollout", zero_ok=True)
        _positive(self.update_weights_interval, "update_weights_interval")
        _positive(self.save_interval, "save_interval", allow_none=True)
        _positive(self.eval_interval, "eval_interval", allow_none=True)
        _positive(self.stall_warning_s, "stall_warning_s")
        if self.pause_generation_mode == "abort" and not self.partial_rollout:
            raise ConfigError(
                "abort would throw away every in-flight request; it needs --partial-rollout to continue them",
                flags=["--pause-generation-mode", "--partial-rollout"],
            )
        if self.eval_interval is not None and self.eval_interval % self.update_weights_interval:
            raise ConfigError(
                f"an eval point evaluates the weights pushed last, so it must fall on a push: eval interval "
                f"{self.eval_interval} is not a multiple of {self.update_weights_interval}",
                flags=["--eval-interval", "--update-weights-interval"],
            )
        if self.save_interval is not None and self.save is None:
            raise ConfigError(
                "a save interval needs a checkpoint directory", flags=["--save-interval", "--save"]
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    """Evaluation (`miles_aio.eval`); `--eval-interval` is with the driver's periodic actions."""

    eval_prompt_data: tuple[str, ...] = opt(
        (), "Eval datasets as NAME PATH pairs (JSONL, same keys as --prompt-data).", metavar="NAME PATH"
    )
    n_samples_per_eval_prompt: int = opt(1, "Samples per eval prompt.")
    eval_max_response_len: int | None = opt(
        None, "max_new_tokens for eval.", shown_default="--rollout-max-response-len"
    )
    eval_temperature: float | None = opt(
        None, "Sampling temperature for eval.", shown_default="--rollout-temperature"
    )
    skip_eval_before_train: bool = opt(False, "Do not evaluate the initial weights.")
    # Mode 2 (dedicated engines loading HF snapshots) and mode 3 (an external CheckpointEvalFn)
    eval_sglang_urls: tuple[str, ...] = opt(
        (), "Mode 2: evaluate on these running engines (they load HF snapshots), not the rollout ones."
    )
    eval_num_gpus: int = opt(0, "Mode 2: GPUs for dedicated eval engines started by this run (CPU: engines).")
    eval_num_gpus_per_engine: int = opt(1, "GPUs per dedicated eval engine (its tensor-parallel size).")
    eval_function_path: str | None = opt(
        None,
        "Mode 3: a miles_aio.eval.CheckpointEvalFn subclass evaluating each HF snapshot externally.",
        metavar="PKG.MOD:CLASS",
    )
    eval_hf_dir: Path | None = opt(
        None, "Modes 2/3 export source: a fresh HF export per eval point to DIR/step_<n> (tmpfs is best)."
    )
    save_hf: str | None = opt(
        None,
        "Also export an HF checkpoint at every --save, to this path format ({step} = steps trained); "
        "modes 2/3 reuse it as their snapshot when --eval-hf-dir is not given.",
        metavar="FORMAT",
    )
    eval_max_in_flight: int = opt(2, "Modes 2/3: eval points pending at once (exported, not yet evaluated).")
    eval_overflow_policy: Literal["backpressure", "skip"] = opt(
        "backpressure",
        "Modes 2/3, a point due while --eval-max-in-flight are pending: wait for the oldest, or skip it.",
    )
    eval_keep_snapshots: int = opt(
        2,
        "Modes 2/3: exported snapshot dirs kept after their points settled (never --save-hf ones).",
    )

    def __post_init__(self) -> None:
        _positive(self.eval_num_gpus, "eval_num_gpus", zero_ok=True)
        _positive(self.eval_num_gpus_per_engine, "eval_num_gpus_per_engine")
        _positive(self.eval_max_in_flight, "eval_max_in_flight")
        _positive(self.eval_keep_snapshots, "eval_keep_snapshots", zero_ok=True)
        if self.eval_num_gpus % self.eval_num_gpus_per_engine:
            raise ConfigError(
                f"{self.eval_num_gpus} GPUs do not split into engines of {self.eval_num_gpus_per_engine}",
                flags=["--eval-num-gpus", "--eval-num-gpus-per-engine"],
            )
        if self.eval_sglang_urls and self.eval_num_gpus:
            raise ConfigError(
                "give running eval engines or GPUs to start them on, not both",
                flags=["--eval-sglang-urls", "--eval-num-gpus"],
            )
        if self.dedicated_engines and self.eval_function_path is not None:
            raise ConfigError(
                "dedicated eval engines (mode 2) and an external eval function (mode 3) exclude each other",
                flags=[
                    "--eval-sglang-urls" if self.eval_sglang_urls else "--eval-num-gpus",
                    "--eval-function-path",
                ],
            )
        if self.save_hf is not None:
            try:
                formatted = self.save_hf.format(step=0)
            except (KeyError, IndexError, ValueError) as e:
                raise ConfigError(f"bad path format {self.save_hf!r}: {e!r}", flags=["--save-hf"]) from e
            if formatted == self.save_hf.format(step=1):
                raise ConfigError(f"{self.save_hf!r} needs a {{step}} field", flags=["--save-hf"])
        if self.uses_snapshots and self.eval_hf_dir is None and self.save_hf is None:
            raise ConfigError(
                "eval modes 2 and 3 need a snapshot source: an export dir or the --save-hf checkpoints",
                flags=["--eval-hf-dir", "--save-hf"],
            )
        if len(self.eval_prompt_data) % 2:
            raise ConfigError("needs NAME PATH pairs", flags=["--eval-prompt-data"])
        if self.n_samples_per_eval_prompt < 1:
            raise ConfigError(
                f"must be >= 1, got {self.n_samples_per_eval_prompt}", flags=["--n-samples-per-eval-prompt"]
            )
        if self.eval_max_response_len is not None and self.eval_max_response_len < 1:
            raise ConfigError(
                f"must be >= 1, got {self.eval_max_response_len}", flags=["--eval-max-response-len"]
            )
        if self.eval_temperature is not None and self.eval_temperature < 0:
            raise ConfigError(f"must be >= 0, got {self.eval_temperature}", flags=["--eval-temperature"])

    @property
    def dedicated_engines(self) -> bool:
        """Mode 2: --eval-sglang-urls or --eval-num-gpus."""
        return bool(self.eval_sglang_urls) or self.eval_num_gpus > 0

    @property
    def uses_snapshots(self) -> bool:
        """Modes 2 and 3 evaluate HF snapshots of the trainer's weights."""
        return self.dedicated_engines or self.eval_function_path is not None

    @property
    def datasets(self) -> dict[str, Path]:
        pairs = self.eval_prompt_data
        return {pairs[i]: Path(pairs[i + 1]) for i in range(0, len(pairs), 2)}


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """A whole run. Cross-component rules live in `__post_init__` (pure checks, as the components');
    `resolve` fills in the derived fields once, in the controller process."""

    data: DataConfig
    rollout: RolloutConfig
    scheduler: SchedulerConfig
    buffer: BufferConfig
    driver: DriverConfig
    eval: EvalConfig = field(default_factory=EvalConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    run_dir: Path = opt(Path("runs/run"), "Directory for everything the run writes.")

    def __post_init__(self) -> None:
        n = self.rollout.n_samples_per_prompt
        cap = self.scheduler.async_max_concurrent_samples
        if self.scheduler.adaptive and self.scheduler.adaptive_concurrency_min < n:
            raise ConfigError(
                f"the smallest adaptive bound ({self.scheduler.adaptive_concurrency_min}) "
                f"must hold a group of {n} samples",
                flags=["--adaptive-concurrency-min", "--n-samples-per-prompt"],
            )
        if isinstance(cap, int) and cap < n:
            raise ConfigError(
                f"the in-flight bound ({cap}) must hold at least one whole group of {n} samples",
                flags=["--async-max-concurrent-samples", "--n-samples-per-prompt"],
            )
        check_batch_arithmetic(self.train, self.samples_per_step)
        check_run_lr_decay(
            self.train, num_rollout=self.driver.num_rollout, samples_per_step=self.samples_per_step
        )
        check_off_policy_correction(self.train, fully_async=True)
        if self.buffer_capacity_groups < 1:
            raise ConfigError(
                f"buffer capacity floor({self.buffer.async_data_buffer_capacity_factor} × "
                f"{self.rollout.rollout_batch_size}) is 0 groups",
                flags=["--async-data-buffer-capacity-factor", "--rollout-batch-size"],
            )
        self._check_eval_snapshots()

    def _check_eval_snapshots(self) -> None:
        ev, d = self.eval, self.driver
        if not ev.uses_snapshots:
            return
        if d.eval_interval is None:
            raise ConfigError("eval modes 2 and 3 need an eval interval", flags=["--eval-interval"])
        if ev.eval_hf_dir is None and (d.save_interval is None or d.eval_interval % d.save_interval):
            raise ConfigError(
                f"reusing --save-hf checkpoints needs every eval point on a save: eval interval "
                f"{d.eval_interval} is not a multiple of save interval {d.save_interval}",
                flags=["--eval-interval", "--save-interval", "--save-hf"],
            )

    @property
    def samples_per_step(self) -> int:
        """rollout_batch_size × n_samples_per_prompt: the samples one training step consumes."""
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt

    @property
    def max_in_flight_samples(self) -> int:
        """--async-max-concurrent-samples, else rollout_batch_size × n_samples_per_prompt (as miles);
        with `auto`, the initial bound: that default, clamped to --adaptive-concurrency-min/max."""
        s, cap = self.scheduler, self.scheduler.async_max_concurrent_samples
        default = self.samples_per_step
        if s.adaptive:
            return min(max(default, s.adaptive_concurrency_min), s.adaptive_concurrency_max)
        return cap if isinstance(cap, int) else default

    @property
    def buffer_capacity_groups(self) -> int:
        """floor(--async-data-buffer-capacity-factor × --rollout-batch-size)."""
        return math.floor(self.buffer.async_data_buffer_capacity_factor * self.rollout.rollout_batch_size)

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with some components (or run_dir) replaced; validation runs again (resolution does
        not: a copy that changes what a derived field derives from goes through `resolve` again)."""
        return dataclasses.replace(self, **changes)


def resolve(cfg: RunConfig) -> RunConfig:
    """The run's config with its derived fields filled in, after the checks that need more than the
    values (files, the environment); raises ConfigError naming the flags. Run once, in the controller
    process, before anything starts; every component (the trainer ranks too) then uses its result.

    - `--lr-decay-iters` unset with a linear/cosine schedule: the run's last optimizer step (Megatron's
      default), so the ranks train with the schedule the run's own config states;
    - `--hf-checkpoint`'s layer count splits into the pipeline stages (reads its config.json);
    - what the flags ask for is installed (wandb), and weights by broadcast to vLLM have a CUDA device
      (vLLM's weight transfer is NCCL only).

    Idempotent: `resolve(resolve(cfg)) == resolve(cfg)`."""
    train = with_run_lr_decay(
        cfg.train, num_rollout=cfg.driver.num_rollout, samples_per_step=cfg.samples_per_step
    )
    check_model_layers(train)
    check_observability_installed(cfg.observability)
    check_event_loop_installed(cfg.driver)
    check_vllm_broadcast(cfg)
    return cfg if train is cfg.train else cfg.replace(train=train)


def check_event_loop_installed(driver: DriverConfig) -> None:
    """--event-loop uvloop needs uvloop installed here (an optional extra, never a dependency)."""
    if driver.event_loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        raise ConfigError("uvloop is not installed (pip install 'miles_aio[uvloop]')", flags=["--event-loop"])


def check_vllm_broadcast(cfg: RunConfig) -> None:
    """Weights by broadcast to vLLM servers need CUDA: vLLM's weight transfer is NCCL only (it has no
    gloo backend, so a CPU trainer cannot send to it). Checked here when the trainer runs on this machine;
    ranks on other nodes (--actor-num-nodes > 1) report their device when they start, and a CPU one's
    pushes go by disk with a warning (`trainer.actor._group_protocol`)."""
    if cfg.engine.rollout_backend != "vllm" or cfg.train.update_weight_transfer_mode != "broadcast":
        return
    if cfg.train.actor_num_nodes > 1:
        return
    import torch  # only for this combination: the check needs the machine, not the values

    if not torch.cuda.is_available():
        raise ConfigError(
            "vLLM takes weights by broadcast over NCCL only, and this machine has no CUDA device: "
            "use --update-weight-transfer-mode disk",
            flags=["--update-weight-transfer-mode", "--rollout-backend"],
        )


def config_warnings(cfg: RunConfig) -> list[ConfigWarning]:
    """Valid but risky settings, for the controller process to log once (`log_config_warnings`)."""
    return train_warnings(cfg.train)


def log_config_warnings(cfg: RunConfig) -> None:
    """Log each of `config_warnings(cfg)` once, as a warning event with its flags and detail."""
    for w in config_warnings(cfg):
        log.warning(w.event, flags=list(w.flags), detail=w.detail)
