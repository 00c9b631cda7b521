"""The trainer's pushes to a vLLM server when no broadcast group can hold it (here: a CPU trainer, as vLLM's
weight transfer is NCCL only): real trainer ranks over gloo, the server faked at the HTTP seam
(`FakeVLLMServer`). Each push goes by disk, the reason is said once, and nothing crashes mid-push."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from miles_aio.inference.vllm import VLLMClient
from miles_aio.trainer.actor import TrainerActor
from miles_aio.trainer.config import TrainConfig
from tests.inference.vllm_fake import FakeVLLMServer
from tests.trainer.helpers import make_batch, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_pushes_no_group_can_take_go_by_disk_and_say_why_once(model_dir: Path, tmp_path: Path) -> None:
    fake = FakeVLLMServer()
    cfg = TrainConfig(hf_checkpoint=model_dir, update_weight_transfer_mode="broadcast")

    async def main() -> None:
        async with (
            VLLMClient("http://fake-vllm", transport=fake.transport()) as client,
            TrainerActor.open(cfg, run_dir=tmp_path / "run") as actor,
        ):
            for version in (1, 2, 3):
                await actor.train(version - 1, make_batch(version - 1))
                await actor.sync_weights(client, version=version)
                assert fake.version == str(version)
            assert actor.bcast_failures == 3

    with structlog.testing.capture_logs() as logs:
        run(main())
    warned = [e for e in logs if e["event"] == "trainer: weight broadcast failed; this push goes by disk"]
    assert len(warned) == 1 and "NCCL only" in warned[0]["error"]
    run_dir = tmp_path / "run" / "weights"
    assert fake.loaded == [str(run_dir / f"v{v}") for v in (1, 2, 3)]
    assert not any(p == "/init_weight_transfer_engine" for p, _ in fake.calls)  # never asked to join
    assert fake.paused is None  # each reload paused and resumed the server
