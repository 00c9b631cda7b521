"""Fakes at the engine and trainer seams, driven by time alone (run them on virtual time: looptime).

`FakeLatencyEngine` turns each generate call into "work": seconds of *unpaused* engine time drawn
from a latency distribution, during which tokens appear at a steady rate. A pause stops the clock of
every request; a weight version stamped during the pause applies to the tokens produced after it, so
per-token versions behave like the real engines'. With `mode="abort"` a pause returns every
in-flight request with the tokens produced so far and finish_reason "abort".

It also stands in for one engine behind the `EngineRouter` (the router's `client_factory`: `url`,
`health_generate`, `weight_version`, the broadcast calls), with faults a test injects: `fail(call, error)`
(the next `call` raises it), `slow(call, s)` (every `call` takes s seconds), `freeze()`/`thaw()` (every call
hangs and generation stops, like a SIGSTOPped process), `kill()`/`revive()` (every call, in flight or new,
raises EngineUnavailable, like a dead server).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_aio._durable import write_file_atomic
from miles_aio._notify import Notifier
from miles_aio.errors import EngineError, EngineUnavailable
from miles_aio.inference.base import InferenceEngine, PauseMode
from miles_aio.types import GenerateOutput, Group

__all__ = ["FakeLatencyEngine", "FakeTokenizer", "FakeTrainer", "LogNormalLatency"]

_Z99 = 2.3263478740408408  # the standard normal's 99th percentile


@dataclass(frozen=True, slots=True)
class LogNormalLatency:
    """Latency with a given median and 99th percentile (long tail: p99/p50 >= 10 is typical of RL)."""

    p50_s: float
    p99_s: float

    @property
    def sigma(self) -> float:
        return math.log(self.p99_s / self.p50_s) / _Z99

    @property
    def mean_s(self) -> float:
        return self.p50_s * math.exp(self.sigma**2 / 2)

    def __call__(self, rng: random.Random) -> float:
        return self.p50_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))


class FakeLatencyEngine(InferenceEngine):
    """A FAKE engine: no model, no HTTP; latency and tokens are drawn from `latency` and `tokens_per_s`."""

    def __init__(
        self,
        latency: Callable[[random.Random], float],
        *,
        tokens_per_s: float = 100.0,
        vocab_size: int = 256,
        seed: int = 0,
        url: str = "fake://engine",
    ) -> None:
        self.url = url
        self._latency = latency
        self._tokens_per_s = tokens_per_s
        self._vocab = vocab_size
        self._rng = random.Random(seed)
        self._paused: PauseMode | None = None
        self._changed = Notifier()
        self.version: int | None = None
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests = 0
        self.calls: list[str] = []  # admin calls, in order
        self.continuations = 0  # the router's stats read it (partial rollout is the real client's)
        self.frozen = False
        self.dead = False
        self.model_path: str | None = None
        self._faults: dict[str, list[EngineError]] = {}
        self._slow: dict[str, float] = {}

    # -- faults ----------------------------------------------------------------------------------------
    def fail(self, call: str, error: EngineError, *, times: int = 1) -> None:
        """The next `times` calls of `call` (a method name) raise `error`."""
        self._faults.setdefault(call, []).extend([error] * times)

    def slow(self, call: str, seconds: float) -> None:
        """Every `call` takes `seconds` before it answers."""
        self._slow[call] = seconds

    def freeze(self) -> None:
        """Like SIGSTOP: every call hangs (generation stops) until `thaw()`."""
        self.frozen = True
        self._changed.notify()

    def thaw(self) -> None:
        self.frozen = False
        self._changed.notify()

    def kill(self) -> None:
        """Like a dead server: every call, in flight or new, raises EngineUnavailable until `revive()`,
        which brings it back with no weights (version None), as a restarted server."""
        self.dead = True
        self._changed.notify()

    def revive(self) -> None:
        self.dead, self.frozen, self._paused, self.version = False, False, None, None
        self._changed.notify()

    def _check_alive(self) -> None:
        if self.dead:
            raise EngineUnavailable(f"{self.url}: connection refused (fake engine is dead)")

    async def _admin(self, call: str) -> None:
        """The common prelude of every non-generate call: hang while frozen, fail as scripted."""
        self._check_alive()
        await self._changed.wait_until(lambda: not self.frozen or self.dead)
        self._check_alive()
        if delay := self._slow.get(call):
            await asyncio.sleep(delay)
        if faults := self._faults.get(call):
            raise faults.pop(0)

    async def generate(
        self, *, input_ids: list[int], sampling_params: Mapping[str, Any], routing_key: Hashable | None = None
    ) -> GenerateOutput:
        self._check_alive()
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._generate(sampling_params)
        finally:
            self.in_flight -= 1

    async def _generate(self, sampling_params: Mapping[str, Any]) -> GenerateOutput:
        loop = asyncio.get_running_loop()
        work = max(0.0, self._latency(self._rng))
        n_natural = max(1, round(work * self._tokens_per_s))
        n = min(n_natural, int(sampling_params.get("max_new_tokens", n_natural)))
        finish: str = "length" if n < n_natural else "stop"
        work = work * n / n_natural
        ids = [self._rng.randrange(self._vocab) for _ in range(n)]
        versions: list[int | None] = []
        done = 0.0
        while True:
            await self._changed.wait_until(
                lambda: self.dead or (not self.frozen and (self._paused is None or self._paused == "abort"))
            )
            self._check_alive()
            if self._paused == "abort":
                finish = "abort"
                break
            version, t0 = self.version, loop.time()
            try:
                async with asyncio.timeout(work - done):
                    await self._changed.wait_until(
                        lambda: self._paused is not None or self.frozen or self.dead
                    )
                done = min(work, done + loop.time() - t0)  # paused part-way
            except TimeoutError:
                done = work  # the deadline is the finish (clocks round: never trust work - elapsed)
            produced = n if done >= work else math.floor(n * done / work)
            versions.extend([version] * (produced - len(versions)))
            if produced == n:
                break
            await asyncio.sleep(0)  # let the pause settle before checking its mode
        k = len(versions)
        return GenerateOutput(
            text="",
            output_ids=ids[:k],
            output_log_probs=[-1.0] * k,
            weight_versions=versions,
            finish_reason=finish,  # type: ignore[arg-type]
            prompt_tokens=0,
        )

    async def pause_generation(self, mode: PauseMode) -> None:
        await self._admin("pause_generation")
        self.calls.append(f"pause:{mode}")
        self._paused = mode
        self._changed.notify()

    async def continue_generation(self) -> None:
        await self._admin("continue_generation")
        self.calls.append("continue")
        self._paused = None
        self._changed.notify()

    async def flush_cache(self) -> None:
        await self._admin("flush_cache")
        self.calls.append("flush")

    async def update_weight_version(self, version: int) -> None:
        await self._admin("update_weight_version")
        self.calls.append(f"version:{version}")
        self.version = version

    async def update_weights_from_disk(
        self, model_path: str, *, version: int, flush_cache: bool = True
    ) -> None:
        await self._admin("update_weights_from_disk")
        self.calls.append(f"load:{model_path}")
        self.model_path, self.version = model_path, version

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        await self._admin("init_weights_update_group")
        self.calls.append(f"group:{group_name}:{rank_offset}/{world_size}")

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._admin("destroy_weights_update_group")
        self.calls.append(f"destroy:{group_name}")

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int | None = None,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
    ) -> None:
        await self._admin("update_weights_from_distributed")
        self.calls.append(f"broadcast:{group_name}")
        if version is not None:
            self.version = version

    async def health_generate(self) -> None:
        await self._admin("health_generate")

    async def weight_version(self) -> int | None:
        await self._admin("weight_version")
        return self.version

    async def server_info(self) -> dict[str, Any]:
        await self._admin("server_info")
        return {"internal_states": [{"num_running_reqs": self.in_flight, "num_waiting_reqs": 0}]}

    async def aclose(self) -> None:
        return None


class FakeTrainer:
    """A FAKE trainer: each step takes `step_time_s` (+ `per_token_s` per response token)."""

    def __init__(
        self,
        *,
        step_time_s: float = 1.0,
        per_token_s: float = 0.0,
        sync_time_s: float = 0.0,
        keep_batches: bool = True,
    ) -> None:
        self.step_time_s = step_time_s
        self.per_token_s = per_token_s
        self.sync_time_s = sync_time_s
        self.keep_batches = keep_batches  # tests inspect what was trained; long runs must not hoard it
        self.steps: list[tuple[int, list[Group]]] = []
        self.synced_versions: list[int] = []
        self.loaded_step: int | None = None

    async def train(self, step: int, batch: list[Group]) -> dict[str, float]:
        tokens = sum(s.response_length for g in batch for s in g)
        await asyncio.sleep(self.step_time_s + self.per_token_s * tokens)
        self.steps.append((step, batch if self.keep_batches else []))
        return {"train/loss": 1.0 / (1 + step), "train/tokens": float(tokens)}

    async def sync_weights(self, engine: InferenceEngine, *, version: int) -> None:
        await asyncio.sleep(self.sync_time_s)
        self.synced_versions.append(version)

    async def save(self, step: int, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - a fake: tiny, test-only write
        write_file_atomic(directory / "fake_trainer.json", json.dumps({"step": step}).encode())  # fsynced

    async def load(self, directory: Path) -> None:
        self.loaded_step = json.loads((directory / "fake_trainer.json").read_text())["step"]

    async def aclose(self) -> None:
        return None


class FakeTokenizer:
    """A FAKE byte tokenizer (one id per UTF-8 byte) for runs that need no real model."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(t % 256 for t in token_ids).decode("utf-8", errors="replace")
