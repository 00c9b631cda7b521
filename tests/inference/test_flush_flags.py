"""`--engine-flush-attempts` / `--engine-flush-backoff-s`: the router's retries of a `/flush_cache`
answered 400 (`RouterPolicy.flush_attempts`, `flush_backoff_s`), validated, and what the run's router
does (servers given by `--sglang-urls`, real HTTP stub servers)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles_aio.cli import parse_run_config
from miles_aio.inference.engines import open_engines
from miles_aio.inference.router import RouterPolicy
from miles_aio.testing.sglang_stub_server import SGLangStubServer

BASE = ["--rollout-batch-size", "4", "--num-rollout", "2", "--n-samples-per-prompt", "2", "--use-tis"]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--engine-flush-attempts", "0"], "--engine-flush-attempts"),
        (["--engine-flush-backoff-s", "-0.5"], "--engine-flush-backoff-s"),
    ],
)
def test_a_bad_flush_retry_flag_exits_2_naming_it(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse_run_config(BASE + argv, prog="prog")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and ("must be >= 1" in err or "must be >= 0" in err), err


def test_the_defaults_are_the_router_policys() -> None:
    e = parse_run_config(BASE).engine
    p = RouterPolicy()
    assert (e.engine_flush_attempts, e.engine_flush_backoff_s) == (p.flush_attempts, p.flush_backoff_s)
    assert parse_run_config([*BASE, "--engine-flush-backoff-s", "0"]).engine.engine_flush_backoff_s == 0.0


@pytest.mark.procs
@pytest.mark.timeout(30)
def test_the_flags_reach_the_runs_router(tmp_path: Path) -> None:
    """Two tries, no backoff: an engine refusing every flush is asked twice, then excluded."""

    async def main() -> None:
        async with SGLangStubServer.open() as server:
            flags = ["--engine-flush-attempts", "2", "--engine-flush-backoff-s", "0"]
            cfg = parse_run_config([*BASE, "--sglang-urls", server.url, *flags])
            async with open_engines(cfg, model_path=tmp_path) as router:
                assert (router.policy.flush_attempts, router.policy.flush_backoff_s) == (2, 0.0)
                server.refuse_flushes = 10
                await router.flush_cache()
                assert server.counts["/flush_cache"] == 2
                assert router.stats()["router/engine0/exclusions"] == 1

    asyncio.run(main())
