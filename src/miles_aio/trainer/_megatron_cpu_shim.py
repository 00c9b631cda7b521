"""Make megatron-core (0.16.x; also 0.19.x) run on a CPU-only torch, for tests on CPU machines.

megatron-core assumes CUDA in a few places that have nothing to do with the math: the CUDA RNG tracker,
`torch.cuda.current_device()` used as a device, and `torch.tensor(..., device="cuda")` scalars in the
optimizer utilities and the pipeline schedule (see reference/cpu-stack.md §1), plus
`torch.cuda.synchronize()` and `Tensor.cuda()` on the pipeline-parallel paths. `apply()` patches exactly
those, and only when `torch.cuda.is_available()` is False; on a GPU machine it does nothing. It never
touches numerics: forward, backward and the parameter update are megatron's own code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Final

import torch

__all__ = ["apply"]

_FACTORIES: Final = frozenset({"tensor", "zeros", "ones", "empty", "full", "zeros_like", "ones_like"})
_PATCHED_MODULES: Final = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.pipeline_parallel.schedules",  # the schedule's token counter is a "cuda" tensor
    "megatron.core.utils",
)
_applied = False


class _TorchCudaToCpu:
    """A stand-in for the `torch` module that rewrites device="cuda…" to "cpu" in tensor factories."""

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr

        def factory(*args: Any, **kwargs: Any) -> Any:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        return factory


class _NullStream:
    def wait_event(self, *args: Any, **kwargs: Any) -> None: ...
    def wait_stream(self, *args: Any, **kwargs: Any) -> None: ...
    def synchronize(self) -> None: ...


def _set(obj: Any, name: str, value: Callable[..., Any]) -> None:
    setattr(obj, name, value)


def apply() -> None:
    """Patch megatron-core and `torch.cuda` for CPU. Call after importing megatron.core, before building
    a model. Idempotent; a no-op when CUDA is available."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    import megatron.core.tensor_parallel.random as mrandom  # type: ignore[import-untyped,import-not-found,unused-ignore]

    _set(torch.cuda, "current_device", lambda: "cpu")
    _set(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    _set(torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed))
    _set(torch.cuda, "current_stream", lambda device=None: _NullStream())
    # Pipeline p2p: shape exchanges end with torch.cuda.synchronize() (CPU ops are synchronous anyway),
    # and a tied embedding's last-stage copy is moved with `.cuda()` before its initial all-reduce.
    _set(torch.cuda, "synchronize", lambda device=None: None)
    _set(torch.Tensor, "cuda", lambda self, *a, **k: self)
    _set(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    _set(mrandom, "_set_cuda_rng_state", lambda new_state, *a, **k: torch.set_rng_state(new_state))
    for name in _PATCHED_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        module.torch = _TorchCudaToCpu()  # type: ignore[attr-defined]
    _applied = True
