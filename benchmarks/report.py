"""Write docs/benchmarks.md (and docs/images/bench_*.png) from the JSON results in bench-results/.

    python -m benchmarks.report [--results bench-results] [--output docs/benchmarks.md]

The last step of `nox -s bench`. Every figure in the page comes from one JSON file written by one
benchmark run (`python -m benchmarks.<name> --output bench-results/<name>.json`); a missing file gives
a "not run" line instead of a section. Nothing here measures anything.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
from pathlib import Path
from typing import Any

IMAGES = "images"


def _load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def machine_section() -> list[str]:
    return [
        "## Machine",
        "",
        f"- CPU: {_cpu_model()}, {os.cpu_count()} logical CPUs visible (shared with other work: wall-clock",
        "  figures carry that noise; virtual-time figures do not)",
        f"- OS: {platform.platform()}; Python {platform.python_version()}; no GPU",
        f"- generated: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M UTC} by `python -m benchmarks.report`",
        "",
    ]


def pipeline_section(d: dict[str, Any], images: Path) -> list[str]:
    cases = d["cases"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    xs = range(len(cases))
    for k, (key, label) in enumerate(
        [
            ("ideal_bound_s", "ideal bound"),
            ("async_step_s", "miles_aio async"),
            ("sync_step_s", "synchronous"),
        ]
    ):
        ax.bar([x + (k - 1) * 0.27 for x in xs], [c[key] for c in cases], width=0.27, label=label)
    ax.set_xticks(list(xs), [c["case"] for c in cases])
    ax.set_ylabel("seconds per step (virtual time)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(images / "bench_pipeline.png", dpi=110)
    plt.close(fig)
    s = d["setup"]
    lines = [
        "## Pipeline: async vs sync, and vs the ideal bound (`benchmarks.pipeline`)",
        "",
        f"Real controller on virtual time; fake engine (lognormal latency p50 {s['latency_p50_s']} s, p99 "
        f"{s['latency_p99_s']} s), fake trainer; {s['groups_per_step']} groups × {s['samples_per_group']} "
        f"samples per step, {s['steps']} steps (first 3 excluded).",
        "",
        "| case | train s | ideal bound s | async s | sync s | async / bound | speedup over sync |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        lines.append(
            f"| {c['case']} | {c['train_step_s']:.3f} | {c['ideal_bound_s']:.3f} | {c['async_step_s']:.3f} | "
            f"{c['sync_step_s']:.3f} | {c['async_over_bound']:.3f} | {c['speedup_over_sync']:.2f}× |"
        )
    o = d.get("controller_overhead_real_time", {})
    if o:
        g, n = o["groups_per_s"], o["samples_per_s"]
        lines += [
            "",
            f"Controller overhead (real time, zero-latency fakes): {g:.0f} groups/s, {n:.0f} samples/s.",
        ]
    return [*lines, "", f"![pipeline]({IMAGES}/bench_pipeline.png)", ""]


def client_section(d: dict[str, Any]) -> list[str]:
    lines = [
        "## HTTP client vs bare aiohttp (`benchmarks.client`)",
        "",
        "Zero-work SGLang stub server on loopback; best of interleaved rounds. Ratio = SGLangClient req/s ÷ "
        f"bare aiohttp req/s (target ≥ {d.get('target_ratio', 0.9)}).",
        "",
        "| in flight | aiohttp req/s | SGLangClient req/s | ratio | client on httpcore: ratio | "
        "client CPU µs per request: aiohttp / SGLangClient |",
        "|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        cpu = f"{r['aiohttp_cpu_us']:.0f} / {r['SGLangClient_cpu_us']:.0f}" if "aiohttp_cpu_us" in r else "—"
        lines.append(
            f"| {r['in_flight']} | {r['aiohttp_rps']:.0f} | {r['SGLangClient_rps']:.0f} | {r['ratio']:.2f} | "
            f"{r['ratio_httpcore']:.2f} | {cpu} |"
        )
    return [*lines, ""]


def _engine_target(c: dict[str, Any], targets: dict[str, Any]) -> str:
    t = targets[c["mode"]]
    if c["batch"] < t["min_batch"]:
        return "—"
    return f"{'met' if c['ratio'] >= t['ratio'] else 'missed'} (≥ {t['ratio']:.1f}×)"


def _engine_code(d: dict[str, Any]) -> str:
    code = d.get("code") or {}
    if not code.get("commit"):
        return ""
    edited = " with local edits to `miles_aio/engine`" if code.get("engine_edited") else ""
    return f" Engine code: commit {code['commit'][:7]}{edited}."


def engine_section(d: dict[str, Any]) -> list[str]:
    m, targets, cells = d["mixed"], d["targets"], d["cells"]
    eq, mx = targets["equal"], targets["mixed"]
    lines = [
        "## Embedded CPU engine vs transformers `generate` (`benchmarks.engine`)",
        "",
        f"Model: {d['model']}; {d['num_threads']} thread(s) on both sides: one engine process over "
        "HTTP vs `model.generate` (KV cache on, left padding with an "
        "attention mask) in the benchmark process while the engine is idle, same weights. Both sample at "
        "temperature 1 from the full distribution and never stop early. Tokens/s = useful generated tokens "
        f"/ wall time of the batch, prefill included; median of {d['repeats']} runs per side, engine and "
        "HF interleaved." + _engine_code(d),
        "",
        f"Targets: engine / HF ≥ {eq['ratio']:.1f}× at every batch size with equal lengths; "
        f"≥ {mx['ratio']:.1f}× at batch ≥ {mx['min_batch']} with mixed lengths.",
        "",
    ]
    for mode, title in (
        ("equal", f"Equal lengths: every request generates {d['new_tokens']} tokens."),
        (
            "mixed",
            f"Mixed lengths (RL-like long tail): {m.get('waves', 1)} × B requests per cell, lengths "
            f"lognormal, p50 {m['p50']:g}, p99 {m['p99']:g}, capped at {m['cap']} (seed {m['seed']}), at "
            "most B in flight, as a rollout pool sends them: the engine decodes each request to its own "
            "length and takes the next as soon as one finishes; HF runs consecutive static batches of B, "
            "each until its longest member is done (HF computed = B × longest, per batch); both are "
            "credited with the useful tokens only.",
        ),
    ):
        rows = [c for c in cells if c["mode"] == mode]
        if not rows:
            continue
        lines += [
            title,
            "",
            "| prompt | batch | useful tokens | HF computed | engine tok/s | HF tok/s | engine / HF "
            "| target |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {c['prompt_len']} | {c['batch']} | {c['useful_tokens']} | {c['hf_computed_tokens']} | "
            f"{c['engine_tokens_per_s']:.0f} | {c['hf_tokens_per_s']:.0f} | {c['ratio']:.2f}× | "
            f"{_engine_target(c, targets)} |"
            for c in rows
        ]
        lines.append("")
    judged = [c for c in cells if c["batch"] >= targets[c["mode"]]["min_batch"]]
    met = [c for c in judged if c["ratio"] >= targets[c["mode"]]["ratio"]]
    named = ", ".join(f"{c['mode']} prompt {c['prompt_len']} batch {c['batch']}" for c in met) or "none"
    lines += [f"Cells meeting their target today: {len(met)} of {len(judged)} ({named}).", ""]
    return lines


def group_prefill_section(d: dict[str, Any]) -> list[str]:
    med = d["median_s"]
    return [
        "## A group's prompt prefilled once (`benchmarks.group_prefill`)",
        "",
        f"The embedded engine's scheduler and runner in one process: batches of {d['groups']} random "
        f"{d['prompt_len']}-token prompts × {d['n']} samples × {d['new_tokens']} new tokens, the in-batch "
        "sharing threshold alternating between SGLang's 32 (each sample prefills its prompt) and the "
        "embedded engine's 2 (one sample prefills it, the others start from its cached KV a step later); "
        f"median of {d['repeats']} batches each.",
        "",
        "| threshold | ms per batch |",
        "|---|---|",
        *(f"| {name} | {s * 1000:.1f} |" for name, s in med.items()),
        "",
        f"Ratio embedded / sglang: {d['ratio']:.2f}.",
        "",
    ]


_SENT_TO = {"source": "group's first rank", "every": "every rank"}  # TP 1: every rank is its group


def trainer_data_section(d: dict[str, Any]) -> list[str]:
    a = d["args"]
    lines = [
        "## The trainer's data path at 8 and 64 ranks (`benchmarks.trainer_data`)",
        "",
        f"The real `TrainerActor` sending {a['samples']} samples of {a['prompt_len']} + {a['response_len']} "
        "tokens per step to simulated ranks (threads of one child process, on this machine's cores) that "
        "decode their shard and answer at once; ranks × TP, the ranks of a TP group getting the same shard. "
        "Medians over the steps after the first. prep = sharding and encoding, before the first byte goes "
        "out; first / last = until the first / last rank holds its whole shard.",
        "",
        "| ranks | TP | DP | sent to | MB per step | MB per rank | controller CPU s | prep s | first s "
        "| last s | step s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["layouts"]:
        sent_to = _SENT_TO["every" if r["tp"] == 1 else r["send"]]
        lines.append(
            f"| {r['ranks']} | {r['tp']} | {r['dp']} | {sent_to} | {r['bytes'] / 1e6:.1f} | "
            f"{r['bytes_per_rank'] / 1e6:.2f} | "
            f"{r['cpu_s']:.3f} | {r['prepare_s']:.3f} | {r['first_rank_s']:.3f} | {r['last_rank_s']:.3f} | "
            f"{r['step_s']:.3f} |"
        )
    return [*lines, ""]


def weight_sync_section(d: dict[str, Any]) -> list[str]:
    lines = [
        "## Weight-sync cost (`benchmarks.weight_sync`)",
        "",
        "One CPU trainer rank → one embedded engine; median seconds per sync. Disk ratio = disk sync ÷ raw "
        "safetensors write + read of the same tensors.",
        "",
        "| model | params | MiB | broadcast s | disk s | disk ratio | trainer tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in d["results"]:
        lines.append(
            f"| {r['hidden']}×{r['layers']} | {r['params']} | {r['mbytes']:.1f} | {r['broadcast_s']:.3f} | "
            f"{r['disk_s']:.3f} | {r['disk_ratio']:.1f} | {r['trainer_tokens_per_s']:.0f} |"
        )
    return [*lines, ""]


def soak_section(d: dict[str, Any]) -> list[str]:
    lag, rss = d["loop_lag_ms"], d["rss_mib"]
    return [
        "## Soak (`benchmarks.soak`)",
        "",
        f"{d['max_in_flight_requests']} requests in flight (real time, fake engine and trainer) for "
        f"{d['seconds']:.0f} s, {d['requests']} requests, {d['steps']} steps"
        + (
            f"; requests lasting {d['latency_s']['median']} s median, {d['latency_s']['p99']} s p99"
            if "latency_s" in d
            else ""
        )
        + ".",
        "",
        f"- event-loop lag over the whole run: p50 {lag['p50']} ms, p99 {lag['p99']} ms, max {lag['max']} ms",
        *_steady_lag(d),
        f"- resident memory: {rss['after_warmup']} MiB after warm-up → {rss['end']} MiB at the end: ratio "
        f"{rss['ratio_end_to_warmup']} (target within ±10%)"
        + (
            f"; {rss['kib_per_in_flight_request']} KiB per in-flight request"
            if "kib_per_in_flight_request" in rss
            else ""
        ),
        "",
    ]


def _steady_lag(d: dict[str, Any]) -> list[str]:
    """The soak's steady window (after the warm-up third, before the stop), when the run reports it."""
    steady, stop = d.get("loop_lag_ms_after_warmup"), d.get("stop")
    if not steady:
        return []
    lines = [
        f"- steady (after the warm-up third, before the stop): p50 {steady['p50']} ms, "
        f"p99 {steady['p99']} ms, max {steady['max']} ms; time-weighted (coordinated omission corrected) p99 "
        f"{steady.get('time_weighted', {}).get('p99', '—')} ms (target p99 < 10 ms)"
    ]
    if stop:
        lines.append(f"- the stop (cancelling every request in flight): {stop['s']} s, longest stall "
                     f"{stop['loop_lag_ms_max']} ms")  # fmt: skip
    return lines


def controller_section(d: dict[str, Any]) -> list[str]:
    """`benchmarks.controller`: one row per case (ceiling and lag in real time, scale on virtual time)."""
    lines = [
        "## The single controller at scale (`benchmarks.controller`)",
        "",
        "Real controller, the simulator's continuous-batching engines (64 running per engine in `scale`), "
        "zero-time trainer. CPU µs are the process's CPU time over the run per sample and per engine "
        "request (fake engines included); ceiling = samples/s one core sustains at that cost; "
        "*ceiling, no engine model* rows use `InstantEngine` (each request answered on the next loop pass): "
        "the controller's cost alone. See [the scale model](guide/scaling.md).",
        "",
        "| part | engines | in flight | turns | samples | CPU µs/sample | CPU µs/request | ceiling samples/s "
        "| loop lag p50 / p99 / max ms | RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["results"]:
        lag = r.get("loop_lag_ms")
        lag_cell = f"{lag['p50']} / {lag['p99']} / {lag['max']}" if lag else "(virtual time)"
        lines.append(
            f"| {_part(r)} | {r['engines']} | {r['in_flight']} | {r['turns']} | {r['samples']} "
            f"| {r['cpu_us_per_sample']} | {r['cpu_us_per_request']} | {r['ceiling_samples_per_s']} "
            f"| {lag_cell} | {r['rss_mib']['peak_step']} |"
        )
    return [*lines, "", "![controller](images/controller.png)", ""]


def _part(r: dict[str, Any]) -> str:
    return f"{r['part']}, no engine model" if r.get("engine") == "instant" else str(r["part"])


def _ratios(s: dict[str, Any]) -> str:
    return (
        f"median **{s['median']:.3f}** (min {s['min']:.3f}, max {s['max']:.3f}; all: "
        + ", ".join(f"{r:.3f}" for r in s["ratios"])
        + ")"
    )


def simulate_section(d: dict[str, Any]) -> list[str]:
    c, setup = d["calibration"], d["setup"]
    lines = [
        "## Simulator accuracy (`benchmarks.simulate --validate`)",
        "",
        f"{setup['repeats']} repeats, each a real run ({setup['steps']} steps, "
        f"{setup['groups_per_step']} groups × {setup['samples_per_group']} samples, ≤ "
        f"{setup['max_response_len']} tokens) on a fresh embedded engine and real trainer rank, then "
        f"{setup['rounds']} rounds of engine calibration followed by the rollout-alone checks "
        f"({setup['rollout_groups']} groups through the real pool and limiter). The "
        "simulator is calibrated only from quantities measured apart from what it predicts: the engine's "
        "decode-step time and engine time per request start vs requests in flight, from closed-loop loads "
        f"(concurrency {', '.join(map(str, setup['calibration_concurrency']))}; mean lengths "
        f"{' and '.join(map(str, setup['calibration_lengths']))} tokens, i.e. 0.5 and 1.5 × the run's mean "
        "response length, each varied ±50%; each finished request "
        "replaced at once, so arrivals are staggered as in a rollout), fitted so the simulator reproduces "
        "those loads; response lengths, trainer seconds per token and weight-sync seconds from the run's "
        "own `perf/*` metrics.",
        "",
        f"- step time, predicted / measured: {_ratios(d['step_time_ratio'])} (target within 10%)",
        *[
            f"- rollout alone with {b} in flight, predicted / measured: {_ratios(s)}"
            for b, s in d["rollout_ratio_by_in_flight"].items()
        ],
        "",
        "The repeat with the median step-time ratio:",
        "",
        "- engine decode step (ms) by running requests: "
        + ", ".join(f"{k}: {v * 1e3:.2f}" for k, v in c["engine_per_token_s_vs_concurrency"].items())
        + "; engine time per request start (ms; prefill, HTTP handling, prefix-cache lookup): "
        + ", ".join(f"{k}: {v * 1e3:.2f}" for k, v in c["engine_start_s_vs_concurrency"].items())
        + f" (the calibration loads reproduced within {c['engine_calibration_max_error']:.1%})",
        f"- trainer: {c['trainer_step_s']:.3f} s + {c['trainer_per_token_s'] * 1e3:.3f} ms/token; "
        f"weight sync {c['weight_sync_s']:.3f} s; mean response {c['mean_response_len']:.1f} tokens",
        f"- step time measured {d['measured_step_time_s']:.3f} s, predicted "
        f"{d['predicted_step_time_s']:.3f} s; trainer idle ratio measured "
        f"{d['measured_trainer_idle_ratio']:.3f}, predicted {d['predicted_trainer_idle_ratio']:.3f}",
        "",
        "Caveats: on this CPU the tiny model's trainer step dominates (the run is train-bound, and the "
        "trainer runs several times slower while the engine decodes, both sharing 2 cores), so the step "
        "time mostly checks the pipeline overlap and the trainer/sync calibration, which come from the same "
        "run; the rollout-alone checks test the engine model. A single rollout-alone measurement drifts by "
        "up to ±30% within seconds on this machine, hence one ratio per round and the median. With 64 in "
        "flight the model tends to be pessimistic: that check is short (two waves of 64 requests, the "
        "first arriving all at once), unlike the steady staggered traffic the engine time per request is "
        "calibrated on; this is not explained further yet.",
        "",
    ]
    return lines


def tune_section(d: dict[str, Any], images: Path) -> list[str]:
    from benchmarks.tune import plot

    rows, front, rec = d["runs"], d["pareto_front"], d["recommended"]
    plot(rows, front, rec, images / "bench_tune.png")
    b = d["base"]
    lines = [
        "## Tuner (`benchmarks.tune`)",
        "",
        f"{len(rows)} simulated runs of {d['steps']} steps: workload {b['rollout_batch_size']} groups × "
        f"{b['n_samples_per_prompt']} samples, lengths lognormal p50 {b['p50_tokens']:.0f} / p99 "
        f"{b['p99_tokens']:.0f} tokens, engine {b['base_per_token_s']} s + {b['slope_per_token_s']} s × "
        f"running per token, ≤ {b['max_running']} running, trainer {b['train_step_s']} s/step + "
        f"{b['sync_s']} s sync.",
        "",
        "Pareto front (throughput vs mean staleness of trained groups):",
        "",
        "| samples/s | mean staleness | in-flight | buffer factor | admission K | weight staleness |",
        "|---|---|---|---|---|---|",
    ]
    for i in front:
        r = rows[i]
        mark = " **(recommended)**" if i == rec else ""
        lines.append(
            f"| {r['samples_per_s']:.2f}{mark} | {r['staleness_mean']:.2f} | "
            f"{r['async_max_concurrent_samples']} | {r['async_data_buffer_capacity_factor']:g} | "
            f"{r['max_admission_staleness']} | "
            f"{r['max_weight_staleness']} |"
        )
    fast = rows[d["fastest"]]
    lines += [
        "",
        f"Recommended / fastest throughput = {rows[rec]['samples_per_s'] / fast['samples_per_s']:.3f}, "
        f"at mean staleness {rows[rec]['staleness_mean']:.2f} vs {fast['staleness_mean']:.2f}.",
        "",
        f"![tuner]({IMAGES}/bench_tune.png)",
        "",
    ]
    if "adaptive" in d:
        lines += adaptive_section(d["adaptive"], images)
    return lines


def adaptive_section(a: dict[str, Any], images: Path) -> list[str]:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.3))
    fixed = a["fixed_samples_per_s"]
    ax1.bar(list(fixed), list(fixed.values()), color="tab:blue", label="fixed")
    ax1.axhline(a["auto_samples_per_s"], color="tab:red", label="auto")
    ax1.set_xlabel("--async-max-concurrent-samples")
    ax1.set_ylabel("samples/s")
    ax1.legend(fontsize=8)
    ax2.plot(a["auto_limit_per_step"], marker=".")
    ax2.set_xlabel("step")
    ax2.set_ylabel("auto in-flight bound")
    fig.tight_layout()
    fig.savefig(images / "bench_adaptive.png", dpi=110)
    plt.close(fig)
    return [
        "## Adaptive concurrency (`--async-max-concurrent-samples auto`, in the simulator)",
        "",
        f"Same workload, {a['steps']} steps: auto {a['auto_samples_per_s']:.2f} samples/s vs the best fixed "
        f"bound ({a['best_fixed']}) {a['best_fixed_samples_per_s']:.2f}: **auto / best fixed = "
        f"{a['auto_over_best_fixed']:.3f}** (target ≥ 0.9). Mean staleness with auto: "
        f"{a['auto_staleness_mean']:.2f}.",
        "",
        f"![adaptive]({IMAGES}/bench_adaptive.png)",
        "",
    ]


def _target(r: dict[str, Any], t: dict[str, Any]) -> str:
    ok = r["latency"] <= t["latency_ratio_max"] and r["throughput"] >= t["throughput_ratio_min"]
    return "met" if ok else "missed"


def _agent_sessions_table(d: dict[str, Any], cells: list[dict[str, Any]], *, targets: bool) -> list[str]:
    t = d["targets"]
    lines = [
        "| C | turns | side | p50 ms | p99 ms | turns/s | p50 ÷ direct | p99 ÷ direct | turns/s ÷ direct "
        f"| per turn ÷ direct |{' target |' if targets else ''}",
        f"|---|---|---|---|---|---|---|---|---|---|{'---|' if targets else ''}",
    ]
    labels = {"agent": "openai agent", "http": "bare HTTP", "direct": "direct"}
    for c in cells:
        for side, label in labels.items():
            v, r = c[side], c["ratios"].get(side)
            tail = (
                f"{r['latency']:.2f}× | {r['p99']:.2f}× | {r['throughput']:.2f}× | {r['paired']:.2f}×"
                if r
                else "— | — | — | —"
            )
            if targets:
                tail += f" | {_target(r, t)}" if r else " | —"
            lines.append(
                f"| {c['concurrency']} | {c['turns']} | {label} | {v['p50_ms']:.2f} | {v['p99_ms']:.2f} | "
                f"{v['turns_per_s']:.0f} | {tail} |"
            )
    return lines


def agent_sessions_section(d: dict[str, Any]) -> list[str]:
    t = d["targets"]
    lo, hi = d["reply_tokens"]
    load = d.get("load_avg")
    lines = [
        "## Agent sessions: the session endpoint's overhead per turn (`benchmarks.agent_sessions`)",
        "",
        f"One embedded engine process serving a {d['model']}, behind the "
        "`EngineRouter` and the rollout limiter; the session server in the benchmark process, as in a run. "
        f"Conversations of {d['turns']} user turns, C of them in flight; every reply of a conversation is "
        f"exactly as long on every side (`ignore_eos`). Sides: **openai agent**: the official "
        "`openai.AsyncOpenAI` client (in the controller's process, as `--custom-agent-function-path` agents "
        "run; one shared connection pool) against the endpoint: its own CPU is the agent's (user code), and "
        "it is counted; **bare HTTP**: the same JSON requests from a bare aiohttp client: the endpoint's "
        "overhead alone; **direct**: the same token ids the session built, turn by turn, straight to "
        "`ctx.engine.generate`. Prefix cache flushed before every measurement; the sides take turns over "
        f"{d['repeats']} rounds and each ratio (side ÷ direct) is the median of the per-round ratios. "
        "Latency is per turn; *per turn ÷ direct* (not a target) is the median over turns of a turn's "
        "latency ÷ the same turn's direct latency, which the mix of reply lengths does not move as it moves "
        "the p50 of a few dozen turns.",
        "",
        f"Targets: p50 latency ≤ {t['latency_ratio_max']}× direct, turns/s ≥ {t['throughput_ratio_min']}× "
        "direct.",
        "",
        f"**Realistic agent turns** (the targets apply): replies of {lo} to {hi} tokens, spread over the "
        "conversations.",
        "",
        *_agent_sessions_table(d, d["cells"], targets=True),
    ]
    if d.get("short"):
        m = d["short"]["max_tokens"]
        lines += [
            "",
            f"**Adversarial: {m}-token replies.** The engine does almost nothing per turn, so the endpoint's "
            "fixed cost per turn (HTTP, chat template, tokenizer) is as large as it gets next to the "
            "engine's; at C = 256 on 2 CPUs that cost is also taken from the engine process's CPU. Reported "
            "for what it shows, not held to the targets.",
            "",
            *_agent_sessions_table(d, d["short"]["cells"], targets=False),
        ]
    lines += [
        "",
        "Without the engine (realistic reply lengths): CPU µs per turn of the benchmark process, which "
        "serves the endpoint over a fake engine that answers at once, while the same openai agents run in a "
        "child process (the lowest of the interleaved runs). Floor: a bare aiohttp handler on the same route "
        "answering a canned completion of the same size; session = endpoint − floor (history matching, two "
        "template renders, tokenizing the appended text, detokenizing the reply, the answer); direct: one "
        "`ctx.engine.generate` call on the same fake; agents: the openai client's own CPU per turn, in the "
        "child.",
        "",
        "| C | endpoint µs | endpoint turns/s | floor µs | session µs | direct µs | openai agent µs |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {c['concurrency']} | {c['endpoint_cpu_us_per_turn']:.0f} | {c['endpoint_turns_per_s']:.0f} | "
        f"{c['floor_cpu_us_per_turn']:.0f} | {c['session_cpu_us_per_turn']:.0f} | "
        f"{c['direct_cpu_us_per_turn']:.1f} | {c['agent_cpu_us_per_turn']:.0f} |"
        for c in d["no_engine"]
    ]
    if d["no_engine"]:
        x = [c["agent_cpu_us_per_turn"] / c["endpoint_cpu_us_per_turn"] for c in d["no_engine"]]
        lines += [
            "",
            f"Reading: the openai client's own CPU per turn is {min(x):.1f}–{max(x):.1f}× the endpoint's, "
            "and it runs in the controller's process and event loop, next to the endpoint: it is most of the "
            "openai agent's overhead (bare HTTP shows the endpoint's own). On this 2-CPU machine the engine "
            "process and the controller share the cores, so at high concurrency every µs of controller CPU "
            "per turn is taken from the engine's throughput.",
        ]
    if load:
        lines += [
            "",
            f"Load average (1/5/15 min) at the end of the run: {load[0]} / {load[1]} / {load[2]}, on "
            f"{d['machine']['cpus']} CPUs shared with other work: at C = 256 the openai agent's own CPU "
            "competes with the engine for the cores, so its ratios there move from run to run with the "
            "machine's other load more than any other figure here.",
        ]
    return [*lines, ""]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=Path("bench-results"))
    p.add_argument("--output", type=Path, default=Path("docs/benchmarks.md"))
    args = p.parse_args()
    images = args.output.parent / IMAGES
    images.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Benchmarks",
        "",
        "Generated by `nox -s bench` (`python -m benchmarks.report` from `bench-results/*.json`); do not",
        "edit by hand. Each figure is measured in one run of the named benchmark on the machine below.",
        "",
        *machine_section(),
    ]
    sections = [
        ("pipeline", lambda d: pipeline_section(d, images)),
        ("client", client_section),
        ("engine", engine_section),
        ("group_prefill", group_prefill_section),
        ("weight_sync", weight_sync_section),
        ("trainer_data", trainer_data_section),
        ("soak", soak_section),
        ("controller", controller_section),
        ("simulate", simulate_section),
        ("tune", lambda d: tune_section(d, images)),
        ("agent_sessions", agent_sessions_section),
    ]
    for name, section in sections:
        d = _load(args.results, name)
        lines += section(d) if d is not None else [f"## {name}", "", f"Not run (no {name}.json).", ""]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
