"""Fixtures for the embedded-engine tests: one tiny model set per session, one engine process per module.

Every engine is a real `python -m miles_aio.engine` process on a loopback port; tests talk to
it over HTTP. Requests and responses of `/generate` are checked against SGLang's own msgspec schema
(`sglang/api/v1/api_types.py`, loaded by file path without importing sglang).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from miles_aio.models import build_tiny_llama
from tests.engine.helpers import ALPHABET, EngineProcess, Models


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    root = tmp_path_factory.mktemp("weights")
    outside = tmp_path_factory.mktemp("elsewhere") / "m2copy"
    return Models(
        root=root,
        m1=build_tiny_llama(root / "m1", alphabet=ALPHABET, seed=0),
        m2=build_tiny_llama(root / "m2", alphabet=ALPHABET, seed=1),
        tied=build_tiny_llama(
            root / "tied",
            alphabet=ALPHABET,
            seed=2,
            tie_word_embeddings=True,
            num_layers=3,
            num_kv_heads=4,
            rope_theta=500.0,
        ),
        wrong_shape=build_tiny_llama(root / "small", alphabet=ALPHABET, hidden_size=64, seed=3),
        outside=build_tiny_llama(outside, alphabet=ALPHABET, seed=1),
    )


@pytest.fixture(scope="session")
def api_types() -> ModuleType:
    """SGLang's generated /generate schema, loaded by path (importing sglang would pull torch/CUDA deps)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang is not installed (pip install --no-deps sglang): cannot check SGLang's schema")
    path = Path(spec.origin).parent / "api" / "v1" / "api_types.py"
    if not path.exists():
        pytest.skip(f"this sglang has no {path.name} at {path}")
    mod_spec = importlib.util.spec_from_file_location("sglang_api_types_for_tests", path)
    assert mod_spec is not None
    assert mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_spec.name] = module  # msgspec resolves the forward references through sys.modules
    mod_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def engine(models: Models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """One engine per test module, serving m1 with weights root = models.root."""
    proc = EngineProcess(
        models.m1, "--weights-root", str(models.root), log_dir=tmp_path_factory.mktemp("logs")
    )
    yield proc
    assert proc.stop() == 0, proc.stderr()


@pytest.fixture
def client(engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=30.0) as c:
        yield c
