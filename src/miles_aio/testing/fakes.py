"""Fakes at the engine and trainer seams, driven by time alone (run them on virtual time: looptime).

`FakeLatencyEngine` turns each generate call into "work": seconds of *unpaused* engine time drawn
from a latency distribution, during which tokens appear at a steady rate. A pause stops the clock of
every request; a weight version stamped during the pause applies to the tokens produced after it, so
per-token versions behave like the real engines'. With `mode="abort"` a pause returns every
in-flight request with the tokens produced so far and finish_reason "abort".
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

from miles_aio._notify import Notifier
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
    ) -> None:
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

    async def generate(
        self, *, input_ids: list[int], sampling_params: Mapping[str, Any], routing_key: Hashable | None = None
    ) -> GenerateOutput:
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
            await self._changed.wait_until(lambda: self._paused is None or self._paused == "abort")
            if self._paused == "abort":
                finish = "abort"
                break
            version, t0 = self.version, loop.time()
            try:
                async with asyncio.timeout(work - done):
                    await self._changed.wait_until(lambda: self._paused is not None)
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
        self.calls.append(f"pause:{mode}")
        self._paused = mode
        self._changed.notify()

    async def continue_generation(self) -> None:
        self.calls.append("continue")
        self._paused = None
        self._changed.notify()

    async def flush_cache(self) -> None:
        self.calls.append("flush")

    async def update_weight_version(self, version: int) -> None:
        self.calls.append(f"version:{version}")
        self.version = version

    async def update_weights_from_disk(self, model_path: str, *, version: int) -> None:
        self.calls.append(f"load:{model_path}")
        self.version = version

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
        (directory / "fake_trainer.json").write_text(json.dumps({"step": step}))

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
