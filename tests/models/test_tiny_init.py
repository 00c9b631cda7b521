"""How `build_tiny_llama` draws the weights: transformers' N(0, 0.02) (the default) or torch.nn's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_aio.models.tiny import build_tiny_llama
from miles_aio.tasks.arithmetic import ALPHABET

pytestmark = pytest.mark.pure

SHAPE = {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512}


def weights(path: Path, **kwargs: object) -> dict[str, torch.Tensor]:
    return load_file(str(build_tiny_llama(path, alphabet=ALPHABET, **SHAPE, **kwargs) / "model.safetensors"))  # type: ignore[arg-type]


def test_the_default_is_transformers_init_and_byte_identical_to_it(tmp_path: Path) -> None:
    default, named = weights(tmp_path / "a"), weights(tmp_path / "b", init="transformers")
    assert default.keys() == named.keys()
    assert all(torch.equal(default[k], named[k]) for k in default)
    for name, t in default.items():
        if t.dim() == 2:  # every matrix, the embedding included
            assert abs(float(t.std()) - 0.02) < 0.002, name


def test_torch_init_draws_as_torch_nn_modules_do(tmp_path: Path) -> None:
    w = weights(tmp_path / "t", init="torch", chat_tokens=True)
    for name, t in w.items():
        if name == "model.embed_tokens.weight":  # nn.Embedding: N(0, 1), the appended rows too
            assert abs(float(t.std()) - 1.0) < 0.1
        elif t.dim() == 2:  # nn.Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), std 1/sqrt(3 fan_in)
            bound = 1 / math.sqrt(t.shape[1])
            assert float(t.abs().max()) <= bound, name
            assert abs(float(t.std()) - bound / math.sqrt(3)) < 0.1 * bound, name
        else:
            assert torch.equal(t, torch.ones_like(t)), name  # norms
    again = weights(tmp_path / "t2", init="torch", chat_tokens=True)
    assert all(torch.equal(w[k], again[k]) for k in w)  # seeded: the same arguments, the same bytes


def test_embedding_std_overrides_either_init(tmp_path: Path) -> None:
    w = weights(tmp_path / "e", init="torch", embedding_std=0.02)
    assert abs(float(w["model.embed_tokens.weight"].std()) - 0.02) < 0.003
