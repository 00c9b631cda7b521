"""The controller ↔ rank channel: handshake, framing, and strangers rejected before any decoding."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch

from miles_aio.trainer import channel, protocol
from miles_aio.trainer.channel import AsyncChannel, ChannelListener
from tests.trainer.helpers import run

pytestmark = pytest.mark.timeout(30)
SECRET = b"s" * 32


@asynccontextmanager
async def serving(
    secret: bytes = SECRET, timeout_s: float = 2.0
) -> AsyncIterator[tuple[ChannelListener, asyncio.Queue[AsyncChannel]]]:
    listener = ChannelListener(secret, handshake_timeout_s=timeout_s)
    got: asyncio.Queue[AsyncChannel] = asyncio.Queue()
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(listener.serve(got.put_nowait))
        try:
            yield listener, got
        finally:
            task.cancel()
            listener.close()


def test_round_trip_of_headers_and_tensors() -> None:
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).bfloat16(),
        "i64": torch.arange(11),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }

    async def main() -> None:
        async with serving() as (listener, got):
            host, port = listener.address

            def rank_side() -> protocol.Message:
                chan = channel.connect(host, port, secret=SECRET, rank=3)
                msg = chan.recv()
                chan.send({"op": "ok", "echo": msg.header}, msg.tensors)
                chan.close()
                return msg

            rank = asyncio.create_task(asyncio.to_thread(rank_side))
            chan = await got.get()
            assert chan.rank == 3
            await chan.send({"op": "train", "num_tokens": [1.5, 2.0]}, tensors)
            reply = await chan.recv()
            assert reply.op == "ok" and reply.header["echo"] == {"op": "train", "num_tokens": [1.5, 2.0]}
            for name, t in tensors.items():
                assert reply.tensors[name].dtype == t.dtype and torch.equal(reply.tensors[name], t), name
            assert (await rank).op == "train"
            with pytest.raises(ConnectionError):
                await chan.recv()
            await chan.aclose()
            assert listener.rejected == 0

    run(main())


def _forbid_decoding(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record any attempt to parse a frame (there must be none from an unauthenticated peer)."""
    calls: list[str] = []

    def forbidden(name: str) -> Callable[..., Any]:
        def f(*a: Any, **k: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} called for an unauthenticated peer")

        return f

    for name in ("decode_frame", "parse_frame_prefix", "decode_batch"):
        monkeypatch.setattr(protocol, name, forbidden(name))
    return calls


def test_wrong_secret_is_rejected_without_deserialising(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _forbid_decoding(monkeypatch)

    async def main() -> None:
        async with serving() as (listener, got):
            host, port = listener.address
            with pytest.raises((ConnectionError, OSError)):
                await asyncio.to_thread(channel.connect, host, port, secret=b"x" * 32, rank=0)

            # A peer that skips the handshake and sends a frame straight away: dropped unread.
            def raw_frame() -> None:
                with socket.create_connection((host, port)) as s:
                    s.recv(protocol.HELLO_LEN)
                    head = b'{"op": "init"}'
                    s.sendall(struct.pack("!IQ", len(head), 0) + head + b"\0" * (protocol.RESPONSE_LEN))
                    assert s.recv(1) == b""  # closed by the controller, no proof sent

            await asyncio.to_thread(raw_frame)
            assert listener.rejected == 2
            assert got.empty()

    run(main())
    assert calls == []


def test_silent_peer_times_out_and_listener_keeps_serving() -> None:
    async def main() -> None:
        async with serving(timeout_s=0.3) as (listener, got):
            host, port = listener.address
            idle = socket.create_connection((host, port))  # never answers the hello
            try:
                chan = await asyncio.to_thread(channel.connect, host, port, secret=SECRET, rank=1)
                accepted = await got.get()
                assert accepted.rank == 1
                chan.close()
                await accepted.aclose()
                await asyncio.sleep(0.5)
                assert listener.rejected == 1
            finally:
                idle.close()

    run(main())


def test_rank_refuses_an_impostor_controller() -> None:
    """A controller that does not hold the secret cannot command a rank."""

    async def main() -> None:
        async with serving(secret=b"o" * 32) as (listener, _):
            host, port = listener.address
            with pytest.raises((protocol.ProtocolError, ConnectionError)):
                await asyncio.to_thread(channel.connect, host, port, secret=SECRET, rank=0)

    run(main())


def test_handshake_primitives() -> None:
    nonce, hello = protocol.hello()
    cn, response = protocol.rank_response(SECRET, hello, 5)
    assert protocol.check_response(SECRET, nonce, response) == (5, cn)
    tampered = response[:32] + struct.pack("!I", 0) + response[36:]  # claim to be another rank
    with pytest.raises(protocol.ProtocolError, match="MAC"):
        protocol.check_response(SECRET, nonce, tampered)
    with pytest.raises(protocol.ProtocolError):
        protocol.rank_response(SECRET, b"HTTP/1.1 200 OK\r\n" + b"x" * 20, 0)
    with pytest.raises(protocol.ProtocolError, match="too large"):
        protocol.parse_frame_prefix(struct.pack("!IQ", protocol.MAX_HEADER_BYTES + 1, 0))
    assert protocol.secret_from_env({protocol.SECRET_ENV: SECRET.hex()}) == SECRET
    assert protocol.secret_from_env({}) is None


def test_corrupt_tensor_table_is_a_protocol_error() -> None:
    frame = protocol.encode_frame({"op": "x"}, {"t": torch.ones(4)})
    head = bytes(frame[1]).replace(b"[4]", b"[400]")
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_frame(head, bytearray(b"".join(bytes(c) for c in frame[2:])))


def test_stopping_the_listener_closes_handshakes_in_progress() -> None:
    """A connection still in its handshake when the listener stops is closed (not left open until its
    timeout), and the cancellation is not swallowed: the serve task ends."""

    async def main() -> None:
        listener = ChannelListener(SECRET, handshake_timeout_s=60.0)
        host, port = listener.address
        peer = socket.create_connection((host, port))
        try:
            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(listener.serve(lambda chan: None))
                hello = await asyncio.to_thread(peer.recv, protocol.HELLO_LEN)
                assert len(hello) == protocol.HELLO_LEN  # the handshake is under way
                task.cancel()
            assert task.cancelled()
            peer.settimeout(5.0)
            assert await asyncio.to_thread(peer.recv, 1) == b""  # closed by the controller, at once
        finally:
            peer.close()
            listener.close()

    run(main())
