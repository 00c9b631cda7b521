"""Helpers for the embedded-engine tests: engine processes, SGLang-schema checks, reference logprobs."""

from __future__ import annotations

import functools
import itertools
import json
import os
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import torch

ALPHABET = "abcdefghijklmnopqrstuvwxyz 0123456789+-=.\n"
ENGINE_READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Models:
    root: Path
    """The engines' --weights-root."""
    m1: Path
    """The served model (seed 0)."""
    m2: Path
    """Same architecture, other weights (seed 1): the target of weight updates."""
    tied: Path
    """Tied embeddings, other RoPE theta, 3 layers, no GQA."""
    wrong_shape: Path
    """hidden_size 64: a checkpoint that must be refused."""
    outside: Path
    """A valid checkpoint outside the weights root."""


@dataclass(frozen=True)
class ModelPair:
    root: Path
    """The engines' --weights-root."""
    m1: Path
    """The served model."""
    m2: Path
    """Same shape, other weights: the target of weight updates."""


def model_pair(root: Path, *, seeds: tuple[int, int] = (0, 1), **kw: Any) -> ModelPair:
    """Two tiny Llamas of one shape under `root` (build_tiny_llama's arguments, e.g. a long context)."""
    from miles_aio.models import build_tiny_llama

    return ModelPair(
        root=root,
        m1=build_tiny_llama(root / "m1", seed=seeds[0], **kw),
        m2=build_tiny_llama(root / "m2", seed=seeds[1], **kw),
    )


class EngineProcess:
    """A running engine: `url`, `pid`, and `stop()`. Its stderr goes to a file, shown on failures."""

    def __init__(
        self, model_path: Path, *args: str, log_dir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.stderr_path = log_dir / f"engine-{os.getpid()}-{id(self)}.log"
        cmd = [sys.executable, "-m", "miles_aio.engine", "--model-path", str(model_path)]
        cmd += ["--port", "0", *args]
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=None if env is None else {**os.environ, **env},
            )
        lines: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
        try:
            line = lines.get(timeout=ENGINE_READY_TIMEOUT_S)
            ready = json.loads(line)
        except (queue.Empty, ValueError):
            self.stop()
            raise RuntimeError(f"engine did not become ready; stderr:\n{self.stderr()}") from None
        assert ready["event"] == "ready", ready
        assert ready["pid"] == self.proc.pid, ready
        self.url = f"http://{ready['host']}:{ready['port']}"
        self.pid = self.proc.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-5000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


def generate(client: httpx.Client, api_types: ModuleType, body: dict[str, Any]) -> dict[str, Any]:
    """POST /generate with a body SGLang accepts; return a response SGLang's schema accepts."""
    api_types.GenerateRequest.from_json_value(body)  # raises JsonContractError if we send nonsense
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()
    check_response(api_types, data)
    return data


def check_response(api_types: ModuleType, data: dict[str, Any]) -> None:
    """Strict SGLang-schema check of one /generate answer, plus the invariants clients rely on."""
    decoded = api_types.GenerateResponse.from_json_value(data)
    meta = decoded.meta_info
    # The schema falls back to a plain dict for a finish_reason it cannot type: treat that as a failure.
    assert isinstance(
        meta.finish_reason, api_types.FinishStop | api_types.FinishLength | api_types.FinishAbort
    )
    n = len(data["output_ids"])
    assert meta.completion_tokens == n
    if meta.output_token_logprobs is not None:
        assert [e.token_id for e in meta.output_token_logprobs] == data["output_ids"]
    spans = meta.weight_versions
    assert spans
    assert spans[0].start == 0
    assert spans[-1].end == n
    assert all(a.end == b.start for a, b in itertools.pairwise(spans))
    assert meta.weight_version == spans[-1].version


def token_versions(data: dict[str, Any]) -> list[str]:
    """Expand `weight_versions` spans into one version per output token."""
    out: list[str] = []
    for span in data["meta_info"]["weight_versions"]:
        out += [span["version"]] * (span["end"] - span["start"])
    return out


def logprobs(data: dict[str, Any]) -> list[float]:
    return [e[0] for e in data["meta_info"]["output_token_logprobs"]]


@functools.cache
def hf_model(path: Path) -> Any:
    """transformers' LlamaForCausalLM for `path`, float32, eval mode (cached: loading costs ~1 s)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def reference_logprobs(
    model_path: Path, prompt: list[int], output: list[int], *, temperature: float = 1.0
) -> list[float]:
    """What a trainer computes: log_softmax(HF LlamaForCausalLM logits / T) of each output token."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = hf_model(model_path)(ids).logits[0].float()
    steps = logits[len(prompt) - 1 : len(prompt) + len(output) - 1] / temperature
    return torch.log_softmax(steps, dim=-1).gather(1, torch.tensor(output)[:, None])[:, 0].tolist()
