"""Weights by broadcast into a real vLLM server over vLLM's own NCCL weight transfer (GPU only).

The trainer (cuda:0) trains one step and pushes by broadcast to a vLLM server it launched on cuda:1
(`--weight-transfer-config '{"backend": "nccl"}'`); the server's greedy log-probs must then be the
trainer's policy, not the starting weights. Needs 2 GPUs (NCCL cannot join two processes on one device)
and a CUDA vLLM next to miles_aio; skipped, with the reason shown, without either. Not yet run: the lent
device machine has one GPU and no vLLM.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest
import torch

from miles_aio.inference.vllm import VLLMClient
from miles_aio.inference.vllm_launch import vllm_servers
from miles_aio.models.tiny import build_tiny_llama
from miles_aio.trainer.actor import TrainerActor
from miles_aio.trainer.config import TrainConfig
from tests.gpu.test_gpu_trainer import ALPHABET, _batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (the trainer's and the vLLM server's)"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="needs vllm (a CUDA build) installed"
    ),
]
PROMPT = [5, 9, 4, 7, 12, 3]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    # head_dim 64: vLLM's attention kernels have it
    return build_tiny_llama(
        tmp_path / "model", alphabet=ALPHABET, hidden_size=256, num_heads=4, num_kv_heads=2
    )


def test_broadcast_into_vllm_serves_the_trained_policy(model_dir: Path, tmp_path: Path) -> None:
    async def main() -> tuple[list[float], list[float], list[float]]:
        cfg = TrainConfig(
            hf_checkpoint=model_dir,
            lr=5e-2,  # a step large enough to move every greedy log-prob
            use_tis=True,
            micro_batch_size=2,
            update_weight_transfer_mode="broadcast",
            update_weight_buffer_size=1 << 20,  # several buckets: start/update/finish per bucket
        )
        extra = ["--weight-transfer-config", '{"backend": "nccl"}', "--enforce-eager"]
        async with (
            vllm_servers(model_dir, gpu_offset=1, extra_args=extra, log_dir=tmp_path / "logs") as launcher,
            TrainerActor.open(cfg, run_dir=tmp_path) as actor,
        ):
            (server,) = await launcher.start_all(1)
            async with VLLMClient(server.url) as client:
                greedy = {"max_new_tokens": 8, "temperature": 0.0}
                before = await client.generate(input_ids=PROMPT, sampling_params=greedy)
                await actor.train(0, _batch(0))
                await client.pause_generation("retract")
                await actor.sync_weights(client, version=1)
                await client.continue_generation()
                after = await client.generate(input_ids=PROMPT, sampling_params=greedy)
                assert after.weight_versions == [1] * len(after.output_ids)
                (trainer,) = await actor.logprobs([PROMPT + after.output_ids], [len(after.output_ids)])
                return list(before.output_log_probs), list(after.output_log_probs), list(trainer)

    before, after, trainer = asyncio.run(main())
    # bf16 autocast in the trainer against vLLM's kernels: bf16-level agreement
    torch.testing.assert_close(torch.tensor(after), torch.tensor(trainer), atol=5e-2, rtol=0)
    assert max(abs(a - b) for a, b in zip(after, before, strict=False)) > 0.1  # the push changed the policy
