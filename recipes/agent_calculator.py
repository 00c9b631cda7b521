"""An agent on the official `openai` client learns to use a calculator tool, through the session endpoint.

    python -m recipes.agent_calculator                      # about 8 minutes on 2 cores
    python -m recipes.agent_calculator --num-rollout 5      # a smoke run

The task is the quickstart's two-digit addition, posed as a chat. The agent (`run_agent`: ordinary
`openai.AsyncOpenAI` code, given with --custom-agent-function-path) offers a `calc` tool and sends the
problem as the user message; the tiny chat model (role tokens and a chat template:
`build_tiny_llama(chat_tokens=True)`) answers it by itself, or calls the tool in the `qwen25` parser's
format, gets the result back as a `tool` message and answers. One conversation is one sample:

    <s><|system|>{"type": "function", ...}<|end|><|user|>12+34=<|end|><|assistant|>    first prompt
    <tool_call>{"name":"calc","arguments":{"expr":"12+34"}}</tool_call><|end|>           the model: mask 1
    <|tool|>46<|end|><|assistant|>                                           the tool and the template: 0
    46<|end|>                                                                            the model: mask 1

The session endpoint keeps the model's own tokens (TITO); the reward is 1.0 for the right final answer,
however it was found. `rollout/model_token_ratio` is the share of the trained response tokens the model
wrote (~0.94 here: the rest is the tool's answers and the template's glue).

The supervised warm start renders its examples with the same chat template, the way the session appends
turns (`tito.next_prompt`): 3/4 of the conversations call the tool, 1/4 answer directly, but only 8%
teach the decision to call (the first token, `<`): the model learns *how* to use the calculator (its
check: made to start a call, it answers 90% of a training probe right, greedily, through the agent's
protocol) but rarely *to* use it, and it cannot add by itself. RL (fully async GRPO, held-out eval of
200 problems, greedy, through the same agent) finds that calling pays.

Measured on this project's 2-core CPU machine (one run, seed 0, defaults, other jobs sharing the cores):
warm start 250 steps (about 100 s); held-out success **2% → 85.5% after 10 steps (1 min of RL) → 97.5%
after 20 → 100% from step 30 to 50**; RL 5 min 39 s, the whole command 7 min 40 s. The training reward
(temperature 1) rose from 0.06 to about 0.43. A second run (the same warm start; RL differs with the
async timing): 2% → 82.5% → 97.5% → 100% → 100% → 98% at steps 0-50, 5 min 57 s in all.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from miles_aio.config import RunConfig, opt
from miles_aio.errors import ConfigError
from miles_aio.recipe import Recipe, RecipeArgs, main
from miles_aio.tasks.arithmetic import Problem, Segment, make_splits
from miles_aio.types import Sample
from recipes import quickstart

ALPHABET: Final = "0123456789+=" + '<>/_{}":, ' + "abcdefghijklmnopqrstuvwxyz"
"""Every character of the prompts, the tool spec, the tool calls and the tool's replies."""
TOOLS: Final = [{"type": "function", "function": {"name": "calc"}}]
END: Final = "<|end|>"
REQUEST_TIMEOUT_S: Final = 300.0
MAX_TURNS: Final = 3
"""Model replies per conversation: a tool call, the answer, and one more call allowed."""
TOOL_SHARE: Final = 0.75
"""Warm-start conversations that call the tool (the rest answer directly)."""
DECIDE_SHARE: Final = 0.08
"""Warm-start conversations whose first token, the `<` that starts a call, is trained on (default)."""


# ---- the tool and the agent -----------------------------------------------------------------------------


def calculator(expr: str) -> str:
    """The tool: the sum of `a+b+...` (non-negative integers; nothing else, it is not eval())."""
    terms = expr.strip().rstrip("=").split("+")
    if not all(t.strip().isdigit() for t in terms):
        return "error"
    return str(sum(int(t) for t in terms))


def run_tool(name: str, arguments: str) -> str:
    """What the agent sends back for one tool call (an unknown tool or bad arguments: `error`)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return "error"
    if name != "calc" or not isinstance(args, dict) or not isinstance(args.get("expr"), str):
        return "error"
    return calculator(args["expr"])


def tool_call_text(expr: str) -> str:
    """A call in the `qwen25` parser's format, as the warm start teaches the model to write it."""
    body = json.dumps({"name": "calc", "arguments": {"expr": expr}}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


async def run_agent(
    base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any], **kwargs: Any
) -> dict[str, Any]:
    """The agent: ask, run every tool call, send the results back; up to MAX_TURNS replies. Its dict is
    merged into the sample's metadata, where `reward` reads `answer`."""
    import openai  # the test extra's client; imported here so `--help` and the docs need nothing more

    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    answer: str | None = None
    calls = errors = 0
    # a generous timeout, connecting included: the endpoint shares its event loop (and two cores) with
    # the whole controller, and a request waits for its turn on the engine
    async with openai.AsyncOpenAI(
        base_url=base_url, api_key=kwargs.get("api_key") or "unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
    ) as client:
        for _ in range(MAX_TURNS):
            reply = await client.chat.completions.create(
                model="default",
                messages=messages,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
                **request_kwargs,
            )
            msg = reply.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                answer = msg.content
                break
            for call in msg.tool_calls:
                fn = getattr(call, "function", None)
                result = run_tool(fn.name, fn.arguments) if fn is not None else "error"
                calls += 1
                errors += result == "error"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"answer": answer, "tool_calls": calls, "tool_errors": errors}


async def reward(ctx: Any, sample: Sample) -> dict[str, float]:
    """`reward` (what GRPO optimises, --reward-key reward) and `accuracy` (what eval reports): 1.0 for
    the right final answer; `tool_calls`: whether the model used the calculator."""
    answer = sample.metadata.get("answer")
    correct = isinstance(answer, str) and answer.strip() == str(sample.label)
    used = float(bool(sample.metadata.get("tool_calls")))
    return {"reward": float(correct), "accuracy": float(correct), "tool_calls": used}


# ---- the warm start: the same conversations, rendered as the session renders them --------------------------


def _template(tok: Any) -> Any:
    from miles_aio.chat_template import ChatTemplate

    template = ChatTemplate.from_tokenizer(tok)
    assert template is not None
    return template


def _assistant(text: str, call_id: int) -> dict[str, Any]:
    """The assistant message the session answers `text` with (and the agent resends)."""
    from miles_aio.rollout.agent.parsers import parse_qwen25

    parsed = parse_qwen25(text)
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        msg["tool_calls"] = [
            {
                "id": f"call_{call_id + i}",
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for i, c in enumerate(parsed.tool_calls)
        ]
    return msg


def _continue(messages: list[dict[str, Any]], reply: Mapping[str, Any]) -> bool:
    """Append the reply and the tool results, as `run_agent` does; False when the conversation is over."""
    messages.append(dict(reply))
    for call in reply.get("tool_calls") or []:
        fn = call["function"]
        messages.append(
            {"role": "tool", "tool_call_id": call["id"], "content": run_tool(fn["name"], fn["arguments"])}
        )
    return bool(reply.get("tool_calls"))


def _gap(template: Any, history: Sequence[Mapping[str, Any]], request: Sequence[Mapping[str, Any]]) -> str:
    """The text the session appends after the model's last reply (`tito.next_prompt`'s difference)."""
    before = template.render(history, tools=TOOLS, add_generation_prompt=False)
    after = template.render(request, tools=TOOLS, add_generation_prompt=True)
    assert after.startswith(before)
    return str(after[len(before) :])


def make_render(tok: Any, *, decide_share: float = DECIDE_SHARE) -> Any:
    """The warm start's examples: TOOL_SHARE of the conversations call the tool, and `decide_share` of
    all of them teach the decision to (their first token, `<`); the others answer directly."""
    template = _template(tok)

    def render(p: Problem) -> list[Segment]:
        """One conversation, text by text: the model's replies are trained on, the rest is not."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": p.prompt}]
        segments: list[Segment] = [
            (template.render(messages, tools=TOOLS, add_generation_prompt=True), False)
        ]
        share = (p.a * 31 + p.b * 17) % 100 / 100
        if share < TOOL_SHARE:
            call = tool_call_text(p.prompt.rstrip("="))
            _continue(messages, _assistant(call, 0))
            segments += [
                (call[0], share < decide_share),  # the decision to call: rarely taught
                (call[1:] + END, True),
                (_gap(template, messages[:2], messages), False),
            ]
        segments.append((p.answer + END, True))
        return segments

    return render


def solve(
    model: Any, tok: Any, problems: Sequence[Problem], *, max_new: int = 80, force_call: bool = False
) -> list[str]:
    """Greedy conversations through the agent's protocol, in process: the session's prompts
    (`tito.next_prompt`), the `qwen25` parser, the tool; the final answers ("" when there is none).
    `force_call`: the first reply starts with `<` (how well the model uses the tool once it decides to)."""
    from miles_aio.rollout.agent.tito import TurnTokens, next_prompt

    template = _template(tok)
    end_ids = [tok.convert_tokens_to_ids(END), tok.eos_token_id]

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    def render(messages: Sequence[Mapping[str, Any]], generation_prompt: bool) -> str:
        return str(template.render(messages, tools=TOOLS, add_generation_prompt=generation_prompt))

    convs: list[list[dict[str, Any]]] = [[{"role": "user", "content": p.prompt}] for p in problems]
    forced = encode("<") if force_call else []
    inputs = [encode(render(c, True)) for c in convs]
    answers = [""] * len(problems)
    live = list(range(len(problems)))
    for turn in range(MAX_TURNS):
        lead = forced if turn == 0 else []
        outputs = _greedy(model, [inputs[i] + lead for i in live], max_new=max_new, end_ids=end_ids)
        outputs = [lead + out for out in outputs]
        still = []
        for i, out in zip(live, outputs, strict=True):
            history = convs[i]
            reply = _assistant(tok.decode(out, skip_special_tokens=True), len(history))
            prefix = len(history) + 1
            if not _continue(history, reply):
                answers[i] = reply.get("content") or ""
                continue
            kept = TurnTokens(inputs[i], out, [0.0] * len(out), [None] * len(out))
            inputs[i] = next_prompt(kept, history, prefix, render=render, encode=encode)
            still.append(i)
        live = still
        if not live:
            break
    return answers


def _greedy(model: Any, rows: list[list[int]], *, max_new: int, end_ids: list[int]) -> list[list[int]]:
    """Greedy continuations of `rows` (up to and with the first end id), in one left-padded batch."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    with torch.no_grad():
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=end_ids,
            pad_token_id=0,
        )[:, width:].tolist()
    return [g[: next((k + 1 for k, t in enumerate(g) if t in end_ids), len(g))] for g in gen]


# ---- the recipe -------------------------------------------------------------------------------------------

MODEL: Final[dict[str, Any]] = {"chat_tokens": True, "max_position_embeddings": 256}


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """agent_calculator's own flags: its warm start."""

    warm_start_accuracy: float = opt(
        0.9,
        "Supervised warm start until the model, made to start a tool call, answers this share of training "
        "problems right (greedy); 0 stops after --warm-start-check-every steps.",
    )
    warm_start_call_share: float = opt(
        DECIDE_SHARE,
        f"Share of the warm start's conversations that teach the model to start a tool call (of the "
        f"{TOOL_SHARE} that use the tool; the others teach only how to use it, once started).",
    )
    warm_start_check_every: int = opt(25, "Warm-start steps between two checks of that share.")

    def __post_init__(self) -> None:
        if not 0.0 <= self.warm_start_call_share <= TOOL_SHARE:
            raise ConfigError(
                f"must be between 0 and {TOOL_SHARE}, got {self.warm_start_call_share}",
                flags=["--warm-start-call-share"],
            )
        if self.warm_start_check_every < 1:
            raise ConfigError(
                f"must be >= 1, got {self.warm_start_check_every}", flags=["--warm-start-check-every"]
            )


def prepare(cfg: RunConfig, args: RecipeArgs[Options]) -> None:
    """The supervised warm start (before the event loop starts; cached in the run directory)."""
    from miles_aio.models.tiny import build_tiny_llama, load_tokenizer
    from miles_aio.tasks.arithmetic import warm_start

    model_dir, opts = cfg.run_dir / "model", args.options
    if (model_dir / "model.safetensors").is_file():
        return
    with tempfile.TemporaryDirectory() as tmp:  # the tokenizer the examples are rendered with
        tok = load_tokenizer(build_tiny_llama(Path(tmp), alphabet=ALPHABET, **MODEL))
    train, _ = make_splits()
    warm_start(
        model_dir,
        train,
        alphabet=ALPHABET,
        render=make_render(tok, decide_share=opts.warm_start_call_share),
        # 0: no probe at all (a smoke run): stop at the first check
        solve=functools.partial(solve, force_call=True) if opts.warm_start_accuracy > 0 else _no_answers,
        target_accuracy=opts.warm_start_accuracy,
        model_kwargs=MODEL,
        append_eos=False,
        lr=2e-3,
        batch_size=64,
        probe_size=50,
        check_every=opts.warm_start_check_every,
    )


def _no_answers(model: Any, tok: Any, problems: Sequence[Problem]) -> list[str]:
    return [""] * len(problems)


def plan(cfg: RunConfig, args: RecipeArgs[object]) -> dict[str, Any]:
    return quickstart.plan(cfg, args) | {
        "model": "tiny chat Llama (role tokens, chat template), warm-started by supervised fine-tuning",
        "agent": cfg.rollout.custom_agent_function_path,
        "tool_call_parser": cfg.rollout.session_tool_call_parser,
    }


DEFAULTS: dict[str, Any] = {
    # rollout: 16 prompts × 8 conversations per step; a reply is at most 80 tokens (a tool call is 67 +
    # <|end|>), a whole conversation (prompt, replies, tool output) at most 224
    "rollout_batch_size": 16,
    "n_samples_per_prompt": 8,
    "num_rollout": 50,
    "rollout_max_response_len": 80,
    "max_seq_len": 224,
    "rollout_temperature": 1.0,
    # the agent: every rollout is a session of its own on the endpoint; the reward reads its answer
    "custom_agent_function_path": "recipes.agent_calculator:run_agent",
    "custom_rm_path": "recipes.agent_calculator:reward",
    "reward_key": "reward",
    # fully async: bounded staleness, rollout runs ahead of training
    "max_admission_staleness": 2,
    "max_weight_staleness": 4,
    "async_data_buffer_capacity_factor": 2.0,
    # eval: greedy, 200 held-out problems, through the same agent, on the shared engine
    "eval_interval": 10,
    "eval_temperature": 0.0,
    "eval_max_response_len": 80,
    "save_interval": 100,  # into <run-dir>/checkpoints unless --save is given; the last step too
    # trainer: as the quickstart's (GRPO + truncated importance sampling, without its OPSM), one optimizer
    # step per rollout (the derived --global-batch-size: every sample of the rollout)
    "lr": 3e-5,
    "use_tis": True,
    "micro_batch_size": 128,
    "update_weight_transfer_mode": "disk",
}

RECIPE = Recipe(
    name="agent_calculator",
    description=(__doc__ or "").split("\n\n")[0],
    defaults=DEFAULTS,
    build=quickstart.build,
    options=Options,
    prompts=quickstart.prompts,
    eval_prompts=quickstart.eval_prompts,
    prepare=prepare,
    plan=plan,
    checkpoints_in_run_dir=True,
)


def cli(argv: Sequence[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    main(RECIPE, argv)


if __name__ == "__main__":
    cli()
