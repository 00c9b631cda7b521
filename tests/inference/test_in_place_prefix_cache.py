"""`--pause-generation-mode in_place` on SGLang needs the radix cache off (miles #2782): requests frozen in
place finish on pre-update KV, which the prefix cache would serve to new requests. Launched servers are
checked before anything starts (exit 2); servers given by URL are asked for their /server_info."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from miles_aio.errors import ConfigError
from miles_aio.inference.engines import check_in_place_prefix_cache, open_engines
from miles_aio.testing.sglang_stub_server import SGLangStubServer
from tests.helpers import make_config

pytestmark = pytest.mark.procs


def test_launched_sglang_with_in_place_needs_the_radix_cache_off() -> None:
    cfg = make_config(rollout_backend="sglang", pause_generation_mode="in_place")
    with pytest.raises(ConfigError, match="--sglang-disable-radix-cache") as info:
        check_in_place_prefix_cache(cfg, ["--mem-fraction-static", "0.8"])
    assert "--pause-generation-mode" in str(info.value)
    check_in_place_prefix_cache(cfg, ["--disable-radix-cache"])
    check_in_place_prefix_cache(make_config(rollout_backend="sglang"), [])  # retract: no constraint
    check_in_place_prefix_cache(make_config(pause_generation_mode="in_place"), [])  # embedded engine


@pytest.mark.timeout(60)
def test_recipe_refuses_it_with_exit_2_before_starting_anything(tmp_path: Path) -> None:
    argv = ["recipes.gsm8k_qwen3", "--dry-run", "--run-dir", str(tmp_path / "run")]
    argv += ["--pause-generation-mode", "in_place"]
    proc = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2, proc.stderr
    assert "--sglang-disable-radix-cache" in proc.stderr and "miles #2782" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("radix_cache_off", [False, True])
def test_servers_given_by_url_are_asked(radix_cache_off: bool, tmp_path: Path) -> None:
    async def main() -> None:
        async with SGLangStubServer.open() as a, SGLangStubServer.open() as b:
            b.disable_radix_cache = radix_cache_off
            a.disable_radix_cache = True
            cfg = make_config(tmp_path, sglang_urls=(a.url, b.url), pause_generation_mode="in_place")
            if radix_cache_off:
                async with open_engines(cfg, model_path=tmp_path) as router:
                    assert len(router.clients) == 2
            else:
                with pytest.raises(ConfigError, match=b.url.replace(".", r"\.")):
                    async with open_engines(cfg, model_path=tmp_path):
                        pass

    asyncio.run(main())
