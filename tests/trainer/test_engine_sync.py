"""After a weight sync the embedded engine serves exactly the trainer's policy, for both transfer modes.

The engine generates greedily and reports the log-prob of each token it produced; the trainer scores the
same tokens with its current weights. Tolerance 1e-4 absolute (two float32 implementations of the same
Llama: HF transformers in the trainer, the engine's own forward with a KV cache).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from miles_aio.inference.local_launch import launch_local_engines
from miles_aio.inference.router import EngineRouter
from miles_aio.trainer.actor import TrainerActor
from miles_aio.trainer.config import TrainConfig
from tests.trainer.helpers import make_batch, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
PROMPT = [5, 9, 4, 7, 12, 3]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}


def test_engine_logprobs_match_trainer_after_sync(model_dir: Path, tmp_path: Path) -> None:
    cfg = TrainConfig(
        hf_checkpoint=model_dir,
        lr=5e-2,
        use_tis=True,
        update_weight_transfer_mode="broadcast",
        update_weight_buffer_size=40_000,  # several buckets for this 0.1M-parameter model
    )

    async def check(
        actor: TrainerActor, router: EngineRouter, version: int
    ) -> tuple[list[float], list[float]]:
        out = await router.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert out.weight_versions == [version] * len(out.output_ids)
        (trainer,) = await actor.logprobs([PROMPT + out.output_ids], [len(out.output_ids)])
        return out.output_log_probs, trainer.tolist()

    async def main() -> None:
        async with (
            launch_local_engines(model_dir, num_engines=1, weights_root=tmp_path) as urls,
            EngineRouter.open(urls) as router,
            TrainerActor.open(cfg, run_dir=tmp_path / "run") as actor,
        ):
            await actor.train(0, make_batch(0))
            before = await router.generate(input_ids=PROMPT, sampling_params=GREEDY)
            (stale,) = await actor.logprobs([PROMPT + before.output_ids], [len(before.output_ids)])
            assert (
                max(abs(a - b) for a, b in zip(before.output_log_probs, stale.tolist(), strict=True)) > 1e-3
            )

            await actor.sync_weights(router, version=1)  # broadcast, over gloo
            engine, trainer = await check(actor, router, 1)
            assert engine == pytest.approx(trainer, abs=1e-4)

            await actor.train(1, make_batch(1))
            actor.cfg = dataclasses.replace(cfg, update_weight_transfer_mode="disk")
            await actor.sync_weights(router, version=2)  # safetensors under <run-dir>/weights
            engine, trainer = await check(actor, router, 2)
            assert engine == pytest.approx(trainer, abs=1e-4)
            assert (tmp_path / "run" / "weights" / "v2" / "model.safetensors").exists()

            # staged: rank 0 writes v3 now; the push loads that file later, even after more training
            # (--overlap-weight-push trains the next step meanwhile), and writes nothing again
            staged = tmp_path / "run" / "weights" / "v3" / "model.safetensors"
            await actor.train(2, make_batch(2))
            assert await actor.stage_weights(version=3)
            written = staged.stat().st_mtime_ns
            await actor.train(3, make_batch(3))
            await actor.sync_weights(router, version=3)
            assert staged.stat().st_mtime_ns == written
            engine, trainer = await check(actor, router, 3)  # the engine serves v3, not the newer weights
            assert max(abs(a - b) for a, b in zip(engine, trainer, strict=True)) > 1e-3
            actor.cfg = cfg
            assert not await actor.stage_weights(version=4)  # a broadcast needs rank 0 in the collective

    run(main())
