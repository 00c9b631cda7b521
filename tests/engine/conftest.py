"""Fixtures for the embedded-engine tests: one tiny model set per session, one engine process per module.

Every engine is a real `python -m miles_aio.engine` process on a loopback port; tests talk to
it over HTTP. Requests and responses of `/generate` are checked against SGLang's own msgspec schema
(`sglang/api/v1/api_types.py`, loaded by file path without importing sglang).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from miles_aio.models import build_tiny_llama
from tests.engine.helpers import ALPHABET, EngineProcess, Models
from tests.engine.parity import SGLANG_UPDATE_MODEL_ENV, SGLANG_URL_ENV, ParityServer


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


# ---- SGLang parity suites (test_parity*.py): one server for the session ----


@pytest.fixture(scope="session")
def parity_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ParityServer]:
    """A real SGLang server when MILES_AIO_SGLANG_URL is set, else one embedded engine on a tiny model
    with a 1024-token context (hidden 64, 2 layers), 8 running requests, and a second checkpoint of
    the same shape under its weights root."""
    url = os.environ.get(SGLANG_URL_ENV)
    if url:
        base = httpx.get(f"{url.rstrip('/')}/model_info", timeout=30.0).json()["model_path"]
        update = os.environ.get(SGLANG_UPDATE_MODEL_ENV) or None
        yield ParityServer(url=url.rstrip("/"), engine=None, base_model=base, update_model=update)
        return
    root = tmp_path_factory.mktemp("parity-weights")
    small: dict[str, Any] = {"alphabet": ALPHABET, "hidden_size": 64, "max_position_embeddings": 1024}
    p1 = build_tiny_llama(root / "p1", seed=10, **small)
    p2 = build_tiny_llama(root / "p2", seed=11, **small)
    proc = EngineProcess(
        p1,
        "--weights-root", str(root), "--max-running-requests", "8",
        log_dir=tmp_path_factory.mktemp("parity-logs"),
    )  # fmt: skip
    yield ParityServer(
        url=proc.url,
        engine=proc,
        base_model=str(p1.resolve()),
        update_model=str(p2.resolve()),
        local_base=p1,
        local_update=p2,
    )
    assert proc.stop() == 0, proc.stderr()


@pytest.fixture(scope="session")
def server_url(parity_server: ParityServer) -> str:
    """The URL the parity suites talk to: $MILES_AIO_SGLANG_URL, or the embedded engine's."""
    return parity_server.url


@pytest.fixture
def server(server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server_url, timeout=120.0) as c:
        yield c
