"""The SGLang and vLLM launchers' process handling (`server_launch`), run against the embedded engine
(it serves both health routes).

SGLang cannot serve on a CPU machine, and vLLM takes a minute to start (`nox -s vllm` starts the real
one); the launcher logic — spawn in its own process group, wait for the health route, report early
death with the log tail, tear the whole group down on every exit path, restart one engine — is the
same whatever the command, so the embedded engine stands in for both here.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import httpx
import pytest

from miles_aio.inference.sglang_launch import (
    SGLangStartError,
    free_port,
    launch_sglang_servers,
    sglang_command,
)
from miles_aio.inference.vllm_launch import vllm_servers
from miles_aio.models.tiny import build_tiny_llama

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(
        tmp_path_factory.mktemp("m") / "model", alphabet="abc", hidden_size=32, num_heads=2, num_kv_heads=1
    )


def engine_cmd(model_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "miles_aio.engine",
        "--model-path",
        str(model_dir),
        "--port",
        str(free_port()),
    ]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sglang_command_line() -> None:
    cmd = sglang_command(
        "/m", host="127.0.0.1", port=30000, tp_size=4, extra_args=["--mem-fraction-static", "0.8"]
    )
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[3:] == [
        "--model-path",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
        "--tp-size",
        "4",
        "--mem-fraction-static",
        "0.8",
    ]


def test_servers_become_healthy_and_are_torn_down_on_an_exception(model_dir: Path, tmp_path: Path) -> None:
    pids: list[int] = []

    async def main() -> None:
        launcher = launch_sglang_servers(
            model_dir,
            num_engines=2,
            log_dir=tmp_path,
            commands=[engine_cmd(model_dir), engine_cmd(model_dir)],
        )
        with pytest.raises(RuntimeError, match="boom"):
            async with launcher as urls:
                async with httpx.AsyncClient() as c:
                    for url in urls:
                        assert (await c.get(f"{url}/health_generate")).status_code == 200
                        info = (await c.get(f"{url}/server_info")).json()
                        pids.append(int(info["pid"]))
                raise RuntimeError("boom")

    asyncio.run(main())
    assert (tmp_path / "sglang-0.log").exists()
    assert len(pids) == 2
    assert not any(alive(p) for p in pids)


def test_a_server_that_dies_early_raises_with_its_log_tail(tmp_path: Path) -> None:
    bad = [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)", "--port", "1"]

    async def main() -> None:
        async with launch_sglang_servers("/nowhere", num_engines=1, log_dir=tmp_path, commands=[bad]):
            pytest.fail("must not yield")

    with pytest.raises(SGLangStartError, match="exited with code 3") as e:
        asyncio.run(main())
    assert "no such model" in str(e.value)


def test_cancellation_during_start_leaves_no_process(model_dir: Path, tmp_path: Path) -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)", "--port", "1"]
    procs: list[int] = []

    async def main() -> None:
        async def start() -> None:
            async with launch_sglang_servers("/m", num_engines=1, log_dir=tmp_path, commands=[sleeper]):
                pass

        task = asyncio.create_task(start())
        await asyncio.sleep(1.5)
        procs.extend(
            int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(int(p), "time.sleep(600)")
        )
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert procs
    assert all(not alive(p) for p in procs)


def test_vllm_servers_get_their_env_and_restart_one_engine(model_dir: Path, tmp_path: Path) -> None:
    """The vLLM kind: its RL routes switched on, the caller's KV-cache size kept, engine i on GPUs after
    the offset; `start(i)` brings a killed engine back on a fresh process, and exit takes both down."""
    pids: list[int] = []

    async def main() -> None:
        commands = [engine_cmd(model_dir), engine_cmd(model_dir)]
        async with vllm_servers(
            model_dir, gpu_offset=2, log_dir=tmp_path, commands=commands, env={"VLLM_CPU_KVCACHE_SPACE": "3"}
        ) as launcher:
            first, second = await launcher.start_all(2)
            envs = [_environ(s.pid) for s in (first, second)]
            assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2", "3"]
            assert all(e["VLLM_SERVER_DEV_MODE"] == "1" and e["VLLM_CPU_KVCACHE_SPACE"] == "3" for e in envs)
            os.killpg(second.pid, 9)
            assert await second.wait() != 0
            again = await launcher.start(1)
            async with httpx.AsyncClient() as c:
                assert (await c.get(f"{again.url}/health")).status_code == 200
            assert again.pid != second.pid
            pids.extend([first.pid, again.pid])

    asyncio.run(main())
    assert (tmp_path / "vllm-1.log").exists()
    assert not any(alive(p) for p in pids)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def _cmdline_has(pid: int, needle: str) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
