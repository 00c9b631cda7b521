from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.helpers import tiny_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-init HF Llama (hidden 64, 2 layers, 15 tokens), built once per session."""
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")
