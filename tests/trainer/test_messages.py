"""The typed controller ↔ rank seam: one msgspec Struct per command and per reply, type-checked on decode;
the engines' broadcast side (`InferenceEngine.weight_broadcast()`); no import cycle inside the trainer."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Any, get_args

import msgspec
import pytest
import torch

import miles_aio.trainer
from miles_aio.errors import ConfigError
from miles_aio.inference.base import SingleServerBroadcast, WeightBroadcast
from miles_aio.testing import FakeLatencyEngine
from miles_aio.trainer import protocol
from miles_aio.trainer.actor import TrainerActor
from miles_aio.trainer.channel import ChannelListener
from miles_aio.trainer.config import TrainConfig
from miles_aio.trainer.protocol import Message, ProtocolError


def _over_the_wire(msg: protocol.Wire) -> Message:
    """`msg` encoded into a frame's bytes and decoded back (what the other end of the channel sees)."""
    prefix, head, *chunks = protocol.encode_frame(*protocol.to_wire(msg))
    head_len, blob_len = protocol.parse_frame_prefix(bytes(prefix))
    blob = bytearray(b"".join(bytes(c) for c in chunks))
    assert (head_len, blob_len) == (len(head), len(blob))
    return protocol.decode_frame(bytes(head), blob)


BATCH = {"tokens": torch.arange(6), "lengths": torch.tensor([6]), "rollout_logp": torch.randn(3)}
REQUESTS: list[protocol.AnyRequest] = [
    protocol.InitRequest(config='{"lr": 1e-3}'),
    protocol.TrainRequest(step=3, num_tokens=[12.0, 7.5], batch=BATCH),
    protocol.LogprobsRequest(batch=BATCH),
    protocol.GetWeightsRequest(),
    protocol.WeightMetaRequest(),
    protocol.WeightMetaRequest(master_address="10.0.0.2"),
    protocol.SaveHFRequest(path="/w/v1", keep=2),
    protocol.BcastInitRequest(
        backend="gloo", master_address="h", master_port=1, world_size=3, group_name="g", timeout_s=5.0
    ),
    protocol.BcastInitRequest(
        backend="nccl",
        master_address="h",
        master_port=1,
        world_size=3,
        group_name="g",
        timeout_s=5.0,
        protocol="vllm",
    ),
    protocol.BcastBucketRequest(names=["a", "b"]),
    protocol.BcastDestroyRequest(),
    protocol.SaveRequest(step=4, directory="/c/step_4"),
    protocol.LoadRequest(directory="/c/step_4"),
    protocol.RemoveHFRequest(paths=["/e/1", "/e/2"]),
    protocol.ShutdownRequest(),
]


def _same(a: msgspec.Struct, b: msgspec.Struct) -> bool:
    if type(a) is not type(b):
        return False
    for f in msgspec.structs.fields(type(a)):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.type == protocol.Tensors:
            if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
                return False
        elif x != y:
            return False
    return True


def test_every_command_is_covered_and_names_its_reply() -> None:
    commands = get_args(protocol.AnyRequest)
    assert {type(r) for r in REQUESTS} == set(commands)
    tags = [c.__struct_config__.tag for c in commands]
    assert len(set(tags)) == len(tags)
    assert protocol.TrainRequest.reply_type is protocol.TrainReply
    assert protocol.ShutdownRequest.reply_type is protocol.Reply
    for c in commands:
        assert issubclass(c.reply_type, protocol.Reply), c


@pytest.mark.parametrize("req", REQUESTS, ids=lambda r: type(r).__name__)
def test_requests_round_trip_through_a_frame(req: protocol.AnyRequest) -> None:
    msg = _over_the_wire(req)
    assert msg.op == req.op == type(req).__struct_config__.tag
    assert "batch" not in msg.header  # tensors travel in the blob, not the JSON header
    assert _same(protocol.decode_request(msg), req)


def test_replies_decode_as_the_type_their_request_names() -> None:
    metrics = protocol.TrainReply(metrics={"train/loss": 0.5})
    got = REQUESTS[1].decode_reply(_over_the_wire(metrics))
    assert isinstance(got, protocol.TrainReply) and got.metrics == {"train/loss": 0.5}
    weights = protocol.WeightsReply(weights={"w": torch.ones(2, 3)})
    assert torch.equal(
        protocol.GetWeightsRequest().decode_reply(_over_the_wire(weights)).weights["w"], weights.weights["w"]
    )
    assert (
        protocol.BcastBucketRequest(names=[]).decode_reply(_over_the_wire(protocol.BcastReply())).failed
        is None
    )
    with pytest.raises(ProtocolError, match="TrainReply"):  # another command's reply
        protocol.TrainRequest(step=0, num_tokens=[], batch={}).decode_reply(
            _over_the_wire(protocol.LoadReply(step=1))
        )
    with pytest.raises(ProtocolError):  # not a reply at all
        protocol.GetWeightsRequest().decode_reply(Message({"op": "heartbeat"}))
    failure = protocol.decode_as(
        _over_the_wire(protocol.RankFailure(type="E", message="m", traceback="t")), protocol.RankFailure
    )
    assert (failure.type, failure.message, failure.traceback) == ("E", "m", "t")
    assert _over_the_wire(protocol.Heartbeat()).header == {"op": "heartbeat"}


@pytest.mark.parametrize(
    ("header", "tensors", "match"),
    [
        ({"op": "nope"}, {}, "unknown command"),
        ({}, {}, "unknown command"),
        ({"op": "train", "step": "3", "num_tokens": [1.0]}, {}, "step"),
        ({"op": "train", "step": 3}, {}, "num_tokens"),
        ({"op": "save", "step": 1, "directory": "/d", "extra": 1}, {}, "extra"),
        ({"op": "bcast_bucket", "names": "a"}, {}, "names"),
        ({"op": "save", "step": 1, "directory": "/d"}, {"t": torch.ones(1)}, "no tensors"),
    ],
)
def test_malformed_commands_are_protocol_errors(
    header: dict[str, Any], tensors: dict[str, torch.Tensor], match: str
) -> None:
    with pytest.raises(ProtocolError, match=match):
        protocol.decode_request(Message(header, tensors))


# -- the engines' side of a broadcast ------------------------------------------------------------------
def test_single_server_broadcast_forwards_to_its_server() -> None:
    async def main() -> list[str]:
        server = FakeLatencyEngine(lambda rng: 0.01)
        target = server.weight_broadcast()
        assert isinstance(target, SingleServerBroadcast) and target.push_clients() == (server,)
        assert len(target.membership_key()) == len(target.push_clients())
        await target.init_weights_update_group(
            master_address="h", master_port=1, rank_offsets=[1], world_size=2, group_name="g", backend="gloo"
        )
        await target.update_weights_from_distributed(
            names=["w"], dtypes=["float32"], shapes=[[1]], group_name="g"
        )
        await target.destroy_weights_update_group("g", clients=[])  # not named: stays
        await target.destroy_weights_update_group("g", clients=[server])
        with pytest.raises(ValueError, match="rank_offsets"):
            await target.init_weights_update_group(
                master_address="h", master_port=1, rank_offsets=[1, 2], world_size=3
            )
        return server.calls

    assert asyncio.run(main()) == ["group:g:1/2", "broadcast:g", "destroy:g"]


class _DiskOnly(FakeLatencyEngine):
    # An engine with no broadcast side, as `InferenceEngine.weight_broadcast` allows; the fake it builds on
    # narrows the return type to always having one.
    def weight_broadcast(self) -> WeightBroadcast | None:  # type: ignore[override]
        return None


def test_broadcast_to_an_engine_without_one_is_a_config_error(tmp_path: Path) -> None:
    async def main() -> None:
        listener = ChannelListener(b"s" * 32)
        try:
            actor = TrainerActor(
                TrainConfig(update_weight_transfer_mode="broadcast"),
                run_dir=tmp_path,
                listener=listener,
                spawn=False,
            )
            engine = _DiskOnly(lambda rng: 0.01)
            assert engine.weight_broadcast() is None
            with pytest.raises(ConfigError, match="--update-weight-transfer-mode"):
                await actor.sync_weights(engine, version=1)
        finally:
            listener.close()

    asyncio.run(main())


# -- module structure -----------------------------------------------------------------------------------
def test_the_trainer_package_has_no_import_cycle() -> None:
    """Among miles_aio.trainer's modules (TYPE_CHECKING imports included): megatron_backend imports
    megatron_pp, never the other way round."""
    root = Path(miles_aio.trainer.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.glob("*.py"):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            deps |= {
                n.removeprefix("miles_aio.trainer.") for n in names if n.startswith("miles_aio.trainer.")
            }
        graph[path.stem] = {d for d in deps if (root / f"{d}.py").exists()} - {path.stem}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for d in graph[start] - seen:
            seen.add(d)
            if d == goal or reaches(d, goal, seen):
                return True
        return False

    assert "megatron_pp" in graph["megatron_backend"]
    cyclic = sorted(m for m in graph if reaches(m, m, set()))
    assert not cyclic, cyclic
