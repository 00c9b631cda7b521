"""`TrainConfig`: every trainer flag (miles' names), validated when constructed.

Same conventions as `miles_aio.config`: one frozen dataclass, one field per flag (`--` + name with
`_` → `-`), help text in the field metadata, invalid values raise `ConfigError` naming the flags from
`__post_init__` — a pure check (no file reads, no logging), cheap enough to run again wherever a copy
is made (each rank rebuilds the config from JSON). Rules that need other components' config are
module functions `RunConfig` calls at the cross-check: `check_batch_arithmetic` (samples per step vs
`--global-batch-size`), `check_run_lr_decay` and `check_off_policy_correction` (a fully async run must
correct for off-policy data somehow). What needs more than the values — the checkpoint's layer count
(`check_model_layers`), the run's decay end (`with_run_lr_decay`), the warnings (`train_warnings`) — is
done once, in the controller process, by `miles_aio.config.resolve` / `config_warnings`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from miles_aio._fields import ConfigWarning, flag, opt
from miles_aio.errors import ConfigError

__all__ = [
    "AdvantageEstimator",
    "KLLossType",
    "LRDecayStyle",
    "TrainBackend",
    "TrainConfig",
    "TransferMode",
    "check_batch_arithmetic",
    "check_model_layers",
    "check_off_policy_correction",
    "check_run_lr_decay",
    "run_lr_decay_iters",
    "train_warnings",
    "with_run_lr_decay",
]

TrainBackend = Literal["fsdp", "megatron"]
AdvantageEstimator = Literal["grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
KLLossType = Literal["k1", "k2", "k3", "low_var_kl"]
LRDecayStyle = Literal["constant", "linear", "cosine"]
TransferMode = Literal["disk", "broadcast"]
FsdpWrap = Literal["auto", "fsdp2", "ddp"]

_CHOICES: dict[str, tuple[str, ...]] = {  # checked in __post_init__: the ranks rebuild configs from JSON
    "train_backend": get_args(TrainBackend),
    "advantage_estimator": get_args(AdvantageEstimator),
    "kl_loss_type": get_args(KLLossType),
    "lr_decay_style": get_args(LRDecayStyle),
    "update_weight_transfer_mode": get_args(TransferMode),
    "fsdp_wrap": get_args(FsdpWrap),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """The trainer: model, parallelism, batch arithmetic, optimizer, loss and weight sync."""

    # -- model and processes ---------------------------------------------------------------------------
    train_backend: TrainBackend = opt("fsdp", "Trainer backend: HF model under FSDP2/DDP, or megatron-core.")
    hf_checkpoint: Path | None = opt(None, "Initial HF model directory (config.json + safetensors).")
    actor_num_nodes: int = opt(1, "Trainer nodes. >1: ranks are started by torchrun and dial the controller.")
    actor_num_gpus_per_node: int = opt(1, "Trainer ranks per node (on CPU: rank processes).")
    fsdp_wrap: FsdpWrap = opt(
        "auto", "fsdp backend wrapper: FSDP2 fully_shard, DDP, or auto (FSDP2 when world size > 1)."
    )
    tensor_model_parallel_size: int = opt(1, "Megatron tensor parallel size.")
    pipeline_model_parallel_size: int = opt(
        1, "Megatron pipeline parallel size (the model's layer count must be a multiple of it)."
    )
    seed: int = opt(1234, "Seed of the trainer's RNGs.")
    trainer_host: str = opt(
        "127.0.0.1", "Address the controller listens on for trainer ranks (non-loopback needs a secret)."
    )
    trainer_port: int = opt(0, "Port the controller listens on for trainer ranks (0: any free port).")
    trainer_connect_timeout_s: float = opt(600.0, "How long to wait for every rank to connect and load.")
    dist_timeout_s: float = opt(600.0, "torch.distributed collective timeout inside the trainer ranks.")
    trainer_heartbeat_timeout_s: float = opt(
        60.0,
        "Fail the run when a trainer rank sends no heartbeat for this long (frozen or hung; a thread in each "
        "rank beats every 1/6 of it, also during a long step); 0: off.",
    )
    trainer_num_threads: int = opt(
        0,
        "torch threads per CPU trainer rank (0: the cores the embedded engines leave free, split over the "
        "ranks; -1: every core, split over the ranks and shared with the engines, which pays when the "
        "trainer sets the pace and the engines idle while they wait for its weights).",
    )

    # -- batch arithmetic ------------------------------------------------------------------------------
    global_batch_size: int | None = opt(
        None,
        "Samples per optimizer step; must divide rollout_batch_size × n_samples_per_prompt.",
        shown_default="all of them, one optimizer step per rollout",
    )
    num_steps_per_rollout: int | None = opt(
        None,
        "Optimizer steps per rollout; sets global_batch_size = samples per rollout / N (N > 1 warns: each "
        "extra step trains on data further off-policy, on top of the async staleness).",
    )
    micro_batch_size: int = opt(1, "Samples per forward/backward on one rank.")
    max_tokens_per_gpu: int | None = opt(
        None, "Pack micro-batches up to this many tokens per rank instead of --micro-batch-size."
    )
    pack_shared_prompts: bool = opt(
        False,
        "fsdp backend: forward a prompt shared by several samples of a micro-batch once, not once per sample "
        "(those rows become one sequence, each response masked from the others; the same math). The linear "
        "layers then skip the prompt's tokens n_samples_per_prompt − 1 times, but attention and its dense "
        "mask grow with the square of prompt + all the group's responses: for short answers to long "
        "prompts, not long responses. Needs sdpa or eager attention, no sliding window.",
    )

    # -- optimizer -------------------------------------------------------------------------------------
    lr: float = opt(1e-6, "AdamW learning rate (the peak of the --lr-decay-style schedule).")
    lr_decay_style: LRDecayStyle = opt(
        "constant",
        "Learning-rate schedule after warmup, one iteration = one optimizer step (Megatron's formulas): "
        "constant (--lr), linear or cosine from --lr down to --min-lr at --lr-decay-iters, --min-lr after.",
    )
    lr_warmup_iters: int = opt(
        0, "Optimizer steps of linear warmup from 0 to --lr (step k of the run trains at lr·k/N; 0: none)."
    )
    lr_decay_iters: int | None = opt(
        None,
        "Optimizer step (counted from the start of the run, warmup included) at which linear/cosine decay "
        "reaches --min-lr.",
        shown_default="as Megatron, the run's last: num_rollout × optimizer steps per rollout",
    )
    min_lr: float = opt(0.0, "Final learning rate of the linear/cosine decay (must be <= --lr).")
    decoupled_lr: float | None = opt(
        None,
        "Megatron's --decoupled-lr: a separate peak learning rate for the input embedding and the output "
        "layer (lm_head; one tensor when tied), on the same warmup and decay as --lr.",
        shown_default="--lr (one learning rate for every parameter)",
    )
    decoupled_min_lr: float | None = opt(
        None,
        "Megatron's --decoupled-min-lr: the final learning rate of that decay (must be <= --decoupled-lr).",
        shown_default="--min-lr",
    )
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    adam_beta1: float = opt(0.9, "AdamW beta1.")
    adam_beta2: float = opt(0.98, "AdamW beta2.")
    adam_eps: float = opt(1e-8, "AdamW epsilon.")
    clip_grad: float = opt(1.0, "Clip the global gradient norm to this (0: off).")

    # -- loss ------------------------------------------------------------------------------------------
    advantage_estimator: AdvantageEstimator = opt(
        "grpo",
        "How rewards become advantages: grpo (group-normalized), gspo (GRPO advantages with a per-sequence "
        "importance ratio), rloo (leave-one-out baseline), reinforce_plus_plus (token-level returns of the "
        "reward on the last token minus --kl-coef × KL per token, whitened over the batch), "
        "reinforce_plus_plus_baseline (group-mean baseline, whitened over the batch).",
    )
    normalize_advantages: bool = opt(
        False,
        "Whiten the advantages over all trained tokens of the rollout (masked mean/std across the "
        "data-parallel ranks, eps 1e-8) after the estimator.",
    )
    kl_coef: float = opt(
        0.0,
        "Reward shaping for --advantage-estimator reinforce_plus_plus: every token's reward gets "
        "-kl_coef × KL(π_old‖π_ref), estimated per token with --kl-loss-type as miles does (loads the "
        "reference model; other estimators refuse it).",
    )
    disable_grpo_std_normalization: bool = opt(
        False, "GRPO: only mean-centre rewards per group (Dr.GRPO), do not divide by the group std."
    )
    reward_key: str | None = opt(None, "Key of the scalar reward when the reward function returns a dict.")
    custom_reward_post_process_path: str | None = opt(
        None,
        "miles' reward post-processing `fn(args, samples) -> (raw_rewards, rewards)`, called on the "
        "controller with the whole rollout (group by group): its rewards replace the estimator's group "
        "normalization (grpo/gspo: they are the advantages; reinforce_plus_plus_baseline: whitened; "
        "reinforce_plus_plus: the token returns' rewards).",
        metavar="PKG.MOD:ATTR",
    )
    eps_clip: float = opt(0.2, "PPO ratio clip: lower bound 1 - eps_clip.")
    eps_clip_high: float | None = opt(
        None, "PPO ratio clip upper bound 1 + eps_clip_high.", shown_default="--eps-clip"
    )
    eps_clip_c: float | None = opt(
        None,
        "Dual-clip PPO: for tokens with negative advantage also bound the loss by -A × c (c > 1), so a "
        "huge ratio cannot blow up the update.",
    )
    use_kl_loss: bool = opt(False, "Add a KL penalty against the frozen initial model (keeps a copy).")
    kl_loss_coef: float = opt(
        0.0, "Weight of the KL loss (0 with --use-kl-loss: the KL is only computed and logged)."
    )
    kl_loss_type: KLLossType = opt("low_var_kl", "KL estimator: k1, k2, k3 or low_var_kl (k3 clamped).")
    entropy_coef: float = opt(0.0, "Entropy bonus weight (loss -= coef × entropy).")
    use_tis: bool = opt(
        False, "Truncated importance sampling: weight each token by clamp(π_old/π_rollout, low, high)."
    )
    tis_clip: float = opt(2.0, "Upper clamp of the TIS weight.")
    tis_clip_low: float = opt(0.0, "Lower clamp of the TIS weight.")
    use_decoupled_loss: bool = opt(
        False,
        "Decoupled PPO (AReaL): clip the ratio against the recomputed proximal policy and weight by "
        "π_prox/π_behave (clamped by the TIS bounds when --use-tis).",
    )
    use_rollout_logprobs: bool = opt(
        False, "Use the engine's rollout log-probs as π_old (no recompute): PPO against the behaviour policy."
    )
    use_opsm: bool = opt(
        False,
        "Off-policy sequence masking: drop negative-advantage sequences whose KL(π_rollout‖π), the mean "
        "of log π_rollout − log π over the sequence, exceeds --opsm-delta.",
    )
    opsm_delta: float = opt(1e-4, "OPSM sequence-level KL threshold.")
    mask_offpolicy_in_partial_rollout: bool = opt(
        False,
        "Train only on the tokens of a response that its newest policy version produced: tokens from "
        "before a weight push it spanned (partial rollout, retract, in_place) get loss mask 0.",
    )
    allow_uncorrected_off_policy: bool = opt(
        False, "Allow a fully async run with no off-policy correction at all (not recommended)."
    )

    # -- weight sync -----------------------------------------------------------------------------------
    update_weight_transfer_mode: TransferMode = opt(
        "disk", "How weights reach the engines: safetensors on disk, or a torch.distributed broadcast."
    )
    update_weight_buffer_size: int = opt(
        512 * 1024**2, "Broadcast bucket size in bytes (tensors per /update_weights_from_distributed call)."
    )
    weight_sync_keep: int = opt(
        2, "Disk mode: weight snapshots kept under <run-dir>/weights (older deleted)."
    )

    def __post_init__(self) -> None:
        """Pure checks of the values (no file, no environment, no logging): see `miles_aio.config.resolve`
        for the ones that need more."""
        self._check_ranges()
        self._check_lr_schedule()
        self._check_combinations()
        self._check_parallelism()

    def _check_ranges(self) -> None:
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(
                    f"must be one of {', '.join(choices)}, got {getattr(self, name)!r}", flags=[flag(name)]
                )
        for name in (
            "actor_num_nodes",
            "actor_num_gpus_per_node",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "micro_batch_size",
            "update_weight_buffer_size",
            "weight_sync_keep",
        ):
            _require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("global_batch_size", "num_steps_per_rollout", "max_tokens_per_gpu", "lr_decay_iters"):
            value = getattr(self, name)
            _require(value is None or value >= 1, name, f"must be >= 1, got {value}")
        for name in ("lr", "trainer_connect_timeout_s", "dist_timeout_s", "adam_eps"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value > 0, name, f"must be > 0, got {value}")
        for name in (
            "weight_decay",
            "clip_grad",
            "kl_loss_coef",
            "entropy_coef",
            "tis_clip_low",
            "trainer_heartbeat_timeout_s",
            "opsm_delta",
            "kl_coef",
            "min_lr",
        ):
            value = getattr(self, name)
            _require(math.isfinite(value) and value >= 0, name, f"must be >= 0, got {value}")
        for name in ("adam_beta1", "adam_beta2"):
            _require(0 <= getattr(self, name) < 1, name, f"must be in [0, 1), got {getattr(self, name)}")
        _require(0 < self.eps_clip < 1, "eps_clip", f"must be in (0, 1), got {self.eps_clip}")
        _require(
            self.eps_clip_high is None or self.eps_clip_high > 0,
            "eps_clip_high",
            f"must be > 0, got {self.eps_clip_high}",
        )
        _require(
            self.eps_clip_c is None or (math.isfinite(self.eps_clip_c) and self.eps_clip_c > 1),
            "eps_clip_c",
            f"the dual-clip constant must be > 1, got {self.eps_clip_c}",
        )
        _require(self.lr_warmup_iters >= 0, "lr_warmup_iters", f"must be >= 0, got {self.lr_warmup_iters}")
        _require(0 <= self.trainer_port < 65536, "trainer_port", f"must be a port, got {self.trainer_port}")
        _require(
            self.trainer_num_threads >= -1,
            "trainer_num_threads",
            f"must be >= -1 (0: the free cores, -1: every core), got {self.trainer_num_threads}",
        )

    def _check_combinations(self) -> None:
        if self.tis_clip <= self.tis_clip_low:
            raise ConfigError(
                f"the TIS clamp is empty: [{self.tis_clip_low}, {self.tis_clip}]",
                flags=["--tis-clip-low", "--tis-clip"],
            )
        if self.global_batch_size is not None and self.num_steps_per_rollout is not None:
            raise ConfigError(
                "give one of them: num_steps_per_rollout sets the global batch size",
                flags=["--global-batch-size", "--num-steps-per-rollout"],
            )
        if self.use_rollout_logprobs and (self.use_tis or self.use_decoupled_loss):
            # π_old would *be* π_rollout, so the behaviour weight π_old/π_rollout is identically 1.
            raise ConfigError(
                "with --use-rollout-logprobs the importance weight π_old/π_rollout is always 1",
                flags=["--use-rollout-logprobs", "--use-tis" if self.use_tis else "--use-decoupled-loss"],
            )
        if self.custom_reward_post_process_path and self.advantage_estimator == "rloo":
            raise ConfigError(
                "rloo's baseline is its normalization; a reward post-process would replace it (miles has "
                "no rloo): use grpo with the post-process, or rloo without it",
                flags=["--custom-reward-post-process-path", "--advantage-estimator"],
            )
        if self.kl_coef > 0 and self.advantage_estimator != "reinforce_plus_plus":
            raise ConfigError(
                f"--kl-coef shapes the rewards of reinforce_plus_plus only; {self.advantage_estimator} "
                "would ignore it (use --use-kl-loss --kl-loss-coef for a KL penalty in the loss)",
                flags=["--kl-coef", "--advantage-estimator"],
            )

    def _check_parallelism(self) -> None:
        if self.pack_shared_prompts and self.train_backend != "fsdp":
            raise ConfigError(
                "prompt packing is implemented for the HF model of the fsdp backend only",
                flags=["--pack-shared-prompts", "--train-backend"],
            )
        if self.train_backend == "fsdp" and (
            self.tensor_model_parallel_size > 1 or self.pipeline_model_parallel_size > 1
        ):
            raise ConfigError(
                "tensor/pipeline parallelism needs --train-backend megatron",
                flags=["--train-backend", "--tensor-model-parallel-size", "--pipeline-model-parallel-size"],
            )
        mp = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if self.world_size % mp:
            raise ConfigError(
                f"world size {self.world_size} is not a multiple of TP × PP = {mp}",
                flags=[
                    "--actor-num-nodes",
                    "--actor-num-gpus-per-node",
                    "--tensor-model-parallel-size",
                    "--pipeline-model-parallel-size",
                ],
            )
        if self.actor_num_nodes > 1 and self.trainer_host in ("127.0.0.1", "localhost", "::1"):
            raise ConfigError(
                "ranks on other nodes cannot dial a loopback address; give the controller's address",
                flags=["--actor-num-nodes", "--trainer-host"],
            )

    def _check_lr_schedule(self) -> None:
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr {self.min_lr} exceeds --lr {self.lr}", flags=["--min-lr", "--lr"])
        for name in ("decoupled_lr", "decoupled_min_lr"):
            value = getattr(self, name)
            _require(
                value is None or (math.isfinite(value) and value >= 0), name, f"must be >= 0, got {value}"
            )
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise ConfigError(
                "--decoupled-min-lr needs --decoupled-lr", flags=["--decoupled-min-lr", "--decoupled-lr"]
            )
        if self.decoupled_lr is not None and self._decoupled_min_lr > self.decoupled_lr:
            # the flag the decay's end came from
            low = "--min-lr" if self.decoupled_min_lr is None else "--decoupled-min-lr"
            raise ConfigError(
                f"the decoupled decay would end above its peak: --decoupled-lr {self.decoupled_lr} < "
                f"{low} {self._decoupled_min_lr}",
                flags=["--decoupled-lr", low],
            )
        if self.lr_decay_iters is not None and self.lr_decay_iters <= self.lr_warmup_iters:
            raise ConfigError(
                f"decay must end after warmup: --lr-decay-iters {self.lr_decay_iters} <= "
                f"--lr-warmup-iters {self.lr_warmup_iters}",
                flags=["--lr-decay-iters", "--lr-warmup-iters"],
            )

    @property
    def _decoupled_min_lr(self) -> float:
        return self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr

    def lr_at(self, step: int, *, decoupled: bool = False) -> float:
        """The learning rate of optimizer step `step` (0-based, counted from the start of the run), as
        Megatron's OptimizerParamScheduler computes it with --lr-warmup-init 0:
        warmup (step ≤ W): lr·step/W; then constant: lr; linear / cosine with decay end D: past D min_lr,
        else min_lr + (lr − min_lr)·c with ρ = (step − W)/(D − W), c = 1 − ρ (linear) or ½(1 + cos πρ).
        `decoupled`: the same for the embedding and output layer's group, with --decoupled-lr and
        --decoupled-min-lr as lr and min_lr (as Megatron's param groups carry their own max/min lr)."""
        w, top, low = self.lr_warmup_iters, self.lr, self.min_lr
        if decoupled and self.decoupled_lr is not None:
            top, low = self.decoupled_lr, self._decoupled_min_lr
        if w > 0 and step <= w:
            return top * step / w
        d = self.lr_decay_iters
        if self.lr_decay_style == "constant" or d is None:
            return top
        if step > d:
            return low
        rho = (step - w) / (d - w)
        coeff = 1.0 - rho if self.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * rho) + 1.0)
        return low + coeff * (top - low)

    @property
    def needs_ref_model(self) -> bool:
        """The frozen initial policy is loaded for the KL loss (or its monitoring at coefficient 0) and
        for reinforce_plus_plus' reward shaping."""
        return self.use_kl_loss or self.kl_coef > 0

    @property
    def world_size(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the world divided by the model-parallel group."""
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    def optimizer_steps(self, samples_per_step: int) -> int:
        """Optimizer steps per rollout (`check_batch_arithmetic` has made sure this divides evenly)."""
        return samples_per_step // self.resolved_global_batch_size(samples_per_step)

    def resolved_global_batch_size(self, samples_per_step: int) -> int:
        if self.global_batch_size is not None:
            return self.global_batch_size
        if self.num_steps_per_rollout is not None:
            return samples_per_step // self.num_steps_per_rollout
        return samples_per_step

    def to_json(self) -> str:
        """JSON for the rank processes (which rebuild it with `from_json`, so validation runs there too)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["hf_checkpoint"] = None if self.hf_checkpoint is None else str(self.hf_checkpoint)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        d: dict[str, Any] = json.loads(text)
        if d.get("hf_checkpoint") is not None:
            d["hf_checkpoint"] = Path(d["hf_checkpoint"])
        return cls(**d)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(message, flags=[flag(name)])


def run_lr_decay_iters(train_cfg: TrainConfig, *, num_rollout: int, samples_per_step: int) -> int | None:
    """Megatron's default decay end for a linear/cosine schedule with `--lr-decay-iters` unset: the
    run's last optimizer step, num_rollout × optimizer steps per rollout (None: nothing to fill in).
    Pure; raises ConfigError when the run ends before its warmup does."""
    total = num_rollout * train_cfg.optimizer_steps(samples_per_step)
    if train_cfg.lr_decay_style == "constant" or train_cfg.lr_decay_iters is not None or total == 0:
        return None
    if total <= train_cfg.lr_warmup_iters:
        raise ConfigError(
            f"the run's {total} optimizer steps end before the {train_cfg.lr_warmup_iters}-step warmup",
            flags=["--lr-warmup-iters", "--num-rollout", "--lr-decay-style"],
        )
    return total


def check_run_lr_decay(train_cfg: TrainConfig, *, num_rollout: int, samples_per_step: int) -> None:
    """The lr schedule fits the run (its optimizer steps outlast the warmup); see `run_lr_decay_iters`."""
    run_lr_decay_iters(train_cfg, num_rollout=num_rollout, samples_per_step=samples_per_step)


def with_run_lr_decay(train_cfg: TrainConfig, *, num_rollout: int, samples_per_step: int) -> TrainConfig:
    """`train_cfg` with Megatron's default decay end filled in (`run_lr_decay_iters`); unchanged when
    there is none to fill in. `miles_aio.config.resolve` calls it once, so the run's config and the
    ranks train with the same value."""
    total = run_lr_decay_iters(train_cfg, num_rollout=num_rollout, samples_per_step=samples_per_step)
    return train_cfg if total is None else dataclasses.replace(train_cfg, lr_decay_iters=total)


def check_model_layers(train_cfg: TrainConfig) -> None:
    """Megatron splits the decoder layers evenly over the pipeline stages: the checkpoint's layer
    count must be a multiple of PP. Reads `--hf-checkpoint`'s config.json (when it is readable here),
    so it runs in `miles_aio.config.resolve`, not in `__post_init__`."""
    pp = train_cfg.pipeline_model_parallel_size
    cfg_file = None if train_cfg.hf_checkpoint is None else Path(train_cfg.hf_checkpoint) / "config.json"
    if pp == 1 or cfg_file is None or not cfg_file.is_file():
        return
    try:
        layers = int(json.loads(cfg_file.read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # not an HF config we can read: the rank reports the problem when it loads the model
    if layers % pp:
        raise ConfigError(
            f"the model's {layers} decoder layers do not split evenly into {pp} pipeline stages",
            flags=["--pipeline-model-parallel-size", "--hf-checkpoint"],
        )


def train_warnings(train_cfg: TrainConfig) -> list[ConfigWarning]:
    """Valid but risky trainer settings (logged once by the controller process)."""
    out: list[ConfigWarning] = []
    if train_cfg.num_steps_per_rollout is not None and train_cfg.num_steps_per_rollout > 1:
        out.append(
            ConfigWarning(
                "num_steps_per_rollout_adds_off_policyness",
                f"{train_cfg.num_steps_per_rollout} optimizer steps per rollout: every step after a "
                "rollout's first trains on samples generated by an older policy, on top of the fully async "
                "staleness; keep the TIS/decoupled correction on",
                flags=("--num-steps-per-rollout",),
            )
        )
    return out


def check_batch_arithmetic(train_cfg: TrainConfig, samples_per_step: int) -> None:
    """`samples_per_step` = rollout_batch_size × n_samples_per_prompt: it must split into whole global
    batches, and each global batch into equal shares for the data-parallel ranks."""
    flags = ["--global-batch-size", "--rollout-batch-size", "--n-samples-per-prompt"]
    if train_cfg.num_steps_per_rollout is not None:
        k = train_cfg.num_steps_per_rollout
        if samples_per_step % k:
            raise ConfigError(
                f"{samples_per_step} samples per rollout do not split into {k} optimizer steps",
                flags=["--num-steps-per-rollout", "--rollout-batch-size", "--n-samples-per-prompt"],
            )
    gbs = train_cfg.resolved_global_batch_size(samples_per_step)
    if gbs > samples_per_step or samples_per_step % gbs:
        raise ConfigError(
            f"global batch size {gbs} must divide the {samples_per_step} samples of a rollout "
            "(rollout_batch_size × n_samples_per_prompt)",
            flags=flags,
        )
    if gbs % train_cfg.dp_size:
        raise ConfigError(
            f"global batch size {gbs} does not split evenly over {train_cfg.dp_size} data-parallel ranks",
            flags=["--global-batch-size", "--actor-num-gpus-per-node", "--actor-num-nodes"],
        )


def check_off_policy_correction(train_cfg: TrainConfig, *, fully_async: bool) -> None:
    """Refuse to start a fully async run with no off-policy correction of any kind unless
    --allow-uncorrected-off-policy: stale samples would silently be trained as on-policy (the CPU probe
    lost 10-17 points of accuracy to one step of uncorrected staleness)."""
    corrected = train_cfg.use_tis or train_cfg.use_decoupled_loss or train_cfg.use_rollout_logprobs
    if fully_async and not corrected and not train_cfg.allow_uncorrected_off_policy:
        raise ConfigError(
            "refuse to start a fully async run with no off-policy correction of any kind; enable one "
            "(--use-tis, --use-decoupled-loss or --use-rollout-logprobs) or pass "
            "--allow-uncorrected-off-policy",
            flags=[
                "--use-tis",
                "--use-decoupled-loss",
                "--use-rollout-logprobs",
                "--allow-uncorrected-off-policy",
            ],
        )
