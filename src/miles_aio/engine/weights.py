"""Reading and validating new weights, before anything touches the live model.

Every update is staged whole and checked against the model's `LlamaSpec` (names, shapes, dtypes) before
the first byte is copied, so a bad update is a 4xx and leaves the served weights untouched; SGLang instead
documents that a failed `update_weights_from_distributed` leaves weights "partially updated".

Disk updates may only read under `--weights-root` (default: the parent of `--model-path`): the engine
is an HTTP server, and `model_path` is client input.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Final

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

if TYPE_CHECKING:  # the model reads its checkpoint here: a runtime import back would be a cycle
    from miles_aio.engine.model import LlamaSpec

__all__ = ["WeightUpdateError", "parse_dtype", "read_checkpoint", "resolve_weights_dir", "stage_update"]

_SAFETENSORS_INDEX: Final = "model.safetensors.index.json"


class WeightUpdateError(ValueError):
    """The requested weight update is invalid; the message says why (it becomes the 400 body)."""


def resolve_weights_dir(model_path: str, *, weights_root: Path) -> Path:
    """The real directory `model_path` names, if it lies under `weights_root` and holds safetensors."""
    root = weights_root.resolve()
    # realpath first, so a symlink under the root cannot point outside it.
    path = Path(os.path.realpath(model_path))
    if path != root and root not in path.parents:
        raise WeightUpdateError(
            f"model_path {model_path!r} is outside the engine's --weights-root {str(root)!r}"
        )
    if not path.is_dir():
        raise WeightUpdateError(f"model_path {model_path!r} is not a directory")
    if not any(path.glob("*.safetensors")):
        raise WeightUpdateError(f"model_path {model_path!r} holds no *.safetensors file")
    return path


def read_checkpoint(model_dir: Path, *, weights_root: Path | None = None) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint (single file, sharded with an index, or loose shards).

    With `weights_root`, every shard file must really (after symlinks and `..`) lie under it: the index's
    `weight_map` is file content, not trusted input. Any unreadable or corrupt file (index or shard) is
    a `WeightUpdateError` naming it; nothing is returned unless every shard read whole.
    """
    index = model_dir / _SAFETENSORS_INDEX
    if index.exists():
        files = _index_shards(index)
    elif (model_dir / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"{model_dir} holds no safetensors checkpoint")
    root = weights_root.resolve() if weights_root is not None else None
    paths = [_shard_path(model_dir, name, root=root) for name in files]  # all checked before any read
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        try:
            tensors.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise WeightUpdateError(f"cannot read shard {str(path)!r}: {exc}") from exc
    return tensors


def _index_shards(index: Path) -> list[str]:
    """The shard file names `model.safetensors.index.json` maps to (sorted, unique)."""
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise WeightUpdateError(f"cannot read {str(index)!r}: {exc}") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        raise WeightUpdateError(
            f'malformed {str(index)!r}: expected {{"weight_map": {{tensor name: shard file name}}}}'
        )
    return sorted(set(weight_map.values()))


def _shard_path(model_dir: Path, name: str, *, root: Path | None) -> Path:
    """The real path of shard `name` of `model_dir`; with `root`, it must lie under it."""
    path = Path(os.path.realpath(model_dir / name))
    if root is not None and root not in path.parents:
        raise WeightUpdateError(
            f"shard {name!r} of {str(model_dir)!r} resolves to {str(path)!r}, outside the engine's "
            f"--weights-root {str(root)!r}"
        )
    if not path.is_file():
        raise WeightUpdateError(f"shard {name!r} of {str(model_dir)!r} is not a file")
    return path


def parse_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` / `"torch.float32"` → torch dtype, as SGLang does (`getattr(torch, dtype)`)."""
    attr = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(attr, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r}")
    return attr


def stage_update(
    spec: LlamaSpec,
    tensors: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    require_all: bool,
) -> dict[str, torch.Tensor]:
    """Check `tensors` against the model and return them ready to copy in (contiguous, engine dtype).

    Floating-point tensors of another precision are cast (a bf16 checkpoint into a float32 engine is
    normal; SGLang casts too). Non-float tensors, unknown names and shape mismatches are rejected.
    `require_all`: a disk checkpoint must be complete; a broadcast may update any subset.
    """
    expected = spec.expected_shapes()
    staged: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if spec.is_ignored(name):
            continue
        if name not in expected:
            raise WeightUpdateError(
                f"unknown tensor {name!r}: not a parameter of this {spec.model_type} model"
            )
        if tuple(tensor.shape) != expected[name]:
            raise WeightUpdateError(
                f"shape mismatch for {name}: got {list(tensor.shape)}, the model has {list(expected[name])}"
            )
        if not tensor.dtype.is_floating_point:
            raise WeightUpdateError(
                f"dtype mismatch for {name}: got {tensor.dtype}, expected a floating dtype"
            )
        staged[name] = tensor.to(dtype).contiguous()
    if not staged:
        raise WeightUpdateError("the update holds no parameter of this model")
    if require_all and (missing := set(expected) - set(staged)):
        raise WeightUpdateError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    return staged
