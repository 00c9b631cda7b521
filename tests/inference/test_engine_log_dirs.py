"""Where engine logs go, and that nothing is left behind: a temporary log folder the launcher made itself
is removed on exit (normal or failed start), a given one is kept, and the mode-2 eval fleet logs under the
run dir (`<run-dir>/logs/eval`) instead of leaking a temporary folder per run.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from miles_aio.eval import open_eval_engines
from miles_aio.inference.local_launch import EngineStartError, launch_local_engines
from miles_aio.models.tiny import build_tiny_llama
from tests.helpers import make_config

pytestmark = [pytest.mark.procs, pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return build_tiny_llama(tmp_path / "m", alphabet="abc", hidden_size=32, num_heads=2, num_kv_heads=1)


@pytest.fixture
def tmp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`tempfile`'s default folder, private to this test."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def _engine_temp_dirs(root: Path) -> list[Path]:
    return sorted(root.glob("miles-aio-engines-*"))


def test_own_temporary_log_dir_is_removed_on_exit(model_dir: Path, tmp_root: Path) -> None:
    async def main() -> None:
        async with launch_local_engines(model_dir, num_engines=1):
            (logs,) = _engine_temp_dirs(tmp_root)
            assert (logs / "engine-0.log").exists()

    asyncio.run(main())
    assert _engine_temp_dirs(tmp_root) == []


def test_own_temporary_log_dir_is_removed_after_a_failed_start(tmp_path: Path, tmp_root: Path) -> None:
    async def main() -> None:
        async with launch_local_engines(tmp_path / "no-such-model", num_engines=1):
            pytest.fail("an engine without a model must not become ready")

    with pytest.raises(EngineStartError):
        asyncio.run(main())
    assert _engine_temp_dirs(tmp_root) == []


def test_given_log_dir_is_kept(model_dir: Path, tmp_path: Path, tmp_root: Path) -> None:
    async def main() -> None:
        async with launch_local_engines(model_dir, num_engines=1, log_dir=tmp_path / "logs"):
            pass

    asyncio.run(main())
    assert (tmp_path / "logs" / "engine-0.log").exists()
    assert _engine_temp_dirs(tmp_root) == []


def test_eval_fleet_logs_under_the_run_dir(model_dir: Path, tmp_path: Path, tmp_root: Path) -> None:
    cfg = make_config(tmp_path / "run", eval_interval=2, eval_num_gpus=1, eval_hf_dir=tmp_path / "snaps")
    assert cfg.engine.rollout_backend != "sglang"

    async def main() -> None:
        async with open_eval_engines(cfg, model_path=model_dir) as fleet:
            assert fleet is not None
            assert _engine_temp_dirs(tmp_root) == []

    asyncio.run(main())
    assert (cfg.run_dir / "logs" / "eval" / "engine-0.log").exists()
    assert _engine_temp_dirs(tmp_root) == []
