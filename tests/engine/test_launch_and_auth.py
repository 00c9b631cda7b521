"""`--api-key` (required off loopback, enforced on every route but /health*) and `launch_local_engines`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from miles_aio.inference.local_launch import EngineStartError, launch_local_engines
from tests.engine.helpers import EngineProcess, Models

pytestmark = [pytest.mark.slow]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _engine_children() -> list[int]:
    """Pids of engine processes whose parent is this test process (read from /proc, Linux)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"miles_aio.engine" in cmdline:
            pids.append(int(entry.name))
    return pids


@pytest.mark.timeout(30)
def test_non_loopback_host_requires_an_api_key(models: Models) -> None:
    started = time.monotonic()
    cmd = [
        sys.executable,
        "-m",
        "miles_aio.engine",
        "--model-path",
        str(models.m1),
        "--host",
        "0.0.0.0",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 2
    assert "--api-key" in proc.stderr
    assert "not a loopback address" in proc.stderr
    assert proc.stdout == ""  # no ready line
    assert time.monotonic() - started < 15  # refused before loading anything


@pytest.mark.timeout(60)
def test_api_key_is_enforced(models: Models, tmp_path: Path) -> None:
    engine = EngineProcess(models.m1, "--host", "0.0.0.0", "--api-key", "s3cret", log_dir=tmp_path)
    url = f"http://127.0.0.1:{engine.url.rsplit(':', 1)[1]}"
    try:
        assert httpx.get(f"{url}/health").status_code == 200  # probes stay open, as in SGLang
        assert httpx.get(f"{url}/health_generate").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            resp = httpx.get(f"{url}/model_info", headers=headers)
            assert resp.status_code == 401
            assert resp.json() == {"error": "Unauthorized"}
            gen = httpx.post(
                f"{url}/generate",
                json={"input_ids": [5], "sampling_params": {"max_new_tokens": 1}},
                headers=headers,
            )
            assert gen.status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{url}/model_info", headers=ok).status_code == 200
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(f"{url}/generate", json=body, headers=ok).status_code == 200
    finally:
        assert engine.stop() == 0, engine.stderr()


@pytest.mark.timeout(60)
def test_launcher_yields_urls_and_kills_children_on_exception(models: Models) -> None:
    pids: list[int] = []

    async def main() -> None:
        async with launch_local_engines(models.m1, num_engines=2, weights_root=models.root) as urls:
            assert len(set(urls)) == 2
            async with httpx.AsyncClient() as client:
                for url in urls:
                    info = (await client.get(f"{url}/server_info")).json()
                    pids.append(info["pid"])
                    assert info["weights_root"] == str(models.root.resolve())
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):  # the body's own exception, not a wrapper
        asyncio.run(main())
    assert len(pids) == 2
    assert not any(_alive(pid) for pid in pids)
    assert _engine_children() == []


@pytest.mark.timeout(60)
def test_launcher_cleans_up_when_cancelled_before_and_after_ready(models: Models) -> None:
    async def cancel_after(delay_s: float, ready: asyncio.Event | None) -> None:
        async def run() -> None:
            async with launch_local_engines(models.m1, num_engines=1):
                if ready is not None:
                    ready.set()
                await asyncio.sleep(3600)

        task = asyncio.create_task(run())
        if ready is not None:
            await ready.wait()
        await asyncio.sleep(delay_s)
        assert _engine_children(), "the engine should be running at this point"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_after(0.2, ready=None))  # still starting up (loading torch)
    assert _engine_children() == []
    asyncio.run(cancel_after(0.0, ready=asyncio.Event()))  # serving
    assert _engine_children() == []


@pytest.mark.timeout(30)
def test_launcher_reports_a_child_that_dies_before_ready(tmp_path: Path, models: Models) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((models.m1 / "config.json").read_text())  # no weights

    async def main() -> None:
        async with launch_local_engines(broken, num_engines=1):
            pytest.fail("a model without weights must not become ready")

    with pytest.raises(EngineStartError, match=r"exited with code 1 before it was ready(.|\n)*safetensors"):
        asyncio.run(main())
    assert _engine_children() == []


@pytest.mark.timeout(60)
def test_engine_exits_when_its_launcher_goes_away(models: Models, tmp_path: Path) -> None:
    """With --exit-on-stdin-eof (the launcher's flag), a closed stdin pipe means the parent died."""
    cmd = [
        sys.executable,
        "-m",
        "miles_aio.engine",
        "--model-path",
        str(models.m1),
        "--port",
        "0",
        "--exit-on-stdin-eof",
    ]
    with open(tmp_path / "stderr.log", "wb") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
    try:
        assert proc.stdout is not None
        assert b'"ready"' in proc.stdout.readline()
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=20) == 0
        assert "stdin_closed" in (tmp_path / "stderr.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
