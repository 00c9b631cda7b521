"""The metric registry: every metric name the runtime can emit, with a one-line meaning.

Names are templates: `{ds}` (an eval dataset name), `{i}` (an engine index), `{reason}`, `{cause}`,
`{bucket}` and `{name}` stand for one path segment (no `/`). `eval/{metric...}` is the one open-ended
entry: the metrics of a user's `CheckpointEvalFn` (eval mode 3), which the runtime cannot know.

The step loop checks every key of every step record against this registry (`check_metrics`) and logs a
warning once per unknown key; the docs tests check that the code emits only registered names, that
every entry is documented on the metrics page (docs/guide/metrics.md) and that a real run's
metrics.jsonl matches it. Adding a metric: emit it, add it here, document it there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache

import structlog

__all__ = ["METRICS", "MetricSpec", "check_metrics", "lookup", "unknown_metrics"]

log = structlog.get_logger("miles_aio.observability")


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    """The name, or a template with `{placeholder}` segments."""
    meaning: str
    source: str
    """What emits it (a module, or "user" for metrics the runtime passes through)."""
    user: bool = False
    """Open-ended: names defined by user code (eval mode 3), not by the runtime."""
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = re.split(r"(\{[a-z_]+(?:\.\.\.)?\})", self.name)
        rx = "".join(
            (".+" if p.endswith("...}") else "[^/]+") if p.startswith("{") else re.escape(p) for p in parts
        )
        object.__setattr__(self, "pattern", re.compile(rx + r"\Z"))

    @property
    def template(self) -> str:
        """The name with every placeholder written `{}` (how the docs tests compare f-strings)."""
        return re.sub(r"\{[a-z_]+(?:\.\.\.)?\}", "{}", self.name)


def _m(name: str, meaning: str, source: str, *, user: bool = False) -> MetricSpec:
    return MetricSpec(name, meaning, source, user)


_FA = "rollout/fully_async/"
_BUF = "miles_aio.buffer.default"
_BATCH = "miles_aio.metrics"
_PERF = "miles_aio.observability.accounting"
_LOAD = "miles_aio.observability.engine_load"
_OBS = "miles_aio.observability.observer"
_SHARED = "miles_aio.eval.shared"
_EVAL = "miles_aio.eval.dispatcher, miles_aio.eval.snapshot_dispatcher"
_SNAP = "miles_aio.eval.snapshot_dispatcher"
_RANK = "miles_aio.trainer.rank_main"
_LOSS = "miles_aio.trainer.losses (reduced in rank_main)"

METRICS: tuple[MetricSpec, ...] = (
    # -- the data buffer (a window since the previous step) ------------------------------------------------
    _m(_FA + "queue_size", "Groups left in the buffer when the step's batch finished draining.", _BUF),
    _m(_FA + "aborted_groups_filtered", "Groups with an aborted sample, sent to the unused handler.", _BUF),
    _m(
        _FA + "stale_groups_filtered",
        "Groups over --max-weight-staleness at get(), sent to the unused handler.",
        _BUF,
    ),
    _m(_FA + "avg_staleness", "Mean staleness of the groups get() popped (stale-rejected too).", _BUF),
    _m(_FA + "max_staleness", "Largest staleness of the groups get() popped (stale-rejected too).", _BUF),
    _m(_FA + "buffer_avg_staleness", "Mean staleness of the groups still buffered.", _BUF),
    _m(_FA + "buffer_max_staleness", "Largest staleness of the groups still buffered.", _BUF),
    _m("rollout/failed_groups", "Groups whose user code raised or returned an unusable sample.", _BUF),
    _m(
        "rollout/dynamic_filter/drop_{reason}",
        "Groups the dynamic filter rejected, by its reason (filter_crashed: the filter raised, under a "
        "drop/retry --rollout-failure-policy).",
        _BUF,
    ),
    _m(
        "rollout/skipped_prompts/{reason}",
        "Prompts skipped so far (cumulative), by reason: not_utf8, invalid_json, missing_key, bad_prompt, "
        "too_long.",
        "miles_aio.data.source",
    ),
    # -- the trained batch --------------------------------------------------------------------------------
    _m("rollout/reward", "Mean reward of the trained batch (a dict's --reward-key entry).", _BATCH),
    _m("rollout/response_len", "Mean response length (tokens) of the trained batch.", _BATCH),
    _m("rollout/truncated_ratio", "Fraction of trained samples cut by the length limit.", _BATCH),
    _m("rollout/samples", "Samples in the trained batch.", _BATCH),
    _m("rollout/tokens", "Response tokens in the trained batch.", _BATCH),
    _m(
        "rollout/model_token_ratio",
        "Fraction of the trained batch's response tokens the model generated (loss_mask 1).",
        _BATCH,
    ),
    _m("rollout/train_staleness_mean", "Mean group staleness against the policy being trained.", _BATCH),
    _m("rollout/train_staleness_max", "Largest group staleness against the policy being trained.", _BATCH),
    _m(
        "rollout/token_staleness/{bucket}",
        "Fraction of trained tokens 0, 1, 2, 3 or 4+ versions old.",
        _BATCH,
    ),
    _m("rollout/policy_version", "Policy version the engines serve at the end of the step.", _OBS),
    _m("rollout/in_flight_groups", "Groups admitted and not yet finished at the end of the step.", _OBS),
    # -- bubble accounting ---------------------------------------------------------------------------------
    _m(
        "perf/step_time_s",
        "Wall seconds of the driver step, from the previous step's record (so the steps add up to the run).",
        _PERF,
    ),
    _m("perf/trainer_idle_ratio", "Fraction of the step the driver waited for data.", _PERF),
    _m(
        "perf/rollout_blocked_ratio",
        "Fraction of the step admission was blocked (full, pacing, paused).",
        _PERF,
    ),
    _m(
        "perf/rollout_blocked_ratio/{reason}",
        "The same, by reason: buffer_full, pacing, paused, capacity.",
        _PERF,
    ),
    _m(
        "perf/weight_sync_seconds",
        "Seconds the step waited for weight pushes: the whole push, or with disk transfers rank 0's write "
        "and any wait for the push that ran alongside the step's training.",
        _PERF,
    ),
    _m(
        "perf/weight_push_seconds",
        "Seconds of the latest finished push, from the engines' pause to the new version's publish.",
        _PERF,
    ),
    _m("perf/eval_stall_seconds", "Seconds the step loop waited for eval points.", _PERF),
    _m("perf/train_seconds", "Seconds of trainer.train() in the step.", _PERF),
    _m("perf/generated_tokens_per_s", "Tokens the engines generated per second of the step.", _PERF),
    _m("perf/trained_tokens_per_s", "Trained response tokens per second of training.", _PERF),
    _m("perf/wasted_tokens", "Tokens generated in the step for groups never trained on.", _PERF),
    _m("perf/wasted_tokens/{cause}", "The same, by cause: aborted, stale, filtered, failed.", _PERF),
    # -- engine load ----------------------------------------------------------------------------------------
    _m("perf/engine/num_running_reqs", "Requests running on all engines (from /server_info).", _LOAD),
    _m("perf/engine/queue_len", "Requests queued on all engines (from /server_info).", _LOAD),
    _m("perf/engine/{i}/num_running_reqs", "Requests running on engine i.", _LOAD),
    _m("perf/engine/{i}/queue_len", "Requests queued on engine i.", _LOAD),
    _m("perf/engine/latency_p50_s", "Median generate latency over the router's recent requests.", _LOAD),
    _m(
        "perf/engine/latency_p99_s",
        "99th-percentile generate latency over the router's recent requests.",
        _LOAD,
    ),
    _m("perf/engine/{i}/latency_p50_s", "Median generate latency of engine i's recent requests.", _LOAD),
    _m("perf/engine/{i}/latency_p99_s", "99th-percentile generate latency of engine i.", _LOAD),
    _m("perf/engine/in_flight", "Generate calls in flight in the router.", _LOAD),
    _m("perf/engine/active", "Engines in rotation (taking requests and weight pushes) now.", _LOAD),
    _m(
        "perf/engine/excluded",
        "Engine exclusions so far: a weight-push call failed or missed --engine-admin-timeout-s.",
        _LOAD,
    ),
    _m("perf/engine/restarts", "Restarts so far of launched engines whose process died.", _LOAD),
    # -- the trainer ranks ----------------------------------------------------------------------------------
    _m("perf/trainer_tokens_per_s", "Tokens (prompt + response) per second inside the trainer ranks.", _RANK),
    _m("perf/trainer_step_s", "Seconds of the train command inside the trainer ranks.", _RANK),
    _m(
        "perf/trainer_pre_forward_s",
        "Seconds of the no-grad forwards before training (π_old, π_ref); π_old's is skipped with one "
        "optimizer step per rollout.",
        _RANK,
    ),
    _m("train/grad_norm", "Global gradient norm before clipping, mean over optimizer steps.", _RANK),
    _m("train/lr", "Learning rate.", _RANK),
    _m("train/decoupled_lr", "Learning rate of the embedding and output layer (--decoupled-lr only).", _RANK),
    _m("train/optimizer_steps", "Optimizer steps in this rollout.", _RANK),
    _m(
        "train/advantage_abs_mean",
        "Mean absolute per-sample advantage, controller side (reinforce_plus_plus: the raw rewards).",
        "miles_aio.trainer.actor",
    ),
    _m(
        "train/masked_offpolicy_tokens",
        "Tokens --mask-offpolicy-in-partial-rollout took out of the loss (older than the response's end).",
        "miles_aio.trainer.actor",
    ),
    _m("train/tokens", "Trained (loss-mask 1) tokens.", _LOSS),
    _m("train/loss", "The loss, per trained token.", _LOSS),
    _m("train/pg_loss", "Policy-gradient part of the loss, per token.", _LOSS),
    _m("train/pg_clipfrac", "Fraction of tokens whose PPO ratio was clipped.", _LOSS),
    _m("train/dual_clipfrac", "Fraction of tokens bounded by the dual clip (--eps-clip-c).", _LOSS),
    _m("train/ppo_kl", "Mean log π_old − log π over tokens (how far the update moved).", _LOSS),
    _m("train/ratio", "Mean PPO ratio π/π_old.", _LOSS),
    _m("train/advantage", "Mean token advantage.", _LOSS),
    _m(
        "train/train_rollout_logp_abs_diff",
        "Mean |log π_old − log π_rollout|: trainer/engine mismatch.",
        _LOSS,
    ),
    _m("train/train_rollout_logp_abs_diff_max", "Largest |log π_old − log π_rollout| of a token.", _LOSS),
    _m("train/train_rollout_kl", "k3 estimate of KL(π_rollout‖π_old) over the rollout's tokens.", _LOSS),
    _m("train/tis_weight", "Mean truncated-IS weight (--use-tis / --use-decoupled-loss).", _LOSS),
    _m("train/tis_weight_max", "Largest IS weight of a token.", _LOSS),
    _m("train/tis_clipfrac", "Fraction of tokens whose IS weight hit a TIS clamp.", _LOSS),
    _m("train/entropy", "Mean token entropy of the policy.", _LOSS),
    _m("train/kl_loss", "Mean KL against the reference model (--use-kl-loss).", _LOSS),
    _m("train/opsm_masked_seqs", "Sequences masked by --use-opsm.", _LOSS),
    # -- eval (in the step record where a point's results land) ---------------------------------------------
    _m("eval/step", "Steps trained when the point's weights were taken.", _EVAL),
    _m("eval/version", "Policy version the point evaluated.", _EVAL),
    _m("eval/lag_steps", "Steps trained between the point and the record it lands in.", _EVAL),
    _m(
        "eval/push_wait_seconds",
        "Mode 1: seconds the next weight push waited for the point.",
        "miles_aio.eval.dispatcher",
    ),
    _m(
        "eval/backpressure_wait_seconds",
        "Modes 2/3: seconds the point waited for --eval-max-in-flight.",
        _SNAP,
    ),
    _m("eval/duration_seconds", "Seconds from dispatch to the point's last result.", _EVAL),
    _m(
        "eval/export_time_seconds",
        "Modes 2/3 export source: seconds to write the point's HF snapshot.",
        _SNAP,
    ),
    _m("eval/skipped_{reason}", "Points skipped: busy, export_failed, ckpt_missing, crashed, ...", _EVAL),
    _m("eval/{ds}/reward", "Mean reward on dataset ds.", _SHARED),
    _m("eval/{ds}/accuracy", "Accuracy on ds (a dict reward's accuracy/acc, else reward ≥ 1).", _SHARED),
    _m("eval/{ds}/truncated_ratio", "Fraction of ds responses cut by the length limit.", _SHARED),
    _m("eval/{ds}/response_len", "Mean response length on ds.", _SHARED),
    _m("eval/{ds}/weight_version/mean", "Mean policy version of ds's response tokens.", _SHARED),
    _m(
        "eval/{ds}/mixed_version_ratio",
        "Fraction of ds samples generated under more than one version.",
        _SHARED,
    ),
    _m("eval/{metric...}", "Mode 3: whatever your CheckpointEvalFn returns, under eval/.", "user", user=True),
)


@cache
def lookup(key: str) -> MetricSpec | None:
    """The registry entry a metric name matches (runtime entries before the open-ended user one)."""
    for spec in METRICS:
        if spec.pattern.match(key):
            return spec
    return None


def unknown_metrics(keys: Iterable[str]) -> list[str]:
    """The names among `keys` that no registry entry matches (`step` is the record's own key)."""
    return sorted(k for k in keys if k != "step" and lookup(k) is None)


_checked: set[str] = set()  # names already matched (or warned about): each is looked up once


def check_metrics(metrics: dict[str, float]) -> None:
    """Log a warning, once per name and process, for each metric the registry does not know. Runs on
    every step record, so a name is matched against the registry's patterns only the first time."""
    new = [k for k in metrics if k not in _checked]
    for key in unknown_metrics(new):
        log.warning("unregistered metric", metric=key, registry="miles_aio.observability.registry")
    _checked.update(new)
