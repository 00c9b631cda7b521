"""A trainer rank: `python -m miles_aio.trainer.rank_main` (spawned by `TrainerActor`, or under torchrun).

A plain synchronous command loop, no asyncio. It dials the controller (`MILES_AIO_CONTROLLER_ADDR` =
host:port, secret in `MILES_AIO_TRAINER_SECRET`, identity from RANK/WORLD_SIZE/LOCAL_RANK and the
rendezvous from MASTER_ADDR/MASTER_PORT, as torchrun sets them), proves the secret, then repeats:
block on the next command → run it (collectives with the other ranks inside) → reply `ok` with results.

Consumes: `protocol.AnyRequest`, each frame decoded (and type-checked) by `protocol.decode_request`:
`InitRequest` (the TrainConfig) once, then train / logprobs / get_weights / weight_meta / save_hf /
bcast_init / bcast_bucket / bcast_destroy / save / load / remove_hf, and `ShutdownRequest`;
`RankWorker.handle` matches on the union (mypy checks that every command is handled and answered with its
own reply type). Produces: one reply per command (rank 0's carry the results the controller uses; every
rank replies so the controller knows all are done), and from `init` on a `protocol.Heartbeat` every
--trainer-heartbeat-timeout-s / 6 from a thread of its own, even inside a long command. Waits for: the
controller's next frame, and the other ranks inside collectives.

Failure: any exception is sent to the controller as a `protocol.RankFailure` (with the traceback) and the
process exits 1; EOF from the controller (it died) exits 3; if spawned by the actor, the rank also dies
with it (PR_SET_PDEATHSIG), so no rank outlives a killed controller.

Rendezvous: ranks the actor spawned (all on this machine; it sets `MILES_AIO_LOCAL_RENDEZVOUS=1` and a
loopback MASTER_ADDR) build the default group on a TCPStore whose listening socket rank 0 binds to
MASTER_ADDR itself: torch's own store listens on every interface, and a store takes unauthenticated
writes. Gloo's pair sockets follow (`GLOO_SOCKET_IFNAME=lo` unless set). torchrun's ranks (multi-node)
rendezvous as torch does, at their explicit MASTER_ADDR.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import assert_never

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it, untyped

from miles_aio._durable import fsync_dir, fsync_path, write_file_atomic
from miles_aio.trainer import losses, protocol
from miles_aio.trainer.backend import HFBackend, ModelBackend, check_param_groups
from miles_aio.trainer.channel import BlockingChannel, connect
from miles_aio.trainer.config import TrainConfig
from miles_aio.trainer.protocol import (
    AnyRequest,
    BcastBucketRequest,
    BcastDestroyRequest,
    BcastInitRequest,
    BcastReply,
    GetWeightsRequest,
    InitReply,
    InitRequest,
    LoadReply,
    LoadRequest,
    LogprobsReply,
    LogprobsRequest,
    RemoveHFRequest,
    Reply,
    SaveHFRequest,
    SaveRequest,
    ShutdownRequest,
    TrainReply,
    TrainRequest,
    WeightMetaReply,
    WeightMetaRequest,
    WeightsReply,
    reply_to,
)
from miles_aio.trainer.vllm_transfer import VLLMWeightGroup

__all__ = ["RankWorker", "main"]

CONTROLLER_ENV = "MILES_AIO_CONTROLLER_ADDR"
PARENT_ENV = "MILES_AIO_PARENT_PID"
THREADS_ENV = "MILES_AIO_RANK_THREADS"
LOCAL_RENDEZVOUS_ENV = "MILES_AIO_LOCAL_RENDEZVOUS"
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


class RankWorker:
    """Executes the controller's commands on this rank (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, *, rank: int, world: int, local_rank: int) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_rank)
        self.device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        if not dist.is_initialized():
            backend, timeout = "nccl" if cuda else "gloo", timedelta(seconds=cfg.dist_timeout_s)
            if loopback_rendezvous(os.environ):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pair listeners: loopback too
                store = _loopback_store(rank, world, timeout)
                dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
            else:
                dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        torch.manual_seed(cfg.seed)
        self.backend: ModelBackend
        if cfg.train_backend == "megatron":
            from miles_aio.trainer.megatron_backend import MegatronBackend

            self.backend = MegatronBackend(cfg, device=self.device, world=world)
        else:
            self.backend = HFBackend(cfg, device=self.device, world=world)
        names = [f.name for f in dataclasses.fields(losses.LossSettings)]
        self.settings = losses.LossSettings(**{n: getattr(cfg, n) for n in names})
        self.weight_group: dist.ProcessGroup | VLLMWeightGroup | None = None
        self.optimizer_steps = 0

    def info(self) -> InitReply:
        be = self.backend
        return InitReply(
            dp_rank=be.dp_rank,
            dp_size=be.dp_size,
            shard_source=be.shard_source,
            wrapper=be.wrapper,
            device=str(self.device),
            threads=torch.get_num_threads(),
        )

    def handle(self, req: AnyRequest) -> Reply:
        """Run one command (after `init`); `reply_to` has mypy check each reply type against the request's."""
        match req:
            case TrainRequest():
                return reply_to(req, self.train(req))
            case LogprobsRequest():
                return reply_to(req, self.logprobs(req))
            case GetWeightsRequest():
                return reply_to(req, self.get_weights(req))
            case WeightMetaRequest():
                return reply_to(req, self.weight_meta(req))
            case SaveHFRequest():
                return reply_to(req, self.save_hf(req))
            case BcastInitRequest():
                return reply_to(req, self.bcast_init(req))
            case BcastBucketRequest():
                return reply_to(req, self.bcast_bucket(req))
            case BcastDestroyRequest():
                return reply_to(req, self.bcast_destroy(req))
            case SaveRequest():
                return reply_to(req, self.save(req))
            case LoadRequest():
                return reply_to(req, self.load(req))
            case RemoveHFRequest():
                return reply_to(req, self.remove_hf(req))
            case InitRequest() | ShutdownRequest():  # the command loop's own (`_serve`)
                raise ValueError(f"command {req.op!r} is not the worker's")
            case _:
                assert_never(req)

    # -- training -----------------------------------------------------------------------------------------
    def _lockstep(self, per_step: list[list[losses.MicroBatch]]) -> list[list[losses.MicroBatch]]:
        """Pad every optimizer step to the most micro-batches any rank has: FSDP2 all-gathers in each
        forward, so all ranks must run the same number of them (the filler trains nothing)."""
        counts = torch.tensor([len(m) for m in per_step], dtype=torch.int64, device=self.device)  # nccl: GPU
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        return [
            mbs + [mbs[-1].masked_out()] * (int(n) - len(mbs))
            for mbs, n in zip(per_step, counts, strict=True)
        ]

    def _logps(self, mbs: list[losses.MicroBatch], *, ref: bool = False) -> list[torch.Tensor]:
        if (pipeline := self.backend.pipeline) is not None:  # megatron PP
            return pipeline.logps(mbs, ref=ref)
        fwd = self.backend.ref_logits if ref else self.backend.logits
        return [losses.token_log_probs(fwd(mb), mb.targets) for mb in mbs]

    def train(self, req: TrainRequest) -> TrainReply:
        cfg, be = self.cfg, self.backend
        t0 = time.monotonic()
        batch = req.batch
        if be.shard_group is not None:
            batch = share_shard(batch, group=be.shard_group, source=be.shard_source, device=self.device)
        rows = protocol.decode_batch(batch)
        num_tokens = req.num_tokens
        mbsize, max_tokens = cfg.micro_batch_size, cfg.max_tokens_per_gpu
        split = functools.partial(losses.split_micro_batches, micro_batch_size=mbsize, max_tokens=max_tokens)
        step_rows = [[r for r in rows if r.opt_step == j] for j in range(len(num_tokens))]
        per_step = [[losses.collate(g).to(self.device) for g in split(sr)] for sr in step_rows]
        per_step = self._lockstep(per_step)
        # π_old: the proximal policy = these weights before this rollout's first update (unless the
        # engine's log-probs stand in for it), and π_ref for the KL. With one optimizer step per rollout
        # every micro-batch is trained on exactly those weights, so the training forward's own log-probs
        # (detached) are π_old and a separate forward pass for them would be redundant: `None` says so.
        t_pre = time.monotonic()
        with torch.no_grad():
            ref = [self._logps(s, ref=True) for s in per_step] if cfg.needs_ref_model else None
            old: list[list[torch.Tensor | None]]
            recomputed = False
            if cfg.use_rollout_logprobs:
                old = [[mb.rollout_logp for mb in s] for s in per_step]
            elif len(per_step) == 1 and not self._advantages_need_old(ref):
                old = [[None] * len(per_step[0])]
            else:
                old, recomputed = [list(self._logps(s)) for s in per_step], True
            self._token_advantages(per_step, old, ref)
        pre_forward_s = time.monotonic() - t_pre if recomputed or ref is not None else 0.0
        sums: dict[str, float] = {}
        maxes: dict[str, float] = {}
        grad_norms: list[float] = []

        def loss_of(j: int, i: int, logits: torch.Tensor) -> torch.Tensor:
            out = losses.micro_batch_loss(
                logits,
                per_step[j][i],
                old_logp=old[j][i],
                settings=self.settings,
                num_tokens=num_tokens[j],
                ref_logp=None if ref is None else ref[j][i],
            )
            for k, v in out.sums.items():
                sums[k] = sums.get(k, 0.0) + v
            for k, v in out.maxes.items():
                maxes[k] = max(maxes.get(k, v), v)
            # DDP/FSDP average gradients over dp ranks; the loss is already a global token mean.
            return out.loss * be.dp_size

        pipeline = be.pipeline  # megatron PP: its schedule runs forward and backward
        for j, mbs in enumerate(per_step):
            be.optimizer.zero_grad(set_to_none=True)
            if pipeline is not None:
                pipeline.forward_backward(mbs, functools.partial(loss_of, j))
            else:
                for i, mb in enumerate(mbs):
                    with be.no_sync(i < len(mbs) - 1):
                        torch.autograd.backward(loss_of(j, i, be.logits(mb)))
            grad_norms.append(be.clip_grad(cfg.clip_grad))
            for group in be.optimizer.param_groups:  # the schedule is a function of the run's step count
                group["lr"] = cfg.lr_at(self.optimizer_steps, decoupled=group.get("decoupled", False))
            be.optimizer.step()
            self.optimizer_steps += 1
        metrics = self._reduce(sums, maxes)
        if pipeline is not None:  # only the last stage computed the loss; rank 0 reports it
            metrics = pipeline.share_metrics(metrics)
        wall = time.monotonic() - t0
        tokens = torch.tensor(float(sum(int(r.tokens.numel()) for r in rows)), device=self.device)
        dist.all_reduce(tokens, group=be.dp_group)
        metrics |= {
            "train/grad_norm": sum(grad_norms) / len(grad_norms),
            "train/lr": float(be.optimizer.param_groups[0]["lr"]),
            "train/optimizer_steps": float(len(per_step)),
            "perf/trainer_tokens_per_s": float(tokens) / max(wall, 1e-9),
            "perf/trainer_step_s": wall,
            "perf/trainer_pre_forward_s": pre_forward_s,
        }
        for group in be.optimizer.param_groups:
            if group.get("decoupled"):
                metrics["train/decoupled_lr"] = float(group["lr"])
        return TrainReply(metrics=metrics)

    def _advantages_need_old(self, ref: list[list[torch.Tensor]] | None) -> bool:
        """reinforce_plus_plus folds KL(π_old ‖ π_ref) into the returns before the training forward."""
        return self.cfg.advantage_estimator == "reinforce_plus_plus" and ref is not None

    def _token_advantages(
        self,
        per_step: list[list[losses.MicroBatch]],
        old: list[list[torch.Tensor | None]],
        ref: list[list[torch.Tensor]] | None,
    ) -> None:
        """Token-level advantages, in place, over the whole rollout on all data-parallel ranks:
        reinforce_plus_plus returns (the rows carry raw rewards) whitened, and --normalize-advantages."""
        cfg = self.cfg
        mbs = [mb for s in per_step for mb in s]
        whiten = cfg.normalize_advantages
        if cfg.advantage_estimator == "reinforce_plus_plus":
            flat_old = [t for s in old for t in s]
            flat_ref = [t for s in ref for t in s] if ref is not None else [None] * len(mbs)
            for mb, o, r in zip(mbs, flat_old, flat_ref, strict=True):
                assert r is None or o is not None  # `_advantages_need_old` kept π_old's forward
                kl = None if r is None or o is None else losses.kl_estimate(o, r, cfg.kl_loss_type)
                mb.advantages = losses.reinforce_pp_returns(
                    mb.advantages, mb.mask, kl=kl, kl_coef=cfg.kl_coef
                )
            whiten = True
        if not whiten:
            return

        def dp_sum(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t, group=self.backend.dp_group)
            return t

        white = losses.masked_whiten([mb.advantages for mb in mbs], [mb.mask for mb in mbs], reduce=dp_sum)
        for mb, adv in zip(mbs, white, strict=True):
            mb.advantages = adv

    def _reduce(self, sums: dict[str, float], maxes: dict[str, float]) -> dict[str, float]:
        keys, mkeys = sorted(sums), sorted(maxes)
        s = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        m = torch.tensor([maxes[k] for k in mkeys], dtype=torch.float64, device=self.device)
        if len(keys):  # none before the last pipeline stage (the loss runs there)
            dist.all_reduce(s, group=self.backend.dp_group)
        if len(mkeys):
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.backend.dp_group)
        out = losses.finalize_metrics(
            dict(zip(keys, s.tolist(), strict=True)), dict(zip(mkeys, m.tolist(), strict=True))
        )
        return {f"train/{k}": v for k, v in out.items()}

    def logprobs(self, req: LogprobsRequest) -> LogprobsReply:
        """Current-policy log-probs of each row's response tokens (tests, benchmarks, debugging)."""
        rows = protocol.decode_batch(req.batch)
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            logps = self._logps([losses.collate([row]).to(self.device) for row in rows])
        for i, (row, logp) in enumerate(zip(rows, logps, strict=True)):
            n, r = int(row.tokens.numel()), row.response_length
            out[str(i)] = logp[0, n - r - 1 : n - 1].cpu()
        return LogprobsReply(logps=out)

    # -- weights ------------------------------------------------------------------------------------------
    def _all_names(self) -> list[str]:
        return [n for n, _, _ in self.backend.weight_meta()]

    def get_weights(self, req: GetWeightsRequest) -> WeightsReply:
        tensors = self.backend.hf_tensors(self._all_names())
        return WeightsReply(weights=tensors if self.rank == 0 else {})

    def save_hf(self, req: SaveHFRequest) -> Reply:
        """Disk sync / export: rank 0 writes a complete HF model directory (atomically renamed)."""
        tensors = self.backend.hf_tensors(self._all_names())
        path = Path(req.path).absolute()
        if self.rank == 0:
            protocol.write_hf_dir(tensors, path, source=self.backend.hf_source)
            if req.keep:
                # Older snapshots go: the engines loaded the previous one before this sync started.
                protocol.prune_snapshots(path.parent, req.keep)
        return Reply()

    def weight_meta(self, req: WeightMetaRequest) -> WeightMetaReply:
        meta = self.backend.weight_meta()
        with socket.socket() as s:  # a free port for the weight-update group rank 0 will host
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return WeightMetaReply(
            names=[n for n, _, _ in meta],
            dtypes=[str(d).removeprefix("torch.") for _, d, _ in meta],
            shapes=[s for _, _, s in meta],
            master_address=req.master_address or _my_address(),
            master_port=port,
        )

    # A failed rendezvous or broadcast of the weight-update group is the engines' failure (one died or froze
    # mid-collective), not this rank's: rank 0 drops the group and replies `failed`, the controller
    # sends that push by disk instead and forms a new group with the engines present at the next one.
    def bcast_init(self, req: BcastInitRequest) -> BcastReply:
        if self.rank == 0 and req.protocol == "vllm":
            self._drop_weight_group()
            try:
                self.weight_group = VLLMWeightGroup.join(
                    master_address=req.master_address,
                    master_port=req.master_port,
                    world_size=req.world_size,
                    device=self.device,
                    timeout_s=req.timeout_s,
                )
            except Exception as exc:  # the engines did not all join: reported, the rank lives on
                return BcastReply(failed=f"{type(exc).__name__}: {exc}")
        elif self.rank == 0:
            from miles_aio.weight_broadcast import init_custom_process_group

            self._drop_weight_group()
            try:
                self.weight_group = init_custom_process_group(
                    backend=req.backend,
                    master_address=req.master_address,
                    master_port=req.master_port,
                    world_size=req.world_size,
                    group_name=req.group_name,
                    rank=0,
                    timeout=timedelta(seconds=req.timeout_s),
                )
            except Exception as exc:  # the engines did not all join: reported, the rank lives on
                return BcastReply(failed=f"{type(exc).__name__}: {exc}")
        return BcastReply()

    def bcast_bucket(self, req: BcastBucketRequest) -> BcastReply:
        names = req.names
        tensors = self.backend.hf_tensors(names)  # every rank: a collective under FSDP2 / TP
        if self.rank == 0:
            from miles_aio.weight_broadcast import broadcast_weights

            if self.weight_group is None:
                return BcastReply(failed="no weight-update group (its rendezvous or a broadcast failed)")
            dev = "cuda" if self.device.type == "cuda" else "cpu"  # nccl broadcasts from GPU memory
            try:
                pairs = ((n, tensors[n].to(dev)) for n in names)
                if isinstance(self.weight_group, VLLMWeightGroup):
                    self.weight_group.broadcast(pairs)
                else:
                    broadcast_weights(pairs, group=self.weight_group)
            except Exception as exc:  # an engine left the collective: reported, the rank lives on
                self._drop_weight_group()
                return BcastReply(failed=f"{type(exc).__name__}: {exc}")
        return BcastReply()

    def bcast_destroy(self, req: BcastDestroyRequest) -> Reply:
        """Leave the weight-update group (the set of engines changed: a new one is formed)."""
        self._drop_weight_group()
        return Reply()

    def _drop_weight_group(self) -> None:
        group, self.weight_group = self.weight_group, None
        if group is not None:
            try:
                if isinstance(group, VLLMWeightGroup):
                    group.destroy()
                else:
                    dist.destroy_process_group(group)
            except Exception as exc:  # a broken group may not tear down cleanly; it is unused from here on
                sys.stderr.write(f"rank {self.rank}: dropping the weight-update group: {exc!r}\n")

    # -- checkpoints --------------------------------------------------------------------------------------
    def save(self, req: SaveRequest) -> Reply:
        """Model (HF safetensors), optimizer (safetensors + JSON, no pickle), per-rank RNG, step."""
        d = Path(req.directory).absolute()
        tensors = self.backend.hf_tensors(self._all_names())
        optim = self.backend.optim_state()
        d.mkdir(parents=True, exist_ok=True)
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        written = [d / f"rng_rank{self.rank}.safetensors"]
        save_file(rng, str(written[0]))
        if self._optim_sharded or self.rank == 0:
            stem = self._optim_stem(d)
            protocol.save_optim_state(optim, stem)
            written += [stem.with_suffix(".safetensors"), stem.with_suffix(".json")]
        for f in written:
            fsync_path(f)
        if self.rank == 0:
            protocol.write_hf_dir(tensors, d / "model", source=self.backend.hf_source, durable=True)
            meta = {"step": req.step, "optimizer_steps": self.optimizer_steps}
            write_file_atomic(d / "trainer_state.json", json.dumps(meta).encode())
        fsync_dir(d)
        dist.barrier()  # every rank's files are written and fsynced when the reply arrives
        return Reply()

    def load(self, req: LoadRequest) -> LoadReply:
        d = Path(req.directory).absolute()
        meta = json.loads((d / "trainer_state.json").read_text())
        self.backend.load_hf_tensors(protocol.read_hf_dir(d / "model"))
        optim = protocol.load_optim_state(self._optim_stem(d))
        check_param_groups(optim["param_groups"], self.backend.optimizer.param_groups)
        self.backend.load_optim_state(optim)
        rng_file = d / f"rng_rank{self.rank}.safetensors"
        if rng_file.exists():  # a different world size keeps fresh RNG streams
            rng = load_file(str(rng_file))
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        self.optimizer_steps = int(meta["optimizer_steps"])
        return LoadReply(step=int(meta["step"]))

    @property
    def _optim_sharded(self) -> bool:
        """Megatron keeps one optimizer file per rank (TP shards); FSDP/DDP gather one full state."""
        return self.backend.optim_sharded

    def _optim_stem(self, d: Path) -> Path:
        return d / (f"optimizer_rank{self.rank}" if self._optim_sharded else "optimizer")

    def remove_hf(self, req: RemoveHFRequest) -> Reply:
        """Delete HF directories this trainer exported (retired eval snapshots), on rank 0: the controller
        never blocks its loop on (or spawns a thread for) deleting a model of many GB."""
        if self.rank == 0:
            for path in req.paths:
                protocol.remove_hf_dir(Path(path))
        return Reply()


def loopback_rendezvous(env: Mapping[str, str]) -> bool:
    """Whether this rank's default-group store must listen on loopback only: the actor spawned every
    rank on this machine (it says so) and gave a loopback MASTER_ADDR. Anything else (torchrun, an
    explicit address) rendezvouses as torch does."""
    return env.get(LOCAL_RENDEZVOUS_ENV) == "1" and env.get("MASTER_ADDR", "") in _LOOPBACK


def _loopback_store(rank: int, world: int, timeout: timedelta) -> TCPStore:
    """The default group's TCPStore at MASTER_ADDR:MASTER_PORT, its server (rank 0) listening on that
    address alone (`weight_broadcast.loopback_store`, which the weight-update group uses too)."""
    from miles_aio.weight_broadcast import loopback_store

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return loopback_store(host, port, world, is_master=rank == 0, timeout=timeout)


def _my_address() -> str:
    """This host's address as the engines should dial it (loopback when everything is local)."""
    if os.environ.get("MASTER_ADDR", "127.0.0.1") in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when the spawning controller dies, even by SIGKILL."""
    parent = os.environ.get(PARENT_ENV)
    if parent is None or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != int(parent):  # the parent died before the prctl took effect
        os._exit(3)


def _start_heartbeat(chan: BlockingChannel, timeout_s: float) -> None:
    """A daemon thread sends a `protocol.Heartbeat` every timeout/6 s, whatever the command loop is doing
    (torch releases the GIL in its kernels and collectives), so the controller tells a busy rank from a
    frozen one (SIGSTOP stops every thread). It ends with the channel. timeout 0: no heartbeat."""
    if timeout_s <= 0:
        return
    interval = timeout_s / 6

    def beat() -> None:
        while True:
            time.sleep(interval)  # a thread of its own: sleeping is all it does
            try:
                chan.send_message(protocol.Heartbeat())
            except OSError:  # the channel closed (shutdown, controller gone): nothing left to tell
                return

    threading.Thread(target=beat, name="trainer-heartbeat", daemon=True).start()


def _serve(chan: BlockingChannel, rank: int, world: int) -> int:
    worker: RankWorker | None = None
    while True:
        req = protocol.decode_request(chan.recv())
        match req:
            case ShutdownRequest():
                chan.send_message(reply_to(req, Reply()))
                return 0
            case InitRequest():
                local_rank = int(os.environ.get("LOCAL_RANK", rank))
                cfg = TrainConfig.from_json(req.config)
                _start_heartbeat(chan, cfg.trainer_heartbeat_timeout_s)  # before the (long) model load
                worker = RankWorker(cfg, rank=rank, world=world, local_rank=local_rank)
                chan.send_message(reply_to(req, worker.info()))
            case _ if worker is None:
                raise RuntimeError(f"command {req.op!r} before init")
            case _:
                chan.send_message(worker.handle(req))


def share_shard(
    batch: Mapping[str, torch.Tensor], *, group: dist.ProcessGroup, source: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """The shard that the controller sent `source` (`protocol.encode_batch`'s tensors), on every rank of
    `group`; the others arrive with none. Consumes: on `source`, its `batch`. Waits for: every rank of
    `group` (one broadcast of the fields' sizes, then one per field, on `device`: NCCL needs the GPU; the
    dtypes are `protocol.BATCH_FIELDS`'s, so nothing is pickled)."""
    fields = protocol.BATCH_FIELDS
    mine = dist.get_rank() == source
    if mine and set(batch) != set(fields):
        raise protocol.ProtocolError(f"a shard has the fields {sorted(fields)}, got {sorted(batch)}")
    sizes = torch.tensor([batch[k].numel() if mine else 0 for k in fields], dtype=torch.int64, device=device)
    dist.broadcast(sizes, src=source, group=group)
    out: dict[str, torch.Tensor] = {}
    for (name, dtype), n in zip(fields.items(), sizes.tolist(), strict=True):
        t = batch[name].to(device, dtype) if mine else torch.empty(n, dtype=dtype, device=device)
        dist.broadcast(t, src=source, group=group)
        out[name] = t.cpu()
    return out


def main() -> int:
    _die_with_parent()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded at run time
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if threads := os.environ.get(THREADS_ENV):
        torch.set_num_threads(int(threads))
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    host, _, port = os.environ.get(CONTROLLER_ENV, "").rpartition(":")
    if (secret := protocol.secret_from_env()) is None or not port:
        sys.exit(f"rank {rank}: set {CONTROLLER_ENV}=host:port and {protocol.SECRET_ENV} (hex)")
    chan = connect(host.strip("[]"), int(port), secret=secret, rank=rank)
    try:
        rc = _serve(chan, rank, world)
    except ConnectionError:
        return 3  # the controller is gone: nobody to report to
    except BaseException as exc:
        tb = traceback.format_exc()
        sys.stderr.write(f"rank {rank} failed:\n{tb}")
        with contextlib.suppress(OSError):
            chan.send_message(protocol.RankFailure(type=type(exc).__name__, message=str(exc), traceback=tb))
        # No destroy_process_group: the other ranks may sit in a collective that will never finish,
        # and the controller takes them down once it sees this report.
        return 1
    finally:
        chan.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
