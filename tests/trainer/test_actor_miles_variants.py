"""The miles variants through real rank processes (CPU, gloo, the tiny HF Llama): REINFORCE++ with
--kl-coef (which loads the reference model) and GSPO with dual clip train end to end, on megatron as on
HF, under a cosine lr schedule. (The schedule's resume is checked in test_actor's save/load test.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from miles_aio.trainer.actor import TrainerActor
from miles_aio.trainer.config import TrainConfig
from tests.trainer.helpers import make_batch, run
from tests.trainer.helpers import train_cfg as _cfg
from tests.trainer.test_reward_post_process import CALLS as post_calls

pytestmark = [pytest.mark.slow]


async def _train(
    cfg: TrainConfig, run_dir: Path, steps: int
) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    async with TrainerActor.open(cfg, run_dir=run_dir) as actor:
        metrics = [await actor.train(s, make_batch(s)) for s in range(steps)]
        return await actor.get_weights(), metrics


@pytest.mark.timeout(180)
def test_miles_variants_train_and_megatron_matches_hf(model_dir: Path, tmp_path: Path) -> None:
    """REINFORCE++ with --kl-coef and --normalize-advantages (both backends load the reference model),
    GSPO with dual clip and a coefficient-0 KL loss (monitored only), under a cosine lr schedule: each
    trains on HF, and the TP=2 megatron run lands on the HF run's weights (1e-5, as test_megatron)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    schedule = {"lr_decay_style": "cosine", "lr_warmup_iters": 1, "lr_decay_iters": 4, "lr": 1e-2}
    rpp = {"advantage_estimator": "reinforce_plus_plus", "kl_coef": 0.05, "normalize_advantages": True}
    gspo = {"advantage_estimator": "gspo", "eps_clip_c": 1.5, "use_kl_loss": True, "kl_loss_coef": 0.0}
    gspo["custom_reward_post_process_path"] = "tests.trainer.test_reward_post_process:doubled"  # miles' hook
    post_calls.clear()
    for i, kw in enumerate([rpp | schedule, gspo | schedule]):
        hf_w, hf_m = run(_train(_cfg(model_dir, **kw), tmp_path / f"hf{i}", steps=2))
        for m in hf_m:
            assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0
            if "kl_coef" in kw:  # whitened over the whole rollout: the token-mean advantage is ~0
                assert abs(m["train/advantage"]) < 1e-4
        if "eps_clip_c" in kw:
            assert len(post_calls) == 2  # once per train call, on the controller side
            assert all(0.0 <= m["train/dual_clipfrac"] <= 1.0 for m in hf_m)
            assert hf_m[1]["train/kl_loss"] > 0.0  # monitored at coefficient 0: the policy moved
        mg = _cfg(
            model_dir, train_backend="megatron", tensor_model_parallel_size=2, actor_num_gpus_per_node=2, **kw
        )
        mg_w, mg_m = run(_train(mg, tmp_path / f"mg{i}", steps=2))
        assert [m["train/lr"] for m in mg_m] == pytest.approx([m["train/lr"] for m in hf_m])
        for k in hf_w:
            torch.testing.assert_close(mg_w[k], hf_w[k], atol=1e-5, rtol=0, msg=f"{kw}: {k}")
