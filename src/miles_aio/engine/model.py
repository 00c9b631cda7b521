"""A plain-torch Llama forward over HF Llama weight names, with a slot-based KV cache.

`LlamaModel.forward` runs one batch of sequences, each continuing from the KV already stored in its cache
slot: a prefill feeds many tokens of one sequence, a decode step feeds one token of each of B sequences.
Both go through the same code; only the shapes differ.

KV layout: one pool per layer, `[max_running, n_kv_heads, capacity, head_dim]`, one slot per running
request; the capacity grows (doubling) with the longest sequence served, up to the context length. A
step writes its new keys/values at their positions, then attends over `slot[:, :, :kv_len]` with a mask
`key_pos <= query_pos`, so sequences of different lengths share a batch (padding + mask, no paging:
fine for the small models this engine exists for).

The math mirrors transformers' `LlamaForCausalLM` in float32 (RMSNorm in float32, default RoPE with
`rotate_half`, GQA, SiLU MLP, tied or untied `lm_head`) so logprobs agree with a trainer's forward to
~1e-5. Weights live in `self.weights` under their HF names; updates copy into those tensors in place.
Everything here runs on the engine's single compute thread; nothing is thread-safe by itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
import torch.nn.functional as F

from miles_aio.engine.weights import read_checkpoint

__all__ = ["SUPPORTED_ARCHITECTURES", "KVPool", "LlamaModel", "LlamaSpec"]

SUPPORTED_ARCHITECTURES: Final = frozenset({"LlamaForCausalLM", "MistralForCausalLM"})
# Tensors that a checkpoint may carry but the forward recomputes (or, when tied, shares).
_IGNORED_SUFFIXES: Final = ("rotary_emb.inv_freq",)
_SDPA_DECODE_BATCH: Final = 32
"""Decode batches this large use `scaled_dot_product_attention`; smaller ones `_decode_attention`, which
measured faster below it and slower above it (2-core x86, 1 thread, kv length 1,050: 2.5 vs 3.4 ms per
step at batch 16, 6.9 vs 5.4 ms at batch 64)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaSpec:
    """The parts of a Llama `config.json` the forward needs, checked for what this engine supports."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    architectures: tuple[str, ...]
    model_type: str
    attention_bias: bool
    mlp_bias: bool

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> LlamaSpec:
        cfg = json.loads((model_dir / "config.json").read_text())
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        return cls.from_config(cfg, generation_config=gen)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], *, generation_config: dict[str, Any]) -> LlamaSpec:
        archs = tuple(cfg.get("architectures") or ("LlamaForCausalLM",))
        if not SUPPORTED_ARCHITECTURES.intersection(archs):
            raise ValueError(
                f"unsupported architectures {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported RoPE type {rope_type!r} (only the default RoPE is implemented)")
        if cfg.get("sliding_window") is not None:
            raise ValueError("sliding-window attention is not supported")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        nh = int(cfg["num_attention_heads"])
        eos: set[int] = set()
        for src in (cfg, generation_config):  # SGLang stops on the union of both
            raw = src.get("eos_token_id")
            eos.update([raw] if isinstance(raw, int) else (raw or []))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=nh,
            num_kv_heads=int(cfg.get("num_key_value_heads") or nh),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // nh),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=tuple(sorted(eos)),
            architectures=archs,
            model_type=str(cfg.get("model_type", "llama")),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the forward reads, by HF name, with its shape."""
        h, inter, hd = self.hidden_size, self.intermediate_size, self.head_dim
        nq, nkv = self.num_heads * hd, self.num_kv_heads * hd
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "self_attn.q_proj.weight": (nq, h),
                p + "self_attn.k_proj.weight": (nkv, h),
                p + "self_attn.v_proj.weight": (nkv, h),
                p + "self_attn.o_proj.weight": (h, nq),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
            if self.attention_bias:
                shapes |= {
                    p + "self_attn.q_proj.bias": (nq,),
                    p + "self_attn.k_proj.bias": (nkv,),
                    p + "self_attn.v_proj.bias": (nkv,),
                    p + "self_attn.o_proj.bias": (h,),
                }
            if self.mlp_bias:
                shapes |= {
                    p + "mlp.gate_proj.bias": (inter,),
                    p + "mlp.up_proj.bias": (inter,),
                    p + "mlp.down_proj.bias": (h,),
                }
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def is_ignored(self, name: str) -> bool:
        """True for checkpoint tensors the engine skips: RoPE buffers, and lm_head when it is tied."""
        return name.endswith(_IGNORED_SUFFIXES) or (self.tie_word_embeddings and name == "lm_head.weight")


_Fused = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]
"""One layer's fused projections: qkv weight, qkv bias, gate/up weight, gate/up bias."""


class KVPool:
    """Keys/values per layer, `k[layer]`, `v[layer]`: [slots, n_kv_heads, capacity, head_dim].

    The capacity (positions per slot) starts small and doubles up to `context_len` when a step needs more
    (`ensure`), so memory follows the longest sequence actually served, not the model's context window
    (a 135M model with an 8k window and 64 slots would otherwise need tens of GB up front).
    """

    def __init__(
        self,
        spec: LlamaSpec,
        *,
        num_slots: int,
        context_len: int,
        dtype: torch.dtype,
        initial_capacity: int = 256,
    ) -> None:
        self.num_slots = num_slots
        self.context_len = context_len
        self.capacity = min(context_len, initial_capacity)
        shape = (num_slots, spec.num_kv_heads, self.capacity, spec.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(spec.num_layers)]

    def ensure(self, length: int) -> None:
        """Grow every slot to hold at least `length` positions (copying what is stored)."""
        if length <= self.capacity:
            return
        if length > self.context_len:
            raise ValueError(f"{length} positions exceed the context length {self.context_len}")
        new_cap = min(self.context_len, max(length, 2 * self.capacity))
        for cache in (self.k, self.v):
            for layer, old in enumerate(cache):
                grown = old.new_zeros((*old.shape[:2], new_cap, old.shape[3]))
                grown[:, :, : self.capacity] = old
                cache[layer] = grown
        self.capacity = new_cap

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def read(self, slot: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of one slot's first `length` positions (what the prefix cache stores)."""
        return (
            [k[slot, :, :length].clone() for k in self.k],
            [v[slot, :, :length].clone() for v in self.v],
        )

    def write(self, slot: int, ks: list[torch.Tensor], vs: list[torch.Tensor], length: int) -> None:
        """Copy the first `length` positions of stored keys/values into `slot` (a prefix-cache hit)."""
        self.ensure(length)
        for layer in range(len(self.k)):
            self.k[layer][slot, :, :length] = ks[layer][:, :length]
            self.v[layer][slot, :, :length] = vs[layer][:, :length]


class LlamaModel:
    """Weights (HF names → tensors) plus the forward. Construct with `load`, or directly in tests."""

    def __init__(self, spec: LlamaSpec, weights: dict[str, torch.Tensor], *, context_len: int) -> None:
        missing = set(spec.expected_shapes()) - set(weights)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        self.spec = spec
        self.weights = weights
        self.dtype = weights["model.embed_tokens.weight"].dtype
        # RoPE table for every position, computed like transformers (inv_freq in float32, then cos/sin).
        hd = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
        freqs = torch.arange(context_len, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos().to(self.dtype)
        self._fused: dict[
            int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]
        ] = {}
        self._sin = emb.sin().to(self.dtype)

    def weights_changed(self) -> None:
        """Drop the fused projections; the next forward rebuilds them from `weights` (call after updates)."""
        self._fused.clear()

    def _fused_layer(self, i: int) -> _Fused:
        """Layer i's q/k/v projections as one matrix and gate/up as another (and biases): two matmuls per
        layer instead of five. Built from `weights` on first use after load or an update."""
        if (fused := self._fused.get(i)) is None:
            w, p = self.weights, f"model.layers.{i}."
            qkv = [p + f"self_attn.{n}_proj" for n in "qkv"]
            gu = [p + "mlp.gate_proj", p + "mlp.up_proj"]

            def cat(names: list[str], part: str) -> torch.Tensor | None:
                ts = [w.get(f"{n}.{part}") for n in names]
                return None if any(t is None for t in ts) else torch.cat([t for t in ts if t is not None])

            qkv_w, gu_w = cat(qkv, "weight"), cat(gu, "weight")
            assert qkv_w is not None and gu_w is not None
            fused = (qkv_w, cat(qkv, "bias"), gu_w, cat(gu, "bias"))
            self._fused[i] = fused
        return fused

    @classmethod
    def load(cls, model_dir: Path, *, context_len: int, dtype: torch.dtype = torch.float32) -> LlamaModel:
        spec = LlamaSpec.from_model_dir(model_dir)
        raw = read_checkpoint(model_dir)
        expected = spec.expected_shapes()
        weights: dict[str, torch.Tensor] = {}
        for name, tensor in raw.items():
            if spec.is_ignored(name):
                continue
            if name not in expected:
                raise ValueError(f"{model_dir}: unexpected tensor {name!r} for a Llama model")
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(
                    f"{model_dir}: {name} has shape {tuple(tensor.shape)}, expected {expected[name]}"
                )
            weights[name] = tensor.to(dtype).contiguous()
        return cls(spec, weights, context_len=context_len)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        *,
        slots: torch.Tensor,
        kv: KVPool,
        kv_len: int,
        logits_from: int | None = None,
        last_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of the LAST fed position of each row, float32 [B, vocab] (`last_index` [B]: each row's
        last real position, for right-padded rows); with `logits_from` (B == 1), the logits of every fed
        position from that index on, [T - logits_from, vocab].

        `input_ids`, `positions`: [B, T] (every row has T real tokens: a prefill is one row, a decode step
        has T = 1). `slots`: [B] cache slot of each row. `kv_len`: attend over key positions [0, kv_len);
        must exceed every position fed. Keys/values of the fed tokens are written into the pool.
        """
        w, spec = self.weights, self.spec
        kv.ensure(kv_len)
        b, t = input_ids.shape
        nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        h = F.embedding(input_ids, w["model.embed_tokens.weight"])
        cos = self._cos[positions].unsqueeze(1)  # [B, 1, T, hd], broadcasts over heads
        sin = self._sin[positions].unsqueeze(1)
        key_pos = torch.arange(kv_len)
        mask = key_pos[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, kv_len]
        slot_idx = slots[:, None]  # [B, 1] with positions [B, T] → writes land at [B, T]
        # Consecutive slots (the usual case: slots are handed out lowest first) are read as a view of the
        # pool; any other set is gathered, a copy of every row's keys/values per layer.
        first = int(slots[0])
        span = slice(first, first + b) if bool((slots == torch.arange(first, first + b)).all()) else None
        fresh = t > 1 and kv_len == t and not bool(positions[:, 0].any())
        lo = int(slots.min())
        near = slots - lo  # otherwise: narrow the pool to the slots' range, then one index_select
        width = int(slots.max()) - lo + 1
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            qkv_w, qkv_b, gate_up_w, gate_up_b = self._fused_layer(i)
            x = _rms_norm(h, w[p + "input_layernorm.weight"], spec.rms_norm_eps)
            q, k, v = torch.split(F.linear(x, qkv_w, qkv_b), [nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = q.reshape(b, t, nh, hd).transpose(1, 2)
            k = k.reshape(b, t, nkv, hd).transpose(1, 2)
            v = v.reshape(b, t, nkv, hd).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            # Advanced indices [B,1] and [B,T] around a slice put the indexed dims first: [B, T, nkv, hd].
            kv.k[i][slot_idx, :, positions] = k.transpose(1, 2)
            kv.v[i][slot_idx, :, positions] = v.transpose(1, 2)
            if fresh:  # nothing cached before these tokens: plain causal attention over them
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nh != nkv)
            else:
                if span is not None:
                    keys, values = kv.k[i][span, :, :kv_len], kv.v[i][span, :, :kv_len]
                else:
                    keys = kv.k[i][lo : lo + width, :, :kv_len].index_select(0, near)
                    values = kv.v[i][lo : lo + width, :, :kv_len].index_select(0, near)
                if t == 1 and b < _SDPA_DECODE_BATCH:
                    attn = _decode_attention(q, keys, values, mask)
                else:
                    attn = F.scaled_dot_product_attention(
                        q, keys, values, attn_mask=mask, enable_gqa=nh != nkv
                    )
            h = h + _linear(attn.transpose(1, 2).reshape(b, t, nh * hd), w, p + "self_attn.o_proj")
            x = _rms_norm(h, w[p + "post_attention_layernorm.weight"], spec.rms_norm_eps)
            gate, up = F.linear(x, gate_up_w, gate_up_b).chunk(2, dim=-1)
            h = h + _linear(F.silu(gate) * up, w, p + "mlp.down_proj")
        if logits_from is not None:
            last = h[0, logits_from:]
        elif last_index is not None:
            last = h[torch.arange(b), last_index]
        else:
            last = h[:, -1]
        last = _rms_norm(last, w["model.norm.weight"], spec.rms_norm_eps)
        head = w["model.embed_tokens.weight"] if spec.tie_word_embeddings else w["lm_head.weight"]
        return (last @ head.T).float()


def _decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Attention of one query per row, [B, nh, 1, hd], over [B, nkv, L, hd] keys/values.

    Each kv head's query group is one matmul (no copy of the keys per query head, as GQA in SDPA
    would need); on CPU this is over twice as fast as `scaled_dot_product_attention` with a mask."""
    b, nh, _, hd = q.shape
    nkv, length = keys.shape[1], keys.shape[2]
    scores = torch.matmul(q.view(b, nkv, nh // nkv, hd), keys.transpose(-1, -2)) * hd**-0.5
    scores = scores.masked_fill(~mask.view(b, 1, 1, length), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values).view(b, nh, 1, hd)


def _linear(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    return F.linear(x, w[prefix + ".weight"], w.get(prefix + ".bias"))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers' LlamaRMSNorm: normalise in float32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
