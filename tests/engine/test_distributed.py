"""`/init_weights_update_group` + `/update_weights_from_distributed` over a real gloo group.

This test process is the trainer's rank 0: it hosts the rendezvous, the engine joins as rank 1 (SGLang's
`rank_offset`), and each tensor is one `broadcast(src=0)`, in the order of the request's `names`.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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
from tests.engine.helpers import Models, generate, logprobs, reference_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

GROUP = "test_weight_update_group"
PROMPT = [5, 6, 7, 8, 9, 10]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def group(client: httpx.Client) -> Iterator[Any]:
    """Rank 0 of a 2-rank gloo group whose rank 1 is the engine."""
    port = _free_port()
    body = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": GROUP,
        "backend": "gloo",
    }
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.post, "/init_weights_update_group", json=body, timeout=60.0)
        pg = init_custom_process_group(
            backend="gloo",
            master_address="127.0.0.1",
            master_port=port,
            world_size=2,
            rank=0,
            group_name=GROUP,
        )
        assert joined.result().json() == {
            "success": True,
            "message": "Succeeded to initialize custom process group.",
        }
    yield pg
    assert client.post("/destroy_weights_update_group", json={"group_name": GROUP}).json()["success"]
    destroy_process_group(pg)


def _push(
    client: httpx.Client, pg: Any, named: list[tuple[str, torch.Tensor]], **extra: Any
) -> httpx.Response:
    """What a trainer does: POST the metadata and broadcast the tensors, concurrently."""
    body = {
        "names": [n for n, _ in named],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
        "group_name": GROUP,
        **extra,
    }
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.post, "/update_weights_from_distributed", json=body, timeout=60.0)
        broadcast_weights(named, group=pg)
        return answer.result()


def test_the_group_listens_on_loopback_only(group: Any, engine: Any) -> None:
    """A loopback master address keeps the weight-update group off the network: the store this rank
    hosts and every gloo socket of both ranks listen on loopback (torch's own store would listen on
    every interface, and it takes unauthenticated writes)."""
    import ipaddress
    import os

    from tests.core.test_exposure import listening_sockets

    for pid in (os.getpid(), engine.pid):
        sockets = listening_sockets(pid)
        exposed = {s for s in sockets if not ipaddress.ip_address(s[0]).is_loopback}
        assert not exposed, f"pid {pid} listens off loopback: {sorted(exposed)}"
    assert listening_sockets(os.getpid()), "rank 0 hosts the group's store: it must listen somewhere"


def test_broadcast_update_swaps_weights_and_version(
    client: httpx.Client, api_types: ModuleType, models: Models, group: Any
) -> None:
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0.0},
    }
    before = generate(client, api_types, body)
    m2 = sorted(load_file(str(models.m2 / "model.safetensors")).items())
    # A bf16 tensor on the wire is cast into the float32 engine, as SGLang does (norm weights are all 1.0:
    # exact in bf16). Half the tensors per call, as a bucketed trainer would send them.
    m2 = [(n, t.bfloat16() if n.endswith("norm.weight") else t) for n, t in m2]
    first, second = m2[: len(m2) // 2], m2[len(m2) // 2 :]
    assert _push(client, group, first, flush_cache=True).json()["success"]
    resp = _push(client, group, second, weight_version="42")
    assert resp.json() == {
        "success": True,
        "message": "Succeeded to update parameter online. Weight version updated to 42.",
    }

    after = generate(client, api_types, body)
    assert after["meta_info"]["weight_version"] == "42"
    assert logprobs(after) == pytest.approx(
        reference_logprobs(models.m2, PROMPT, after["output_ids"]), abs=1e-4
    )
    assert logprobs(after) != pytest.approx(logprobs(before), abs=1e-4)
    name = "model.layers.0.self_attn.q_proj.weight"
    row = client.post("/get_weights_by_name", json={"name": name, "truncate_size": 1}).json()
    assert row[0] == pytest.approx(dict(m2)[name][0].tolist())


def test_bad_broadcast_is_received_then_refused_whole(
    client: httpx.Client, api_types: ModuleType, models: Models, group: Any
) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
    before = generate(client, api_types, body)
    good = ("model.norm.weight", torch.full((128,), 3.0))
    for bad in [
        ("model.embed_tokens.weight", torch.zeros(3, 3)),  # shape mismatch
        ("model.no_such.weight", torch.zeros(4)),  # unknown name
        ("model.layers.0.input_layernorm.weight", torch.zeros(128, dtype=torch.int64)),  # dtype mismatch
    ]:
        # The trainer's broadcast completes (the engine receives first), then the update is refused whole:
        # the good tensor in the same call is not applied either.
        resp = _push(client, group, [good, bad])
        assert resp.status_code == 400
        assert resp.json()["success"] is False
    after = generate(client, api_types, body)
    assert after["output_ids"] == before["output_ids"]
    norm = client.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 2})
    assert norm.json() == [1.0, 1.0]
