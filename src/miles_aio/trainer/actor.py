"""`TrainerActor`: the controller's `Trainer`, driving W trainer rank processes over the channel.

    async with TrainerActor.open(train_cfg, run_cfg) as actor:   # spawns, authenticates, loads the model
        metrics = await actor.train(step, batch)                  # batch: the step's groups
        await actor.stage_weights(version=v)                      # disk: rank 0 writes them now
        await actor.sync_weights(engine, version=v)               # engines paused by the controller

Tasks (all in `open()`'s TaskGroup, so a failure cancels the caller's block and surfaces as
`TrainerRankError`):
  listener      accepts rank connections; each must pass the HMAC handshake (`channel`).
  watch-<r>     waits for rank r's process to exit (never polls). An exit outside shutdown fails every
                pending call; if the rank had no channel yet it raises, else its reader does.
  heartbeat-<r> from init on: fails the run with `TrainerRankError` when rank r sends no frame for
                --trainer-heartbeat-timeout-s (a thread in each rank beats every 1/6 of it, even during a
                long step, so only a frozen rank — SIGSTOP, a hung host — goes silent).
  reader-<r>    reads rank r's frames: a reply resolves the oldest pending call of that rank (replies
                come in command order), an `error` report fails every pending call with the rank's
                traceback; EOF outside shutdown raises `TrainerRankError` (exit code included).
Commands go out one at a time (`_lock`); a call waits for its replies or for the first rank failure.
Each command is a typed `protocol.Request[R]` and comes back as its `R` from every rank it went to
(`_call(protocol.TrainRequest(...))` → `dict[rank, protocol.TrainReply]`).
Every exit path (normal, error, cancellation) ends in `aclose()`: shutdown command, then SIGTERM, then
SIGKILL, run to completion even when the caller is cancelled meanwhile. No child outlives the block.

Spawned ranks run in their own session (process group), so a terminal's Ctrl-C or a scheduler's SIGTERM
to the controller's group reaches only the controller: it finishes its step and saves, which needs live
ranks, then takes them down itself. They still die with a SIGKILLed controller (`PR_SET_PDEATHSIG` in
`rank_main`, and the channel's EOF). All of them are on this machine, so their torch.distributed
rendezvous store listens on 127.0.0.1 only (`LOCAL_RENDEZVOUS_ENV`); torchrun's ranks keep their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from asyncio.subprocess import DEVNULL
from collections import deque
from collections.abc import AsyncIterator, Hashable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

import structlog
import torch

from miles_aio._aio import finish_even_if_cancelled
from miles_aio.config import RunConfig
from miles_aio.errors import ConfigError, EngineError, MilesAioError, primary_error
from miles_aio.inference.base import InferenceEngine, WeightBroadcast, WeightGroupMember
from miles_aio.trainer import losses, protocol
from miles_aio.trainer.channel import AsyncChannel, ChannelListener
from miles_aio.trainer.config import TrainConfig, check_batch_arithmetic
from miles_aio.trainer.protocol import (
    BcastBucketRequest,
    BcastDestroyRequest,
    BcastInitRequest,
    GetWeightsRequest,
    InitRequest,
    LoadRequest,
    LogprobsRequest,
    Message,
    RemoveHFRequest,
    Reply,
    Request,
    SaveHFRequest,
    SaveRequest,
    ShutdownRequest,
    TrainRequest,
    WeightMetaRequest,
)
from miles_aio.trainer.rank_main import CONTROLLER_ENV, LOCAL_RENDEZVOUS_ENV, PARENT_ENV, THREADS_ENV
from miles_aio.trainer.reward_post import RewardPostProcess
from miles_aio.types import Group

__all__ = ["TrainerActor", "TrainerRankError", "rank_threads"]

log = structlog.get_logger("miles_aio.trainer")
_TERM_GRACE_S: Final = 5.0
_EXIT_REPORT_GRACE_S: Final = 5.0


R = TypeVar("R", bound=Reply)
_Membership = tuple[int, tuple[Hashable, ...]]
"""Whom a weight-update group spans: (id of the engine handle, its `WeightBroadcast.membership_key()`)."""


@dataclass(frozen=True, slots=True)
class _WeightGroup:
    """The weight-update group formed last: its members, name, buckets and name → (dtype, shape)."""

    key: _Membership
    name: str
    buckets: list[list[str]]
    info: dict[str, tuple[str, list[int]]]


class TrainerRankError(MilesAioError):
    """A trainer rank failed: its exception (with the rank's traceback) or its unexpected exit."""

    def __init__(
        self, rank: int, message: str, *, traceback: str = "", returncode: int | None = None
    ) -> None:
        self.rank, self.rank_traceback, self.returncode = rank, traceback, returncode
        text = f"trainer rank {rank}: {message}"
        if traceback:
            text += f"\n--- rank {rank} traceback ---\n{traceback.rstrip()}"
        super().__init__(text)


class TrainerActor:
    """The `Trainer` protocol over trainer rank processes. Build it with `TrainerActor.open(...)`."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        run_dir: Path,
        listener: ChannelListener,
        spawn: bool,
        engine_threads: int = 0,
    ) -> None:
        self.cfg = cfg
        self._engine_threads = engine_threads  # cores the embedded engines on this machine keep busy
        self.run_dir = run_dir
        self._listener = listener
        self._spawn = spawn
        self._world = cfg.world_size
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._chans: dict[int, AsyncChannel] = {}
        self._readers: dict[int, asyncio.Task[None]] = {}
        self._pending: dict[int, deque[asyncio.Future[Message]]] = {r: deque() for r in range(self._world)}
        self._all_connected = asyncio.Event()
        self._lock = asyncio.Lock()
        self._closing = False
        self._closed = asyncio.Event()
        self._failure: TrainerRankError | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._aux: list[asyncio.Task[None]] = []
        self._dp_of: dict[int, int] = {}
        self._shard_source: dict[int, int] = {}  # rank → the rank the controller sends its shard to
        self._dp_size = 1
        self._device = "cpu"
        self._bcast: _WeightGroup | None = None
        self._bcast_failure: str | None = None
        self._staged: tuple[int, Path] | None = None  # the version `stage_weights` wrote, and where
        """Why the last push by broadcast went by disk (None once one succeeds)."""
        self.bcast_failures = 0
        """Pushes by broadcast that went by disk instead."""
        self.weight_group_timeout_s = cfg.dist_timeout_s
        """How long rank 0 waits for the engines in the group's rendezvous and broadcasts (the run's
        --engine-admin-timeout-s when the actor knows the run)."""
        self._alive: dict[int, asyncio.Event] = {r: asyncio.Event() for r in range(self._world)}
        """Set by every frame from a rank; the heartbeat watchdog clears it."""
        self.reward_post_process: RewardPostProcess | None = None  # --custom-reward-post-process-path
        self.wrapper = ""
        self.threads = 0  # torch threads of each rank (reported by rank 0)

    # -- lifecycle ----------------------------------------------------------------------------------------
    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        train_cfg: TrainConfig,
        run_cfg: RunConfig | None = None,
        *,
        run_dir: Path | None = None,
        secret: bytes | None = None,
        spawn: bool | None = None,
    ) -> AsyncIterator[TrainerActor]:
        """Start (spawn=True, default on one node) or await (torchrun ranks dialling in) the W ranks,
        load the model on each, and yield the actor; on exit, take every rank down."""
        if run_dir is None:
            run_dir = run_cfg.run_dir if run_cfg is not None else Path("runs/run")
        spawn = train_cfg.actor_num_nodes == 1 if spawn is None else spawn
        if secret is None:
            secret = protocol.secret_from_env()
        if secret is None:
            if not spawn:
                raise ConfigError(
                    f"ranks started by torchrun need the run's secret: set {protocol.SECRET_ENV} (hex) "
                    "on the controller and on every node",
                    flags=["--actor-num-nodes"],
                )
            secret = protocol.new_secret()
        if train_cfg.hf_checkpoint is None:
            raise ConfigError("the trainer needs an initial model", flags=["--hf-checkpoint"])
        # train_cfg is used as given: `miles_aio.config.resolve` filled in its lr decay end (the run's)
        listener = ChannelListener(secret, host=train_cfg.trainer_host, port=train_cfg.trainer_port)
        # abspath: the engines and the ranks get absolute paths whatever their cwd
        run_dir = Path(os.path.abspath(run_dir))  # noqa: ASYNC240 - no I/O beyond getcwd, once per run
        e = run_cfg.engine if run_cfg is not None else None
        local = e is not None and e.rollout_backend == "local" and not e.sglang_urls
        engine_threads = e.num_engines * e.engine_num_threads if e is not None and local else 0
        actor = cls(train_cfg, run_dir=run_dir, listener=listener, spawn=spawn, engine_threads=engine_threads)
        if e is not None:
            actor.weight_group_timeout_s = e.engine_admin_timeout_s
        actor.reward_post_process = RewardPostProcess.from_config(train_cfg, run_cfg)
        try:
            async with asyncio.TaskGroup() as tg:
                actor._tg = tg
                actor._aux.append(tg.create_task(listener.serve(actor._deliver), name="trainer-listener"))
                try:
                    async with asyncio.timeout(train_cfg.trainer_connect_timeout_s):
                        if spawn:
                            await actor._spawn_ranks(secret)
                        else:
                            log.info("trainer: waiting for torchrun ranks", address=listener.address)
                        await actor._all_connected.wait()
                        await actor._init_ranks()
                    yield actor
                finally:
                    await finish_even_if_cancelled(actor.aclose())
        except BaseExceptionGroup as eg:
            raise primary_error(eg, prefer=_rank_report)  # noqa: B904 - keep its own cause chain
        finally:
            listener.close()

    async def _spawn_ranks(self, secret: bytes) -> None:
        assert self._tg is not None
        host, port = self._listener.address
        threads = rank_threads(
            self.cfg.trainer_num_threads,
            cores=os.cpu_count() or 1,
            engine_threads=self._engine_threads,
            world=self._world,
        )
        base = {
            **os.environ,
            "WORLD_SIZE": str(self._world),
            "LOCAL_WORLD_SIZE": str(self._world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            CONTROLLER_ENV: f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
            protocol.SECRET_ENV: secret.hex(),
            PARENT_ENV: str(os.getpid()),
            LOCAL_RENDEZVOUS_ENV: "1",  # every rank is ours, on this machine: a loopback-only store
            THREADS_ENV: str(threads),
            "OMP_NUM_THREADS": str(threads),
        }
        for rank in range(self._world):
            env = base | {"RANK": str(rank), "LOCAL_RANK": str(rank)}
            # stdout goes to our stderr: the controller's stdout may be machine-read (benchmarks, JSON).
            cmd = (sys.executable, "-m", "miles_aio.trainer.rank_main")
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                env=env,
                stdin=DEVNULL,
                stdout=sys.stderr.fileno(),
                start_new_session=True,  # the terminal's / scheduler's group signals reach only us
            )
            self._procs[rank] = proc
            self._aux.append(self._tg.create_task(self._watch_exit(rank, proc), name=f"trainer-watch-{rank}"))
        log.info("trainer: ranks spawned", pids=[p.pid for p in self._procs.values()])

    def _deliver(self, chan: AsyncChannel) -> None:
        """A rank passed the handshake: keep its channel and start its reader."""
        assert self._tg is not None
        if chan.rank >= self._world or chan.rank in self._chans or self._closing:
            log.warning("trainer: unexpected rank connection dropped", rank=chan.rank)
            self._tg.create_task(chan.aclose(), name="trainer-channel-close")
            return
        self._chans[chan.rank] = chan
        reader = self._tg.create_task(self._read(chan), name=f"trainer-reader-{chan.rank}")
        self._readers[chan.rank] = reader
        self._aux.append(reader)
        if len(self._chans) == self._world:
            self._all_connected.set()

    async def _init_ranks(self) -> None:
        if (timeout_s := self.cfg.trainer_heartbeat_timeout_s) > 0:  # the ranks beat from `init` on
            assert self._tg is not None
            for r in range(self._world):
                self._aux.append(
                    self._tg.create_task(self._watch_heartbeat(r, timeout_s), name=f"trainer-heartbeat-{r}")
                )
        replies = await self._call(InitRequest(config=self.cfg.to_json()))
        self._dp_of = {r: m.dp_rank for r, m in replies.items()}
        self._shard_source = {r: m.shard_source for r, m in replies.items()}
        self._dp_size = replies[0].dp_size
        self._device = replies[0].device
        self.wrapper = replies[0].wrapper
        self.threads = replies[0].threads
        log.info(
            "trainer: ready",
            world=self._world,
            dp=self._dp_size,
            wrapper=self.wrapper,
            device=self._device,
            threads=self.threads,
        )

    async def aclose(self) -> None:
        """Shut every rank down (politely, then SIGTERM, then SIGKILL) and stop the actor's tasks."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        try:
            live = [c for r, c in self._chans.items() if self._failure is None or r != self._failure.rank]
            if live and self._failure is None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(_TERM_GRACE_S):
                        await self._send_all(ShutdownRequest(), live)
                        await asyncio.gather(*(p.wait() for p in self._procs.values()))
            await asyncio.gather(*(_terminate(r, p) for r, p in self._procs.items()))
            self._fail_pending(TrainerRankError(-1, "the trainer was closed"))
        finally:
            for task in self._aux:
                task.cancel()
            for chan in self._chans.values():
                await chan.aclose()
            self._closed.set()

    # -- per-rank tasks -----------------------------------------------------------------------------------
    async def _watch_exit(self, rank: int, proc: asyncio.subprocess.Process) -> None:
        rc = await proc.wait()
        if self._closing:
            return
        if rank not in self._chans:
            err = TrainerRankError(rank, f"exited with code {rc} before connecting", returncode=rc)
            self._fail_pending(err)
            raise err
        # The reader reports it (with the traceback the rank sent before exiting) once it reads EOF; if
        # the socket somehow stays open (a grandchild holding it), close it so the reader sees EOF.
        await asyncio.wait([self._readers[rank]], timeout=_EXIT_REPORT_GRACE_S)
        await self._chans[rank].aclose()

    async def _read(self, chan: AsyncChannel) -> None:
        rank, report = chan.rank, None
        try:
            while True:
                msg = await chan.recv()
                self._alive[rank].set()
                if msg.op == "heartbeat":
                    continue
                if msg.op == "error":
                    failure = protocol.decode_as(msg, protocol.RankFailure)
                    report = TrainerRankError(
                        rank, f"{failure.type}: {failure.message}", traceback=failure.traceback
                    )
                    self._fail_pending(report)
                    continue
                queue = self._pending[rank]
                if queue:
                    fut = queue.popleft()
                    if not fut.done():  # the caller may have been cancelled meanwhile
                        fut.set_result(msg)
        except (ConnectionError, OSError, protocol.ProtocolError) as exc:
            if self._closing:
                return
            rc = None
            if (proc := self._procs.get(rank)) is not None:
                with contextlib.suppress(TimeoutError):
                    rc = await asyncio.wait_for(proc.wait(), _EXIT_REPORT_GRACE_S)
            if report is not None:
                report.returncode = rc
                err = report
            else:
                what = f"exited with code {rc}" if rc is not None else f"channel lost ({exc})"
                err = TrainerRankError(rank, what, returncode=rc)
            self._fail_pending(err)
            raise err from None

    async def _watch_heartbeat(self, rank: int, timeout_s: float) -> None:
        """Raise `TrainerRankError` if rank `rank` sends nothing (no heartbeat, no reply) for `timeout_s`."""
        alive = self._alive[rank]
        while True:
            try:
                async with asyncio.timeout(timeout_s):
                    await alive.wait()
            except TimeoutError:
                if self._closing:
                    return
                err = TrainerRankError(
                    rank,
                    f"no heartbeat for {timeout_s:g}s (--trainer-heartbeat-timeout-s): the rank process is "
                    "frozen (SIGSTOP?) or hung; failing the run instead of waiting for it",
                )
                log.error("trainer: rank stopped answering", rank=rank, timeout_s=timeout_s)
                self._fail_pending(err)
                raise err from None
            alive.clear()

    def _fail_pending(self, err: TrainerRankError) -> None:
        if self._failure is None and err.rank >= 0:
            self._failure = err
        for queue in self._pending.values():
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_exception(err)
                    fut.exception()  # mark retrieved: only the caller's await reports it

    # -- commands -----------------------------------------------------------------------------------------
    async def _send_all(self, req: Request[Reply], chans: Sequence[AsyncChannel]) -> None:
        for chan in chans:
            await chan.send_message(req)

    async def _call(
        self, request: Request[R] | Mapping[int, Request[R]], *, ranks: Sequence[int] | None = None
    ) -> dict[int, R]:
        """Send `request` to `ranks` (default all), or each rank its own (a mapping rank → request), and
        wait for each one's reply."""
        if self._failure is not None:
            raise self._failure
        if self._closing:
            raise TrainerRankError(-1, "the trainer is closed")
        if isinstance(request, Request):
            targets = list(range(self._world)) if ranks is None else list(ranks)
            requests: Mapping[int, Request[R]] = dict.fromkeys(targets, request)
        else:
            requests = request
        loop = asyncio.get_running_loop()
        async with self._lock:
            futs: dict[int, asyncio.Future[Message]] = {}
            for r, req in requests.items():
                futs[r] = loop.create_future()
                self._pending[r].append(futs[r])
                try:
                    await self._chans[r].send_message(req)
                except (ConnectionError, OSError) as exc:
                    futs[r].cancel()
                    raise self._failure or TrainerRankError(r, f"cannot send {req.op!r}: {exc}") from exc
            done, _ = await asyncio.wait(futs.values(), return_when=asyncio.FIRST_EXCEPTION)
            for fut in done:
                if (failed := fut.exception()) is not None:
                    raise failed
            replies: dict[int, R] = {}
            for r, req in requests.items():
                try:
                    replies[r] = req.decode_reply(futs[r].result())
                except protocol.ProtocolError as exc:
                    raise TrainerRankError(r, f"bad reply to {req.op!r}: {exc}") from exc
            return replies

    # -- the Trainer protocol -----------------------------------------------------------------------------
    async def train(self, step: int, batch: list[Group]) -> dict[str, float]:
        """One rollout: advantages over all groups, then optimizer steps of --global-batch-size samples."""
        cfg, post = self.cfg, self.reward_post_process
        n = sum(len(g) for g in batch)
        check_batch_arithmetic(cfg, n)
        step_data = losses.shard_batch(
            batch,
            estimator=cfg.advantage_estimator,
            std_normalization=not cfg.disable_grpo_std_normalization,
            reward_key=cfg.reward_key,
            global_batch_size=cfg.resolved_global_batch_size(n),
            dp_size=self._dp_size,
            mask_offpolicy=cfg.mask_offpolicy_in_partial_rollout,
            processed_rewards=post(batch) if post is not None else None,
        )
        encoded = [protocol.encode_batch(rows) for rows in step_data.shards]
        # Each shard goes once to its model-parallel group's source rank, which passes it on to the group
        # (`rank_main.share_shard`); the others get the command with no tensors.
        replies = await self._call(
            {
                r: TrainRequest(
                    step=step,
                    num_tokens=step_data.num_tokens,
                    batch=encoded[d] if self._shard_source.get(r, r) == r else {},
                )
                for r, d in self._dp_of.items()
            }
        )
        metrics = dict(replies[0].metrics)
        metrics["train/advantage_abs_mean"] = sum(map(abs, step_data.advantages)) / max(n, 1)
        metrics["train/masked_offpolicy_tokens"] = float(step_data.masked_offpolicy)
        return metrics

    async def stage_weights(self, *, version: int) -> bool:
        """Disk mode: rank 0 writes the weights now, and the push's load needs no rank (True). A
        broadcast needs rank 0 in the collective: nothing to stage (False)."""
        if self.cfg.update_weight_transfer_mode != "disk":
            return False
        self._staged = (version, await self.write_weights(version))
        return True

    async def sync_weights(self, engine: InferenceEngine, *, version: int) -> None:
        if self.cfg.update_weight_transfer_mode == "disk":
            staged, self._staged = self._staged, None
            path = (
                staged[1]
                if staged is not None and staged[0] == version
                else await self.write_weights(version)
            )
            await engine.update_weights_from_disk(str(path), version=version)
        else:
            await self._sync_broadcast(engine, version)

    async def write_weights(self, version: int) -> Path:
        """Disk mode's first half: rank 0 writes `<run-dir>/weights/v<version>` (an HF model dir)."""
        path = self.run_dir / "weights" / f"v{version}"
        await self._call(SaveHFRequest(path=str(path), keep=self.cfg.weight_sync_keep))
        return path

    async def _sync_broadcast(self, engine: InferenceEngine, version: int) -> None:
        """Weights by torch.distributed broadcast from rank 0, per bucket of ≤ --update-weight-buffer-size
        bytes (rank 0 sends while the engines receive, concurrently).

        The group spans rank 0 and the engines of this push (`WeightBroadcast.push_clients()`); it is formed
        again whenever that set changes (`membership_key()`: an engine excluded, restarted or rejoining).
        If forming it or a broadcast fails (an engine died or froze mid-collective, or left the push),
        this push goes by disk to the engines still in it, and the next push forms a new group."""
        target = engine.weight_broadcast()
        if target is None:
            raise ConfigError(
                f"{type(engine).__name__} takes no weights by broadcast: use the disk transfer mode",
                flags=["--update-weight-transfer-mode"],
            )
        clients = list(target.push_clients())
        key = _membership(engine, target)
        if not clients:
            log.warning("trainer: no engine in this push: nothing to broadcast", version=version)
            return
        if self._bcast is None or self._bcast.key != key:
            failed = await self._form_weight_group(engine, target, clients, key, version)
            if failed is not None:
                await self._sync_by_disk_instead(engine, version, failed)
                return
        assert self._bcast is not None
        group = self._bcast
        for i, names in enumerate(group.buckets):
            async with asyncio.TaskGroup() as tg:
                sent = tg.create_task(
                    self._call(BcastBucketRequest(names=names)), name="trainer-bcast-bucket"
                )
                tg.create_task(
                    target.update_weights_from_distributed(
                        names=names,
                        dtypes=[group.info[n][0] for n in names],
                        shapes=[group.info[n][1] for n in names],
                        version=version,
                        group_name=group.name,
                        last_bucket=i == len(group.buckets) - 1,
                    ),
                    name="trainer-bcast-engines-receive",
                )
            failed = sent.result()[0].failed
            if failed is None and _membership(engine, target) != key:
                failed = "an engine left the push during the broadcast"
            if failed is not None:
                await self._sync_by_disk_instead(engine, version, failed)
                return
        self._bcast_failure = None

    async def _form_weight_group(
        self,
        engine: InferenceEngine,
        target: WeightBroadcast,
        clients: list[WeightGroupMember],
        key: _Membership,
        version: int,
    ) -> str | None:
        """Drop the old weight-update group (rank 0 and the engines still in it), form one over `clients`;
        returns why it failed, or None."""
        old, self._bcast = self._bcast, None
        if old is not None:
            await self._call(BcastDestroyRequest(), ranks=[0])
            if old.key[0] == key[0]:  # the same handle: its servers still in the old group leave it
                before = set(old.key[1])
                kept = [c for m, c in zip(key[1], clients, strict=True) if m in before]
                await target.destroy_weights_update_group(old.name, clients=kept)
        meta = (await self._call(WeightMetaRequest(), ranks=[0]))[0]
        try:
            async with asyncio.timeout(self.weight_group_timeout_s):
                infos = [await c.server_info() for c in clients]
        except (EngineError, TimeoutError) as exc:
            return f"server_info: {exc or 'timed out'}"
        tps = [int(info.get("tp_size", 1)) for info in infos]
        offsets = [1 + sum(tps[:i]) for i in range(len(tps))]
        name = f"miles_aio_weights_{os.getpid()}_{version}"
        backend = "nccl" if self._device.startswith("cuda") else "gloo"
        try:
            protocol_name = _group_protocol([info.get("engine") for info in infos], backend)
        except ValueError as exc:  # no group can hold these engines: every push goes by disk
            return str(exc)
        world_size = 1 + sum(tps)
        init = BcastInitRequest(
            backend=backend,
            master_address=meta.master_address,
            master_port=meta.master_port,
            world_size=world_size,
            group_name=name,
            timeout_s=self.weight_group_timeout_s,
            protocol=protocol_name,
        )
        async with asyncio.TaskGroup() as tg:
            joined = tg.create_task(self._call(init, ranks=[0]), name="trainer-bcast-init")
            tg.create_task(
                target.init_weights_update_group(
                    master_address=meta.master_address,
                    master_port=meta.master_port,
                    rank_offsets=offsets,  # each client's first rank
                    world_size=world_size,
                    group_name=name,
                    backend=backend,
                    clients=clients,
                ),
                name="engines-bcast-init",
            )
        if (failed := joined.result()[0].failed) is not None:
            return failed
        if _membership(engine, target) != key:
            return "an engine left the push while the group formed"
        info = {n: (d, s) for n, d, s in zip(meta.names, meta.dtypes, meta.shapes, strict=True)}
        buckets = protocol.weight_buckets(
            meta.names, meta.dtypes, meta.shapes, self.cfg.update_weight_buffer_size
        )
        self._bcast = _WeightGroup(key, name, buckets, info)
        log.info("trainer: weight-update group formed", group=name, engines=len(clients), world=world_size)
        return None

    async def _sync_by_disk_instead(self, engine: InferenceEngine, version: int, why: str) -> None:
        """The broadcast failed: drop the group; this push's engines load the weights from disk. Logged
        as a warning when the reason is new (a lasting one, e.g. engines no group can hold, is said once
        and then counted)."""
        if why != self._bcast_failure:
            log.warning(
                "trainer: weight broadcast failed; this push goes by disk", version=version, error=why
            )
        self._bcast_failure = why
        self.bcast_failures += 1
        self._bcast = None
        await self._call(BcastDestroyRequest(), ranks=[0])
        path = await self.write_weights(version)
        await engine.update_weights_from_disk(str(path), version=version)

    async def save(self, step: int, directory: Path) -> None:
        await self._call(SaveRequest(step=step, directory=str(directory)))

    async def load(self, directory: Path) -> int:
        """Restore model, optimizer and RNG state written by `save`; returns the saved step."""
        replies = await self._call(LoadRequest(directory=str(directory)))
        return replies[0].step

    async def export_hf(self, directory: Path) -> Path:
        """Write the current weights as an HF model directory (transformers and SGLang load it)."""
        await self._call(SaveHFRequest(path=str(directory)))
        return Path(directory)

    async def remove_hf(self, directory: Path) -> None:
        """Delete an HF directory `export_hf` wrote (finished or half-written); done by rank 0."""
        await self._call(RemoveHFRequest(paths=[str(directory)]), ranks=[0])

    async def get_weights(self) -> dict[str, torch.Tensor]:
        """The full current weights, HF names (for tests and tools; the whole model comes over the wire)."""
        return (await self._call(GetWeightsRequest()))[0].weights

    async def logprobs(
        self, tokens: Sequence[Sequence[int]], response_lengths: Sequence[int]
    ) -> list[torch.Tensor]:
        """Current-policy log-probs of the last `response_lengths[i]` tokens of each `tokens[i]`."""
        rows = [
            losses.TrainRow(losses.tensor_of(t, torch.int64), r, torch.ones(r), torch.zeros(r), 0.0)
            for t, r in zip(tokens, response_lengths, strict=True)
        ]
        reply = (await self._call(LogprobsRequest(batch=protocol.encode_batch(rows))))[0]
        return [reply.logps[str(i)] for i in range(len(rows))]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values()]


async def _terminate(rank: int, proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    _signal_group(proc, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), _TERM_GRACE_S)
    except TimeoutError:
        log.warning("trainer: rank ignored SIGTERM, killing it", rank=rank, pid=proc.pid)
        _signal_group(proc, signal.SIGKILL)
        await proc.wait()


def rank_threads(setting: int, *, cores: int, engine_threads: int, world: int) -> int:
    """torch threads per CPU trainer rank for `--trainer-num-threads` `setting`: itself when > 0; 0: the
    cores the embedded engines leave free; -1: every core. Either split over the `world` ranks, at least 1."""
    if setting > 0:
        return setting
    free = cores if setting == -1 else cores - engine_threads
    return max(1, free // world)


def _signal_group(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    """A spawned rank leads its own process group: signal all of it (anything the rank started too)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _membership(engine: InferenceEngine, target: WeightBroadcast) -> _Membership:
    return id(engine), tuple(target.membership_key())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_report(exc: BaseException) -> bool:
    """The most telling error of a group: a rank's report (with its traceback), else the first real one."""
    return isinstance(exc, TrainerRankError) and bool(exc.rank_traceback)


def _group_protocol(engines: Sequence[object], backend: str) -> str:
    """How rank 0 forms the group for servers of these engines (`server_info()["engine"]`): vLLM's own
    NCCL group for vLLM servers, torch.distributed for the rest (SGLang's protocol, which the embedded
    engine speaks too). A group mixes neither, and vLLM's has no gloo: ValueError saying so (the push then
    goes by disk; `config.check_vllm_broadcast` refuses what it can see before the run starts)."""
    vllm = [e == "vllm" for e in engines]
    if not any(vllm):
        return "torch"
    if not all(vllm):
        raise ValueError("one weight-update group cannot hold vLLM and other servers")
    if backend != "nccl":
        raise ValueError("vLLM's weight transfer is NCCL only, and the trainer runs without CUDA")
    return "vllm"
