"""The trainer's data path at 8 and 64 ranks: bytes and seconds per step from the controller to every rank.

    python -m benchmarks.trainer_data [--layouts 8x1,8x8,64x1,64x8] [--send source,every] [--samples 256]
        [--prompt-len 512] [--response-len 1000] [--steps 4] [--output bench-results/trainer_data.json]

A layout `RxT` is R ranks in tensor-parallel groups of T (data-parallel size R / T; the ranks of one group
train on the same shard, as Megatron's do). `--send source` is what the runtime does: the controller sends
each shard to its group's first rank, which passes it on inside the group (`rank_main.share_shard`, NCCL on
GPUs; not simulated here, so not timed); `--send every` is what it did before: every rank gets its own copy
from the controller (the same for T = 1). This process runs the real `TrainerActor` (the controller's end:
`losses.shard_batch`, `protocol.encode_batch`, one framed `TrainRequest` per rank over its own authenticated
TCP connection, then every rank's reply) and calls its `train` once per step on a batch of `--samples`
samples of `--prompt-len` + `--response-len` tokens. The ranks are simulated: one child process
(`--serve-ranks`, started by this one) holds every rank as a thread that dials the controller as torchrun's
ranks do, receives and decodes its frame and its rows (`protocol.decode_batch`, what a real rank does
first), records when the last byte arrived, and answers at once: no model, so what is timed is the data path
alone. The ranks share this machine's cores with the controller; on a cluster they are other hosts, so the
figures are an upper bound on the controller's time and a lower bound on the bandwidth.

Reported per layout (median over the steps after the first): bytes sent per step (all connections, and
per rank; a group peer under `--send source` gets none), the controller's CPU seconds per step (this
process), the part of it spent before the first byte goes out (sharding and encoding, timed apart on the
same batch: "prep"), and the time from `train()`'s call to the first and the last rank holding its whole
shard, and to the last reply.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from miles_aio.trainer import losses, protocol
from miles_aio.trainer.actor import TrainerActor
from miles_aio.trainer.channel import connect
from miles_aio.trainer.config import TrainConfig
from miles_aio.trainer.protocol import (
    InitReply,
    InitRequest,
    Reply,
    ShutdownRequest,
    TrainReply,
    TrainRequest,
)
from miles_aio.types import Group, Sample, Status

_DEFAULT_LAYOUTS = "8x1,8x8,64x1,64x8"


# -- the simulated ranks (child process) ----------------------------------------------------------------
def _rank(
    host: str,
    port: int,
    secret: bytes,
    rank: int,
    source: int,
    layout: tuple[int, int],
    out: list[dict[str, Any]],
) -> None:
    """One rank: dial (retrying until the controller listens), then answer every command at once."""
    deadline = time.monotonic() + 60
    while True:
        try:
            chan = connect(host, port, secret=secret, rank=rank)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    while True:
        msg = chan.recv()
        received = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on this host
        req = protocol.decode_request(msg)
        if isinstance(req, InitRequest):
            world, tp = layout
            info = InitReply(
                dp_rank=rank // tp,
                dp_size=world // tp,
                shard_source=source,
                wrapper="sim",
                device="cpu",
                threads=1,
            )
            chan.send_message(info)
        elif isinstance(req, TrainRequest):
            rows = protocol.decode_batch(req.batch) if req.batch else []  # a group peer's: no tensors
            nbytes = sum(t.numel() * t.element_size() for t in req.batch.values())
            out.append(
                {"rank": rank, "step": req.step, "received": received, "bytes": nbytes, "rows": len(rows)}
            )
            chan.send_message(TrainReply(metrics={"rows": float(len(rows))}))
        elif isinstance(req, ShutdownRequest):
            chan.send_message(Reply())
            chan.close()
            return
        else:
            raise RuntimeError(f"the simulated rank does not handle {req.op!r}")


def serve_ranks(addr: str, ranks: int, tp: int, send: str, report: Path) -> None:
    host, port = addr.rsplit(":", 1)
    secret = bytes.fromhex(os.environ[protocol.SECRET_ENV])
    records: list[dict[str, Any]] = []
    threads = [
        threading.Thread(
            target=_rank,
            args=(host, int(port), secret, r, r - r % tp if send == "source" else r, (ranks, tp), records),
            daemon=True,
        )
        for r in range(ranks)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report.write_text(json.dumps(records))


# -- the controller's end (this process) ----------------------------------------------------------------
def make_batch(samples: int, n: int, prompt_len: int, response_len: int, seed: int = 0) -> list[Group]:
    rng = random.Random(seed)
    groups: list[Group] = []
    for g in range(samples // n):
        prompt = [rng.randrange(3, 32_000) for _ in range(prompt_len)]
        group = []
        for k in range(n):
            s = Sample(group_index=g, index=g * n + k, prompt="")
            s.tokens = prompt + [rng.randrange(3, 32_000) for _ in range(response_len)]
            s.response_length = response_len
            s.loss_mask = [1] * response_len
            s.rollout_log_probs = [-rng.random() for _ in range(response_len)]
            s.weight_versions = [0] * response_len
            s.reward = float(k % 2)
            s.status = Status.COMPLETED
            group.append(s)
        groups.append(group)
    return groups


def _prepare_s(batch: list[Group], *, dp: int) -> float:
    """What `TrainerActor.train` does before its first byte goes out (shard, then encode every shard),
    timed on its own: the same calls, on the same batch."""
    n = sum(len(g) for g in batch)
    t0 = time.perf_counter()
    step = losses.shard_batch(
        batch, estimator="grpo", std_normalization=True, reward_key=None, global_batch_size=n, dp_size=dp
    )
    for rows in step.shards:
        protocol.encode_batch(rows)
    return time.perf_counter() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def run_layout(ranks: int, tp: int, send: str, a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    secret = protocol.new_secret()
    port = _free_port()
    cfg = TrainConfig(
        hf_checkpoint=workdir,  # never read: the simulated ranks load nothing
        actor_num_gpus_per_node=ranks,
        trainer_port=port,
        trainer_heartbeat_timeout_s=0.0,
        trainer_connect_timeout_s=120.0,
    )
    report = workdir / f"ranks-{ranks}x{tp}-{send}.json"
    args = ["--serve-ranks", f"127.0.0.1:{port}", "--ranks", str(ranks), "--tp", str(tp), "--send", send]
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "benchmarks.trainer_data",
        *args,
        "--report",
        str(report),
        env={**os.environ, protocol.SECRET_ENV: secret.hex()},
    )
    batch = make_batch(a.samples, a.n, a.prompt_len, a.response_len)
    prepare = [_prepare_s(batch, dp=ranks // tp) for _ in range(max(2, a.steps))]
    calls: list[tuple[float, float, float]] = []  # (called, returned, controller CPU s)
    try:
        async with TrainerActor.open(cfg, run_dir=workdir, secret=secret, spawn=False) as actor:
            for step in range(a.steps):
                cpu0, t0 = time.process_time(), time.monotonic()
                metrics = await actor.train(step, batch)
                calls.append((t0, time.monotonic(), time.process_time() - cpu0))
                assert metrics["rows"] == a.samples // (ranks // tp), metrics  # rank 0 got a whole shard
    finally:
        async with asyncio.timeout(60):
            if await child.wait() != 0:
                raise RuntimeError(f"the simulated ranks exited {child.returncode}")
    records = json.loads(report.read_text())
    steps = []
    for step, (t0, t1, cpu) in enumerate(calls):
        mine = [r for r in records if r["step"] == step]
        assert len(mine) == ranks, (step, len(mine))
        total = sum(r["bytes"] for r in mine)
        mine = [r for r in mine if r["rows"]]  # the ranks the controller sent a shard to
        steps.append(
            {
                "bytes": total,
                "bytes_per_rank": total / ranks,
                "cpu_s": cpu,
                "first_rank_s": min(r["received"] for r in mine) - t0,
                "last_rank_s": max(r["received"] for r in mine) - t0,
                "step_s": t1 - t0,
            }
        )
    kept = steps[1:] or steps  # the first step warms the allocator and the sockets
    med = {k: statistics.median(s[k] for s in kept) for k in kept[0]}
    med["prepare_s"] = statistics.median(prepare[1:])
    return {
        "ranks": ranks,
        "tp": tp,
        "dp": ranks // tp,
        "send": send,
        **med,
        "steps": steps,
    }


def _layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        r, _, t = item.partition("x")
        ranks, tp = int(r), int(t or 1)
        if ranks < 1 or tp < 1 or ranks % tp:
            raise SystemExit(f"--layouts: {item!r} is not RANKSxTP with TP dividing RANKS")
        out.append((ranks, tp))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--layouts", default=_DEFAULT_LAYOUTS, help="ranks x tensor-parallel size, comma separated"
    )
    p.add_argument("--send", default="source,every", help="source (the runtime's) and/or every (see above)")
    p.add_argument("--samples", type=int, default=256, help="samples per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=1000)
    p.add_argument("--steps", type=int, default=4, help="train() calls per layout (the first is left out)")
    p.add_argument("--output", type=Path, default=None, help="write the results here (JSON)")
    p.add_argument("--serve-ranks", metavar="HOST:PORT", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, help=argparse.SUPPRESS)
    p.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve_ranks:
        serve_ranks(a.serve_ranks, a.ranks, a.tp, a.send, a.report)
        return
    layouts = _layouts(a.layouts)
    sends = a.send.split(",")
    if not set(sends) <= {"source", "every"}:
        raise SystemExit(f"--send: {a.send!r} is not a list of source, every")
    for ranks, tp in layouts:
        if a.samples % a.n or a.samples % (ranks // tp):
            raise SystemExit(
                f"--samples {a.samples} must split into groups of --n and over {ranks // tp} dp ranks"
            )
    results = []
    print(f"batch: {a.samples} samples x ({a.prompt_len} prompt + {a.response_len} response) tokens")
    print(
        f"{'ranks':>5} {'tp':>3} {'dp':>3} {'send':>6} {'MB/step':>8} {'MB/rank':>8} {'ctl CPU s':>9} "
        f"{'prep s':>7} {'first s':>8} {'last s':>8} {'step s':>8}"
    )
    with tempfile.TemporaryDirectory(prefix="trainer-data-") as tmp:
        for (ranks, tp), send in ((lay, m) for lay in layouts for m in sends):
            if send == "every" and tp == 1 and "source" in sends:
                continue  # the same sends
            r = asyncio.run(run_layout(ranks, tp, send, a, Path(tmp)))
            results.append(r)
            mb = f"{r['bytes'] / 1e6:>8.1f} {r['bytes_per_rank'] / 1e6:>8.2f}"
            cpu = f"{r['cpu_s']:>9.3f} {r['prepare_s']:>7.3f}"
            times = f"{r['first_rank_s']:>8.3f} {r['last_rank_s']:>8.3f} {r['step_s']:>8.3f}"
            print(f"{ranks:>5} {tp:>3} {r['dp']:>3} {send:>6} {mb} {cpu} {times}", flush=True)
    if a.output is not None:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        args = {
            k: v
            for k, v in vars(a).items()
            if k in ("layouts", "send", "samples", "n", "prompt_len", "response_len", "steps")
        }
        a.output.write_text(json.dumps({"args": args, "layouts": results}, indent=1))


if __name__ == "__main__":
    main()
