"""The training backend a rank's command loop drives: the `ModelBackend` protocol, and `HFBackend`
(transformers' AutoModelForCausalLM under FSDP2, DDP, or bare; `megatron_backend` is the other one).

Tensor names are always HF names, so weight sync and checkpoints never depend on the backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from miles_aio.errors import ConfigError
from miles_aio.trainer import losses, shared_prefix
from miles_aio.trainer.config import TrainConfig

__all__ = ["HFBackend", "ModelBackend", "Pipeline"]


def adamw(
    cfg: TrainConfig, params: list[torch.nn.Parameter], *, decoupled: list[torch.nn.Parameter]
) -> torch.optim.AdamW:
    """The trainer's AdamW over `params`. With --decoupled-lr, the `decoupled` ones (the input embedding
    and the output layer, as Megatron marks them) form a second param group, tagged `decoupled`, whose lr
    the step loop sets from `cfg.lr_at(step, decoupled=True)`; group 0 always holds the other weights."""
    kw: dict[str, Any] = {
        "lr": cfg.lr,
        "betas": (cfg.adam_beta1, cfg.adam_beta2),
        "eps": cfg.adam_eps,
        "weight_decay": cfg.weight_decay,
    }
    if cfg.decoupled_lr is None:
        return torch.optim.AdamW(params, **kw)
    ends = {id(p) for p in decoupled}
    rest = [p for p in params if id(p) not in ends]
    mine = [p for p in params if id(p) in ends]  # a tied embedding is one tensor: it appears once
    groups = [{"params": rest, "decoupled": False}, {"params": mine, "decoupled": True}]
    return torch.optim.AdamW([g for g in groups if g["params"]], **kw)


def check_param_groups(saved: list[dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """A checkpoint's optimizer state restores only into the param groups it was saved with (torch would
    otherwise fail later, or map the groups onto each other): the same --decoupled-lr setting."""

    def layout(gs: list[dict[str, Any]]) -> list[bool]:
        return [bool(g.get("decoupled", False)) for g in gs]

    if layout(saved) != layout(groups):
        said = {True: "with --decoupled-lr", False: "without --decoupled-lr"}
        raise ValueError(
            f"the checkpoint's optimizer was saved {said[any(layout(saved))]} and this run is "
            f"{said[any(layout(groups))]}: resume with the setting it was saved with (--decoupled-lr "
            "gives the embedding and lm_head a param group of their own)"
        )


class Pipeline(Protocol):
    """A pipeline-parallel backend's schedule (megatron PP: `megatron_pp.MegatronPipeline`): it runs the
    forwards, backwards and log-probs over all stages in place of `ModelBackend.logits` / `no_sync`."""

    def logps(self, mbs: list[losses.MicroBatch], *, ref: bool = False) -> list[torch.Tensor]:
        """log π (or π_ref) of every micro-batch's targets, on every rank of the pipeline."""
        ...

    def forward_backward(
        self, mbs: list[losses.MicroBatch], loss_of: Callable[[int, torch.Tensor], torch.Tensor]
    ) -> None:
        """Forward and backward of one optimizer step's micro-batches (`loss_of(i, logits)` on the last
        stage), gradient reductions included."""
        ...

    def share_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The last stage's metrics, on every rank of the pipeline."""
        ...


class ModelBackend(Protocol):
    """What a training backend gives the command loop (HF under FSDP2/DDP here; megatron-core in
    `megatron_backend`). Tensor names are always HF names, so sync and checkpoints are backend-free."""

    wrapper: str
    dp_rank: int
    dp_size: int
    dp_group: dist.ProcessGroup | None
    shard_group: dist.ProcessGroup | None
    """The ranks that train on the same shard (megatron's TP × PP group), or None: each rank its own."""
    shard_source: int
    """The global rank of `shard_group` that the controller sends the shard to (this rank if no group)."""
    optimizer: torch.optim.Optimizer
    hf_source: Path

    @property
    def pipeline(self) -> Pipeline | None:
        """The pipeline schedule that runs forwards and backwards instead of `logits` / `no_sync`, or None
        (no pipeline parallelism)."""
        ...

    @property
    def optim_sharded(self) -> bool:
        """Each rank checkpoints its own optimizer shard (megatron's TP shards), or rank 0 writes one full
        state (gathered under FSDP2 / DDP)."""
        ...

    def logits(self, mb: losses.MicroBatch) -> torch.Tensor: ...
    def ref_logits(self, mb: losses.MicroBatch) -> torch.Tensor: ...
    def no_sync(self, skip: bool) -> AbstractContextManager[None]: ...
    def clip_grad(self, max_norm: float) -> float: ...
    def weight_meta(self) -> list[tuple[str, torch.dtype, list[int]]]: ...
    def hf_tensors(self, names: list[str]) -> dict[str, torch.Tensor]: ...
    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None: ...
    def optim_state(self) -> dict[str, Any]: ...
    def load_optim_state(self, state: dict[str, Any]) -> None: ...


def _check_packable(config: Any, attn: str) -> None:
    """--pack-shared-prompts hands the model a custom 4D mask: only sdpa and eager attention take one, and
    transformers (≥ 5) uses it unchanged on every layer, so a sliding window would silently be ignored."""
    import transformers

    why = None
    if attn not in ("sdpa", "eager"):
        why = f"{attn} attention takes no custom attention mask (load the model with sdpa or eager)"
    elif int(transformers.__version__.split(".")[0]) < 5:
        why = f"transformers {transformers.__version__} reads a custom mask differently (needs ≥ 5)"
    elif getattr(config, "sliding_window", None) and (
        getattr(config, "use_sliding_window", True)
        or "sliding_attention" in (getattr(config, "layer_types", None) or ())
    ):
        why = "the model has sliding-window layers, which a custom mask would turn into full attention"
    if why is not None:
        raise ConfigError(f"prompt packing: {why}", flags=["--pack-shared-prompts"])


class HFBackend:
    """transformers' AutoModelForCausalLM under FSDP2 `fully_shard` (world > 1 by default), DDP, or bare."""

    pipeline: Pipeline | None = None  # no pipeline parallelism
    optim_sharded = False  # rank 0 checkpoints the full (gathered) optimizer state

    def __init__(self, cfg: TrainConfig, *, device: torch.device, world: int) -> None:
        from torch.distributed.checkpoint import state_dict as dcp_sd
        from transformers import AutoModelForCausalLM

        self._dcp = dcp_sd
        assert cfg.hf_checkpoint is not None
        self.hf_source = cfg.hf_checkpoint
        dtype = torch.float32  # fp32 master weights; on GPU the forward runs under bf16 autocast
        module: Any = AutoModelForCausalLM.from_pretrained(str(cfg.hf_checkpoint), dtype=dtype)
        module.to(device)
        module.config.use_cache = False
        self.module, self.device = module, device
        self.dp_rank, self.dp_size = dist.get_rank(), world
        self.dp_group: dist.ProcessGroup | None = None
        self.shard_group: dist.ProcessGroup | None = None  # every rank is a data-parallel rank of its own
        self.shard_source = dist.get_rank()
        self.tied = bool(getattr(module.config, "tie_word_embeddings", False))
        self.wrapper: str = cfg.fsdp_wrap if cfg.fsdp_wrap != "auto" else ("fsdp2" if world > 1 else "none")
        self.model: torch.nn.Module = module
        if self.wrapper == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (world,))
            for layer in module.model.layers:  # one all-gather per decoder layer, as FSDP2 recommends
                fully_shard(layer, mesh=mesh)
            fully_shard(module, mesh=mesh)
        elif self.wrapper == "ddp":
            # No buffer broadcast: a forward then issues no collective, so only the synced backward of
            # each optimizer step has to line up across ranks.
            self.model = torch.nn.parallel.DistributedDataParallel(
                module, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
            )
        ends = [
            m.weight for m in (module.get_input_embeddings(), module.get_output_embeddings()) if m is not None
        ]
        self.optimizer: torch.optim.Optimizer = adamw(cfg, list(module.parameters()), decoupled=ends)
        self.ref: Any = None
        if cfg.needs_ref_model:  # frozen initial policy, full copy per rank (KL loss or --kl-coef only)
            self.ref = AutoModelForCausalLM.from_pretrained(str(cfg.hf_checkpoint), dtype=dtype)
            self.ref.to(device).requires_grad_(False).eval()
        self._names = [n for n, _ in module.named_parameters()]
        self._attn = str(getattr(module.config, "_attn_implementation", None))
        if cfg.pack_shared_prompts:
            _check_packable(module.config, self._attn)
        self.pack = cfg.pack_shared_prompts

    def _forward(self, model: torch.nn.Module, mb: losses.MicroBatch) -> torch.Tensor:
        """Logits [B, T−1, V] aligned to `mb.targets`; packed by shared prompt with --pack-shared-prompts."""
        cuda = self.device.type == "cuda"
        packing = (
            shared_prefix.plan(mb.input_ids, mb.attention_mask, mb.prompt_lengths) if self.pack else None
        )
        with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext():
            if packing is None:
                out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
                logits: torch.Tensor = out.logits
                return logits[:, :-1]
            # sdpa takes a bool mask (True: attend); eager adds the mask to its scores
            mask = packing.attention_mask(None if self._attn == "sdpa" else torch.float32)
            out = model(input_ids=packing.input_ids, attention_mask=mask, position_ids=packing.position_ids)
        return shared_prefix.unpack(out.logits, packing)

    def logits(self, mb: losses.MicroBatch) -> torch.Tensor:
        return self._forward(self.model, mb)

    def ref_logits(self, mb: losses.MicroBatch) -> torch.Tensor:
        assert self.ref is not None
        return self._forward(self.ref, mb)

    def no_sync(self, skip: bool) -> AbstractContextManager[None]:
        if skip and isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def clip_grad(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(
            self.module.parameters(), max_norm if max_norm > 0 else float("inf")
        )
        full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2
        return float(full() if full is not None else norm)

    def weight_meta(self) -> list[tuple[str, torch.dtype, list[int]]]:
        params = dict(self.module.named_parameters())  # DTensor shapes are the global shapes
        return [(n, params[n].dtype, list(params[n].shape)) for n in self._names]

    def hf_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        params = dict(self.module.named_parameters())
        out: dict[str, torch.Tensor] = {}
        for name in names:
            p = params[name].detach()
            full = getattr(p, "full_tensor", None)
            out[name] = (full() if full is not None else p).to("cpu")  # collective under FSDP2
        return out

    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        sd: dict[str, Any] = dict(tensors)
        if self.tied and "lm_head.weight" not in sd:  # tied checkpoints store the shared matrix once
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        opts = self._dcp.StateDictOptions(full_state_dict=True)
        self._dcp.set_model_state_dict(self.module, sd, options=opts)

    def optim_state(self) -> dict[str, Any]:
        opts = self._dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
        return dict(self._dcp.get_optimizer_state_dict(self.module, self.optimizer, options=opts))

    def load_optim_state(self, state: dict[str, Any]) -> None:
        opts = self._dcp.StateDictOptions(full_state_dict=True)
        self._dcp.set_optimizer_state_dict(self.module, self.optimizer, state, options=opts)
