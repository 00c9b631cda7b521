"""`MegatronBackend`: an HF Llama checkpoint trained as a megatron-core GPTModel (local layer spec, TP × PP).

Used by `rank_main` when `--train-backend megatron`. Construction reads the HF `config.json`, builds
`GPTModel` with tensor parallelism (`--tensor-model-parallel-size`) and pipeline parallelism
(`--pipeline-model-parallel-size`: this rank's stage only, layers split evenly), and loads the HF
weights through the HF ↔ Megatron conversion below, so the engines, checkpoints and exports keep
speaking HF names:

    model.embed_tokens / lm_head            ↔ embedding.word_embeddings / output_layer (vocab rows, padded
                                              to a multiple of TP, split by rows)
    layers.i.self_attn.{q,k,v}_proj         ↔ decoder.layers.i.self_attention.linear_qkv: per query group
                                              [q heads of the group; k; v], groups split by TP rank
    layers.i.self_attn.o_proj               ↔ …linear_proj (split by columns)
    layers.i.mlp.{gate,up}_proj             ↔ …mlp.linear_fc1: per TP rank [gate shard; up shard]
    layers.i.mlp.down_proj                  ↔ …mlp.linear_fc2 (split by columns)
    layers.i.{input,post_attention}_layernorm, model.norm ↔ input_layernorm, pre_mlp_layernorm,
                                              decoder.final_layernorm (replicated)

Under PP, HF layer i lives on stage i // (L / PP) as its local `decoder.layers.(i − offset)`; the
embedding is on the first stage, the final norm and output layer on the last (a tied embedding has a
copy there too). `megatron_pp.MegatronPipeline` runs the 1F1B schedule and moves log-probs, metrics
and exported weights from the stages that own them to rank 0.

Data parallelism: gradients are all-reduced (averaged) over the data-parallel group after each
optimizer step's last micro-batch. The optimizer is torch AdamW with a hand-rolled TP/PP-aware gradient
clip (megatron's own clip asserts CUDA tensors). Optimizer checkpoints are per rank, so a megatron run
resumes on the same TP × PP × DP layout.
On a machine without CUDA, `_megatron_cpu_shim.apply()` patches megatron's CUDA-only plumbing first.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from miles_aio.trainer import losses, protocol
from miles_aio.trainer.backend import adamw
from miles_aio.trainer.config import TrainConfig
from miles_aio.trainer.megatron_pp import MegatronPipeline

__all__ = ["MegatronBackend"]


class MegatronBackend:
    """The `backend.ModelBackend` over megatron-core."""

    optim_sharded = True  # each rank saves its own optimizer shard

    def __init__(self, cfg: TrainConfig, *, device: torch.device, world: int) -> None:
        import megatron.core  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: F401

        from miles_aio.trainer import _megatron_cpu_shim

        _megatron_cpu_shim.apply()
        from megatron.core import parallel_state as ps  # type: ignore[import-untyped,import-not-found,unused-ignore]
        from megatron.core.models.gpt import GPTModel  # type: ignore[import-untyped,import-not-found,unused-ignore]
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # type: ignore[import-untyped,import-not-found,unused-ignore]
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # type: ignore[import-untyped,import-not-found,unused-ignore]
        from megatron.core.transformer.transformer_config import TransformerConfig  # type: ignore[import-untyped,import-not-found,unused-ignore]

        assert cfg.hf_checkpoint is not None
        self.hf_source = cfg.hf_checkpoint
        self.device = device
        tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
        hf = json.loads((cfg.hf_checkpoint / "config.json").read_text())
        if hf["num_hidden_layers"] % pp:  # TrainConfig checks this too; a rank may see another checkpoint
            raise ValueError(f"{hf['num_hidden_layers']} layers do not split into {pp} pipeline stages")
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        model_parallel_cuda_manual_seed(cfg.seed)
        self._ps = ps
        self.tp, self.tp_rank = tp, ps.get_tensor_model_parallel_rank()
        self.pp, self.pp_rank = pp, ps.get_pipeline_model_parallel_rank()
        self.first, self.last = self.pp_rank == 0, self.pp_rank == pp - 1
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group: dist.ProcessGroup | None = ps.get_data_parallel_group()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        # The TP × PP ranks of one data-parallel replica train on the same shard: the controller sends it
        # to the group's first rank only, which passes it on (`rank_main.share_shard`, NCCL on GPUs), so
        # the controller's one process sends each shard once, not TP × PP times.
        self.shard_group: dist.ProcessGroup | None = ps.get_model_parallel_group() if tp * pp > 1 else None
        self.shard_source = (
            dist.get_process_group_ranks(self.shard_group)[0]
            if self.shard_group is not None
            else dist.get_rank()
        )
        self.wrapper = f"megatron(tp={tp},pp={pp},dp={self.dp_size})"

        self.h, self.nh, self.ng = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
        self.hd = hf.get("head_dim") or self.h // self.nh
        self.layers, self.inter, self.vocab = (
            hf["num_hidden_layers"],
            hf["intermediate_size"],
            hf["vocab_size"],
        )
        self.per_stage: int = self.layers // pp
        self.offset = self.pp_rank * self.per_stage  # megatron's uniform split: stage s owns this range
        self.tied = bool(hf.get("tie_word_embeddings", False))
        self.vocab_padded = math.ceil(self.vocab / tp) * tp
        rope = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        config = TransformerConfig(
            num_layers=self.layers,
            hidden_size=self.h,
            num_attention_heads=self.nh,
            num_query_groups=self.ng,
            ffn_hidden_size=self.inter,
            kv_channels=self.hd,
            normalization="RMSNorm",
            layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            # Plain isend/irecv pairs (gloo has no coalesced batch_isend_irecv); the loss is already a
            # global token mean, so the schedule must not divide it by the micro-batch count.
            batch_p2p_comm=False,
            calculate_per_token_loss=pp > 1,
            bf16=False,  # fp32 params; on GPU the forward runs under bf16 autocast
            apply_rope_fusion=False,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
        )

        # Micro-batches are padded per batch, so stages exchange shapes before each activation. Set after
        # construction: __post_init__ rejects it for the (unused, dense model) MoE allgather dispatcher.
        config.variable_seq_lengths = pp > 1

        def build() -> Any:
            model = GPTModel(
                config,
                get_gpt_layer_local_spec(normalization="RMSNorm"),
                vocab_size=self.vocab_padded,
                max_sequence_length=hf.get("max_position_embeddings", 4096),
                position_embedding_type="rope",
                rotary_base=rope,
                share_embeddings_and_output_weights=self.tied,
                parallel_output=False,
                pre_process=self.first,
                post_process=self.last,
            )
            return model.to(device)

        self.model = build()
        initial = protocol.read_hf_dir(cfg.hf_checkpoint)
        self.load_hf_tensors(initial)
        self.ref: Any = None
        if cfg.needs_ref_model:
            self.ref = build()
            _load_into(self.ref, self._to_megatron(initial))
            self.ref.requires_grad_(False)
        # Megatron's --decoupled-lr covers the parameters it marks `is_embedding_or_output_parameter`:
        # the word embeddings and the output layer (whichever of them this pipeline stage holds)
        ends = [
            p
            for name, p in self.model.named_parameters()
            if getattr(p, "is_embedding_or_output_parameter", False)
            or name.endswith(("embedding.word_embeddings.weight", "output_layer.weight"))
        ]
        self.optimizer: torch.optim.Optimizer = adamw(cfg, list(self.model.parameters()), decoupled=ends)
        self.pipeline: MegatronPipeline | None = (
            MegatronPipeline(self, group=ps.get_pipeline_model_parallel_group()) if pp > 1 else None
        )

    # -- forward / backward ----------------------------------------------------------------------------------
    def _forward(self, model: Any, mb: losses.MicroBatch) -> torch.Tensor:
        if self.pipeline is not None:  # one stage alone has no logits: the schedule runs the stages
            raise RuntimeError("with pipeline parallelism, forwards go through `self.pipeline`")
        return self.stage_forward(model, mb)[:, :-1, : self.vocab]  # drop the TP vocab padding

    def stage_forward(self, model: Any, mb: losses.MicroBatch) -> torch.Tensor:
        """This stage's output: padded-vocab logits [B, T, V'] on the last stage, else the hidden states
        [T, B, H] for the next one (under PP the input comes from `model.set_input_tensor`)."""
        b, t = mb.input_ids.shape
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=self.device), 1)
        pad = mb.attention_mask == 0  # True = masked out, megatron's convention
        mask = (causal[None, None] | pad[:, None, None, :]).expand(b, 1, t, t)
        pos = torch.arange(t, device=self.device)[None].expand(b, t)
        cuda = self.device.type == "cuda"
        with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext():
            out: torch.Tensor = model(mb.input_ids, pos, mask)
        # Under autocast a stage's output may be bf16; the next stage receives pipeline_dtype buffers.
        return out if self.last else out.to(torch.float32)

    def logits(self, mb: losses.MicroBatch) -> torch.Tensor:
        return self._forward(self.model, mb)

    def ref_logits(self, mb: losses.MicroBatch) -> torch.Tensor:
        return self._forward(self.ref, mb)

    @contextlib.contextmanager
    def no_sync(self, skip: bool) -> Iterator[None]:
        yield
        if not skip:  # the optimizer step's last micro-batch
            self.reduce_grads()

    def reduce_grads(self) -> None:
        """Sum the tied embedding's two copies' gradients (first and last stage, PP only), then average
        over data parallel."""
        if self.tied and self.pp > 1 and (self.first or self.last):
            w = self.model.embedding.word_embeddings.weight if self.first else self.model.output_layer.weight
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            dist.all_reduce(w.grad, group=self._ps.get_embedding_group())
        if self.dp_size > 1:
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.dp_group)
                    p.grad /= self.dp_size

    def clip_grad(self, max_norm: float) -> float:
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate  # type: ignore[import-untyped,import-not-found,unused-ignore]

        params = [p for p in self.model.parameters() if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in params:
            # Count each replicated norm weight once, and the tied embedding only on the first stage.
            if param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False):
                sq += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(sq, group=self._ps.get_model_parallel_group())  # TP × PP
        norm = float(sq.sqrt())
        if max_norm > 0 and norm > max_norm:
            for p in params:
                p.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    # -- HF ↔ Megatron --------------------------------------------------------------------------------
    def _table(self) -> list[tuple[str, str, str]]:
        """(HF name, Megatron name, how it is laid out) for every HF tensor."""
        rows = [("model.embed_tokens.weight", "embedding.word_embeddings.weight", "vocab")]
        for i in range(self.layers):
            hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
            rows += [
                (hp + "input_layernorm.weight", mp + "input_layernorm.weight", "rep"),
                (hp + "self_attn.q_proj.weight", mp + "self_attention.linear_qkv.weight", "q"),
                (hp + "self_attn.k_proj.weight", mp + "self_attention.linear_qkv.weight", "k"),
                (hp + "self_attn.v_proj.weight", mp + "self_attention.linear_qkv.weight", "v"),
                (hp + "self_attn.o_proj.weight", mp + "self_attention.linear_proj.weight", "col"),
                (hp + "post_attention_layernorm.weight", mp + "pre_mlp_layernorm.weight", "rep"),
                (hp + "mlp.gate_proj.weight", mp + "mlp.linear_fc1.weight", "gate"),
                (hp + "mlp.up_proj.weight", mp + "mlp.linear_fc1.weight", "up"),
                (hp + "mlp.down_proj.weight", mp + "mlp.linear_fc2.weight", "col"),
            ]
        rows.append(("model.norm.weight", "decoder.final_layernorm.weight", "rep"))
        if not self.tied:
            rows.append(("lm_head.weight", "output_layer.weight", "vocab"))
        return rows

    def stage_of(self, hf_name: str) -> int:
        """The pipeline stage that owns an HF tensor (the tied embedding: the first stage's copy)."""
        if hf_name.startswith("model.layers."):
            return int(hf_name.split(".")[2]) // self.per_stage
        return 0 if hf_name == "model.embed_tokens.weight" else self.pp - 1

    def _local(self, m_name: str) -> str:
        """A Megatron name with a global layer index → this stage's module name (layers count from 0)."""
        if not m_name.startswith("decoder.layers."):
            return m_name
        _, _, index, rest = m_name.split(".", 3)
        return f"decoder.layers.{int(index) - self.offset}.{rest}"

    def _to_megatron(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shard (TP) of every Megatron tensor of its stage (PP), from full HF tensors."""
        r, tp, g = self.tp_rank, self.tp, self.ng
        out: dict[str, torch.Tensor] = {}
        for i in range(self.offset, self.offset + self.per_stage):
            hp, mp = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
            q = hf[hp + "q_proj.weight"].reshape(g, -1, self.h)
            k, v = (hf[hp + n].reshape(g, -1, self.h) for n in ("k_proj.weight", "v_proj.weight"))
            out[mp + "self_attention.linear_qkv.weight"] = (
                torch.cat([q, k, v], 1).chunk(tp)[r].reshape(-1, self.h)
            )
            gate, up = (
                hf[f"model.layers.{i}.mlp.gate_proj.weight"],
                hf[f"model.layers.{i}.mlp.up_proj.weight"],
            )
            out[mp + "mlp.linear_fc1.weight"] = torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
        rows = [row for row in self._table() if self.stage_of(row[0]) == self.pp_rank]
        if self.tied and self.pp > 1 and self.last:  # the last stage's copy of the tied embedding
            rows.append(("model.embed_tokens.weight", "output_layer.weight", "vocab"))
        for hf_name, m_name, kind in rows:
            t = hf[hf_name]
            if kind == "rep":
                out[m_name] = t
            elif kind == "col":
                out[m_name] = t.chunk(tp, dim=1)[r]
            elif kind == "vocab":
                padded = torch.zeros(self.vocab_padded, t.shape[1], dtype=t.dtype)
                padded[: self.vocab] = t
                out[m_name] = padded.chunk(tp)[r]
        return {self._local(k): v for k, v in out.items()}

    def _gather(self, shard: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp == 1:
            return shard.detach().cpu()
        parts = [torch.empty_like(shard) for _ in range(self.tp)]
        dist.all_gather(parts, shard.detach().contiguous(), group=self.tp_group)
        return torch.cat([p.cpu() for p in parts], dim)

    def hf_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Full HF tensors, complete on rank 0 (a collective: every rank must call it with the same names).
        Each stage's TP group gathers its own tensors; under PP the other stages' reach rank 0 from their
        TP-rank-0, DP-rank-0 replica; other ranks return only what their stage owns."""
        mine = self._stage_tensors([n for n in names if self.stage_of(n) == self.pp_rank])
        if self.pipeline is None:
            return mine
        shapes = {n: s for n, _, s in self.weight_meta()}
        return self.pipeline.to_rank0(names, mine, shapes)

    def _stage_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Full HF tensors of this stage (a TP collective over the stage's TP group)."""
        params = dict(self.model.named_parameters())
        table = {hf: (m, kind) for hf, m, kind in self._table()}
        per_group = (self.nh // self.ng + 2) * self.hd
        out: dict[str, torch.Tensor] = {}
        for name in names:
            m_name, kind = table[name]
            p = params[self._local(m_name)]
            if kind == "rep":
                out[name] = p.detach().cpu().clone()
            elif kind == "col":
                out[name] = self._gather(p, 1)
            elif kind == "vocab":
                out[name] = self._gather(p, 0)[: self.vocab]
            elif kind in ("q", "k", "v"):
                qkv = self._gather(p, 0).reshape(self.ng, per_group, self.h)
                nq = self.nh // self.ng * self.hd
                part = {"q": qkv[:, :nq], "k": qkv[:, nq : nq + self.hd], "v": qkv[:, nq + self.hd :]}[kind]
                out[name] = part.reshape(-1, self.h).contiguous()
            else:  # gate / up: each rank holds [gate shard; up shard]
                halves = [t.chunk(2) for t in self._gather(p, 0).chunk(self.tp)]
                out[name] = torch.cat([h[0 if kind == "gate" else 1] for h in halves]).contiguous()
        return out

    def weight_meta(self) -> list[tuple[str, torch.dtype, list[int]]]:
        shapes = {
            "vocab": [self.vocab, self.h],
            "rep": [self.h],
            "q": [self.nh * self.hd, self.h],
            "k": [self.ng * self.hd, self.h],
            "v": [self.ng * self.hd, self.h],
            "gate": [self.inter, self.h],
            "up": [self.inter, self.h],
        }
        out = []
        for hf_name, _, kind in self._table():
            if kind == "col":
                shape = [self.h, self.nh * self.hd] if "o_proj" in hf_name else [self.h, self.inter]
            else:
                shape = shapes[kind]
            out.append((hf_name, torch.float32, shape))
        return out

    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        _load_into(self.model, self._to_megatron(tensors))

    def optim_state(self) -> dict[str, Any]:
        return dict(self.optimizer.state_dict())

    def load_optim_state(self, state: dict[str, Any]) -> None:
        state = {
            "state": {int(k): v for k, v in state["state"].items()},
            "param_groups": state["param_groups"],
        }
        self.optimizer.load_state_dict(state)


def _load_into(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[name].to(p.dtype))
