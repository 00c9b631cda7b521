"""`MegatronPipeline`: pipeline parallelism for `MegatronBackend` (--pipeline-model-parallel-size > 1).

Each rank holds one stage of the GPTModel (built with pre_process / post_process): the first stage the
embedding, stage s decoder layers [s·L/PP, (s+1)·L/PP), the last one the final norm and the output
layer (plus its own copy of a tied embedding, whose gradient `MegatronBackend.reduce_grads` sums with
the first stage's). Forward and backward run under megatron-core's non-interleaved 1F1B schedule
(`get_forward_backward_func`), activations and gradients travel between stages by isend/irecv.

Only the last stage sees logits, so everything computed from them happens there and is then shared:
  - log-probs (π_old recomputation, π_ref for the KL, the `logprobs` command) are broadcast from the
    last stage to its whole pipeline, so every rank holds the same tensors afterwards;
  - the loss runs inside the schedule's loss function on the last stage; its metrics (reduced over
    that stage's data-parallel group by the rank loop) are broadcast to the pipeline, so rank 0 reports;
  - HF weights: each stage's TP group gathers its own tensors, and the stages' TP-rank-0, DP-rank-0
    replicas send them point-to-point to rank 0 (which writes or broadcasts them to the engines).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from miles_aio.trainer import losses

__all__ = ["MegatronPipeline", "PipelineStage"]

StageLoss = Callable[[int, torch.Tensor], Any]
"""(micro-batch index, logits [B, T−1, V]) → what the last stage keeps of that micro-batch."""


class PipelineStage(Protocol):
    """What the pipeline needs of the backend that owns this rank's stage (`MegatronBackend`: this module
    does not import it, that one imports this)."""

    model: Any
    ref: Any
    device: torch.device
    vocab: int
    last: bool
    pp_rank: int
    tp_rank: int
    dp_rank: int

    def stage_forward(self, model: Any, mb: losses.MicroBatch) -> torch.Tensor: ...
    def reduce_grads(self) -> None: ...
    def stage_of(self, hf_name: str) -> int: ...


class MegatronPipeline:
    """Drives megatron's pipeline schedule for one backend (`MegatronBackend`, which owns the model stage);
    `group` is megatron's pipeline-parallel group of this rank."""

    def __init__(self, backend: PipelineStage, *, group: dist.ProcessGroup) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func  # type: ignore[import-untyped,import-not-found,unused-ignore]

        self.be = backend
        self.group = group
        self.ranks: list[int] = dist.get_process_group_ranks(self.group)  # global rank of each stage
        # The replica that exports weights: rank 0's pipeline (TP rank 0, DP rank 0 of every stage).
        self.exporter = backend.tp_rank == 0 and backend.dp_rank == 0
        self.schedule = get_forward_backward_func()

    def _run(
        self, model: Any, mbs: list[losses.MicroBatch], keep: StageLoss, *, forward_only: bool
    ) -> list[Any]:
        """One pass of the schedule over `mbs`; returns, on the last stage, `keep`'s results in order."""
        be = self.be
        vocab = be.vocab

        def step(data: Iterator[tuple[int, losses.MicroBatch]], stage: Any) -> tuple[torch.Tensor, Any]:
            i, mb = next(data)

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
                kept = keep(i, output[:, :-1, :vocab])  # drop the TP vocab padding
                # (loss, token count, what the schedule collects): calculate_per_token_loss is on, so
                # megatron backpropagates the loss as given (it is a global token mean already).
                one = torch.tensor(1, dtype=torch.int)
                return (output.new_zeros(()), one, kept) if forward_only else (kept, one, None)

            return be.stage_forward(stage, mb), loss_func

        out: list[Any] = self.schedule(
            forward_step_func=step,
            data_iterator=iter(enumerate(mbs)),
            model=[model],
            num_microbatches=len(mbs),
            seq_length=max(int(mb.input_ids.shape[1]) for mb in mbs),  # shapes travel with each tensor
            micro_batch_size=max(int(mb.input_ids.shape[0]) for mb in mbs),
            forward_only=forward_only,
        )
        return out

    def logps(self, mbs: list[losses.MicroBatch], *, ref: bool = False) -> list[torch.Tensor]:
        """log π (or π_ref) of every micro-batch's targets [B, T−1], on every rank of the pipeline."""
        model = self.be.ref if ref else self.be.model

        def keep(i: int, logits: torch.Tensor) -> torch.Tensor:
            return losses.token_log_probs(logits, mbs[i].targets)

        got = self._run(model, mbs, keep, forward_only=True) if mbs else []
        out: list[torch.Tensor] = []
        for i, mb in enumerate(mbs):
            t = got[i] if self.be.last else torch.empty(mb.targets.shape, device=self.be.device)
            dist.broadcast(t, src=self.ranks[-1], group=self.group)
            out.append(t)
        return out

    def forward_backward(
        self, mbs: list[losses.MicroBatch], loss_of: Callable[[int, torch.Tensor], torch.Tensor]
    ) -> None:
        """Forward and backward of one optimizer step's micro-batches (`loss_of` runs on the last stage
        and returns the micro-batch's scaled loss), then the tied-embedding and DP gradient reductions."""
        self._run(self.be.model, mbs, loss_of, forward_only=False)
        self.be.reduce_grads()

    def share_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The last stage's metrics on every rank of the pipeline (rank 0 replies with them)."""
        box: list[Any] = [metrics if self.be.last else None]
        dist.broadcast_object_list(box, src=self.ranks[-1], group=self.group)
        shared: dict[str, float] = box[0]
        return shared

    def to_rank0(
        self, names: list[str], mine: dict[str, torch.Tensor], shapes: dict[str, list[int]]
    ) -> dict[str, torch.Tensor]:
        """Complete `mine` (this stage's full tensors) with the other stages' on rank 0: each one comes
        point-to-point from its owner stage's exporting replica (all fp32, shapes from `weight_meta`)."""
        if not self.exporter:
            return mine
        stage, dev = self.be.pp_rank, self.be.device  # nccl sends from GPU memory
        out = dict(mine)
        for name in names:
            owner = self.be.stage_of(name)
            if owner == 0:
                continue  # rank 0's own stage: already in `mine`
            if stage == 0:
                buf = torch.empty(shapes[name], dtype=torch.float32, device=dev)
                dist.recv(buf, src=self.ranks[owner], group=self.group)
                out[name] = buf.cpu()
            elif stage == owner:
                dist.send(mine[name].to(dev), dst=self.ranks[0], group=self.group)
        return out
