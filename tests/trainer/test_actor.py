"""TrainerActor end to end on CPU: real rank processes, gloo, a tiny HF Llama.

Tolerances: parameters of a 2-rank (FSDP2) run match the 1-rank run to 1e-5 absolute after two AdamW
steps at lr 1e-3 (the ranks' partial gradients are summed in another order; float32). A resumed run
matches an uninterrupted one to 1e-6 (same world size, same order of operations).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from miles_aio.trainer.actor import TrainerActor, TrainerRankError, rank_threads
from miles_aio.trainer.config import TrainConfig
from tests.trainer.helpers import alive, children_of, make_batch, run
from tests.trainer.helpers import train_cfg as _cfg

pytestmark = [pytest.mark.slow]


async def _train(cfg: TrainConfig, run_dir: Path, steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    async with TrainerActor.open(cfg, run_dir=run_dir) as actor:
        losses = [(await actor.train(s, make_batch(s)))["train/loss"] for s in range(steps)]
        return await actor.get_weights(), losses


@pytest.mark.timeout(90)
def test_two_ranks_equal_one_rank(model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    initial = load_file(str(model_dir / "model.safetensors"))
    w1, l1 = run(_train(_cfg(model_dir), tmp_path / "one", steps=1))
    w2, l2 = run(_train(_cfg(model_dir, actor_num_gpus_per_node=2), tmp_path / "two", steps=1))
    assert set(w1) == set(w2) == set(initial)
    assert l1 == pytest.approx(l2, abs=1e-6)
    moved = max((w1[k] - initial[k]).abs().max().item() for k in w1)
    assert moved > 1e-4  # two AdamW steps at lr 1e-3 did change the weights
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=0, msg=k)


@pytest.mark.timeout(90)
def test_save_load_resume_equals_uninterrupted(model_dir: Path, tmp_path: Path) -> None:
    """Weights, optimizer, RNG and the lr schedule's position survive save → load: the resumed run
    lands where the uninterrupted one does. 8 samples per train call, global batch 4: two optimizer
    steps per call; warmup 1 then linear decay to 0 at step 5 with lr 1e-2: steps 0..3 train at
    0, 1e-2, 0.75e-2, 0.5e-2 (Megatron's schedule: the warmup's first step is at lr 0)."""
    cfg = _cfg(model_dir, lr=1e-2, lr_decay_style="linear", lr_warmup_iters=1, lr_decay_iters=5)
    ckpt, export = tmp_path / "ckpt" / "step_0", tmp_path / "export"

    async def interrupted() -> tuple[dict[str, torch.Tensor], list[torch.Tensor], list[float]]:
        async with TrainerActor.open(cfg, run_dir=tmp_path / "a") as actor:
            first = await actor.train(0, make_batch(0))
            await actor.save(0, ckpt)
            await actor.export_hf(export)
            lp = await actor.logprobs([make_batch(5)[0][0].tokens], [3])
        async with TrainerActor.open(cfg, run_dir=tmp_path / "b") as actor:
            assert await actor.load(ckpt) == 0
            second = await actor.train(1, make_batch(1))
            return await actor.get_weights(), lp, [first["train/lr"], second["train/lr"]]

    async def straight_run() -> tuple[dict[str, torch.Tensor], list[float]]:
        async with TrainerActor.open(cfg, run_dir=tmp_path / "c") as actor:
            lrs = [(await actor.train(s, make_batch(s)))["train/lr"] for s in range(2)]
            return await actor.get_weights(), lrs

    resumed, lp, resumed_lrs = run(interrupted())
    straight, straight_lrs = run(straight_run())
    # train/lr is the lr of the call's last optimizer step: steps 1 and 3
    assert straight_lrs == pytest.approx([1e-2, 0.5e-2])
    assert resumed_lrs == pytest.approx(straight_lrs)
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], atol=1e-6, rtol=0, msg=k)

    # The export is an ordinary HF checkpoint: transformers loads it and agrees with the trainer.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    tokens = torch.tensor([make_batch(5)[0][0].tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=tokens).logits[0, :-1], -1)
    ref = logp.gather(-1, tokens[0, 1:, None])[-3:, 0]
    torch.testing.assert_close(lp[0], ref, atol=1e-5, rtol=0)
    assert {p.name for p in ckpt.iterdir()} >= {
        "model",
        "optimizer.safetensors",
        "optimizer.json",
        "trainer_state.json",
        "rng_rank0.safetensors",
    }


@pytest.mark.timeout(90)
def test_killed_rank_fails_the_run_fast_and_leaves_no_children(model_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(model_dir, actor_num_gpus_per_node=2, micro_batch_size=1, global_batch_size=None)
    big = make_batch(1, groups=32, n=8, prompt_len=40, max_resp=60)  # ~5 s per step even on a quiet machine
    pids: list[int] = []
    before = set(children_of(os.getpid()))  # other tests' processes are not ours to judge

    async def main() -> None:
        async with TrainerActor.open(cfg, run_dir=tmp_path) as actor:
            pids.extend(actor.pids)
            step = asyncio.create_task(actor.train(0, big))
            await asyncio.sleep(0.5)
            assert not step.done()
            os.kill(pids[1], signal.SIGKILL)
            await step

    t0 = time.monotonic()
    with pytest.raises(TrainerRankError) as info:
        run(main())
    assert time.monotonic() - t0 < 60
    assert info.value.rank in (0, 1)
    assert not any(alive(p) for p in pids)
    assert set(children_of(os.getpid())) <= before


@pytest.mark.timeout(60)
def test_rank_exception_arrives_with_its_traceback(model_dir: Path, tmp_path: Path) -> None:
    batch = make_batch(0)
    batch[0][0].tokens[0] = 10_000  # not in the vocabulary: the embedding lookup fails on the rank
    before = set(children_of(os.getpid()))

    async def main() -> None:
        async with TrainerActor.open(_cfg(model_dir), run_dir=tmp_path) as actor:
            await actor.train(0, batch)

    with pytest.raises(TrainerRankError) as info:
        run(main())
    assert info.value.rank == 0
    assert "IndexError" in str(info.value) and "rank_main.py" in info.value.rank_traceback
    assert set(children_of(os.getpid())) <= before


@pytest.mark.timeout(60)
def test_rank_death_while_idle_cancels_the_block(model_dir: Path, tmp_path: Path) -> None:
    """No call in flight: the process exit itself (not a poll, not the next call) fails the block."""
    pids: list[int] = []

    async def main() -> None:
        async with TrainerActor.open(_cfg(model_dir), run_dir=tmp_path) as actor:
            pids.extend(actor.pids)
            os.kill(pids[0], signal.SIGKILL)
            await asyncio.sleep(50)  # cancelled by the actor's TaskGroup long before this ends

    t0 = time.monotonic()
    with pytest.raises(TrainerRankError, match="exited with code -9"):
        run(main())
    assert time.monotonic() - t0 < 30
    assert not any(alive(p) for p in pids)


@pytest.mark.timeout(60)
def test_rank_threads_leave_the_embedded_engines_their_cores(model_dir: Path, tmp_path: Path) -> None:
    from tests.helpers import make_config

    run_cfg = make_config(tmp_path / "run", num_rollout=1, engine_num_threads=1)
    assert run_cfg.engine.rollout_backend == "local" and run_cfg.engine.num_engines == 1

    async def threads(cfg: TrainConfig) -> int:
        async with TrainerActor.open(cfg, run_cfg, run_dir=tmp_path / "t") as actor:
            return actor.threads

    cores = os.cpu_count() or 1
    assert run(threads(_cfg(model_dir))) == max(1, cores - 1)  # one core for the one engine thread
    assert run(threads(_cfg(model_dir, trainer_num_threads=3))) == 3  # the flag overrides
    assert run(threads(_cfg(model_dir, trainer_num_threads=-1))) == cores  # every core, the engine's too


@pytest.mark.pure
@given(
    setting=st.integers(-1, 8),
    cores=st.integers(1, 64),
    engine_threads=st.integers(0, 64),
    world=st.integers(1, 8),
)
def test_rank_threads(setting: int, cores: int, engine_threads: int, world: int) -> None:
    got = rank_threads(setting, cores=cores, engine_threads=engine_threads, world=world)
    assert got >= 1
    if setting > 0:
        assert got == setting
    elif setting == -1:  # the engines' cores count too
        assert (
            got
            == max(1, cores // world)
            >= rank_threads(0, cores=cores, engine_threads=engine_threads, world=world)
        )
    else:  # the ranks together take as many of the free cores as split evenly, at least a thread each
        free = cores - engine_threads
        assert got * world <= max(free, world) and (got == 1 or (got + 1) * world > free)


@pytest.mark.timeout(90)
def test_one_optimizer_step_per_rollout_skips_the_pi_old_forward(model_dir: Path, tmp_path: Path) -> None:
    """π_old = the weights before the rollout's first update: with one optimizer step the training
    forward's own log-probs are π_old (no pre-forward); with two, the second step needs the recomputed
    π_old, so the pre-forward runs and the PPO ratio moves off 1 (batch 1: both groups have mixed rewards,
    so the first step has a gradient)."""

    async def main() -> tuple[dict[str, float], dict[str, float]]:
        one_cfg = _cfg(model_dir, global_batch_size=8)
        async with TrainerActor.open(one_cfg, run_dir=tmp_path / "one") as actor:
            one = await actor.train(0, make_batch(1))  # 8 samples, one optimizer step
        async with TrainerActor.open(_cfg(model_dir), run_dir=tmp_path / "two") as actor:
            two = await actor.train(0, make_batch(1))  # the same 8 samples, two optimizer steps
        return one, two

    one, two = run(main())
    assert one["train/optimizer_steps"] == 1 and two["train/optimizer_steps"] == 2
    assert one["perf/trainer_pre_forward_s"] == 0.0 < two["perf/trainer_pre_forward_s"]
    assert one["train/ratio"] == pytest.approx(1.0, abs=1e-12) and one["train/pg_clipfrac"] == 0.0
    assert two["train/ppo_kl"] != 0.0  # the second step ran against π_old, not against itself


@pytest.mark.timeout(90)
def test_decoupled_lr_drives_the_embedding_and_output_layer_and_survives_resume(
    model_dir: Path, tmp_path: Path
) -> None:
    """--decoupled-lr 0 with --lr 1e-3: AdamW moves every weight but the token embedding and lm_head,
    which stay bit-identical, before and after a save → load (the optimizer's second param group and its
    schedule are restored with it); train/decoupled_lr reports that group's lr."""
    from safetensors.torch import load_file

    initial = load_file(str(model_dir / "model.safetensors"))
    cfg = _cfg(model_dir, decoupled_lr=0.0)
    ends = {"model.embed_tokens.weight", "lm_head.weight"}
    ckpt = tmp_path / "ckpt" / "step_0"

    async def go() -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
        async with TrainerActor.open(cfg, run_dir=tmp_path / "a") as actor:
            first = await actor.train(0, make_batch(0))
            await actor.save(0, ckpt)
        async with TrainerActor.open(cfg, run_dir=tmp_path / "b") as actor:
            assert await actor.load(ckpt) == 0
            second = await actor.train(1, make_batch(1))
            return await actor.get_weights(), [first, second]

    weights, metrics = run(go())
    assert ends <= set(weights)
    for k in weights:
        if k in ends:
            assert torch.equal(weights[k], initial[k]), k
        else:
            assert (weights[k] - initial[k]).abs().max().item() > 1e-5, k  # lr 1e-3 moved the rest
    assert [m["train/decoupled_lr"] for m in metrics] == [0.0, 0.0]
    assert [m["train/lr"] for m in metrics] == pytest.approx([1e-3, 1e-3])


@pytest.mark.timeout(90)
def test_resuming_with_another_decoupled_lr_setting_fails_naming_it(model_dir: Path, tmp_path: Path) -> None:
    """A checkpoint saved without --decoupled-lr (one param group) does not load into a run with it (two
    groups): the load fails at once, saying which setting the checkpoint has, instead of torch mapping
    the saved group onto the wrong one and failing (or training wrongly) later."""
    ckpt = tmp_path / "ckpt" / "step_0"

    async def go() -> None:
        async with TrainerActor.open(_cfg(model_dir), run_dir=tmp_path / "a") as actor:
            await actor.train(0, make_batch(0))
            await actor.save(0, ckpt)
        async with TrainerActor.open(_cfg(model_dir, decoupled_lr=1e-2), run_dir=tmp_path / "b") as actor:
            await actor.load(ckpt)

    with pytest.raises(TrainerRankError, match="saved without --decoupled-lr and this run is with"):
        run(go())


@pytest.mark.timeout(90)
def test_packed_shared_prompts_train_the_same_weights(model_dir: Path, tmp_path: Path) -> None:
    """--pack-shared-prompts on real ranks (FSDP2 over 2 gloo ranks): a GRPO batch whose groups share
    their prompts trains the same weights, with the same loss, as the padded rows, over two steps.
    Tolerance: AdamW moves a weight by ~lr whatever its gradient's size, so an element whose gradient is
    float noise moves by a few % of lr either way (the unit test compares the gradients themselves)."""
    from safetensors.torch import load_file

    async def main(pack: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
        cfg = _cfg(
            model_dir,
            actor_num_gpus_per_node=2,
            micro_batch_size=8,
            global_batch_size=None,
            pack_shared_prompts=pack,
        )
        async with TrainerActor.open(cfg, run_dir=tmp_path / str(pack)) as actor:
            batch = [
                make_batch(s, groups=4, prompt_len=24, max_resp=16, shared_prompt=True) for s in range(2)
            ]
            losses = [(await actor.train(s, b))["train/loss"] for s, b in enumerate(batch)]
            return await actor.get_weights(), losses

    rows_w, rows_l = run(main(False))
    packed_w, packed_l = run(main(True))
    assert packed_l == pytest.approx(rows_l, abs=1e-6)
    initial = load_file(str(model_dir / "model.safetensors"))
    assert max((rows_w[k] - initial[k]).abs().max().item() for k in rows_w) > 1e-3  # trained
    diffs = {k: (packed_w[k] - rows_w[k]).abs().max().item() for k in rows_w}
    assert max(diffs.values()) < 5e-5, diffs
