"""Multi-turn rollout with a tool: the worked example of "write your rollout as a coroutine".

    python -m recipes.tool_use --num-rollout 50

The task is the quickstart's two-digit addition, but the model may call a calculator. The protocol,
in characters the tiny model's tokenizer knows:

    12+34=          prompt
    ?               the model asks the calculator (generation stops at "?")
    46;             the tool's answer — appended as context: loss_mask 0, never trained on
    46</s>          the model's final answer

or it answers directly (`46</s>`). A correct direct answer earns 1.0, a correct answer after a tool call
0.8: the model is paid for doing it itself, but the tool is the safer bet while it cannot. Everything
else — engines, trainer, fully async schedule, eval — is the quickstart's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from miles_aio.config import RunConfig, opt
from miles_aio.recipe import Recipe, RecipeArgs, main
from miles_aio.rollout.context import RolloutContext
from miles_aio.rollout.single_turn import prompt_token_ids
from miles_aio.tasks.arithmetic import Problem, Segment, make_splits, parse_answer
from miles_aio.types import Sample, Status
from recipes import quickstart

ALPHABET = "0123456789+=?;"
CALL, END_OF_TOOL = "?", ";"
TOOL_BONUS = {False: 1.0, True: 0.8}  # reward for a correct answer, by "used the tool"


def calculator(expression: str) -> str:
    """The tool: evaluates `a+b=` (nothing else: it is a calculator, not eval())."""
    left, _, _ = expression.partition("=")
    a, _, b = left.partition("+")
    return str(int(a) + int(b))


async def generate(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Turn 1: answer, or stop at "?" to call the calculator. Turn 2 (after a call): the final answer."""
    assert ctx.tokenizer is not None
    call_id = ctx.tokenizer.encode(CALL)[0]
    prompt_token_ids(ctx, sample)
    params = {**sampling_params, "stop_token_ids": [call_id]}
    out = await ctx.engine.generate(
        input_ids=sample.tokens, sampling_params=params, routing_key=sample.group_index
    )
    sample.append(out)
    if out.output_ids and out.output_ids[-1] == call_id and sample.status != Status.ABORTED:
        sample.metadata["tool_calls"] = 1
        result = calculator(str(sample.prompt)) + END_OF_TOOL
        sample.append_context(ctx.tokenizer.encode(result), result)  # loss_mask 0: the tool wrote it
        out = await ctx.engine.generate(
            input_ids=sample.tokens, sampling_params=sampling_params, routing_key=sample.group_index
        )
        sample.append(out)
    return sample


async def reward(ctx: RolloutContext, sample: Sample) -> dict[str, float]:
    """`reward` is what GRPO optimises (--reward-key reward); `accuracy` is what eval reports."""
    used_tool = bool(sample.metadata.get("tool_calls"))
    correct = parse_answer(sample.response.rsplit(END_OF_TOOL, 1)[-1]) == str(sample.label)
    return {
        "reward": TOOL_BONUS[used_tool] if correct else 0.0,
        "accuracy": float(correct),
        "tool_calls": float(used_tool),
    }


def render(p: Problem) -> list[Segment]:
    """Warm-start examples: half answer directly, half call the tool and copy its answer."""
    if (p.a * 7 + p.b) % 2:
        return [(p.prompt, False), (p.answer, True)]
    return [(p.prompt, False), (CALL, True), (p.answer + END_OF_TOOL, False), (p.answer, True)]


def solve(model: Any, tok: Any, problems: Sequence[Problem]) -> list[str]:
    """Greedy answers, running the calculator when the model asks for it."""
    import torch

    answers = []
    with torch.no_grad():
        for p in problems:
            ids = tok.encode(p.prompt)
            for _ in range(10):
                nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
                if nxt == tok.eos_token_id:
                    break
                ids.append(nxt)
                if tok.decode([nxt]) == CALL:
                    ids += tok.encode(calculator(p.prompt) + END_OF_TOOL)
            answers.append(tok.decode(ids).rsplit(END_OF_TOOL, 1)[-1].split("=", 1)[-1].lstrip(CALL))
    return answers


@dataclass(frozen=True, kw_only=True, slots=True)
class Options(quickstart.Options):
    """The quickstart's flags, with the model its figures in docs/learning.md were measured with."""

    model_hidden_size: int = opt(128, quickstart.HIDDEN_SIZE_HELP)


def prepare(cfg: RunConfig, args: RecipeArgs[Options]) -> None:
    from miles_aio.tasks.arithmetic import warm_start

    model_dir = cfg.run_dir / "model"
    if not (model_dir / "model.safetensors").is_file():
        train, _ = make_splits()
        warm_start(
            model_dir,
            train,
            alphabet=ALPHABET,
            render=render,
            solve=solve,
            target_accuracy=args.options.warm_start_accuracy,
            seed=args.options.warm_start_seed,
            check_every=args.options.warm_start_check_every,
            model_kwargs=quickstart.model_shape(args.options),
        )


RECIPE = Recipe(
    name="tool_use",
    description=(__doc__ or "").split("\n\n")[0],
    defaults={
        **quickstart.DEFAULTS,
        # what its figures in docs/learning.md were measured with (it learns in 300 steps at a constant lr)
        "num_rollout": 300,
        "eval_interval": 10,
        "lr": 1e-4,
        "min_lr": 0.0,
        "decoupled_lr": None,
        "decoupled_min_lr": None,
        "lr_warmup_iters": 0,
        "lr_decay_style": "constant",
        "lr_decay_iters": None,
        "use_opsm": False,  # its figures predate the quickstart's OPSM (session 24)
        "trainer_num_threads": 0,  # the free cores, as its figures were measured (not the quickstart's -1)
        # 64 running requests and no --pack-shared-prompts (the quickstart's is a conditional default)
        "engine_max_running_requests": 64,
        "rollout_max_response_len": 4,
        "custom_generate_function_path": "recipes.tool_use:generate",
        "custom_rm_path": "recipes.tool_use:reward",
        "reward_key": "reward",
    },
    build=quickstart.build,
    options=Options,
    prompts=quickstart.prompts,
    eval_prompts=quickstart.eval_prompts,
    prepare=prepare,
    plan=quickstart.plan,
    check=quickstart.check,
    checkpoints_in_run_dir=True,
)


def cli(argv: Sequence[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    main(RECIPE, argv)


if __name__ == "__main__":
    cli()
