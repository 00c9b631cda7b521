"""Weight updates that fail or are cut short leave the engine serving its old weights, and lose nothing.

Disk updates: a corrupt shard, an index that is not JSON (or not an index), an index entry or a shard
symlink that leads out of `--weights-root` — each is a 400 naming the file, and generation afterwards is
unchanged. Distributed updates: a request whose client hangs up (the server cancels its handler) still
finishes its collective before another one may start, and a group whose rendezvous completes after its
request was cancelled is still registered (so it can be destroyed, not leaked).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from miles_aio.weight_broadcast import (
    broadcast_weights,
    destroy_process_group,
    init_custom_process_group,
)
from tests.engine.helpers import EngineProcess, Models, generate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

PROMPT = [5, 6, 7, 8, 9, 10]
BODY = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
INDEX = "model.safetensors.index.json"


@pytest.fixture(autouse=True)
def _serve_m1_again(client: httpx.Client, models: Models) -> Iterator[None]:
    """Each test starts from m1 whatever the one before did (a failing one may have loaded weights)."""
    yield
    resp = client.post(
        "/update_weights_from_disk", json={"model_path": str(models.m1), "weight_version": "default"}
    )
    assert resp.json()["success"], resp.text


def _checkpoint_copy(models: Models, name: str) -> Path:
    """A fresh copy of m2 (other weights than the served m1) under the weights root."""
    d = models.root / f"robust-{name}"
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(models.m2, d)
    return d


def _corrupt_shard(models: Models) -> Path:
    d = _checkpoint_copy(models, "corrupt")
    shard = d / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated mid-data
    return d


def _garbage_shard(models: Models) -> Path:
    d = _checkpoint_copy(models, "garbage")
    (d / "model.safetensors").write_bytes(b"\xff" * 64)  # a header length far beyond the file
    return d


def _index_not_json(models: Models) -> Path:
    d = _checkpoint_copy(models, "index-not-json")
    (d / INDEX).write_text('{"weight_map": {')
    return d


def _index_without_map(models: Models) -> Path:
    d = _checkpoint_copy(models, "index-no-map")
    (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": ["model.safetensors"]}))
    return d


def _index_traversal(models: Models) -> Path:
    d = _checkpoint_copy(models, "index-traversal")
    (d / "model.safetensors").unlink()
    (d / "placeholder.safetensors").write_bytes(b"")  # so the dir passes the "holds safetensors" check
    outside = os.path.relpath(models.outside / "model.safetensors", d)
    assert outside.startswith("..")
    (d / INDEX).write_text(json.dumps({"weight_map": {"model.norm.weight": outside}}))
    return d


def _shard_symlink_out(models: Models) -> Path:
    d = _checkpoint_copy(models, "shard-symlink")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(models.outside / "model.safetensors")
    return d


@pytest.mark.parametrize(
    ("make", "needles"),
    [
        pytest.param(_corrupt_shard, ["robust-corrupt", "model.safetensors"], id="truncated-shard"),
        pytest.param(_garbage_shard, ["robust-garbage", "model.safetensors"], id="garbage-shard"),
        pytest.param(_index_not_json, ["robust-index-not-json", INDEX], id="index-not-json"),
        pytest.param(_index_without_map, ["robust-index-no-map", INDEX, "weight_map"], id="index-no-map"),
        pytest.param(_index_traversal, ["outside", "--weights-root"], id="index-traversal"),
        pytest.param(_shard_symlink_out, ["outside", "--weights-root"], id="shard-symlink-out"),
    ],
)
def test_bad_checkpoint_files_are_refused_and_old_weights_kept(
    client: httpx.Client,
    api_types: ModuleType,
    models: Models,
    make: Callable[[Models], Path],
    needles: list[str],
) -> None:
    before = generate(client, api_types, BODY)
    path = make(models)
    resp = client.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": "bad"})
    assert resp.status_code == 400, resp.text
    data = resp.json()
    assert data["success"] is False
    for needle in needles:
        assert needle in data["message"], data["message"]
    after = generate(client, api_types, BODY)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]
    assert client.get("/model_info").json()["model_path"] == str(models.m1)


def test_a_valid_sharded_index_inside_the_root_still_loads(
    client: httpx.Client, api_types: ModuleType, models: Models
) -> None:
    d = _checkpoint_copy(models, "index-ok")
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    keys = load_file(str(d / "model-00001-of-00001.safetensors")).keys()
    (d / INDEX).write_text(
        json.dumps({"weight_map": dict.fromkeys(keys, "model-00001-of-00001.safetensors")})
    )
    before = generate(client, api_types, BODY)
    resp = client.post("/update_weights_from_disk", json={"model_path": str(d), "weight_version": "ok"})
    assert resp.status_code == 200, resp.text
    after = generate(client, api_types, BODY)
    assert after["meta_info"]["weight_version"] == "ok"
    assert after["output_ids"] != before["output_ids"]


# --- distributed updates cut short by a client timeout -------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _group_body(name: str, port: int) -> dict[str, Any]:
    return {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": name,
        "backend": "gloo",
    }


def _join_as_trainer(name: str, port: int) -> Any:
    return init_custom_process_group(
        backend="gloo", master_address="127.0.0.1", master_port=port, world_size=2, rank=0, group_name=name
    )


def test_group_joined_after_its_request_was_cancelled_is_registered(
    client: httpx.Client, engine: EngineProcess
) -> None:
    name, port = "cancelled_init_group", _free_port()
    # The client gives up while the engine waits for rank 0: the server cancels the handler.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{engine.url}/init_weights_update_group", json=_group_body(name, port), timeout=1.0)
    pg = _join_as_trainer(name, port)  # the engine's rendezvous thread completes now
    try:
        deadline = time.monotonic() + 15.0
        while not (resp := client.post("/destroy_weights_update_group", json={"group_name": name})).json()[
            "success"
        ]:
            assert time.monotonic() < deadline, f"the group was created but never registered: {resp.text}"
            time.sleep(0.1)
    finally:
        destroy_process_group(pg)


@pytest.fixture
def group(client: httpx.Client) -> Iterator[tuple[str, Any]]:
    name, port = "robust_group", _free_port()
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(
            client.post, "/init_weights_update_group", json=_group_body(name, port), timeout=60.0
        )
        pg = _join_as_trainer(name, port)
        assert joined.result().json()["success"]
    yield name, pg
    assert client.post("/destroy_weights_update_group", json={"group_name": name}).json()["success"]
    destroy_process_group(pg)


def test_cancelled_receive_keeps_the_group_busy_until_its_collective_is_done(
    client: httpx.Client,
    api_types: ModuleType,
    models: Models,
    engine: EngineProcess,
    group: tuple[str, Any],
) -> None:
    name, pg = group
    before = generate(client, api_types, BODY)
    norm = ("model.norm.weight", torch.full((128,), 3.0))
    first = {"names": [norm[0]], "dtypes": ["float32"], "shapes": [[128]], "group_name": name}
    # The trainer is late: the client gives up, the server cancels the handler mid-receive.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{engine.url}/update_weights_from_distributed", json=first, timeout=1.0)
    # A retry whose receive fails at once (a shape too large to allocate) shows when it got the group:
    # it must wait for the abandoned receive's collective, not start a second one beside it.
    probe = {"names": [norm[0]], "dtypes": ["float32"], "shapes": [[2**62, 4]], "group_name": name}
    with ThreadPoolExecutor(1) as pool:
        retry = pool.submit(client.post, "/update_weights_from_distributed", json=probe, timeout=60.0)
        time.sleep(1.5)
        assert not retry.done(), (
            f"a second collective started while the first was running: {retry.result().text}"
        )
        broadcast_weights([norm], group=pg)  # the abandoned receive's broadcast completes
        resp = retry.result()
    assert resp.status_code == 400
    assert "Failed to receive weights" in resp.json()["message"]
    # The abandoned update was received but never applied (its request was cancelled); the group still works.
    after = generate(client, api_types, BODY)
    assert after["output_ids"] == before["output_ids"]
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.post, "/update_weights_from_distributed", json=first, timeout=60.0)
        broadcast_weights([norm], group=pg)
        assert answer.result().json()["success"], answer.result().text
    got = client.post("/get_weights_by_name", json={"name": norm[0], "truncate_size": 2}).json()
    assert got == [3.0, 3.0]
